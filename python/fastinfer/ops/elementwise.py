"""Python wrappers for the fused elementwise ops and the paged KV-cache write.

Each wrapper calls the registered custom op ``torch.ops.fastinfer.<op>`` (CPU and CUDA dispatch
keys; fake impls make them traceable by ``torch.compile``). Validation happens in C++: bad input
raises ``RuntimeError("fastinfer.<op>: <argument> must ..., got ...")``.

Dtypes: float16 and bfloat16 on CUDA; the CPU implementations also accept float32. All math is
fp32 inside with a single rounding to the output dtype. Empty inputs (T = 0) are no-ops.

Strided rows: the norms and activations read (and their ``out=`` / in-place arguments write) any
tensor whose last dim is contiguous and whose leading dims are evenly spaced rows at least a row
apart, e.g. ``qkv[:, :q_size]`` or ``gate_up[..., :2F]`` of a wider buffer, without a copy. The
kernels use 16-byte vectors where the row stride and the pointers allow it and one element per
thread otherwise (any stride works). Returned outputs are contiguous.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

ACTIVATIONS = ("gelu_new", "gelu_fast", "quick_gelu")
"""The names :func:`activation` takes (transformers' ``ACT2FN`` keys)."""

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "rms_norm_quant",
    "fused_add_rms_norm_quant",
    "gated_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "activation",
    "rotary_embedding",
    "reshape_and_cache",
    "build_rope_cache",
]


def rms_norm(
    x: Tensor,
    weight: Optional[Tensor],
    eps: float = 1e-6,
    out: Optional[Tensor] = None,
    *,
    weight_offset: float = 0.0,
    lib=None,
) -> Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset)``.

    Args:
        x: ``[..., H]``, rank >= 1; float16 / bfloat16 (float32 on CPU). Strided rows are read in
            place: the last dim contiguous, the rows evenly spaced at any stride (a column slice of
            a wider buffer such as a fused qkv output; see the module docstring).
        weight: ``[H]``, same dtype and device as ``x``; or None, the weightless RMSNorm
            (``elementwise_affine=False``), which equals a weight of ones bit for bit.
        eps: ``>= 0``.
        out: optional preallocated ``[..., H]`` tensor (same shape/dtype/device as ``x``, rows as
            ``x``); written in place (``rms_norm_out``) and returned.
        weight_offset: added to the weight in float32: 1.0 for the zero-centred weights of Gemma,
            Qwen3.5 and Qwen3-Next (``x_normed * (1 + weight)``, the 1 never rounded to the model
            dtype). Must be 0 without a weight.

    Returns:
        A new tensor shaped like ``x`` (or ``out``). ``x`` is not modified.
    """
    if out is None:
        return (lib or torch.ops.fastinfer).rms_norm(x, weight, float(eps), float(weight_offset))
    (lib or torch.ops.fastinfer).rms_norm_out(out, x, weight, float(eps), float(weight_offset))
    return out


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, weight_offset: float = 0.0, lib=None
) -> Tuple[Tensor, Tensor]:
    """Residual add + RMSNorm, both **in place** (the residual stream of a Llama layer).

    ``residual <- round(fp32(x) + fp32(residual))``; then
    ``x <- rms_norm(residual, weight, eps)`` computed from the rounded residual.

    Args:
        x: ``[..., H]`` (strided rows allowed); overwritten with the normalised output.
        residual: same shape/dtype/device as ``x`` (strided rows allowed); overwritten with the sum.
        weight: ``[H]``, same dtype as ``x``; or None (no weight, as :func:`rms_norm`).
        eps: ``>= 0``.
        weight_offset: as :func:`rms_norm` (1.0 for zero-centred weights).

    Returns:
        ``(x, residual)`` -- the same tensor objects, for chaining.
    """
    (lib or torch.ops.fastinfer).fused_add_rms_norm(x, residual, weight, float(eps), float(weight_offset))
    return x, residual


def rms_norm_quant(
    x: Tensor,
    weight: Optional[Tensor],
    eps: float = 1e-6,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Optional[Tensor] = None,
    *,
    weight_offset: float = 0.0,
    lib=None,
) -> Tuple[Tensor, Tensor]:
    """RMSNorm fused with the activation quantisation of the W8A8 GEMMs (one read of ``x``).

    Bit for bit the unfused pair: :func:`rms_norm` (rounded to ``x``'s dtype, as it returns it)
    followed by ``fp8_quantize`` (``out_dtype=torch.float8_e4m3fn``) or symmetric ``int8_quantize``
    (``out_dtype=torch.int8``) on the ``[rows, H]`` view, on every backend:

    * ``scale=None``: dynamic per-token scales, ``max(amax, 1e-12) / 448`` (e4m3) or ``/ 127``
      (int8) of each normalised row (``mode='token'``);
    * ``scale`` given (float32, 1 element, a static calibration scale): ``mode='tensor'`` with it;
      the returned scale is a copy.

    The quantisers' non-finite rule holds: a NaN in a row makes its dynamic scale NaN and its
    codes NaN (e4m3) or 0 (int8).

    Args:
        x: ``[..., H]``, H >= 1; float16 / bfloat16 (float32 on CPU); strided rows as
            :func:`rms_norm`.
        weight: ``[H]`` or None, as :func:`rms_norm`.
        eps: ``>= 0``.
        out_dtype: ``torch.float8_e4m3fn`` or ``torch.int8``.
        scale: None (per token) or a static per-tensor float32 scale with 1 element, on ``x``'s device.
        weight_offset: as :func:`rms_norm`.

    Returns:
        ``(codes [..., H] of out_dtype, scale float32 [rows] or [1])`` with ``rows = x.numel() / H``;
        ``rms_norm(x) ~= codes.float() * scale`` (per row). ``x`` is not modified.
    """
    return (lib or torch.ops.fastinfer).rms_norm_quant(x, weight, float(eps), out_dtype, scale, float(weight_offset))


def fused_add_rms_norm_quant(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor],
    eps: float = 1e-6,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Optional[Tensor] = None,
    *,
    weight_offset: float = 0.0,
    lib=None,
) -> Tuple[Tensor, Tensor]:
    """Residual add + RMSNorm + quantisation: ``residual <- round(fp32(x) + fp32(residual))`` **in
    place**, then :func:`rms_norm_quant` of the updated residual.

    Bit for bit :func:`fused_add_rms_norm` on the same tensors followed by the quantiser (see
    :func:`rms_norm_quant`); ``x`` is only read (the unfused op overwrites it with the norm).

    Args:
        x: ``[..., H]`` (strided rows allowed), the layer output.
        residual: same shape/dtype/device as ``x`` (strided rows allowed); overwritten with the sum.
        weight, eps, out_dtype, scale, weight_offset: as :func:`rms_norm_quant`.

    Returns:
        ``(codes [..., H], scale float32 [rows] or [1])``.
    """
    return (lib or torch.ops.fastinfer).fused_add_rms_norm_quant(
        x, residual, weight, float(eps), out_dtype, scale, float(weight_offset))


def gated_rms_norm(
    x: Tensor, gate: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, weight_offset: float = 0.0, lib=None
) -> Tensor:
    """Gated RMSNorm: ``rms_norm(x, weight, eps) * silu(gate)``, fp32 inside, one rounding.

    The output norm of Gated DeltaNet layers (Qwen3.5, Qwen3-Next: transformers'
    ``Qwen3_5RMSNormGated``, flash-linear-attention's ``FusedRMSNormGated`` with the norm before
    the gate), applied per head: ``x`` and ``gate`` are ``[..., Dv]`` rows.

    Args:
        x: ``[..., H]`` (strided rows allowed), float16 / bfloat16 (float32 on CPU).
        gate: the shape, dtype and device of ``x`` (strided rows allowed).
        weight: ``[H]``, same dtype as ``x``; or None.
        eps: ``>= 0``.
        weight_offset: as :func:`rms_norm`.

    Returns:
        A new tensor shaped like ``x``. transformers rounds the normalised ``x`` and its product
        with the weight to the model dtype before the gate; this op rounds once (the same in
        float32).
    """
    return (lib or torch.ops.fastinfer).gated_rms_norm(x, gate, weight, float(eps), float(weight_offset))


def silu_and_mul(x: Tensor, out: Optional[Tensor] = None, *, lib=None) -> Tensor:
    """SwiGLU gate: ``out = silu(x[..., :F]) * x[..., F:]``.

    Args:
        x: ``[..., 2F]`` (the fused gate/up projection output; strided rows allowed).
        out: optional preallocated ``[..., F]`` tensor (same dtype/device, strided rows allowed), written in
            place (``silu_and_mul_out``) and returned.

    Returns:
        ``[..., F]``. ``x`` is not modified.
    """
    if out is None:
        return (lib or torch.ops.fastinfer).silu_and_mul(x)
    (lib or torch.ops.fastinfer).silu_and_mul_out(out, x)
    return out


def gelu_and_mul(x: Tensor, out: Optional[Tensor] = None, *, lib=None) -> Tensor:
    """GeGLU gate with the exact (erf) gelu: ``out = gelu(x[..., :F]) * x[..., F:]``,
    ``gelu(a) = a / 2 * (1 + erf(a / sqrt(2)))`` (``torch.nn.functional.gelu``, transformers'
    ``gelu``).

    Args:
        x: ``[..., 2F]`` (the fused gate/up projection output; strided rows allowed).
        out: optional preallocated ``[..., F]`` tensor (same dtype/device, strided rows allowed), written in
            place (``gelu_and_mul_out``) and returned.

    Returns:
        ``[..., F]``. ``x`` is not modified.
    """
    if out is None:
        return (lib or torch.ops.fastinfer).gelu_and_mul(x)
    (lib or torch.ops.fastinfer).gelu_and_mul_out(out, x)
    return out


def activation(x: Tensor, activation: str, out: Optional[Tensor] = None, *, lib=None) -> Tensor:
    """An elementwise activation by transformers' name (``ACT2FN`` key), fp32 inside, one rounding:

    * ``"gelu_new"``: ``x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))``;
    * ``"gelu_fast"``: ``x / 2 * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 x^2)))``;
    * ``"quick_gelu"``: ``x * sigmoid(1.702 x)`` (vLLM's ``gelu_quick``).

    Any other name raises.

    Args:
        x: any shape (strided rows allowed); float16 / bfloat16 (float32 on CPU).
        out: optional preallocated tensor shaped like ``x`` (same dtype/device, strided rows allowed),
            written in place (``activation_out``) and returned.

    Returns:
        A tensor shaped like ``x`` (or ``out``). ``x`` is not modified.
    """
    if out is None:
        return (lib or torch.ops.fastinfer).activation(x, activation)
    (lib or torch.ops.fastinfer).activation_out(out, x, activation)
    return out


def gelu_tanh_and_mul(x: Tensor, out: Optional[Tensor] = None, *, lib=None) -> Tensor:
    """GeGLU gate (Gemma): ``out = gelu(x[..., :F]) * x[..., F:]``, gelu's tanh approximation
    (``torch.nn.functional.gelu(approximate="tanh")``, transformers' ``gelu_pytorch_tanh``).

    Args:
        x: ``[..., 2F]`` (the fused gate/up projection output; strided rows allowed).
        out: optional preallocated ``[..., F]`` tensor (same dtype/device, strided rows allowed), written in
            place (``gelu_tanh_and_mul_out``) and returned.

    Returns:
        ``[..., F]``. ``x`` is not modified.
    """
    if out is None:
        return (lib or torch.ops.fastinfer).gelu_tanh_and_mul(x)
    (lib or torch.ops.fastinfer).gelu_tanh_and_mul_out(out, x)
    return out


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool = True, *, lib=None
) -> Tuple[Tensor, Tensor]:
    """Apply RoPE to ``q`` and ``k`` **in place**.

    Args:
        positions: ``[T]`` int64 or int32, ``0 <= p < max_pos``.
        q: ``[T, Hq, D]``; k: ``[T, Hkv, D]``; same dtype. The last two dims must be contiguous
            (``stride(-1) == 1``, ``stride(-2) == D``); the token stride is free, so views into a
            fused qkv projection output ``[T, (Hq + 2*Hkv) * D]`` work without copies.
        cos_sin_cache: ``[max_pos, R]`` contiguous, float32 or ``q.dtype``; row ``p`` is
            ``cat(cos, sin)`` (each ``R/2`` wide), see :func:`build_rope_cache`. ``R`` even,
            ``R <= D``; only the first ``R`` dims of each head rotate (partial rotary).
        is_neox: True rotates halves (HF Llama), False rotates interleaved pairs (GPT-J).

    Returns:
        ``(q, k)`` -- the same tensor objects.
    """
    (lib or torch.ops.fastinfer).rotary_embedding(positions, q, k, cos_sin_cache, bool(is_neox))
    return q, k


def reshape_and_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    *,
    lib=None,
) -> None:
    """Write new tokens' K/V into the paged cache, **in place** on ``k_cache`` / ``v_cache``.

    Token ``t`` goes to ``cache.view(NB*BS, Hkv, D)[slot_mapping[t]]``; slot ``-1`` is skipped
    (padding). Slots outside ``[-1, NB*BS)`` are an error (always checked for CPU tensors; on CUDA
    only with ``FASTINFER_CHECK_INDICES=1``).

    Args:
        k, v: ``[T, Hkv, D]`` float16/bfloat16 (float32 on CPU); last two dims contiguous, any
            token stride.
        k_cache, v_cache: ``[NB, BS, Hkv, D]`` contiguous, dtype ``k.dtype`` or
            ``torch.float8_e4m3fn``.
        slot_mapping: ``[T]`` int64 or int32.
        k_scale, v_scale: contiguous float32 tensors on the same device with one element (per
            tensor) or ``Hkv`` elements (per KV head), required for an fp8 cache (stored value
            ``e4m3(clamp(k / k_scale[h], -448, 448))`` for KV head ``h``, round to nearest even,
            saturating) and must be None otherwise. The attention ops read the cache with the
            same scales.
    """
    (lib or torch.ops.fastinfer).reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def build_rope_cache(
    max_pos: int,
    rotary_dim: int,
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Tensor:
    """Build the ``cos_sin_cache`` for :func:`rotary_embedding`.

    ``inv_freq[i] = theta ** (-2i / rotary_dim)`` for ``i < rotary_dim / 2``;
    ``angle[p, i] = p * inv_freq[i]``; returns ``cat(cos(angle), sin(angle), -1)`` of shape
    ``[max_pos, rotary_dim]`` computed in float64 and rounded once to ``dtype``.
    (Frequency scaling schemes such as Llama-3.1's are applied by the caller to ``inv_freq``;
    this helper implements the plain RoPE table.)
    """
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if max_pos <= 0:
        raise ValueError(f"max_pos must be positive, got {max_pos}")
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64)
    inv_freq = 1.0 / (float(theta) ** (i / rotary_dim))
    pos = torch.arange(max_pos, dtype=torch.float64)
    ang = torch.outer(pos, inv_freq)
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
    return cache.to(dtype=dtype, device=device).contiguous()


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("rms_norm")
def _rms_norm_fake(ns, x, weight, eps, weight_offset=0.0):
    same_device(ns, "rms_norm", "x", x, weight=weight)
    if weight is not None:
        check_dim(ns, "rms_norm", "weight", weight, 1, "[hidden]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@fake("rms_norm_out")
def _rms_norm_out_fake(ns, out, x, weight, eps, weight_offset=0.0):
    same_device(ns, "rms_norm_out", "x", x, out=out, weight=weight)


@fake("fused_add_rms_norm")
def _fused_add_rms_norm_fake(ns, x, residual, weight, eps, weight_offset=0.0):
    same_device(ns, "fused_add_rms_norm", "x", x, residual=residual, weight=weight)


def _rms_norm_quant_fake_outputs(ns, op, x, weight, out_dtype, scale, **others):
    same_device(ns, op, "x", x, weight=weight, scale=scale, **others)
    check(ns, op, x.dim() >= 1, "x must have shape [..., hidden], got a 0-D tensor")
    check(ns, op, out_dtype in (torch.float8_e4m3fn, torch.int8),
          f"out_dtype must be torch.float8_e4m3fn or torch.int8, got {out_dtype}")
    rows = x.numel() // x.shape[-1] if x.shape[-1] != 0 else 0
    codes = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    return codes, x.new_empty((1,) if scale is not None else (rows,), dtype=torch.float32)


@fake("rms_norm_quant")
def _rms_norm_quant_fake(ns, x, weight, eps, out_dtype, scale=None, weight_offset=0.0):
    return _rms_norm_quant_fake_outputs(ns, "rms_norm_quant", x, weight, out_dtype, scale)


@fake("fused_add_rms_norm_quant")
def _fused_add_rms_norm_quant_fake(ns, x, residual, weight, eps, out_dtype, scale=None, weight_offset=0.0):
    return _rms_norm_quant_fake_outputs(ns, "fused_add_rms_norm_quant", x, weight, out_dtype, scale,
                                        residual=residual)


@fake("gated_rms_norm")
def _gated_rms_norm_fake(ns, x, gate, weight, eps, weight_offset=0.0):
    same_device(ns, "gated_rms_norm", "x", x, gate=gate, weight=weight)
    check(ns, "gated_rms_norm", gate.shape == x.shape,
          f"gate must have the shape of x {list(x.shape)}, got {list(gate.shape)}")
    if weight is not None:
        check_dim(ns, "gated_rms_norm", "weight", weight, 1, "[hidden]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@fake("silu_and_mul")
def _silu_and_mul_fake(ns, x):
    check(ns, "silu_and_mul", x.dim() >= 1, "x must have shape [..., 2 * F], got a 0-D tensor")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@fake("silu_and_mul_out")
def _silu_and_mul_out_fake(ns, out, x):
    same_device(ns, "silu_and_mul_out", "x", x, out=out)


@fake("gelu_and_mul")
def _gelu_and_mul_fake(ns, x):
    check(ns, "gelu_and_mul", x.dim() >= 1, "x must have shape [..., 2 * F], got a 0-D tensor")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@fake("gelu_and_mul_out")
def _gelu_and_mul_out_fake(ns, out, x):
    same_device(ns, "gelu_and_mul_out", "x", x, out=out)


@fake("activation")
def _activation_fake(ns, x, activation):
    check(ns, "activation", activation in ACTIVATIONS,
          f"activation must be 'gelu_new', 'gelu_fast' or 'quick_gelu', got '{activation}'")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@fake("activation_out")
def _activation_out_fake(ns, out, x, activation):
    same_device(ns, "activation_out", "x", x, out=out)


@fake("gelu_tanh_and_mul")
def _gelu_tanh_and_mul_fake(ns, x):
    check(ns, "gelu_tanh_and_mul", x.dim() >= 1, "x must have shape [..., 2 * F], got a 0-D tensor")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@fake("gelu_tanh_and_mul_out")
def _gelu_tanh_and_mul_out_fake(ns, out, x):
    same_device(ns, "gelu_tanh_and_mul_out", "x", x, out=out)


@fake("rotary_embedding")
def _rotary_embedding_fake(ns, positions, q, k, cos_sin_cache, is_neox=True):
    same_device(ns, "rotary_embedding", "q", q, positions=positions, k=k, cos_sin_cache=cos_sin_cache)


@fake("reshape_and_cache")
def _reshape_and_cache_fake(ns, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    same_device(ns, "reshape_and_cache", "k", k, v=v, k_cache=k_cache, v_cache=v_cache,
                slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)
