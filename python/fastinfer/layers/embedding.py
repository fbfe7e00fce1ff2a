"""Token embedding and the LM head (vocabulary-parallel ready: world size 1 today)."""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from .linear import ReplicatedLinear, UnquantizedLinearMethod, WeightPart, param
from .weights import SingleWeightModule, WeightReader

Tensor = torch.Tensor

__all__ = ["VocabEmbedding", "LMHead"]


class VocabEmbedding(SingleWeightModule):
    """``weight [vocab, hidden]``; ``forward(ids) -> [T, hidden]``."""

    def __init__(self, vocab: int, hidden: int, prefix: str, *, dtype, device):
        super().__init__()
        self.prefix = prefix
        self.weight = param((vocab, hidden), dtype, device)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


class _TiedWeight(UnquantizedLinearMethod):
    """The LM head of a tied model: the embedding's weight IS its weight; nothing to load (a
    checkpoint's own ``lm_head.weight`` copy is ignored, as in transformers)."""

    name = "float (tied to the embedding)"

    def __init__(self, embedding: VocabEmbedding):
        self.embedding = embedding

    def create_weights(self, layer) -> None:
        layer.weight = self.embedding.weight
        layer.packed = None

    def load_weights(self, layer, reader: WeightReader) -> None:
        name = layer.prefix + ".weight"
        if reader.has(name):
            reader.skip(name)

    def checkpoint_tensors(self, layer) -> Iterable[Tuple[str, Tensor]]:
        return ()


class LMHead(ReplicatedLinear):
    """Hidden states ``[T, hidden]`` -> float32 logits ``[T, vocab]``; ``tie_to``: share the
    embedding's weight."""

    def __init__(self, vocab: int, hidden: int, prefix: str, *, dtype, device, ops,
                 tie_to: Optional[VocabEmbedding] = None, quant_config=None):
        super().__init__(hidden, [WeightPart(prefix, vocab)], False, dtype=dtype, device=device, ops=ops,
                         quant_config=quant_config, method=_TiedWeight(tie_to) if tie_to is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).float()
