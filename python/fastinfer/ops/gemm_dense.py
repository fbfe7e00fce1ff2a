"""Python wrapper for ``dense_mm``: the batch-invariant fp16 / bf16 (fp32 on CPU) GEMM.

Calls ``torch.ops.fastinfer.dense_mm`` (CPU and CUDA kernels, fake impls; ``torch.ops.fastinfer_sim``
runs the CUDA kernel on CPU tensors). The oracle is :func:`fastinfer.reference.dense_mm`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._fake import fake, same_device

Tensor = torch.Tensor

__all__ = ["dense_mm"]


def dense_mm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, *, lib=None) -> Tensor:
    """``out = a @ b^T (+ bias)``, fp32 accumulation, rounded once to the dtype of ``a``.

    Batch invariant: row ``m`` of the result is bitwise the same whatever M and the other rows
    (``torch.matmul`` is not: its kernels pick blockings and k-splits from M). The CUDA kernel is a
    hand-written ``mma.sync.m16n8k16`` kernel (sm_80+) with a cp.async pipeline and ldmatrix
    fragments, tiles chosen by M but no split-K: each accumulator runs over k in order. The CPU
    implementation reduces every element with the same fixed-order fp32 fma micro-kernel.

    Args:
        a: ``[M, K]`` float16 / bfloat16 (float32 too on CPU), contiguous; K a multiple of 8.
        b: ``[N, K]`` of a's dtype, contiguous row-major (an ``nn.Linear`` weight); any N.
        bias: optional ``[N]`` of a's dtype, added in fp32 before the rounding.

    Returns:
        A new ``[M, N]`` tensor of a's dtype.
    """
    return (lib or torch.ops.fastinfer).dense_mm(a, b, bias)


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("dense_mm")
def _dense_mm_fake(ns, a, b, bias=None):
    same_device(ns, "dense_mm", "a", a, b=b, bias=bias)
    return a.new_empty((a.shape[0], b.shape[0]))
