"""Which linear method each layer of a model gets, and which method each mixture-of-experts layer's
experts get (``moe_method``): :func:`resolve_quantization` is the one place
that turns the stored ``quantization_config`` and the on-load options into the
:class:`~fastinfer.layers.QuantizationConfig` a model is built with.
"""

from __future__ import annotations

from typing import Optional

from ..layers import (
    FusedMoE,
    FusedMoEMethod,
    Linear,
    LinearMethod,
    QuantizationConfig,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
)
from .config import NOT_QUANTIZED, QuantOptions, StoredQuantization, stored_quantization
from .methods import (
    Fp4FusedMoEMethod,
    Fp4LinearMethod,
    Fp8BlockLinearMethod,
    Fp8FusedMoEMethod,
    Fp8LinearMethod,
    Int4FusedMoEMethod,
    Int4LinearMethod,
    Int8LinearMethod,
    Nvfp4DequantizedFusedMoEMethod,
    Nvfp4DequantizedLinearMethod,
    fp4_experts_fit,
)

#: the values of ``fp4_weights``: a checkpoint's FP4 weights run as stored (where the FP4 kernels'
#: tiles fit, else dequantised) or dequantised to the model dtype
FP4_WEIGHTS = ("stored", "float")

__all__ = ["FP4_WEIGHTS", "OnLoadQuantization", "CheckpointQuantization", "CompressedTensorsQuantization",
           "GgufQuantization",
           "Mxfp4ExpertsQuantization", "resolve_quantization"]


def _ignored(layer: Linear, names) -> bool:
    """Whether an ignore-list entry occurs in one of ``layer``'s checkpoint module names (AutoAWQ's
    ``modules_to_not_convert`` rule: a substring match)."""
    return any(n in p for p in [layer.prefix] + [part.prefix for part in layer.parts] for n in names)


class OnLoadQuantization(QuantizationConfig):
    """A float checkpoint quantised while loading (``LLM(..., quantization="fp8" | "int4" | "int8" | "nvfp4" |
    "mxfp4")``)."""

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
        if self.opts.method in ("nvfp4", "mxfp4"):
            return Fp4LinearMethod(source="float", fmt=self.opts.method, opts=self.opts)
        return Int4LinearMethod(source="float", opts=self.opts)

    def moe_method(self, layer: FusedMoE) -> FusedMoEMethod:
        if self.opts.method == "fp8":
            return Fp8FusedMoEMethod(source="float", blockwise=False, opts=self.opts)
        if self.opts.method == "int4":
            return Int4FusedMoEMethod(source="float", opts=self.opts)
        raise ValueError(f"{layer.prefix}: quantization={self.opts.method!r} does not quantise mixture-of-experts "
                         "experts; quantization='fp8' (experts per channel) or 'int4' (group-wise) does")


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

    def moe_method(self, layer: FusedMoE) -> FusedMoEMethod:
        """The experts as stored: fine-grained fp8 in 128 x 128 blocks, fastinfer fp8 per channel,
        int4 (AutoAWQ, AutoGPTQ, fastinfer); experts stored in float (as ``modules_to_not_convert``
        leaves them) load in float."""
        if self.stored.kind == "fp8":
            return Fp8FusedMoEMethod(source="fp8", blockwise=True, stored_config=self.stored.config)
        if self.stored.method == "fp8":
            return Fp8FusedMoEMethod(source=self.stored.kind, blockwise=False, stored_config=self.stored.config)
        if self.stored.method == "int4":
            return Int4FusedMoEMethod(source=self.stored.kind, stored_config=self.stored.config)
        raise ValueError(f"{layer.prefix}: {self.stored.describe()} experts are not supported (mixture-of-experts "
                         "checkpoints load with fp8 or int4 experts: compressed-tensors, fine-grained fp8, "
                         "AutoAWQ, AutoGPTQ, fastinfer fp8 or int4)")


class CompressedTensorsQuantization(QuantizationConfig):
    """A compressed-tensors checkpoint: each checkpoint module gets its config group's scheme
    (:class:`~fastinfer.quant.compressed_tensors.CompressedTensorsConfig`: ``targets`` / ``ignore``),
    ``lm_head`` included when the checkpoint quantised it. The projections fused into one layer must
    share a scheme. An unsupported scheme is a ``ValueError`` naming it and the module."""

    _METHODS = {"int4": Int4LinearMethod, "fp8": Fp8LinearMethod, "fp8-block": Fp8BlockLinearMethod,
                "int8": Int8LinearMethod, "nvfp4": Fp4LinearMethod}

    def __init__(self, stored: StoredQuantization, fp4_weights: str = "stored"):
        self.stored = stored
        self.name = stored.describe()
        self.schemes = stored.schemes
        self.fp4_weights = _check_fp4_weights(fp4_weights)

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
        if scheme.kind == "nvfp4" and self.fp4_weights == "float":
            return Nvfp4DequantizedLinearMethod(scheme=scheme)
        return self._METHODS[scheme.kind](source="compressed-tensors", stored_config=self.stored.config,
                                          scheme=scheme)

    def moe_method(self, layer: FusedMoE) -> FusedMoEMethod:
        """The scheme every expert projection of ``layer`` shares: fp8 with dynamic per-token
        activations (FP8_DYNAMIC: per channel or per tensor weights), FP8_BLOCK, or int4 W4A16
        (``pack-quantized``, group-wise or channel-wise, symmetric or not); none: float experts. The
        router is never asked (it stays float)."""
        schemes = {}
        for e in range(layer.num_experts):
            for part in layer.expert_projections(e):
                schemes.setdefault(self.schemes.scheme_for(part.prefix), part.prefix)
        if len(schemes) > 1:
            which = ", ".join(f"{prefix}: {s.group if s else 'ignored (float)'}" for s, prefix in schemes.items())
            raise ValueError(f"{layer.prefix}: the experts have different compressed-tensors schemes ({which}); "
                             "every expert projection of a layer must share one")
        scheme, prefix = next(iter(schemes.items()))
        if scheme is None:
            return UnquantizedFusedMoEMethod()
        if scheme.kind == "unsupported":
            raise ValueError(f"{prefix}: {scheme.description}")
        if scheme.kind == "fp8-block":
            return Fp8FusedMoEMethod(source="compressed-tensors", blockwise=True, stored_config=self.stored.config,
                                     scheme=scheme)
        if scheme.kind == "fp8" and scheme.activation == "token":
            return Fp8FusedMoEMethod(source="compressed-tensors", blockwise=False, stored_config=self.stored.config,
                                     scheme=scheme)
        if scheme.kind == "int4":
            return Int4FusedMoEMethod(source="compressed-tensors", stored_config=self.stored.config, scheme=scheme)
        if scheme.kind == "nvfp4":
            if self.fp4_weights == "stored" and fp4_experts_fit(layer):
                return Fp4FusedMoEMethod("nvfp4", stored_config=self.stored.config, scheme=scheme)
            return Nvfp4DequantizedFusedMoEMethod()
        raise ValueError(f"{prefix}: compressed-tensors scheme {scheme.description} of config group "
                         f"{scheme.group!r} is not supported for experts (fused_moe_fp8 runs fp8 experts with "
                         "activations quantised dynamically per token, or per 1 x 128 group with 128 x 128 blocks: "
                         "FP8_DYNAMIC, FP8_BLOCK; fused_moe_int4 runs int4 W4A16 experts; fused_moe_fp4 NVFP4A16 "
                         "experts)")


_GGUF_FLOATS = ("F32", "F16", "BF16")  # GGUF tensor types that are float already


class GgufQuantization(QuantizationConfig):
    """A GGUF file's weights as stored where a kernel runs their type: a linear whose every part is
    one of :data:`~fastinfer.models.gguf.GGUF_INT4_TYPES` (Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K /
    Q8_0), with this rank's K a multiple of 64 and its N of 16 (the int4 layout's tile), runs on
    ``int4_gemm`` (:class:`Int4LinearMethod`, group 32, zero point 8; float minimums, centred, as a
    second term; the 5- and 8-bit types as two nibble planes, :class:`~fastinfer.models.gguf.GgufInt4`);
    every other weight (the other types, a fused layer with
    a part of another type, lm_head, the experts) is dequantised to the model dtype, and the
    types that are reported once (:attr:`dequantized_types`). ``strict`` (``gguf_weights="stored"``):
    a quantised decoder linear or expert that cannot run as stored is an error naming its tensor, its
    type and the types that can; the output projection (a tied embedding too) is dequantised either
    way, as every quantisation keeps lm_head in float."""

    name = "gguf"

    def __init__(self, path: str, model_config, strict: bool = False):
        from ..models.gguf import GGUF_INT4_TYPES, GGUFWeightReader

        self.reader = GGUFWeightReader(path, model_config)
        self.int4_types = GGUF_INT4_TYPES
        self.strict = strict
        self.dequantized_types: set = set()

    def _dequantized(self, prefix: str, types, why: str) -> None:
        quantised = [t for t in types if t is not None and t not in _GGUF_FLOATS]
        if quantised and self.strict:
            named = [t for t in quantised if t not in self.int4_types] or quantised
            raise ValueError(
                f"{prefix}: GGUF type {', '.join(sorted(set(named)))} cannot run as stored ({why}); "
                f"gguf_weights='stored' runs {' / '.join(self.int4_types)} linears with whole 64 x 16 tiles "
                "as stored (gguf_weights='auto' dequantises the others, 'float' everything)")
        self.dequantized_types.update(quantised)

    def _type(self, prefix: str) -> Optional[str]:
        name = prefix + ".weight"
        return self.reader.gguf_type(name) if self.reader.has(name) else None

    def linear_method(self, layer: Linear) -> LinearMethod:
        types = [self._type(p.prefix) for p in layer.parts]
        if _ignored(layer, NOT_QUANTIZED):  # lm_head (its probe has only a name and parts)
            self.dequantized_types.update(t for t in types if t is not None and t not in _GGUF_FLOATS)
            return UnquantizedLinearMethod()
        # whole 64 x 16 tiles of the int4 layout on this rank (its rows, and its input features:
        # the whole K, or a row-parallel slice, also whole 32-groups then)
        fits = layer.in_features % 64 == 0 and all(n % 16 == 0 for n in layer.part_rows)
        if fits and all(t in self.int4_types for t in types):
            return Int4LinearMethod(source="gguf")
        if all(t in self.int4_types for t in types):
            why = f"{layer.in_features} input features and {layer.part_rows} rows on this rank are not whole tiles"
        elif all(t in self.int4_types or t in _GGUF_FLOATS for t in types):
            why = "fused with a float part"
        else:
            why = "no kernel for the type"
        self._dequantized(", ".join(p.prefix for p in layer.parts), types, why)
        return UnquantizedLinearMethod()

    def moe_method(self, layer: FusedMoE) -> FusedMoEMethod:
        for e in range(layer.num_experts):
            for part in layer.expert_projections(e):
                self._dequantized(part.prefix, [self._type(part.prefix)], "experts run in float")
        return UnquantizedFusedMoEMethod()


class Mxfp4ExpertsQuantization(QuantizationConfig):
    """A gpt-oss checkpoint whose experts are MXFP4 (``quantization_config {"quant_method": "mxfp4"}``,
    transformers' ``Mxfp4Config``: ``mlp.experts.gate_up_proj_blocks`` / ``_scales`` and
    ``down_proj_blocks`` / ``_scales``; the attention, router, embedding and head in float). The
    experts run as stored on ``fused_moe_fp4`` (:class:`Fp4FusedMoEMethod`, with gpt-oss's clamped
    SwiGLU and biases) where its tiles fit (:func:`fp4_experts_fit`: H and each rank's I multiples of
    64); otherwise, or with ``fp4_weights="float"``, they are dequantised while loading
    (:class:`~fastinfer.models.gpt_oss.GptOssExpertsReader`) and run as float experts, the reasons
    in :attr:`dequantized_why`. Every linear is float."""

    name = "mxfp4 experts"
    experts_mxfp4 = True

    def __init__(self, stored: StoredQuantization, model_config, fp4_weights: str = "stored"):
        arch = getattr(model_config, "architecture", None)
        if arch != "GptOssForCausalLM":
            raise ValueError(f"quantization_config quant_method 'mxfp4' is gpt-oss's expert format; {arch} has no "
                             "MXFP4 checkpoint layout")
        self.stored = stored
        self.fp4_weights = _check_fp4_weights(fp4_weights)
        self.dequantized_why: set = set()

    def moe_method(self, layer: FusedMoE) -> FusedMoEMethod:
        if self.fp4_weights == "float":
            self.dequantized_why.add("fp4_weights='float'")
        elif not fp4_experts_fit(layer):
            self.dequantized_why.add(
                f"fused_moe_fp4 needs the hidden size ({layer.hidden_size}) and each rank's expert intermediate size "
                f"({layer.local_intermediate_size}) to be multiples of 64")
        else:
            return Fp4FusedMoEMethod("mxfp4", stored_config=self.stored.config)
        return UnquantizedFusedMoEMethod()


def _check_fp4_weights(fp4_weights: str) -> str:
    if fp4_weights not in FP4_WEIGHTS:
        raise ValueError(f"fp4_weights must be 'stored' or 'float', got {fp4_weights!r}")
    return fp4_weights


def resolve_quantization(model_config, opts: Optional[QuantOptions] = None,
                         path: Optional[str] = None, gguf_weights: str = "auto",
                         fp4_weights: str = "stored") -> Optional[QuantizationConfig]:
    """The quantisation a model loads with: as stored when its ``config.json`` says it is quantised
    (``opts`` may then only name the stored method; a checkpoint's FP4 weights, compressed-tensors
    NVFP4 and gpt-oss's MXFP4 experts, dequantised with ``fp4_weights="float"``), else ``opts``
    (quantise on load), else, for a GGUF file with ``gguf_weights`` ``"auto"`` or ``"stored"``, its
    quantised types as stored where a kernel runs them (:class:`GgufQuantization`, strict with
    ``"stored"``), else None (float)."""
    _check_fp4_weights(fp4_weights)
    from ..models.gguf import find_gguf

    gguf_file = find_gguf(path) if path is not None and opts is None else None
    if gguf_file is not None and gguf_weights in ("auto", "stored"):
        return GgufQuantization(gguf_file, model_config, strict=gguf_weights == "stored")
    stored = stored_quantization(model_config)
    if getattr(model_config, "is_hybrid", False) and (stored is not None or opts is not None):
        return _hybrid_experts_quantization(model_config, opts, stored)
    if stored is not None:
        if opts is not None and opts.method != stored.method:
            where = f"checkpoint {path!r}" if path else "the checkpoint"
            also = f" or {stored.method!r}" if stored.method in ("fp8", "int4", "int8") else ""
            raise ValueError(
                f"{where} is already quantised ({stored.describe()}); quantization={opts.method!r} "
                f"cannot be applied to it (pass quantization=None{also} to run it as stored)")
        if stored.kind == "compressed-tensors":
            return CompressedTensorsQuantization(stored, fp4_weights)
        if stored.kind == "mxfp4":
            return Mxfp4ExpertsQuantization(stored, model_config, fp4_weights)
        return CheckpointQuantization(stored)
    return OnLoadQuantization(opts) if opts is not None else None


class ExpertsOnlyQuantization(QuantizationConfig):
    """``quantization="fp8"`` on load for a hybrid (Gated DeltaNet) MoE model: the routed experts
    quantised as a MoE model's (:class:`Fp8FusedMoEMethod`, per channel), every linear left in float
    (the linear-attention and attention projections, the shared expert)."""

    def __init__(self, opts: QuantOptions):
        self.experts = OnLoadQuantization(opts)
        self.name = f"{opts.method} (experts)"

    def linear_method(self, layer: Linear) -> LinearMethod:
        return UnquantizedLinearMethod()

    def moe_method(self, layer: FusedMoE) -> FusedMoEMethod:
        return self.experts.moe_method(layer)


def _hybrid_experts_quantization(model_config, opts: Optional[QuantOptions], stored) -> QuantizationConfig:
    """A hybrid model quantises its experts only, fp8 on load; everything else is refused by name."""
    arch = model_config.architecture
    if stored is not None:
        raise ValueError(f"quantised {arch} checkpoints ({stored.describe()}) are not supported: quantise a float "
                         "checkpoint on load (quantization='fp8', the experts of a MoE variant)")
    if opts.method != "fp8" or model_config.num_experts == 0:
        raise ValueError(f"quantization={opts.method!r} is not supported for {arch}: its linear-attention and "
                         "attention projections run in float; only the routed experts of a MoE variant "
                         "(Qwen3.5-MoE, Qwen3-Next) are quantised, with quantization='fp8'")
    return ExpertsOnlyQuantization(opts)
