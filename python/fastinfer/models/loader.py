"""Build a model (Llama family, Gemma, mixture of experts or Qwen3.5, :func:`model_class`) and load a checkpoint into it
(safetensors or GGUF).

* Sources: a checkpoint directory (``model.safetensors`` or an index + shards, memory-mapped: peak
  host memory stays around one tensor), a GGUF file or a directory holding one (:mod:`.gguf`:
  dequantised to float while loading), or any :class:`~fastinfer.layers.WeightReader` (tensors in
  memory). Pickle checkpoints (``*.bin``, ``*.pt``) are refused. :func:`load_config` reads the
  config of either kind of path.
* Every layer reads its own tensors by checkpoint name (``model.layers.{i}.self_attn.q_proj.weight``
  ...); fused layers read their parts (:data:`~fastinfer.models.llama.PACKED_MODULES`). A
  ``quant_config`` (:mod:`fastinfer.quant`) gives each linear its method: quantised checkpoints,
  or float ones quantised while loading; it never allocates the float linears it replaces.
* Tied embeddings (``tie_word_embeddings``): ``lm_head`` IS ``embed_tokens`` (an ``lm_head.weight``
  in the file is then ignored, as in transformers). Untied: ``lm_head.weight`` is required.
* Errors (``ValueError`` naming the tensor): a missing tensor, an unexpected tensor (rotary
  ``inv_freq`` buffers are ignored), a shape mismatch, a non-float tensor where a float one
  belongs, a tensor listed in the index but absent from its shard.
"""

from __future__ import annotations

from typing import Dict, Optional, Type, Union

import torch

from ..distributed import SINGLE, ParallelInfo
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..layers import QuantizationConfig, SafetensorsReader, WeightReader
from ..ops import Backend
from .config import GEMMA_ARCHITECTURES, HYBRID_ARCHITECTURES, MLA_ARCHITECTURES, MOE_ARCHITECTURES, ModelConfig
from .deepseek import DeepseekForCausalLM
from .gemma import GemmaForCausalLM
from .gguf import GGUFWeightReader, find_gguf, gguf_model_config
from .llama import LlamaForCausalLM
from .gpt_oss import GptOssForCausalLM
from .moe import MoeForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM

__all__ = ["load_model", "load_config", "checkpoint_reader", "default_dtype", "random_weights", "model_class"]

Tensor = torch.Tensor


def model_class(config: ModelConfig) -> Type[LlamaForCausalLM]:
    """The model class that runs ``config``: :class:`GemmaForCausalLM` for Gemma 2 / 3,
    :class:`MoeForCausalLM` for Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE, :class:`GptOssForCausalLM` for
    gpt-oss, :class:`Qwen3_5ForCausalLM`
    for Qwen3.5, :class:`DeepseekForCausalLM` for DeepSeek-V2 / V3, else :class:`LlamaForCausalLM` (all
    take the same constructor arguments)."""
    if config.architecture in MLA_ARCHITECTURES:
        return DeepseekForCausalLM
    if config.architecture in GEMMA_ARCHITECTURES:
        return GemmaForCausalLM
    if config.architecture in HYBRID_ARCHITECTURES:
        return Qwen3_5ForCausalLM
    if config.architecture == "GptOssForCausalLM":
        return GptOssForCausalLM
    return MoeForCausalLM if config.architecture in MOE_ARCHITECTURES else LlamaForCausalLM


def default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype ``"auto"`` means (the rule :class:`~fastinfer.engine.config.EngineConfig`'s
    ``dtype`` option states): on a CPU bfloat16 where it computes bfloat16 natively
    (:func:`fastinfer.cpu_has_native_bf16`), else float32; on a GPU the checkpoint's
    float16 / bfloat16, else bfloat16."""
    if device.type == "cpu":
        from .. import cpu_has_native_bf16  # looked up per call: tests pin it

        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if config.torch_dtype in (torch.float16, torch.bfloat16):
        return config.torch_dtype
    return torch.bfloat16


def load_config(path: str) -> ModelConfig:
    """The config of checkpoint ``path``: a Hugging Face directory (``config.json``) or a GGUF
    file / a directory holding one (its metadata)."""
    gguf_file = find_gguf(path)
    return gguf_model_config(gguf_file) if gguf_file else ModelConfig.from_pretrained(path)


def checkpoint_reader(path: str, config: Optional[ModelConfig] = None) -> WeightReader:
    """The :class:`~fastinfer.layers.WeightReader` of checkpoint ``path`` (see :func:`load_config`)."""
    gguf_file = find_gguf(path)
    return GGUFWeightReader(gguf_file, config) if gguf_file else SafetensorsReader(path)


def load_model(
    source: Union[str, WeightReader],
    dtype: Optional[torch.dtype] = None,
    device=None,
    progress: bool = False,
    max_positions: Optional[int] = None,
    config: Optional[ModelConfig] = None,
    quant_config: Optional[QuantizationConfig] = None,
    ops: Optional[Backend] = None,
    tp: ParallelInfo = SINGLE,
    stage: PipelineStage = WHOLE_MODEL,
) -> LlamaForCausalLM:
    """Build the model of checkpoint ``source`` (a directory, a GGUF file, or a reader with
    ``config`` given) and load its weights. ``dtype`` defaults to :func:`default_dtype`, ``device``
    to the CPU. ``ops``: the op backend every layer calls (:func:`fastinfer.ops.backend`: its
    library and its mode, e.g. ``backend("fastinfer", deterministic=True)``; default: the compiled
    ops, default mode). ``tp``: build and load this rank's shard only; ``stage``: the layers of this
    pipeline stage only."""
    if isinstance(source, str):
        config = load_config(source) if config is None else config
        reader: WeightReader = checkpoint_reader(source, config)
    else:
        if config is None:
            raise ValueError("load_model from a reader needs its config")
        reader = source
    device = torch.device("cpu" if device is None else device)
    dtype = default_dtype(config, device) if dtype is None else dtype
    model = model_class(config)(config, dtype=dtype, device=device, max_positions=max_positions,
                                ops=ops, quant_config=quant_config, tp=tp, stage=stage)
    model.load_weights(reader, progress=progress)
    return model.eval()


@torch.no_grad()
def random_weights(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> Dict[str, Tensor]:
    """Checkpoint tensors of ``config``'s shape with random values (N(0, 0.02), norms = 1), by
    checkpoint name: benchmark models of real shapes without downloading weights."""
    shell = model_class(config)(config, dtype=dtype, device="meta")
    g = torch.Generator(device=device).manual_seed(seed)
    out: Dict[str, Tensor] = {}
    for name, t in shell.checkpoint_tensors():
        x = torch.empty(t.shape, dtype=dtype, device=device)
        if "norm" in name:  # a unit scale: zero-centred norms (Gemma, Qwen3.5) hold weight - 1
            zero_centred = config.architecture in GEMMA_ARCHITECTURES + HYBRID_ARCHITECTURES
            x.fill_(0.0 if zero_centred and "linear_attn.norm" not in name else 1.0)
        else:
            x.normal_(0.0, 0.02, generator=g)
        out[name] = x
    return out
