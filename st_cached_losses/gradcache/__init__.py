"""GradCache (arXiv 2101.06983) as the losses share it, on sentence-transformers' ``CachedLossMixin``:

- ``steps.py``: the engine, :class:`~.steps.GradCacheSteps`: step (1) embeds every mini-batch without gradients
  (``embed_minibatch``), step (2) is the loss's ``calculate_loss``; ``backward.py``: step (3), sentence-transformers'
  own backward hook re-embedding each mini-batch with gradients; ``step.py``: one forward's state (``Step``);
- ``parallel.py``, ``agreement.py``, ``zero.py``, ``distributed.py``: DDP, FSDP2 and DeepSpeed ZeRO (one plan for
  every rank, gradient synchronisation in step (3), ZeRO-2/3's coalesced reduction, equal rows per rank);
- ``minibatches.py``: rows in length order, each mini-batch without the padding all its rows share;
  ``compiled.py``: mini-batches a ``torch.compile``'d model compiles few graphs for;
- ``activation_budget.py`` → ``kept_minibatches.py`` → ``activation_memory.py``: the activation budget (which
  mini-batches keep step (1)'s graph, their held bytes; measured and predicted activation bytes per modality) and
  ``mini_batch_size="auto"``;
- ``memory_bank.py`` / ``memory_inputs.py``: the cross-batch memory bank and a step's op inputs with it;
- ``guide_model.py``: a GISTEmbed guide model embedding step (1)'s mini-batches; ``text_ids.py``: text ids for the
  duplicate mask; ``precision.py``: the autocast the encoder ran under;
- ``dims.py``: the Matryoshka dims of a model; ``layers.py``: a model's transformer layers (2D Matryoshka);
  ``loss_components.py``: the per-dim dict the trainer logs; ``defaults.py``: defaults shared with the command line;
- the doors to other libraries' internals, each with its tested range: ``_st_compat.py`` (sentence-transformers),
  ``_deepspeed_compat.py`` (DeepSpeed), ``_fsdp_compat.py`` (FSDP2's private state).

Step (2), the loss, is each loss's ``calculate_loss`` (:mod:`st_cached_losses.losses`) calling
:func:`st_cached_losses.matryoshka_infonce` (:mod:`st_cached_losses.ops`).
"""
