"""FP4 weight formats: e2m1 values, their packing, NVFP4 and MXFP4 block scales (float64 oracles).

e2m1 (OCP MX spec, "FP4 E2M1"): a 4-bit code ``s e1 e0 m`` is ``(-1)^s * v[code & 7]`` with
``v = [0, 0.5, 1, 1.5, 2, 3, 4, 6]`` (no infinities, no NaN; ``-0`` is code 8).

Packing (both formats, as their producers write it): two codes per byte along the input
features, **the even element in the low nibble**: byte ``j`` of a row holds element ``2 j`` in bits
0..3 and ``2 j + 1`` in bits 4..7. Hand-worked: the row ``[1.0, -6.0, 0.5, 3.0]`` has codes
``[2, 15, 1, 5]`` and packs to bytes ``[0xF2, 0x51]``.

* NVFP4 (what compressed-tensors writes as ``nvfp4-pack-quantized``): ``weight_packed uint8
  [N, K / 2]``, ``weight_scale`` e4m3 ``[N, K / 16]`` (one per 16 input features) and
  ``weight_global_scale`` float32 ``[1]``, a divisor: ``W = e2m1 * (weight_scale / global_scale)``.
* MXFP4 (OCP MX; gpt-oss's experts as ``*_blocks uint8 [..., K / 32, 16]`` and ``*_scales uint8
  [..., K / 32]``): one e8m0 scale per 32 input features, ``2^(e - 127)``: ``W = e2m1 * 2^(e - 127)``
  (``e = 255``, the spec's NaN, is refused).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["E2M1_VALUES", "e2m1_values", "fp4_pack", "fp4_unpack", "e2m1_encode", "nvfp4_dequantize",
           "mxfp4_dequantize", "FP4_GROUP", "fp4_scale_values", "fp4_gemm_weight", "fp4_gemm"]

#: the magnitudes of e2m1 codes 0..7 (codes 8..15: the same, negative)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(codes: Tensor) -> Tensor:
    """float64 values of e2m1 codes (uint8 in 0..15)."""
    if codes.dtype != torch.uint8 or (codes.numel() and int(codes.max()) > 15):
        raise ValueError("e2m1 codes must be uint8 in 0..15")
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float64)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def e2m1_encode(x: Tensor) -> Tensor:
    """uint8 codes of values that are e2m1 values (the inverse of :func:`e2m1_values`; anything
    else is refused)."""
    xf = x.to(torch.float64)
    mag = xf.abs()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    hit = mag.unsqueeze(-1) == table
    if not bool(hit.any(-1).all()):
        raise ValueError("e2m1_encode: every value must be one of +-" + str(E2M1_VALUES))
    codes = hit.to(torch.uint8).argmax(-1).to(torch.uint8)
    return codes | (torch.signbit(xf).to(torch.uint8) << 3)


def fp4_pack(codes: Tensor) -> Tensor:
    """uint8 ``[..., K]`` codes -> ``[..., K / 2]`` bytes, the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4_pack needs an even number of elements per row, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def fp4_unpack(packed: Tensor) -> Tensor:
    """uint8 ``[..., K / 2]`` bytes -> ``[..., K]`` codes (the inverse of :func:`fp4_pack`)."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


def nvfp4_dequantize(packed: Tensor, scale: Tensor, global_scale: Tensor) -> Tensor:
    """float64 ``W [N, K]`` of an NVFP4 weight: ``packed uint8 [N, K / 2]``, ``scale`` e4m3
    ``[N, K / 16]``, ``global_scale`` float32 ``[1]`` (``W = e2m1 * scale / global_scale``)."""
    v = e2m1_values(fp4_unpack(packed))
    n, k = v.shape
    if scale.shape != (n, k // 16):
        raise ValueError(f"scale must have shape [{n}, {k // 16}] (one per 16 input features), got {list(scale.shape)}")
    s = scale.to(torch.float64) / global_scale.to(torch.float64).reshape(())
    return v * s.repeat_interleave(16, dim=1)


def mxfp4_dequantize(blocks: Tensor, scales: Tensor) -> Tensor:
    """float64 ``W [..., K]`` of an MXFP4 weight: ``blocks uint8 [..., K / 32, 16]`` (gpt-oss's
    layout; 32 codes per block, packed) and e8m0 ``scales uint8 [..., K / 32]``."""
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks [..., G, 16] and scales [..., G] expected, got {list(blocks.shape)} and "
                         f"{list(scales.shape)}")
    if scales.numel() and int(scales.to(torch.int32).max()) == 255:
        raise ValueError("an e8m0 scale of 255 is the MX spec's NaN")
    v = e2m1_values(fp4_unpack(blocks))  # [..., G, 32]
    e = scales.to(torch.float64) - 127
    return (v * torch.pow(2.0, e).unsqueeze(-1)).flatten(-2)


# ---- the fp4_gemm op (W4A16; layout in fastinfer.ops.gemm_fp4) ----------------------------------

#: input features per scale of each format
FP4_GROUP = {"nvfp4": 16, "mxfp4": 32}


def fp4_scale_values(scales: Tensor, fmt: str) -> Tensor:
    """float64 values of scale bits (uint8): e4m3 for ``nvfp4`` (0x7F / 0xFF are NaN), e8m0
    ``2^(e - 127)`` for ``mxfp4`` (255 refused)."""
    if fmt == "nvfp4":
        return scales.view(torch.float8_e4m3fn).to(torch.float64)
    if fmt == "mxfp4":
        if scales.numel() and int(scales.to(torch.int32).max()) == 255:
            raise ValueError("an e8m0 scale of 255 is the MX spec's NaN")
        return torch.pow(2.0, scales.to(torch.float64) - 127)
    raise ValueError(f"format must be 'nvfp4' or 'mxfp4', got {fmt!r}")


def fp4_gemm_weight(codes: Tensor, scales: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """The weight ``fp4_gemm`` multiplies, float64 ``[N, K]``: codes uint8 ``[N, K]``, scales uint8
    ``[K / G, N]``; the scale rounded to ``dtype``, then ``e2m1 * scale`` rounded to ``dtype``."""
    group = FP4_GROUP[fmt]
    s = fp4_scale_values(scales, fmt).to(dtype).to(torch.float64)
    s = s.t().repeat_interleave(group, dim=1)  # [N, K]
    return (e2m1_values(codes) * s).to(dtype).to(torch.float64)


def fp4_gemm(a: Tensor, codes: Tensor, scales: Tensor, global_scale: Optional[Tensor], fmt: str) -> Tensor:
    """fp64 oracle of ``fp4_gemm`` given the UNPACKED codes ``[N, K]``: ``a @ W.T / global_scale``
    with W as :func:`fp4_gemm_weight` (rounded to ``a``'s dtype), accumulated in fp64."""
    out = a.to(torch.float64) @ fp4_gemm_weight(codes, scales, fmt, a.dtype).t()
    if global_scale is not None:
        out = out / global_scale.to(torch.float64).reshape(())
    return out
