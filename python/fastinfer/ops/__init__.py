"""Documented Python wrappers around ``torch.ops.fastinfer.*``.

See the docstring of each function for shapes, dtypes, semantics and which arguments are modified
in place. The fp64 oracles live in :mod:`fastinfer.reference`.
"""

from .elementwise import (  # noqa: F401
    build_rope_cache,
    fused_add_rms_norm,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)

__all__ = [
    "build_rope_cache",
    "fused_add_rms_norm",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
