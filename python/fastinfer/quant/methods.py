"""Quantised linear methods (:class:`~fastinfer.layers.LinearMethod`): fp8 W8A8 (per channel / per
tensor, and 128 x 128 blocks), int8 W8A8 and int4 W4A16.

A method reads every part of its layer (``stored.py``: each checkpoint format, quantising float
weights on load, and this rank's tensor-parallel slice), fuses the parts, and multiplies with
``fp8_scaled_mm`` / ``int4_gemm`` / ``int8_scaled_mm``. A layer whose parts a quantised checkpoint
left in float becomes a float linear. A row-parallel fp8 or int8 shard quantises its input slice
with the whole row's scale (and zero point), so every rank multiplies the codes the unsharded layer
would.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..layers import (
    FusedMoE,
    FusedMoEMethod,
    Linear,
    LinearMethod,
    QuantizedInput,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
    WeightReader,
)
from ..ops import fp4_repack, int8_azp_adj
from .compressed_tensors import FP8_BLOCK, CtScheme
from .config import QuantOptions
from .math import dequantize_nvfp4, quantize_mxfp4_weight, quantize_nvfp4_weight
from .stored import Int4Part, _cdiv, _read_part, _shard, _Stored

Tensor = torch.Tensor

__all__ = ["Fp8LinearMethod", "Fp8BlockLinearMethod", "Int4LinearMethod", "Int4Part", "Int8LinearMethod",
           "Nvfp4DequantizedLinearMethod", "Fp4LinearMethod",
           "Fp8FusedMoEMethod", "Int4FusedMoEMethod", "Fp4FusedMoEMethod", "Nvfp4DequantizedFusedMoEMethod",
           "fp4_experts_fit"]


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

    def input_quantization(self, layer: Linear) -> Optional[Tuple[torch.dtype, Optional[Tensor]]]:
        if self.activation == "static":
            return torch.float8_e4m3fn, layer.input_scale
        if self.activation == "token" and layer.col_shard() is None:
            return torch.float8_e4m3fn, None
        return None

    def apply(self, layer: Linear, x, bias: Optional[Tensor]) -> Tensor:
        if isinstance(x, QuantizedInput):  # quantised by the norm before (input_quantization)
            lead, dtype = x.codes.shape[:-1], x.dtype
            xq, xs = x.codes.reshape(-1, layer.in_features), x.scale
        else:
            lead, dtype = x.shape[:-1], x.dtype
            x2 = x.reshape(-1, layer.in_features).contiguous()
            if self.activation == "static":
                xq, xs = layer.ops.fp8_quantize(x2, "tensor", scale=layer.input_scale)
            elif layer.col_shard() is not None:
                xq, xs = _quantize_over_ranks(layer, x2, self.activation)
            else:
                xq, xs = layer.ops.fp8_quantize(x2, self.activation)
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        out = layer.ops.fp8_scaled_mm(xq, layer.weight, xs, layer.weight_scale, dtype, bias)
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

    def input_quantization(self, layer: Linear) -> Optional[Tuple[torch.dtype, Optional[Tensor]]]:
        if layer.smooth_inv is not None:
            return None
        if self.activation == "static":
            return torch.int8, layer.input_scale
        if self.activation == "token" and layer.col_shard() is None:
            return torch.int8, None
        return None

    def apply(self, layer: Linear, x, bias: Optional[Tensor]) -> Tensor:
        if isinstance(x, QuantizedInput):  # quantised by the norm before (input_quantization)
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)
            out = layer.ops.int8_scaled_mm(x.codes.reshape(-1, layer.in_features), layer.weight, x.scale,
                                           layer.weight_scale, x.dtype, bias)
            return out.reshape(*x.codes.shape[:-1], layer.out_features)
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
                              or (p.high is None) != (p0.high is None) for p in parts):
        return parts
    zeros = mins = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, 8, dtype=torch.uint8)
                           for p in parts], dim=1)
    if any(p.mins is not None for p in parts):
        mins = torch.cat([p.mins if p.mins is not None else torch.zeros(p.scales.shape) for p in parts], dim=1)
    high = None if p0.high is None else _fuse_int4([p.high for p in parts])[0]
    return [Int4Part(torch.cat([p.packed for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                     zeros, p0.perm, p0.group_size, mins, high)]


class Int4LinearMethod(_QuantizedMethod):
    """W4A16: ``int4_gemm(x, packed, scales, zeros, G, perm)`` (+ bias); a GGUF weight's float
    minimums (``W = (q - 8) s + min`` per 32 weights) add the activations' group sums times them (a
    float32 GEMM of ``[M, K / 32]`` by ``[K / 32, N]``, buffer ``mins{i}``); a GGUF Q5_0 / Q5_1 / Q5_K /
    Q8_0 weight is two int4 GEMMs summed in float32 (the high nibbles' plane: buffers
    ``high_packed{i}``, ``high_scales{i}``) plus its minimum term.

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
            # GGUF minimums [Kq / G, n]: their term is a GEMM of the activations' group sums by them
            layer.register_buffer(f"mins{i}", None if p.mins is None else p.mins.float(), persistent=False)
            high = p.high  # GGUF Q8_0's second plane
            for name in ("packed", "scales"):
                t = None if high is None else getattr(high, name).to(layer.device).contiguous()
                layer.register_buffer(f"high_{name}{i}", t, persistent=False)

    def part(self, layer: Linear, i: int) -> Int4Part:
        high_packed = getattr(layer, f"high_packed{i}", None)
        high = None if high_packed is None else Int4Part(high_packed, getattr(layer, f"high_scales{i}"), None,
                                                         getattr(layer, f"perm{i}"), layer.group_sizes[i])
        return Int4Part(getattr(layer, f"packed{i}"), getattr(layer, f"scales{i}"), getattr(layer, f"zeros{i}"),
                        getattr(layer, f"perm{i}"), layer.group_sizes[i], getattr(layer, f"mins{i}", None), high)

    def apply(self, layer: Linear, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, layer.in_features)
        if layer.kq != layer.in_features:
            x2 = torch.nn.functional.pad(x2, (0, layer.kq - layer.in_features))
        x2 = x2.contiguous()
        outs = []
        for i in range(layer.num_parts):
            p = self.part(layer, i)
            y = layer.ops.int4_gemm(x2, p.packed, p.scales, p.zeros, p.group_size, p.perm)
            if p.high is not None:  # Q8_0: + the high nibbles' GEMM, summed in float32
                h = p.high
                y = y.float() + layer.ops.int4_gemm(x2, h.packed, h.scales, None, h.group_size, h.perm).float()
            if p.mins is not None:  # + sum over groups g of (sum of x over g) * min[g, n], in float32
                sums = x2.view(x2.shape[0], -1, p.group_size).sum(-1, dtype=torch.float32)
                if layer.ops.deterministic:  # dense_mm: a row's bits do not depend on M
                    y = y.float() + layer.ops.linear(sums, p.mins.t())
                else:
                    y = torch.addmm(y.float(), sums, p.mins)
            y = y.to(x2.dtype)
            outs.append(y)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*lead, layer.out_features)

    def describe(self, layer: Linear) -> str:
        if not hasattr(layer, "group_sizes"):
            return "int4 (not loaded)"
        sym = all(getattr(layer, f"zeros{i}") is None for i in range(layer.num_parts))
        return f"int4-g{'/'.join(map(str, sorted(set(layer.group_sizes))))}{'-sym' if sym else ''}"


class Nvfp4DequantizedLinearMethod(UnquantizedLinearMethod):
    """A compressed-tensors NVFP4 W4A16 weight (``weight_packed`` uint8 ``[N, K / 2]``,
    ``weight_scale`` e4m3 ``[N, K / 16]``, ``weight_global_scale`` float32 ``[1]``) dequantised at
    load (:func:`~fastinfer.quant.math.dequantize_nvfp4`, float32 as compressed-tensors computes it,
    then the model dtype) into a float linear: the memory and speed of a float model until an FP4
    kernel runs them."""

    name = "nvfp4-dequantised"

    def __init__(self, source: str = "compressed-tensors", stored_config=None, scheme=None):
        self.source, self.scheme = source, scheme

    def load_weights(self, layer: Linear, reader: WeightReader) -> None:
        with torch.no_grad():
            off = 0
            for i, (part, rows) in enumerate(zip(layer.parts, layer.part_rows)):
                n, k = layer.full_shape(part)
                span = layer.row_shard(i)
                packed = reader.get(part.prefix + ".weight_packed", (n, k // 2), (torch.uint8,), rows=span)
                scale = reader.get(part.prefix + ".weight_scale", (n, k // 16), (torch.float8_e4m3fn,), rows=span)
                gs = reader.get(part.prefix + ".weight_global_scale", (1,), (torch.float32,))
                w = dequantize_nvfp4(packed, scale, gs)
                cols = layer.col_shard()
                if cols is not None:
                    w = w.narrow(1, *cols)
                layer.weight.narrow(0, off, rows).copy_(w.to(device=layer.device, dtype=layer.dtype))
                off += rows


def fp4_tiles_fit(layer: Linear) -> bool:
    """Whether every part of ``layer`` on this rank is whole 64 x 16 tiles of the fp4_gemm layout
    (input features a multiple of 64, each part's rows a multiple of 16)."""
    return layer.in_features % 64 == 0 and all(rows % 16 == 0 for rows in layer.part_rows)


class Fp4LinearMethod(LinearMethod):
    """W4A16 with FP4 weights: one ``fp4_gemm(x, packed, scales, global_scale, fmt)`` per part (an
    NVFP4 projection has its own global scale), the outputs concatenated (+ bias).

    Sources: ``"compressed-tensors"`` NVFP4A16 (``weight_packed`` uint8 ``[N, K / 2]``,
    ``weight_scale`` e4m3 ``[N, K / 16]``, ``weight_global_scale`` float32 ``[1]``), or ``"float"``
    (``quantization="nvfp4" | "mxfp4"``: each whole weight quantised on load by
    :func:`~fastinfer.quant.math.quantize_nvfp4_weight` / :func:`~fastinfer.quant.math.quantize_mxfp4_weight`).
    This rank keeps its rows (column parallel) or input features (row parallel: whole groups, since
    a shard is a multiple of 64) of the stored form and converts them with ``fp4_repack`` (buffers
    ``packed{i}``, ``scales{i}``, ``global_scale{i}``). A layer whose shard is not whole 64 x 16
    tiles (:func:`fp4_tiles_fit`) loads dequantised from a compressed-tensors checkpoint
    (:class:`Nvfp4DequantizedLinearMethod`) and is refused when quantising on load.
    """

    def __init__(self, source: str = "compressed-tensors", stored_config=None, scheme=None, fmt: str = "nvfp4",
                 opts: Optional[QuantOptions] = None):
        if source not in ("compressed-tensors", "float") or fmt not in ("nvfp4", "mxfp4"):
            raise ValueError(f"fp4 linears read compressed-tensors NVFP4 or quantise float weights to nvfp4 / mxfp4, "
                             f"got source {source!r}, format {fmt!r}")
        if source == "compressed-tensors" and fmt != "nvfp4":
            raise ValueError("compressed-tensors fp4 weights are NVFP4")
        self.source, self.scheme, self.fmt, self.opts = source, scheme, fmt, opts
        self.name = fmt

    def _read(self, layer: Linear, reader: WeightReader, i: int) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """This rank's (checkpoint bytes [n, k / 2], scale bits [n, k / G], global scale or None)."""
        part = layer.parts[i]
        n, k = layer.full_shape(part)
        span = layer.row_shard(i)
        if self.source == "compressed-tensors":
            packed = reader.get(part.prefix + ".weight_packed", (n, k // 2), (torch.uint8,), rows=span)
            scale = reader.get(part.prefix + ".weight_scale", (n, k // 16), (torch.float8_e4m3fn,), rows=span)
            gs = reader.get(part.prefix + ".weight_global_scale", (1,), (torch.float32,))
        else:  # the whole weight (an NVFP4 global scale is the whole tensor's), then this rank's rows
            w = reader.get_float(part.prefix + ".weight", (n, k))
            if self.fmt == "nvfp4":
                packed, scale, gs = quantize_nvfp4_weight(w)
            else:
                (packed, scale), gs = quantize_mxfp4_weight(w), None
            if span is not None:
                packed, scale = packed.narrow(0, *span), scale.narrow(0, *span)
        cols = layer.col_shard()
        if cols is not None:
            group = 16 if self.fmt == "nvfp4" else 32
            packed = packed.narrow(1, cols[0] // 2, cols[1] // 2)
            scale = scale.narrow(1, cols[0] // group, cols[1] // group)
        return packed.contiguous(), scale.contiguous(), gs

    def load_weights(self, layer: Linear, reader: WeightReader) -> None:
        if not fp4_tiles_fit(layer):
            if self.source == "float":
                raise ValueError(f"{layer.prefix}: quantization={self.fmt!r} needs whole 64 x 16 tiles of fp4_gemm "
                                 f"on each rank (input features {layer.in_features} a multiple of 64, each "
                                 f"projection's rows {layer.part_rows} a multiple of 16)")
            layer.replace_method(Nvfp4DequantizedLinearMethod(self.source, scheme=self.scheme))
            layer.method.load_weights(layer, reader)
            return
        for i in range(len(layer.parts)):
            packed, scale, gs = self._read(layer, reader, i)
            w = fp4_repack(packed, scale)
            layer.register_buffer(f"packed{i}", w.packed.to(layer.device), persistent=False)
            layer.register_buffer(f"scales{i}", w.scales.to(layer.device), persistent=False)
            layer.register_buffer(f"global_scale{i}", None if gs is None else
                                  gs.reshape(1).to(layer.device, torch.float32).contiguous(), persistent=False)

    def apply(self, layer: Linear, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, layer.in_features).contiguous()
        outs = [layer.ops.fp4_gemm(x2, getattr(layer, f"packed{i}"), getattr(layer, f"scales{i}"),
                                   getattr(layer, f"global_scale{i}"), self.fmt) for i in range(len(layer.parts))]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*lead, layer.out_features)


class Fp8FusedMoEMethod(FusedMoEMethod):
    """FP8 experts, run by ``fused_moe_fp8`` (activations quantised dynamically inside the op: per
    token, or per token and 128-group with blockwise scales).

    Buffers (this rank's experts, each its intermediate slice): ``w13`` float8_e4m3fn ``[E, 2I, H]``
    (gate rows, then up rows) and ``w2`` ``[E, H, I]``, with float32 scales either per output
    channel, ``w13_scale [E, 2I]`` and ``w2_scale [E, H]`` (a checkpoint's per-tensor scale repeated
    over its projection's rows: the same product), or per 128 x 128 block (``blockwise``),
    ``w13_scale [E, 2I / 128, H / 128]`` and ``w2_scale [E, H / 128, I / 128]``. Each expert
    projection is read as a quantised linear's part is (every format of ``stored.py``, float weights
    quantised per channel on load), whole, then cut: gate and up rows
    with their scale rows (blocks), down columns (per-channel scales whole; blocks cut along with
    them). Experts a checkpoint stores in float load as float experts.

    The op needs H and each rank's I to be multiples of 16 (per channel) or 128 (blockwise, so that
    no block straddles the gate / up boundary or a tensor-parallel cut); other sizes are refused
    when the layer is built. Under tensor parallelism each rank quantises its own slice of the
    activation between the two GEMMs: with blockwise scales a 128-group never spans ranks (the same
    codes as one rank); per channel the row's scale is the slice's amax, not the whole row's
    (different, never coarser, rounding: tensor parallelism changes the numbers by that much).
    """

    tensor_names = ("w13", "w2", "w13_scale", "w2_scale")

    def __init__(self, source: str, blockwise: bool, opts: Optional[QuantOptions] = None,
                 stored_config: Optional[dict] = None, scheme: Optional[CtScheme] = None):
        if (source == "float") != (opts is not None):
            raise ValueError("quantising on load (source='float') needs QuantOptions, and only it takes them")
        # what _read_part reads a projection with (as a quantised linear method carries it)
        self.source, self.opts, self.config, self.scheme = source, opts, stored_config or {}, scheme
        self.blockwise = bool(blockwise)
        self.kind = "fp8-block" if self.blockwise else "fp8"
        self.name = "fp8-block128" if self.blockwise else "fp8"

    def create_weights(self, layer: FusedMoE) -> None:
        E, H, I = layer.num_local_experts, layer.hidden_size, layer.local_intermediate_size
        unit = FP8_BLOCK if self.blockwise else 16
        if H % unit or I % unit:
            where = (f"{I} of {layer.intermediate_size} on each of tensor_parallel_size={layer.tp.world_size} ranks"
                     if layer.intermediate_shard is not None else f"{I}")
            layout = "in 128 x 128 blocks" if self.blockwise else "per channel"
            raise ValueError(f"{layer.prefix}: fp8 experts {layout} need the hidden size ({H}) and each rank's "
                             f"expert intermediate size ({where}) to be multiples of {unit} (fused_moe_fp8)")
        if self.blockwise:
            s13, s2 = (E, 2 * I // FP8_BLOCK, H // FP8_BLOCK), (E, H // FP8_BLOCK, I // FP8_BLOCK)
        else:
            s13, s2 = (E, 2 * I), (E, H)
        for name, shape, dtype in (("w13", (E, 2 * I, H), torch.float8_e4m3fn), ("w2", (E, H, I), torch.float8_e4m3fn),
                                   ("w13_scale", s13, torch.float32), ("w2_scale", s2, torch.float32)):
            layer.register_buffer(name, torch.empty(shape, dtype=dtype, device=layer.device), persistent=False)

    def _cut(self, stored: _Stored, dim: int, span: Optional[Tuple[int, int]]) -> Tuple[Tensor, Tensor]:
        """Codes and scales of one projection, cut to ``span`` of dimension ``dim`` (rows 0, columns 1)."""
        codes, scale = stored.data[0], stored.data[1]
        if span is None:
            return codes, scale
        if self.blockwise:  # create_weights made span a whole number of blocks
            scale = scale.narrow(dim, span[0] // FP8_BLOCK, span[1] // FP8_BLOCK)
        elif dim == 0:  # a row's scale follows it; a column cut keeps every row's whole-row scale
            scale = scale.narrow(0, *span)
        return codes.narrow(dim, *span), scale

    def load_weights(self, layer: FusedMoE, reader: WeightReader) -> None:
        shard = layer.intermediate_shard
        H, I = layer.hidden_size, layer.intermediate_size
        for i, e in enumerate(layer.local_experts()):
            parts = layer.expert_projections(e)
            stored = [_read_part(reader, p, k, self, layer.dtype) for p, k in zip(parts, (H, H, I))]
            kinds = [p.kind for p in stored]
            if i == 0 and kinds == ["float"] * 3:  # experts the checkpoint keeps in float
                layer.replace_method(UnquantizedFusedMoEMethod())
                layer.method.load_weights(layer, reader)
                return
            for part, kind in zip(parts, kinds):
                if kind != self.kind:
                    raise ValueError(f"{part.prefix}: stored as {kind}, but {layer.prefix}'s experts load as "
                                     f"{self.kind} (every expert projection of a layer must be stored alike)")
            (gq, gs), (uq, us), (dq, ds) = (self._cut(stored[0], 0, shard), self._cut(stored[1], 0, shard),
                                            self._cut(stored[2], 1, shard))
            layer.w13[i].copy_(torch.cat([gq, uq]))
            layer.w13_scale[i].copy_(torch.cat([gs, us]))
            layer.w2[i].copy_(dq)
            layer.w2_scale[i].copy_(ds)

    def apply(self, layer: FusedMoE, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return layer.ops.fused_moe_fp8(x, layer.w13, layer.w2, layer.w13_scale, layer.w2_scale, topk_weights,
                                       topk_ids, "silu")


class Int4FusedMoEMethod(FusedMoEMethod):
    """INT4 (W4A16) experts, run by ``fused_moe_int4`` (the activations stay in the model dtype).

    Buffers (this rank's experts, each its intermediate slice; registered when loading, as the group
    size and the zero points are the checkpoint's): ``w13`` int32 ``[E, H / 64, 8 * 2I]``
    (``int4_pack`` of each expert's gate rows, then its up rows: packed weights concatenated along N
    are the packed weight of the concatenation), ``w2`` int32 ``[E, I / 64, 8 * H]``, group scales
    ``w13_scales [E, H / G, 2I]`` / ``w2_scales [E, I / G, H]`` in the model dtype, and zero points
    ``w13_zeros`` / ``w2_zeros`` uint8 of the same shapes (None when every projection is symmetric;
    a symmetric projection beside asymmetric ones gets 8, its implied zero point). Each expert
    projection is read as a quantised linear's part is (``stored.py``: AutoAWQ, AutoGPTQ,
    compressed-tensors ``pack-quantized``, fastinfer int4, float weights quantised on load), then
    cut: gate and up by output rows (whole 16-row tiles), down by input features (whole groups and
    64-feature tiles). Experts a checkpoint stores in float load as float experts.

    One group size per layer, the smallest of its projections' (a larger one, such as a
    channel-wise projection's single group, is repeated over it: the same weights); H and each
    rank's I multiples of 64 and of it (the op's contract); act-order (a ``g_idx`` that permutes the input features) and padded groups are refused when
    loading, naming the projection. Tensor parallelism does not change the numbers: the activations
    are not quantised, and each rank's codes and scales are the unsharded expert's.
    """

    name = kind = "int4"
    tensor_names = ("w13", "w2", "w13_scales", "w2_scales", "w13_zeros", "w2_zeros")

    def __init__(self, source: str, opts: Optional[QuantOptions] = None, stored_config: Optional[dict] = None,
                 scheme: Optional[CtScheme] = None):
        if (source == "float") != (opts is not None):
            raise ValueError("quantising on load (source='float') needs QuantOptions, and only it takes them")
        self.source, self.opts, self.config, self.scheme = source, opts, stored_config or {}, scheme
        self.group_size: Optional[int] = None

    def create_weights(self, layer: FusedMoE) -> None:
        H, I = layer.hidden_size, layer.local_intermediate_size
        if H % 64 or I % 64:
            where = (f"{I} of {layer.intermediate_size} on each of tensor_parallel_size={layer.tp.world_size} ranks"
                     if layer.intermediate_shard is not None else f"{I}")
            raise ValueError(f"{layer.prefix}: int4 experts need the hidden size ({H}) and each rank's expert "
                             f"intermediate size ({where}) to be multiples of 64 (fused_moe_int4)")

    def _cut(self, part: Int4Part, rows: Optional[Tuple[int, int]], cols: Optional[Tuple[int, int]]) -> Int4Part:
        """``part`` cut to output rows ``rows`` or input features ``cols`` (create_weights and
        load_weights checked that they are whole tiles and groups)."""
        if rows is not None:
            span = (8 * rows[0], 8 * rows[1])
            cut = [part.packed.narrow(1, *span), part.scales.narrow(1, *rows),
                   None if part.zeros is None else part.zeros.narrow(1, *rows)]
        elif cols is not None:
            g = part.group_size
            groups = (cols[0] // g, cols[1] // g)
            cut = [part.packed.narrow(0, cols[0] // 64, cols[1] // 64), part.scales.narrow(0, *groups),
                   None if part.zeros is None else part.zeros.narrow(0, *groups)]
        else:
            return part
        return Int4Part(*cut, part.perm, part.group_size)

    @staticmethod
    def _regroup(part: Int4Part, g: int) -> Int4Part:
        """``part`` with group size ``g`` (a divisor of its own): each group's scale and zero point
        repeated over its ``part.group_size / g`` subgroups, the same weights (how a channel-wise
        projection, one group spanning K, joins a layer whose other projections have smaller groups)."""
        r = part.group_size // g
        if r == 1:
            return part
        rep = (lambda t: None if t is None else t.repeat_interleave(r, 0))
        return Int4Part(part.packed, rep(part.scales), rep(part.zeros), part.perm, g)

    def load_weights(self, layer: FusedMoE, reader: WeightReader) -> None:
        shard = layer.intermediate_shard
        H, I, local = layer.hidden_size, layer.intermediate_size, layer.local_intermediate_size
        experts = []
        for i, e in enumerate(layer.local_experts()):
            parts = layer.expert_projections(e)
            stored = [_read_part(reader, p, k, self, layer.dtype) for p, k in zip(parts, (H, H, I))]
            kinds = [p.kind for p in stored]
            if i == 0 and kinds == ["float"] * 3:  # experts the checkpoint keeps in float
                layer.replace_method(UnquantizedFusedMoEMethod())
                layer.method.load_weights(layer, reader)
                return
            for part, kind, s, k in zip(parts, kinds, stored, (H, H, I)):
                if kind != self.kind:
                    raise ValueError(f"{part.prefix}: stored as {kind}, but {layer.prefix}'s experts load as "
                                     f"{self.kind} (every expert projection of a layer must be stored alike)")
                p: Int4Part = s.data[0]
                if p.mins is not None or p.high is not None:
                    raise ValueError(f"{part.prefix}: GGUF experts with float minimums or two nibble planes (every "
                                     "type but Q4_0) load dequantised, not as int4 experts")
                if p.perm is not None:
                    raise ValueError(f"{part.prefix}: act-order int4 experts (a g_idx permuting the input features) "
                                     "are not supported (fused_moe_int4 reads the input in order); use a checkpoint "
                                     "quantised without act-order (desc_act=False / actorder=None)")
                if p.k != k:
                    raise ValueError(f"{part.prefix}: its int4 codes cover {p.k} input features (padded groups), the "
                                     f"projection has {k}: fused_moe_int4 needs the group size ({p.group_size}) to "
                                     "divide it (quantise with a group size that does, or pad_groups=False)")
            experts.append([s.data[0] for s in stored])
        g = min(p.group_size for ex in experts for p in ex)
        odd = next((part for ex, e in zip(experts, layer.local_experts())
                    for p, part in zip(ex, layer.expert_projections(e)) if p.group_size % g), None)
        if odd is not None:
            raise ValueError(f"{odd.prefix}: int4 group sizes {sorted({p.group_size for ex in experts for p in ex})} "
                             f"in {layer.prefix}'s experts: fused_moe_int4 runs one group size per layer (each a "
                             "multiple of the smallest)")
        if H % g or local % g:
            where = f"{local} per rank, tensor_parallel_size={layer.tp.world_size}" if shard is not None else f"{local}"
            raise ValueError(f"{layer.prefix}: int4 group size {g} does not divide the hidden size ({H}) and each "
                             f"rank's expert intermediate size ({where}) (fused_moe_int4)")
        self.group_size = g
        experts = [(self._cut(self._regroup(gp, g), shard, None), self._cut(self._regroup(up, g), shard, None),
                    self._cut(self._regroup(dn, g), None, shard)) for gp, up, dn in experts]
        zeros = any(p.zeros is not None for ex in experts for p in ex)

        def z(p: Int4Part) -> Tensor:
            return p.zeros if p.zeros is not None else torch.full_like(p.scales, 8, dtype=torch.uint8)

        stack = {
            "w13": [torch.cat([g.packed, u.packed], 1) for g, u, _ in experts],
            "w2": [d.packed for _, _, d in experts],
            "w13_scales": [torch.cat([g.scales, u.scales], 1) for g, u, _ in experts],
            "w2_scales": [d.scales for _, _, d in experts],
            "w13_zeros": [torch.cat([z(g), z(u)], 1) for g, u, _ in experts] if zeros else None,
            "w2_zeros": [z(d) for _, _, d in experts] if zeros else None,
        }
        for name, ts in stack.items():
            t = None if ts is None else torch.stack(ts).to(layer.device).contiguous()
            layer.register_buffer(name, t, persistent=False)

    def apply(self, layer: FusedMoE, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return layer.ops.fused_moe_int4(x, layer.w13, layer.w2, layer.w13_scales, layer.w2_scales, layer.w13_zeros,
                                        layer.w2_zeros, topk_weights, topk_ids, self.group_size, "silu")

    def describe(self, layer: FusedMoE) -> str:
        if self.group_size is None:
            return "int4 (not loaded)"
        return f"int4-g{self.group_size}{'-sym' if getattr(layer, 'w13_zeros', None) is None else ''}"


def fp4_experts_fit(layer: FusedMoE) -> bool:
    """Whether ``fused_moe_fp4`` runs ``layer``'s experts on this rank: the hidden size and each
    rank's expert intermediate size multiples of 64 (whole 64 x 16 tiles of the fp4_gemm layout)."""
    return layer.hidden_size % 64 == 0 and layer.local_intermediate_size % 64 == 0


class Fp4FusedMoEMethod(FusedMoEMethod):
    """FP4 (W4A16) experts as a checkpoint stores them, run by ``fused_moe_fp4`` (the activations
    stay in the model dtype), with the layer's activation and biases (gpt-oss's clamped SwiGLU).

    Each expert projection is read as ``P.weight_packed`` uint8 ``[N, K / 2]`` (two e2m1 codes a
    byte, the even element in the low nibble) and ``P.weight_scale`` ``[N, K / G]``:

    * ``"nvfp4"``: compressed-tensors ``nvfp4-pack-quantized`` (NVFP4A16), e4m3 scales per 16 input
      features and a global divisor ``P.weight_global_scale`` float32 ``[1]`` per projection;
    * ``"mxfp4"``: gpt-oss's MXFP4 experts, e8m0 scale bits per 32 input features, no global scale
      (:class:`~fastinfer.models.gpt_oss.GptOssExpertsReader` shows its stacked ``*_blocks`` /
      ``*_scales`` under these per-expert names).

    This rank keeps its slice of each expert (gate and up rows, down input features: whole 64 x 16
    tiles and whole scale groups, since each rank's I is a multiple of 64) and converts it with
    ``fp4_repack``. Buffers: ``w13`` int32 ``[E, H / 64, 8 * 2I]`` (gate rows, then up rows),
    ``w2`` ``[E, I / 64, 8 * H]``, scale bits ``w13_scales`` uint8 ``[E, H / G, 2I]`` /
    ``w2_scales [E, I / G, H]``, NVFP4 global divisors ``w13_global_scale [E, 2]`` (gate, up) and
    ``w2_global_scale [E]`` (None for MXFP4), and on a layer with ``bias`` ``w13_bias [E, 2I]`` /
    ``w2_bias [E, H]`` in the model dtype (the down bias held by rank 0 under tensor parallelism,
    zeros elsewhere, as float experts hold it). Tensor parallelism does not change the numbers: the
    activations are not quantised, and each rank's codes and scales are the unsharded expert's.

    A layer whose H or per-rank I is not a multiple of 64 (:func:`fp4_experts_fit`) is not given
    this method: its experts load dequantised (:class:`Nvfp4DequantizedFusedMoEMethod`, or gpt-oss's
    reader decoding MXFP4 into float experts).
    """

    tensor_names = ("w13", "w2", "w13_scales", "w2_scales", "w13_global_scale", "w2_global_scale", "w13_bias",
                    "w2_bias")
    activations = ("silu", "swiglu_oai")
    biases = True

    def __init__(self, fmt: str, stored_config=None, scheme: Optional[CtScheme] = None):
        if fmt not in ("nvfp4", "mxfp4"):
            raise ValueError(f"FP4 experts are 'nvfp4' or 'mxfp4', got {fmt!r}")
        self.format = self.name = fmt
        self.group = 16 if fmt == "nvfp4" else 32
        self.config, self.scheme = stored_config or {}, scheme

    def create_weights(self, layer: FusedMoE) -> None:
        if not fp4_experts_fit(layer):
            H, I = layer.hidden_size, layer.local_intermediate_size
            raise ValueError(f"{layer.prefix}: FP4 experts need the hidden size ({H}) and each rank's expert "
                             f"intermediate size ({I}) to be multiples of 64 (fused_moe_fp4)")

    def _read(self, reader: WeightReader, part, k: int, rows, cols) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """One projection's codes ``[n, k / 2]``, scale bits ``[n, k / G]`` and global scale (or
        None): this rank's rows / input features of it."""
        n, g = part.rows, self.group
        packed = reader.get(part.prefix + ".weight_packed", (n, k // 2), (torch.uint8,), rows=rows)
        scale_dtypes = (torch.float8_e4m3fn,) if self.format == "nvfp4" else (torch.uint8,)
        scale = reader.get(part.prefix + ".weight_scale", (n, k // g), scale_dtypes, rows=rows)
        gs = (reader.get(part.prefix + ".weight_global_scale", (1,), (torch.float32,))
              if self.format == "nvfp4" else None)
        if cols is not None:
            packed = packed.narrow(1, cols[0] // 2, cols[1] // 2)
            scale = scale.narrow(1, cols[0] // g, cols[1] // g)
        return packed.contiguous(), scale.contiguous(), gs

    def load_weights(self, layer: FusedMoE, reader: WeightReader) -> None:
        shard = layer.intermediate_shard
        H, I = layer.hidden_size, layer.intermediate_size
        first = layer.expert_projections(layer.first_expert)[0].prefix
        if not reader.has(first + ".weight_packed") and reader.has(first + ".weight"):  # experts kept in float
            layer.replace_method(UnquantizedFusedMoEMethod())
            layer.method.load_weights(layer, reader)
            return
        stack: Dict[str, List[Tensor]] = {name: [] for name in self.tensor_names}
        for e in layer.local_experts():
            gate, up, down = layer.expert_projections(e)
            (gq, gsc, ggs), (uq, usc, ugs) = (self._read(reader, p, H, shard, None) for p in (gate, up))
            dq, dsc, dgs = self._read(reader, down, I, None, shard)
            w13 = fp4_repack(torch.cat([gq, uq]), torch.cat([gsc, usc]))
            w2 = fp4_repack(dq, dsc)
            stack["w13"].append(w13.packed)
            stack["w13_scales"].append(w13.scales)
            stack["w2"].append(w2.packed)
            stack["w2_scales"].append(w2.scales)
            if self.format == "nvfp4":
                stack["w13_global_scale"].append(torch.cat([ggs.reshape(1), ugs.reshape(1)]))
                stack["w2_global_scale"].append(dgs.reshape(()))
            if layer.bias:
                gb = reader.get_float(gate.prefix + ".bias", (gate.rows,), rows=shard)
                ub = reader.get_float(up.prefix + ".bias", (up.rows,), rows=shard)
                db = reader.get_float(down.prefix + ".bias", (down.rows,))
                if shard is not None and layer.tp.rank != 0:  # added once, by rank 0's partial sum
                    db = torch.zeros_like(db)
                stack["w13_bias"].append(torch.cat([gb, ub]).to(layer.dtype))
                stack["w2_bias"].append(db.to(layer.dtype))
        for name, ts in stack.items():
            t = torch.stack(ts).to(layer.device).contiguous() if ts else None
            layer.register_buffer(name, t, persistent=False)

    def apply(self, layer: FusedMoE, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return layer.ops.fused_moe_fp4(x, layer.w13, layer.w2, layer.w13_scales, layer.w2_scales,
                                       layer.w13_global_scale, layer.w2_global_scale, topk_weights, topk_ids,
                                       self.format, layer.activation, layer.swiglu_alpha, layer.swiglu_limit,
                                       layer.w13_bias, layer.w2_bias)


class Nvfp4DequantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """compressed-tensors NVFP4 experts dequantised at load (:func:`~fastinfer.quant.math.dequantize_nvfp4`,
    float32 as compressed-tensors computes it, then the model dtype) into float experts: where
    ``fused_moe_fp4`` cannot run them (:func:`fp4_experts_fit`) or the user asked for float
    (``fp4_weights="float"``)."""

    name = "nvfp4-dequantised"

    def read_weight(self, reader: WeightReader, part, in_features: int, rows=None, cols=None) -> Tensor:
        n, k = part.rows, in_features
        packed = reader.get(part.prefix + ".weight_packed", (n, k // 2), (torch.uint8,), rows=rows)
        scale = reader.get(part.prefix + ".weight_scale", (n, k // 16), (torch.float8_e4m3fn,), rows=rows)
        gs = reader.get(part.prefix + ".weight_global_scale", (1,), (torch.float32,))
        w = dequantize_nvfp4(packed, scale, gs)
        return w if cols is None else w.narrow(1, *cols)


def describe_quantization(model) -> str:
    """"none", or the quantised linears' methods (int4 with group sizes, ``-sym`` when symmetric;
    ``nvfp4`` / ``mxfp4``) and the quantised experts' (``experts-fp8``, ``experts-fp8-block128``,
    ``experts-int4-g128``)."""
    kinds = {m.method.describe(m) for m in model.linear_layers()
             if isinstance(m.method, (_QuantizedMethod, Fp4LinearMethod))}
    kinds |= {f"experts-{m.method.describe(m)}" for m in model.modules()
              if isinstance(m, FusedMoE) and not isinstance(m.method, UnquantizedFusedMoEMethod)}
    return ",".join(sorted(kinds)) or "none"

