"""The fake (meta) implementations of the ops: output shapes and dtypes from the input shapes,
symbolic sizes included, for ``torch.compile``, ``opcheck`` and meta tensors. Each op's fake sits
next to its wrapper (``fastinfer/ops/<family>.py``, ``@fake("<op>")``); each extension module
registers them for its namespace when it loads (``cpp/torch/module.cpp`` calls
:func:`register`).

The compiled extension uses only the LibTorch stable ABI, which has no symbolic sizes, so these
live in Python. They check what decides the outputs and that every tensor is on one device; the
full argument checks run in the real implementations.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional

import torch

#: op name -> fake impl taking the namespace first (for its messages), then the op's arguments
FAKES: Dict[str, Callable] = {}
_REGISTERED: set = set()


def fake(op: str):
    """Declares the decorated function ``fn(ns, *op_args)`` the fake impl of ``op``."""
    def decorate(fn: Callable) -> Callable:
        FAKES[op] = fn
        return fn
    return decorate


def register(ns: str) -> None:
    """Registers the fake impls of every op under namespace ``ns`` (once per namespace)."""
    if ns in _REGISTERED:
        return
    for op, fn in FAKES.items():
        torch.library.register_fake(f"{ns}::{op}")(functools.partial(fn, ns))
    _REGISTERED.add(ns)


def check(ns: str, op: str, cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{ns}.{op}: {msg}")


def same_device(ns: str, op: str, ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    for name, t in others.items():
        if isinstance(t, torch.Tensor):
            check(ns, op, t.device == ref.device,
                  f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def check_dim(ns: str, op: str, name: str, t: torch.Tensor, dim: int, layout: str) -> None:
    check(ns, op, t.dim() == dim, f"{name} must be {dim}-D {layout}, got shape {list(t.shape)}")


def attention_outputs(q: torch.Tensor, return_lse: bool):
    lse = q.new_empty((q.shape[0], q.shape[1]) if return_lse else (0,), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse
