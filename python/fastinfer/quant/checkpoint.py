"""Round-to-nearest weight quantisers and ``fastinfer quantize`` (checkpoint -> quantised checkpoint).

The format written here is documented in :mod:`fastinfer.quant`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

Tensor = torch.Tensor

__all__ = [
    "FORMAT_VERSION",
    "METHODS",
    "QuantOptions",
    "LINEAR_RE",
    "pack_nibbles",
    "unpack_nibbles",
    "quantize_fp8_weight",
    "quantize_int4_weight",
    "quantize_checkpoint",
]

FORMAT_VERSION = 1
METHODS = ("fp8", "int4")
# the per-layer linears the runner quantises (HF names; lm_head is not among them)
LINEAR_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)$")


@dataclass(frozen=True)
class QuantOptions:
    """What to quantise to. ``group_size`` / ``symmetric`` / ``pad_groups``: int4 only."""

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
                raise ValueError("quantization_config given without quantization='fp8' or 'int4'")
            return None
        config = dict(config or {})
        unknown = set(config) - {"group_size", "symmetric", "pad_groups"}
        if unknown:
            raise ValueError(f"unknown quantization_config keys {sorted(unknown)} (group_size, symmetric, pad_groups)")
        return cls(str(method), **config)

    def config_entry(self) -> dict:
        """The ``quantization_config`` entry of a checkpoint written with these options."""
        d = {"quant_method": "fastinfer", "format_version": FORMAT_VERSION, "method": self.method,
             "modules_not_quantized": ["lm_head"]}
        if self.method == "fp8":
            d.update(weight="e4m3, per output channel", activation="e4m3, dynamic per token")
        else:
            d.update(weight="int4, group-wise", activation="unquantised", group_size=self.group_size,
                     symmetric=bool(self.symmetric), pad_groups=bool(self.pad_groups))
        return d


# ------------------------------------------------------------------------------------------------
# quantisers
# ------------------------------------------------------------------------------------------------


def quantize_fp8_weight(w: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-output-channel e4m3: ``(codes float8_e4m3fn [N, K], scale float32 [N])``."""
    from ..reference.gemm_fp8 import fp8_quantize

    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"fp8 quantisation needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    q, s = fp8_quantize(w.to(torch.float32), "token")
    return q.contiguous(), s.contiguous()


def int4_padded_k(k: int, opts: QuantOptions, name: str = "weight") -> int:
    """The stored input size ``Kq`` of a layer with input size ``k`` (see :mod:`fastinfer.quant`)."""
    g = opts.group_size
    if k % g:
        if not opts.pad_groups:
            div = math.gcd(k, g)
            hint = f"a group size dividing it (e.g. {div})" if div % 32 == 0 else "another group size"
            raise ValueError(
                f"{name}: group_size {g} does not divide the input size K={k}; use {hint} or let the "
                f"last group be zero-padded (pad_groups=True, the default; --no-pad-groups turned it off)")
        k = -(-k // g) * g
    if k % 64:
        raise ValueError(f"{name}: the int4 kernel needs K (padded: {k}) to be a multiple of 64")
    return k


def quantize_int4_weight(w: Tensor, opts: QuantOptions, name: str = "weight") -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Group-wise RTN int4 of ``w [N, K]``: ``(codes uint8 [N, Kq], scales [Kq / G, N] (w's dtype),
    zeros uint8 [Kq / G, N] or None)`` (:func:`fastinfer.reference.quantize_int4`, padded with zero
    columns to ``Kq`` when ``opts.pad_groups`` and G does not divide K)."""
    from ..reference.gemm import quantize_int4

    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{name}: int4 quantisation needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if n % 16:
        raise ValueError(f"{name}: the int4 kernel needs the output size N={n} to be a multiple of 16")
    kq = int4_padded_k(k, opts, name)
    if kq != k:
        w = torch.nn.functional.pad(w, (0, kq - k))
    return quantize_int4(w, opts.group_size, bool(opts.symmetric))


def pack_nibbles(q: Tensor) -> Tensor:
    """uint8 ``[N, K]`` (0..15, K even) -> uint8 ``[N, K / 2]``: low nibble = even column."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`."""
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1).contiguous()


# ------------------------------------------------------------------------------------------------
# checkpoint -> quantised checkpoint
# ------------------------------------------------------------------------------------------------

_WEIGHT_FILES = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.pt|\.pth|\.ckpt|\.msgpack|\.h5)$")


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="layer")


class _ShardWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max = out_dir, int(max_shard_bytes)
        self.cur: Dict[str, Tensor] = {}
        self.cur_bytes = 0
        self.shards: List[Dict[str, Tensor]] = []
        self.files: List[str] = []
        self.names: List[List[str]] = []

    def add(self, name: str, t: Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.cur and self.cur_bytes + nbytes > self.max:
            self._flush()
        self.cur[name] = t.contiguous()
        self.cur_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.cur:
            return
        fname = f".tmp-shard-{len(self.files):05d}.safetensors"
        save_file(self.cur, os.path.join(self.out_dir, fname), metadata={"format": "pt"})
        self.files.append(fname)
        self.names.append(list(self.cur))
        self.cur, self.cur_bytes = {}, 0

    def close(self) -> List[str]:
        self._flush()
        n = len(self.files)
        final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        umask = os.umask(0)
        os.umask(umask)
        for tmp, fin in zip(self.files, final):
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, fin))
            os.chmod(os.path.join(self.out_dir, fin), 0o666 & ~umask)  # safetensors writes 0600
        if n > 1:
            total = sum(os.path.getsize(os.path.join(self.out_dir, f)) for f in final)
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: fin for names, fin in zip(self.names, final) for name in names}}
            with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        return final


@torch.no_grad()
def quantize_checkpoint(in_dir: str, out_dir: str, opts: QuantOptions, progress: bool = False,
                        max_shard_bytes: int = 4 << 30) -> Dict[str, object]:
    """Quantise the float safetensors checkpoint ``in_dir`` into ``out_dir`` (format: module docstring).

    Reads one layer at a time (memory-mapped); writes shards of at most ``max_shard_bytes``.
    Returns a summary dict (files written, number of quantised linears).
    """
    from safetensors import safe_open

    from ..models.config import ModelConfig
    from ..models.loader import checkpoint_files

    if not isinstance(opts, QuantOptions):
        raise TypeError("opts must be a QuantOptions")
    cfg_path = os.path.join(in_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"no config.json in {in_dir!r}")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    ModelConfig.from_dict(cfg)  # refuse unsupported models before writing anything
    if cfg.get("quantization_config"):
        qc = cfg["quantization_config"]
        raise ValueError(f"{in_dir!r} is already quantised (quantization_config {qc.get('quant_method')!r}"
                         f"{' ' + repr(qc.get('method')) if qc.get('method') else ''}); quantise a float checkpoint")
    files, _ = checkpoint_files(in_dir)
    if os.path.abspath(out_dir) == os.path.abspath(in_dir):
        raise ValueError("OUT_DIR must differ from IN_DIR")
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if _WEIGHT_FILES.search(old):
            raise ValueError(f"{out_dir!r} already holds weights ({old}); use an empty directory")

    handles = [safe_open(p, framework="pt", device="cpu") for p in files]
    where: Dict[str, int] = {}
    for i, h in enumerate(handles):
        for name in h.keys():
            where[name] = i
    layers: Dict[int, List[str]] = {}
    other: List[str] = []
    for name in where:
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        (layers.setdefault(int(m.group(1)), []) if m else other).append(name)

    writer = _ShardWriter(out_dir, max_shard_bytes)
    n_quant = 0

    def emit(name: str) -> None:
        nonlocal n_quant
        t = handles[where[name]].get_tensor(name)
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix is None or not LINEAR_RE.match(prefix):
            writer.add(name, t)
            return
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}: the input must be a float checkpoint")
        if opts.method == "fp8":
            q, s = quantize_fp8_weight(t)
            writer.add(prefix + ".weight", q)
            writer.add(prefix + ".weight_scale", s)
        else:
            q, s, z = quantize_int4_weight(t, opts, name)
            writer.add(prefix + ".weight_packed", pack_nibbles(q))
            writer.add(prefix + ".weight_scale", s)
            if z is not None:
                writer.add(prefix + ".weight_zero_point", z)
        n_quant += 1

    for name in sorted(other):
        emit(name)
    for li in _progress(sorted(layers), progress, f"quantize {opts.method}"):
        for name in sorted(layers[li]):
            emit(name)
    written = writer.close()

    cfg["quantization_config"] = opts.config_entry()
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    copied = []
    for fname in sorted(os.listdir(in_dir)):
        src = os.path.join(in_dir, fname)
        if fname == "config.json" or _WEIGHT_FILES.search(fname) or not os.path.isfile(src):
            continue
        shutil.copyfile(src, os.path.join(out_dir, fname))  # tokenizer files, generation_config, ...
        copied.append(fname)
    return {"out_dir": out_dir, "method": opts.method, "weights": written, "copied": copied,
            "quantized_linears": n_quant}
