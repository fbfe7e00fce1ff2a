"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, which Kimi K2 also uses) and DeepSeek-V2 / V2-Lite
(``DeepseekV2ForCausalLM``): multi-head latent attention (MLA) and routed experts with shared
experts, as transformers' ``deepseek_v3`` and ``deepseek_v2`` modeling files define them.

Per layer (pre-norms and residual stream as Llama's)::

    q = q_b_proj(rms_norm(q_a_proj(x)))  |  q_proj(x)        # [T, H, nope + rope]; V2-Lite: no q LoRA
    kv_c, k_pe = split(kv_a_proj_with_mqa(x))                 # [T, kv_lora_rank], [T, rope]
    kv_c = rms_norm(kv_c)                                     # kv_a_layernorm
    q_pe, k_pe = rotary(q_pe, k_pe)                           # interleaved pairs (or halves), YaRN
    mla_cache_write(kv_c, k_pe)                               # the cache: one latent [576] per token
    out = attention(q, latents) @ W_o                         # the two forms below
    mlp: dense SwiGLU on layers < first_k_dense_replace, else routed experts + shared experts

Attention, in one of two forms over the same latent cache (``MultiHeadLatentAttention.forward`` chooses,
for each batch):

- absorbed (:func:`~fastinfer.ops.mla_decode_attention`): ``kv_b_proj`` splits per head into
  ``W_UK [nope, 512]`` and ``W_UV [v, 512]``; the query becomes ``cat(q_nope @ W_UK, q_pe)``
  ``[T, H, 576]`` and attends to the cached latents directly, the output ``[T, H, 512]`` is brought
  back by ``W_UV``. Decode rows, and every chunk whose sequence has cached context (a later chunk of
  a chunked prefill, a prefix-cache hit, a speculative tree with its mask) run this form.
- expanded (:func:`~fastinfer.ops.prefill_attention`): a batch whose prefill chunks all start at
  position 0 with the causal mask (nothing cached before them) expands its own latents with
  ``kv_b_proj`` into per-head keys ``cat(k_nope, k_pe)`` and values, as transformers computes the
  attention: fewer operations than the absorbed form when the keys are the queries' own rows.
  ``prefill_attention`` runs head dims 64, 128 and 256 with one head dim for q, k and v, so q and k
  (``nope + rope``) and v are zero-padded to the next of these (192 and 128 -> 256 for DeepSeek-V3;
  the zeros add nothing to the scores, and the padded output columns are dropped).

The deterministic mode runs the absorbed form for every row: a row's bits then do not depend on
whether its batch had cached context.

The softmax scale is ``(nope + rope) ** -0.5`` times YaRN's ``mscale ** 2``
(:attr:`~fastinfer.models.ModelConfig.attention_scale`); the rotary table carries YaRN's
``attention_factor`` on cos and sin as transformers' does (both apply).

Rotary layout: V2 rotates interleaved pairs (complex multiplication), V3 too when ``rope_interleave``
(transformers then writes the rotated pairs out as halves, a permutation of the same values that q
and k share, so the scores are equal); V3 without ``rope_interleave`` rotates halves.

Routing (:func:`grouped_topk`, in torch): V3 scores with sigmoid, chooses with
``e_score_correction_bias`` added, within the ``topk_group`` best of ``n_group`` groups (a group's
score: the sum of its best two), and weighs with the scores themselves, renormalised when
``norm_topk_prob``; V2 scores with softmax, ``greedy`` or ``group_limited_greedy`` (a group's score:
its best expert). Both multiply the weights by ``routed_scaling_factor``. The router runs in float32
(transformers keeps ``gate.weight`` and the bias in float32). The experts run through
:class:`~fastinfer.layers.FusedMoE`; the ``n_shared_experts`` shared experts are one ungated SwiGLU
MLP added to every routed layer's output.

Checkpoint names: ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``,
``self_attn.kv_a_proj_with_mqa``, ``self_attn.kv_a_layernorm``, ``self_attn.kv_b_proj``,
``self_attn.o_proj``; ``mlp.gate.weight`` (``[E, H]``), ``mlp.gate.e_score_correction_bias`` (V3),
``mlp.experts.{e}.{gate,up,down}_proj`` (or transformers 5's stacked experts),
``mlp.shared_experts.{gate,up,down}_proj``; dense layers ``mlp.{gate,up,down}_proj``. The
multi-token prediction layers of a V3 checkpoint (``model.layers.{num_hidden_layers + i}``) are
skipped, as transformers skips them.

The KV cache of a layer is ``(latents [num_blocks, block_size, 576], None)``: one latent per token,
the normed ``kv_c`` then the rotated ``k_pe``.

Quantisation: the linears and the experts by the quantisation config (block-FP8 checkpoints with
``weight_scale_inv`` as DeepSeek ships them), except ``kv_b_proj``, which the absorbed form needs as
float weights: an fp8 ``kv_b_proj`` is dequantised on load. An fp8 KV cache (``kv_cache_dtype="fp8"``)
holds the latents in e4m3 with one per-tensor scale per layer, 1.0 (the normalised latent and the
roped rotary part sit well inside e4m3's range); a fresh prefill attends over its own latents
unrounded, every read of the cache (decode, later chunks, prefix hits, the deterministic mode) over
the e4m3 ones.

Tensor parallelism (``tp``, N ranks; as vLLM and SGLang shard MLA): each rank holds ``H / N`` query
heads (a head count that does not split is refused). ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj``
are column-parallel by heads, so ``W_UK`` / ``W_UV`` are the rank's heads; ``q_a_proj``,
``kv_a_proj_with_mqa`` and the two LoRA norms are replicated, and so is the latent cache: every rank
writes the same 576 values per token and layer. ``o_proj`` is row-parallel (one all-reduce). The
dense first layers and the shared experts split as Llama's MLP, each routed expert's intermediate
dimension as :class:`~fastinfer.layers.FusedMoE` splits it; the experts' and the shared experts'
partial sums are added and reduced by one all-reduce. The router is replicated. Expert parallelism
(``tp.ep``) splits the routed experts whole over the ranks as FusedMoE does for the other MoE models
(the shared experts then as under TP, or whole without it). Pipeline parallelism (``stage``): each
stage holds its layers and their latent caches, as Llama's.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch
from torch import nn

from ..distributed import SINGLE, ParallelInfo
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..layers import (
    CheckpointModule,
    ColumnParallelLinear,
    ExpertProjections,
    ForwardBatch,
    FusedMoE,
    KVCache,
    QuantizationConfig,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    StackedExpertsReader,
    WeightPart,
    WeightReader,
    param,
)
from ..layers.attention import FP8_KV_CACHE_DTYPE
from ..layers.moe import RouterMethod
from ..ops import Backend
from .config import MLA_ARCHITECTURES, MLA_LATENT_DIMS, ModelConfig
from .llama import LlamaForCausalLM, init_layer_geometry
from .moe import PartialRowParallelLinear

__all__ = ["DeepseekForCausalLM", "MultiHeadLatentAttention", "grouped_topk", "LATENT_DIM"]

Tensor = torch.Tensor

#: values per token in an MLA layer's cache: the kv latent, then the rotated k_pe
LATENT_DIM = sum(MLA_LATENT_DIMS)
# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps
_LORA_NORM_EPS = 1e-6
# head dims prefill_attention runs (the expanded form pads to the next one)
_PREFILL_HEAD_DIMS = (64, 128, 256)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def grouped_topk(logits: Tensor, top_k: int, *, scoring: str, grouping: Optional[str], num_groups: int,
                 topk_groups: int, renormalize: bool, scaling_factor: float,
                 correction_bias: Optional[Tensor] = None, ops: Optional[Backend] = None) -> Tuple[Tensor, Tensor]:
    """DeepSeek's routing of float32 router ``logits [T, E]``: ``(weights [T, top_k] float32,
    ids [T, top_k] int32)`` (see the module docstring; ``ops`` runs the sigmoid row by row in the
    deterministic mode)."""
    T, E = logits.shape
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits) if ops is None else ops.rowwise(torch.sigmoid, logits)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores if correction_bias is None else scores + correction_bias
    if grouping is not None:
        per_group = choice.view(T, num_groups, E // num_groups)
        if grouping == "top2_sum":
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = per_group.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = group_mask.unsqueeze(-1).expand(-1, -1, E // num_groups).reshape(T, E)
        # V3 drops the other groups' experts from the choice, V2 zeroes their scores (as transformers)
        choice = choice.masked_fill(~keep, float("-inf") if grouping == "top2_sum" else 0.0)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling_factor).to(torch.float32), ids.to(torch.int32)


class _Router(CheckpointModule):
    """``mlp.gate``: the router weight ``[E, H]`` and (V3) its ``e_score_correction_bias [E]``, held
    in float32 (transformers keeps both in float32 whatever the model dtype)."""

    def __init__(self, c: ModelConfig, prefix: str, *, device, ops):
        super().__init__()
        self.prefix = prefix
        self.ops = ops
        self.c = c
        self.weight = param((c.num_experts, c.hidden_size), torch.float32, device)
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts, dtype=torch.float32, device=device)
                             if c.moe_correction_bias else None)

    def load_from(self, reader: WeightReader) -> None:
        with torch.no_grad():
            self.weight.copy_(reader.get_float(self.prefix + ".weight", tuple(self.weight.shape)).to(torch.float32))
            if self.e_score_correction_bias is not None:
                bias = reader.get_float(self.prefix + ".e_score_correction_bias", (self.c.num_experts,))
                self.e_score_correction_bias.copy_(bias.to(torch.float32))

    def checkpoint_tensors(self):
        yield self.prefix + ".weight", self.weight.detach()
        if self.e_score_correction_bias is not None:
            yield self.prefix + ".e_score_correction_bias", self.e_score_correction_bias.detach()

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        c = self.c
        logits = self.ops.linear(x.to(torch.float32), self.weight)
        return grouped_topk(logits, c.num_experts_per_tok, scoring=c.moe_scoring, grouping=c.moe_grouping,
                            num_groups=c.moe_num_groups, topk_groups=c.moe_topk_groups,
                            renormalize=c.moe_renormalize, scaling_factor=c.moe_routed_scaling_factor,
                            correction_bias=self.e_score_correction_bias, ops=self.ops)


class _SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` of the projections ``{prefix}.{gate,up,down}_proj`` (gate/up
    column-parallel, down row-parallel; ``partial``: down returns this rank's partial sum, which the
    caller reduces)."""

    def __init__(self, hidden: int, width: int, prefix: str, lin: dict, partial: bool = False):
        super().__init__()
        self.ops = lin["ops"]
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [WeightPart(f"{prefix}.gate_proj", width), WeightPart(f"{prefix}.up_proj", width)], False, **lin)
        down = PartialRowParallelLinear if partial else RowParallelLinear
        self.down_proj = down(width, [WeightPart(f"{prefix}.down_proj", hidden)], False, **lin)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class _RoutedMLP(nn.Module):
    """The routed experts plus the shared experts of a DeepSeek MoE layer (under tensor parallelism
    the experts' and the shared experts' partial sums are added and reduced by one all-reduce)."""

    def __init__(self, c: ModelConfig, prefix: str, lin: dict):
        super().__init__()
        self.tp = lin["tp"]
        shared = c.shared_expert_intermediate_size
        self.gate = _Router(c, f"{prefix}.gate", device=lin["device"], ops=lin["ops"])
        self.experts = FusedMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                                c.moe_renormalize, prefix, ExpertProjections("gate_proj", "up_proj", "down_proj"),
                                dtype=lin["dtype"], device=lin["device"], ops=lin["ops"], tp=self.tp,
                                reduce_results=not shared, quant_config=lin["quant_config"], router_name=None)
        self.shared_experts = (_SwiGLU(c.hidden_size, shared, f"{prefix}.shared_experts", lin, partial=True)
                               if shared else None)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.gate(x)
        out = self.experts.run_experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
            if self.tp.world_size > 1:
                self.tp.comm.all_reduce(out)
        return out


def _per_head_matmul(ops: Backend, x: Tensor, w: Tensor) -> Tensor:
    """``y[t, h] = w[h] @ x[t, h]`` for ``x [T, H, K]``, ``w [H, N, K]``: ``[T, H, N]``. The
    deterministic mode multiplies head by head through the backend's batch-invariant linear."""
    if ops.deterministic:
        return torch.stack([ops.linear(x[:, h].contiguous(), w[h]) for h in range(w.shape[0])], dim=1)
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


class MultiHeadLatentAttention(nn.Module):
    """One MLA layer (see the module docstring): ``forward(x [T, hidden], batch, (latents, None),
    cos_sin_cache) -> [T, hidden]`` (after ``o_proj``). Under tensor parallelism this rank's
    ``num_heads`` of the ``H`` query heads (the caller checked that they split)."""

    def __init__(self, c: ModelConfig, prefix: str, lin: dict):
        super().__init__()
        H = c.num_attention_heads  # all heads: the checkpoint's rows; this rank's are the column shards
        self.num_heads = H // lin["tp"].world_size
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rank = c.kv_lora_rank
        self.qk_dim = self.nope + self.rope
        self.ops = ops = lin["ops"]
        self.scale = c.attention_scale
        self.is_neox = not c.rope_interleave
        self.padded_dim = next((d for d in _PREFILL_HEAD_DIMS if d >= max(self.qk_dim, self.v_dim)), None)
        p = f"{prefix}.self_attn"
        kw = dict(dtype=lin["dtype"], device=lin["device"], ops=ops)
        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, [WeightPart(f"{p}.q_proj", H * self.qk_dim)], False,
                                               **lin)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = ReplicatedLinear(c.hidden_size, [WeightPart(f"{p}.q_a_proj", c.q_lora_rank)], False, **lin)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, _LORA_NORM_EPS, f"{p}.q_a_layernorm", **kw)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, [WeightPart(f"{p}.q_b_proj", H * self.qk_dim)], False,
                                                 **lin)
        self.kv_a_proj = ReplicatedLinear(c.hidden_size, [WeightPart(f"{p}.kv_a_proj_with_mqa", self.rank + self.rope)],
                                          False, **lin)
        self.kv_a_layernorm = RMSNorm(self.rank, _LORA_NORM_EPS, f"{p}.kv_a_layernorm", **kw)
        # float whatever the checkpoint holds (an fp8 one is dequantised): the absorbed form multiplies
        # by its per-head blocks W_UK and W_UV directly
        self.kv_b_proj = ColumnParallelLinear(self.rank, [WeightPart(f"{p}.kv_b_proj", H * (self.nope + self.v_dim))],
                                              False, method=RouterMethod(), tp=lin["tp"], **kw)
        self.o_proj = RowParallelLinear(H * self.v_dim, [WeightPart(f"{p}.o_proj", c.hidden_size)], False, **lin)
        # an fp8 latent cache's per-tensor scale (written and read with it)
        self.register_buffer("kv_scale", torch.ones(1, dtype=torch.float32, device=lin["device"]), persistent=False)
        # W_UK^T [H, 512, nope] and W_UV [H, v, 512]: views of kv_b_proj's weight, made after loading
        self.w_uk_t: Optional[Tensor] = None
        self.w_uv: Optional[Tensor] = None

    def absorb(self) -> None:
        """Split ``kv_b_proj``'s (loaded) weight into the absorbed form's per-head matrices."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk_t = w[:, : self.nope].transpose(1, 2).contiguous()
        self.w_uv = w[:, self.nope:].contiguous()

    def forward(self, x: Tensor, batch: ForwardBatch, kv_cache: KVCache, cos_sin_cache: Tensor) -> Tensor:
        T, H, ops = x.shape[0], self.num_heads, self.ops
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, self.qk_dim)
        kv_a = self.kv_a_proj(x)
        kv_c = self.kv_a_layernorm(kv_a[:, : self.rank])
        q_pe = q[..., self.nope:].contiguous()
        k_pe = kv_a[:, self.rank:].contiguous().view(T, 1, self.rope)
        ops.rotary_embedding(batch.positions, q_pe, k_pe, cos_sin_cache, self.is_neox)
        latents = kv_cache[0]
        ops.mla_cache_write(kv_c, k_pe.view(T, self.rope), latents, batch.slot_mapping, self._cache_scale(latents))
        q_nope = q[..., : self.nope]
        P = batch.num_prefill_tokens
        parts: List[Tensor] = []
        if P > 0:
            if batch.prefill_fresh and not ops.deterministic:
                parts.append(self._expanded(q_nope[:P], q_pe[:P], kv_c[:P], k_pe[:P], batch))
            else:
                parts.append(self._absorbed(q_nope[:P], q_pe[:P], latents, batch.prefill_block_table,
                                            batch.prefill_seq_lens_k, batch.prefill_cu_seqlens_q, batch.custom_mask))
        if T > P:
            cu = torch.arange(T - P + 1, dtype=torch.int32, device=x.device)
            parts.append(self._absorbed(q_nope[P:], q_pe[P:], latents, batch.decode_block_table, batch.decode_seq_lens,
                                        cu, None))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj(out.reshape(T, H * self.v_dim))  # this rank's heads: o_proj's input columns

    def _absorbed(self, q_nope: Tensor, q_pe: Tensor, latents: Tensor, block_table: Tensor, seq_lens: Tensor,
                  cu_seqlens_q: Tensor, custom_mask: Optional[Tensor]) -> Tensor:
        """Attention over the cached latents: ``[rows, H, v]``."""
        ops = self.ops
        q = torch.cat([_per_head_matmul(ops, q_nope, self.w_uk_t), q_pe], dim=-1)
        out = ops.mla_decode_attention(q, latents, block_table, seq_lens, cu_seqlens_q, self.scale, causal=True,
                                       custom_mask=custom_mask, kv_scale=self._cache_scale(latents))
        return _per_head_matmul(ops, out, self.w_uv)

    def _cache_scale(self, latents: Tensor) -> Optional[Tensor]:
        """The scale the cache write and the reads take: ``kv_scale`` for an fp8 cache, else None."""
        return self.kv_scale if latents.dtype == FP8_KV_CACHE_DTYPE else None

    def _expanded(self, q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, batch: ForwardBatch) -> Tensor:
        """Attention of fresh prefill chunks over their own rows, keys and values expanded from the
        latents: ``[rows, H, v]``."""
        P, H, D = q_nope.shape[0], self.num_heads, self.padded_dim
        nope, qk = self.nope, self.qk_dim
        kv = self.kv_b_proj(kv_c).view(P, H, nope + self.v_dim)
        q = q_nope.new_zeros(P, H, D)
        k = q_nope.new_zeros(P, H, D)
        v = q_nope.new_zeros(P, H, D)
        q[..., :nope], q[..., nope:qk] = q_nope, q_pe
        k[..., :nope], k[..., nope:qk] = kv[..., :nope], k_pe
        v[..., : self.v_dim] = kv[..., nope:]
        cu, n = batch.prefill_cu_seqlens_q, int(batch.prefill_max_seqlen_q)
        out = self.ops.prefill_attention(q, k, v, cu, cu, n, n, scale=self.scale, causal=True)
        return out[..., : self.v_dim]


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype, device, ops,
                 quant_config: Optional[QuantizationConfig], tp: ParallelInfo = SINGLE):
        super().__init__()
        c = config
        _, prefix = init_layer_geometry(self, c, layer_idx, tp, ops)
        kw = dict(dtype=dtype, device=device, ops=ops)
        lin = dict(kw, quant_config=quant_config, tp=tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, f"{prefix}.input_layernorm", **kw)
        self.self_attn = MultiHeadLatentAttention(c, prefix, lin)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, f"{prefix}.post_attention_layernorm",
                                                **kw)
        if c.is_moe_layer(layer_idx):
            self.mlp = _RoutedMLP(c, f"{prefix}.mlp", lin)
        else:
            self.mlp = _SwiGLU(c.hidden_size, c.intermediate_size, f"{prefix}.mlp", lin)

    def forward(self, x: Tensor, residual: Optional[Tensor], batch: ForwardBatch, kv_cache: KVCache,
                cos_sin_cache: Tensor) -> Tuple[Tensor, Tensor]:
        """As :meth:`~fastinfer.models.llama.LlamaDecoderLayer.forward`."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        x = self.self_attn(x, batch, kv_cache, cos_sin_cache)
        x, residual = self.post_attention_layernorm.add_norm(x, residual)
        return self.mlp(x), residual


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 / Kimi K2 and DeepSeek-V2 causal LM (``DeepseekV3ForCausalLM``,
    ``DeepseekV2ForCausalLM``; arguments as :class:`~fastinfer.models.LlamaForCausalLM`)."""

    decoder_layer = DeepseekDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: Optional[int] = None, ops: Optional[Backend] = None,
                 quant_config: Optional[QuantizationConfig] = None, tp: ParallelInfo = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        if config.architecture not in MLA_ARCHITECTURES:
            raise ValueError(f"DeepseekForCausalLM runs {', '.join(MLA_ARCHITECTURES)}, not {config.architecture}")
        super().__init__(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                         quant_config=quant_config, tp=tp, stage=stage)

    @torch.no_grad()
    def load_weights(self, reader: WeightReader, progress: bool = False) -> "DeepseekForCausalLM":
        reader = StackedExpertsReader(reader, [layer.mlp.experts for layer in self.layers
                                               if isinstance(layer.mlp, _RoutedMLP)])
        for name in list(reader.names()):  # the multi-token prediction layers (transformers skips them too)
            m = _LAYER_INDEX.match(name)
            if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
                reader.skip(name)
        super().load_weights(reader, progress)
        for layer in self.layers:
            layer.self_attn.absorb()
        return self

    # ---- the latent cache -------------------------------------------------------------------
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> Tuple[int, int, int]:
        """Shape of a layer's latent cache: ``[num_blocks, block_size, 576]``."""
        return (int(num_blocks), int(block_size), LATENT_DIM)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes one KV block takes over all layers (one latent per token and layer)."""
        dt = self.dtype if dtype is None else dtype
        return self.num_layers * block_size * LATENT_DIM * torch.empty((), dtype=dt).element_size()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: Optional[torch.dtype] = None,
                          device=None) -> List[KVCache]:
        """Per layer ``(latents, None)``: a zero ``[num_blocks, block_size, 576]`` cache (model dtype and
        device by default; ``float8_e4m3fn``: the fp8 latent cache, each layer's ``kv_scale`` 1.0)."""
        dt = self.dtype if dtype is None else dtype
        dev = self.device if device is None else device
        shape = self.kv_cache_shape(num_blocks, block_size)
        return [(torch.zeros(shape, dtype=dt, device=dev), None) for _ in range(self.num_layers)]
