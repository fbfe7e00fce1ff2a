"""Quantised drop-in replacements of the runner's ``_Linear`` (``forward(x) -> x @ W^T + b``)."""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
from torch import nn

Tensor = torch.Tensor

__all__ = ["QuantizedLinear", "Fp8Linear", "Int4Linear", "Int4Part"]


def _buffer(module: nn.Module, name: str, t: Optional[Tensor]) -> None:
    module.register_buffer(name, t, persistent=False)


class QuantizedLinear(nn.Module):
    """Base: ``in_features`` (the activation width), ``out_features``, optional float ``bias``."""

    method = "none"

    def __init__(self, in_features: int, out_features: int, bias: Optional[Tensor]):
        super().__init__()
        # "fastinfer" or "fastinfer_sim" (the CUDA kernel sources on the simt emulator); the model's
        # set_op_namespace() sets it
        self.op_namespace = "fastinfer"
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Fp8Linear(QuantizedLinear):
    """W8A8: ``fp8_scaled_mm(fp8_quantize(x, 'token'), W_e4m3, s_x, s_w)``, out dtype = x's dtype.

    Args:
        weight: float8_e4m3fn ``[N, K]``; weight_scale: float32 ``[N]`` (per output channel).
    """

    method = "fp8"

    def __init__(self, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor] = None):
        n, k = weight.shape
        super().__init__(k, n, bias)
        if weight.dtype != torch.float8_e4m3fn or weight_scale.dtype != torch.float32 or weight_scale.shape != (n,):
            raise ValueError("Fp8Linear needs an e4m3 weight [N, K] and a float32 scale [N]")
        _buffer(self, "weight", weight.contiguous())
        _buffer(self, "weight_scale", weight_scale.contiguous())

    def forward(self, x: Tensor) -> Tensor:
        ops = getattr(torch.ops, self.op_namespace)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        xq, xs = ops.fp8_quantize(x2, "token", 128, None)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        out = ops.fp8_scaled_mm(xq, self.weight, xs, self.weight_scale, x.dtype, bias)
        return out.reshape(*lead, self.out_features)


class Int4Part(NamedTuple):
    """One int4 GEMM: ``packed int32 [Kq/64, 8 n]``, ``scales [Kq/G, n]``, ``zeros uint8 [Kq/G, n]``
    or None (symmetric), act-order ``perm int64 [Kq]`` or None, group size ``G``."""

    packed: Tensor
    scales: Tensor
    zeros: Optional[Tensor]
    perm: Optional[Tensor]
    group_size: int

    @property
    def n(self) -> int:
        return self.packed.shape[1] // 8

    @property
    def k(self) -> int:
        return self.packed.shape[0] * 64


class Int4Linear(QuantizedLinear):
    """W4A16: ``int4_gemm(x, packed, scales, zeros, G, perm)`` (+ bias).

    Usually one :class:`Int4Part`; several (outputs concatenated along N) when fused projections
    have different act-order permutations. A stored input size ``Kq`` larger than the activation
    width (``pad_groups``) zero-pads the activations.
    """

    method = "int4"

    def __init__(self, parts: List[Int4Part], in_features: int, bias: Optional[Tensor] = None):
        if not parts:
            raise ValueError("Int4Linear needs at least one part")
        kq = parts[0].k
        if any(p.k != kq for p in parts) or kq < in_features:
            raise ValueError("Int4Linear parts must share the (padded) input size >= in_features")
        super().__init__(in_features, sum(p.n for p in parts), bias)
        self.kq = kq
        self.num_parts = len(parts)
        self.group_sizes = [int(p.group_size) for p in parts]
        for i, p in enumerate(parts):
            _buffer(self, f"packed{i}", p.packed.contiguous())
            _buffer(self, f"scales{i}", p.scales.contiguous())
            _buffer(self, f"zeros{i}", None if p.zeros is None else p.zeros.contiguous())
            _buffer(self, f"perm{i}", None if p.perm is None else p.perm.contiguous())

    def part(self, i: int) -> Int4Part:
        return Int4Part(getattr(self, f"packed{i}"), getattr(self, f"scales{i}"), getattr(self, f"zeros{i}"),
                        getattr(self, f"perm{i}"), self.group_sizes[i])

    def forward(self, x: Tensor) -> Tensor:
        ops = getattr(torch.ops, self.op_namespace)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kq != self.in_features:
            x2 = torch.nn.functional.pad(x2, (0, self.kq - self.in_features))
        x2 = x2.contiguous()
        outs = []
        for i in range(self.num_parts):
            p = self.part(i)
            outs.append(ops.int4_gemm(x2, p.packed, p.scales, p.zeros, p.group_size, p.perm))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kq={self.kq}, parts={self.num_parts}, group_sizes={self.group_sizes}"
