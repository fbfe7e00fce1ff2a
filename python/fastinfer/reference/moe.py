"""fp64 oracles of the MoE routing ops (docs/design.md "Mixture of experts").

``moe_topk``: the ``top_k`` largest logits of each row (descending, ties to the lower expert id,
NaN before every number, as torch.topk), weighted by the softmax over all experts (``scoring='softmax'``,
optionally renormalised over the selected) or by the softmax over the selected logits
(``scoring='topk_softmax'``). NaN propagates through the arithmetic as in ``torch.softmax``.

``moe_align``: vLLM's ``moe_align_block_size`` layout (the golden ``torch_moe_align_block_size`` of
vLLM's tests/kernels/moe/test_moe_align_block_size.py, which also orders an expert's slots
ascending), with ``-1`` ids skipped.

``fused_moe``: the expert MLPs of each token's slots in fp64, weighted and summed; the two roundings
of the contract (the activation ``a`` rounded to x's dtype between the two GEMMs, and each slot's
``y`` before the weighted sum) applied, so the reference is what an exact implementation of the
contract computes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

__all__ = ["moe_topk", "moe_align", "expert_order", "expert_activation", "fused_moe", "fused_moe_fp8",
           "fp8_fake_quantize", "int4_expert_weights", "fused_moe_int4",
           "fp4_expert_weights", "fused_moe_fp4"]


def expert_order(router_logits: Tensor) -> Tensor:
    """The experts of each row from first to last: descending logit, ties to the lower id, NaN first
    (as ``torch.topk``, whose order among equal values is left unspecified)."""
    x = router_logits.double()
    by_value = torch.sort(torch.where(x.isnan(), float("-inf"), x), dim=-1, descending=True, stable=True).indices
    nan_first = torch.sort(x.isnan().gather(-1, by_value).to(torch.uint8), dim=-1, descending=True, stable=True).indices
    return by_value.gather(-1, nan_first)


def moe_topk(router_logits: Tensor, top_k: int, renormalize: bool = False,
             scoring: str = "softmax") -> Tuple[Tensor, Tensor]:
    """``(topk_weights [T, top_k] float64, topk_ids [T, top_k] int64)``."""
    x = router_logits.double()
    ids = expert_order(x)[:, :top_k]
    if scoring == "softmax":
        weights = torch.softmax(x, dim=-1).gather(-1, ids)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    elif scoring == "topk_softmax":
        weights = torch.softmax(x.gather(-1, ids), dim=-1)
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    return weights, ids


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, int32, built expert by expert."""
    ids = topk_ids.flatten().long()
    num_slots = ids.numel()
    sorted_size = num_slots + num_experts * (block_m - 1)
    sorted_token_ids = torch.full((sorted_size,), num_slots, dtype=torch.int32)
    expert_ids = torch.zeros((sorted_size + block_m - 1) // block_m, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        slots = (ids == e).nonzero().flatten()  # ascending
        padded = -(-slots.numel() // block_m) * block_m
        sorted_token_ids[pos:pos + slots.numel()] = slots.int()
        expert_ids[pos // block_m:(pos + padded) // block_m] = e
        pos += padded
    return sorted_token_ids, expert_ids, torch.tensor([pos], dtype=torch.int32)


def expert_activation(gate: Tensor, up: Tensor, activation: str = "silu", swiglu_alpha: Optional[float] = None,
                      swiglu_limit: Optional[float] = None) -> Tensor:
    """``silu(gate) * up``, or gpt-oss's clamped swiglu (``'swiglu_oai'``), in the inputs' dtype."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swiglu_oai":
        g = gate.clamp(max=swiglu_limit)
        u = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return (u + 1) * g * torch.sigmoid(g * swiglu_alpha)
    raise ValueError(f"unknown activation {activation!r}")


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, activation: str = "silu",
              swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None,
              w13_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None) -> Tensor:
    """``out [T, H]`` float64; the activation rounded to ``x.dtype`` before the second GEMM, and each
    slot's ``y`` before the weighted sum."""
    T, H = x.shape
    I = w13.shape[1] // 2
    xd, ids, weights = x.double(), topk_ids.long(), topk_weights.double()
    out = torch.zeros(T, H, dtype=torch.float64)
    for e in ids[ids >= 0].unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = xd[tokens] @ w13[e].double().T
        if w13_bias is not None:
            h = h + w13_bias[e].double()
        a = expert_activation(h[:, :I], h[:, I:], activation, swiglu_alpha, swiglu_limit)
        y = a.to(x.dtype).double() @ w2[e].double().T
        if w2_bias is not None:
            y = y + w2_bias[e].double()
        y = y.to(x.dtype).double()
        out.index_add_(0, tokens, weights[tokens, slots, None] * y)
    return out


ACT_GROUP = 64  # fused_moe_fp8 quantises each activation row in groups of 64


def fp8_fake_quantize(v: Tensor, group: Optional[int] = None) -> Tensor:
    """``v`` (rows) quantised to e4m3 and back, fp64: per row, or per ``group`` consecutive elements
    of a row (the last one shorter where ``group`` does not divide the row);
    ``s = max(amax, 1e-12) / 448`` and ``e4m3(clamp(v / s))`` in fp32, as fp8_quantize."""
    rows, K = v.shape
    parts = []
    for g in v.float().split(group or K, dim=1):
        s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        parts.append(q.double() * s.double())
    return torch.cat(parts, dim=1)


def _dequantize_experts(w: Tensor, scale: Tensor) -> Tensor:
    """[E, N, K] e4m3 weights times their per-row [E, N] or 128 x 128 block [E, N/128, K/128] scales, fp64."""
    if scale.dim() == 2:
        return w.double() * scale.double()[:, :, None]
    full = scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return w.double() * full[:, :w.shape[1], :w.shape[2]]


def fused_moe_fp8(x: Tensor, w13: Tensor, w2: Tensor, w13_scale: Tensor, w2_scale: Tensor, topk_weights: Tensor,
                  topk_ids: Tensor, activation: str = "silu", swiglu_alpha: Optional[float] = None,
                  swiglu_limit: Optional[float] = None, w13_bias: Optional[Tensor] = None,
                  w2_bias: Optional[Tensor] = None) -> Tensor:
    """``out [T, H]`` float64: x quantised per row (per-channel scales) or per 128-group (blockwise),
    each activation row per 64-group, the dequantised weights, then :func:`fused_moe`'s computation
    in fp64."""
    T, H = x.shape
    I = w13.shape[1] // 2
    group = 128 if w13_scale.dim() == 3 else None
    xq = fp8_fake_quantize(x, group)
    W13, W2 = _dequantize_experts(w13, w13_scale), _dequantize_experts(w2, w2_scale)
    ids, weights = topk_ids.long(), topk_weights.double()
    out = torch.zeros(T, H, dtype=torch.float64)
    for e in ids[ids >= 0].unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = xq[tokens] @ W13[e].T
        if w13_bias is not None:
            h = h + w13_bias[e].double()
        a = expert_activation(h[:, :I], h[:, I:], activation, swiglu_alpha, swiglu_limit).to(x.dtype)
        y = fp8_fake_quantize(a, ACT_GROUP) @ W2[e].T
        if w2_bias is not None:
            y = y + w2_bias[e].double()
        y = y.to(x.dtype).double()
        out.index_add_(0, tokens, weights[tokens, slots, None] * y)
    return out


def int4_expert_weights(packed: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                        dtype: torch.dtype) -> Tensor:
    """[E, N, K] in ``dtype``: each expert's int4_pack words unpacked (:func:`fastinfer.reference.gemm.int4_unpack`)
    and dequantised, ``(q - z) * s`` rounded once to ``dtype``."""
    from .gemm import int4_dequantize, int4_unpack

    return torch.stack([int4_dequantize(int4_unpack(packed[e]), scales[e], None if zeros is None else zeros[e],
                                        group_size, dtype=dtype).to(dtype) for e in range(packed.shape[0])])


def fused_moe_int4(x: Tensor, w13: Tensor, w2: Tensor, w13_scales: Tensor, w2_scales: Tensor,
                   w13_zeros: Optional[Tensor], w2_zeros: Optional[Tensor], topk_weights: Tensor, topk_ids: Tensor,
                   group_size: int = 128, activation: str = "silu", swiglu_alpha: Optional[float] = None,
                   swiglu_limit: Optional[float] = None, w13_bias: Optional[Tensor] = None,
                   w2_bias: Optional[Tensor] = None) -> Tensor:
    """``out [T, H]`` float64: :func:`fused_moe` on the dequantised experts (rounded to x's dtype)."""
    W13 = int4_expert_weights(w13, w13_scales, w13_zeros, group_size, x.dtype)
    W2 = int4_expert_weights(w2, w2_scales, w2_zeros, group_size, x.dtype)
    return fused_moe(x, W13, W2, topk_weights, topk_ids, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias)


def fp4_expert_weights(packed: Tensor, scales: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """[E, N, K] float64: each expert's fp4_repack words unpacked (:func:`fastinfer.reference.gemm.int4_unpack`:
    the same layout, e2m1 codes as nibbles) and decoded as fp4_gemm's weight
    (:func:`fastinfer.reference.fp4.fp4_gemm_weight`: rounded to ``dtype``)."""
    from .fp4 import fp4_gemm_weight
    from .gemm import int4_unpack

    return torch.stack([fp4_gemm_weight(int4_unpack(packed[e]).to(torch.uint8), scales[e], fmt, dtype)
                        for e in range(packed.shape[0])])


def fused_moe_fp4(x: Tensor, w13: Tensor, w2: Tensor, w13_scales: Tensor, w2_scales: Tensor,
                  w13_global_scale: Optional[Tensor], w2_global_scale: Optional[Tensor], topk_weights: Tensor,
                  topk_ids: Tensor, format: str = "nvfp4", activation: str = "silu",
                  swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None,
                  w13_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None) -> Tensor:
    """``out [T, H]`` float64: :func:`fused_moe` on the decoded experts (rounded to x's dtype), each
    divided by its global scale (gate and up rows by theirs) in fp64."""
    W13 = fp4_expert_weights(w13, w13_scales, format, x.dtype)
    W2 = fp4_expert_weights(w2, w2_scales, format, x.dtype)
    if w13_global_scale is not None:
        I = W13.shape[1] // 2
        W13 = W13 / w13_global_scale.double().repeat_interleave(I, dim=1)[:, :, None]
        W2 = W2 / w2_global_scale.double()[:, None, None]
    return fused_moe(x, W13, W2, topk_weights, topk_ids, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias)
