"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE) on the Llama-family building blocks.

The layer is Llama's (:mod:`.llama`: attention, norms, RoPE; Qwen3-MoE's per-head q/k norms as
Qwen3's) with the MLP replaced, on the layers :meth:`ModelConfig.is_moe_layer` names, by a
:class:`~fastinfer.layers.FusedMoE`::

    w, ids = moe_topk(x @ W_router^T, top_k, renormalize)   # softmax over the experts in fp32
    x = fused_moe(x, w13, w2, w, ids, "silu")               # sum of the k experts' SwiGLU MLPs

Mixtral routes every layer and always renormalises the top-k weights; Qwen3-MoE renormalises when
``norm_topk_prob`` and keeps a dense MLP on its ``mlp_only_layers`` and the layers that
``decoder_sparse_step`` skips. Checkpoint names: Mixtral's ``block_sparse_moe.gate`` /
``experts.{e}.w1 / w3 / w2`` and Qwen's ``mlp.gate`` / ``experts.{e}.gate_proj / up_proj /
down_proj``, or the stacked tensors transformers 5's modules hold (``mlp.experts.gate_up_proj``,
:class:`~fastinfer.layers.StackedExpertsReader`).

Tensor parallelism: attention and the dense MLPs as Llama's; each expert's intermediate dimension
split over the ranks, one all-reduce after the experts. The experts are never quantised (a
quantisation config is refused).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..distributed import SINGLE, ParallelInfo
from ..layers import ExpertProjections, FusedMoE, QuantizationConfig, StackedExpertsReader, WeightReader
from ..ops import Backend
from .config import MOE_ARCHITECTURES, ModelConfig
from .llama import LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["MoeForCausalLM"]

Tensor = torch.Tensor

# per architecture: the routed MLP's module name under "model.layers.{i}" in hub checkpoints, and
# its experts' projection names
MOE_CHECKPOINT_NAMES: Dict[str, Tuple[str, ExpertProjections]] = {
    "MixtralForCausalLM": ("block_sparse_moe", ExpertProjections("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", ExpertProjections("gate_proj", "up_proj", "down_proj")),
}


class MoeDecoderLayer(LlamaDecoderLayer):
    def init_mlp(self, c: ModelConfig, prefix: str, lin: dict) -> None:
        self.moe: Optional[FusedMoE] = None
        if not c.is_moe_layer(self.layer_idx):
            super().init_mlp(c, prefix, lin)
            return
        module, projections = MOE_CHECKPOINT_NAMES[c.architecture]
        self.moe = FusedMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                            c.moe_renormalize, f"{prefix}.{module}", projections, dtype=lin["dtype"],
                            device=lin["device"], ops=lin["ops"], tp=lin["tp"], stacked_prefix=f"{prefix}.mlp")

    def mlp(self, x: Tensor) -> Tensor:
        return super().mlp(x) if self.moe is None else self.moe(x)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen3-MoE causal LM (``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``; arguments as
    :class:`~fastinfer.models.LlamaForCausalLM`, ``quant_config`` None only)."""

    decoder_layer = MoeDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: Optional[int] = None, ops: Optional[Backend] = None,
                 quant_config: Optional[QuantizationConfig] = None, tp: ParallelInfo = SINGLE):
        if config.architecture not in MOE_ARCHITECTURES:
            raise ValueError(f"MoeForCausalLM runs {', '.join(MOE_ARCHITECTURES)}, not {config.architecture}")
        if quant_config is not None:
            raise ValueError(f"quantised {config.architecture} models are not supported yet (the experts are "
                             f"float only): got the {quant_config.name} quantisation")
        super().__init__(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                         quant_config=quant_config, tp=tp)

    @torch.no_grad()
    def load_weights(self, reader: WeightReader, progress: bool = False) -> "MoeForCausalLM":
        # stacked experts (transformers 5's modules' tensors) are read under the per-expert names
        moe_layers = [layer.moe for layer in self.layers if layer.moe is not None]
        return super().load_weights(StackedExpertsReader(reader, moe_layers), progress)
