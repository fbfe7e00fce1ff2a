"""Oracles for the FP8 (W8A8) ops: ``fp8_quantize`` and ``fp8_scaled_mm``.

Quantisation is an exact encoding, so its oracle reproduces it bit for bit: fp32 amax, scale =
``max(amax, 1e-12) / 448`` (fp32), ``q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``
(IEEE fp32 division, round-to-nearest-even cast after clamping: saturating, never NaN for finite x).
The scaled matmul is computed in float64 from the exact fp8 values.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["fp8_quantize", "fp8_dequantize", "fp8_scaled_mm", "FP8_MIN_AMAX", "FP8_BLOCK"]

Tensor = torch.Tensor

FP8_E4M3_MAX = 448.0
FP8_MIN_AMAX = 1e-12
"""amax guard: an all-zero row/group/tensor gets scale ``1e-12 / 448`` (its codes are all 0)."""
FP8_BLOCK = 128
"""Block edge of the blockwise scales of ``fp8_scaled_mm``."""


def _scale_from_amax(amax: Tensor) -> Tensor:
    return amax.to(torch.float32).clamp_min(FP8_MIN_AMAX) / FP8_E4M3_MAX


def fp8_quantize(
    x: Tensor, mode: str = "token", group_size: int = 128, scale: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """Dynamic e4m3 quantisation of ``x [M, K]``; returns ``(x_fp8 [M, K], scale float32)``.

    With ``scale`` given (static) it is used as is and returned (copied): ``[1]`` per tensor, ``[M]``
    per token, ``[M, K / group_size]`` per group, ``[K]`` per channel (``mode='channel'``, given
    only): ``q[m, k] = e4m3(clamp(x[m, k] / scale[unit(m, k)], -448, 448))``.

    ``mode='tensor'``: one scale ``[1]`` (``scale`` if given, else from the amax of all of x);
    ``'token'``: scale ``[M]`` from each row's amax; ``'group'``: scale ``[M, K / group_size]`` from
    the amax of each run of ``group_size`` elements of a row. ``x ~= x_fp8.float() * scale``
    (broadcast per row / per group).
    """
    xf = x.to(torch.float32)
    m, k = xf.shape
    if mode == "tensor":
        if scale is not None:
            s = scale.to(torch.float32).reshape(1).clone()
        else:
            amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32)
            s = _scale_from_amax(amax).reshape(1)
        q = xf / s
    elif mode == "token":
        if scale is not None:
            s = scale.to(torch.float32).reshape(m).clone()
        else:
            amax = xf.abs().amax(1) if k else torch.zeros(m, dtype=torch.float32)
            s = _scale_from_amax(amax)
        q = xf / s[:, None]
    elif mode == "group":
        xg = xf.view(m, k // group_size, group_size)
        s = scale.to(torch.float32).reshape(m, k // group_size).clone() if scale is not None else _scale_from_amax(xg.abs().amax(2))
        q = (xg / s[:, :, None]).view(m, k)
    elif mode == "channel":
        if scale is None:
            raise ValueError("mode='channel' needs a given scale [K]")
        s = scale.to(torch.float32).reshape(k).clone()
        q = xf / s[None, :]
    else:
        raise ValueError(f"mode must be 'tensor', 'token', 'group' or 'channel', got {mode!r}")
    return q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), s


def _expand_scale(scale: Tensor, rows: int, cols: int, rows_per: int, cols_per: int) -> Tensor:
    s = scale.to(torch.float64)
    return s.repeat_interleave(rows_per, 0)[:rows].repeat_interleave(cols_per, 1)[:, :cols]


def fp8_dequantize(q: Tensor, scale: Tensor, group_size: int = FP8_BLOCK) -> Tensor:
    """float64 values of ``q [R, K]`` with a scale ``[1]``, ``[R]`` or ``[R, ceil(K / group_size)]``."""
    v = q.to(torch.float64)
    r, k = v.shape
    s = scale.to(torch.float64)
    if s.dim() == 2:
        return v * _expand_scale(s, r, k, 1, group_size)
    return v * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(1, 1))


def fp8_scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: Optional[torch.dtype] = None,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``(a * scale_a) @ (b * scale_b)^T (+ bias)`` in float64; ``a [M, K]``, ``b [N, K]`` e4m3.

    Scales: ``scale_a [1]`` or ``[M]`` with ``scale_b [1]`` or ``[N]``; or blockwise
    ``scale_a [M, ceil(K/128)]`` (1 x 128 blocks of a) with ``scale_b [ceil(N/128), ceil(K/128)]``
    (128 x 128 blocks of b). Returns float64 ``[M, N]`` (``out_dtype`` is accepted for signature
    parity and ignored: the oracle does not round).
    """
    m, k = a.shape
    n = b.shape[0]
    af = a.to(torch.float64)
    bf = b.to(torch.float64)
    if scale_a.dim() == 2:
        af = af * _expand_scale(scale_a, m, k, 1, FP8_BLOCK)
        bf = bf * _expand_scale(scale_b, n, k, FP8_BLOCK, FP8_BLOCK)
    else:
        af = af * scale_a.to(torch.float64).reshape(-1, 1)
        bf = bf * scale_b.to(torch.float64).reshape(-1, 1)
    out = af @ bf.t()
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out
