"""fp64 oracles of multi-head latent attention (docs/design.md "Attention", MLA): the cache write
and the absorbed decode of DeepSeek-V3 / R1 / V3.2, Kimi K2 and GLM-5.

A cache row per token is ``[kv_c (512) | k_pe (64)]``. In the absorbed form query head ``h`` is
``[q_nope W_UK[h] | q_pe]`` (576 values): the score of key ``j`` is ``scale * q . row_j`` over all
576 values and the value is ``row_j[:512]``, so the output stays in latent space (the caller applies
``W_UV``). This equals transformers' ``DeepseekV3Attention`` (scores ``q_nope . k_nope + q_pe .
k_pe`` with ``k_nope = W_UK kv_c``, output ``softmax(s) (W_UV kv_c)``) by associativity. Masking,
lse and the non-finite rules are those of :mod:`fastinfer.reference.attention` with one KV head.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .attention import _lens, attention_fixed_splits, unpack_custom_mask, visibility_mask  # noqa: F401
from .gemm_fp8 import FP8_E4M3_MAX, FP8_MIN_AMAX

Tensor = torch.Tensor

MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64
MLA_ROW_DIM = MLA_LATENT_DIM + MLA_ROPE_DIM


def mla_cache_write(
    kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, kv_scale: Optional[Tensor] = None
) -> Tuple[Tensor, Optional[Tensor]]:
    """``cache.view(NB * BS, 576)[s] = enc([kv_c[t] | k_pe[t]])`` for every token ``t`` with slot
    ``s = slot_mapping[t] >= 0`` (-1 skips it). ``enc`` is the identity for a cache in the
    activations' dtype; for a ``float8_e4m3fn`` cache ``e4m3(clamp(fp32(x) / scale, -448, 448))``
    (round to nearest even) with ``kv_scale`` per tensor (1 element, given) or per token
    (``[NB, BS]``: slot ``s`` gets ``max(amax of the row's 576 fp32 values, 1e-12) / 448``).

    Returns ``(cache, scale)``: the new cache in its own dtype (an exact copy of the rows, or the
    e4m3 codes: compare bits), and the new per-token scales (or the given per-tensor one; None
    without a scale)."""
    row = torch.cat([kv_c, k_pe], dim=1)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots, row = slots[keep], row[keep]
    flat = kv_cache.reshape(-1, MLA_ROW_DIM)
    if kv_cache.dtype != torch.float8_e4m3fn:
        out = flat.clone()
        out[slots] = row.to(kv_cache.dtype)
        return out.reshape(kv_cache.shape), None
    x = row.to(torch.float32)
    out = flat.clone()
    scale = kv_scale.clone()
    if kv_scale.dim() == 2:
        amax = x.abs().amax(1)
        s = amax.clamp_min(FP8_MIN_AMAX) / FP8_E4M3_MAX  # a NaN amax stays NaN
        scale.reshape(-1)[slots] = s
        q = x / s[:, None]
    else:
        q = x / kv_scale.to(torch.float32).reshape(1, 1)
    out[slots] = q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return out.reshape(kv_cache.shape), scale


def gather_latent(kv_cache: Tensor, block_table_row: Tensor, length: int, kv_scale: Optional[Tensor] = None) -> Tensor:
    """The first ``length`` cache rows ``[length, 576]`` of one sequence in float64, an fp8 cache
    dequantised with its per-tensor or per-token scale."""
    bs = kv_cache.shape[1]
    j = torch.arange(length)
    slots = block_table_row.to(torch.int64)[j // bs] * bs + j % bs
    rows = kv_cache.reshape(-1, MLA_ROW_DIM)[slots].to(torch.float64)
    if kv_scale is not None:
        s = kv_scale.to(torch.float64)
        rows = rows * (s.reshape(-1)[slots].unsqueeze(1) if s.dim() == 2 else s.reshape(1, 1))
    return rows


def mla_decode_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    causal: bool = True,
    custom_mask: Optional[Tensor] = None,
    kv_scale: Optional[Tensor] = None,
    fixed_split_size: int = 0,
) -> Tuple[Tensor, Tensor]:
    """q ``[T, H, 576]`` -> (out fp64 ``[T, H, 512]``, lse fp64 ``[T, H]``). The queries of sequence
    ``b`` are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``, its last ``q_len`` tokens of
    ``seq_lens[b]``; ``custom_mask`` as :func:`fastinfer.reference.paged_prefill_attention` takes
    it."""
    out = torch.zeros((*q.shape[:2], MLA_LATENT_DIM), dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    mask_offset = 0
    for b, (qs, qe) in enumerate(_lens(cu_seqlens_q)):
        q_len, k_len = qe - qs, int(seq_lens[b])
        m = None
        if custom_mask is not None:
            m = custom_mask[mask_offset : mask_offset + q_len * q_len]
            mask_offset += q_len * q_len
        vis = visibility_mask(q_len, k_len, causal, -1, m)
        rows = gather_latent(kv_cache, block_table[b], k_len, kv_scale).unsqueeze(1)  # one KV head
        out[qs:qe], lse[qs:qe] = attention_fixed_splits(q[qs:qe], rows, rows[..., :MLA_LATENT_DIM], scale, vis,
                                                        0.0, fixed_split_size)
    return out, lse
