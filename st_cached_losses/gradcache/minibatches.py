"""How a batch's columns are cut into mini-batches: one row per anchor in every column, rows in length order
(so each mini-batch pads only to its own longest row), and mini-batches without the padding columns all their
rows share (trailing padding is trimmed by sentence-transformers' own ``embed_minibatch``; leading padding, of
left-padded decoder models, here, where the model's positions do not depend on it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from ._st_compat import get_batch_size

# Feature keys whose rows are not one per text (flattened sequences, images, videos, audio): such a column
# is embedded in its original order, since permuting its rows could pair them with the wrong inputs.
_UNSORTABLE_KEY_PARTS = ("cu_seq_lens", "seq_idx", "pixel", "image", "video", "audio")


def check_columns(
    sentence_features: list[dict[str, Any]], mini_batch_num_tokens: int | None = None, owner: str = "The loss"
) -> None:
    """Raises ValueError, naming ``owner`` (the loss class in use), unless there are >= 2 columns (anchor,
    positive[, negatives...]) of equal row counts, and, with ``mini_batch_num_tokens``, each has tokens to count (an
    attention mask or flattened sequences)."""
    if len(sentence_features) < 2:
        raise ValueError(
            f"{owner} expects at least 2 input columns (anchor, positive[, negatives...]), got "
            f"{len(sentence_features)}."
        )
    sizes = [get_batch_size(feature) for feature in sentence_features]
    if len(set(sizes)) != 1:
        raise ValueError(
            f"{owner}: every input column must have one row per anchor, got column sizes {sizes}: drop incomplete "
            "rows from the dataset."
        )
    if mini_batch_num_tokens is None:
        return
    for index, feature in enumerate(sentence_features):
        mask = feature.get("attention_mask")
        if "cu_seq_lens_q" not in feature and not (isinstance(mask, Tensor) and mask.ndim == 2):
            name = ("anchor", "positive")[index] if index < 2 else f"negative_{index - 1}"
            raise ValueError(
                f"{owner}: mini_batch_num_tokens={mini_batch_num_tokens} packs mini-batches by their tokens, but input "
                f"column {index} (the {name} column) holds {column_modality(feature)} inputs without tokens to count "
                f"(no attention mask; keys {sorted(feature)}): use mini_batch_size (rows per mini-batch) instead, e.g. "
                "mini_batch_num_tokens=None, mini_batch_size=32."
            )


def column_modality(feature: dict[str, Any]) -> str:
    """A column's modality: the one sentence-transformers' ``preprocess`` recorded (``feature["modality"]``, a
    multimodal tuple joined by "+"), else "image" for ``pixel_values`` and "text" otherwise."""
    modality = feature.get("modality")
    if isinstance(modality, (tuple, list)):
        return "+".join(modality)
    if isinstance(modality, str):
        return modality
    return "image" if "pixel_values" in feature else "text"


def rows_are_texts(feature: dict[str, Any]) -> bool:
    """Whether every tensor of ``feature`` holds one row per text beside a 2-D attention mask, so rows can be
    permuted and padding columns cut: not for flattened (``cu_seq_lens``) or image/video/audio inputs."""
    if any(part in key for key in feature for part in _UNSORTABLE_KEY_PARTS):
        return False
    mask = feature.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        return False
    rows = mask.shape[0]
    return not any(
        isinstance(value, Tensor) and (value.ndim == 0 or value.shape[0] != rows) for value in feature.values()
    )


def length_order(feature: dict[str, Any]) -> Tensor | None:
    """Row order by descending token count (stable: a column already in that order keeps it), on the mask's device,
    or None to keep the original order where the column cannot be permuted row by row safely (see
    :func:`rows_are_texts`). Never read on the host: no synchronisation with the GPU."""
    if not rows_are_texts(feature):
        return None
    return torch.sort(feature["attention_mask"].sum(dim=1), descending=True, stable=True).indices


def without_leading_padding(
    feature: dict[str, Any], begin: int, end: int, positions_relative: bool
) -> tuple[dict[str, Any], int, int]:
    """Rows ``begin:end`` of a left-padded column without the padding columns that all of them start with (as
    ``(feature, 0, end - begin)``), where that leaves the embeddings as they are; else the arguments unchanged
    (stock's behaviour: it trims nothing at the start).

    Decoder embedding models pad on the left (Qwen3-Embedding, e5-mistral). Every per-token tensor (``input_ids``,
    ``attention_mask``, ``token_type_ids``, ``position_ids``, ...) loses the same columns, which changes no
    embedding where the model's positions are relative (``positions_relative``: rotary or relative position
    embeddings, :func:`positions_are_relative`) or come in the features' ``position_ids``. A model with absolute
    positions counted from the first column (BERT given left padding) would see its tokens shifted: not trimmed.
    """
    if not (positions_relative or "position_ids" in feature):
        return feature, begin, end
    if not rows_are_texts(feature) or "query_expansion_positions" in feature:  # ColBERT scores masked positions
        return feature, begin, end
    mask = feature["attention_mask"]
    active = mask[begin:end].bool().any(dim=0)
    # The first column any row uses (0 when none does): one host synchronisation per mini-batch, where stock's
    # trailing trim takes three.
    first, width = int(active.int().argmax()), mask.shape[1]
    if first == 0:
        return feature, begin, end
    trimmed = {
        key: value[begin:end, first:] if value.ndim >= 2 and value.shape[1] == width else value[begin:end]
        for key, value in feature.items()
        if isinstance(value, Tensor)
    }
    return {**feature, **trimmed}, 0, end - begin


# Config keys that make positions relative: rotary embeddings (transformers 5's rope_parameters, earlier releases'
# rope_theta / rope_scaling, GPT-NeoX-style rotary_emb_base) and BERT-style relative position types.
_ROTARY_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_emb_base")
_RELATIVE_TYPES = ("relative_key", "relative_key_query", "rotary")


def positions_are_relative(model: nn.Module) -> bool:
    """Whether every Hugging Face model inside ``model`` places its tokens by relative positions (rotary, or a
    ``position_embedding_type`` of relative keys), read from its config: then trimming leading padding changes no
    embedding. False without any (nothing is known about the positions of a custom module) and for absolute or
    unknown position embeddings (BERT, RoBERTa, GPT-2, CLIP)."""
    configs = [
        module.config
        for module in model.modules()
        if isinstance(module, PreTrainedModel) and isinstance(getattr(module, "config", None), PretrainedConfig)
    ]
    return bool(configs) and all(_relative(config) for config in configs)


def _relative(config: PretrainedConfig) -> bool:
    kind = getattr(config, "position_embedding_type", None)
    if kind is not None:
        return kind in _RELATIVE_TYPES
    return any(getattr(config, key, None) is not None for key in _ROTARY_KEYS)


class LengthSorted(dict):
    """A column's features as given (no copy) and the row ``order`` in which ``embed_minibatch`` reads them."""

    def __init__(self, feature: dict[str, Any], order: Tensor) -> None:
        super().__init__(feature)
        self.order = order


def length_sorted(feature: dict[str, Any], order: Tensor | None) -> dict[str, Any]:
    return feature if order is None else LengthSorted(feature, order)


def reorder(feature: dict[str, Any], order: Tensor | None) -> dict[str, Any]:
    if order is None:
        return feature
    return {key: value[order] if isinstance(value, Tensor) else value for key, value in feature.items()}


def restore_order(embeddings: Tensor, order: Tensor | None) -> Tensor:
    """Embeddings of rows ``feature[order]`` back in the original row order (differentiable gather)."""
    if order is None:
        return embeddings
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return embeddings[inverse.to(embeddings.device)]
