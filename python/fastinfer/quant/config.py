"""What quantisation was asked for: options for quantising on load (:class:`QuantOptions`) and
the ``quantization_config`` of a stored checkpoint (:func:`stored_quantization`).
:mod:`fastinfer.quant.resolve` turns them into each layer's linear method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from .compressed_tensors import FP8_BLOCK, CompressedTensorsConfig

__all__ = ["FORMAT_VERSION", "METHODS", "ON_LOAD_ONLY", "NOT_QUANTIZED", "QuantOptions", "StoredQuantization",
           "stored_quantization"]

FORMAT_VERSION = 1
METHODS = ("fp8", "int4", "int8", "nvfp4", "mxfp4")
# methods that quantise on load only (fastinfer quantize writes no checkpoint of them)
ON_LOAD_ONLY = ("nvfp4", "mxfp4")
# layers never quantised: the LM head (tied to the embedding in many small models; it dominates the
# logits' accuracy)
NOT_QUANTIZED = ("lm_head",)


@dataclass(frozen=True)
class QuantOptions:
    """What to quantise a float checkpoint to. ``group_size`` / ``symmetric`` / ``pad_groups``: int4 only."""

    method: str
    group_size: int = 128
    symmetric: bool = False
    pad_groups: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r} (one of {', '.join(METHODS)})")
        g = self.group_size
        if self.method == "int4" and (not isinstance(g, int) or isinstance(g, bool) or g < 32 or g % 32):
            raise ValueError(f"group_size must be a positive multiple of 32 (the int4 kernel's unit), got {g!r}")

    @classmethod
    def from_any(cls, method: Optional[str], config: Optional[dict] = None) -> Optional["QuantOptions"]:
        """``method`` plus an optional dict of ``group_size`` / ``symmetric`` / ``pad_groups``."""
        if method is None:
            if config:
                raise ValueError("quantization_config given without quantization='fp8', 'int4' or 'int8'")
            return None
        config = dict(config or {})
        unknown = set(config) - {"group_size", "symmetric", "pad_groups"}
        if unknown:
            raise ValueError(f"unknown quantization_config keys {sorted(unknown)} (group_size, symmetric, pad_groups)")
        if config and method in ON_LOAD_ONLY:
            raise ValueError(f"quantization_config {sorted(config)}: group_size / symmetric / pad_groups are int4 "
                             f"options; {method!r} has fixed groups (nvfp4: 16, mxfp4: 32) and takes none")
        return cls(str(method), **config)

    def config_entry(self, smoothquant: Optional[dict] = None) -> dict:
        """The ``quantization_config`` entry of a checkpoint written with these options (int8:
        ``smoothquant`` = how the weights were smoothed, or None)."""
        d = {"quant_method": "fastinfer", "format_version": FORMAT_VERSION, "method": self.method,
             "modules_not_quantized": list(NOT_QUANTIZED)}
        if self.method == "fp8":
            d.update(weight="e4m3, per output channel", activation="e4m3, dynamic per token")
        elif self.method == "int8":
            d.update(weight="int8 symmetric, per output channel", activation="int8 symmetric, dynamic per token",
                     smoothquant=smoothquant)
        else:
            d.update(weight="int4, group-wise", activation="unquantised", group_size=self.group_size,
                     symmetric=bool(self.symmetric), pad_groups=bool(self.pad_groups))
        return d


class StoredQuantization(NamedTuple):
    """How a checkpoint is quantised: ``kind`` "fastinfer" / "awq" / "gptq" / "compressed-tensors" /
    "fp8" (Hugging Face fine-grained FP8) / "mxfp4" (gpt-oss's MXFP4 experts), ``method`` "fp8" / "int4" ("mixed" for a compressed-tensors
    checkpoint with both); ``schemes``: the parsed compressed-tensors config."""

    kind: str
    method: str
    config: dict
    schemes: Optional[Any] = None  # CompressedTensorsConfig for kind "compressed-tensors"

    def describe(self) -> str:
        if self.kind == "fastinfer":
            return f"fastinfer {self.method}"
        if self.kind == "fp8":
            return "fine-grained fp8"
        if self.kind == "mxfp4":
            return "mxfp4 experts"
        return self.kind


def stored_quantization(config) -> Optional[StoredQuantization]:
    """Parse ``config.json``'s ``quantization_config`` (``config``: a ModelConfig or the raw dict);
    None for a float checkpoint. Unsupported variants raise ``ValueError`` naming the field."""
    raw = getattr(config, "raw", config) or {}
    qc = raw.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a dict, got {qc!r}")
    qm = str(qc.get("quant_method", "")).lower()
    if qm == "fastinfer":
        if qc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported fastinfer quantization format_version {qc.get('format_version')!r} "
                             f"({FORMAT_VERSION})")
        if qc.get("method") not in METHODS:
            raise ValueError(f"unsupported fastinfer quantization method {qc.get('method')!r}")
        return StoredQuantization("fastinfer", qc["method"], qc)
    if qm in ("awq", "gptq"):
        if qc.get("bits", 4) != 4:
            raise ValueError(f"{qm}: only 4-bit checkpoints are supported, got bits={qc.get('bits')!r}")
        if qm == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"awq: only version 'gemm' checkpoints are supported, got {version!r}")
            if qc.get("zero_point", True) is False:
                raise ValueError("awq: zero_point=false checkpoints are not supported")
        else:
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt != "gptq":
                raise ValueError(f"gptq: only checkpoint_format 'gptq' (v1) is supported, got {fmt!r}")
        return StoredQuantization(qm, "int4", qc)
    if qm == "compressed-tensors":
        ct = CompressedTensorsConfig(qc)
        kinds = ct.kinds - {"unsupported"}
        families = {"int4" if k == "int4" else "int8" if k == "int8" else "fp8" for k in kinds}
        method = families.pop() if len(families) == 1 else "mixed" if families else "fp8"
        return StoredQuantization(qm, method, qc, ct)
    if qm == "fp8":  # transformers' FineGrainedFP8Config (Qwen3 / DeepSeek FP8 releases)
        block = qc.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])  # transformers' default
        if block is None or list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(f"fp8: only weight_block_size [128, 128] checkpoints are supported, got {block!r}")
        act = str(qc.get("activation_scheme", "dynamic")).lower()
        if act != "dynamic":
            raise ValueError(f"fp8: only activation_scheme 'dynamic' is supported, got {act!r}")
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8: only fmt 'e4m3' is supported, got {fmt!r}")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "float"):
            raise ValueError(f"fp8: only float32 block scales (scale_fmt 'float') are supported, got {scale_fmt!r}")
        if qc.get("modules_to_convert"):
            raise ValueError(f"fp8: modules_to_convert {qc['modules_to_convert']!r} (fp8 embeddings) is not supported")
        return StoredQuantization("fp8", "fp8", qc)
    if qm == "mxfp4":  # transformers' Mxfp4Config: gpt-oss's experts as *_blocks / *_scales
        return StoredQuantization("mxfp4", "mxfp4", qc)
    raise ValueError(f"unsupported quantization_config quant_method {qc.get('quant_method')!r} "
                     "(fastinfer, awq, gptq, compressed-tensors, fp8, mxfp4)")
