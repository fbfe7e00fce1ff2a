"""Quantised linear methods (:class:`~fastinfer.layers.LinearMethod`): fp8 W8A8 (per channel / per
tensor, and 128 x 128 blocks), int8 W8A8 and int4 W4A16.

A method reads every part (checkpoint projection) of its layer from wherever it is stored —
quantised in fastinfer's format, AutoAWQ, AutoGPTQ, compressed-tensors, Hugging Face fine-grained
FP8, or float (then quantised on load) — fuses the parts, and multiplies with ``fp8_scaled_mm`` /
``int4_gemm`` / ``int8_scaled_mm``. A layer whose parts a quantised checkpoint left in float becomes a float linear.

Tensor parallelism: every part is read (and, from float, quantised) whole, then this rank's slice of
the stored form is kept (:func:`_shard`), so a shard holds exactly the codes and scales of the
unsharded layer: fp8 per-channel scales follow their rows (a row-parallel shard keeps its rows'
full-width scales); fp8 128 x 128 blocks and int4 groups must not straddle a shard boundary (int4:
the group size must divide each rank's input features, and column shards are whole 16-row tiles of
the packed layout), else a ``ValueError`` names the layer, the group (or block) size and the
tensor-parallel size. Act-order int4 (a permutation of the input features) shards by output rows
only; a row-parallel act-order layer is refused. int8 weights shard like fp8 per-channel ones (a
SmoothQuant ``smooth_scale`` follows the input features), and a row-parallel int8 shard quantises
its input slice with the whole row's scale and zero point, as fp8 does.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from ..layers import Linear, LinearMethod, UnquantizedLinearMethod, WeightPart, WeightReader, check_tensor
from ..ops import int4_pack, int4_repack, int8_azp_adj
from .compressed_tensors import FP8_BLOCK, CtScheme
from .config import QuantOptions
from .math import quantize_fp8_weight, quantize_int4_weight, quantize_int8_weight, unpack_int4_words, unpack_nibbles

Tensor = torch.Tensor

__all__ = ["Fp8LinearMethod", "Fp8BlockLinearMethod", "Int4LinearMethod", "Int4Part", "Int8LinearMethod"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn,)
_INT8 = (torch.int8,)
_INTS = (torch.int32, torch.int64)
_ONE = [(1,), (), (1, 1)]  # shapes a per-tensor scale is stored with


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    kind: str  # "float" | "fp8" | "fp8-block" | "int4" | "int8"
    # float: (w,); fp8: (codes, scale float32 [n], input_scale float32 [1] or None);
    # fp8-block: (codes, scale float32 [ceil(n/128), ceil(k/128)]); int4: (Int4Part,);
    # int8: (codes int8 [n, k], scale float32 [n], input_scale float32 [1] or None, smooth_scale float32 [k] or None)
    data: tuple


def _get_scale(r: WeightReader, name: str, shapes, dtypes=_FLOATS) -> Tensor:
    """Tensor ``name`` stored with one of ``shapes`` and ``dtypes``, as float32."""
    if r.has(name):
        shape = tuple(r.shape(name))
        if shape not in [tuple(x) for x in shapes]:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}, expected "
                             f"{' or '.join(str(list(x)) for x in shapes)}")
    return r.get(name, None, dtypes).to(torch.float32)


def _int4_part(prefix: str, codes: Tensor, scales: Tensor, zeros: Optional[Tensor], perm: Optional[Tensor],
               group_size: int) -> Int4Part:
    """An :class:`Int4Part` from codes ``uint8 [n, Kq]`` in 0..15 (the kernel layout by ``int4_pack``)."""
    try:
        packed = int4_pack(codes.contiguous())
    except RuntimeError as e:
        raise ValueError(f"{prefix}: cannot pack the int4 codes: {e}") from None
    return Int4Part(packed, scales, zeros, perm, group_size)


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
    return _Stored("int4", (_int4_part(prefix, unpack_nibbles(pk), s.to(dtype), z, None, g),))


def _read_ct_int4(r: WeightReader, prefix: str, scheme: CtScheme, n: int, k: int, dtype) -> _Stored:
    """compressed-tensors ``pack-quantized`` int4 (see :mod:`fastinfer.quant`, "compressed-tensors")."""
    if scheme.kind != "int4":
        raise ValueError(f"tensor {prefix}.weight_packed found, but the module's compressed-tensors scheme is "
                         f"{scheme.description}")
    if r.has(prefix + ".weight_shape"):
        shape = r.get(prefix + ".weight_shape", (2,), _INTS)
        if shape.tolist() != [n, k]:
            raise ValueError(f"tensor {prefix}.weight_shape is {shape.tolist()}, the layer's weight is [{n}, {k}]")
    g = scheme.group_size or k  # channel-wise: one group spanning K
    if g % 32 or k % g:  # (compressed-tensors cannot write a partial last group either)
        raise ValueError(f"{prefix}: group_size {g} is not supported by the int4 kernel for K={k} (a multiple "
                         "of 32 dividing K)")
    groups = k // g
    pk = r.get(prefix + ".weight_packed", (n, _cdiv(k, 8)), (torch.int32,))
    codes = unpack_int4_words(pk)[:, :k]  # uint8 [n, k]: the stored signed value + 8
    s = _get_scale(r, prefix + ".weight_scale", [(n, groups)]).t()
    zeros = None
    if not scheme.symmetric:
        name = prefix + ".weight_zero_point"
        zshape = tuple(r.shape(name)) if r.has(name) else None
        if zshape == (_cdiv(n, 8), groups):  # packed along N (what compressed-tensors writes today)
            zeros = unpack_int4_words(r.get(name, None, (torch.int32,)).t().contiguous())[:, :n]
        elif zshape == (n, groups):  # unpacked: one signed int8 per output row and group
            zeros = (r.get(name, None, (torch.int8,)).to(torch.int16) + 8).t().to(torch.uint8)
        else:
            r.get(name, (_cdiv(n, 8), groups))  # missing or misshapen: the reader's error names it
        if int(zeros.max()) > 15:
            raise ValueError(f"tensor {name!r} holds zero points outside the int4 range")
    perm = None
    if r.has(prefix + ".weight_g_idx"):
        g_idx = r.get(prefix + ".weight_g_idx", (k,), _INTS).to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k) // g):  # act-order: groups are not runs of columns
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups or \
                    bool((torch.bincount(g_idx, minlength=groups) != g).any()):
                raise ValueError(f"tensor {prefix}.weight_g_idx: every group must hold exactly {g} input "
                                 f"features (group ids 0..{groups - 1})")
            perm = torch.argsort(g_idx, stable=True)  # int4_repack's act-order rule: sort by group, stable
            codes = codes[:, perm]
    elif scheme.actorder == "group":
        r.get(prefix + ".weight_g_idx")  # the reader's "missing tensor" error
    return _Stored("int4", (_int4_part(prefix, codes, s.to(dtype).contiguous(), zeros, perm, g),))


def _no_zero_points(r: WeightReader, prefix: str, what: str = "fp8") -> None:
    """fp8 schemes and int8 weights / static activations are symmetric: zero points, if a release
    wrote them, must be zero."""
    for name in (prefix + ".weight_zero_point", prefix + ".input_zero_point"):
        if r.has(name) and bool(torch.count_nonzero(r.get(name).float())):
            raise ValueError(f"tensor {name!r} holds non-zero zero points (asymmetric {what} is not supported)")


def _read_ct_fp8(r: WeightReader, prefix: str, scheme: CtScheme, n: int, k: int) -> _Stored:
    """compressed-tensors ``float-quantized`` fp8 (see :mod:`fastinfer.quant`, "compressed-tensors")."""
    if scheme.kind not in ("fp8", "fp8-block"):
        raise ValueError(f"tensor {prefix}.weight is float8, but the module's compressed-tensors scheme is "
                         f"{scheme.description}")
    w = r.get(prefix + ".weight", (n, k), _FP8)
    name = prefix + ".weight_scale"
    _no_zero_points(r, prefix)
    if scheme.weight_strategy == "block":
        return _Stored("fp8-block", (w, _get_scale(r, name, [(_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))])))
    if scheme.weight_strategy == "channel":
        s = _get_scale(r, name, [(n, 1), (n,)]).reshape(n)
    else:  # one scale for the projection: the same for each of its output channels
        s = _get_scale(r, name, _ONE).reshape(1).expand(n)
    xs = _get_scale(r, prefix + ".input_scale", _ONE).reshape(1) if scheme.activation == "static" else None
    return _Stored("fp8", (w, s.contiguous(), xs))


def _read_ct_int8(r: WeightReader, prefix: str, scheme: CtScheme, n: int, k: int) -> _Stored:
    """compressed-tensors ``int-quantized`` W8A8 (see :mod:`fastinfer.quant`, "compressed-tensors")."""
    if scheme.kind != "int8":
        raise ValueError(f"tensor {prefix}.weight is int8, but the module's compressed-tensors scheme is "
                         f"{scheme.description}")
    w = r.get(prefix + ".weight", (n, k), _INT8)
    _no_zero_points(r, prefix, "int8 weights / static activations")
    name = prefix + ".weight_scale"
    if scheme.weight_strategy == "channel":
        s = _get_scale(r, name, [(n, 1), (n,)]).reshape(n)
    else:
        s = _get_scale(r, name, _ONE).reshape(1).expand(n)
    xs = _get_scale(r, prefix + ".input_scale", _ONE).reshape(1) if scheme.activation == "static" else None
    return _Stored("int8", (w, s.contiguous(), xs, None))


def _read_fastinfer_int8(r: WeightReader, prefix: str, n: int, k: int) -> _Stored:
    w = r.get(prefix + ".weight", (n, k), _INT8)
    s = r.get(prefix + ".weight_scale", (n,), (torch.float32,))
    smooth = r.get(prefix + ".smooth_scale", (k,), (torch.float32,)) if r.has(prefix + ".smooth_scale") else None
    return _Stored("int8", (w, s, None, smooth))


def _read_hf_fp8(r: WeightReader, prefix: str, n: int, k: int) -> _Stored:
    """Hugging Face fine-grained fp8: ``weight`` e4m3 and ``weight_scale_inv`` per 128 x 128 block
    (despite its name the dequantisation multiplier: ``W = weight * weight_scale_inv``)."""
    w = r.get(prefix + ".weight", (n, k), _FP8)
    s = _get_scale(r, prefix + ".weight_scale_inv", [(_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))])
    return _Stored("fp8-block", (w, s))


def _read_part(r: WeightReader, part: WeightPart, k: int, m: "_QuantizedMethod", dtype) -> _Stored:
    """Part ``part`` (``W [rows, k]``) as stored; float weights are quantised to ``m.opts`` if given."""
    prefix, n = part.prefix, part.rows
    source, config, opts = m.source, m.config, m.opts
    if r.has(prefix + ".qweight"):
        if source not in ("awq", "gptq"):
            raise ValueError(f"tensor {prefix}.qweight found but config.json's quantization_config is not awq/gptq")
        return _read_awq_gptq(r, prefix, source, n, k, dtype)
    if r.has(prefix + ".weight_packed"):
        if source == "compressed-tensors":
            return _read_ct_int4(r, prefix, m.scheme, n, k, dtype)
        if source != "fastinfer" or config.get("method") != "int4":
            raise ValueError(f"tensor {prefix}.weight_packed found but the checkpoint is not a fastinfer int4 "
                             "or compressed-tensors one")
        return _read_fastinfer_int4(r, prefix, config, n, k, dtype)
    w = r.get(prefix + ".weight")
    if w.dtype == torch.int8:
        if source == "compressed-tensors":
            return _read_ct_int8(r, prefix, m.scheme, n, k)
        if source != "fastinfer" or config.get("method") != "int8":
            raise ValueError(f"tensor {prefix}.weight is int8 but config.json's quantization_config is not a "
                             "fastinfer int8 or compressed-tensors W8A8 one")
        return _read_fastinfer_int8(r, prefix, n, k)
    if w.dtype == torch.float8_e4m3fn:
        if source == "compressed-tensors":
            return _read_ct_fp8(r, prefix, m.scheme, n, k)
        if source == "fp8":
            return _read_hf_fp8(r, prefix, n, k)
        if source != "fastinfer" or config.get("method") != "fp8":
            raise ValueError(f"tensor {prefix}.weight is float8 but config.json's quantization_config is not a "
                             "fastinfer fp8, compressed-tensors or fine-grained fp8 one")
        check_tensor(prefix + ".weight", w, (n, k))
        return _Stored("fp8", (w, r.get(prefix + ".weight_scale", (n,), (torch.float32,)), None))
    check_tensor(prefix + ".weight", w, (n, k), _FLOATS)
    if opts is None:
        return _Stored("float", (w,))
    if opts.method == "fp8":
        return _Stored("fp8", (*quantize_fp8_weight(w), None))
    if opts.method == "int8":
        return _Stored("int8", (*quantize_int8_weight(w), None, None))
    q, s, z = quantize_int4_weight(w, opts.group_size, opts.symmetric, opts.pad_groups, prefix + ".weight")
    return _Stored("int4", (Int4Part(int4_pack(q), s.to(dtype), z, None, opts.group_size),))


def _narrow(t: Optional[Tensor], dim: int, span, unit: int = 1) -> Optional[Tensor]:
    """``t`` cut to ``span`` (in units of ``unit`` elements along ``dim``); None stays None."""
    if t is None or span is None:
        return t
    return t.narrow(dim, span[0] // unit, span[1] // unit).contiguous()


def _shard(layer: Linear, i: int, stored: _Stored) -> _Stored:
    """This rank's slice of part ``i`` as stored: rows ``layer.row_shard(i)``, input features
    ``layer.col_shard()`` (see the module docstring for what must divide what)."""
    rows, cols = layer.row_shard(i), layer.col_shard()
    prefix, ws = layer.parts[i].prefix, layer.tp.world_size
    if stored.kind == "fp8":
        w, s, xs = stored.data
        return _Stored("fp8", (_narrow(_narrow(w, 0, rows), 1, cols), _narrow(s, 0, rows), xs))
    if stored.kind == "fp8-block":
        w, s = stored.data
        for span, full, what in ((rows, w.shape[0], "output rows"), (cols, w.shape[1], "input features")):
            if span is not None and (span[0] % FP8_BLOCK or (span[1] % FP8_BLOCK and sum(span) != full)):
                raise ValueError(f"{prefix}: its {full} {what} split over tensor_parallel_size={ws} into "
                                 f"{span[1]} per rank, which cuts its {FP8_BLOCK} x {FP8_BLOCK} fp8 blocks")
        cut = (lambda t, d, sp: t if sp is None else t.narrow(d, sp[0] // FP8_BLOCK, _cdiv(sp[1], FP8_BLOCK)))
        return _Stored("fp8-block", (_narrow(_narrow(w, 0, rows), 1, cols),
                                     cut(cut(s, 0, rows), 1, cols).contiguous()))
    if stored.kind == "int8":
        w, s, xs, smooth = stored.data
        return _Stored("int8", (_narrow(_narrow(w, 0, rows), 1, cols), _narrow(s, 0, rows), xs,
                                _narrow(smooth, 0, cols)))
    p: Int4Part = stored.data[0]
    if rows is not None and (rows[0] % 16 or rows[1] % 16):
        raise ValueError(f"{prefix}: {rows[1]} output rows per rank (tensor_parallel_size={ws}) are not whole "
                         "16-row tiles of the int4 layout")
    if cols is not None:
        g = p.group_size
        if p.perm is not None:
            raise ValueError(f"{prefix}: act-order int4 weights (g_idx) cannot be split along the input features "
                             f"(row-parallel, tensor_parallel_size={ws}); use a checkpoint without act-order "
                             "(desc_act=False) or tensor_parallel_size=1")
        if cols[1] % g or p.k != layer.full_in_features:
            raise ValueError(f"{prefix}: int4 group size {g} does not divide the {cols[1]} input features each "
                             f"rank holds (K={layer.full_in_features}, tensor_parallel_size={ws}); use a group "
                             f"size that divides {cols[1]}")
        if cols[1] % 64:
            raise ValueError(f"{prefix}: {cols[1]} input features per rank (tensor_parallel_size={ws}) are not a "
                             "multiple of 64, the int4 layout's tile")
    packed = _narrow(_narrow(p.packed, 1, rows and (8 * rows[0], 8 * rows[1])), 0, cols, 64)
    scales = _narrow(_narrow(p.scales, 1, rows), 0, cols, p.group_size)
    zeros = _narrow(_narrow(p.zeros, 1, rows), 0, cols, p.group_size)
    return _Stored("int4", (Int4Part(packed, scales, zeros, p.perm, p.group_size),))


class _QuantizedMethod(LinearMethod):
    """Reads the layer's parts; falls back to a float linear when all of them are stored in float."""

    kind = "none"

    def __init__(self, source: str, opts: Optional[QuantOptions] = None, stored_config: Optional[dict] = None,
                 scheme: Optional[CtScheme] = None):
        if (source == "float") != (opts is not None):
            raise ValueError("quantising on load (source='float') needs QuantOptions, and only it takes them")
        if (source == "compressed-tensors") != (scheme is not None):
            raise ValueError("a compressed-tensors layer needs its scheme, and only it takes one")
        # "float" (quantise on load) | "fastinfer" | "awq" | "gptq" | "compressed-tensors" | "fp8" (fine-grained)
        self.source = source
        self.opts = opts
        self.config = stored_config or {}
        self.scheme = scheme

    def _read_parts(self, layer: Linear, reader: WeightReader) -> Optional[List[_Stored]]:
        parts = [_read_part(reader, p, layer.full_in_features, self, layer.dtype) for p in layer.parts]
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
        return [_shard(layer, i, p) for i, p in enumerate(parts)] if layer.is_sharded else parts


def _register_per_channel(layer: Linear, parts: List[_Stored], static_input_scale: bool) -> None:
    """The buffers of a per-output-channel W8A8 layer (fp8 or int8): ``weight [N, K]`` and
    ``weight_scale [N]`` of the fused parts, and with static activations ``input_scale [1]``, the
    largest of the parts' (vLLM's rule: the fused projections see the same input)."""
    w = torch.cat([p.data[0] for p in parts], dim=0).to(layer.device).contiguous()
    s = torch.cat([p.data[1] for p in parts], dim=0).to(layer.device).contiguous()
    layer.register_buffer("weight", w, persistent=False)
    layer.register_buffer("weight_scale", s, persistent=False)
    if static_input_scale:
        xs = torch.stack([p.data[2].reshape(()) for p in parts]).amax().reshape(1)
        layer.register_buffer("input_scale", xs.to(layer.device).contiguous(), persistent=False)


class Fp8LinearMethod(_QuantizedMethod):
    """W8A8: ``fp8_scaled_mm(x_e4m3, W_e4m3, s_x, s_w)`` (+ bias), out dtype = x's.

    Buffers: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32 ``[N]`` (per output
    channel; a checkpoint's per-tensor scale is repeated over its projection's rows, which is the same
    product), and for static activations ``input_scale`` float32 ``[1]``. The activations
    (``activation``, from a compressed-tensors scheme; "token" otherwise) are quantised by
    ``fp8_quantize`` dynamically per token (``s_x [M]``), dynamically per tensor, or with the
    checkpoint's static ``input_scale``: the largest of the fused projections' (vLLM's rule; the
    projections see the same input, so a calibrated checkpoint stores equal ones). A row-parallel
    shard quantises its input slice with the whole row's dynamic scale (one small all-reduce of
    the amax), so tensor parallelism does not change the numbers.
    """

    name = kind = "fp8"

    @property
    def activation(self) -> str:
        return self.scheme.activation if self.scheme is not None else "token"

    def load_weights(self, layer: Linear, reader: WeightReader) -> None:
        parts = self._read_parts(layer, reader)
        if parts is not None:
            _register_per_channel(layer, parts, static_input_scale=self.activation == "static")

    def apply(self, layer: Linear, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, layer.in_features).contiguous()
        if self.activation == "static":
            xq, xs = layer.ops.fp8_quantize(x2, "tensor", scale=layer.input_scale)
        elif layer.col_shard() is not None:
            xq, xs = _quantize_over_ranks(layer, x2, self.activation)
        else:
            xq, xs = layer.ops.fp8_quantize(x2, self.activation)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        out = layer.ops.fp8_scaled_mm(xq, layer.weight, xs, layer.weight_scale, x.dtype, bias)
        return out.reshape(*lead, layer.out_features)

    def describe(self, layer: Linear) -> str:
        return "fp8" if self.activation == "token" else f"fp8-{self.activation}"


def _quantize_over_ranks(layer: Linear, x: Tensor, mode: str) -> Tuple[Tensor, Tensor]:
    """Dynamic e4m3 quantisation of a row-parallel layer's input slice with the scales of the WHOLE
    row (token) or tensor: the amax is all-reduced (max) over the ranks first, so every rank
    quantises exactly as one rank would. The arithmetic is ``fp8_quantize``'s (fp32 amax, scale =
    max(amax, 1e-12) / 448, IEEE division, clamp, round-to-nearest-even cast)."""
    xf = x.float()
    amax = xf.abs().amax(1) if mode == "token" else xf.abs().amax().reshape(1)
    layer.tp.comm.all_reduce(amax, op="max")
    s = amax.clamp_min(1e-12) / 448.0
    q = (xf / (s[:, None] if mode == "token" else s)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, s


class Fp8BlockLinearMethod(_QuantizedMethod):
    """W8A8 in DeepSeek-V3 blocks: ``weight`` e4m3 ``[N, K]`` with float32 scales per 128 x 128 block
    (``[ceil(N/128), ceil(K/128)]``), activations quantised per 1 x 128 group at run time
    (``fp8_quantize(x, 'group', 128)``: ``[M, ceil(K/128)]``), multiplied by the blockwise path of
    ``fp8_scaled_mm``.

    Fused projections share a scale row only when a block row covers one projection: parts are
    concatenated along N while each one but the last of a run has a multiple of 128 rows; a run ends
    after a part that does not (e.g. a 64-row k_proj), so such a layer runs one GEMM per run on the
    same quantised activations. K not a multiple of 128: the activations are zero-padded to one for
    the group quantisation (zeros change no group's amax) and the codes cut back to K.
    """

    name = kind = "fp8-block"

    def load_weights(self, layer: Linear, reader: WeightReader) -> None:
        parts = self._read_parts(layer, reader)
        if parts is None:
            return
        runs, cur = [], []
        for p in parts:
            cur.append(p)
            if p.data[0].shape[0] % FP8_BLOCK:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        layer.num_parts = len(runs)
        for i, run in enumerate(runs):
            w = torch.cat([p.data[0] for p in run], dim=0).to(layer.device).contiguous()
            s = torch.cat([p.data[1] for p in run], dim=0).to(layer.device).contiguous()
            layer.register_buffer(f"weight{i}", w, persistent=False)
            layer.register_buffer(f"weight_scale{i}", s, persistent=False)

    def apply(self, layer: Linear, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        lead = x.shape[:-1]
        k = layer.in_features
        x2 = x.reshape(-1, k)
        kp = _cdiv(k, FP8_BLOCK) * FP8_BLOCK
        if kp != k:
            x2 = torch.nn.functional.pad(x2, (0, kp - k))
        xq, xs = layer.ops.fp8_quantize(x2.contiguous(), "group", FP8_BLOCK)
        if kp != k:
            xq = xq[:, :k].contiguous()
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        one = layer.num_parts == 1
        outs = [layer.ops.fp8_scaled_mm(xq, getattr(layer, f"weight{i}"), xs, getattr(layer, f"weight_scale{i}"),
                                        x.dtype, bias if one else None) for i in range(layer.num_parts)]
        out = outs[0] if one else torch.cat(outs, dim=1)
        if bias is not None and not one:
            out = out + bias
        return out.reshape(*lead, layer.out_features)

    def describe(self, layer: Linear) -> str:
        return "fp8-block128"


class Int8LinearMethod(_QuantizedMethod):
    """W8A8 int8: ``int8_scaled_mm(x_int8, W_int8, s_x, s_w)`` (+ bias), out dtype = x's.

    Buffers: ``weight`` int8 ``[N, K]`` (symmetric), ``weight_scale`` float32 ``[N]`` (per output
    channel; a per-tensor scale is repeated over its projection's rows); activations quantised by
    ``int8_quantize`` dynamically per token, symmetric, or asymmetric (a compressed-tensors scheme with
    ``symmetric: false`` input activations: zero points ``azp [M]`` and ``azp_adj = W.sum(1)``
    int32 ``[N]``, a buffer), or with a static ``input_scale`` ``[1]`` (the largest of the fused
    projections'). A SmoothQuant factor that could not be folded into a preceding weight
    (``smooth_scale [K]``, fastinfer format: o_proj) divides the activations first (a buffer
    ``smooth_inv = 1 / smooth_scale`` in the activation dtype).
    """

    name = kind = "int8"

    @property
    def activation(self) -> str:
        if self.scheme is None:
            return "token"
        return self.scheme.activation if self.scheme.activation_symmetric else "token-asym"

    def load_weights(self, layer: Linear, reader: WeightReader) -> None:
        parts = self._read_parts(layer, reader)
        if parts is None:
            return
        _register_per_channel(layer, parts, static_input_scale=self.activation == "static")
        if self.activation == "token-asym":
            layer.register_buffer("azp_adj", int8_azp_adj(layer.weight).contiguous(), persistent=False)
        smooth = [p.data[3] for p in parts]
        if any(x is not None for x in smooth):
            if any(x is None or not torch.equal(x, smooth[0]) for x in smooth):
                raise ValueError(f"{layer.prefix}: the projections fused into this layer have different "
                                 "smooth_scale tensors (they share one input)")
            inv = (1.0 / smooth[0].to(torch.float64)).to(layer.dtype)
            layer.register_buffer("smooth_inv", inv.to(layer.device).contiguous(), persistent=False)
        else:
            layer.smooth_inv = None

    def apply(self, layer: Linear, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, layer.in_features)
        if layer.smooth_inv is not None:
            x2 = x2 * layer.smooth_inv
        x2 = x2.contiguous()
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        act = self.activation
        over_ranks = act != "static" and layer.col_shard() is not None
        if act == "token-asym":
            xq, xs, azp = (_int8_quantize_over_ranks(layer, x2, symmetric=False) if over_ranks else
                           layer.ops.int8_quantize(x2, "token", symmetric=False))
            out = layer.ops.int8_scaled_mm(xq, layer.weight, xs, layer.weight_scale, x.dtype, bias, layer.azp_adj, azp)
        else:
            if act == "static":
                xq, xs = layer.ops.int8_quantize(x2, "tensor", scale=layer.input_scale)
            elif over_ranks:
                xq, xs = _int8_quantize_over_ranks(layer, x2, symmetric=True)
            else:
                xq, xs = layer.ops.int8_quantize(x2, "token")
            out = layer.ops.int8_scaled_mm(xq, layer.weight, xs, layer.weight_scale, x.dtype, bias)
        return out.reshape(*lead, layer.out_features)

    def describe(self, layer: Linear) -> str:
        sq = self.config.get("smoothquant") if self.source == "fastinfer" else None
        smooth = f"-smoothquant{sq['alpha']:g}" if sq else ""
        return ("int8" if self.activation == "token" else f"int8-{self.activation}") + smooth


def _int8_quantize_over_ranks(layer: Linear, x: Tensor, symmetric: bool):
    """Dynamic per-token int8 quantisation of a row-parallel layer's input slice with the WHOLE
    row's scale (and zero point): the row's extremes are all-reduced (max) over the ranks first, so
    every rank quantises exactly as one rank would. The arithmetic is ``int8_quantize``'s
    (gemm/int8.h: fp32, IEEE division, round half to even)."""
    xf = x.float()
    if symmetric:
        amax = xf.abs().amax(1)
        layer.tp.comm.all_reduce(amax, op="max")
        s = amax.clamp_min(1e-12) / 127.0
        return (xf / s[:, None]).clamp_(-127.0, 127.0).round_().to(torch.int8), s
    ext = torch.stack([(-xf.amin(1)).clamp_min(0.0), xf.amax(1).clamp_min(0.0)])  # lo, hi: the range holds 0
    layer.tp.comm.all_reduce(ext, op="max")
    s = (ext[1] + ext[0]).clamp_min(1e-12) / 255.0
    azp = ((ext[0] / s).round() - 128.0).clamp_(-128.0, 127.0)
    q = ((xf / s[:, None]).round_() + azp[:, None]).clamp_(-128.0, 127.0).to(torch.int8)
    return q, s, azp.to(torch.int32)


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

