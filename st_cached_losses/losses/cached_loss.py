"""What every cached loss of this package shares on top of the GradCache engine (:class:`GradCacheSteps`): the
mini-batch settings and their defaults, the Matryoshka dims and weights, the ``n_dims_per_step`` draw (stock
MatryoshkaLoss's ``random.sample`` call), the op's precision, the per-dim entries ``forward`` returns, the model card's
settings, the activation report, the options every loss takes (:class:`.options.LossOptions`, built here, every
error naming the class in use), the backend's one rule and stock's step (2) hook (``calculate_loss``); the refused
options are :mod:`.refusals`'s.

Each loss adds its base losses (:mod:`.base_losses`), what it embeds (``encode``) and its step (2) (``step_loss``).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from st_cached_losses.ops.core.backend import backends, check_backend
from st_cached_losses.ops.core.precision import resolve_precision

from ..gradcache._st_compat import untruncated_embedding_dimension
from ..gradcache.activation_budget import AUTO, ActivationBudget
from ..gradcache.defaults import DEFAULT_MINI_BATCH_SIZE
from ..gradcache.distributed import unwrapped
from ..gradcache.guide_model import GuideModel
from ..gradcache.kept_minibatches import StepPlan
from ..gradcache.loss_components import loss_components
from ..gradcache.step import LayerDraw, Step, require_step
from ..gradcache.steps import GradCacheSteps
from . import card
from .base_losses import mini_batch_defaults
from .options import LossOptions, check_flag, integer, model_embeddings

__all__ = ["CachedLossBase", "check_flag", "check_model_backend", "integer", "naming_errors", "option_attribute"]


@contextmanager
def naming_errors(owner: str) -> Iterator[None]:
    """A ValueError or TypeError raised inside (the checks of a loss's options, some of them shared) names ``owner``,
    the class in use: "<owner>: <message>" where the message does not name it already."""
    try:
        yield
    except (ValueError, TypeError) as error:
        if type(error) not in (ValueError, TypeError) or owner in str(error):
            raise
        raise type(error)(f"{owner}: {error}") from error


def check_model_backend(model: nn.Module, backend: Any, op: str) -> None:
    """The backend rule of every loss, when it is built: ``backend`` is "auto" or a name of ``op``'s backends
    (:func:`~st_cached_losses.ops.core.backend.check_backend`), one that can run on the model's device ("triton" on
    a CPU: now, not after the first batch). A model that does not say its device (a stand-in) has the name checked
    alone: its first step runs the backend where the embeddings are, or raises there.

    Raises:
        ValueError: an unknown name, or a backend that cannot run on the model's device.
    """
    device = getattr(model, "device", None)
    if device is not None or backend not in backends(op):
        check_backend(backend, "cpu" if device is None else device, op=op)  # a name alone: refused before the device


def option_attribute(name: str, doc: str) -> property:
    """The loss's attribute ``name``: the option of its :class:`.options.LossOptions`. Assigning it still works, as
    the attribute did before the options object, but is deprecated (a FutureWarning): the value is not checked."""

    def assign(self, value: Any) -> None:
        warnings.warn(
            f"Assigning {type(self).__name__}.{name} after construction is deprecated and unchecked: pass "
            f"{name}=... when building the loss.",
            FutureWarning,
            stacklevel=2,
        )
        self.options._set(**{name: value})

    return property(lambda self: getattr(self.options, name), assign, doc=doc)


class CachedLossBase(GradCacheSteps):
    """The shared part of the cached losses (see the module's docstring); ``self.loss`` is the base loss holding the
    InfoNCE hyperparameters.

    Args:
        model, loss: as the losses take them.
        options: the keywords of :class:`.options.LossOptions` as the loss was given them
            (:func:`.options.given_options`), built into ``self.options`` here, with the model (the bars show when
            this loss's or the base loss's ``show_progress_bar`` is True; without in-batch negatives nothing is
            gathered across processes: :attr:`gathers`). The dims are bounded as stock bounds them, by the model's
            untruncated embedding dimension (a multi-vector model's token dim; ``truncate_dim`` aside); the mini-batch
            defaults are those the base loss implies (:func:`.base_losses.mini_batch_defaults`).
        guide: a GISTEmbed guide embedding step (1)'s mini-batches, or None.
        take_text_ids: take each row's text id (the duplicate mask, a memory bank).
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        options: Mapping[str, Any],
        *,
        guide: GuideModel | None = None,
        take_text_ids: bool = False,
    ) -> None:
        embedding_dim = untruncated_embedding_dimension(unwrapped(model))
        default_mini_batch = mini_batch_defaults(loss, DEFAULT_MINI_BATCH_SIZE)
        with naming_errors(type(self).__name__):
            checked = LossOptions(
                **options, model=model, embedding_dim=embedding_dim, default_mini_batch=default_mini_batch
            )
            budgeted = checked.activation_budget is not None or checked.mini_batch_size == AUTO
            super().__init__(
                model,
                mini_batch_size=checked.mini_batch_size,
                default_mini_batch_size=DEFAULT_MINI_BATCH_SIZE,
                mini_batch_num_tokens=checked.mini_batch_num_tokens,
                sort_by_length=checked.sort_by_length,
                # Either's, as stock's cached base loss shows its bars when the wrapper runs it.
                show_progress_bar=checked.show_progress_bar or bool(getattr(loss, "show_progress_bar", False)),
                budget=ActivationBudget(checked.activation_budget) if budgeted else None,
                guide=guide,
                take_text_ids=take_text_ids or checked.mask_duplicates,
                fsdp_sync=checked.fsdp_sync,
            )
        self.loss = loss
        self.options = checked
        self.last_precision: str | None = None  # the last step's, resolved (a report, as masked_share)
        self.masked_share: float | None = None  # the last step's share of candidates the masks removed

    # The shared options, read from ``self.options`` (the attributes the losses have always had).
    matryoshka_dims = option_attribute("matryoshka_dims", "The dims, descending (a tuple).")
    matryoshka_weights = option_attribute("matryoshka_weights", "Each dim's weight, in the dims' order (a tuple).")
    n_dims_per_step = option_attribute("n_dims_per_step", "Dims drawn per step; -1: every dim.")
    backend = option_attribute("backend", "The op's backend, as asked.")
    precision = option_attribute("precision", "The op's precision, as asked (what runs: :attr:`resolved_precision`).")
    activation_budget = option_attribute("activation_budget", "Bytes of kept activations, 'auto' or None.")
    mask_duplicates = option_attribute("mask_duplicates", "Whether exact duplicates are kept out of the negatives.")
    in_batch_negatives = option_attribute("in_batch_negatives", "Whether a row scores the other rows' documents.")

    @property
    def gathers(self) -> bool:
        """Whether a step gathers the batch across processes: the base loss's ``gather_across_devices``, with in-batch
        negatives on (without them a row scores only its own documents, which this process holds: nothing to gather,
        and DDP's mean of the processes' gradients is that of one process on the whole batch)."""
        return self.gather_across_devices and self.in_batch_negatives

    # ------------------------------------------------------------------------------------------ the step's dims

    def draw_step(self) -> tuple[LayerDraw, ...]:
        """This step's dims, drawn with the same ``random.sample`` call as MatryoshkaLoss (a seed draws stock's)."""
        return (LayerDraw(None, self._sample_dims()),)

    def _sample_dims(self) -> tuple[int, ...]:
        # The same random.sample call as MatryoshkaLoss, so a seed picks the same dims as stock.
        dim_indices = range(len(self.matryoshka_dims))
        if not self.options.draws_every_dim:
            dim_indices = sorted(random.sample(dim_indices, self.n_dims_per_step))
        return tuple(self.matryoshka_dims[i] for i in dim_indices)

    def dim_weights(self, dims: Sequence[int]) -> list[float]:
        """The weight of each of ``dims``."""
        return [self.matryoshka_weights[self.matryoshka_dims.index(dim)] for dim in dims]

    # ------------------------------------------------------------------------------------------ the op's precision

    def op_precision(self, queries: Tensor) -> str:
        """The op's ``precision`` for this step's ``queries``: the loss's, resolved by the ops' one rule
        (:func:`~st_cached_losses.ops.core.precision.resolve_precision`, in the op's context: "auto" is "ieee" for
        the fp32
        embeddings the trainer hands over outside autocast, "tf32" on CUDA where torch's flag allows it, "bf16" under
        a bf16 autocast of your own on CUDA), kept as :attr:`resolved_precision`."""
        self.last_precision = resolve_precision(self.precision, queries)
        return self.last_precision

    @property
    def resolved_precision(self) -> str | None:
        """The op's GEMM precision ("bf16", "tf32" or "ieee"): the last step's, else what ``precision`` resolves to
        for the model's embeddings as the trainer hands them over (its device and dtype, outside autocast); None for a
        model that does not say its device."""
        if self.last_precision is not None:
            return self.last_precision
        embeddings = model_embeddings(self.model)
        return None if embeddings is None else resolve_precision(self.precision, embeddings)

    # ------------------------------------------------------------------------------------------ step (2)

    def calculate_loss(
        self,
        reps: list[list[Tensor]],
        labels: Tensor | None = None,
        *,
        with_backward: bool = False,
        step: Step | None = None,
    ) -> Tensor:
        """Step (2) (CachedLossMixin's hook): the loss of the whole batch from the per-mini-batch embeddings of
        ``step`` (:meth:`step_loss`, which puts the entries in ``step.components``). With ``with_backward`` it
        back-propagates to the embeddings and returns the detached loss. ``labels`` are unused.

        Raises:
            ValueError: without the ``step`` of the forward that embedded ``reps`` (call the loss, not this hook).
        """
        loss = self.step_loss(reps, require_step(step, type(self).__name__))
        if with_backward:
            loss.backward()
            return loss.detach()
        return loss

    def step_loss(self, reps: list[list[Tensor]], step: Step) -> Tensor:
        """This loss's step (2) on ``step``'s embeddings ``reps`` (see :meth:`calculate_loss`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ the entries

    def component_names(self) -> list[str]:
        """The entries ``forward`` returns, in order: ``loss_dim_<d>`` per dim, descending."""
        return [f"loss_dim_{dim}" for dim in self.matryoshka_dims]

    def record_dims(
        self, step: Step, dims: Sequence[int], weights: Sequence[float], per_dim: Tensor, prefix: str = "loss_dim_"
    ) -> None:
        """Step (2): each dim's weighted loss into ``step.components`` as ``<prefix><d>``, detached."""
        for dim, weight, value in zip(dims, weights, per_dim):
            step.components[f"{prefix}{dim}"] = (weight * value).detach()

    def entries(self, total: Tensor, step: Step) -> dict[str, Tensor]:
        """``forward``'s return: the entries of :meth:`component_names` (0 for what this step did not draw), whose
        sum carries the gradient of ``total`` (:func:`~st_cached_losses.gradcache.loss_components.loss_components`)."""
        zero = total.detach().new_zeros(())
        return loss_components(total, {name: step.components.get(name, zero) for name in self.component_names()})

    # ------------------------------------------------------------------------------------------ reports

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's settings for the model card, JSON values: stock ``MatryoshkaLoss``'s keys and value types (the
        base loss by class name, the dims and weights), the base loss's own settings as stock ``Matryoshka2dLoss``
        lists them, then this loss's own (the mini-batch settings in effect; ``precision`` as asked and
        ``resolved_precision``, what runs: :attr:`resolved_precision`)."""
        resolved, options = self.resolved_precision, self.options
        return {
            "loss": type(self.loss).__name__,
            "matryoshka_dims": options.matryoshka_dims,
            "matryoshka_weights": options.matryoshka_weights,
            "n_dims_per_step": options.n_dims_per_step,
            **card.base_loss_settings(self.loss),
            # The mini-batch settings and fsdp_sync as the engine (GradCacheSteps) runs them: "auto" is measured.
            "mini_batch_size": AUTO if self.auto_mini_batch else self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "sort_by_length": self.sort_by_length,
            "backend": options.backend,
            "precision": options.precision,
            **({"resolved_precision": resolved} if resolved else {}),
            **self.filter_settings(),
            "activation_budget": options.activation_budget,
            **({"fsdp_sync": self.fsdp_sync} if self.fsdp_sync != "per_backward" else {}),
            **({"mask_duplicates": True} if options.mask_duplicates else {}),
            **({"in_batch_negatives": False} if not options.in_batch_negatives else {}),
            **self.bank_settings(),
            **(self.budget.chosen if self.budget is not None else {}),
        }

    def filter_settings(self) -> dict[str, Any]:
        """The card's false-negative filter settings, where the loss has one."""
        return {}

    def bank_settings(self) -> dict[str, Any]:
        """The card's memory bank settings, where the loss has one."""
        return {}

    @property
    def activation_report(self) -> StepPlan | None:
        """The last training step's kept mini-batches and their bytes (:class:`StepPlan`); None without a budget."""
        return None if self.budget is None else self.budget.report
