"""FP4 weight-only (W4A16) GEMM: NVFP4 and MXFP4 weights, checkpoint repacking and the GEMM.

Formats (docs/design.md "GEMM"; the fp64 definitions in :mod:`fastinfer.reference.fp4`)
-------------------------------------------------------------------------------------
A linear layer ``out = a @ W.T`` with ``W[N, K]`` stores one e2m1 code per weight (4 bits ``s e1
e0 m``: ``(-1)^s * [0, 0.5, 1, 1.5, 2, 3, 4, 6][code & 7]``) and one scale per group of ``G``
consecutive input features:

* ``"nvfp4"``: e4m3 scales, ``G = 16``, and an optional fp32 ``global_scale`` (a divisor, as
  compressed-tensors stores it): ``W = e2m1 * scale / global_scale``;
* ``"mxfp4"`` (OCP MX): e8m0 scales ``2^(e - 127)``, ``G = 32`` (``e = 255``, the spec's NaN, is
  refused), no global scale.

Checkpoints pack two codes per byte along the input features, **the even element in the low
nibble** (``[1.0, -6.0, 0.5, 3.0]`` -> codes ``[2, 15, 1, 5]`` -> bytes ``[0xF2, 0x51]``):
``[N, K / 2]`` uint8 (compressed-tensors ``weight_packed``; gpt-oss's ``*_blocks [N, K / 32, 16]``
reshaped), scales ``[N, K / G]``.

Arithmetic: the scale is converted to ``a``'s dtype (exact for e4m3 in fp16 and bf16; for e8m0
exact in bf16 and within fp16's range), ``e2m1 * scale`` is rounded to ``a``'s dtype (exact for
NVFP4: at most 6 significant bits), the products are accumulated in fp32, the sum is divided by
``global_scale`` in fp32 and rounded once.

Packed layout (:func:`fp4_repack`)
----------------------------------
``int32 [K / 64, 8 * N]``: :func:`fastinfer.ops.int4_pack`'s layout (``cuda/include/fastinfer/gemm/int4.h``)
with the e2m1 codes as its nibbles, so **N must be a multiple of 16 and K of 64**; the scales
transposed to ``uint8 [K / G, N]`` (a row of a unit's 128 columns is contiguous).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["Fp4Weight", "FP4_FORMATS", "fp4_repack", "fp4_gemm"]

#: format name -> input features per scale
FP4_FORMATS = {"nvfp4": 16, "mxfp4": 32}


class Fp4Weight(NamedTuple):
    """Result of :func:`fp4_repack`: the packed codes and the transposed scale bits."""

    packed: Tensor
    scales: Tensor


def _bits(t: Tensor) -> Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def fp4_repack(weight_packed: Tensor, weight_scale: Tensor, *, lib=None) -> Fp4Weight:
    """Convert a checkpoint's FP4 weight to the kernel layout.

    Args:
        weight_packed: ``uint8 [N, K / 2]``, two e2m1 codes per byte, the even element in the low
            nibble. ``N % 16 == 0``, ``K % 64 == 0``.
        weight_scale: ``[N, K / 16]`` (NVFP4: e4m3, as ``torch.float8_e4m3fn`` or its uint8 bits) or
            ``[N, K / 32]`` (MXFP4: e8m0 bits, uint8 or ``torch.float8_e8m0fnu``).

    Returns:
        :class:`Fp4Weight` ``(packed int32 [K / 64, 8 N], scales uint8 [K / G, N])``.
    """
    packed, scales = (lib or torch.ops.fastinfer).fp4_repack(weight_packed, _bits(weight_scale))
    return Fp4Weight(packed, scales)


def fp4_gemm(
    a: Tensor,
    packed: Tensor,
    scales: Tensor,
    global_scale: Optional[Tensor] = None,
    format: str = "nvfp4",
    deterministic: bool = False,
    *,
    lib=None,
) -> Tensor:
    """W4A16 GEMM with FP4 weights: ``out = a @ W.T / global_scale``, W decoded from ``packed``.

    Args:
        a: ``[M, K]`` float16 / bfloat16 (float32 too on CPU), contiguous.
        packed: ``int32 [K / 64, 8 N]`` from :func:`fp4_repack`.
        scales: ``uint8 [K / G, N]`` scale bits from :func:`fp4_repack` (G = 16 for ``"nvfp4"``,
            32 for ``"mxfp4"``). e8m0 values of 255 are refused (checked on CPU tensors, on CUDA
            only with ``FASTINFER_CHECK_INDICES=1``).
        global_scale: float32 ``[1]``, the NVFP4 global divisor, or ``None`` (1); not accepted
            with ``"mxfp4"``.
        format: ``"nvfp4"`` or ``"mxfp4"``.
        deterministic: batch invariance (a row's bits do not depend on M): on a GPU a split-K count
            from (N, K) alone, on CPU one row per matmul.

    Returns:
        ``[M, N]`` in the dtype of ``a``.

    On a GPU the fused kernel runs for every M (no dequantise + dense path at large M). On CPU,
    256-column chunks of W are decoded to fp32 and multiplied with ATen's matmul.
    """
    return (lib or torch.ops.fastinfer).fp4_gemm(a, packed, scales, global_scale, str(format), bool(deterministic))


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("fp4_repack")
def _fp4_repack_fake(ns, weight_packed, weight_scale):
    op = "fp4_repack"
    check_dim(ns, op, "weight_packed", weight_packed, 2, "[N, K / 2] uint8 (two e2m1 codes per byte)")
    same_device(ns, op, "weight_packed", weight_packed, weight_scale=weight_scale)
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    return (weight_packed.new_empty((k // 64, 8 * n), dtype=torch.int32),
            weight_packed.new_empty((weight_scale.shape[1], n), dtype=torch.uint8))


@fake("fp4_gemm")
def _fp4_gemm_fake(ns, a, packed, scales, global_scale, format, deterministic=False):
    op = "fp4_gemm"
    check(ns, op, format in FP4_FORMATS, f"format must be 'nvfp4' or 'mxfp4', got '{format}'")
    check_dim(ns, op, "a", a, 2, "[M, K]")
    same_device(ns, op, "a", a, packed=packed, scales=scales, global_scale=global_scale)
    return a.new_empty((a.shape[0], packed.shape[1] // 8))
