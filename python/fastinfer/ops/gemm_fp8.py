"""Python wrappers for the FP8 (W8A8) ops: dynamic e4m3 quantisation and the scaled e4m3 GEMM.

Both call ``torch.ops.fastinfer.<op>`` (CPU and CUDA kernels, fake impls; ``torch.ops.fastinfer_sim``
has the same schemas and runs the CUDA kernels on CPU tensors). Bad input raises
``RuntimeError("fastinfer.<op>: <argument> must ..., got ...")``. The fp64 oracles are in
:mod:`fastinfer.reference.gemm_fp8`.

e4m3 is ``torch.float8_e4m3fn`` (max finite 448, no infinities).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["fp8_quantize", "fp8_scaled_mm"]


def fp8_quantize(
    x: Tensor, mode: str = "token", group_size: int = 128, scale: Optional[Tensor] = None, *, lib=None
) -> Tuple[Tensor, Tensor]:
    """Quantise ``x`` to e4m3 with dynamic (or, per tensor, given) float32 scales.

    ``q = e4m3_rne(clamp(x.float() / scale, -448, 448))`` (saturating), with
    ``scale = max(amax, 1e-12) / 448`` over the quantisation unit:

    * ``mode='token'``: one scale per row, ``scale [M]`` (activations; pairs with a per-channel
      weight scale in :func:`fp8_scaled_mm`). One CTA per row, one read of x for K <= 8192.
    * ``mode='group'``: one scale per ``group_size`` consecutive elements of a row,
      ``scale [M, K / group_size]`` (``group_size=128`` gives the ``scale_a`` of the blockwise GEMM).
      ``group_size`` is a power of two in [8, 256] dividing K. One read of x.
    * ``mode='tensor'``: one scale ``[1]``. With ``scale`` given (float32, 1 element, e.g. a
      static calibration scale) the data is quantised with it in one pass (the returned scale is a
      copy); without, a reduction pass computes the amax first (two kernels, x read twice).

    * Static scales: ``scale`` given with ``mode='token'`` (``[M]``), ``'group'``
      (``[M, K / group_size]``) or ``'channel'`` (``[K]``, one per column; this mode takes only a
      given scale) quantises with them in one pass: ``q[m, k] = e4m3(clamp(x[m, k] / scale[unit]))``;
      the returned scale is a copy.

    Non-finite values, on every backend: a NaN makes its unit's scale NaN (as ``amax`` does) and
    every code under that scale NaN; an infinity makes the scale infinite, its own code NaN and the
    unit's finite values 0. With a given scale a NaN value's code is NaN and an infinity saturates.

    Args:
        x: ``[M, K]`` float16 / bfloat16 (float32 too on CPU); K a multiple of 8. Strided rows
            (``stride(1) == 1``, ``stride(0)`` any multiple of 8 >= K: a column slice of a wider
            buffer) are read in place; the outputs are contiguous.
        mode: ``'token'`` (default), ``'group'``, ``'tensor'`` or ``'channel'``.
        group_size: the group width for ``mode='group'``.
        scale: optional given (static) float32 scale of the mode's shape.

    Returns:
        ``(x_fp8 [M, K] float8_e4m3fn, scale float32)``; ``x ~= x_fp8.float() * scale``.
    """
    return (lib or torch.ops.fastinfer).fp8_quantize(x, mode, int(group_size), scale)


def fp8_scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[Tensor] = None,
    deterministic: bool = False,
    *,
    lib=None,
) -> Tensor:
    """``out = (a * scale_a) @ (b * scale_b)^T (+ bias)``, e4m3 inputs, fp32 accumulation.

    Scale layouts (all float32, contiguous, on the device of ``a``):

    * per tensor / per token x per channel: ``scale_a [1]`` or ``[M]``, ``scale_b [1]`` or ``[N]``
      (any combination), applied in the epilogue;
    * blockwise (DeepSeek-V3 / DeepGEMM): ``scale_a [M, ceil(K/128)]`` (1 x 128 blocks of a, what
      ``fp8_quantize(x, 'group', 128)`` returns) and ``scale_b [ceil(N/128), ceil(K/128)]``
      (128 x 128 blocks of b), applied per 128-wide K block to fp32 partial sums in the main loop.

    The CUDA kernel is a hand-written mma.sync.m16n8k32 e4m3 kernel with a multi-stage cp.async
    pipeline; it needs sm_89+ (Ada / Hopper) and raises "requires sm_89+" on older GPUs.

    Args:
        a: ``[M, K]`` float8_e4m3fn (activations); K a multiple of 16. Its rows may lie further
            apart (``stride(1) == 1``, ``stride(0)`` a multiple of 16 >= K: a column slice of a
            wider buffer, cuBLASLt's ``lda``), read in place.
        b: ``[N, K]`` float8_e4m3fn, contiguous row-major (a weight in ``nn.Linear`` layout);
            N a multiple of 16.
        scale_a, scale_b: see above.
        out_dtype: ``torch.bfloat16`` or ``torch.float16`` (``torch.float32`` too on CPU).
        bias: optional ``[N]`` of ``out_dtype``, added after scaling (fp32), before the rounding.
        deterministic: batch invariance: a row's bits do not depend on M. CUDA: always the
            mma.sync kernel (no split-K, k-order fixed by K; never the CUTLASS sm90 kernels, whose
            tiles follow M); CPU: a fixed-order fp32 GEMM instead of ATen's.

    Returns:
        A new ``[M, N]`` tensor of ``out_dtype``.
    """
    return (lib or torch.ops.fastinfer).fp8_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, bool(deterministic))


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("fp8_quantize")
def _fp8_quantize_fake(ns, x, mode="token", group_size=128, scale=None):
    op = "fp8_quantize"
    check_dim(ns, op, "x", x, 2, "[M, K]")
    same_device(ns, op, "x", x, scale=scale)
    check(ns, op, mode in ("tensor", "token", "group", "channel"),
          f"mode must be 'tensor', 'token', 'group' or 'channel', got '{mode}'")
    shape = {"tensor": (1,), "token": (x.shape[0],), "channel": (x.shape[1],)}.get(mode) or (
        x.shape[0], x.shape[1] // group_size)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(shape, dtype=torch.float32)


@fake("fp8_scaled_mm")
def _fp8_scaled_mm_fake(ns, a, b, scale_a, scale_b, out_dtype, bias=None, deterministic=False):
    same_device(ns, "fp8_scaled_mm", "a", a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
