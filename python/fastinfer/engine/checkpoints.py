"""Loading a checkpoint path into a model, its quantisation resolved: what the runner does for the
target and the speculative registry's loader for a draft model (this module imports no config, so
the config may import the registry)."""

from __future__ import annotations

from ..distributed import SINGLE, ParallelInfo
from ..models import LlamaForCausalLM, load_config, load_model
from ..ops import Backend
from ..quant import resolve_quantization

__all__ = ["load_checkpoint"]


def load_checkpoint(path: str, dtype, device, max_positions, ops: Backend, quantization=None,
                    progress: bool = False, tp: ParallelInfo = SINGLE) -> LlamaForCausalLM:
    """Build and load checkpoint ``path`` (its quantisation resolved) on the op backend ``ops``,
    this rank's shard under TP."""
    cfg = load_config(path)  # a Hugging Face directory or a GGUF file
    qc = resolve_quantization(cfg, quantization, path)
    return load_model(path, dtype=dtype, device=device, progress=progress,
                      max_positions=cfg.max_model_len if max_positions is None else max_positions,
                      config=cfg, quant_config=qc, ops=ops, tp=tp)
