"""Token embedding and the LM head, vocabulary-parallel under tensor parallelism.

At world size N > 1 the vocabulary is padded to a multiple of ``64 * N`` (:func:`padded_vocab`) and
rank r holds rows ``[r * Vp / N, (r + 1) * Vp / N)`` of the embedding (and of an untied LM head;
padding rows are zero). The embedding looks up the ids in its range, zeroes the others and sums
over ranks (one all-reduce); the LM head computes its slice of the logits, gathered on rank 0 and
cut back to the vocabulary (the other ranks return their slice, which nobody reads).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from ..distributed import SINGLE, ParallelInfo
from .linear import Linear, UnquantizedLinearMethod, WeightPart, param
from .weights import SingleWeightModule, WeightReader

Tensor = torch.Tensor

__all__ = ["VocabEmbedding", "LMHead", "padded_vocab", "VOCAB_PAD"]

VOCAB_PAD = 64


def padded_vocab(vocab: int, world_size: int) -> int:
    """``vocab`` rounded up to a multiple of ``64 * world_size`` (unchanged at world size 1)."""
    if world_size == 1:
        return int(vocab)
    m = VOCAB_PAD * world_size
    return -(-int(vocab) // m) * m


def _vocab_range(vocab: int, tp: ParallelInfo) -> Tuple[int, int, int]:
    """``(start, rows held, rows of them in the checkpoint)`` of this rank's vocabulary slice."""
    per = padded_vocab(vocab, tp.world_size) // tp.world_size
    start = tp.rank * per
    return start, per, max(0, min(per, vocab - start))


class VocabEmbedding(SingleWeightModule):
    """``weight [vocab, hidden]`` (this rank's slice under TP); ``forward(ids) -> [T, hidden]``."""

    def __init__(self, vocab: int, hidden: int, prefix: str, *, dtype, device, tp: ParallelInfo = SINGLE):
        super().__init__()
        self.prefix = prefix
        self.tp = tp
        self.vocab_size = int(vocab)
        self.vocab_start, rows, self.rows_stored = _vocab_range(vocab, tp)
        self.weight = param((rows, hidden), dtype, device)

    def load_from(self, reader: WeightReader) -> None:
        if self.tp.world_size == 1:
            return super().load_from(reader)
        with torch.no_grad():
            w = reader.get_float(self.prefix + ".weight", (self.vocab_size, self.weight.shape[1]),
                                 rows=(self.vocab_start, self.rows_stored))
            self.weight.zero_()
            self.weight[: self.rows_stored].copy_(w.to(device=self.weight.device, dtype=self.weight.dtype))

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.world_size == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.comm.all_reduce(x)


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


class _TiedElsewhere(UnquantizedLinearMethod):
    """The LM head of a tied model on a pipeline stage without the embedding: reads the embedding's
    tensor (its vocabulary slice under TP) as its own weight; a checkpoint's ``lm_head.weight`` copy
    is ignored, as for :class:`_TiedWeight`."""

    name = "float (the embedding's tensor)"

    def __init__(self, embedding_name: str):
        self.embedding_name = embedding_name

    def load_weights(self, layer, reader: WeightReader) -> None:
        if reader.has(layer.prefix + ".weight"):
            reader.skip(layer.prefix + ".weight")
        start, _, stored = _vocab_range(layer.vocab_size, layer.tp)
        with torch.no_grad():
            w = reader.get_float(self.embedding_name, (layer.vocab_size, layer.in_features), rows=(start, stored))
            layer.weight.zero_()
            layer.weight[:stored].copy_(w.to(device=layer.device, dtype=layer.dtype))

    def checkpoint_tensors(self, layer) -> Iterable[Tuple[str, Tensor]]:
        return ()  # the embedding's, written by the stage that holds it


class _VocabSlice(UnquantizedLinearMethod):
    """An untied LM head's vocabulary slice (padding rows zero)."""

    def load_weights(self, layer, reader: WeightReader) -> None:
        start, _, stored = _vocab_range(layer.vocab_size, layer.tp)
        with torch.no_grad():
            w = reader.get_float(layer.prefix + ".weight", (layer.vocab_size, layer.in_features), rows=(start, stored))
            layer.weight.zero_()
            layer.weight[:stored].copy_(w.to(device=layer.device, dtype=layer.dtype))


class LMHead(Linear):
    """Hidden states ``[T, hidden]`` -> float32 logits ``[T, vocab]``; ``tie_to``: share the
    embedding's weight; ``tied_name``: a tied model's head on a pipeline stage without the embedding
    (it reads that tensor). Vocabulary-parallel under TP (a quantised LM head is refused there)."""

    def __init__(self, vocab: int, hidden: int, prefix: str, *, dtype, device, ops,
                 tie_to: Optional[VocabEmbedding] = None, quant_config=None, tp: ParallelInfo = SINGLE,
                 tied_name: Optional[str] = None):
        self.parallel = "column" if tp.world_size > 1 else "replicated"
        self.vocab_size = int(vocab)
        method = _TiedWeight(tie_to) if tie_to is not None else None
        if tied_name is not None:
            method = _TiedElsewhere(tied_name + ".weight")
        if tp.world_size > 1 and method is None:
            probe = quant_config.linear_method(_Probe(prefix, vocab)) if quant_config is not None else None
            if probe is not None and type(probe) is not UnquantizedLinearMethod:
                raise ValueError(f"{prefix}: a quantised LM head ({probe.name}) cannot be split by vocabulary; "
                                 "tensor_parallel_size > 1 needs a float lm_head")
            method = _VocabSlice()
        super().__init__(hidden, [WeightPart(prefix, padded_vocab(vocab, tp.world_size))], False, dtype=dtype,
                         device=device, ops=ops, quant_config=quant_config, method=method, tp=tp)

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x).float()
        if self.tp.world_size == 1:
            return y
        y = self.tp.comm.gather_to_first(y, dim=1)
        return y[:, : self.vocab_size] if self.tp.rank == 0 else y


class _Probe:
    """What a quantisation config looks at to choose the LM head's method (its name and parts)."""

    def __init__(self, prefix: str, rows: int):
        self.prefix = prefix
        self.parts = [WeightPart(prefix, rows)]
