"""Model configuration: the subset of a Hugging Face ``config.json`` the runner needs.

Supported architectures: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, the mixture-of-experts
``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM``,
``GptOssForCausalLM``, the hybrid (Gated DeltaNet) ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``
and ``Qwen3NextForCausalLM``, the multi-head latent attention ``DeepseekV3ForCausalLM``
(DeepSeek-V3, Kimi K2) and ``DeepseekV2ForCausalLM`` (DeepSeek-V2, V2-Lite) (and the text model of a
``Gemma3ForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration`` or
``Qwen3_5MoeForConditionalGeneration`` checkpoint: its ``text_config``). A key missing from
``config.json`` takes the default of the corresponding ``transformers`` config class (so a
checkpoint means the same thing here as in ``transformers``). Anything the runner cannot run
faithfully (another architecture, an activation other than SiLU (Llama family) or tanh-GELU
(Gemma), a RoPE type outside ``default/linear/dynamic/llama3/yarn``, partial rotary, per-layer RoPE
other than Gemma 3's sliding / full pair, bidirectional attention) raises a ``ValueError`` naming
it, never a silent approximation.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "GEMMA_ARCHITECTURES", "MOE_ARCHITECTURES",
           "HYBRID_ARCHITECTURES", "HYBRID_MOE_ARCHITECTURES", "MLA_ARCHITECTURES"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# Defaults of the transformers (5.x) config classes for the keys we read.
_COMMON_DEFAULTS: Dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "head_dim": None,
    "rope_theta": 10000.0,
}
_ARCH_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "LlamaForCausalLM": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "MistralForCausalLM": {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "Qwen3ForCausalLM": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "Qwen3_5ForCausalLM": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "full_attention_interval": 4,
        "partial_rotary_factor": 0.25,
    },
    "Qwen3_5MoeForCausalLM": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "full_attention_interval": 4,
        "partial_rotary_factor": 0.25,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    "Qwen3NextForCausalLM": {
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "full_attention_interval": 4,
        "partial_rotary_factor": 0.25,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
    "Gemma2ForCausalLM": {
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "use_bidirectional_attention": None,
    },
    "Gemma3ForCausalLM": {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "rope_theta": 1_000_000.0,  # full-attention layers
        "rope_local_base_freq": 10_000.0,  # sliding-window layers
    },
    "Qwen3MoeForCausalLM": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
    "Qwen2MoeForCausalLM": {
        "model_type": "qwen2_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "qkv_bias": True,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
    "OlmoeForCausalLM": {
        "model_type": "olmoe",
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": None,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "pad_token_id": 1,
        "bos_token_id": None,
        "eos_token_id": 50279,
        "attention_bias": False,
        "clip_qkv": None,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
}
_ARCH_DEFAULTS["GptOssForCausalLM"] = {
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": None,
    "attention_bias": True,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "rope_theta": 150000.0,
    # transformers' GptOssConfig when the config states no rope_parameters
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096},
}
# transformers' DeepseekV3Config (DeepSeek-V3, Kimi K2) and DeepseekV2Config (DeepSeek-V2, V2-Lite)
_ARCH_DEFAULTS["DeepseekV3ForCausalLM"] = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_interleave": True,
    "attention_bias": False,
}
_ARCH_DEFAULTS["DeepseekV2ForCausalLM"] = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "moe_intermediate_size": 1407,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": None,
    "topk_group": None,
    "topk_method": "greedy",
    "num_experts_per_tok": None,
    "first_k_dense_replace": 0,
    "norm_topk_prob": False,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_bias": False,
    "mlp_bias": False,
}
# Mixtral's config is Mistral's (the same sizes) with experts, no sliding window and its own eps / RoPE base
_ARCH_DEFAULTS["MixtralForCausalLM"] = dict(
    _ARCH_DEFAULTS["MistralForCausalLM"], model_type="mixtral", rms_norm_eps=1e-5, rope_theta=1_000_000.0,
    sliding_window=None, num_local_experts=8, num_experts_per_tok=2)
# architectures whose attention RMS-normalises every q and k head (weights [head_dim]) before RoPE
# the Gemma decoder (fastinfer.models.gemma): sandwich norms, (1 + weight) RMSNorm, GeGLU, scaled embeddings
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# the mixture-of-experts decoder (fastinfer.models.moe): the Llama-family layer with a routed-experts MLP
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                     "GptOssForCausalLM")
# the hybrid decoder (fastinfer.models.qwen3_5): Gated DeltaNet layers with a per-sequence state beside
# gated full-attention layers; the MoE variants route the MLP (HYBRID_MOE_ARCHITECTURES)
HYBRID_MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM",) + HYBRID_MOE_ARCHITECTURES
# the multi-head latent attention decoder (fastinfer.models.deepseek): low-rank q / kv projections, one
# latent per token in the cache, routed experts with shared experts after the first dense layers
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
#: (kv_lora_rank, qk_rope_head_dim) of the latent cache the MLA attention ops run
MLA_LATENT_DIMS = (512, 64)
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM") + HYBRID_ARCHITECTURES
# architectures whose attention RMS-normalises q and k over their whole projections (all heads together;
# weights [Hq * D] and [Hkv * D]) before RoPE
_QK_PROJECTION_NORM_ARCHITECTURES = ("OlmoeForCausalLM",)
# a multimodal checkpoint whose text model runs as the architecture named here (its text_config)
_TEXT_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                  "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                  "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_DEFAULTS) + tuple(_TEXT_MODEL_OF)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _token_ids(value: Any, what: str) -> List[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"{what} must be an int or a list of ints, got {value!r}")


@dataclass
class ModelConfig:
    """What the model and the engine need to know about a checkpoint (see :meth:`from_pretrained`).

    Attention details: ``qkv_bias`` / ``o_bias`` / ``mlp_bias`` say which projections carry a bias
    (Llama: ``attention_bias`` applies to q, k, v and o, ``mlp_bias`` to gate, up and down; Qwen2:
    q, k, v always biased, o never; Qwen3: ``attention_bias`` on q, k, v and o). ``qk_norm``: every
    query and key head is RMS-normalised over ``head_dim`` (``self_attn.q_norm`` / ``k_norm``
    weights) before RoPE (Qwen3); ``qk_projection_norm``: q and k are RMS-normalised over their
    whole projections instead, every head together (weights ``[Hq * D]`` / ``[Hkv * D]``, OLMoE).
    ``clip_qkv``: q, k (after those norms) and v are clamped to ``[-clip_qkv, clip_qkv]`` (OLMoE;
    None: off). ``sliding_window`` is the transformers value ``W`` (a query at
    position p sees keys ``j > p - W``, i.e. ``W`` keys including itself); ``layer_types[i]`` is
    ``"sliding_attention"`` or ``"full_attention"``; the op-level window for layer ``i`` is
    :meth:`window_left` (``W - 1``, or -1).

    ``rope_scaling`` is None (plain RoPE) or a dict with ``rope_type`` in
    ``linear/dynamic/llama3/yarn`` and that type's parameters, normalised (``original_max_position_
    embeddings`` filled in as transformers does). ``sliding_rope_theta`` / ``sliding_rope_scaling``:
    the RoPE of the sliding-window layers when it differs from the full-attention layers' (Gemma 3:
    ``rope_local_base_freq``, and rope scaling on the full-attention layers only); None: the same.

    Gemma: ``hidden_act`` ``"gelu_pytorch_tanh"`` (GeGLU MLP), ``query_pre_attn_scalar`` (attention
    scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``, see
    :attr:`attention_scale`), ``attn_logit_softcapping`` (attention scores ``c * tanh(s / c)``) and
    ``final_logit_softcapping`` (the same on the logits); None: off. ``text_weights_prefixes``: where
    the text model's ``model.*`` tensors sit in a multimodal checkpoint (tried in order), else empty.

    Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; ``num_experts`` 0 on dense models):
    ``num_experts`` experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them per
    token, softmax routing whose top-k weights are divided by their sum when ``moe_renormalize``
    (Mixtral always, the others' ``norm_topk_prob``); ``shared_expert_intermediate_size`` (Qwen2-MoE;
    0: none): every routed layer also runs a shared SwiGLU MLP of that width, its output scaled by
    ``sigmoid(shared_expert_gate(x))``; the layers in ``dense_mlp_layers`` have a dense MLP of width
    ``intermediate_size`` instead (:meth:`is_moe_layer`).

    DeepSeek (``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``, :attr:`is_mla`): the latent
    attention sizes ``q_lora_rank`` (None: no q LoRA), ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim`` (= ``head_dim``, what the rotary table spans, as transformers sets it),
    ``v_head_dim``, ``rope_interleave``; routing ``moe_scoring`` ``"sigmoid"`` (V3) or ``"softmax"``
    (V2), ``moe_grouping`` / ``moe_num_groups`` / ``moe_topk_groups``, ``moe_correction_bias`` and
    ``moe_routed_scaling_factor`` (see :func:`_parse_deepseek_moe`); the shared experts in
    ``shared_expert_intermediate_size`` (ungated), the first dense layers in ``dense_mlp_layers``.

    gpt-oss (``GptOssForCausalLM``): ``moe_scoring`` ``"topk_softmax"`` (the softmax of the top-k
    router logits), ``moe_activation`` ``"swiglu_oai"`` (its clamped SwiGLU with ``swiglu_alpha`` /
    ``swiglu_limit``), ``moe_bias`` (router and expert biases) and ``attention_sinks`` (one sink logit
    per query head).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_projection_norm: bool = False
    clip_qkv: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: List[str] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    eos_token_ids: List[int] = field(default_factory=list)
    pad_token_id: Optional[int] = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    sliding_rope_theta: Optional[float] = None
    sliding_rope_scaling: Optional[Dict[str, Any]] = None
    text_weights_prefixes: Tuple[str, ...] = ()
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate width
    moe_renormalize: bool = False  # the top-k routing weights divided by their sum
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_mlp_layers: List[int] = field(default_factory=list)  # layers of an MoE model with a dense MLP
    moe_scoring: str = "softmax"  # moe_topk's scoring: "softmax" over all experts, or "topk_softmax" (gpt-oss)
    moe_activation: str = "silu"  # fused_moe's activation: "silu", or "swiglu_oai" (gpt-oss)
    swiglu_alpha: Optional[float] = None  # "swiglu_oai"'s sigmoid gain and clamp limit
    swiglu_limit: Optional[float] = None
    moe_bias: bool = False  # the router and the experts' projections carry biases (gpt-oss)
    attention_sinks: bool = False  # a learned sink logit per query head (gpt-oss ``self_attn.sinks``)
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that RoPE rotates
    attn_output_gate: bool = False  # attention output * sigmoid(gate), the gate from q_proj (Qwen3.5)
    linear_num_key_heads: int = 0  # Gated DeltaNet layers (0: none)
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # multi-head latent attention (DeepSeek-V2 / V3; kv_lora_rank 0: none)
    q_lora_rank: Optional[int] = None  # None: q_proj directly (V2-Lite), else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dims rotate as interleaved pairs (DeepSeek), not halves
    # grouped routing (DeepSeek): the experts in moe_num_groups groups, a token's experts chosen in the
    # moe_topk_groups best groups ("top2_sum": a group's score is the sum of its best two, V3;
    # "max": its best one, V2's group_limited_greedy; None: no group limit)
    moe_grouping: Optional[str] = None
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    moe_correction_bias: bool = False  # e_score_correction_bias added to the scores for the choice only (V3)
    moe_routed_scaling_factor: float = 1.0  # the routed experts' weights times this
    torch_dtype: Optional[torch.dtype] = None  # the checkpoint's dtype ("dtype" / "torch_dtype")
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json dict as read

    # ------------------------------------------------------------------------------------------
    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head RoPE rotates: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are Gated DeltaNet (``layer_types`` ``"linear_attention"``): each
        sequence then needs a state slot beside its KV blocks."""
        return "linear_attention" in self.layer_types

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's short convolution (q, k and v together)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def is_mla(self) -> bool:
        """Whether the attention is multi-head latent attention (DeepSeek-V2 / V3)."""
        return self.kv_lora_rank > 0

    @property
    def attention_scale(self) -> float:
        """The factor of ``q . k``: ``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``;
        multi-head latent attention: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
        ``mscale ** 2`` with YaRN's ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when the
        rope parameters give a ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
        if self.is_mla:
            scale = float(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            s = self.rope_scaling or {}
            if s.get("mscale_all_dim"):
                factor = float(s["factor"])
                mscale = 1.0 if factor <= 1 else 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0
                scale = scale * mscale * mscale
            return scale
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(scalar) ** -0.5

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts (else the dense ``gate_up`` / ``down`` MLP)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and self.layer_types[layer] == "sliding_attention"

    def window_left(self, layer: int) -> int:
        """Op-level ``window_left`` of layer ``layer``: ``sliding_window - 1`` on a sliding layer
        (transformers' mask ``kv_idx > q_idx - sliding_window`` keeps ``sliding_window`` keys,
        the query's own included; the op's window ``[p - W, p]`` is inclusive), else -1."""
        if not self.is_sliding(layer):
            return -1
        return int(self.sliding_window) - 1

    @property
    def max_model_len(self) -> int:
        """Positions the RoPE table covers by default: ``max_position_embeddings``, times ``factor``
        for ``linear`` and ``dynamic`` scaling (whose Llama-family configs keep the original length
        there; ``llama3`` and ``yarn`` configs, and Gemma's, already state the extended length)."""
        n = int(self.max_position_embeddings)
        if self.rope_type in ("linear", "dynamic") and self.architecture not in GEMMA_ARCHITECTURES:
            n = int(n * float(self.rope_scaling["factor"]))
        return n

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read ``<path>/config.json`` (``path`` may also be the json file itself).

        When a ``generation_config.json`` sits next to it, its ``eos_token_id`` entries are
        appended to :attr:`eos_token_ids` (transformers' ``generate`` stops on those; e.g.
        Llama-3-Instruct lists ``<|eot_id|>`` only there).
        """
        cfg_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"no config.json found at {path!r}")
        with open(cfg_file, "r", encoding="utf-8") as f:
            d = json.load(f)
        gen_file = os.path.join(os.path.dirname(os.path.abspath(cfg_file)), "generation_config.json")
        gen_eos: List[int] = []
        if os.path.isfile(gen_file):
            try:
                with open(gen_file, "r", encoding="utf-8") as f:
                    gen_eos = _token_ids(json.load(f).get("eos_token_id"), "generation_config eos_token_id")
            except (OSError, json.JSONDecodeError):
                gen_eos = []
        conf = cls.from_dict(d)
        for t in gen_eos:
            if t not in conf.eos_token_ids:
                conf.eos_token_ids.append(t)
        return conf

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ModelConfig":
        """Build from a ``config.json`` dict (see the module docstring for defaults/errors)."""
        archs = d.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got architectures={archs!r}")
        arch = archs[0]
        if arch in _TEXT_MODEL_OF:
            return cls._text_model_of(d, arch)
        if arch not in _ARCH_DEFAULTS:
            raise ValueError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        defaults = dict(_COMMON_DEFAULTS, **_ARCH_DEFAULTS[arch])
        gemma = arch in GEMMA_ARCHITECTURES

        def get(key: str) -> Any:
            v = d.get(key, defaults.get(key))
            return defaults.get(key) if v is None and key in ("rms_norm_eps", "hidden_act", "hidden_activation") else v

        def get_positive(key: str, optional: bool = False) -> Optional[float]:
            v = get(key)
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"config field {key!r} must be a positive number{' or null' if optional else ''}, "
                                 f"got {v!r}")
            return float(v)

        def get_int(key: str, minimum: int = 1) -> int:
            v = get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                raise ValueError(f"config field {key!r} must be an int >= {minimum}, got {v!r}")
            return v

        if gemma:  # transformers' Gemma 2 / 3 read hidden_activation (a hidden_act key is ignored)
            hidden_act = get("hidden_activation")
            if hidden_act != "gelu_pytorch_tanh":
                raise ValueError(f"unsupported hidden_activation {hidden_act!r} for {arch} "
                                 "(only 'gelu_pytorch_tanh' is supported)")
            if get("use_bidirectional_attention"):
                raise ValueError(f"use_bidirectional_attention={get('use_bidirectional_attention')!r} is not "
                                 f"supported ({arch} runs causal attention only)")
        else:
            hidden_act = get("hidden_act")
            if hidden_act not in ("silu", "swish"):
                raise ValueError(f"unsupported hidden_act {hidden_act!r} (only 'silu' is supported)")
            hidden_act = "silu"

        hidden = get_int("hidden_size")
        heads = get_int("num_attention_heads")
        kv_heads = get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else kv_heads
        if arch in MLA_ARCHITECTURES:  # every head reads the one latent: the field plays no part
            kv_heads = heads
        if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads ({kv_heads!r}) must divide num_attention_heads ({heads})"
            )
        mla = arch in MLA_ARCHITECTURES
        # transformers' DeepSeek configs set head_dim to qk_rope_head_dim (what the rotary table spans)
        head_dim = get_int("qk_rope_head_dim") if mla else get("head_dim")
        if head_dim is None:
            if hidden % heads != 0:
                raise ValueError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
            head_dim = hidden // heads
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be an even int, got {head_dim!r}")
        if arch in _QK_PROJECTION_NORM_ARCHITECTURES and head_dim * heads != hidden:
            # transformers sizes these norms by hidden_size, the projections by head_dim
            raise ValueError(f"{arch} needs head_dim * num_attention_heads == hidden_size (its q/k norms span "
                             f"the whole projections), got head_dim={head_dim}, {heads} heads, hidden {hidden}")

        num_layers = get_int("num_hidden_layers")
        max_pos = get_int("max_position_embeddings")

        # --- biases ------------------------------------------------------------------------------
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif arch == "Qwen2MoeForCausalLM":
            qkv_bias, o_bias, mlp_bias = bool(get("qkv_bias")), False, False
        elif arch == "LlamaForCausalLM":
            qkv_bias = o_bias = bool(get("attention_bias"))
            mlp_bias = bool(get("mlp_bias"))
        elif mla:
            for key in ("attention_bias", "mlp_bias"):
                if get(key):
                    raise ValueError(f"{key}=True is not supported for {arch} (its projections run without biases)")
            qkv_bias = o_bias = mlp_bias = False
        elif arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "GptOssForCausalLM") \
                or arch in HYBRID_ARCHITECTURES or gemma:
            qkv_bias = o_bias = bool(get("attention_bias"))
            mlp_bias = False
        else:
            qkv_bias = o_bias = mlp_bias = False

        # --- sliding window ------------------------------------------------------------------------
        sliding_window: Optional[int] = None
        layer_types = ["full_attention"] * num_layers
        if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            sliding_window = get("sliding_window")
            if sliding_window is not None:
                layer_types = ["sliding_attention"] * num_layers
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            sliding_window = get("sliding_window") if get("use_sliding_window") else None
            lt = d.get("layer_types")
            if lt is not None:
                if not isinstance(lt, list) or len(lt) != num_layers or any(
                    t not in ("full_attention", "sliding_attention") for t in lt
                ):
                    raise ValueError(f"unsupported layer_types {lt!r}")
                layer_types = list(lt)
            elif sliding_window is not None:
                mwl = get("max_window_layers")
                layer_types = [
                    "sliding_attention" if i >= mwl else "full_attention" for i in range(num_layers)
                ]
            if sliding_window is None:
                # transformers builds no sliding mask then (sliding_window is None)
                layer_types = ["full_attention"] * num_layers
        elif arch == "Qwen3MoeForCausalLM":  # one mask for every layer: no max_window_layers here
            sliding_window = get("sliding_window") if get("use_sliding_window") else None
            if sliding_window is not None:
                layer_types = ["sliding_attention"] * num_layers
        elif arch == "Qwen2MoeForCausalLM":
            layer_types, sliding_window = _qwen2_moe_layer_types(d, num_layers, get, get_int)
        elif arch in HYBRID_ARCHITECTURES:
            layer_types = _hybrid_layer_types(d, num_layers, get_int("full_attention_interval"))
        elif arch == "GptOssForCausalLM":
            # transformers' GptOssConfig alternates as Gemma 2 does (even layers slide) unless listed
            layer_types = _gemma_layer_types(d, "Gemma2ForCausalLM", num_layers, None)
            if "sliding_attention" in layer_types:
                sliding_window = get("sliding_window")
                if sliding_window is None:
                    raise ValueError("sliding_window is null but layer_types has sliding_attention layers")
        elif gemma:
            layer_types = _gemma_layer_types(d, arch, num_layers, get("sliding_window_pattern"))
            if "sliding_attention" in layer_types:
                sliding_window = get("sliding_window")
                if sliding_window is None:
                    raise ValueError("sliding_window is null but layer_types has sliding_attention layers")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or null, got {sliding_window!r}")

        # --- rope ------------------------------------------------------------------------------------
        sliding_rope_theta = sliding_rope_scaling = None
        if arch == "Gemma3ForCausalLM":
            (rope_theta, rope_scaling), sliding_rope = _parse_gemma3_rope(d, max_pos, head_dim, defaults)
            if "sliding_attention" in layer_types and sliding_rope != (rope_theta, rope_scaling):
                sliding_rope_theta, sliding_rope_scaling = sliding_rope
        else:
            params = None
            if arch == "GptOssForCausalLM" and d.get("rope_parameters") is None and d.get("rope_scaling") is None:
                params = dict(defaults["rope_parameters"], rope_theta=d.get("rope_theta", defaults["rope_theta"]))
            rope_theta, rope_scaling = _parse_rope(d, max_pos, head_dim, params=params,
                                                   default_theta=float(defaults["rope_theta"]),
                                                   partial_rotary=arch in HYBRID_ARCHITECTURES)
        partial_rotary_factor = 1.0
        if arch in HYBRID_ARCHITECTURES:
            partial_rotary_factor = _partial_rotary_factor(d, head_dim, defaults["partial_rotary_factor"])

        # --- Gemma attention scale and soft-capping ----------------------------------------------------
        query_pre_attn_scalar = attn_softcap = final_softcap = None
        if gemma:
            query_pre_attn_scalar = get_positive("query_pre_attn_scalar")
            attn_softcap = get_positive("attn_logit_softcapping", optional=True)
            final_softcap = get_positive("final_logit_softcapping", optional=True)
            if arch == "Gemma3ForCausalLM" and attn_softcap is not None:
                # transformers' Gemma 3 attention never applies it, llama.cpp's converter refuses it:
                # which of the two a checkpoint means is unknowable
                raise ValueError(f"attn_logit_softcapping={attn_softcap} is not supported for {arch} "
                                 "(Gemma 3 has no attention soft-capping; transformers ignores the field)")

        routed = arch in MOE_ARCHITECTURES + HYBRID_MOE_ARCHITECTURES + MLA_ARCHITECTURES
        moe = _parse_moe(d, arch, num_layers, get, get_int) if routed else {}
        latent = _parse_latent_attention(arch, get, get_int) if mla else {}
        linear = _parse_linear_attention(get_int) if arch in HYBRID_ARCHITECTURES else {}
        clip_qkv = get_positive("clip_qkv", optional=True) if arch == "OlmoeForCausalLM" else None

        if arch == "Qwen3_5MoeForCausalLM":
            # no dense MLP (every layer routed, transformers' config has no intermediate_size): the
            # shared expert is the widest dense GEMM, what the activation estimate sizes
            intermediate_size = moe["shared_expert_intermediate_size"]
        else:
            intermediate_size = get_int("intermediate_size")

        # --- tokens / dtype --------------------------------------------------------------------------
        eos = _token_ids(get("eos_token_id"), "eos_token_id")
        bos = get("bos_token_id")
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        dtype_name = d.get("dtype", d.get("torch_dtype"))
        torch_dtype = None
        if dtype_name is not None:
            name = str(dtype_name).replace("torch.", "")
            if name not in _DTYPES:
                raise ValueError(f"unsupported dtype {dtype_name!r} in config.json")
            torch_dtype = _DTYPES[name]

        return cls(
            architecture=arch,
            model_type=d.get("model_type", defaults["model_type"]),
            vocab_size=get_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            qk_projection_norm=arch in _QK_PROJECTION_NORM_ARCHITECTURES,
            clip_qkv=clip_qkv,
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=hidden_act,
            query_pre_attn_scalar=query_pre_attn_scalar,
            attn_logit_softcapping=attn_softcap,
            final_logit_softcapping=final_softcap,
            sliding_rope_theta=sliding_rope_theta,
            sliding_rope_scaling=sliding_rope_scaling,
            bos_token_id=bos,
            eos_token_ids=eos,
            pad_token_id=get("pad_token_id"),
            torch_dtype=torch_dtype,
            raw=d,
            partial_rotary_factor=partial_rotary_factor,
            attn_output_gate=arch in HYBRID_ARCHITECTURES,
            attention_sinks=arch == "GptOssForCausalLM",
            **moe,
            **linear,
            **latent,
        )

    @classmethod
    def _text_model_of(cls, d: Dict[str, Any], arch: str) -> "ModelConfig":
        """The text model of a multimodal checkpoint (its ``text_config``; the vision tower and the
        projector are not run, their tensors are skipped when loading)."""
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{arch} config.json has no text_config dict (got {text!r})")
        td = dict(text, architectures=[_TEXT_MODEL_OF[arch]])
        for key in ("quantization_config", "dtype", "torch_dtype"):  # stated for the whole checkpoint
            if key in d and key not in td:
                td[key] = d[key]
        conf = cls.from_dict(td)
        # transformers 5 nests the text model under model.language_model, 4.x under language_model.model
        conf.text_weights_prefixes = ("model.language_model.", "language_model.model.")
        return conf


_LAYER_TYPES = ("full_attention", "sliding_attention")
_HYBRID_LAYER_TYPES = ("full_attention", "linear_attention")


# the config keys naming the number of experts, per architecture: the field, then the alias its
# transformers config class maps onto it (attribute_map)
_EXPERT_COUNT_NAMES = {
    "MixtralForCausalLM": ("num_local_experts", "num_experts"),
    "GptOssForCausalLM": ("num_local_experts", "num_experts"),
    "Qwen2MoeForCausalLM": ("num_experts",),
    "Qwen3MoeForCausalLM": ("num_experts", "num_local_experts"),
    "OlmoeForCausalLM": ("num_experts", "num_local_experts"),
    "Qwen3_5MoeForCausalLM": ("num_experts",),
    "Qwen3NextForCausalLM": ("num_experts",),
    "DeepseekV3ForCausalLM": ("n_routed_experts", "num_local_experts"),
    "DeepseekV2ForCausalLM": ("n_routed_experts", "num_experts"),
}


def _parse_moe(d: Dict[str, Any], arch: str, num_layers: int, get, get_int) -> Dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / Qwen3.5-MoE /
    Qwen3-Next config, as
    transformers reads them. The number of experts: :data:`_EXPERT_COUNT_NAMES`. Mixtral: every layer
    routed, experts of width ``intermediate_size``, weights always renormalised. The others: weights
    renormalised when ``norm_topk_prob``; OLMoE: every layer routed, experts of width
    ``intermediate_size``; Qwen2-MoE / Qwen3-MoE: experts of width ``moe_intermediate_size``, layer
    ``i`` routed unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then
    a dense MLP of width ``intermediate_size``), Qwen3-Next alike; Qwen3.5-MoE: every layer routed
    (experts ``moe_intermediate_size`` wide), the weights always renormalised. Qwen2-MoE's,
    Qwen3.5-MoE's and Qwen3-Next's routed layers add a shared expert of width
    ``shared_expert_intermediate_size``."""
    names = _EXPERT_COUNT_NAMES[arch]
    key = next((k for k in names if k in d), names[0])
    num_experts = get(key)
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"config field {key!r} must be an int >= 1, got {num_experts!r} "
                         f"({arch} without experts is not supported)")
    shared = 0
    gpt_oss: Dict[str, Any] = {}
    if arch == "MixtralForCausalLM":
        width, renormalize, dense_layers = get_int("intermediate_size"), True, []
    elif arch == "GptOssForCausalLM":
        width, renormalize, dense_layers = get_int("intermediate_size"), False, []
        gpt_oss = dict(moe_scoring="topk_softmax", moe_activation="swiglu_oai", moe_bias=True)
        for key in ("swiglu_alpha", "swiglu_limit"):
            v = get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"config field {key!r} must be a positive number, got {v!r}")
            gpt_oss[key] = float(v)
    elif arch in MLA_ARCHITECTURES:
        return _parse_deepseek_moe(arch, num_experts, num_layers, get, get_int)
    elif arch == "Qwen3_5MoeForCausalLM":
        # transformers' Qwen3_5MoeTopKRouter always renormalises, and every layer is routed
        width, renormalize, dense_layers = get_int("moe_intermediate_size"), True, []
        shared = get_int("shared_expert_intermediate_size")
    else:
        renormalize = bool(get("norm_topk_prob"))
        if arch == "OlmoeForCausalLM":
            width, dense_layers = get_int("intermediate_size"), []
        else:
            width = get_int("moe_intermediate_size")
            step = get_int("decoder_sparse_step")
            only = get("mlp_only_layers") or []
            if not isinstance(only, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in only):
                raise ValueError(f"config field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
            dense_layers = [i for i in range(num_layers) if i in only or (i + 1) % step]
        if arch in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
            shared = get_int("shared_expert_intermediate_size")
    top_k = get_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) is larger than the number of experts ({num_experts})")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                moe_renormalize=renormalize, dense_mlp_layers=dense_layers,
                shared_expert_intermediate_size=shared, **gpt_oss)


def _parse_deepseek_moe(arch: str, num_experts: int, num_layers: int, get, get_int) -> Dict[str, Any]:
    """The routed experts of a DeepSeek-V3 / V2 config, as transformers' ``DeepseekV3TopkRouter`` /
    ``DeepseekV2TopkRouter`` run them. Layers ``[0, first_k_dense_replace)`` have a dense MLP of width
    ``intermediate_size``; the others ``n_routed_experts`` experts of width ``moe_intermediate_size``,
    ``num_experts_per_tok`` per token, plus ``n_shared_experts`` shared experts run as one ungated MLP
    of width ``n_shared_experts * moe_intermediate_size``. The chosen experts' weights are multiplied
    by ``routed_scaling_factor``.

    - V3: sigmoid scores; the choice adds ``e_score_correction_bias`` to them, keeps the
      ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its best two) and takes
      the top-k there; the weights are the chosen experts' scores without the bias, divided by their
      sum when ``norm_topk_prob``.
    - V2: softmax scores; ``topk_method`` ``"greedy"`` takes the top-k of all experts,
      ``"group_limited_greedy"`` the top-k of the ``topk_group`` best groups (a group's score: its
      best expert's). Never renormalised (transformers' V2 router reads no ``norm_topk_prob``)."""
    top_k = get_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) is larger than the number of experts ({num_experts})")
    first_dense = get_int("first_k_dense_replace", minimum=0)
    shared = get_int("n_shared_experts", minimum=0) * get_int("moe_intermediate_size")
    factor = get("routed_scaling_factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"config field 'routed_scaling_factor' must be a positive number, got {factor!r}")
    out = dict(num_experts=num_experts, num_experts_per_tok=top_k,
               moe_intermediate_size=get_int("moe_intermediate_size"),
               dense_mlp_layers=list(range(min(first_dense, num_layers))), shared_expert_intermediate_size=shared,
               moe_routed_scaling_factor=float(factor))
    if arch == "DeepseekV3ForCausalLM":
        grouping, scoring, renormalize, bias = "top2_sum", "sigmoid", bool(get("norm_topk_prob")), True
    else:
        method = get("topk_method")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {method!r} for {arch} (transformers' DeepseekV2TopkRouter runs "
                             "'greedy' and 'group_limited_greedy')")
        grouping = None if method == "greedy" else "max"
        scoring, renormalize, bias = "softmax", False, False
    groups = topk_groups = 1
    if grouping is not None:
        groups, topk_groups = get_int("n_group"), get_int("topk_group")
        if num_experts % groups:
            raise ValueError(f"n_group ({groups}) must divide the number of experts ({num_experts})")
        if topk_groups > groups:
            raise ValueError(f"topk_group ({topk_groups}) is larger than n_group ({groups})")
        per_group = num_experts // groups
        if grouping == "top2_sum" and per_group < 2:
            raise ValueError(f"{arch} scores a group by its best two experts: n_group ({groups}) leaves "
                             f"{per_group} expert per group")
        if top_k > topk_groups * per_group:
            raise ValueError(f"num_experts_per_tok ({top_k}) is larger than the experts of the topk_group "
                             f"({topk_groups}) groups chosen ({topk_groups * per_group})")
    return dict(out, moe_renormalize=renormalize, moe_scoring=scoring, moe_grouping=grouping, moe_num_groups=groups,
                moe_topk_groups=topk_groups, moe_correction_bias=bias)


def _parse_latent_attention(arch: str, get, get_int) -> Dict[str, Any]:
    """The multi-head latent attention sizes of a DeepSeek config. The latent cache holds
    ``kv_lora_rank + qk_rope_head_dim`` values per token; the MLA attention ops run 512 + 64."""
    q_lora = get("q_lora_rank")
    if q_lora is not None:
        q_lora = get_int("q_lora_rank")
    out = dict(q_lora_rank=q_lora, kv_lora_rank=get_int("kv_lora_rank"), qk_nope_head_dim=get_int("qk_nope_head_dim"),
               qk_rope_head_dim=get_int("qk_rope_head_dim"), v_head_dim=get_int("v_head_dim"),
               # V2 rotates interleaved pairs always (as complex numbers), V3 when rope_interleave
               rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(get("rope_interleave")))
    if (out["kv_lora_rank"], out["qk_rope_head_dim"]) != MLA_LATENT_DIMS:
        raise ValueError(f"unsupported kv_lora_rank {out['kv_lora_rank']} / qk_rope_head_dim {out['qk_rope_head_dim']} "
                         f"(the MLA attention ops run a latent of {MLA_LATENT_DIMS[0]} + {MLA_LATENT_DIMS[1]})")
    return out


def _qwen2_moe_layer_types(d: Dict[str, Any], num_layers: int, get, get_int) -> Tuple[List[str], Optional[int]]:
    """``(layer_types, sliding_window)`` as transformers' ``Qwen2MoeConfig`` fills them: the stated
    ``layer_types``, else, with ``use_sliding_window``, sliding attention on the even layers below
    ``max_window_layers`` (``(i + 1) % 2 and i < max_window_layers``); ``sliding_window`` None when
    no layer slides. Without ``use_sliding_window`` its window is 0 (no key visible): a sliding
    layer is then refused."""
    use_sliding = bool(get("use_sliding_window"))
    lt = d.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != num_layers or any(t not in _LAYER_TYPES for t in lt):
            raise ValueError(f"unsupported layer_types {lt!r} (want {num_layers} of {', '.join(_LAYER_TYPES)})")
        layer_types = list(lt)
    elif use_sliding:
        window_layers = get_int("max_window_layers", minimum=0)
        layer_types = ["sliding_attention" if (i + 1) % 2 and i < window_layers else "full_attention"
                       for i in range(num_layers)]
    else:
        layer_types = ["full_attention"] * num_layers
    if "sliding_attention" not in layer_types:
        return layer_types, None
    if not use_sliding:
        raise ValueError("layer_types has sliding_attention layers but use_sliding_window is false (transformers' "
                         "Qwen2-MoE window is then 0, which leaves a query no key)")
    sliding_window = get("sliding_window")
    if sliding_window is None:
        raise ValueError("sliding_window is null but layer_types has sliding_attention layers")
    return layer_types, sliding_window


def _gemma_layer_types(d: Dict[str, Any], arch: str, num_layers: int, pattern: Any) -> List[str]:
    """``layer_types`` as transformers' Gemma configs fill it: the stated list, else Gemma 2 alternates
    (even layers sliding), Gemma 3 makes every ``sliding_window_pattern``-th layer full attention."""
    lt = d.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != num_layers or any(t not in _LAYER_TYPES for t in lt):
            raise ValueError(f"unsupported layer_types {lt!r} (want {num_layers} of {', '.join(_LAYER_TYPES)})")
        return list(lt)
    if arch == "Gemma2ForCausalLM":
        pattern = 2
    elif isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"config field 'sliding_window_pattern' must be an int >= 1, got {pattern!r}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _parse_gemma3_rope(d: Dict[str, Any], max_pos: int, head_dim: int, defaults: Dict[str, Any]):
    """``((theta, scaling) of the full-attention layers, (theta, scaling) of the sliding ones)`` of a
    Gemma 3 config, as transformers' ``Gemma3TextConfig`` reads them: ``rope_parameters`` nested by
    layer type (transformers 5), or ``rope_theta`` + ``rope_scaling`` (full-attention layers only) +
    ``rope_local_base_freq`` (the sliding layers' base) (transformers 4)."""
    params = d.get("rope_parameters")
    global_theta = d.get("rope_theta", defaults["rope_theta"])
    local_theta = d.get("rope_local_base_freq", defaults["rope_local_base_freq"])
    if params is not None:
        if not isinstance(params, dict) or not set(params) <= set(_LAYER_TYPES) or not all(
                isinstance(v, dict) or v is None for v in params.values()):
            raise ValueError(f"unsupported rope_parameters {params!r} for Gemma 3 (want a dict per layer type: "
                             f"{', '.join(_LAYER_TYPES)})")
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or {})
        sliding = {}
    full.setdefault("rope_theta", global_theta)
    sliding.setdefault("rope_theta", local_theta)
    return (_parse_rope(d, max_pos, head_dim, params=full, default_theta=float(defaults["rope_theta"])),
            _parse_rope(d, max_pos, head_dim, params=sliding, default_theta=float(defaults["rope_local_base_freq"])))


def _hybrid_layer_types(d: Dict[str, Any], num_layers: int, interval: int) -> List[str]:
    """``layer_types`` of a hybrid model as transformers' ``Qwen3_5TextConfig`` fills it: the stated
    list, else every ``full_attention_interval``-th layer full attention, the others linear."""
    lt = d.get("layer_types")
    if lt is None:
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(lt, list) or len(lt) != num_layers or any(t not in _HYBRID_LAYER_TYPES for t in lt):
        raise ValueError(f"unsupported layer_types {lt!r} (want {num_layers} of {', '.join(_HYBRID_LAYER_TYPES)})")
    return list(lt)


def _partial_rotary_factor(d: Dict[str, Any], head_dim: int, default: float) -> float:
    """The rotated fraction of each head (``rope_parameters`` or top level; the transformers default
    else); ``head_dim * factor`` must be a positive even number of dims."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    v = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default))
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {v!r}")
    dim = int(head_dim * v)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor {v} of head_dim {head_dim} rotates {dim} dims (want an even "
                         "number >= 2)")
    return float(v)


# the Gated DeltaNet sizes the ops take (head dims 64 or 128, a convolution 2 to 4 wide)
_LINEAR_HEAD_DIMS = (64, 128)


def _parse_linear_attention(get_int) -> Dict[str, Any]:
    """The Gated DeltaNet layers' sizes (``linear_*`` keys), checked against what the ops run."""
    out = {k: get_int(k) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                   "linear_value_head_dim", "linear_conv_kernel_dim")}
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise ValueError(f"linear_num_value_heads ({out['linear_num_value_heads']}) must be a multiple of "
                         f"linear_num_key_heads ({out['linear_num_key_heads']})")
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        if out[key] not in _LINEAR_HEAD_DIMS:
            raise ValueError(f"unsupported {key} {out[key]} (the gated_delta_rule op runs 64 or 128)")
    if not 2 <= out["linear_conv_kernel_dim"] <= 4:
        raise ValueError(f"unsupported linear_conv_kernel_dim {out['linear_conv_kernel_dim']} (the causal_conv1d "
                         "op runs widths 2 to 4)")
    return out


def _parse_rope(d: Dict[str, Any], max_pos: int, head_dim: int, params: Optional[Dict[str, Any]] = None,
                default_theta: float = _COMMON_DEFAULTS["rope_theta"], partial_rotary: bool = False):
    """Return ``(rope_theta, rope_scaling)`` from the transformers 4 form (``rope_theta`` +
    ``rope_scaling``) or the transformers 5 form (``rope_parameters``); ``params``: that dict
    already picked (one layer type's). ``partial_rotary``: a ``partial_rotary_factor`` is allowed
    (:func:`_partial_rotary_factor` reads it)."""
    if params is None:
        params = d.get("rope_parameters")
        if params is None:
            params = d.get("rope_scaling")
    if params and not isinstance(params, dict):
        raise ValueError(f"unsupported rope_parameters {params!r}")
    params = dict(params) if params else {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"unsupported per-layer-type rope_parameters {sorted(params)!r}")
    theta = params.get("rope_theta", d.get("rope_theta", default_theta))
    if theta is None:
        theta = default_theta
    theta = float(theta)
    if not theta > 1.0:
        raise ValueError(f"rope_theta must be > 1, got {theta}")
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0 and not partial_rotary:
        raise ValueError(f"unsupported partial_rotary_factor {prf!r} (Llama-family models rotate the whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None

    s: Dict[str, Any] = {"rope_type": rope_type}

    def num(key: str, default: Any = "required", minimum: Optional[float] = None) -> Any:
        v = params.get(key)
        if v is None:
            if default == "required":
                raise ValueError(f"rope type {rope_type!r} needs {key!r} in rope_parameters / rope_scaling")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"rope_parameters {key!r} must be a number, got {v!r}")
        if minimum is not None and v < minimum:
            raise ValueError(f"rope_parameters {key!r} must be >= {minimum}, got {v!r}")
        return float(v)

    if rope_type in ("linear", "dynamic"):
        s["factor"] = num("factor", minimum=1.0)
    if rope_type in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings wins, else the dict's value,
        # else max_position_embeddings
        omp = d.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))
        if not isinstance(omp, int) or omp < 1:
            raise ValueError(f"original_max_position_embeddings must be a positive int, got {omp!r}")
        s["original_max_position_embeddings"] = omp
    if rope_type == "llama3":
        s["factor"] = num("factor", minimum=1.0)
        s["low_freq_factor"] = num("low_freq_factor")
        s["high_freq_factor"] = num("high_freq_factor")
        if not s["high_freq_factor"] > s["low_freq_factor"]:
            raise ValueError("rope llama3: high_freq_factor must be > low_freq_factor")
    if rope_type == "yarn":
        factor = num("factor", default=None)
        if factor is None:
            factor = max_pos / s["original_max_position_embeddings"]
        s["factor"] = float(factor)
        s["attention_factor"] = num("attention_factor", default=None)
        s["mscale"] = num("mscale", default=None)
        s["mscale_all_dim"] = num("mscale_all_dim", default=None)
        s["beta_fast"] = num("beta_fast", default=None)
        s["beta_slow"] = num("beta_slow", default=None)
        s["truncate"] = bool(params.get("truncate", True))
    return theta, s
