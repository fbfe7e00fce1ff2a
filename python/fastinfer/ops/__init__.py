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

from .attention import (  # noqa: F401
    merge_attention_states,
    move_kv_slots,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_attention,
)

from .gemm_fp8 import fp8_quantize, fp8_scaled_mm  # noqa: F401

__all__ = [
    "merge_attention_states",
    "move_kv_slots",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_attention",
    "build_rope_cache",
    "fused_add_rms_norm",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "fp8_quantize",
    "fp8_scaled_mm",
]

from .gemm_int4 import Int4Weight, int4_gemm, int4_pack, int4_repack, quantize_int4  # noqa: F401,E402

__all__ += ["Int4Weight", "int4_gemm", "int4_pack", "int4_repack", "quantize_int4"]
