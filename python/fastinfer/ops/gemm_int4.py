"""INT4 weight-only (W4A16) GEMM: packing, checkpoint repacking and the GEMM.

Quantisation convention (docs/design.md "GEMM")
-----------------------------------------------
A linear layer ``out = a @ W.T`` with ``W[N, K]`` (N output features, K input features) is stored
as 4-bit integers ``q[N, K]`` in ``0..15`` with one scale and one zero point per group of
``group_size`` consecutive input features and per output feature::

    W[n, k] = (q[n, k] - z[k // G, n]) * s[k // G, n]

``scales``: ``[K / G, N]`` in the activation dtype; ``zeros``: ``uint8 [K / G, N]`` in ``0..15``,
or ``None`` for symmetric weights (``z = 8`` everywhere). The dequantised weight is rounded to the
activation dtype (exactly: ``q - z`` is a small integer, so the product is rounded once) and the
products are accumulated in fp32; ``out`` is rounded once. One exception: the CPU decode path
(M <= 8, or ``deterministic``) with bfloat16 activations multiplies the integers ``q - 8`` with
the activations (exact products, bf16 dot-product instructions where the CPU has them) and applies
``s`` (and ``(z - 8) * s`` times the activations' sum) per 64 input features in fp32: its weight is
``(q - z) * s`` unrounded, the same within bf16's rounding of the weight.

Packed layout (``int4_pack``; the kernel's own, see ``cuda/include/fastinfer/gemm/int4.h``)
-------------------------------------------------------------------------------------------
``int32 [K / 64, 8 * N]``: W is cut into units of 64 (k) x 16 (n) (so **N must be a multiple of
16 and K of 64**), unit ``(kt, nt)`` is 128 words at offset ``(kt * N / 16 + nt) * 128``. Word
``4 * lane + j`` (``lane = 4 g + t``) holds the 8 nibbles that warp lane ``lane`` feeds to the two
``mma.m16n8k16`` B fragments of k16 step ``j``: nibble ``i = 4 e + 2 h + kh`` (bits ``4i..4i+3``)
is ``q[16 nt + 8 h + g, 64 kt + 16 j + 8 kh + 2 t + e]``. ``(word >> 4 i) & 0x000F000F`` then holds
the two halves of one B register, which the kernel turns into fp16/bf16 with one ``lop3``
(magic-number trick).

Act-order (GPTQ ``desc_act``)
-----------------------------
``int4_repack(..., g_idx=g_idx)`` sorts the input features by group (stable) so that every group
is contiguous, and returns that permutation ``perm`` (int64 ``[K]``): the packed weight's input
feature ``i`` is the checkpoint's input feature ``perm[i]``. Pass ``perm`` to :func:`int4_gemm`,
which multiplies ``a[:, perm]`` (equivalently, gather the activations yourself once per layer
input and call it without ``perm``). The scales and zeros need no permutation.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["Int4Weight", "int4_pack", "int4_repack", "int4_gemm"]



class Int4Weight(NamedTuple):
    """Result of :func:`int4_repack`: the packed weight, uint8 zero points and the act-order
    permutation (``None`` unless ``g_idx`` was given)."""

    packed: Tensor
    zeros: Tensor
    perm: Optional[Tensor]


def int4_pack(w_q: Tensor, *, lib=None) -> Tensor:
    """Pack 4-bit weights into the kernel layout.

    Args:
        w_q: ``uint8 [N, K]`` with values ``0..15`` (checked on the host for CPU tensors; on CUDA
            only with ``FASTINFER_CHECK_INDICES=1``), ``N % 16 == 0``, ``K % 64 == 0``.

    Returns:
        ``int32 [K / 64, 8 * N]`` in the layout described in this module's docstring.
    """
    return (lib or torch.ops.fastinfer).int4_pack(w_q)


def int4_repack(qweight: Tensor, qzeros: Tensor, fmt: str = "awq", g_idx: Optional[Tensor] = None, *, lib=None) -> Int4Weight:
    """Convert an AutoAWQ or AutoGPTQ (v1) checkpoint tensor to the kernel layout.

    Formats (4 bits, ``G = K / qzeros.shape[0]`` must be a multiple of 32):

    * ``"awq"`` (AutoAWQ GEMM): ``qweight int32 [K, N / 8]`` packed along N in the interleaved
      order ``order = 0, 2, 4, 6, 1, 3, 5, 7``: nibble ``i`` (bits ``4i..4i+3``) of word ``[k, j]`` is
      column ``8 j + order[i]`` (AutoAWQ's packer, ``WQLinear_GEMM.from_linear`` in
      ``awq/modules/linear/gemm.py``; its unpacker undoes it with the inverse ``0, 4, 1, 5, 2, 6, 3, 7``,
      ``AWQ_REVERSE_ORDER`` in ``awq/utils/packing_utils.py``). Example: columns ``0..7`` holding
      ``1..8`` pack to ``0x86427531``. ``qzeros int32 [K / G, N / 8]`` is packed the same way (zero
      points stored as they are, no minus one).
    * ``"gptq"`` (AutoGPTQ v1, ``QuantLinear.pack`` in
      ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py``): ``qweight int32 [K / 8, N]`` packed
      along K: nibble ``i`` of word ``[j, n]`` is row ``8 j + i``; ``qzeros int32 [K / G, N / 8]`` packed along N in plain order and
      stored as ``zero - 1`` (so ``z = (stored + 1) & 15``; a stored 15, which the v1 packer writes for
      a zero point of 0, decodes to 0). Optional ``g_idx [K]`` (act-order): see module docstring.

    Scales (``[K / G, N]`` in both formats) are used as they are; cast them to the activation dtype.

    Returns:
        :class:`Int4Weight` ``(packed int32 [K / 64, 8 N], zeros uint8 [K / G, N], perm int64 [K] or None)``.
    """
    packed, zeros, perm = (lib or torch.ops.fastinfer).int4_repack(qweight, qzeros, fmt, g_idx)
    return Int4Weight(packed, zeros, perm if g_idx is not None else None)


def int4_gemm(
    a: Tensor,
    packed: Tensor,
    scales: Tensor,
    zeros: Optional[Tensor] = None,
    group_size: int = 128,
    perm: Optional[Tensor] = None,
    deterministic: bool = False,
    *,
    lib=None,
) -> Tensor:
    """W4A16 GEMM: ``out = a @ W.T`` with ``W = (q - z) * s`` dequantised from ``packed``.

    Args:
        a: ``[M, K]`` float16 / bfloat16 (float32 too on CPU), contiguous.
        packed: ``int32 [K / 64, 8 N]`` from :func:`int4_pack` / :func:`int4_repack`.
        scales: ``[K / group_size, N]``, dtype of ``a``.
        zeros: ``uint8 [K / group_size, N]`` in ``0..15``, or ``None`` (symmetric, ``z = 8``).
        group_size: multiple of 16 dividing K (16, 32, 64, 128 (default), ..., K for per-channel).
        perm: optional int64/int32 ``[K]`` act-order permutation from :func:`int4_repack`;
            the op then multiplies ``a[:, perm]``. Index values (perm, zeros <= 15) are checked
            on CPU tensors, on CUDA tensors only with ``FASTINFER_CHECK_INDICES=1``.
        deterministic: batch invariance (a row's bits do not depend on M): the fused kernel for
            every M, with a split-K count from (N, K) alone (never the SM count), and on CPU the
            fused loop for every M.

    Returns:
        ``[M, N]`` in the dtype of ``a``.

    On a GPU, M < 512 runs the fused W4A16 kernel (split-K chosen from the SM count); M >= 512
    dequantises W and calls a dense matmul (threshold not measured; ``FASTINFER_TEST_INT4_DENSE_MIN_M``
    overrides it). On CPU, M <= 16 (8 in bfloat16) runs a fused decode loop, larger M dense chunks of
    W.
    """
    return (lib or torch.ops.fastinfer).int4_gemm(a, packed, scales, zeros, int(group_size), perm,
                                                  bool(deterministic))


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("int4_pack")
def _int4_pack_fake(ns, w_q):
    check_dim(ns, "int4_pack", "w_q", w_q, 2, "[N, K] (the quantised weight, values 0..15)")
    return w_q.new_empty((w_q.shape[1] // 64, 8 * w_q.shape[0]), dtype=torch.int32)


@fake("int4_repack")
def _int4_repack_fake(ns, qweight, qzeros, fmt, g_idx=None):
    op = "int4_repack"
    check(ns, op, fmt in ("awq", "gptq"), f"fmt must be 'awq' or 'gptq', got '{fmt}'")
    same_device(ns, op, "qweight", qweight, qzeros=qzeros, g_idx=g_idx)
    awq = fmt == "awq"
    n = qweight.shape[1] * 8 if awq else qweight.shape[1]
    k = qweight.shape[0] if awq else qweight.shape[0] * 8
    return (qweight.new_empty((k // 64, 8 * n), dtype=torch.int32),
            qweight.new_empty((qzeros.shape[0], n), dtype=torch.uint8),
            qweight.new_empty((k,) if g_idx is not None else (0,), dtype=torch.int64))


@fake("int4_gemm")
def _int4_gemm_fake(ns, a, packed, scales, zeros, group_size=128, perm=None, deterministic=False):
    op = "int4_gemm"
    check_dim(ns, op, "a", a, 2, "[M, K]")
    same_device(ns, op, "a", a, packed=packed, scales=scales, zeros=zeros, perm=perm)
    check(ns, op, group_size > 0 and group_size % 16 == 0,
          f"group_size must be a positive multiple of 16 (16, 32, 64, 128 (default), ..., K), got {group_size}")
    return a.new_empty((a.shape[0], packed.shape[1] // 8))
