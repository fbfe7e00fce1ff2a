"""Where layers read their weights from: the tensors of a checkpoint, by Hugging Face name.

Layers pull what they need (``reader.get("model.layers.0.self_attn.q_proj.weight")``); the reader
remembers what was read, so the loader can refuse a checkpoint with tensors nobody used.

* :class:`SafetensorsReader`: a checkpoint directory (``model.safetensors`` or an index + shards),
  memory-mapped; a tensor is read when asked for. Pickle checkpoints (``*.bin``, ``*.pt``) are
  refused: loading them can execute arbitrary code.
* :class:`TensorDictReader`: tensors already in memory (random-weight models, re-quantising a
  built model, tests).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

Tensor = torch.Tensor
Span = Tuple[int, int]  # (start, length) along one dimension

__all__ = ["WeightReader", "SafetensorsReader", "TensorDictReader", "CheckpointModule", "SingleWeightModule",
           "checkpoint_files", "check_tensor"]


def checkpoint_files(path: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The safetensors files of the checkpoint directory ``path`` and, when sharded, the index's
    ``weight_map`` (tensor name -> file name)."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path!r} does not exist")
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, "r", encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files: List[str] = []
        for fname in weight_map.values():
            if fname not in files:
                files.append(fname)
        for fname in files:
            if not os.path.isfile(os.path.join(path, fname)):
                raise ValueError(f"shard {fname!r} listed in model.safetensors.index.json is missing")
        return [os.path.join(path, f) for f in files], weight_map
    if os.path.isfile(single):
        return [single], None
    pickles = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    if pickles:
        raise ValueError(
            f"{path!r} has only pickle checkpoints ({', '.join(sorted(pickles))}); fastinfer loads "
            "safetensors only (convert with `safetensors` / save_pretrained(safe_serialization=True))"
        )
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def check_tensor(name: str, t: Tensor, shape: Optional[Tuple[int, ...]] = None, dtypes=None) -> Tensor:
    """``t`` (checkpoint tensor ``name``) if it has ``shape`` and one of ``dtypes`` (None: any)."""
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    return t


class WeightReader:
    """Named tensors of a checkpoint. Subclasses implement :meth:`names`, :meth:`_read`, :meth:`shape`."""

    def __init__(self, description: str):
        self.description = description
        self.used: set = set()

    def names(self) -> Iterable[str]:
        raise NotImplementedError

    def shape(self, name: str) -> Tuple[int, ...]:
        raise NotImplementedError

    def _read(self, name: str) -> Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def _read_slice(self, name: str, rows: Optional[Span], cols: Optional[Span]) -> Tensor:
        """Rows ``rows`` and columns ``cols`` (``(start, length)``, None: all) of a 2-D tensor."""
        t = self._read(name)
        if rows is not None:
            t = t.narrow(0, *rows)
        if cols is not None:
            t = t.narrow(1, *cols)
        return t

    def get(self, name: str, shape: Optional[Tuple[int, ...]] = None, dtypes=None, rows: Optional[Span] = None,
            cols: Optional[Span] = None) -> Tensor:
        """Read tensor ``name`` (marks it used); ``shape`` (of the whole tensor) / ``dtypes`` are
        checked when given. ``rows`` / ``cols``: ``(start, length)`` of a 2-D tensor, the slice a
        tensor-parallel rank needs (a memory-mapped reader reads only that)."""
        if not self.has(name):
            raise ValueError(f"missing tensor {name!r} in checkpoint {self.description}")
        if shape is not None and tuple(self.shape(name)) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {list(self.shape(name))}, expected {list(shape)}")
        t = self._read(name) if rows is None and cols is None else self._read_slice(name, rows, cols)
        self.used.add(name)
        return check_tensor(name, t, None, dtypes)

    def get_float(self, name: str, shape: Optional[Tuple[int, ...]] = None, rows: Optional[Span] = None,
                  cols: Optional[Span] = None) -> Tensor:
        """:meth:`get` for a tensor that must be floating point (norms, embeddings, float linears)."""
        t = self.get(name, shape, rows=rows, cols=cols)
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, a float tensor was expected (a quantised "
                             "checkpoint needs a quantization_config in config.json, see fastinfer.quant)")
        return t

    def skip(self, name: str) -> None:
        """Mark ``name`` as deliberately not used (tied copies, rotary buffers)."""
        self.used.add(name)

    def unused(self) -> List[str]:
        return [n for n in self.names() if n not in self.used]


class SafetensorsReader(WeightReader):
    """The checkpoint directory ``path`` (memory-mapped, see :func:`checkpoint_files`)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        super().__init__(repr(path))
        self.path = path
        files, weight_map = checkpoint_files(path)
        self.files = files
        self._handles = [safe_open(p, framework="pt", device="cpu") for p in files]
        self._where: Dict[str, int] = {}
        for i, (h, file) in enumerate(zip(self._handles, files)):
            fname = os.path.basename(file)
            names = list(h.keys())
            if weight_map is not None:
                present = set(names)
                for name, wf in weight_map.items():
                    if wf == fname and name not in present:
                        raise ValueError(f"tensor {name!r} is listed in the index for {fname!r} but absent from it")
            for name in names:
                if name in self._where:
                    raise ValueError(f"tensor {name!r} appears in both "
                                     f"{os.path.basename(files[self._where[name]])!r} and {fname!r}")
                self._where[name] = i

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def _read(self, name: str) -> Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def _read_slice(self, name: str, rows: Optional[Span], cols: Optional[Span]) -> Tensor:
        sl = self._handles[self._where[name]].get_slice(name)
        r = slice(None) if rows is None else slice(rows[0], rows[0] + rows[1])
        c = slice(None) if cols is None else slice(cols[0], cols[0] + cols[1])
        return sl[r, c] if len(sl.get_shape()) == 2 else sl[r]


class TensorDictReader(WeightReader):
    """Tensors in memory, by checkpoint name."""

    def __init__(self, tensors: Mapping[str, Tensor], description: str = "(in memory)"):
        super().__init__(description)
        self.tensors = dict(tensors)

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def _read(self, name: str) -> Tensor:
        return self.tensors[name]


class CheckpointModule(torch.nn.Module):
    """A layer that loads its own weights (:meth:`load_from`) from a :class:`WeightReader` under
    checkpoint names it knows (its ``prefix``), and can give them back (:meth:`checkpoint_tensors`)."""

    def load_from(self, reader: WeightReader) -> None:
        raise NotImplementedError

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        """``(checkpoint name, tensor)`` of this layer's float weights (the inverse of :meth:`load_from`)."""
        raise NotImplementedError


class SingleWeightModule(CheckpointModule):
    """A layer whose only checkpoint tensor is a float ``weight`` at ``prefix + ".weight"``
    (norms, embeddings); subclasses set ``self.prefix`` and ``self.weight``."""

    def load_from(self, reader: WeightReader) -> None:
        with torch.no_grad():
            w = reader.get_float(self.prefix + ".weight", tuple(self.weight.shape))
            self.weight.copy_(w.to(device=self.weight.device, dtype=self.weight.dtype))

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        yield self.prefix + ".weight", self.weight.detach()
