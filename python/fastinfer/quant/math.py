"""The quantisers' arithmetic: round-to-nearest fp8 and int8 (per output channel) and int4 (group-wise),
and the nibble packing of the fastinfer int4 format. Formulas: :mod:`fastinfer.quant`.

This is production code; the tests check it against the independent fp64 oracles of
:mod:`fastinfer.reference` (which production code never imports).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..ops import fp8_quantize, int8_quantize

Tensor = torch.Tensor

__all__ = ["quantize_fp8_weight", "quantize_int8_weight", "quantize_int4_weight", "int4_padded_k", "pack_nibbles", "unpack_nibbles",
           "unpack_int4_words", "dequantize_nvfp4", "quantize_nvfp4_weight", "quantize_mxfp4_weight"]


def quantize_fp8_weight(w: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-output-channel e4m3: ``(codes float8_e4m3fn [N, K], scale float32 [N])``, computed by the
    ``fp8_quantize`` op in ``'token'`` mode on the CPU (rows of W are the "tokens")."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"fp8 quantisation needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    q, s = fp8_quantize(w.detach().to("cpu", torch.float32).contiguous(), "token")
    return q.contiguous(), s.contiguous()


def quantize_int8_weight(w: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: ``(codes int8 [N, K], scale float32 [N])`` with
    ``scale = amax / 127`` and ``codes = round(w / scale)``, computed by the ``int8_quantize`` op in
    ``'token'`` mode on the CPU (rows of W are the "tokens")."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"int8 quantisation needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    q, s = int8_quantize(w.detach().to("cpu", torch.float32).contiguous(), "token")
    return q.contiguous(), s.contiguous()


def int4_padded_k(k: int, group_size: int, pad_groups: bool, name: str = "weight") -> int:
    """The stored input size ``Kq`` of a layer with input size ``k`` (see :mod:`fastinfer.quant`)."""
    g = group_size
    if k % g:
        if not pad_groups:
            div = math.gcd(k, g)
            hint = f"a group size dividing it (e.g. {div})" if div % 32 == 0 else "another group size"
            raise ValueError(
                f"{name}: group_size {g} does not divide the input size K={k}; use {hint} or let the "
                f"last group be zero-padded (pad_groups=True, the default; --no-pad-groups turned it off)")
        k = -(-k // g) * g
    if k % 64:
        raise ValueError(f"{name}: the int4 kernel needs K (padded: {k}) to be a multiple of 64")
    return k


def quantize_int4_weight(w: Tensor, group_size: int, symmetric: bool, pad_groups: bool = True,
                         name: str = "weight") -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Group-wise RTN int4 of ``w [N, K]``: ``(codes uint8 [N, Kq], scales [Kq / G, N] (w's dtype),
    zeros uint8 [Kq / G, N] or None)``; zero columns pad K to ``Kq`` (:func:`int4_padded_k`).

    Symmetric: ``s = amax / 7``, ``q = clamp(round(w / s) + 8, 0, 15)``. Asymmetric: ``s = (max -
    min) / 15`` over a group whose range is widened to include 0, ``z = clamp(round(-min / s), 0,
    15)``, ``q = clamp(round(w / s) + z, 0, 15)``. Scales are computed in fp32 and rounded to w's
    dtype BEFORE the codes, so ``(q - z) * s`` with the stored scales is the dequantised weight.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{name}: int4 quantisation needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if n % 16:
        raise ValueError(f"{name}: the int4 kernel needs the output size N={n} to be a multiple of 16")
    kq = int4_padded_k(k, group_size, pad_groups, name)
    if kq != k:
        w = torch.nn.functional.pad(w, (0, kq - k))
    groups = w.detach().to(torch.float32).reshape(n, kq // group_size, group_size)
    if symmetric:
        lo = None
        step = groups.abs().amax(dim=-1) / 7.0
    else:
        lo = groups.amin(dim=-1).clamp_max(0.0)
        step = (groups.amax(dim=-1).clamp_min(0.0) - lo) / 15.0
    stored = step.clamp_min(1e-8).to(w.dtype)  # what the checkpoint keeps
    s = stored.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny)
    z = torch.full_like(s, 8.0) if lo is None else torch.round(-lo / s).clamp(0, 15)
    codes = (torch.round(groups / s[..., None]) + z[..., None]).clamp(0, 15)
    zeros = None if lo is None else z.to(torch.uint8).t().contiguous()
    return codes.reshape(n, kq).to(torch.uint8), stored.t().contiguous(), zeros


def pack_nibbles(q: Tensor) -> Tensor:
    """uint8 ``[N, K]`` (0..15, K even) -> uint8 ``[N, K / 2]``: low nibble = even column."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`."""
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1).contiguous()


def unpack_int4_words(words: Tensor) -> Tensor:
    """int32 ``[R, W]`` -> uint8 ``[R, 8 W]``: nibble ``i`` (bits ``4i..4i+3``) of word ``j`` is
    column ``8 j + i`` (compressed-tensors' ``pack_to_int32`` with 4 bits; the same bytes as
    :func:`pack_nibbles` on a little-endian machine). Independent of the host's byte order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    return ((w[..., None] >> shifts) & 15).reshape(words.shape[0], -1).to(torch.uint8)


# e2m1 values of codes 0..15 (OCP MX: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_nvfp4(packed: Tensor, scale: Tensor, global_scale: Tensor) -> Tensor:
    """float32 ``W [N, K]`` of an NVFP4 weight (compressed-tensors' ``nvfp4-pack-quantized``):
    ``packed uint8 [N, K / 2]`` (two e2m1 codes a byte, the even element in the low nibble),
    ``scale`` e4m3 ``[N, K / 16]``, ``global_scale`` float32 ``[1]``, a divisor:
    ``W = e2m1 * (scale / global_scale)`` in float32, as compressed-tensors computes it."""
    codes = unpack_nibbles(packed).long()
    values = torch.tensor(_E2M1, dtype=torch.float32)[codes]
    s = scale.float() / global_scale.float().reshape(())
    return values * s.repeat_interleave(16, dim=1)


def _e2m1_codes(x: Tensor) -> Tensor:
    """uint8 e2m1 codes of float32 values: the nearest magnitude of |x| clamped to 6 (a value
    halfway between two magnitudes takes the smaller), the sign in bit 3."""
    mags = torch.tensor(_E2M1[:8], dtype=torch.float32)
    mid = (mags[1:] + mags[:-1]) / 2
    code = torch.bucketize(x.abs().clamp(max=6.0), mid, right=False).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_nvfp4_weight(w: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """NVFP4 of ``w [N, K]`` (K a multiple of 16), compressed-tensors' arithmetic: the global scale
    ``448 * 6 / amax(|W|)`` (1 for an all-zero weight), a divisor; per 16 input features the e4m3
    scale ``amax_group / 6 * global`` (at most 448, rounded to nearest); codes the nearest e2m1 of
    ``W * global / scale`` (:func:`_e2m1_codes`; 0 under a zero scale).

    Returns ``(packed uint8 [N, K / 2]`` (the even element in the low nibble), ``scale
    float8_e4m3fn [N, K / 16]``, ``global_scale float32 [1])``, all on the CPU."""
    if w.dim() != 2 or not w.is_floating_point() or w.shape[1] % 16:
        raise ValueError(f"NVFP4 quantisation needs a 2-D float weight with K a multiple of 16, got "
                         f"{tuple(w.shape)} {w.dtype}")
    w32 = w.detach().to("cpu", torch.float32)
    n, k = w32.shape
    amax = w32.abs().max() if w32.numel() else torch.tensor(0.0)
    gs = (448.0 * 6.0 / amax if amax > 0 else torch.tensor(1.0)).reshape(1).to(torch.float32)
    g = w32.reshape(n, k // 16, 16)
    scale = (g.abs().amax(-1) / 6.0 * gs).clamp(max=448.0).to(torch.float8_e4m3fn)
    s32 = scale.float().unsqueeze(-1)
    x = torch.where(s32 > 0, g * gs / torch.where(s32 > 0, s32, torch.ones_like(s32)), torch.zeros_like(g))
    return pack_nibbles(_e2m1_codes(x).reshape(n, k)), scale, gs


def quantize_mxfp4_weight(w: Tensor) -> Tuple[Tensor, Tensor]:
    """MXFP4 of ``w [N, K]`` (K a multiple of 32), the OCP MX rule: per 32 input features the
    shared exponent ``floor(log2(amax_group)) - 2`` (e2m1's largest exponent), stored e8m0 as
    ``e + 127`` clamped to 0..254 (0 for an all-zero group); codes the nearest e2m1 of
    ``W / 2^e`` (:func:`_e2m1_codes`, clamped to 6).

    Returns ``(packed uint8 [N, K / 2]`` (the even element in the low nibble), ``scale uint8
    [N, K / 32])``, on the CPU."""
    if w.dim() != 2 or not w.is_floating_point() or w.shape[1] % 32:
        raise ValueError(f"MXFP4 quantisation needs a 2-D float weight with K a multiple of 32, got "
                         f"{tuple(w.shape)} {w.dtype}")
    w32 = w.detach().to("cpu", torch.float32)
    n, k = w32.shape
    g = w32.reshape(n, k // 32, 32)
    amax = g.abs().amax(-1)
    _, exp = torch.frexp(amax)  # amax = m 2^exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    biased = torch.where(amax > 0, exp.to(torch.int32) - 1 - 2 + 127, torch.zeros_like(exp, dtype=torch.int32))
    biased = biased.clamp(0, 254)
    x = g / torch.pow(2.0, (biased - 127).to(torch.float32)).unsqueeze(-1)
    return pack_nibbles(_e2m1_codes(x).reshape(n, k)), biased.to(torch.uint8)
