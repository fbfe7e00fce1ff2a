"""Which linear method each layer of a model gets: :func:`resolve_quantization` is the one place
that turns the stored ``quantization_config`` and the on-load options into the
:class:`~fastinfer.layers.QuantizationConfig` a model is built with.
"""

from __future__ import annotations

from typing import Optional

from ..layers import Linear, LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from .config import NOT_QUANTIZED, QuantOptions, StoredQuantization, stored_quantization
from .methods import Fp8BlockLinearMethod, Fp8LinearMethod, Int4LinearMethod, Int8LinearMethod

__all__ = ["OnLoadQuantization", "CheckpointQuantization", "CompressedTensorsQuantization", "resolve_quantization"]


def _ignored(layer: Linear, names) -> bool:
    """Whether an ignore-list entry occurs in one of ``layer``'s checkpoint module names (AutoAWQ's
    ``modules_to_not_convert`` rule: a substring match)."""
    return any(n in p for p in [layer.prefix] + [part.prefix for part in layer.parts] for n in names)


class OnLoadQuantization(QuantizationConfig):
    """A float checkpoint quantised while loading (``LLM(..., quantization="fp8" | "int4" | "int8")``)."""

    def __init__(self, opts: QuantOptions):
        self.opts = opts
        self.name = opts.method

    def linear_method(self, layer: Linear) -> LinearMethod:
        if _ignored(layer, NOT_QUANTIZED):
            return UnquantizedLinearMethod()
        if self.opts.method == "fp8":
            return Fp8LinearMethod(source="float", opts=self.opts)
        if self.opts.method == "int8":
            return Int8LinearMethod(source="float", opts=self.opts)
        return Int4LinearMethod(source="float", opts=self.opts)


class CheckpointQuantization(QuantizationConfig):
    """A checkpoint stored quantised (fastinfer, AutoAWQ, AutoGPTQ, fine-grained fp8): every layer as
    stored. Fine-grained fp8 (``kind`` "fp8") decides by the stored tensors alone: a linear whose
    weight is float (``modules_to_not_convert``, whose matching rules are transformers') loads in
    float."""

    def __init__(self, stored: StoredQuantization):
        self.stored = stored
        self.name = stored.describe()
        qc = stored.config
        self.ignore = list(NOT_QUANTIZED)
        if stored.kind != "fp8":
            self.ignore += list(qc.get("modules_not_quantized") or []) + list(qc.get("modules_to_not_convert") or [])

    def linear_method(self, layer: Linear) -> LinearMethod:
        if _ignored(layer, self.ignore):
            return UnquantizedLinearMethod()
        if self.stored.kind == "fp8":
            return Fp8BlockLinearMethod(source="fp8", stored_config=self.stored.config)
        if self.stored.method == "fp8":
            return Fp8LinearMethod(source=self.stored.kind, stored_config=self.stored.config)
        if self.stored.method == "int8":
            return Int8LinearMethod(source=self.stored.kind, stored_config=self.stored.config)
        return Int4LinearMethod(source=self.stored.kind, stored_config=self.stored.config)


class CompressedTensorsQuantization(QuantizationConfig):
    """A compressed-tensors checkpoint: each checkpoint module gets its config group's scheme
    (:class:`~fastinfer.quant.compressed_tensors.CompressedTensorsConfig`: ``targets`` / ``ignore``),
    ``lm_head`` included when the checkpoint quantised it. The projections fused into one layer must
    share a scheme. An unsupported scheme is a ``ValueError`` naming it and the module."""

    _METHODS = {"int4": Int4LinearMethod, "fp8": Fp8LinearMethod, "fp8-block": Fp8BlockLinearMethod,
                "int8": Int8LinearMethod}

    def __init__(self, stored: StoredQuantization):
        self.stored = stored
        self.name = stored.describe()
        self.schemes = stored.schemes

    def linear_method(self, layer: Linear) -> LinearMethod:
        found = [(p.prefix, self.schemes.scheme_for(p.prefix)) for p in layer.parts]
        for prefix, scheme in found:
            if scheme is not None and scheme.kind == "unsupported":
                raise ValueError(f"{prefix}: {scheme.description}")
        if len({s for _, s in found}) > 1:
            which = ", ".join(f"{p.rsplit('.', 1)[-1]}: {s.group if s else 'ignored (float)'}" for p, s in found)
            raise ValueError(f"{layer.prefix}: the projections fused into this layer have different "
                             f"compressed-tensors schemes ({which}); they must share one")
        scheme = found[0][1]
        if scheme is None:
            return UnquantizedLinearMethod()
        return self._METHODS[scheme.kind](source="compressed-tensors", stored_config=self.stored.config,
                                          scheme=scheme)


def resolve_quantization(model_config, opts: Optional[QuantOptions] = None,
                         path: Optional[str] = None) -> Optional[QuantizationConfig]:
    """The quantisation a model loads with: as stored when its ``config.json`` says it is quantised
    (``opts`` may then only name the stored method), else ``opts`` (quantise on load), else None
    (float)."""
    stored = stored_quantization(model_config)
    if stored is not None:
        if opts is not None and opts.method != stored.method:
            where = f"checkpoint {path!r}" if path else "the checkpoint"
            also = f" or {stored.method!r}" if stored.method in ("fp8", "int4", "int8") else ""
            raise ValueError(
                f"{where} is already quantised ({stored.describe()}); quantization={opts.method!r} "
                f"cannot be applied to it (pass quantization=None{also} to run it as stored)")
        if stored.kind == "compressed-tensors":
            return CompressedTensorsQuantization(stored)
        return CheckpointQuantization(stored)
    return OnLoadQuantization(opts) if opts is not None else None
