"""Which linear method each layer of a model gets: :func:`resolve_quantization` is the one place
that turns the stored ``quantization_config`` and the on-load options into the
:class:`~fastinfer.layers.QuantizationConfig` a model is built with.
"""

from __future__ import annotations

from typing import Optional

from ..layers import Linear, LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from .config import NOT_QUANTIZED, QuantOptions, StoredQuantization, stored_quantization
from .methods import Fp8LinearMethod, Int4LinearMethod

__all__ = ["OnLoadQuantization", "CheckpointQuantization", "resolve_quantization"]


def _ignored(layer: Linear, names) -> bool:
    """Whether an ignore-list entry occurs in one of ``layer``'s checkpoint module names (AutoAWQ's
    ``modules_to_not_convert`` rule: a substring match)."""
    return any(n in p for p in [layer.prefix] + [part.prefix for part in layer.parts] for n in names)


class OnLoadQuantization(QuantizationConfig):
    """A float checkpoint quantised while loading (``LLM(..., quantization="fp8" | "int4")``)."""

    def __init__(self, opts: QuantOptions):
        self.opts = opts
        self.name = opts.method

    def linear_method(self, layer: Linear) -> LinearMethod:
        if _ignored(layer, NOT_QUANTIZED):
            return UnquantizedLinearMethod()
        if self.opts.method == "fp8":
            return Fp8LinearMethod(source="float", opts=self.opts)
        return Int4LinearMethod(source="float", opts=self.opts)


class CheckpointQuantization(QuantizationConfig):
    """A checkpoint stored quantised (fastinfer, AutoAWQ, AutoGPTQ): every layer as stored."""

    def __init__(self, stored: StoredQuantization):
        self.stored = stored
        self.name = stored.describe()
        qc = stored.config
        self.ignore = list(NOT_QUANTIZED) + list(qc.get("modules_not_quantized") or []) + \
            list(qc.get("modules_to_not_convert") or [])

    def linear_method(self, layer: Linear) -> LinearMethod:
        if _ignored(layer, self.ignore):
            return UnquantizedLinearMethod()
        if self.stored.method == "fp8":
            return Fp8LinearMethod(source=self.stored.kind, stored_config=self.stored.config)
        return Int4LinearMethod(source=self.stored.kind, stored_config=self.stored.config)


def resolve_quantization(model_config, opts: Optional[QuantOptions] = None,
                         path: Optional[str] = None) -> Optional[QuantizationConfig]:
    """The quantisation a model loads with: as stored when its ``config.json`` says it is quantised
    (``opts`` may then only name the stored method), else ``opts`` (quantise on load), else None
    (float)."""
    stored = stored_quantization(model_config)
    if stored is not None:
        if opts is not None and opts.method != stored.method:
            where = f"checkpoint {path!r}" if path else "the checkpoint"
            raise ValueError(
                f"{where} is already quantised ({stored.describe()}); quantization={opts.method!r} "
                f"cannot be applied to it (pass quantization=None or {stored.method!r} to run it as stored)")
        return CheckpointQuantization(stored)
    return OnLoadQuantization(opts) if opts is not None else None
