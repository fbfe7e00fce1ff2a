"""RMSNorm on the fastinfer ops (plain, and fused with the residual add of a Llama layer)."""

from __future__ import annotations

from typing import Tuple

import torch

from .linear import param
from .weights import SingleWeightModule

Tensor = torch.Tensor

__all__ = ["RMSNorm"]


class RMSNorm(SingleWeightModule):
    """``x * rsqrt(mean(x^2) + eps) * (weight + weight_offset)`` over the last dimension (``hidden``),
    fp32 inside.

    ``forward(x)`` returns the normalised tensor; :meth:`add_norm` is the residual-stream step of a
    Llama layer. ``weight_offset`` is 0 here; zero-centred norms (Gemma, Qwen3.5) set it to 1 and
    hold the checkpoint's weight as it is.
    """

    weight_offset = 0.0

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
