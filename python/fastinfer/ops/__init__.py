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

from .elementwise import (  # noqa: F401
    build_rope_cache,
    fused_add_rms_norm,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)

from .attention import (  # noqa: F401
    merge_attention_states,
    move_kv_slots,
    pack_custom_mask,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_attention,
)

from .gemm_dense import dense_mm  # noqa: F401
from .gemm_fp8 import fp8_quantize, fp8_scaled_mm  # noqa: F401
from .gemm_int4 import Int4Weight, int4_gemm, int4_pack, int4_repack  # noqa: F401
from .gemm_int8 import int8_azp_adj, int8_quantize, int8_scaled_mm  # noqa: F401
from .speculative import tree_verify  # noqa: F401

_OPS = {
    f.__name__: f
    for f in (rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, reshape_and_cache,
              prefill_attention, paged_prefill_attention, paged_decode_attention, merge_attention_states,
              move_kv_slots, fp8_quantize, fp8_scaled_mm, int4_pack, int4_repack, int4_gemm, int8_quantize,
              int8_scaled_mm, dense_mm, tree_verify)
}

NAMESPACES = ("fastinfer", "fastinfer_sim")

#: keys per split of the attention ops in the deterministic mode (``fixed_split_size``): one
#: reduction order per query row, whatever the batch (a multiple of the kernels' 64-key tile)
DETERMINISTIC_SPLIT_SIZE = 256

# what a deterministic Backend binds into each op (see Backend)
_DETERMINISTIC_ARGS = {
    **{f: {"fixed_split_size": DETERMINISTIC_SPLIT_SIZE}
       for f in ("prefill_attention", "paged_prefill_attention", "paged_decode_attention")},
    **{f: {"deterministic": True} for f in ("fp8_scaled_mm", "int8_scaled_mm", "int4_gemm")},
}


class Backend:
    """The op wrappers of this module bound to one op library (``torch.ops.<namespace>``).

    ``fastinfer``: the compiled CPU / CUDA kernels. ``fastinfer_sim``: the CUDA kernel sources run
    by the simt emulator on CPU tensors (tests; fp16/bf16; slow by design). Attribute access
    returns the wrapper with ``lib`` bound (``Backend.rms_norm(x, weight, eps)``).

    ``deterministic=True`` (the runner's deterministic mode) also binds the batch-invariant options:
    the attention ops get ``fixed_split_size=DETERMINISTIC_SPLIT_SIZE``, the quantised GEMMs
    ``deterministic=True``, and :meth:`linear` multiplies with ``dense_mm`` instead of
    ``torch.nn.functional.linear``; so a row's result depends on that row's inputs alone.
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


__all__ = sorted(_OPS) + ["Int4Weight", "int8_azp_adj", "build_rope_cache", "pack_custom_mask", "Backend", "backend", "NAMESPACES", "DETERMINISTIC_SPLIT_SIZE"]
