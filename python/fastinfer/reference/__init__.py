"""Pure-torch oracles: the executable specification of every fastinfer op.

Functions compute in float64 and return new float64 tensors (never mutating their inputs), except
where the contract prescribes an exact low-precision encoding (the fp8 KV cache), which is then
reproduced bit for bit. Tests compare implementations against these with the error rule documented
in ``tests/conftest.py``.
"""

from .elementwise import (  # noqa: F401
    FP8_E4M3_MAX,
    fp8_e4m3_quantize,
    fused_add_rms_norm,
    fused_add_rms_norm_quant,
    gated_rms_norm,
    rms_norm_quant,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gelu_new,
    gelu_fast,
    quick_gelu,
)

from .attention import (  # noqa: F401
    apply_sinks,
    merge_attention_states,
    move_kv_slots,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_attention,
    random_tree_parents,
    tree_mask,
    tree_positions,
    unpack_custom_mask,
    visibility_mask,
)

from .mla import gather_latent, mla_cache_write, mla_decode_attention  # noqa: F401

from .gemm_fp8 import fp8_dequantize, fp8_quantize, fp8_scaled_mm  # noqa: F401
from .gemm_int8 import int8_dequantize, int8_mm_exact, int8_quantize, int8_scaled_mm  # noqa: F401
from . import fp4  # noqa: F401  (the FP4 weight formats: e2m1, NVFP4, MXFP4)
from .speculative import tree_verify  # noqa: F401,E402
from . import dflash  # noqa: F401,E402  (a DFlash drafter's block forward)
from .sampling import apply_token_bitmask  # noqa: F401,E402
from .moe import moe_align, moe_topk  # noqa: F401,E402
from . import linear_attention  # noqa: F401,E402  (causal_conv1d)

__all__ = [
    "tree_verify",
    "apply_token_bitmask",
    "moe_align",
    "moe_topk",
    "merge_attention_states",
    "move_kv_slots",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_attention",
    "random_tree_parents",
    "tree_mask",
    "tree_positions",
    "unpack_custom_mask",
    "visibility_mask",
    "gather_latent",
    "mla_cache_write",
    "mla_decode_attention",
    "FP8_E4M3_MAX",
    "fp8_e4m3_quantize",
    "fused_add_rms_norm",
    "gated_rms_norm",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gelu_new",
    "gelu_fast",
    "quick_gelu",
    "fp8_dequantize",
    "fp8_quantize",
    "fp8_scaled_mm",
    "int8_dequantize",
    "int8_mm_exact",
    "int8_quantize",
    "int8_scaled_mm",
]

from .gemm import (  # noqa: F401,E402
    awq_pack,
    dense_mm,
    awq_unpack,
    gptq_pack,
    gptq_unpack,
    int4_dequantize,
    int4_gemm,
    int4_pack,
    int4_unpack,
    quantize_int4,
)

__all__ += [
    "awq_pack",
    "dense_mm",
    "awq_unpack",
    "gptq_pack",
    "gptq_unpack",
    "int4_dequantize",
    "int4_gemm",
    "int4_pack",
    "int4_unpack",
    "quantize_int4",
]
