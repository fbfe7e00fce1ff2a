"""RMSNorm on the fastinfer ops (plain, and fused with the residual add of a Llama layer)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from .linear import Linear, QuantizedInput, param
from .weights import SingleWeightModule

Tensor = torch.Tensor

__all__ = ["RMSNorm"]


class RMSNorm(SingleWeightModule):
    """``x * rsqrt(mean(x^2) + eps) * (weight + weight_offset)`` over the last dimension (``hidden``),
    fp32 inside.

    ``forward(x)`` returns the normalised tensor; :meth:`add_norm` is the residual-stream step of a
    Llama layer. ``weight_offset`` is 0 here; zero-centred norms (Gemma, Qwen3.5) set it to 1 and
    hold the checkpoint's weight as it is.

    :meth:`norm_for` / :meth:`add_norm_for` feed a linear: when its method takes a pre-quantised
    input (fp8 / int8 W8A8 with per-token or static activation scales) the norm and the
    quantisation run as one op (``rms_norm_quant`` / ``fused_add_rms_norm_quant``), bit for bit the
    unfused pair; ``fuse_quant = False`` keeps them apart.
    """

    weight_offset = 0.0
    fuse_quant = True

    def __init__(self, hidden: int, eps: float, prefix: str, *, dtype, device, ops):
        super().__init__()
        self.prefix = prefix
        self.eps = float(eps)
        self.ops = ops
        self.weight = param((hidden,), dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, weight_offset=self.weight_offset)

    def add_norm(self, x: Tensor, residual: Tensor) -> Tuple[Tensor, Tensor]:
        """``residual <- x + residual``, then ``x <- rms_norm(residual)``, both in place."""
        self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps, weight_offset=self.weight_offset)
        return x, residual

    def _quantization(self, linear):
        # a module standing in for the linear (a wrapper, a hook's replacement) takes float input
        if not self.fuse_quant or not isinstance(linear, Linear):
            return None
        return linear.method.input_quantization(linear)

    def norm_for(self, x: Tensor, linear: nn.Module) -> Union[Tensor, QuantizedInput]:
        """``self(x)`` as ``linear``'s input: quantised by the fused op where its method allows."""
        q = self._quantization(linear)
        if q is None:
            return self(x)
        codes, scale = self.ops.rms_norm_quant(x, self.weight, self.eps, q[0], q[1], weight_offset=self.weight_offset)
        return QuantizedInput(codes, scale, x.dtype)

    def add_norm_for(self, x: Tensor, residual: Tensor,
                     linear: Optional[nn.Module]) -> Tuple[Union[Tensor, QuantizedInput], Tensor]:
        """:meth:`add_norm` as ``linear``'s input (None: no linear takes it alone); quantised by the
        fused op where its method allows (then ``x`` is left as it was, ``residual`` updated)."""
        q = self._quantization(linear)
        if q is None:
            return self.add_norm(x, residual)
        codes, scale = self.ops.fused_add_rms_norm_quant(x, residual, self.weight, self.eps, q[0], q[1],
                                                         weight_offset=self.weight_offset)
        return QuantizedInput(codes, scale, x.dtype), residual
