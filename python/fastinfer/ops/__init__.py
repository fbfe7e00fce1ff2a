"""Documented Python wrappers around ``torch.ops.fastinfer.*``.

See the docstring of each function for shapes, dtypes, semantics and which arguments are modified
in place. The fp64 oracles live in :mod:`fastinfer.reference`.

Every wrapper takes a keyword-only ``lib``: the op library it calls (``torch.ops.fastinfer`` when
None). :func:`backend` binds it once: ``backend("fastinfer_sim").rms_norm(x, w, 1e-6)`` runs the
CUDA kernel sources on the simt emulator with the same arguments. The runner's layers hold one
:class:`Backend` and call the ops through it with keyword arguments.
"""

from __future__ import annotations

import functools
import importlib
from typing import Dict

import torch

# Each family module lists its public names in __all__; its op wrappers are those with a fake impl
# (_fake.FAKES, declared next to each wrapper), the rest are helpers (pack_custom_mask, Int4Weight).
from . import (
    attention,
    elementwise,
    gemm_dense,
    gemm_fp4,
    gemm_fp8,
    gemm_int4,
    gemm_int8,
    linear_attention,
    moe,
    sampling,
    speculative,
)
from ._fake import FAKES
from .attention import *  # noqa: F401,F403
from .elementwise import *  # noqa: F401,F403
from .gemm_dense import *  # noqa: F401,F403
from .gemm_fp4 import *  # noqa: F401,F403
from .gemm_fp8 import *  # noqa: F401,F403
from .gemm_int4 import *  # noqa: F401,F403
from .gemm_int8 import *  # noqa: F401,F403
from .linear_attention import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
from .speculative import *  # noqa: F401,F403

_FAMILIES = (
    elementwise, attention, gemm_dense, gemm_fp4, gemm_fp8, gemm_int4, gemm_int8, linear_attention, speculative,
    sampling, moe,
)
_OPS = {name: getattr(m, name) for m in _FAMILIES for name in m.__all__ if name in FAKES}

NAMESPACES = ("fastinfer", "fastinfer_sim")

#: keys per split of the attention ops in the deterministic mode (``fixed_split_size``): one
#: reduction order per query row, whatever the batch (a multiple of the kernels' 64-key tile)
DETERMINISTIC_SPLIT_SIZE = 256

#: Backend.rowwise: a row's elements padded to a multiple of this (two vectors of the widest
#: ISA's narrowest type: AVX-512 bf16, 2 x 32), and elements per call, below ATen's
#: one-thread limit (GRAIN_SIZE = 32768)
ROWWISE_WIDTH = 64
ROWWISE_ELEMENTS = 16384

# what a deterministic Backend binds into each op (see Backend)
_DETERMINISTIC_ARGS = {
    **{f: {"fixed_split_size": DETERMINISTIC_SPLIT_SIZE}
       for f in ("prefill_attention", "paged_prefill_attention", "paged_decode_attention", "mla_decode_attention")},
    **{f: {"deterministic": True} for f in ("fp8_scaled_mm", "int8_scaled_mm", "int4_gemm", "fp4_gemm",
                                               "gated_delta_rule")},
}


class Backend:
    """The op wrappers of this module bound to one op library (``torch.ops.<namespace>``).

    ``fastinfer``: the compiled CPU / CUDA kernels. ``fastinfer_sim``: the CUDA kernel sources run
    by the simt emulator on CPU tensors (tests; fp16/bf16; slow by design). Attribute access
    returns the wrapper with ``lib`` bound (``Backend.rms_norm(x, weight, eps)``).

    ``deterministic=True`` (the runner's deterministic mode) also binds the batch-invariant options:
    the attention ops get ``fixed_split_size=DETERMINISTIC_SPLIT_SIZE``, the quantised GEMMs
    ``deterministic=True``, :meth:`linear` multiplies with ``dense_mm`` instead of
    ``torch.nn.functional.linear`` and :meth:`rowwise` lays a torch elementwise gate out in whole
    vectors on CPU; so a row's result depends on that row's inputs alone.
    """

    def __init__(self, namespace: str, deterministic: bool = False):
        if namespace not in NAMESPACES:
            raise ValueError(f"unknown op namespace {namespace!r} (one of {', '.join(NAMESPACES)})")
        if namespace == "fastinfer_sim":
            importlib.import_module("fastinfer._sim")  # registers torch.ops.fastinfer_sim
        self.namespace = namespace
        self.deterministic = bool(deterministic)
        self.lib = getattr(torch.ops, namespace)

    def __getattr__(self, name: str):
        fn = _OPS.get(name)
        if fn is None:
            raise AttributeError(f"fastinfer.ops has no op {name!r}")
        bound = functools.partial(fn, lib=self.lib, **(_DETERMINISTIC_ARGS.get(name, {}) if self.deterministic else {}))
        functools.update_wrapper(bound, fn)
        setattr(self, name, bound)  # resolved once per backend
        return bound

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        """``x W^T + b`` over the last dim of ``x`` (``weight [N, K]``)."""
        if not self.deterministic:
            return torch.nn.functional.linear(x, weight, bias)
        y = dense_mm(x.reshape(-1, x.shape[-1]), weight, bias, lib=self.lib)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def rowwise(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn(x)`` for an elementwise torch function ``fn`` (sigmoid, softplus) of ``x [rows, n]``.
        In the deterministic mode on CPU each row is laid out padded to a multiple of
        ``ROWWISE_WIDTH`` elements, in calls of at most ``ROWWISE_ELEMENTS``: ATen's CPU kernels
        run whole vectors and leave the last ``numel % (2 x lanes)`` elements (and each thread's
        share of a large tensor) to a scalar loop whose exp rounds differently, so an element's
        bits would follow its position in the flattened batch; padded, every element takes the
        vector loop whatever the number of rows."""
        if not self.deterministic or x.device.type != "cpu":
            return fn(x)
        if x.dim() != 2:
            raise ValueError(f"Backend.rowwise: x must be [rows, n], got shape {tuple(x.shape)}")
        n = x.shape[-1]
        width = -(-n // ROWWISE_WIDTH) * ROWWISE_WIDTH
        padded = torch.nn.functional.pad(x, (0, width - n)) if width != n else x.contiguous()
        rows = max(1, ROWWISE_ELEMENTS // max(width, 1))
        return torch.cat([fn(part) for part in padded.split(rows)])[:, :n] if x.shape[0] else fn(x)

    def __repr__(self) -> str:
        return f"Backend({self.namespace!r}{', deterministic=True' if self.deterministic else ''})"


_BACKENDS: Dict[tuple, Backend] = {}


def backend(namespace: str = "fastinfer", deterministic: bool = False) -> Backend:
    """The (cached) :class:`Backend` of ``namespace`` ("fastinfer" or "fastinfer_sim")."""
    key = (namespace, bool(deterministic))
    b = _BACKENDS.get(key)
    if b is None:
        b = _BACKENDS[key] = Backend(namespace, deterministic)
    return b


__all__ = sorted({name for m in _FAMILIES for name in m.__all__}) + [
    "Backend", "backend", "NAMESPACES", "DETERMINISTIC_SPLIT_SIZE"]
