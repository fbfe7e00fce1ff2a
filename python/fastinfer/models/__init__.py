"""Model side of the runner: config parsing, RoPE tables, the safetensors loader and the
Llama-family decoder (Llama, Mistral, Qwen2) running on ``torch.ops.fastinfer.*``.

The engine talks to a model through :class:`ForwardBatch` (``batch.py``) and
``model(batch, kv_caches) -> float32 logits [len(batch.logits_indices), vocab]``.
"""

from .batch import ForwardBatch  # noqa: F401
from .config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig  # noqa: F401
from .llama import LlamaForCausalLM, make_forward_batch, prefill_logits  # noqa: F401
from .loader import checkpoint_files, load_model, load_weights  # noqa: F401
from .rope import build_cos_sin_cache, compute_inv_freq  # noqa: F401

__all__ = [
    "ForwardBatch",
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "LlamaForCausalLM",
    "make_forward_batch",
    "prefill_logits",
    "load_model",
    "load_weights",
    "checkpoint_files",
    "build_cos_sin_cache",
    "compute_inv_freq",
]
