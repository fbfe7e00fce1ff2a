"""fp64 oracles for the fused elementwise ops and the KV-cache write.

Every function here is *functional*: it never mutates its arguments and returns new tensors.
Unless stated otherwise the math is carried out in float64 and the result is returned in float64,
so that the error of an implementation can be measured against it (see ``tests/conftest.py``).

These functions are the executable specification of the ops in ``torch.ops.fastinfer``; where the
op contract prescribes an intermediate rounding (the residual of ``fused_add_rms_norm``, the fp8
cache encoding of ``reshape_and_cache``) the oracle models that rounding exactly.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .gemm_fp8 import fp8_quantize
from .gemm_int8 import int8_quantize

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "gated_rms_norm",
    "rms_norm_quant",
    "fused_add_rms_norm_quant",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gelu_new",
    "gelu_fast",
    "quick_gelu",
    "rotary_embedding",
    "reshape_and_cache",
    "fp8_e4m3_quantize",
    "FP8_E4M3_MAX",
]

FP8_E4M3_MAX = 448.0
"""Largest finite value of ``torch.float8_e4m3fn``."""

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dimension.

    ``out = x * rsqrt(mean(x ** 2, dim=-1) + eps) * (weight + weight_offset)``

    Args:
        x: ``[..., H]`` any floating dtype.
        weight: ``[H]``, or None: no weight (``torch.nn.RMSNorm(elementwise_affine=False)``).
        eps: ``>= 0``.
        weight_offset: 1.0 for zero-centred weights (Gemma, Qwen3.5: ``* (1 + weight)``); 0 without
            a weight.

    Returns:
        ``[..., H]`` float64.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    x64 = x.to(torch.float64)
    ms = x64.square().mean(dim=-1, keepdim=True)
    if weight is None:
        if weight_offset != 0:
            raise ValueError(f"weight_offset must be 0 without a weight, got {weight_offset}")
        return x64 * torch.rsqrt(ms + eps)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}], got {list(weight.shape)}")
    return x64 * torch.rsqrt(ms + eps) * (weight.to(torch.float64) + weight_offset)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float = 0.0) -> Tensor:
    """Gated RMSNorm (Gated DeltaNet's output norm): ``rms_norm(x, weight, eps, weight_offset) * silu(gate)``.

    Returns:
        ``[..., H]`` float64.
    """
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {list(x.shape)}, got {list(gate.shape)}")
    z = gate.to(torch.float64)
    return rms_norm(x, weight, eps, weight_offset) * z * torch.sigmoid(z)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float = 0.0
) -> Tuple[Tensor, Tensor]:
    """Residual add followed by RMSNorm (one Llama residual-stream step).

    Math (the op contract):

    * ``residual_out = round_dtype(fp32(x) + fp32(residual))`` -- the sum is formed in float32
      and rounded *once* to ``x.dtype``; this rounded value is what the op stores into
      ``residual`` and it is also what gets normalised.
    * ``x_out = rms_norm(residual_out, weight, eps)`` -- computed in float64 here (fp32 inside the
      kernels) from the *rounded* residual.

    Modelling the rounding of the residual matters: normalising the unrounded fp64 sum would put a
    whole bf16 ulp of disagreement into ``x_out`` that no correct kernel could remove.

    Returns:
        ``(x_out, residual_out)``, both float64. ``residual_out`` holds values exactly
        representable in ``x.dtype`` (so an implementation should match it bit for bit).
    """
    if x.shape != residual.shape:
        raise ValueError(f"residual must have shape {list(x.shape)}, got {list(residual.shape)}")
    res = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    return rms_norm(res, weight, eps, weight_offset), res.to(torch.float64)


def rms_norm_quant(
    x: Tensor, weight: Optional[Tensor], eps: float, out_dtype: torch.dtype, scale: Optional[Tensor] = None,
    weight_offset: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """RMSNorm, rounded to ``x.dtype`` (what the unfused op returns), then quantised: e4m3 as
    :func:`fastinfer.reference.fp8_quantize`, int8 as :func:`fastinfer.reference.int8_quantize`
    (symmetric), per token (``scale=None``) or per tensor with the given scale.

    Returns:
        ``(codes [..., H] of out_dtype, scale float32 [rows] or [1])``.
    """
    normed = rms_norm(x, weight, eps, weight_offset).to(x.dtype).reshape(-1, x.shape[-1])
    mode = "token" if scale is None else "tensor"
    if out_dtype == torch.float8_e4m3fn:
        q, s = fp8_quantize(normed, mode, scale=scale)
    elif out_dtype == torch.int8:
        q, s = int8_quantize(normed, mode, scale=scale)[:2]
    else:
        raise ValueError(f"out_dtype must be torch.float8_e4m3fn or torch.int8, got {out_dtype}")
    return q.reshape(x.shape), s


def fused_add_rms_norm_quant(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, out_dtype: torch.dtype,
    scale: Optional[Tensor] = None, weight_offset: float = 0.0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``residual_out = round_dtype(fp32(x) + fp32(residual))`` (as :func:`fused_add_rms_norm`), then
    :func:`rms_norm_quant` of it.

    Returns:
        ``(codes, scale, residual_out float64)``.
    """
    if x.shape != residual.shape:
        raise ValueError(f"residual must have shape {list(x.shape)}, got {list(residual.shape)}")
    res = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    q, s = rms_norm_quant(res, weight, eps, out_dtype, scale, weight_offset)
    return q, s, res.to(torch.float64)


def _gate_up(x: Tensor) -> Tuple[Tensor, Tensor]:
    """The gate and up halves ``x[..., :F]``, ``x[..., F:]`` of ``x [..., 2F]``, in float64."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"x last dim must be even, got {x.shape[-1]}")
    x64 = x.to(torch.float64)
    f = x.shape[-1] // 2
    return x64[..., :f], x64[..., f:]


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU gate: ``out = silu(x[..., :F]) * x[..., F:]`` with ``silu(a) = a * sigmoid(a)``;
    ``x [..., 2F]`` -> ``[..., F]`` float64."""
    a, b = _gate_up(x)
    return a * torch.sigmoid(a) * b


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """GeGLU gate (Gemma): ``out = gelu(x[..., :F]) * x[..., F:]`` with the tanh approximation
    ``gelu(a) = a / 2 * (1 + tanh(sqrt(2 / pi) * (a + 0.044715 a^3)))`` (what
    ``torch.nn.functional.gelu(approximate="tanh")`` computes and transformers calls
    ``gelu_pytorch_tanh``); ``x [..., 2F]`` -> ``[..., F]`` float64."""
    a, b = _gate_up(x)
    return 0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3))) * b


def gelu_and_mul(x: Tensor) -> Tensor:
    """GeGLU gate with the exact gelu: ``out = gelu(x[..., :F]) * x[..., F:]`` with
    ``gelu(a) = a / 2 * (1 + erf(a / sqrt(2)))`` (``torch.nn.functional.gelu``'s default,
    transformers' ``gelu``, vLLM's ``GeluAndMul(approximate="none")``); ``x [..., 2F]`` ->
    ``[..., F]`` float64."""
    a, b = _gate_up(x)
    return 0.5 * a * (1.0 + torch.erf(a / math.sqrt(2.0))) * b


# The plain activations as transformers defines them (src/transformers/activations.py), in float64.


def gelu_new(x: Tensor) -> Tensor:
    """transformers' ``NewGELUActivation`` (``ACT2FN["gelu_new"]``, GPT-2's gelu):
    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))``; float64."""
    x = x.to(torch.float64)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: Tensor) -> Tensor:
    """transformers' ``FastGELUActivation`` (``ACT2FN["gelu_fast"]``):
    ``0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))``; float64."""
    x = x.to(torch.float64)
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x: Tensor) -> Tensor:
    """transformers' ``QuickGELUActivation`` (``ACT2FN["quick_gelu"]``, CLIP's):
    ``x * sigmoid(1.702 * x)``; float64."""
    x = x.to(torch.float64)
    return x * torch.sigmoid(1.702 * x)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, rot: int, is_neox: bool) -> Tensor:
    # x: [T, H, D] float64; cos/sin: [T, 1, rot/2] float64
    out = x.clone()
    half = rot // 2
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:rot]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rot] = x2 * cos + x1 * sin
    else:
        xe, xo = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = xe * cos - xo * sin
        out[..., 1:rot:2] = xo * cos + xe * sin
    return out


def rotary_embedding(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    cos_sin_cache: Tensor,
    is_neox: bool = True,
) -> Tuple[Tensor, Tensor]:
    """Rotary position embedding (RoPE), possibly partial.

    ``cos_sin_cache`` is ``[max_pos, R]``; its row ``p`` is ``cat(cos[R/2], sin[R/2])`` for position
    ``p``. Only the first ``R <= D`` dims of every head rotate; dims ``R..D`` pass through unchanged.
    The cache values are used exactly as given (if the cache is bf16 its rounded values *are* the
    cos/sin the op must use).

    * ``is_neox=True`` (HF Llama, "rotate half"): with ``x1 = x[:R/2]``, ``x2 = x[R/2:R]``:
      ``out1 = x1*cos - x2*sin``, ``out2 = x2*cos + x1*sin``.
    * ``is_neox=False`` (GPT-J, interleaved): the pair ``(x[2i], x[2i+1])`` uses ``cos[i], sin[i]``:
      ``out[2i] = x[2i]*cos[i] - x[2i+1]*sin[i]``, ``out[2i+1] = x[2i+1]*cos[i] + x[2i]*sin[i]``.

    Args:
        positions: ``[T]`` integer, ``0 <= p < max_pos``.
        q: ``[T, Hq, D]``; k: ``[T, Hkv, D]`` (any strides).

    Returns:
        ``(q_out, k_out)`` float64, same shapes as ``q`` and ``k``.
    """
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got {positions.dim()}-D")
    t = positions.shape[0]
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != t or k.shape[0] != t:
        raise ValueError("q and k must be [T, H, D] with T = positions.numel()")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError("q and k must have the same head dim")
    max_pos, rot = cos_sin_cache.shape
    if rot % 2 != 0 or rot > d:
        raise ValueError(f"cos_sin_cache width must be even and <= {d}, got {rot}")
    pos = positions.to(torch.int64)
    if t > 0 and (int(pos.min()) < 0 or int(pos.max()) >= max_pos):
        raise ValueError(f"positions must lie in [0, {max_pos})")
    rows = cos_sin_cache.to(torch.float64)[pos]  # [T, R]
    cos = rows[:, : rot // 2].unsqueeze(1)
    sin = rows[:, rot // 2 :].unsqueeze(1)
    q_out = _rotate(q.to(torch.float64), cos, sin, rot, is_neox)
    k_out = _rotate(k.to(torch.float64), cos, sin, rot, is_neox)
    return q_out, k_out


def fp8_e4m3_quantize(x: Tensor, scale: Tensor) -> Tensor:
    """``e4m3(clamp(fp32(x) / fp32(scale), -448, 448))`` with round-to-nearest-even.

    The quotient is formed in float32 (IEEE division, correctly rounded), clamped to the finite
    range (saturating: e4m3fn has no infinity and would otherwise produce NaN) and converted with
    torch's round-to-nearest-even cast. Bit-exact model of the kernels' fp8 cache encoding.
    """
    q = x.to(torch.float32) / scale.to(torch.float32)
    return q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def reshape_and_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Scatter the new tokens' K/V into the paged cache.

    For every token ``t`` with ``s = slot_mapping[t]``:

    * ``s == -1``: skipped (padding token);
    * ``0 <= s < NB*BS``: ``cache.view(NB*BS, Hkv, D)[s] = enc(k[t])`` (block ``s // BS``,
      offset ``s % BS``);
    * anything else is an error.

    ``enc`` is the identity for a cache of ``k.dtype`` and :func:`fp8_e4m3_quantize` (with
    ``k_scale`` / ``v_scale``) for a ``float8_e4m3fn`` cache. Cache rows that no slot names keep
    their previous contents.

    Returns:
        ``(k_cache_out, v_cache_out)``: float64 copies for a same-dtype cache (the copy is exact),
        ``float8_e4m3fn`` tensors for an fp8 cache (compare their bits).
    """
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [NB, BS, Hkv, D]")
    nb, bs, hkv, d = k_cache.shape
    n = nb * bs
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= n):
        raise ValueError(f"slot_mapping must lie in [-1, {n})")
    keep = slots >= 0
    idx = slots[keep]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("k_scale and v_scale are required for an fp8 cache")

    outs = []
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if fp8:
            out = cache.clone().view(n, hkv, d)
            # one scale per tensor, or per KV head (broadcast over [tokens, Hkv, D])
            out[idx] = fp8_e4m3_quantize(src[keep], scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
        else:
            out = cache.to(torch.float64).reshape(n, hkv, d)
            out[idx] = src[keep].to(torch.float64)
        outs.append(out.view(nb, bs, hkv, d))
    return outs[0], outs[1]
