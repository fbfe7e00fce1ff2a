"""Oracles for the GEMM ops.

``dense_mm``: ``a @ b^T (+ bias)`` in fp64 (the op accumulates in fp32 and rounds once).

INT4 (W4A16) section: the executable spec of ``int4_pack`` / ``int4_repack`` / ``int4_gemm``
(layout and conventions in :mod:`fastinfer.ops.gemm_int4`), pure-python packers/unpackers of the
AutoAWQ and AutoGPTQ v1 checkpoint formats (written from the upstream packers, cited at
:data:`AWQ_ORDER` and :func:`gptq_pack`; used by the tests to build checkpoints), and a
round-to-nearest quantiser.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

# AutoAWQ GEMM packing (awq/modules/linear/gemm.py, ``WQLinear_GEMM.from_linear``: ``order_map``):
# nibble i (bits 4i..4i+3) of ``qweight[k, j]`` / ``qzeros[g, j]`` holds column ``8 j + AWQ_ORDER[i]``.
# Its unpacker reorders with the inverse, AWQ_REVERSE_ORDER (awq/utils/packing_utils.py:
# ``AWQ_REVERSE_ORDER``, used by ``reverse_awq_order``): column c is nibble AWQ_REVERSE_ORDER[c].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
assert all(AWQ_ORDER[AWQ_REVERSE_ORDER[c]] == c for c in range(8))

__all__ = [
    "dense_mm",
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "int4_dequantize",
    "int4_gemm",
    "int4_pack",
    "int4_unpack",
    "quantize_int4",
    "awq_pack",
    "awq_unpack",
    "gptq_pack",
    "gptq_unpack",
]


def _to_int32_bits(x: Tensor) -> Tensor:
    """int64 words in [0, 2^32) -> int32 with the same bits."""
    x = x.to(torch.int64)
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _nibbles(words: Tensor) -> Tensor:
    """[..., 8] int64: nibble i of each int32 word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    return (words.to(torch.int64).unsqueeze(-1) >> shifts) & 15


def _words(nibbles: Tensor) -> Tensor:
    """[..., 8] values 0..15 -> int32 words (nibble i at bits 4i)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nibbles.device)
    return _to_int32_bits((nibbles.to(torch.int64) << shifts).sum(-1))


# ---- the kernel's packed layout ----------------------------------------------------------------


def int4_pack(w_q: Tensor) -> Tensor:
    """uint8 ``[N, K]`` (0..15) -> int32 ``[K / 64, 8 N]``, written element by element from the
    layout's definition (slow; tests use small shapes)."""
    n, k = w_q.shape
    assert n % 16 == 0 and k % 64 == 0
    q = w_q.to(torch.int64)
    out = torch.zeros(k // 64, n // 16, 32, 4, 8, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            for i in range(8):
                e, h, kh = i // 4, (i // 2) % 2, i % 2
                rows = torch.arange(n // 16) * 16 + 8 * h + g  # [N/16]
                cols = torch.arange(k // 64) * 64 + 16 * j + 8 * kh + 2 * t + e  # [K/64]
                out[:, :, lane, j, i] = q[rows][:, cols].t()
    return _words(out).reshape(k // 64, 8 * n)


def int4_unpack(packed: Tensor) -> Tensor:
    """Inverse of :func:`int4_pack`: int32 ``[K / 64, 8 N]`` -> uint8 ``[N, K]``."""
    kt, n8 = packed.shape
    n, k = n8 // 8, kt * 64
    nib = _nibbles(packed.cpu()).reshape(kt, n // 16, 32, 4, 8)
    q = torch.empty(n, k, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            for i in range(8):
                e, h, kh = i // 4, (i // 2) % 2, i % 2
                rows = torch.arange(n // 16) * 16 + 8 * h + g
                cols = torch.arange(kt) * 64 + 16 * j + 8 * kh + 2 * t + e
                q[rows.unsqueeze(1), cols.unsqueeze(0)] = nib[:, :, lane, j, i].t()
    return q.to(torch.uint8)


def int4_dequantize(w_q: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                    dtype: Optional[torch.dtype] = None) -> Tensor:
    """``W[n, k] = (q[n, k] - z[k // G, n]) * s[k // G, n]`` in float64, ``[N, K]``.

    With ``dtype`` the result is rounded to it (the kernels' dequantised weight: ``q - z`` is an
    integer, so this is the exact product rounded once), then returned as float64.
    """
    n, k = w_q.shape
    s = scales.to(torch.float64).repeat_interleave(group_size, dim=0).t()  # [N, K]
    z = (torch.full((k // group_size, n), 8.0, dtype=torch.float64) if zeros is None else zeros.to(torch.float64))
    z = z.repeat_interleave(group_size, dim=0).t()
    w = (w_q.to(torch.float64) - z) * s
    if dtype is not None:
        w = w.to(dtype).to(torch.float64)
    return w


def dense_mm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """fp64 oracle of ``dense_mm``: ``a [M, K] @ b [N, K]^T (+ bias [N])``."""
    out = a.to(torch.float64) @ b.to(torch.float64).t()
    return out if bias is None else out + bias.to(torch.float64)


def int4_gemm(a: Tensor, w_q: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int = 128,
              perm: Optional[Tensor] = None) -> Tensor:
    """fp64 oracle of ``int4_gemm`` given the UNPACKED weights ``w_q [N, K]``: ``a[:, perm] @ W.T``
    with W dequantised and rounded to ``a``'s dtype (the contract's weight), accumulated in fp64."""
    a64 = a.to(torch.float64)
    if perm is not None:
        a64 = a64[:, perm.long()]
    w = int4_dequantize(w_q, scales, zeros, group_size, dtype=a.dtype)
    return a64 @ w.t()


def quantize_int4(w: Tensor, group_size: int = 128, symmetric: bool = True) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Round-to-nearest group quantisation of ``w [N, K]`` (float) to 4 bits.

    Symmetric: ``s = max|w_group| / 7`` and ``q = clamp(round(w / s) + 8, 0, 15)`` (so ``q - 8`` is
    in ``-7..7``, ``z = 8``); zeros is ``None``.
    Asymmetric: ``s = (max - min) / 15``, ``z = clamp(round(-min / s), 0, 15)``,
    ``q = clamp(round(w / s) + z, 0, 15)``.

    Returns:
        ``(w_q uint8 [N, K], scales [K / G, N] in w's dtype, zeros uint8 [K / G, N] or None)``.
        Scales are computed in fp32 and rounded to w's dtype before quantising, so the
        round trip ``int4_dequantize(w_q, scales, zeros)`` uses exactly the stored scales.
    """
    n, k = w.shape
    assert k % group_size == 0, "K must be a multiple of group_size"
    wg = w.to(torch.float32).reshape(n, k // group_size, group_size)
    if symmetric:
        amax = wg.abs().amax(-1)
        s = (amax / 7.0).clamp_min(1e-8)
    else:
        lo, hi = wg.amin(-1).clamp_max(0.0), wg.amax(-1).clamp_min(0.0)
        s = ((hi - lo) / 15.0).clamp_min(1e-8)
    s = s.to(w.dtype) if w.dtype != torch.float64 else s
    s32 = s.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny)
    if symmetric:
        q = torch.clamp(torch.round(wg / s32.unsqueeze(-1)) + 8, 0, 15)
        zeros = None
    else:
        z = torch.clamp(torch.round(-lo / s32), 0, 15)
        q = torch.clamp(torch.round(wg / s32.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)
        zeros = z.to(torch.uint8).t().contiguous()
    return q.reshape(n, k).to(torch.uint8), s.t().contiguous().to(w.dtype), zeros


# ---- checkpoint formats (built by tests from the documented conventions) -----------------------


def awq_pack(w_q: Tensor, zeros: Tensor) -> Tuple[Tensor, Tensor]:
    """AutoAWQ GEMM format from ``w_q [N, K]`` and ``zeros [K / G, N]`` (0..15):
    ``qweight int32 [K, N / 8]``, ``qzeros int32 [K / G, N / 8]`` (zero points stored as they are),
    nibble i of word ``[., j]`` = column ``8 j + AWQ_ORDER[i]`` (AWQ_ORDER = 0 2 4 6 1 3 5 7, the
    packer's ``order_map``)."""
    order = torch.tensor(AWQ_ORDER)
    q_kn = w_q.t().to(torch.int64)  # [K, N]
    k, n = q_kn.shape
    qweight = _words(q_kn.reshape(k, n // 8, 8)[..., order])
    qzeros = _words(zeros.to(torch.int64).reshape(zeros.shape[0], n // 8, 8)[..., order])
    return qweight, qzeros


def awq_unpack(qweight: Tensor, qzeros: Tensor) -> Tuple[Tensor, Tensor]:
    """Inverse of :func:`awq_pack`: ``(w_q [N, K] uint8, zeros [K / G, N] uint8)``."""
    inv = torch.tensor(AWQ_REVERSE_ORDER)  # column c <- nibble AWQ_REVERSE_ORDER[c]
    k = qweight.shape[0]
    q_kn = _nibbles(qweight)[..., inv].reshape(k, -1)
    z = _nibbles(qzeros)[..., inv].reshape(qzeros.shape[0], -1)
    return q_kn.t().contiguous().to(torch.uint8), z.to(torch.uint8)


def gptq_pack(w_q: Tensor, zeros: Tensor) -> Tuple[Tensor, Tensor]:
    """AutoGPTQ v1 format (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, ``QuantLinear.pack``):
    ``qweight int32 [K / 8, N]`` (nibble i of word [j, n] = row 8 j + i of ``W^T``),
    ``qzeros int32 [K / G, N / 8]`` (plain order along N) storing ``(zero - 1) & 15``."""
    q_kn = w_q.t().to(torch.int64)  # [K, N]
    k, n = q_kn.shape
    qweight = _words(q_kn.reshape(k // 8, 8, n).permute(0, 2, 1))
    stored = (zeros.to(torch.int64) - 1) & 15
    qzeros = _words(stored.reshape(zeros.shape[0], n // 8, 8))
    return qweight, qzeros


def gptq_unpack(qweight: Tensor, qzeros: Tensor) -> Tuple[Tensor, Tensor]:
    """Inverse of :func:`gptq_pack`: ``(w_q [N, K] uint8, zeros [K / G, N] uint8)``, ``z = (stored + 1) & 15``."""
    k8, n = qweight.shape
    q_kn = _nibbles(qweight).permute(0, 2, 1).reshape(k8 * 8, n)
    z = (_nibbles(qzeros).reshape(qzeros.shape[0], n) + 1) & 15
    return q_kn.t().contiguous().to(torch.uint8), z.to(torch.uint8)
