"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on the Llama-family building blocks.

The layer is Llama's (:mod:`.llama`: attention, norms, RoPE; Qwen3-MoE's per-head q/k norms as
Qwen3's) with the MLP replaced, on the layers :meth:`ModelConfig.is_moe_layer` names, by a
:class:`~fastinfer.layers.FusedMoE`::

    w, ids = moe_topk(x @ W_router^T, top_k, renormalize)   # softmax over the experts in fp32
    y = fused_moe(x, w13, w2, w, ids, "silu")               # sum of the k experts' SwiGLU MLPs
    y += sigmoid(x @ w_s^T) * down_s(silu(gate_s(x)) * up_s(x))   # Qwen2-MoE: the shared expert

What differs between the architectures (as transformers' modeling files have it):

- Mixtral routes every layer and always renormalises the top-k weights; its experts are
  ``intermediate_size`` wide.
- Qwen2-MoE and Qwen3-MoE renormalise when ``norm_topk_prob`` and keep a dense MLP on their
  ``mlp_only_layers`` and the layers that ``decoder_sparse_step`` skips. Qwen2-MoE adds a shared
  expert (:class:`SharedExpert`, ``shared_expert_intermediate_size`` wide) to every routed layer
  and biases q/k/v (``qkv_bias``); Qwen3-MoE normalises each q/k head.
- OLMoE routes every layer (experts ``intermediate_size`` wide, renormalised when
  ``norm_topk_prob``), RMS-normalises q and k over their whole projections, every head together
  (``self_attn.q_norm`` ``[Hq * D]``, ``k_norm`` ``[Hkv * D]``), and clamps the normed q, k and v
  to ``[-clip_qkv, clip_qkv]`` when ``clip_qkv`` is set, all before RoPE.

Checkpoint names: Mixtral's ``block_sparse_moe.gate`` / ``experts.{e}.w1 / w3 / w2`` and the
others' ``mlp.gate`` / ``experts.{e}.gate_proj / up_proj / down_proj``, or the stacked tensors
transformers 5's modules hold (``mlp.experts.gate_up_proj``,
:class:`~fastinfer.layers.StackedExpertsReader`); Qwen2-MoE's ``mlp.shared_expert.gate_proj /
up_proj / down_proj`` and ``mlp.shared_expert_gate`` (``[1, H]``).

Tensor parallelism: attention and the dense MLPs as Llama's; each expert's intermediate dimension
split over the ranks. The shared expert is a dense MLP (gate/up column-parallel, down row-parallel)
with its gate replicated; as a per-token factor the gate scales each rank's partial sum, so the
experts' and the shared expert's partial sums are added and reduced by one all-reduce, as the
experts alone are. OLMoE's q/k norms span every head, so each rank computes the whole q and k
projections (their weights replicated: no communication), normalises them and keeps its own heads;
v stays split as Llama's. Expert parallelism (``tp.ep``, :mod:`fastinfer.layers.moe`) splits the
experts whole over the ranks instead; with tensor parallelism the shared expert's partial sums and
the experts' shares (each rank's tokens, zeros elsewhere) are reduced by the same one all-reduce.

Quantisation (``quant_config``, :mod:`fastinfer.quant`): the linears (attention, the dense MLP
layers, the shared expert) as a dense model's; the experts through the config's expert method: fp8
(``quantization="fp8"`` on load, per channel; compressed-tensors FP8_DYNAMIC / FP8_BLOCK and
fine-grained FP8 checkpoints; fastinfer fp8), run by ``fused_moe_fp8``; int4 (on load, compressed-tensors
W4A16, AutoAWQ, AutoGPTQ, fastinfer int4), run by ``fused_moe_int4``; compressed-tensors NVFP4A16
checkpoints as stored, run by ``fused_moe_fp4``; other methods are refused for the experts. The
routers and Qwen2-MoE's shared expert gate stay float.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from ..distributed import SINGLE, ParallelInfo
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..layers import (
    CheckpointModule,
    ColumnParallelLinear,
    ExpertProjections,
    FusedMoE,
    Linear,
    QuantizationConfig,
    RMSNorm,
    RowParallelLinear,
    StackedExpertsReader,
    WeightPart,
    WeightReader,
    param,
)
from ..ops import Backend
from .config import MOE_ARCHITECTURES, ModelConfig
from .llama import LlamaDecoderLayer, LlamaForCausalLM, packed_parts

__all__ = ["MoeForCausalLM", "PartialRowParallelLinear", "SharedExpert", "init_routed_mlp", "routed_mlp"]

Tensor = torch.Tensor

_QWEN_EXPERTS = ("mlp", ExpertProjections("gate_proj", "up_proj", "down_proj"))
# per architecture: the routed MLP's module name under "model.layers.{i}" in hub checkpoints, and
# its experts' projection names
MOE_CHECKPOINT_NAMES: Dict[str, Tuple[str, ExpertProjections]] = {
    "MixtralForCausalLM": ("block_sparse_moe", ExpertProjections("w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": _QWEN_EXPERTS,
    "Qwen3MoeForCausalLM": _QWEN_EXPERTS,
    "OlmoeForCausalLM": _QWEN_EXPERTS,
    "Qwen3_5MoeForCausalLM": _QWEN_EXPERTS,
    "Qwen3NextForCausalLM": _QWEN_EXPERTS,
}


class PartialRowParallelLinear(RowParallelLinear):
    """A row-parallel linear returning this rank's partial sum (no all-reduce): its caller reduces it
    together with other partial sums."""

    def forward(self, x: Tensor) -> Tensor:
        return self.method.apply(self, x, self.bias)


class _SharedExpertGate(CheckpointModule):
    """The shared expert's gate, ``x @ w^T`` for the checkpoint's ``[1, H]`` weight (replicated, never
    quantised): one output feature, through the op backend's linear (``dense_mm`` in the
    deterministic mode)."""

    def __init__(self, hidden_size: int, prefix: str, *, dtype, device, ops):
        super().__init__()
        self.prefix = prefix
        self.ops = ops
        self.weight = param((1, hidden_size), dtype, device)

    def load_from(self, reader: WeightReader) -> None:
        with torch.no_grad():
            w = reader.get_float(self.prefix + ".weight", (1, self.weight.shape[1]))
            self.weight.copy_(w.to(device=self.weight.device, dtype=self.weight.dtype))

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        yield self.prefix + ".weight", self.weight.detach()

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.linear(x, self.weight)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert, ``sigmoid(x @ w_gate^T) * down(silu(gate(x)) * up(x))`` (``[T, H]``;
    under tensor parallelism this rank's partial sum, which the caller reduces).

    Args:
        hidden_size, intermediate_size: H and the shared expert's (unsharded) width.
        prefix: the checkpoint module holding ``shared_expert`` and ``shared_expert_gate``.
        lin: the linears' keyword arguments (dtype, device, ops, quant_config, tp).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str, lin: dict):
        super().__init__()
        I = intermediate_size
        expert = f"{prefix}.shared_expert"
        self.ops = lin["ops"]
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [WeightPart(f"{expert}.gate_proj", I), WeightPart(f"{expert}.up_proj", I)], False, **lin)
        self.down_proj = PartialRowParallelLinear(I, [WeightPart(f"{expert}.down_proj", hidden_size)], False, **lin)
        self.gate = _SharedExpertGate(hidden_size, f"{prefix}.shared_expert_gate", dtype=lin["dtype"],
                                      device=lin["device"], ops=lin["ops"])

    def forward(self, x: Tensor) -> Tensor:
        y = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return y * self.ops.rowwise(torch.sigmoid, self.gate(x))


class MoeDecoderLayer(LlamaDecoderLayer):
    def init_qkv(self, c: ModelConfig, prefix: str, kv_shard: Tuple[int, int], lin: dict) -> None:
        self.qk_projection_norm = c.qk_projection_norm
        if not c.qk_projection_norm:
            super().init_qkv(c, prefix, kv_shard, lin)
            return
        # OLMoE: the norms span every head: q and k are projected whole on every rank (part shard
        # (0, 1): replicated), v split as Llama's
        kw = dict(dtype=lin["dtype"], device=lin["device"], ops=lin["ops"])
        self.qkv_proj = ColumnParallelLinear(c.hidden_size,
                                             packed_parts(prefix, "qkv_proj", (c.q_size, c.kv_size, c.kv_size)),
                                             c.qkv_bias, part_shards=[(0, 1), (0, 1), kv_shard], **lin)
        self.q_norm = RMSNorm(c.q_size, c.rms_norm_eps, f"{prefix}.self_attn.q_norm", **kw)
        self.k_norm = RMSNorm(c.kv_size, c.rms_norm_eps, f"{prefix}.self_attn.k_norm", **kw)
        self.clip_qkv = c.clip_qkv
        # this rank's heads: columns of the whole normed q and k
        self.q_start = lin["tp"].rank * self.q_size
        self.k_start = kv_shard[0] * self.kv_size

    def qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        if not self.qk_projection_norm:
            return super().qkv(x)
        q_width, k_width = self.q_norm.weight.shape[0], self.k_norm.weight.shape[0]
        qkv = self.qkv_proj(x)  # [T, whole q + whole k + this rank's v]
        T = qkv.shape[0]
        q = self.q_norm(qkv[:, :q_width].contiguous())
        k = self.k_norm(qkv[:, q_width: q_width + k_width].contiguous())
        v = qkv[:, q_width + k_width:]
        if self.clip_qkv is not None:
            for t in (q, k, v):
                t.clamp_(-self.clip_qkv, self.clip_qkv)
        q = q[:, self.q_start: self.q_start + self.q_size].view(T, self.num_heads, self.head_dim)
        k = k[:, self.k_start: self.k_start + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        return q, k, v.view(T, self.num_kv_heads, self.head_dim)

    def init_mlp(self, c: ModelConfig, prefix: str, lin: dict) -> None:
        if not init_routed_mlp(self, c, prefix, lin):
            super().init_mlp(c, prefix, lin)

    def mlp_input(self) -> Optional[Linear]:
        return super().mlp_input() if self.moe is None else None  # the router reads the input too

    def mlp(self, x: Tensor) -> Tensor:
        return super().mlp(x) if self.moe is None else routed_mlp(self, x)


def init_routed_mlp(layer: nn.Module, c: ModelConfig, prefix: str, lin: dict) -> bool:
    """Give decoder layer ``layer`` (its ``layer_idx`` set) its routed MLP if ``c`` routes that layer:
    ``layer.moe`` (:class:`~fastinfer.layers.FusedMoE`) and ``layer.shared_expert`` (or None);
    both None on a dense layer. Returns whether the layer is routed; :func:`routed_mlp` runs it."""
    layer.moe = None
    layer.shared_expert = None
    if not c.is_moe_layer(layer.layer_idx):
        return False
    layer.tp = lin["tp"]
    shared = c.shared_expert_intermediate_size > 0
    module, projections = MOE_CHECKPOINT_NAMES[c.architecture]
    layer.moe = FusedMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                         c.moe_renormalize, f"{prefix}.{module}", projections, dtype=lin["dtype"],
                         device=lin["device"], ops=lin["ops"], tp=layer.tp, stacked_prefix=f"{prefix}.mlp",
                         reduce_results=not shared, quant_config=lin["quant_config"])
    if shared:
        layer.shared_expert = SharedExpert(c.hidden_size, c.shared_expert_intermediate_size, f"{prefix}.mlp", lin)
    return True


def routed_mlp(layer: nn.Module, x: Tensor) -> Tensor:
    """The routed experts plus the shared expert (if any) of a layer :func:`init_routed_mlp` built."""
    out = layer.moe(x)
    if layer.shared_expert is not None:  # both partial sums under TP: one all-reduce for the two
        out += layer.shared_expert(x)
        if layer.tp.world_size > 1:
            layer.tp.comm.all_reduce(out)
    return out


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE causal LM (``MixtralForCausalLM``,
    ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM``; arguments as
    :class:`~fastinfer.models.LlamaForCausalLM`; ``quant_config`` also gives the experts' method)."""

    decoder_layer = MoeDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: Optional[int] = None, ops: Optional[Backend] = None,
                 quant_config: Optional[QuantizationConfig] = None, tp: ParallelInfo = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        if config.architecture not in MOE_ARCHITECTURES:
            raise ValueError(f"MoeForCausalLM runs {', '.join(MOE_ARCHITECTURES)}, not {config.architecture}")
        super().__init__(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                         quant_config=quant_config, tp=tp, stage=stage)

    @torch.no_grad()
    def load_weights(self, reader: WeightReader, progress: bool = False) -> "MoeForCausalLM":
        # stacked experts (transformers 5's modules' tensors) are read under the per-expert names
        moe_layers = [layer.moe for layer in self.layers if layer.moe is not None]
        return super().load_weights(StackedExpertsReader(reader, moe_layers), progress)
