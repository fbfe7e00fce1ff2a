"""Paged attention of one layer over a :class:`~fastinfer.layers.batch.ForwardBatch`.

Writes the new tokens' K/V to the layer's paged cache (``reshape_and_cache``), then attends:
``paged_prefill_attention`` for the prefill rows (chunks, prefix-cache continuations, speculative
trees with their ``custom_mask``; a sliding window applies on top of a tree mask by tree position)
and ``paged_decode_attention`` for the decode rows.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from .batch import ForwardBatch

Tensor = torch.Tensor
KVCache = Tuple[Tensor, Tensor]

__all__ = ["PagedAttention", "KVCache"]


class PagedAttention(nn.Module):
    """``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` (views into the fused qkv output are fine) ->
    ``[T, Hq * D]``. ``window_left`` >= 0: sliding window (Mistral, Gemma), -1: full attention.
    ``softcap`` > 0: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2), 0: off."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window_left: int,
                 layer_idx: int, *, ops, softcap: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.window_left = int(window_left)
        self.softcap = float(softcap)
        self.layer_idx = layer_idx
        self.ops = ops

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, batch: ForwardBatch) -> Tensor:
        k_cache, v_cache = kv_cache
        ops = self.ops
        ops.reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping)
        T, P = q.shape[0], batch.num_prefill_tokens
        parts = []
        if P > 0:
            parts.append(ops.paged_prefill_attention(
                q[:P], k_cache, v_cache, batch.prefill_block_table, batch.prefill_cu_seqlens_q,
                batch.prefill_seq_lens_k, int(batch.prefill_max_seqlen_q), scale=self.scale, causal=True,
                window_left=self.window_left, softcap=self.softcap, custom_mask=batch.custom_mask))
        if T > P:
            parts.append(ops.paged_decode_attention(
                q[P:], k_cache, v_cache, batch.decode_block_table, batch.decode_seq_lens, scale=self.scale,
                window_left=self.window_left, softcap=self.softcap))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return attn.reshape(T, self.num_heads * self.head_dim)
