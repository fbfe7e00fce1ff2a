"""Python wrappers for the INT8 (W8A8) ops: dynamic int8 quantisation and the scaled int8 GEMM.

Both call ``torch.ops.fastinfer.<op>`` (CPU and CUDA kernels, fake impls; ``torch.ops.fastinfer_sim``
has the same schemas and runs the CUDA kernels on CPU tensors). Bad input raises
``RuntimeError("fastinfer.<op>: <argument> must ..., got ...")``. The oracles are in
:mod:`fastinfer.reference.gemm_int8`; the exact arithmetic in ``cuda/include/fastinfer/gemm/int8.h``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["int8_quantize", "int8_scaled_mm", "int8_azp_adj"]


def int8_quantize(
    x: Tensor, mode: str = "token", scale: Optional[Tensor] = None, symmetric: bool = True,
    azp: Optional[Tensor] = None, *, lib=None,
) -> Tuple[Tensor, ...]:
    """Quantise ``x`` to int8 with dynamic (or, per tensor, given) float32 scales.

    Round to nearest even, saturating, fp32 math (bit-exact on every backend):

    * symmetric: ``scale = max(amax, 1e-12) / 127``, ``q = round(clamp(x / scale, -127, 127))``,
      per row (``mode='token'``, ``scale [M]``) or over the tensor (``mode='tensor'``, ``scale [1]``;
      with ``scale`` given, e.g. a static calibration scale, one pass with it; without, a reduction
      pass first: two kernels, x read twice);
    * static asymmetric (``mode='tensor'``, ``symmetric=False``, ``scale`` and ``azp`` given, 1
      element each; vLLM's ``static_scaled_int8_quant`` with ``azp``):
      ``q = clamp(round(x / scale) + azp, -128, 127)``; returns the given ``azp`` ``[1]``;
    * asymmetric (``symmetric=False``, per token): ``lo = max(-min(x), 0)``,
      ``hi = max(max(x), 0)``, ``scale = max(hi + lo, 1e-12) / 255``,
      ``azp = clamp(round(lo / scale) - 128, -128, 127)`` (int32 [M]),
      ``q = clamp(round(x / scale) + azp, -128, 127)``, so ``x ~= (q - azp) * scale``.

    Non-finite values, on every backend: a NaN makes its row's (or the tensor's) scale NaN, as
    ``amax`` does; int8 has no NaN, so a NaN ``x / scale`` has code 0 (the scale carries the NaN)
    and a NaN row's zero point is 0. An infinity makes the scale infinite and the codes 0 (its own
    too: inf / inf is NaN), at the zero point when asymmetric.

    Args:
        x: ``[M, K]`` float16 / bfloat16 (float32 too on CPU); K a multiple of 8. Strided rows
            (``stride(1) == 1``, ``stride(0)`` any multiple of 8 >= K: a column slice of a wider
            buffer) are read in place; the outputs are contiguous.
        mode: ``'token'`` (default) or ``'tensor'``.
        scale: optional given per-tensor scale (float32, 1 element; only with ``mode='tensor'``).
        symmetric: False for zero points (per token, or the given one per tensor).
        azp: the given zero point (int32, 1 element) of static asymmetric quantisation.

    Returns:
        ``(x_int8 [M, K] int8, scale float32)``, and ``azp int32`` (``[M]``, or ``[1]`` per tensor)
        third when ``symmetric=False``.
    """
    q, s, azp = (lib or torch.ops.fastinfer).int8_quantize(x, mode, scale, bool(symmetric), azp)
    return (q, s) if symmetric else (q, s, azp)


def int8_azp_adj(b: Tensor) -> Tensor:
    """``azp_adj`` of a weight ``b [N, K]`` int8 for :func:`int8_scaled_mm`: ``b.sum(1)`` as int32."""
    return b.sum(1, dtype=torch.int32)


def int8_scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[Tensor] = None,
    azp_adj: Optional[Tensor] = None,
    azp: Optional[Tensor] = None,
    deterministic: bool = False,
    *,
    lib=None,
) -> Tensor:
    """``out = scale_a[m] * scale_b[n] * (a @ b^T - azp[m] * azp_adj[n]) (+ bias[n])``.

    ``a @ b^T`` is accumulated exactly in int32; the epilogue is fp32
    (``fma(float(c), sa * sb, bias)``), rounded once to ``out_dtype``. Scales (float32, contiguous,
    on the device of ``a``): ``scale_a [1]`` (per tensor) or ``[M]`` (per token), ``scale_b [1]``
    or ``[N]`` (per channel), any combination.

    The CUDA kernel is a hand-written ``mma.sync.m16n8k32.s8.s8.s32`` kernel (sm_80+: Ampere, Ada,
    Hopper) with a multi-stage cp.async pipeline and ldmatrix fragments, tiles picked by M. The
    CPU implementation computes the same int32 accumulators exactly (int8 dot products for M <= 4,
    else fp32 GEMMs over K chunks of 1024) and the same epilogue, so CPU and the emulated kernel agree bit for bit.

    Args:
        a: ``[M, K]`` int8 (activations); K a multiple of 16. Its rows may lie further apart
            (``stride(1) == 1``, ``stride(0)`` a multiple of 16 >= K: a column slice of a wider
            buffer, cuBLASLt's ``lda``), read in place.
        b: ``[N, K]`` int8, contiguous row-major (a weight in ``nn.Linear`` layout); N a multiple of 16.
        scale_a, scale_b: see above.
        out_dtype: ``torch.bfloat16`` or ``torch.float16`` (``torch.float32`` too on CPU).
        bias: optional ``[N]`` of ``out_dtype``.
        azp_adj: ``[N]`` int32, ``sum_k b[n, k]`` (:func:`int8_azp_adj`); with ``azp`` only.
        azp: ``[M]`` or ``[1]`` int32 zero points of ``a`` (from ``int8_quantize(..., symmetric=False)``).
        deterministic: batch invariance (a row's bits do not depend on M). The int32 sums are exact
            and never split, so every backend here is batch invariant already; the flag pins that
            for backends that would split K by M.

    Returns:
        A new ``[M, N]`` tensor of ``out_dtype``.
    """
    return (lib or torch.ops.fastinfer).int8_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp,
                                                       bool(deterministic))


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("int8_quantize")
def _int8_quantize_fake(ns, x, mode="token", scale=None, symmetric=True, azp=None):
    op = "int8_quantize"
    check_dim(ns, op, "x", x, 2, "[M, K]")
    same_device(ns, op, "x", x, scale=scale, azp=azp)
    check(ns, op, mode in ("tensor", "token"), f"mode must be 'tensor' or 'token', got '{mode}'")
    scale_shape = (1,) if mode == "tensor" else (x.shape[0],)
    azp = x.new_empty((0,) if symmetric else scale_shape, dtype=torch.int32)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(scale_shape, dtype=torch.float32), azp


@fake("int8_scaled_mm")
def _int8_scaled_mm_fake(ns, a, b, scale_a, scale_b, out_dtype, bias=None, azp_adj=None, azp=None, deterministic=False):
    same_device(ns, "int8_scaled_mm", "a", a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias,
                azp_adj=azp_adj, azp=azp)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
