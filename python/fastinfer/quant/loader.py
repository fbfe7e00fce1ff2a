"""Load quantised weights into :class:`~fastinfer.models.LlamaForCausalLM`: fastinfer's own format,
AutoAWQ / AutoGPTQ checkpoints, or a float checkpoint quantised on load (see :mod:`fastinfer.quant`).

Every decoder linear (qkv, o, gate_up, down) becomes an :class:`Fp8Linear` / :class:`Int4Linear`
(or stays a float ``_Linear`` when the checkpoint left it in float and no quantisation was asked
for); everything else (embedding, norms, biases, ``lm_head``) loads as in
:func:`fastinfer.models.loader.load_weights`.
"""

from __future__ import annotations

import os
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .linear import Fp8Linear, Int4Linear, Int4Part
from .quantize import LINEAR_RE, QuantOptions, quantize_fp8_weight, quantize_int4_weight, unpack_nibbles

Tensor = torch.Tensor

__all__ = ["StoredQuantization", "stored_quantization", "load_quantized_weights"]


class StoredQuantization(NamedTuple):
    """How a checkpoint is quantised: ``kind`` "fastinfer" / "awq" / "gptq", ``method`` "fp8" / "int4"."""

    kind: str
    method: str
    config: dict

    def describe(self) -> str:
        return self.kind if self.kind != "fastinfer" else f"fastinfer {self.method}"


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
        if qc.get("format_version") != 1:
            raise ValueError(f"unsupported fastinfer quantization format_version {qc.get('format_version')!r} (1)")
        if qc.get("method") not in ("fp8", "int4"):
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
    raise ValueError(f"unsupported quantization_config quant_method {qc.get('quant_method')!r} "
                     "(fastinfer, awq, gptq)")


# ------------------------------------------------------------------------------------------------
# per-projection weights as found in the checkpoint
# ------------------------------------------------------------------------------------------------


class _Part(NamedTuple):
    kind: str  # "float" | "fp8" | "int4"
    data: tuple  # float: (w,); fp8: (codes, scale); int4: (Int4Part,)


class _Reader:
    def __init__(self, path: str):
        from safetensors import safe_open

        from ..models.loader import checkpoint_files

        files, _ = checkpoint_files(path)
        self.handles = [safe_open(p, framework="pt", device="cpu") for p in files]
        self.where: Dict[str, int] = {}
        for i, h in enumerate(self.handles):
            for name in h.keys():
                if name in self.where:
                    raise ValueError(f"tensor {name!r} appears in two shards")
                self.where[name] = i
        self.used: set = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> Tensor:
        if name not in self.where:
            raise ValueError(f"missing tensor {name!r}")
        self.used.add(name)
        return self.handles[self.where[name]].get_tensor(name)


def _trivial_g_idx(g_idx: Tensor, k: int, groups: int) -> bool:
    if k % groups:
        return False
    return torch.equal(g_idx.to(torch.int64), torch.arange(k, dtype=torch.int64) // (k // groups))


def _read_part(r: _Reader, prefix: str, n: int, k: int, stored: Optional[StoredQuantization],
               opts: Optional[QuantOptions], dtype: torch.dtype) -> _Part:
    """The weights of projection ``prefix`` (``W [n, k]``), quantised to ``opts`` if they are float."""
    ops = torch.ops.fastinfer

    def check(name: str, t: Tensor, shape: Tuple[int, ...], dtypes) -> Tensor:
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
        return t

    if r.has(prefix + ".qweight"):
        if stored is None or stored.kind not in ("awq", "gptq"):
            raise ValueError(f"tensor {prefix}.qweight found but config.json's quantization_config is not awq/gptq")
        fmt = stored.kind
        qweight, qzeros, scales = r.get(prefix + ".qweight"), r.get(prefix + ".qzeros"), r.get(prefix + ".scales")
        groups = qzeros.shape[0] if qzeros.dim() == 2 else 0
        if groups < 1 or k % groups:
            raise ValueError(f"tensor {prefix}.qzeros has shape {list(qzeros.shape)}: its rows must divide K={k}")
        qshape = (k, n // 8) if fmt == "awq" else (k // 8, n)
        check(prefix + ".qweight", qweight, qshape, (torch.int32,))
        check(prefix + ".qzeros", qzeros, (groups, n // 8), (torch.int32,))
        check(prefix + ".scales", scales, (groups, n), (torch.float16, torch.bfloat16, torch.float32))
        g_idx = None
        if r.has(prefix + ".g_idx"):
            g_idx = r.get(prefix + ".g_idx")
            if fmt != "gptq":
                raise ValueError(f"tensor {prefix}.g_idx found in an {fmt} checkpoint (act-order is gptq only)")
            check(prefix + ".g_idx", g_idx, (k,), (torch.int32, torch.int64))
            if _trivial_g_idx(g_idx, k, groups):
                g_idx = None
        try:
            w = ops.int4_repack(qweight.contiguous(), qzeros.contiguous(), fmt, g_idx)
        except RuntimeError as e:
            raise ValueError(f"{prefix}: cannot repack the {fmt} tensors: {e}") from None
        perm = w[2] if g_idx is not None else None
        return _Part("int4", (Int4Part(w[0], scales.to(dtype), w[1], perm, k // groups),))

    if r.has(prefix + ".weight_packed"):
        if stored is None or stored.kind != "fastinfer" or stored.method != "int4":
            raise ValueError(f"tensor {prefix}.weight_packed found but the checkpoint is not a fastinfer int4 one")
        g = int(stored.config.get("group_size", 0))
        pk = r.get(prefix + ".weight_packed")
        if pk.dim() != 2 or pk.shape[0] != n or pk.dtype != torch.uint8 or g < 32 or (2 * pk.shape[1]) % g:
            raise ValueError(f"tensor {prefix}.weight_packed: expected uint8 [{n}, Kq/2] with Kq a multiple of "
                             f"group_size {g}, got {pk.dtype} {list(pk.shape)}")
        kq = 2 * pk.shape[1]
        if kq < k:
            raise ValueError(f"tensor {prefix}.weight_packed covers {kq} input features, the layer has {k}")
        s = check(prefix + ".weight_scale", r.get(prefix + ".weight_scale"), (kq // g, n),
                  (torch.float16, torch.bfloat16, torch.float32))
        z = None
        if r.has(prefix + ".weight_zero_point"):
            z = check(prefix + ".weight_zero_point", r.get(prefix + ".weight_zero_point"), (kq // g, n), (torch.uint8,))
        elif not stored.config.get("symmetric", False):
            raise ValueError(f"missing tensor {prefix + '.weight_zero_point'!r} (asymmetric checkpoint)")
        try:
            packed = ops.int4_pack(unpack_nibbles(pk))
        except RuntimeError as e:
            raise ValueError(f"{prefix}: cannot pack the int4 codes: {e}") from None
        return _Part("int4", (Int4Part(packed, s.to(dtype), z, None, g),))

    w = r.get(prefix + ".weight")
    if w.dtype == torch.float8_e4m3fn:
        if stored is None or stored.kind != "fastinfer" or stored.method != "fp8":
            raise ValueError(f"tensor {prefix}.weight is float8 but the checkpoint is not a fastinfer fp8 one")
        check(prefix + ".weight", w, (n, k), (torch.float8_e4m3fn,))
        s = check(prefix + ".weight_scale", r.get(prefix + ".weight_scale"), (n,), (torch.float32,))
        return _Part("fp8", (w, s))
    check(prefix + ".weight", w, (n, k), (torch.float32, torch.float16, torch.bfloat16))
    if opts is None:
        return _Part("float", (w,))
    if opts.method == "fp8":
        return _Part("fp8", quantize_fp8_weight(w))
    q, s, z = quantize_int4_weight(w, opts, prefix + ".weight")
    return _Part("int4", (Int4Part(ops.int4_pack(q), s.to(dtype), z, None, opts.group_size),))


def _same_perm(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _fuse_int4(parts: List[Int4Part]) -> List[Int4Part]:
    """One part when group sizes, input sizes and permutations agree, else the parts as they are."""
    p0 = parts[0]
    if len(parts) == 1 or any(p.group_size != p0.group_size or p.k != p0.k or not _same_perm(p.perm, p0.perm)
                              for p in parts):
        return parts
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, 8, dtype=torch.uint8)
                           for p in parts], dim=1)
    else:
        zeros = None
    return [Int4Part(torch.cat([p.packed for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                     zeros, p0.perm, p0.group_size)]


_SLOTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def build_model_shell(config, dtype: torch.dtype, device, max_positions: Optional[int] = None):
    """A :class:`LlamaForCausalLM` whose decoder linears have EMPTY (0-row) float weights: built on
    the meta device and materialised without them, so loading a quantised model never allocates
    the float linears (a 70B model in int4 fits where its bf16 weights would not).
    :func:`load_quantized_weights` replaces those linears (or allocates them, for projections a
    checkpoint keeps in float)."""
    from torch import nn

    from ..models.llama import LlamaForCausalLM
    from ..models.rope import build_cos_sin_cache

    device = torch.device("cpu" if device is None else device)
    model = LlamaForCausalLM(config, dtype=dtype, device="meta", max_positions=max_positions)
    for layer in model.layers:
        for slot in _SLOTS:
            lin = getattr(layer, slot)
            lin.weight = nn.Parameter(torch.empty((0, lin.weight.shape[1]), dtype=dtype, device="meta"),
                                      requires_grad=False)
    model.to_empty(device=device)
    model.device = device
    if config.tie_word_embeddings:  # to_empty gives every parameter its own storage
        model.lm_head.weight = model.embed_tokens.weight
    model.cos_sin_cache = build_cos_sin_cache(config, model.max_positions, dtype=torch.float32, device=device)
    return model


@torch.no_grad()
def load_quantized_weights(model, path: str, opts: Optional[QuantOptions] = None, progress: bool = False):
    """Fill ``model`` from checkpoint ``path``, replacing its decoder linears with quantised ones.

    ``opts``: quantise float weights on load (None: run the checkpoint as stored). A checkpoint
    quantised with another method than ``opts.method`` is an error.
    """
    from ..models.llama import _Linear
    from ..models.loader import _IGNORED, _targets

    c = model.config
    stored = stored_quantization(c)
    if stored is not None and opts is not None:
        if opts.method != stored.method:
            raise ValueError(
                f"checkpoint {path!r} is already quantised ({stored.describe()}); quantization={opts.method!r} "
                f"cannot be applied to it (pass quantization=None or {stored.method!r} to run it as stored)")
        opts = None  # as stored
    if stored is None and opts is None:
        raise ValueError("load_quantized_weights: the checkpoint is not quantised and no quantization was asked for")
    dtype, device = model.dtype, model.device
    r = _Reader(path)

    # ---- everything but the decoder linears' weights -----------------------------------------------
    targets = _targets(model)
    linear_prefixes = set()
    for i in range(c.num_hidden_layers):
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            linear_prefixes.add(f"model.layers.{i}.{p}")
    seen = set()
    for name in list(r.where):
        if _IGNORED.search(name) or (c.tie_word_embeddings and name == "lm_head.weight"):
            continue
        prefix, _, suffix = name.rpartition(".")
        if prefix in linear_prefixes and suffix != "bias":
            continue  # the linear pass below
        if name not in targets:
            if prefix in linear_prefixes and suffix == "bias":
                if bool(torch.count_nonzero(r.get(name))):
                    raise ValueError(f"tensor {name!r} is a non-zero bias but the model has no bias there")
                continue  # all-zero bias written by AutoGPTQ: nothing to add
            raise ValueError(f"unexpected tensor {name!r} (not part of {c.architecture})")
        dst, off, rows = targets[name]
        t = r.get(name)
        want = (rows,) + tuple(dst.shape[1:])
        if tuple(t.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(want)}")
        if not t.is_floating_point():
            raise ValueError(f"tensor {name!r} has non-float dtype {t.dtype}")
        dst.narrow(0, off, rows).copy_(t.to(device=device, dtype=dst.dtype))
        seen.add(name)
    missing = [n for n in targets if n not in seen and n.rpartition(".")[0] not in linear_prefixes]
    missing += [n for n in targets if n.endswith(".bias") and n not in seen]
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in checkpoint {path!r}")

    # ---- decoder linears -------------------------------------------------------------------------------
    q, kv, F, H = c.q_size, c.kv_size, c.intermediate_size, c.hidden_size
    slots = [("qkv_proj", [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)], H),
             ("o_proj", [("self_attn.o_proj", H)], q),
             ("gate_up_proj", [("mlp.gate_proj", F), ("mlp.up_proj", F)], H),
             ("down_proj", [("mlp.down_proj", H)], F)]
    layers = range(c.num_hidden_layers)
    if progress:
        try:
            from tqdm.auto import tqdm

            layers = tqdm(layers, desc="loading quantised layers", unit="layer")
        except ImportError:
            pass
    for i in layers:
        layer = model.layers[i]
        for slot, projs, k in slots:
            parts = [_read_part(r, f"model.layers.{i}.{p}", n, k, stored, opts, dtype) for p, n in projs]
            kinds = {p.kind for p in parts}
            old = getattr(layer, slot)
            if len(kinds) != 1:
                raise ValueError(f"layer {i}: the projections fused into {slot} are stored differently "
                                 f"({', '.join(p.kind for p in parts)}); they must all be float or all quantised alike")
            kind = kinds.pop()
            if kind == "float":
                if old.weight.shape[0] == 0:  # a shell from build_model_shell
                    rows = sum(p.data[0].shape[0] for p in parts)
                    old.weight = torch.nn.Parameter(torch.empty((rows, k), dtype=dtype, device=device),
                                                    requires_grad=False)
                off = 0
                for part in parts:
                    w = part.data[0]
                    old.weight.narrow(0, off, w.shape[0]).copy_(w.to(device=device, dtype=old.weight.dtype))
                    off += w.shape[0]
                continue
            if kind == "fp8":
                w = torch.cat([p.data[0] for p in parts], dim=0).to(device)
                s = torch.cat([p.data[1] for p in parts], dim=0).to(device)
                new = Fp8Linear(w, s, old.bias)
            else:
                ip = _fuse_int4([p.data[0] for p in parts])
                ip = [Int4Part(*(t.to(device) if isinstance(t, Tensor) else t for t in p)) for p in ip]
                new = Int4Linear(ip, k, old.bias)
            assert isinstance(old, _Linear)
            new.op_namespace = model.op_namespace
            setattr(layer, slot, new)
    unused = [n for n in r.where if n not in r.used and n.rpartition(".")[0] in linear_prefixes
              and not n.endswith(".bias")]
    if unused:
        raise ValueError(f"unexpected tensor {unused[0]!r} (not used by the {stored.describe() if stored else 'float'} loader)")
    return model


@torch.no_grad()
def quantize_model(model, opts: QuantOptions):
    """Quantise an already built float model's decoder linears in place (e.g. random-weight
    benchmark models). Both quantisers work row by row, so quantising a fused weight equals fusing
    the quantised projections. Returns ``model``."""
    from ..models.llama import _Linear

    if not isinstance(opts, QuantOptions):
        raise TypeError("opts must be a QuantOptions")
    for i, layer in enumerate(model.layers):
        for slot in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            old = getattr(layer, slot)
            if not isinstance(old, _Linear):
                raise ValueError(f"layer {i} {slot} is already quantised")
            w = old.weight.detach().cpu()
            if opts.method == "fp8":
                qw, s = quantize_fp8_weight(w)
                new = Fp8Linear(qw.to(model.device), s.to(model.device), old.bias)
            else:
                q, s, z = quantize_int4_weight(w, opts, f"layers.{i}.{slot}.weight")
                part = Int4Part(torch.ops.fastinfer.int4_pack(q).to(model.device), s.to(model.device, model.dtype),
                                None if z is None else z.to(model.device), None, opts.group_size)
                new = Int4Linear([part], w.shape[1], old.bias)
            new.op_namespace = model.op_namespace
            setattr(layer, slot, new)
    return model
