"""The ``quantization_config`` of a compressed-tensors checkpoint (what llm-compressor writes and vLLM
serves): which scheme each checkpoint module has, and whether fastinfer can run it.

``config_groups`` map names to schemes (``targets``, ``weights``, ``input_activations``,
``output_activations``, ``format``); ``ignore`` lists modules left in float; a module's scheme is
the first group whose targets match it, by exact name or ``re:`` regex (Python ``re.match``, i.e.
anchored at the start) first, then by class name (every linear of a Llama-family model, ``lm_head``
included, is a ``Linear``). An ``ignore`` entry matches the same way. This is compressed-tensors'
own rule (``compressed_tensors.utils.match``).

Supported (:attr:`CtScheme.kind`):

* ``"int4"`` -- format ``pack-quantized``, 4-bit int weights, no activation quantisation (the W4A16
  and W4A16_ASYM presets): ``strategy`` ``group`` (``group_size``) or ``channel``, symmetric or
  asymmetric, ``actorder`` none / ``weight`` / ``group`` (``weight_g_idx``);
* ``"fp8"`` -- format ``float-quantized`` (or the older ``naive-quantized``), e4m3 weights per
  ``channel`` or per ``tensor`` with e4m3 activations dynamic per ``token`` (FP8_DYNAMIC), dynamic
  per ``tensor``, or static per ``tensor`` (``input_scale``, the FP8 preset);
* ``"fp8-block"`` -- e4m3 weights in ``block`` ``[128, 128]`` with dynamic ``group`` 128 activations
  (FP8_BLOCK);
* ``"int8"`` -- format ``int-quantized``, symmetric int8 weights per ``channel`` or per ``tensor``
  with int8 activations dynamic per ``token``, symmetric (the W8A8 preset) or asymmetric (zero points
  per token), or static per ``tensor`` and symmetric (``input_scale``).

Anything else (int8 weight-only or with asymmetric weights, nvfp4 / mxfp4, weight-only fp8, output activations, 2:4 sparsity, other block
shapes, ...) is :attr:`CtScheme.kind` ``"unsupported"``: loading a model with a layer of that scheme
raises one ``ValueError`` line naming the scheme and the layer. ``transform_config`` (rotations) has
no layer and is refused when the config is parsed.

``kv_cache_scheme`` (an fp8 KV cache with calibrated scales): compressed-tensors gives each attention
module ``k_scale`` / ``v_scale`` parameters (``model.layers.{i}.self_attn.k_scale``, shape ``[1]`` for
strategy ``tensor``, ``[Hkv, 1, 1]`` for ``attn_head``, in the model's dtype), which the attention
layers load (:class:`fastinfer.layers.PagedAttention`) and use with ``kv_cache_dtype="fp8"``. Float
8-bit (e4m3), symmetric, static, per ``tensor`` or per ``attn_head`` is accepted; anything else is
refused when the config is parsed, naming the scheme.
"""

from __future__ import annotations

import re
from typing import List, NamedTuple, Optional, Sequence

__all__ = ["CtScheme", "CompressedTensorsConfig", "SUPPORTED_SCHEMES", "check_kv_cache_scheme"]

SUPPORTED_SCHEMES = ("W4A16 / W4A16_ASYM (pack-quantized int4, group or channel, actorder), FP8_DYNAMIC, FP8 "
                     "(static per-tensor), FP8_BLOCK (float-quantized), W8A8 int8 (int-quantized, symmetric "
                     "weights; dynamic per-token or static per-tensor activations), NVFP4A16 "
                     "(nvfp4-pack-quantized, dense layers, on fp4_gemm)")
FP8_BLOCK = 128


class CtScheme(NamedTuple):
    """One config group, as fastinfer reads it. ``kind``: ``"int4"`` / ``"fp8"`` / ``"fp8-block"`` /
    ``"int8"`` / ``"nvfp4"`` / ``"unsupported"``; ``description``: the scheme in words (the error
    text when unsupported)."""

    group: str
    kind: str
    description: str
    group_size: Optional[int] = None  # int4: G; None = channel-wise (one group spanning K)
    symmetric: bool = True  # int4: no weight_zero_point
    actorder: Optional[str] = None  # int4: None | "weight" | "group"
    weight_strategy: str = ""  # fp8 / int8: "channel" | "tensor" | "block"
    activation: str = ""  # fp8: "token" | "tensor" (dynamic) | "static" | "group"; int8: "token" | "static"
    activation_symmetric: bool = True  # int8: False = per-token zero points


def _args_text(a: Optional[dict]) -> str:
    if not a:
        return "none"
    t = f"{a.get('type', 'int')}{a.get('num_bits', 8)}"
    strat = a.get("strategy") or ("group" if a.get("group_size") else "tensor")
    t += f" {strat}"
    if strat == "group" and a.get("group_size"):
        t += f" {a['group_size']}"
    if strat == "block" and a.get("block_structure"):
        t += f" {a['block_structure']}"
    if a.get("dynamic"):
        t += " dynamic" if a["dynamic"] is True else f" dynamic={a['dynamic']}"
    if not a.get("symmetric", True):
        t += " asymmetric"
    return t


def _preset_name(w: dict, ia: Optional[dict]) -> str:
    """The llm-compressor preset a scheme looks like, for error messages ("" if none)."""
    wt, wb = w.get("type", "int"), w.get("num_bits", 8)
    if wt == "float" and wb == 4:
        return "NVFP4" if w.get("strategy") == "tensor_group" else "MXFP4 / FP4"
    if wt == "int" and wb == 8:
        return "W8A8 int8" if ia else "W8A16 int8"
    if wt == "int" and wb == 4 and ia:
        return "W4A8" if ia.get("type", "int") == "int" else "W4AFP8"
    if wt == "float" and wb == 8 and not ia:
        return "FP8 weight-only (W8A16)"
    return ""


def _classify(name: str, g: dict, default_format: Optional[str]) -> CtScheme:
    fmt = g.get("format") or default_format or ""
    w = g.get("weights")
    ia = g.get("input_activations")
    oa = g.get("output_activations")
    text = f"weights {_args_text(w)}, input activations {_args_text(ia)}, format {fmt!r}"
    if oa:
        text += f", output activations {_args_text(oa)}"

    def unsupported(why: str = "") -> CtScheme:
        preset = _preset_name(w, ia) if isinstance(w, dict) else ""
        label = f"{preset} " if preset else ""
        return CtScheme(name, "unsupported", f"compressed-tensors scheme {label}({text}) of config group "
                        f"{name!r} is not supported{': ' + why if why else ''} (supported: "
                        f"{SUPPORTED_SCHEMES})")

    if not isinstance(w, dict):
        return unsupported("no weight quantisation")
    if oa:
        return unsupported("output activation quantisation")
    wtype, wbits = w.get("type", "int"), w.get("num_bits", 8)
    strat = w.get("strategy") or ("group" if w.get("group_size") not in (None, -1) else
                                  "channel" if w.get("group_size") == -1 else "tensor")
    if w.get("dynamic"):
        return unsupported("dynamic weight quantisation")
    if wtype == "int" and wbits == 4 and ia is None:
        if fmt != "pack-quantized":
            return unsupported("int4 weights are read in format 'pack-quantized' only")
        if strat not in ("group", "channel"):
            return unsupported(f"int4 weight strategy {strat!r} (group or channel)")
        gs = w.get("group_size") if strat == "group" else None
        if strat == "group" and (not isinstance(gs, int) or gs <= 0):
            return unsupported(f"int4 group_size {gs!r}")
        actorder = w.get("actorder")
        actorder = {"static": "weight", "dynamic": "group", False: None}.get(actorder, actorder)
        if actorder not in (None, "weight", "group"):
            return unsupported(f"actorder {actorder!r}")
        desc = f"pack-quantized int4 W4A16 ({'group ' + str(gs) if gs else 'channel-wise'}, " \
               f"{'symmetric' if w.get('symmetric', True) else 'asymmetric'})"
        return CtScheme(name, "int4", desc, group_size=gs, symmetric=bool(w.get("symmetric", True)),
                        actorder=actorder)
    if wtype == "float" and wbits == 8 and isinstance(ia, dict):
        if fmt not in ("float-quantized", "naive-quantized"):
            return unsupported("fp8 weights are read in format 'float-quantized' only")
        if not w.get("symmetric", True) or not ia.get("symmetric", True):
            return unsupported("asymmetric fp8")
        if ia.get("type", "int") != "float" or ia.get("num_bits", 8) != 8:
            return unsupported("fp8 weights with non-fp8 activations")
        astrat = ia.get("strategy") or ("group" if ia.get("group_size") else "tensor")
        dyn = ia.get("dynamic", False)
        if strat == "block":
            if list(w.get("block_structure") or []) != [FP8_BLOCK, FP8_BLOCK]:
                return unsupported(f"fp8 block_structure {w.get('block_structure')!r} (only [128, 128])")
            if astrat != "group" or ia.get("group_size") != FP8_BLOCK or dyn is not True:
                return unsupported("128x128 fp8 weight blocks need dynamic group-128 activations")
            return CtScheme(name, "fp8-block", "float-quantized FP8 128x128 blocks, dynamic 1x128 activations",
                            weight_strategy="block", activation="group")
        if strat not in ("channel", "tensor"):
            return unsupported(f"fp8 weight strategy {strat!r}")
        if astrat == "token" and dyn is True:
            act = "token"
        elif astrat == "tensor" and dyn is True:
            act = "tensor"
        elif astrat == "tensor" and not dyn:
            act = "static"
        else:
            return unsupported(f"fp8 activations {_args_text(ia)}")
        return CtScheme(name, "fp8", f"float-quantized FP8 (per-{strat} weights, {act} activations)",
                        weight_strategy=strat, activation=act)
    if wtype == "float" and wbits == 4:
        if fmt != "nvfp4-pack-quantized":
            return unsupported("fp4 weights are read in format 'nvfp4-pack-quantized' only")
        if strat != "tensor_group" or w.get("group_size") != 16:
            return unsupported("fp4 weights other than NVFP4 (tensor_group, group 16)")
        if ia is not None:
            return unsupported("fp4 activations (NVFP4 W4A4)")
        return CtScheme(name, "nvfp4", "nvfp4-pack-quantized NVFP4 W4A16 (e2m1 weights, an e4m3 scale per 16 "
                        "and a global scale), on fp4_gemm", group_size=16)
    if wtype == "int" and wbits == 8 and isinstance(ia, dict):
        if fmt not in ("int-quantized", "naive-quantized"):
            return unsupported("int8 weights are read in format 'int-quantized' only")
        if not w.get("symmetric", True):
            return unsupported("asymmetric int8 weights")
        if ia.get("type", "int") != "int" or ia.get("num_bits", 8) != 8:
            return unsupported("int8 weights with non-int8 activations")
        if strat not in ("channel", "tensor"):
            return unsupported(f"int8 weight strategy {strat!r}")
        astrat = ia.get("strategy") or ("group" if ia.get("group_size") else "tensor")
        dyn, asym = ia.get("dynamic", False), not ia.get("symmetric", True)
        if astrat == "token" and dyn is True:
            act = "token"
        elif astrat == "tensor" and not dyn and not asym:
            act = "static"
        else:
            return unsupported(f"int8 activations {_args_text(ia)}")
        return CtScheme(name, "int8", f"int-quantized W8A8 int8 (per-{strat} weights, {act} "
                        f"{'asymmetric' if asym else 'symmetric'} activations)",
                        weight_strategy=strat, activation=act, activation_symmetric=not asym)
    return unsupported()


def check_kv_cache_scheme(kv: dict) -> dict:
    """``kv`` (a ``kv_cache_scheme``) if the fp8 cache can run it: e4m3 (float, 8 bits), symmetric,
    static scales per tensor or per attention head; else a ValueError naming the scheme."""
    if not isinstance(kv, dict):
        raise ValueError(f"compressed-tensors: kv_cache_scheme must be a dict, got {kv!r}")
    strategy = kv.get("strategy") or "tensor"
    why = ""
    if kv.get("type", "int") != "float" or kv.get("num_bits", 8) != 8:
        why = "only an fp8 (float, 8 bits) KV cache"
    elif not kv.get("symmetric", True):
        why = "asymmetric (zero points)"
    elif kv.get("dynamic", False):
        why = "dynamic scales"
    elif strategy not in ("tensor", "attn_head"):
        why = f"strategy {strategy!r} (tensor or attn_head)"
    if why:
        raise ValueError(f"compressed-tensors: kv_cache_scheme ({_args_text(kv)}) is not supported: {why}")
    return kv


def _match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


class CompressedTensorsConfig:
    """A parsed compressed-tensors ``quantization_config``; :meth:`scheme_for` gives a module's scheme."""

    def __init__(self, qc: dict):
        self.raw = qc
        # the scales themselves are the attention layers' to load (see the module docstring)
        self.kv_cache_scheme = check_kv_cache_scheme(qc["kv_cache_scheme"]) if qc.get("kv_cache_scheme") else None
        if qc.get("transform_config"):
            raise ValueError("compressed-tensors: transform_config (rotations such as SpinQuant / QuIP) is not "
                             "supported")
        if str(qc.get("quantization_status", "compressed")).lower() not in ("compressed", "frozen"):
            raise ValueError(f"compressed-tensors: quantization_status {qc.get('quantization_status')!r} "
                             "(only saved, compressed checkpoints load)")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise ValueError(f"compressed-tensors: config_groups must be a dict, got {groups!r}")
        self.ignore: List[str] = list(qc.get("ignore") or [])
        self.groups = []
        for name, g in groups.items():
            if not isinstance(g, dict):
                raise ValueError(f"compressed-tensors: config group {name!r} must be a dict")
            targets = g.get("targets") or []
            targets = [targets] if isinstance(targets, str) else list(targets)
            self.groups.append((targets, _classify(str(name), g, qc.get("format"))))
        sp = qc.get("sparsity_config") or {}
        self.sparsity = None
        if sp:
            fmt = sp.get("format", "?")
            structure = sp.get("sparsity_structure", "?")
            self.sparsity = (list(sp.get("targets") or []), list(sp.get("ignore") or []),
                             CtScheme("sparsity_config", "unsupported",
                                      f"compressed-tensors sparsity {structure!r} (format {fmt!r}) is not supported"))

    @property
    def kinds(self) -> set:
        return {s.kind for _, s in self.groups}

    def _matches(self, name: str, targets: Sequence[str], cls: str) -> int:
        """0: by name, 1: by class, 2: no match."""
        if any(_match(name, t) for t in targets):
            return 0
        return 1 if cls in targets else 2

    def scheme_for(self, name: str, cls: str = "Linear") -> Optional[CtScheme]:
        """The scheme of checkpoint module ``name`` (None: not quantised)."""
        if self.sparsity is not None:
            targets, ignore, scheme = self.sparsity
            if self._matches(name, targets, cls) < 2 and self._matches(name, ignore, cls) == 2:
                return scheme
        if self._matches(name, self.ignore, cls) < 2:
            return None
        best = None
        for targets, scheme in self.groups:
            m = self._matches(name, targets, cls)
            if m < 2 and (best is None or m < best[0]):
                best = (m, scheme)
        return best[1] if best else None
