"""fp64 oracle of ``apply_token_bitmask`` (docs/design.md "Sampling"): the bitmask of constrained
decoding, unpacked bit by bit.

Semantics (the executable specification): ``bitmask`` is int32 ``[B, W]``, ``32 W >= V``; bit
``j`` of word ``i`` (the word read as unsigned 32 bits) is 1 when token ``32 i + j`` is allowed.
Each selected row (every row, or the rows listed in ``indices``, which index logits and bitmask
alike) has its disallowed tokens' logits replaced by -inf; allowed tokens, unselected rows and
mask bits beyond ``V`` leave the logits as they are (NaN stays NaN where allowed).
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

__all__ = ["apply_token_bitmask", "unpack_token_bitmask", "pack_token_bitmask"]


def unpack_token_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """``[B, W]`` int32 words -> ``[B, vocab_size]`` bool (True: allowed)."""
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int64)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def pack_token_bitmask(allowed: Tensor) -> Tensor:
    """``[B, V]`` bool (True: allowed) -> ``[B, ceil(V / 32)]`` int32 words (the inverse of
    :func:`unpack_token_bitmask`; the padding bits of the last word are 0)."""
    B, V = allowed.shape
    W = (V + 31) // 32
    padded = torch.zeros(B, W * 32, dtype=torch.int64)
    padded[:, :V] = allowed.to(torch.int64)
    words = (padded.view(B, W, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, indices: Optional[Tensor] = None) -> Tensor:
    """Returns ``logits`` in float64 with the disallowed tokens of the selected rows at -inf."""
    out = logits.double().clone()
    V = logits.shape[1]
    allowed = unpack_token_bitmask(bitmask, V)
    rows = range(logits.shape[0]) if indices is None else [int(r) for r in indices.tolist()]
    for r in rows:
        out[r][~allowed[r]] = float("-inf")
    return out
