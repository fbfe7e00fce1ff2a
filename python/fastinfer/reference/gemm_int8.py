"""Oracles for the INT8 (W8A8) ops: ``int8_quantize`` and ``int8_scaled_mm``.

Quantisation is an exact encoding, so its oracle reproduces it bit for bit (fp32 math, IEEE
division, round half to even, as ``cuda/include/fastinfer/gemm/int8.h`` states):

* symmetric: ``scale = max(amax, 1e-12) / 127``, ``q = round(clamp(x / scale, -127, 127))``;
* asymmetric (per token): ``lo = max(-min(x), 0)``, ``hi = max(max(x), 0)`` (the range holds 0),
  ``scale = max(hi + lo, 1e-12) / 255``, ``azp = clamp(round(lo / scale) - 128, -128, 127)``,
  ``q = clamp(round(x / scale) + azp, -128, 127)``; ``x ~= (q - azp) * scale``.

The matmul's integer accumulators are computed exactly in int64 (:func:`int8_mm_exact`); the
scaled result in float64.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["int8_quantize", "int8_dequantize", "int8_mm_exact", "int8_scaled_mm", "INT8_MIN_RANGE"]

Tensor = torch.Tensor

INT8_MIN_RANGE = 1e-12
"""Range guard: an all-zero row / tensor gets scale ``1e-12 / 127`` (asymmetric: ``/ 255``)."""


def int8_quantize(
    x: Tensor, mode: str = "token", scale: Optional[Tensor] = None, symmetric: bool = True,
    azp: Optional[Tensor] = None,
) -> Tuple[Tensor, ...]:
    """Dynamic int8 quantisation of ``x [M, K]``.

    Returns ``(x_int8 [M, K], scale float32 [1] or [M])``, plus ``azp int32 [M]`` when
    ``symmetric=False`` (``mode='token'``). ``mode='tensor'`` uses ``scale`` when given; with
    ``symmetric=False`` it is static asymmetric (vLLM's ``static_scaled_int8_quant`` with ``azp``):
    the given ``scale`` and zero point ``azp`` (1 element each), codes ``clamp(round(x / scale) +
    azp, -128, 127)``, and the returned ``azp`` is the given one ``[1]``.
    A NaN in x makes its row's (or the tensor's) scale NaN, as ``amax`` does; a NaN ``x / scale``
    has code 0 (int8 has no NaN) and a NaN row zero point 0.
    """
    xf = x.to(torch.float32)
    m, k = xf.shape
    if mode not in ("token", "tensor"):
        raise ValueError(f"mode must be 'tensor' or 'token', got {mode!r}")
    if mode == "tensor":
        if not symmetric:
            if scale is None or azp is None:
                raise ValueError("per-tensor asymmetric quantisation needs a given scale and azp")
            s = scale.to(torch.float32).reshape(1).clone()
            z = azp.to(torch.int32).reshape(1).clone()
            q = ((xf / s).clamp(-256, 256).round() + z.to(torch.float32)).clamp(-128, 127)
            return _codes(q), s, z
        if scale is not None:
            s = scale.to(torch.float32).reshape(1).clone()
        else:
            amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32)
            s = (amax.clamp_min(INT8_MIN_RANGE) / 127.0).reshape(1)
        return _codes((xf / s).clamp(-127, 127).round()), s
    if symmetric:
        amax = xf.abs().amax(1) if k else torch.zeros(m, dtype=torch.float32)
        s = amax.clamp_min(INT8_MIN_RANGE) / 127.0
        return _codes((xf / s[:, None]).clamp(-127, 127).round()), s
    zeros = torch.zeros(m, dtype=torch.float32)
    hi = xf.amax(1).clamp_min(0) if k else zeros
    lo = (-xf).amax(1).clamp_min(0) if k else zeros
    s = (hi + lo).clamp_min(INT8_MIN_RANGE) / 255.0
    azp = ((lo / s).round() - 128).clamp(-128, 127).nan_to_num(0.0)
    q = ((xf / s[:, None]).clamp(-256, 256).round() + azp[:, None]).clamp(-128, 127)
    return _codes(q), s, azp.to(torch.int32)


def _codes(q: Tensor) -> Tensor:
    """float codes as int8, NaN as 0."""
    return torch.where(q.isnan(), 0.0, q).to(torch.int8)


def int8_dequantize(q: Tensor, scale: Tensor, azp: Optional[Tensor] = None) -> Tensor:
    """float64 ``(q - azp) * scale`` with ``scale`` ``[1]`` or ``[rows]`` (``azp`` likewise)."""
    v = q.to(torch.float64)
    if azp is not None:
        v = v - azp.to(torch.float64).reshape(-1, 1)
    return v * scale.to(torch.float64).reshape(-1, 1)


def int8_mm_exact(a: Tensor, b: Tensor) -> Tensor:
    """The exact integer ``a @ b^T`` (int64) of ``a [M, K]`` and ``b [N, K]`` int8."""
    return a.to(torch.int64) @ b.to(torch.int64).t()


def int8_scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: Optional[torch.dtype] = None,
    bias: Optional[Tensor] = None,
    azp_adj: Optional[Tensor] = None,
    azp: Optional[Tensor] = None,
) -> Tensor:
    """``scale_a[m] * scale_b[n] * (a @ b^T - azp[m] * azp_adj[n]) (+ bias[n])`` in float64.

    ``scale_a [1]`` or ``[M]``, ``scale_b [1]`` or ``[N]``, ``azp [1]`` or ``[M]`` with
    ``azp_adj [N]`` (``= b.sum(1)`` for the asymmetric-activation correction). Returns float64
    ``[M, N]`` (``out_dtype`` is accepted for signature parity and ignored).
    """
    acc = int8_mm_exact(a, b)
    if azp is not None:
        acc = acc - azp.to(torch.int64).reshape(-1, 1) * azp_adj.to(torch.int64).reshape(1, -1)
    out = acc.to(torch.float64) * scale_a.to(torch.float64).reshape(-1, 1) * scale_b.to(torch.float64).reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out
