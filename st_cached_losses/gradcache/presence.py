"""Absent hard negatives: a batch whose rows have fewer hard negatives than it has columns (ragged data).

A hard-negative column may carry a presence mask: ``features["present"]``, a (rows,) ``torch.bool`` tensor, False
where the row lacks that negative and the column holds a placeholder text in its place.
:class:`st_cached_losses.AbsentNegativesCollator` writes it as the batch key ``<column>_present``, which
sentence-transformers' trainer (``collect_features``) puts into that column's features as ``"present"``. The engine
takes the masks out of the features before the model sees them (:func:`take_presence`), keeps them in the step in
the batch's row order, and the losses hand the op ``document_present`` (:func:`document_present`), in the documents'
layout ``[positives | negatives_1 | ...]``, gathered across processes as the documents are. An absent document is no
row's candidate and its embedding gets exactly zero gradient, so the placeholder changes neither the loss nor any
parameter gradient. Anchors and positives are never absent.

No host synchronisation: the masks stay on their device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from sentence_transformers.util import all_gather, get_world_size
from torch import Tensor

from ._st_compat import get_batch_size

__all__ = ["PRESENT", "document_present", "row_present", "take_presence"]

PRESENT = "present"  # the features' key of a column's presence mask (the batch's "<column>_present")


def take_presence(
    sentence_features: list[dict[str, Any]], owner: str
) -> tuple[list[dict[str, Any]], list[Tensor | None]]:
    """(the columns without their presence masks, each column's mask or None), the caller's dicts left as they were.

    Raises:
        ValueError / TypeError: a mask on the anchor or positive column (they are never absent), or one that is no
            1-D ``torch.bool`` tensor of one flag per row of its column, naming the fix.
    """
    columns, masks = [], []
    for index, feature in enumerate(sentence_features):
        # Any mapping: a BatchEncoding (model.tokenize's output) is a UserDict, not a dict.
        mask = feature.get(PRESENT) if isinstance(feature, Mapping) else None
        if mask is None:
            columns.append(feature)
            masks.append(None)
            continue
        _check_mask(mask, index, get_batch_size(feature), owner)
        columns.append({key: value for key, value in feature.items() if key != PRESENT})
        masks.append(mask)
    return columns, masks


def _check_mask(mask: Any, index: int, rows: int, owner: str) -> None:
    if index < 2:
        raise ValueError(
            f"{owner}: input column {index} (the {('anchor', 'positive')[index]} column) carries a presence mask "
            f"('{PRESENT}'), but anchors and positives are never absent: only hard-negative columns (the third on) "
            "may lack a text."
        )
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (rows,):
        what = f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(
            f"{owner}: the presence mask ('{PRESENT}') of input column {index} must be a torch.bool tensor of shape "
            f"({rows},), one flag per row (False: the row lacks this hard negative), got {what}."
        )


def document_present(masks: list[Tensor | None], gather: bool) -> Tensor | None:
    """``document_present`` for the op: (M,) bool over the documents ``[positives | negatives_1 | ...]`` of this
    process's rows, or with ``gather`` (``gather_across_devices`` in a world of several processes) of the gathered
    batch, each block every rank's rows in rank order (one all-gather of every hard-negative column's flags; every rank
    must carry masks on the same columns, as the collator writes them). None where no column carries a mask.

    ``masks``: each column's mask or None (present), the anchors' first, as :func:`take_presence` gives them."""
    if all(mask is None for mask in masks):
        return None
    known = next(mask for mask in masks if mask is not None)
    ones = torch.ones(known.shape[0], dtype=torch.bool, device=known.device)
    docs = torch.stack([ones if mask is None else mask for mask in masks[1:]])  # (columns, rows)
    if gather and get_world_size() > 1:
        world = all_gather(docs.to(torch.uint8))  # (ranks x columns, rows), rank after rank
        docs = world.view(-1, *docs.shape).transpose(0, 1).bool()  # (columns, ranks, rows)
    return docs.reshape(-1)


def row_present(masks: list[Tensor | None]) -> Tensor | None:
    """(columns x rows,) bool: every embedding row of this process's columns side by side (anchors, positives, hard
    negatives), False for an absent hard negative; None where no column carries a mask."""
    if all(mask is None for mask in masks):
        return None
    known = next(mask for mask in masks if mask is not None)
    ones = torch.ones(known.shape[0], dtype=torch.bool, device=known.device)
    return torch.cat([ones if mask is None else mask for mask in masks])
