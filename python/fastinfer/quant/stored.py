"""How each part (checkpoint projection) of a quantised linear is stored, and this rank's slice of it.

:func:`_read_part` reads a part from wherever it is stored — quantised in fastinfer's format,
AutoAWQ, AutoGPTQ, compressed-tensors, Hugging Face fine-grained FP8, or float (then quantised on
load) — into a :class:`_Stored` (the kind and its tensors); :func:`_shard` cuts this rank's slice.

Tensor parallelism: every part is read (and, from float, quantised) whole, then this rank's slice of
the stored form is kept, so a shard holds exactly the codes and scales of the unsharded layer: fp8
per-channel scales follow their rows (a row-parallel shard keeps its rows' full-width scales); fp8
128 x 128 blocks and int4 groups must not straddle a shard boundary (int4: the group size must divide
each rank's input features, and column shards are whole 16-row tiles of the packed layout), else a
``ValueError`` names the layer, the group (or block) size and the tensor-parallel size. Act-order
int4 (a permutation of the input features) shards by output rows only; a row-parallel act-order
layer is refused. int8 weights shard like fp8 per-channel ones (a SmoothQuant ``smooth_scale``
follows the input features).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..layers import Linear, WeightPart, WeightReader, check_tensor
from ..ops import int4_pack, int4_repack
from .compressed_tensors import FP8_BLOCK, CtScheme
from .math import quantize_fp8_weight, quantize_int4_weight, quantize_int8_weight, unpack_int4_words, unpack_nibbles

Tensor = torch.Tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn,)
_INT8 = (torch.int8,)
_INTS = (torch.int32, torch.int64)
_ONE = [(1,), (), (1, 1)]  # shapes a per-tensor scale is stored with


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Int4Part(NamedTuple):
    """One int4 GEMM: ``packed int32 [Kq/64, 8 n]``, ``scales [Kq/G, n]``, ``zeros uint8 [Kq/G, n]``
    or None (symmetric), act-order ``perm int64 [Kq]`` or None, group size ``G``, and ``mins``
    float32 ``[Kq/G, n]`` or None: a float minimum per group added to each weight (GGUF: ``W = (q - z) s + min``); ``high``: a
    second symmetric int4 GEMM of the same shape and group whose weights are added (the high
    nibbles of GGUF's 5- and 8-bit types, scales ``16 a``), or None."""

    packed: Tensor
    scales: Tensor
    zeros: Optional[Tensor]
    perm: Optional[Tensor]
    group_size: int
    mins: Optional[Tensor] = None
    high: Optional["Int4Part"] = None

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


def _read_gguf_int4(r: WeightReader, prefix: str, n: int, k: int, dtype) -> Optional[_Stored]:
    """A GGUF weight of one of the types in :data:`~fastinfer.models.gguf.GGUF_INT4_TYPES` as an int4
    part, or None for a weight of another type: the codes packed by ``int4_pack``, the scales in the
    model dtype, the implied zero point 8 (symmetric), the float32 minimums per group, and for the
    types wider than 4 bits the high plane as :attr:`Int4Part.high` with scales ``16 a`` (exact in
    float32): :class:`~fastinfer.models.gguf.GgufInt4` says how each type maps."""
    g = r.int4(prefix + ".weight") if hasattr(r, "int4") else None
    if g is None:
        return None
    if g.codes.shape != (n, k):
        raise ValueError(f"tensor {prefix}.weight has shape {list(g.codes.shape)}, expected {[n, k]}")
    scales = torch.from_numpy(g.scales)
    mins = None if g.mins is None else torch.from_numpy(g.mins)
    high = None
    if g.high is not None:
        high = _int4_part(prefix, torch.from_numpy(g.high), (16 * scales).to(dtype), None, None, g.group_size)
    low = _int4_part(prefix, torch.from_numpy(g.codes), scales.to(dtype), None, None, g.group_size)
    return _Stored("int4", (low._replace(mins=mins, high=high),))


def _read_part(r: WeightReader, part: WeightPart, k: int, m, dtype) -> _Stored:
    """Part ``part`` (``W [rows, k]``) as stored; float weights are quantised to ``m.opts`` if given (``m``:
    the layer's method, which gives ``source``, ``config``, ``opts`` and ``scheme``)."""
    prefix, n = part.prefix, part.rows
    source, config, opts = m.source, m.config, m.opts
    if source == "gguf":
        stored = _read_gguf_int4(r, prefix, n, k, dtype)
        if stored is not None:
            return stored
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

    def cut(p: Int4Part) -> Int4Part:
        packed = _narrow(_narrow(p.packed, 1, rows and (8 * rows[0], 8 * rows[1])), 0, cols, 64)
        scales = _narrow(_narrow(p.scales, 1, rows), 0, cols, p.group_size)
        zeros = _narrow(_narrow(p.zeros, 1, rows), 0, cols, p.group_size)
        mins = _narrow(_narrow(p.mins, 1, rows), 0, cols, p.group_size)
        return Int4Part(packed, scales, zeros, p.perm, p.group_size, mins, p.high and cut(p.high))

    return _Stored("int4", (cut(p),))
