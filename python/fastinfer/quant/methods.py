"""Quantised linear methods (:class:`~fastinfer.layers.LinearMethod`): fp8 W8A8 and int4 W4A16.

A method reads every part (checkpoint projection) of its layer from wherever it is stored —
quantised in fastinfer's format, AutoAWQ, AutoGPTQ, or float (then quantised on load) — fuses the
parts, and multiplies with ``fp8_scaled_mm`` / ``int4_gemm``. A layer whose parts a quantised
checkpoint left in float becomes a float linear.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from ..layers import Linear, LinearMethod, UnquantizedLinearMethod, WeightPart, WeightReader, check_tensor
from ..ops import int4_pack, int4_repack
from .config import QuantOptions
from .math import quantize_fp8_weight, quantize_int4_weight, unpack_nibbles

Tensor = torch.Tensor

__all__ = ["Fp8LinearMethod", "Int4LinearMethod", "Int4Part"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


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


class _Stored(NamedTuple):
    kind: str  # "float" | "fp8" | "int4"
    data: tuple  # float: (w,); fp8: (codes, scale); int4: (Int4Part,)


def _trivial_g_idx(g_idx: Tensor, k: int, groups: int) -> bool:
    if k % groups:
        return False
    return torch.equal(g_idx.to(torch.int64), torch.arange(k, dtype=torch.int64) // (k // groups))


def _read_awq_gptq(r: WeightReader, prefix: str, fmt: str, n: int, k: int, dtype) -> _Stored:
    zshape = r.shape(prefix + ".qzeros")
    groups = zshape[0] if len(zshape) == 2 else 0
    if groups < 1 or k % groups:
        raise ValueError(f"tensor {prefix}.qzeros has shape {list(zshape)}: its rows must divide K={k}")
    qweight = r.get(prefix + ".qweight", (k, n // 8) if fmt == "awq" else (k // 8, n), (torch.int32,))
    qzeros = r.get(prefix + ".qzeros", (groups, n // 8), (torch.int32,))
    scales = r.get(prefix + ".scales", (groups, n), _FLOATS)
    g_idx = None
    if r.has(prefix + ".g_idx"):
        if fmt != "gptq":
            raise ValueError(f"tensor {prefix}.g_idx found in an {fmt} checkpoint (act-order is gptq only)")
        g_idx = r.get(prefix + ".g_idx", (k,), (torch.int32, torch.int64))
        if _trivial_g_idx(g_idx, k, groups):
            g_idx = None
    try:
        w = int4_repack(qweight.contiguous(), qzeros.contiguous(), fmt, g_idx)
    except RuntimeError as e:
        raise ValueError(f"{prefix}: cannot repack the {fmt} tensors: {e}") from None
    return _Stored("int4", (Int4Part(w.packed, scales.to(dtype), w.zeros, w.perm, k // groups),))


def _read_fastinfer_int4(r: WeightReader, prefix: str, config: dict, n: int, k: int, dtype) -> _Stored:
    g = int(config.get("group_size", 0))
    pk = r.get(prefix + ".weight_packed")
    if pk.dim() != 2 or pk.shape[0] != n or pk.dtype != torch.uint8 or g < 32 or (2 * pk.shape[1]) % g:
        raise ValueError(f"tensor {prefix}.weight_packed: expected uint8 [{n}, Kq/2] with Kq a multiple of "
                         f"group_size {g}, got {pk.dtype} {list(pk.shape)}")
    kq = 2 * pk.shape[1]
    if kq < k:
        raise ValueError(f"tensor {prefix}.weight_packed covers {kq} input features, the layer has {k}")
    s = r.get(prefix + ".weight_scale", (kq // g, n), _FLOATS)
    z = None
    if r.has(prefix + ".weight_zero_point"):
        z = r.get(prefix + ".weight_zero_point", (kq // g, n), (torch.uint8,))
    elif not config.get("symmetric", False):
        raise ValueError(f"missing tensor {prefix + '.weight_zero_point'!r} (asymmetric checkpoint)")
    try:
        packed = int4_pack(unpack_nibbles(pk))
    except RuntimeError as e:
        raise ValueError(f"{prefix}: cannot pack the int4 codes: {e}") from None
    return _Stored("int4", (Int4Part(packed, s.to(dtype), z, None, g),))


def _read_part(r: WeightReader, part: WeightPart, k: int, source: str, config: dict,
               opts: Optional[QuantOptions], dtype) -> _Stored:
    """Part ``part`` (``W [rows, k]``) as stored; float weights are quantised to ``opts`` if given."""
    prefix, n = part.prefix, part.rows
    if r.has(prefix + ".qweight"):
        if source not in ("awq", "gptq"):
            raise ValueError(f"tensor {prefix}.qweight found but config.json's quantization_config is not awq/gptq")
        return _read_awq_gptq(r, prefix, source, n, k, dtype)
    if r.has(prefix + ".weight_packed"):
        if source != "fastinfer" or config.get("method") != "int4":
            raise ValueError(f"tensor {prefix}.weight_packed found but the checkpoint is not a fastinfer int4 one")
        return _read_fastinfer_int4(r, prefix, config, n, k, dtype)
    w = r.get(prefix + ".weight")
    if w.dtype == torch.float8_e4m3fn:
        if source != "fastinfer" or config.get("method") != "fp8":
            raise ValueError(f"tensor {prefix}.weight is float8 but the checkpoint is not a fastinfer fp8 one")
        check_tensor(prefix + ".weight", w, (n, k))
        return _Stored("fp8", (w, r.get(prefix + ".weight_scale", (n,), (torch.float32,))))
    check_tensor(prefix + ".weight", w, (n, k), _FLOATS)
    if opts is None:
        return _Stored("float", (w,))
    if opts.method == "fp8":
        return _Stored("fp8", quantize_fp8_weight(w))
    q, s, z = quantize_int4_weight(w, opts.group_size, opts.symmetric, opts.pad_groups, prefix + ".weight")
    return _Stored("int4", (Int4Part(int4_pack(q), s.to(dtype), z, None, opts.group_size),))


class _QuantizedMethod(LinearMethod):
    """Reads the layer's parts; falls back to a float linear when all of them are stored in float."""

    kind = "none"

    def __init__(self, source: str, opts: Optional[QuantOptions] = None, stored_config: Optional[dict] = None):
        if (source == "float") != (opts is not None):
            raise ValueError("quantising on load (source='float') needs QuantOptions, and only it takes them")
        self.source = source  # "float" (quantise on load) | "fastinfer" | "awq" | "gptq"
        self.opts = opts
        self.config = stored_config or {}

    def _read_parts(self, layer: Linear, reader: WeightReader) -> Optional[List[_Stored]]:
        if layer.tp.world_size != 1:
            raise ValueError(f"{layer.prefix}: quantised layers do not support tensor parallelism yet")
        parts = [_read_part(reader, p, layer.in_features, self.source, self.config, self.opts, layer.dtype)
                 for p in layer.parts]
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"{layer.prefix}: the projections fused into this layer are stored differently "
                             f"({', '.join(p.kind for p in parts)}); they must all be float or all quantised alike")
        kind = kinds.pop()
        if kind == "float":  # a layer the checkpoint keeps in float (e.g. AWQ modules_to_not_convert)
            layer.replace_method(UnquantizedLinearMethod())
            layer.method.load_weights(layer, reader)
            return None
        if kind != self.kind:
            raise ValueError(f"{layer.prefix}: stored as {kind}, but the checkpoint's quantization is {self.kind}")
        return parts


class Fp8LinearMethod(_QuantizedMethod):
    """W8A8: ``fp8_scaled_mm(fp8_quantize(x, 'token'), W_e4m3, s_x, s_w)`` (+ bias), out dtype = x's.
    Buffers: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32 ``[N]`` (per output channel)."""

    name = kind = "fp8"

    def load_weights(self, layer: Linear, reader: WeightReader) -> None:
        parts = self._read_parts(layer, reader)
        if parts is None:
            return
        w = torch.cat([p.data[0] for p in parts], dim=0).to(layer.device).contiguous()
        s = torch.cat([p.data[1] for p in parts], dim=0).to(layer.device).contiguous()
        layer.register_buffer("weight", w, persistent=False)
        layer.register_buffer("weight_scale", s, persistent=False)

    def apply(self, layer: Linear, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        lead = x.shape[:-1]
        xq, xs = layer.ops.fp8_quantize(x.reshape(-1, layer.in_features).contiguous(), "token")
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        out = layer.ops.fp8_scaled_mm(xq, layer.weight, xs, layer.weight_scale, x.dtype, bias)
        return out.reshape(*lead, layer.out_features)


def _same_perm(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _fuse_int4(parts: List[Int4Part]) -> List[Int4Part]:
    """One part when group sizes, input sizes and permutations agree, else the parts as they are
    (the packed layout is a row of 64 x 16 tiles per 64 input features, so packed weights
    concatenated along N are the packed weight of the concatenation)."""
    p0 = parts[0]
    if len(parts) == 1 or any(p.group_size != p0.group_size or p.k != p0.k or not _same_perm(p.perm, p0.perm)
                              for p in parts):
        return parts
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, 8, dtype=torch.uint8)
                           for p in parts], dim=1)
    return [Int4Part(torch.cat([p.packed for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                     zeros, p0.perm, p0.group_size)]


class Int4LinearMethod(_QuantizedMethod):
    """W4A16: ``int4_gemm(x, packed, scales, zeros, G, perm)`` (+ bias).

    Usually one :class:`Int4Part`; several (outputs concatenated along N) when fused projections
    have different act-order permutations. A stored input size ``Kq`` larger than the activation
    width (``pad_groups``) zero-pads the activations.
    """

    name = kind = "int4"

    def load_weights(self, layer: Linear, reader: WeightReader) -> None:
        stored = self._read_parts(layer, reader)
        if stored is None:
            return
        parts = _fuse_int4([p.data[0] for p in stored])
        kq = parts[0].k
        if any(p.k != kq for p in parts) or kq < layer.in_features:
            raise ValueError(f"{layer.prefix}: the int4 parts must share the (padded) input size >= {layer.in_features}")
        layer.kq = kq
        layer.num_parts = len(parts)
        layer.group_sizes = [int(p.group_size) for p in parts]
        for i, p in enumerate(parts):
            p = Int4Part(*(t.to(layer.device).contiguous() if isinstance(t, Tensor) else t for t in p))
            for name, t in zip(("packed", "scales", "zeros", "perm"), p[:4]):
                layer.register_buffer(f"{name}{i}", t, persistent=False)

    def part(self, layer: Linear, i: int) -> Int4Part:
        return Int4Part(getattr(layer, f"packed{i}"), getattr(layer, f"scales{i}"), getattr(layer, f"zeros{i}"),
                        getattr(layer, f"perm{i}"), layer.group_sizes[i])

    def apply(self, layer: Linear, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, layer.in_features)
        if layer.kq != layer.in_features:
            x2 = torch.nn.functional.pad(x2, (0, layer.kq - layer.in_features))
        x2 = x2.contiguous()
        outs = []
        for i in range(layer.num_parts):
            p = self.part(layer, i)
            outs.append(layer.ops.int4_gemm(x2, p.packed, p.scales, p.zeros, p.group_size, p.perm))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*lead, layer.out_features)

    def describe(self, layer: Linear) -> str:
        if not hasattr(layer, "group_sizes"):
            return "int4 (not loaded)"
        sym = all(getattr(layer, f"zeros{i}") is None for i in range(layer.num_parts))
        return f"int4-g{'/'.join(map(str, sorted(set(layer.group_sizes))))}{'-sym' if sym else ''}"


def describe_quantization(model) -> str:
    """"none", or the quantised linears' methods (int4 with group sizes, ``-sym`` when symmetric)."""
    kinds = {m.method.describe(m) for m in model.linear_layers() if isinstance(m.method, _QuantizedMethod)}
    return ",".join(sorted(kinds)) or "none"

