"""Loading a checkpoint path into a model, its quantisation resolved: what the runner does for the
target and the draft-model loader (:mod:`.speculative.build`) for a draft model."""

from __future__ import annotations

import logging
import os

from ..distributed import SINGLE, ParallelInfo
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..models import LlamaForCausalLM, load_config, load_model
from ..ops import Backend
from ..quant import GgufQuantization, resolve_quantization

logger = logging.getLogger("fastinfer")

__all__ = ["load_checkpoint"]


def load_checkpoint(path: str, dtype, device, max_positions, ops: Backend, quantization=None,
                    progress: bool = False, tp: ParallelInfo = SINGLE, gguf_weights: str = "auto",
                    stage: PipelineStage = WHOLE_MODEL, fp4_weights: str = "stored") -> LlamaForCausalLM:
    """Build and load checkpoint ``path`` (its quantisation resolved; a GGUF file's weights as
    ``gguf_weights`` says, FP4 weights as ``fp4_weights`` does) on the op backend ``ops``, this
    rank's shard under TP, this stage's layers under pipeline parallelism."""
    cfg = load_config(path)  # a Hugging Face directory or a GGUF file
    qc = resolve_quantization(cfg, quantization, path, gguf_weights, fp4_weights)
    model = load_model(path, dtype=dtype, device=device, progress=progress,
                       max_positions=cfg.max_model_len if max_positions is None else max_positions,
                       config=cfg, quant_config=qc, ops=ops, tp=tp, stage=stage)
    if isinstance(qc, GgufQuantization) and qc.dequantized_types and tp.rank == 0:
        logger.warning("%s: GGUF tensors of type %s run dequantised to %s (no kernel for them yet)",
                       os.path.basename(path), ", ".join(sorted(qc.dequantized_types)), str(dtype).replace("torch.", ""))
    return model
