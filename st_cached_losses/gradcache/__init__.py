"""GradCache (arXiv 2101.06983) as the losses share it, on sentence-transformers' ``CachedLossMixin``:

- ``steps.py``: the three steps: step (1) embeds every mini-batch without gradients
  (``GradCacheSteps.embed_minibatch``), step (2) is the loss's, ``backward.py`` is step (3) (re-embedding with
  gradients in the loss's backward);
- ``parallel.py``, ``agreement.py``, ``zero.py``: DDP, FSDP2 and DeepSpeed ZeRO: one plan for every rank, gradient
  synchronisation in step (3), ZeRO-2/3's coalesced reduction;
- ``minibatches.py``: rows in length order, each mini-batch without the padding all its rows share;
- ``activation_budget.py`` / ``activation_memory.py``: which mini-batches keep step (1)'s graph (no second
  forward), measured and predicted activation bytes (per modality: text, images), ``mini_batch_size="auto"``;
- ``distributed.py``: equal rows per rank for ``gather_across_devices``, DDP's gradient sync;
- ``compiled.py``: mini-batches a ``torch.compile``'d model compiles few graphs for (contiguous, shapes dynamic);
- ``precision.py``: the autocast the encoder ran under; ``dims.py``: the Matryoshka dims of a model;
- ``layers.py``: a model's transformer layers (2D Matryoshka); ``loss_components.py``: the per-dim dict the
  trainer logs; ``defaults.py``: defaults shared with the command line;
- ``_st_compat.py``: the one door to sentence-transformers' internals.

Step (2), the loss, is each loss's ``calculate_loss`` (:mod:`st_cached_losses.losses`) calling
:func:`st_cached_losses.matryoshka_infonce` (:mod:`st_cached_losses.ops`).
"""
