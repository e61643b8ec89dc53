"""CachedMatryoshka2dLoss: GradCache for 2D Matryoshka (layers x dims).

Stock ``Matryoshka2dLoss`` / ``AdaptiveLayerLoss`` train every layer of the encoder to embed well, but refuse cached
base losses, so their batch is the one whose activations fit in memory. GradCache extends to several outputs per
mini-batch: step (1) keeps each drawn layer's pooled embedding side by side, (2) computes the loss of every layer (one
:func:`~st_cached_losses.matryoshka_infonce` call per layer, for all its dims) and caches the gradient of all of them,
(3) re-embeds each mini-batch once and back-propagates all layers in one backward. The layers a step draws travel in
its :class:`~st_cached_losses.gradcache.step.Step`. ``CachedAdaptiveLayerLoss`` (:mod:`.cached_adaptive_layer`) is
this loss at the model's one full dim.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any, Literal

import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.sentence_transformer.model import SentenceTransformer
from torch import Tensor

from ..gradcache import _st_compat
from ..gradcache.layers import base_model, num_hidden_layers
from ..gradcache.step import Encoded, LayerDraw, Step
from ..ops import matryoshka_infonce
from . import card, citations
from .base_losses import MNRL_LOSSES, check_base_loss
from .cached_loss import integer, naming_errors
from .cached_matryoshka import CachedMatryoshkaLoss
from .options import given_options

SUPPORTED_LOSSES = MNRL_LOSSES  # (Cached)MultipleNegativesRankingLoss, as stock's layer-wise losses take
LAYER_WEIGHTINGS = ("uniform", "log", "linear")
# The 2D losses' own options, in their signatures' order (the loss's attributes of the same names; its card's entries).
LAYER_OPTIONS = (
    "n_layers_per_step",
    "last_layer_weight",
    "prior_layers_weight",
    "kl_div_weight",
    "kl_temperature",
    "layer_weighting",
)


@card.public_class
class CachedMatryoshka2dLoss(CachedMatryoshkaLoss):
    def __init__(
        self,
        model: SentenceTransformer,
        loss: MultipleNegativesRankingLoss | CachedMultipleNegativesRankingLoss,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | Sequence[int] | None = None,
        n_layers_per_step: int = 1,
        n_dims_per_step: int = 1,
        last_layer_weight: float = 1.0,
        prior_layers_weight: float = 1.0,
        kl_div_weight: float = 1.0,
        kl_temperature: float = 0.3,
        layer_weighting: Literal["uniform", "log", "linear"] | Callable[[int], float] = "uniform",
        *,
        mini_batch_size: int | str | None = None,
        mini_batch_num_tokens: int | None = None,
        sort_by_length: bool = True,
        backend: str = "auto",
        precision: str = "auto",
        show_progress_bar: bool = False,
        false_negative_margin: float | None = None,
        false_negative_strategy: str = "absolute",
        activation_budget: int | str | None = None,
        fsdp_sync: str = "per_backward",
        mask_duplicates: bool = False,
        memory_size: int = 0,
        memory_warmup_steps: int = 0,
        memory_max_age: int | None = None,
        dual_memory: bool = False,
        in_batch_negatives: bool = True,
    ) -> None:
        """
        Stock ``Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), dims, ...)`` (2D Matryoshka: every
        layer of the encoder and every Matryoshka dim embeds well) with GradCache, so that the batch size is bounded by
        time rather than memory: the same loss value and parameter gradients as the stock loss (which refuses cached
        base losses; with dropout, as stock's only with ``sort_by_length=False``: see :class:`CachedMatryoshkaLoss`),
        with the memory of one mini-batch's activations. Step (1) runs the transformer once per
        mini-batch with hidden states and keeps the pooled embeddings of the final layer and each drawn prior layer
        side by side; step (2) calls :func:`~st_cached_losses.matryoshka_infonce` once per layer, for all its dims,
        plus stock's KL term; step (3) re-embeds each mini-batch once and back-propagates all its layers together.

        Layers are numbered as stock's hidden states: 0 is the embedding layer's output, ``l`` the output of the first
        ``l`` transformer layers (what :func:`~st_cached_losses.truncate_layers` keeps), the final layer is the
        model's number of layers L. The loss is stock's::

            last_layer_weight * sum_d w_d InfoNCE_d(final layer)
            + sum_l [prior_layers_weight * layer_weight(l) / n_l * sum_d w_d InfoNCE_d(layer l)
                     + kl_div_weight * kl_temperature * KL(softmax(final / T) || softmax(layer l / T))]

        ``forward`` returns ``{"loss_layer_<l>_dim_<d>": ..., "loss_layer_<l>_kl": ...}`` (0-dim tensors weighted as
        above; layers from the final one down; 0 for what was not drawn this step): the trainer logs each and
        back-propagates their sum, the loss. Memory and time: ``docs/benchmarks.md`` (2D Matryoshka).

        Args:
            model: SentenceTransformer whose first module is a ``Transformer`` (hidden states come from it).
            loss: a MultipleNegativesRankingLoss or CachedMultipleNegativesRankingLoss holding the InfoNCE
                hyperparameters, as for :class:`CachedMatryoshkaLoss`; it is not called itself.
            matryoshka_dims: embedding dims to train, each in [1, model embedding dim], no duplicates.
            matryoshka_weights: one weight per dim (default 1 each).
            n_layers_per_step: prior layers per step, drawn with ``random.sample`` as stock does; -1 for all.
            n_dims_per_step: dims per layer and step (a positive int; the number of dims or more: all), drawn as
                stock's MatryoshkaLoss; -1 for all (a seed draws stock's layers and dims).
            last_layer_weight: weight of the final layer's loss.
            prior_layers_weight: weight of the prior layers' losses (averaged over the drawn layers).
            kl_div_weight: weight of the KL term.
            kl_temperature: temperature T of the KL term, >= 0; 0 turns it off.
            layer_weighting: weight of prior layer ``l``: "uniform" (1), "log" (``1 / (1 + ln(1 + l))``),
                "linear" (``1 / (1 + l)``) or a callable ``l -> float``, as stock's AdaptiveLayerLoss.
            mini_batch_size, mini_batch_num_tokens, sort_by_length, backend, precision, show_progress_bar,
                activation_budget, fsdp_sync, mask_duplicates, in_batch_negatives: as in :class:`CachedMatryoshkaLoss`
                (a kept mini-batch keeps every layer's graph; the duplicate mask and in-batch negatives off apply to
                every layer's softmax). Absent hard negatives (presence masks) are left out of the KL term too (its
                mean over the embeddings present).
            false_negative_margin, false_negative_strategy: refused (None and "absolute" only): which layer would
                guide the self-guided filter is not defined by stock or the filter's recipe; filter with
                :class:`CachedMatryoshkaLoss`.
            memory_size, memory_warmup_steps, memory_max_age, dual_memory: refused (0, 0, None, False only): a bank
                would hold one embedding per text while this loss scores every layer's; a bank of each drawn layer
                grows with the layers and goes stale at the rate of each. Use :class:`CachedMatryoshkaLoss`.

        Raises:
            TypeError: ``loss`` of another type, or an option of the wrong type.
            ValueError: a model without a ``Transformer`` first module (e.g. a StaticEmbedding) or without
                ``num_hidden_layers`` in its config, bad dims or weights, a negative or non-finite
                ``kl_temperature``, ``n_*_per_step`` not -1 or positive, an unknown ``layer_weighting``, a
                ``false_negative_margin``, and what :class:`CachedMatryoshkaLoss` refuses; during a step, a
                ``layer_weighting`` callable that returns no finite number, or a model that returns another number of
                hidden states than its config says.

        References:
            - 2D Matryoshka Sentence Embeddings (2DMSE): https://arxiv.org/abs/2402.14776
            - Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup (GradCache):
              https://arxiv.org/abs/2101.06983
            - Matryoshka Representation Learning: https://arxiv.org/abs/2205.13147

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (anchor, positive) pairs                        | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative) triplets           | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
                from st_cached_losses import CachedMatryoshka2dLoss, truncate_layers

                model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)
                loss = CachedMatryoshka2dLoss(model, base, [384, 192, 96, 48], n_layers_per_step=-1)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
                small = truncate_layers(model, 3)  # embeds with the first 3 layers, as the loss trained them
        """
        owner, arguments = type(self).__name__, locals()
        with naming_errors(owner):
            check_base_loss(loss, owner, SUPPORTED_LOSSES, "Matryoshka2dLoss / AdaptiveLayerLoss")
            own = {**layer_options(arguments), "n_layers_per_step": integer(n_layers_per_step)}
            num_layers = _check_layer_options(model, **own)
        # CachedMatryoshkaLoss checks the options it takes, and refuses (.refusals) the filter and a bank.
        super().__init__(model, loss, **given_options(arguments))
        self.num_layers = num_layers  # transformer layers L: hidden states 0..L, the final layer is L
        for name, value in own.items():  # plain attributes, assignable as they always were
            setattr(self, name, value)

    def component_names(self) -> list[str]:
        """Names of the entries ``forward`` returns, in order: per layer (final first) its dims, then its KL."""
        names = []
        for layer in range(self.num_layers, -1, -1):
            names += [f"loss_layer_{layer}_dim_{dim}" for dim in self.matryoshka_dims]
            names += [f"loss_layer_{layer}_kl"] * (layer < self.num_layers and self.kl_temperature > 0)
        return names

    def draw_step(self) -> tuple[LayerDraw, ...]:
        """This step's layers, their dims and weights, the final layer first, drawn with stock Matryoshka2dLoss's
        ``random`` calls in its order: the final layer's dims, then the prior layers (unsorted, as stock), then each
        prior layer's dims."""
        draws = [LayerDraw(self.num_layers, self._sample_dims(), self.last_layer_weight)]
        layers = range(self.num_layers)
        if 0 < self.n_layers_per_step < len(layers):
            layers = random.sample(layers, self.n_layers_per_step)
        for layer in layers:
            weight = _st_compat.layer_weight(self.layer_weighting, layer)  # stock AdaptiveLayerLoss's weighting
            if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight):
                raise ValueError(f"layer_weighting({layer}) returned {weight!r}: it must return a finite number.")
            draws.append(LayerDraw(layer, self._sample_dims(), weight / len(layers) * self.prior_layers_weight))
        return tuple(draws)

    def encode(self, features: dict[str, Any], step: Step | None = None) -> Encoded:
        """(rows, S * D): the pooled embedding of the final layer, then of each prior layer of ``step`` (none without
        one), side by side. One run of the transformer with hidden states (stock's ``TransformerDecorator``); the
        model's other modules run once per layer on that layer's hidden states."""
        base = base_model(self.model, type(self).__name__)
        transformer = base[0]
        own_forward = vars(transformer).get("forward")
        decorator = _st_compat.TransformerDecorator(transformer, transformer.forward)
        transformer.forward = decorator
        try:
            # A plain dict: wrappers such as accelerate's fp32 output conversion rebuild the dict by its type.
            output = self.model(dict(features))  # through the DDP wrapper, if any: one forward per mini-batch
            hidden = output.get("all_layer_embeddings") or ()
            if len(hidden) != self.num_layers + 1:
                raise ValueError(
                    f"{type(self).__name__} expected the model's {self.num_layers} layers to return "
                    f"{self.num_layers + 1} hidden states (the embedding layer's and each layer's), got {len(hidden)}: "
                    "the model must support output_hidden_states."
                )
            embeddings = [output["sentence_embedding"]]
            for layer in () if step is None else step.prior_layers:
                decorator.set_layer_idx(layer)
                # The cached hidden states: no transformer run. forward, not __call__: outside a model.compile()d call.
                embeddings.append(base.forward(output)["sentence_embedding"])
        finally:
            if own_forward is None:
                del transformer.forward
            else:
                transformer.forward = own_forward
        return Encoded(torch.cat(embeddings, dim=1))

    def step_loss(self, reps: list[list[Tensor]], step: Step) -> Tensor:
        """Step (2) (:meth:`calculate_loss`): the 2D loss of the whole batch from the per-mini-batch (rows, S * D)
        embeddings of ``step``: per drawn layer one call of the op for its dims, and for each prior layer stock's KL
        term; the entries go to ``step.components``."""
        columns = step.columns(reps)
        width = columns[0].shape[1] // len(step.draw)
        queries, docs, placement = step.gathered(columns[0], columns[1:])
        options = {  # the same precision, text ids and absent documents for every layer
            **self.op_options(step),
            "precision": self.op_precision(queries),
            **step.duplicate_inputs(placement),
            **step.presence_inputs(),
        }
        total, teacher = 0.0, None
        for slot, draw in enumerate(step.draw):
            part = slice(slot * width, (slot + 1) * width)
            layer_placement = {  # the rest: offset
                key: value[:, part] if key == "world_queries" else value for key, value in placement.items()
            }
            weights = self.dim_weights(draw.dims)
            out = matryoshka_infonce(
                queries[:, part], docs[:, part], dims=draw.dims, weights=weights, **layer_placement, **options
            )
            if not slot and out.masked_share is not None:  # the final layer's; the mask is the same in every layer
                self.note_masked_share(step, out.masked_share)
            total = total + draw.weight * out.loss
            for dim, weight, value in zip(draw.dims, weights, out.per_dim):
                step.components[f"loss_layer_{draw.layer}_dim_{dim}"] = (draw.weight * weight * value).detach()
            if slot and self.kl_temperature > 0:
                teacher = self._kl_teacher(columns, width) if teacher is None else teacher
                kl = self._kl(columns, part, teacher, step.row_present()) * self.kl_temperature * self.kl_div_weight
                total = total + kl
                step.components[f"loss_layer_{draw.layer}_kl"] = kl.detach()
        return total

    def _kl_teacher(self, columns: list[Tensor], width: int) -> Tensor:
        """Stock's teacher: the softmax of the final layer's embeddings of every column (anchors, positives,
        negatives) over their D features at temperature T, detached; (rows, D)."""
        final = torch.cat([column[:, :width] for column in columns])
        return F.softmax(final / self.kl_temperature, dim=-1).detach()

    def _kl(self, columns: list[Tensor], part: slice, teacher: Tensor, present: Tensor | None) -> Tensor:
        """Stock's KL divergence of one prior layer's softmax from the teacher, ``batchmean`` over the rows; with
        absent hard negatives (``present``: (rows,) bool), the mean over the present rows (an absent row's
        placeholder takes no part, and gets zero gradient)."""
        student = F.log_softmax(torch.cat([column[:, part] for column in columns]) / self.kl_temperature, dim=-1)
        if present is None:
            return F.kl_div(student, teacher, reduction="batchmean")
        per_row = F.kl_div(student, teacher, reduction="none").sum(dim=-1)
        return torch.where(present, per_row, 0.0).sum() / present.sum()

    def get_config_dict(self) -> dict[str, Any]:
        """Stock ``Matryoshka2dLoss``'s entries in its order and types (the base loss by class name, a callable
        ``layer_weighting`` by its name), then the base loss's settings and ours (:class:`CachedMatryoshkaLoss`)."""
        weighting = self.layer_weighting
        weighting = weighting if isinstance(weighting, str) else getattr(weighting, "__name__", "custom")
        config = super().get_config_dict()
        own = {**{name: getattr(self, name) for name in LAYER_OPTIONS}, "layer_weighting": weighting}
        return {"loss": config.pop("loss"), **own, **config}

    @property
    def citation(self) -> str:
        return citations.MATRYOSHKA_2D + citations.GRADCACHE + citations.MATRYOSHKA


def layer_options(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The 2D losses' own options (:data:`LAYER_OPTIONS`) among a loss's ``__init__`` arguments (its ``locals()``)."""
    return {name: arguments[name] for name in LAYER_OPTIONS}


def _check_layer_options(model, n_layers_per_step, kl_temperature, layer_weighting, **weights) -> int:
    """The model's number of layers, after checking the layer options; TypeError / ValueError naming the fix (the
    options every loss takes, ``n_dims_per_step`` among them, are :class:`CachedMatryoshkaLoss`'s to check)."""
    num_layers = num_hidden_layers(model[0] if isinstance(model, SentenceTransformer) and len(model) else model)
    if isinstance(n_layers_per_step, bool) or not isinstance(n_layers_per_step, int):
        raise TypeError(f"n_layers_per_step must be an int (-1 for all), got {n_layers_per_step!r}.")
    if n_layers_per_step == 0 or n_layers_per_step < -1:
        raise ValueError(
            f"n_layers_per_step must be -1 (all) or a positive number to sample per step, got {n_layers_per_step}."
        )
    for option, value in {**weights, "kl_temperature": kl_temperature}.items():
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{option} must be a number, got {value!r}.")
        if not math.isfinite(value):
            raise ValueError(f"{option} must be finite, got {value!r}.")
    if kl_temperature < 0:
        raise ValueError(f"kl_temperature must be >= 0 (0 turns the KL term off), got {kl_temperature}.")
    if not callable(layer_weighting) and layer_weighting not in LAYER_WEIGHTINGS:
        raise ValueError(
            f"layer_weighting must be one of {LAYER_WEIGHTINGS} or a callable layer -> weight, got {layer_weighting!r}."
        )
    return num_layers
