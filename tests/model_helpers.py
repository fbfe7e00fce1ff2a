"""Test shorthands over :class:`fastinfer.layers.BatchBuilder` (the one batch builder)."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from fastinfer.layers import BatchBuilder


def make_forward_batch(prefill: Sequence[Tuple[Sequence[int], int, Sequence[int]]] = (),
                       decode: Sequence[Tuple[int, int, Sequence[int]]] = (), block_size: int = 16, device=None,
                       all_logits: bool = False):
    """``prefill``: per chunk ``(new_token_ids, num_cached, block_ids)``; ``decode``: per row
    ``(token_id, position, block_ids)``. Logits: the last row of each chunk (every row with
    ``all_logits``), then every decode row."""
    b = BatchBuilder(block_size, device)
    for toks, start, blocks in prefill:
        b.prefill(toks, start, blocks, logits="all" if all_logits else "last")
    for tok, pos, blocks in decode:
        b.decode(tok, pos, blocks)
    return b.build()


def prefill_logits(model, token_ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` (float32) of a whole prompt in one prefill, with a fresh
    cache and the contiguous block table ``0, 1, 2, ...``."""
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = model.allocate_kv_cache(num_blocks, block_size)
    return model(make_forward_batch([(list(token_ids), 0, list(range(num_blocks)))], block_size=block_size,
                                    device=model.device, all_logits=True), caches)
