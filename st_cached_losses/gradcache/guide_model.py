"""The guide model of GISTEmbed's false-negative filter (arXiv 2402.16829), as GradCache's step (1) runs it: it embeds
the texts of every mini-batch the model embeds (no gradient, never stepped), and step (2) hands its embeddings to the
op, which computes the filter's mask tile by tile."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from sentence_transformers.util import batch_to_device
from torch import Tensor, nn

__all__ = ["GuideModel"]


class GuideModel:
    """A GISTEmbed base loss's guide model, embedding the texts of the model's mini-batches (no gradient, never
    stepped): on the guide's own device, tokenised by its own tokenizer when the two differ (as stock does,
    decoding the model's tokens), returned on the model's device."""

    def __init__(self, model: nn.Module, *, retokenize: bool, tokenizer: Any = None) -> None:
        self.model = model
        self.retokenize = retokenize
        self.tokenizer = tokenizer

    @torch.no_grad()
    def embed(self, features: dict[str, Any], device: torch.device) -> Tensor:
        """(rows, guide D) embeddings of one mini-batch's texts (``features``: the model's tokenised inputs)."""
        if self.retokenize:
            input_ids = features["input_ids"]
            if "cu_seq_lens_q" in features:  # flattened sequences: one row of all the tokens
                flat, bounds = input_ids[0].tolist(), features["cu_seq_lens_q"].tolist()
                input_ids = [flat[begin:end] for begin, end in itertools.pairwise(bounds)]
            features = self.model.preprocess(self.tokenizer.batch_decode(input_ids, skip_special_tokens=True))
        features = batch_to_device(dict(features), self.model.device)  # a copy: modules write into their inputs
        return self.model(features)["sentence_embedding"].to(device)
