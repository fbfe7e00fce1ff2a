"""Model side of the runner: config parsing, RoPE tables, the Llama-family decoder (Llama, Mistral,
Qwen2, Qwen3), the Gemma one (Gemma 2, Gemma 3) and the mixture-of-experts one (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, gpt-oss), the hybrid Qwen3.5 one (Gated DeltaNet + gated attention), the
multi-head latent attention one (DeepSeek-V2 / V3, Kimi K2) built from :mod:`fastinfer.layers`, and
loading a checkpoint (safetensors or GGUF) into them.

The engine talks to a model through :class:`~fastinfer.layers.ForwardBatch` (built with
:class:`~fastinfer.layers.BatchBuilder`) and ``model(batch, kv_caches) -> float32 logits
[len(batch.logits_indices), vocab]`` (``hidden_states`` / ``compute_logits`` for the two halves).
"""

from ..layers import BatchBuilder, ForwardBatch  # noqa: F401  (the model's input, re-exported)
from .config import (  # noqa: F401
    GEMMA_ARCHITECTURES,
    HYBRID_ARCHITECTURES,
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
)
from .llama import PACKED_MODULES, LlamaForCausalLM  # noqa: F401
from .gemma import GemmaForCausalLM  # noqa: F401
from .moe import MoeForCausalLM  # noqa: F401
from .gpt_oss import GptOssForCausalLM  # noqa: F401
from .qwen3_5 import Qwen3_5ForCausalLM  # noqa: F401
from .deepseek import DeepseekForCausalLM  # noqa: F401
from .gguf import GGUFWeightReader, find_gguf, gguf_model_config, open_gguf  # noqa: F401
from .loader import (  # noqa: F401
    checkpoint_reader,
    default_dtype,
    load_config,
    load_model,
    model_class,
    random_weights,
)
from .rope import build_cos_sin_cache, compute_inv_freq  # noqa: F401

__all__ = [
    "BatchBuilder",
    "ForwardBatch",
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "GEMMA_ARCHITECTURES",
    "MOE_ARCHITECTURES",
    "LlamaForCausalLM",
    "GemmaForCausalLM",
    "MoeForCausalLM",
    "GptOssForCausalLM",
    "Qwen3_5ForCausalLM",
    "DeepseekForCausalLM",
    "HYBRID_ARCHITECTURES",
    "MLA_ARCHITECTURES",
    "model_class",
    "PACKED_MODULES",
    "load_model",
    "load_config",
    "checkpoint_reader",
    "GGUFWeightReader",
    "find_gguf",
    "gguf_model_config",
    "open_gguf",
    "default_dtype",
    "random_weights",
    "build_cos_sin_cache",
    "compute_inv_freq",
]
