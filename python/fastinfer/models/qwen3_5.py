"""Qwen3.5 (text): a hybrid decoder of Gated DeltaNet (linear attention) layers and gated
full-attention layers, as transformers' ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``), and
its mixture-of-experts variants ``Qwen3_5MoeForCausalLM`` (Qwen3.5-MoE, ``qwen3_5_moe_text``) and
``Qwen3NextForCausalLM`` (Qwen3-Next, ``qwen3_next``).

``layer_types[i]`` says which mixer layer ``i`` has; the rest of the layer is Llama's (pre-norms,
residual stream, SwiGLU MLP), every RMSNorm but the gated one zero-centred (``x * (1 + w)``, the 1
added in float32 by the norm ops, as Gemma's, :class:`~fastinfer.models.gemma.GemmaRMSNorm`)::

    linear_attention (Gated DeltaNet):
        qkv | z | b | a = x @ [W_qkv; W_z; W_b; W_a]^T        # one GEMM
        qkv = silu(causal_conv1d(qkv))                         # depthwise, width linear_conv_kernel_dim
        q, k, v = split(qkv)                                   # [T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv]
        g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
        o = gated_delta_rule(q, k, v, g, beta, l2-normalised q and k, scale Dk ** -0.5)
        out = (rms_norm(o) * w_norm * silu(z)) @ W_out^T       # gated_rms_norm per value head
    full_attention:
        q | gate = q_proj(x) per head;  k, v                   # q_proj is 2 * Hq * D wide
        q, k = rms_norm(q), rms_norm(k)                        # per head, zero-centred
        rotary_embedding(q, k)                                 # the first head_dim * partial_rotary_factor dims
        out = (attention(q, k, v) * sigmoid(gate)) @ W_o^T

The MoE variants replace the MLP by routed experts plus a shared expert with its sigmoid gate, as
Qwen2-MoE's (:func:`~fastinfer.models.moe.init_routed_mlp`): Qwen3.5-MoE on every layer with the
top-k weights always renormalised, Qwen3-Next on the layers ``mlp_only_layers`` and
``decoder_sparse_step`` leave routed (a dense MLP on the others), renormalised when
``norm_topk_prob``. Qwen3-Next's checkpoints hold the Gated DeltaNet input projection as
``in_proj_qkvz`` and ``in_proj_ba``, interleaved per key head; :class:`_LinearAttentionReader` reads
both layouts as the same rows.

The multimodal rotary sections of the checkpoint (``mrope_section``) give every section the same
position for text, so text positions rotate as plain RoPE.

State: each linear-attention layer keeps, per sequence, the last ``W - 1`` convolution inputs and a
float32 ``[Hv, Dk, Dv]`` recurrent state. They live in pools of state slots (one slot per running
sequence, the engine's prefix-cache snapshots in others, :meth:`Qwen3_5ForCausalLM.allocate_kv_cache`
with ``num_state_slots``, :meth:`~Qwen3_5ForCausalLM.copy_state_slots`); the batch names
each sequence's slot and whether it continues from it (:class:`~fastinfer.layers.ForwardBatch`'s
``state_slots`` / ``has_initial_state``). A linear layer's entry of ``kv_caches`` is its
``(conv_states, recurrent_states)``, a full-attention layer's its paged ``(k_cache, v_cache)``.

Tensor parallelism: the full-attention layers and the MLPs as Llama's (the experts as
:mod:`~fastinfer.models.moe`'s); a Gated DeltaNet layer splits by head
(:class:`LinearAttentionShards`): each rank holds a contiguous share of the key heads and the value
heads that read them, its rows of q, k, v, z, b and a (column-parallel, no communication), their
convolution channels, ``A_log`` and ``dt_bias``, and the recurrent and convolution states of its
heads only; ``out_proj`` is row-parallel (one all-reduce). ``linear_num_key_heads`` must split over
the ranks.

Quantisation: the MoE variants' routed experts in fp8 on load (``quantization="fp8"``,
:class:`fastinfer.quant.resolve.ExpertsOnlyQuantization`); a quantised linear is refused.

Not supported (refused): pipeline parallelism, quantised linears and checkpoints. A
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` checkpoint runs its text
model (vision and multi-token prediction tensors skipped).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..distributed import SINGLE, ParallelInfo
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..layers import (
    CheckpointModule,
    ColumnParallelLinear,
    ForwardBatch,
    KVCache,
    Linear,
    PagedAttention,
    QuantizationConfig,
    RowParallelLinear,
    StackedExpertsReader,
    UnquantizedLinearMethod,
    WeightPart,
    WeightReader,
    param,
)
from ..layers.attention import FP8_KV_CACHE_DTYPE, report_fp8_kv_cache_scales
from ..layers.weights import SingleWeightModule
from ..ops import Backend
from .config import HYBRID_ARCHITECTURES, ModelConfig
from .gemma import GemmaRMSNorm, _TextModelReader
from .llama import LlamaForCausalLM, init_layer_geometry, packed_parts
from .moe import init_routed_mlp, routed_mlp

__all__ = ["Qwen3_5ForCausalLM", "GatedDeltaNet", "LinearAttentionShards"]

Tensor = torch.Tensor

# checkpoint tensors transformers' Qwen3_5ForCausalLM skips as well: the multi-token prediction head
# and (in a multimodal checkpoint) the vision tower
_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")


class LinearAttentionShards:
    """This rank's share of a Gated DeltaNet layer: its key heads ``[k0, k0 + Hk)`` and value heads
    ``[v0, v0 + Hv)`` (the value heads that read those key heads), of widths ``Dk`` / ``Dv``."""

    def __init__(self, c: ModelConfig, tp: ParallelInfo):
        n = tp.world_size
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(c, key) % n:
                raise ValueError(f"{key}={getattr(c, key)} does not split over tensor_parallel_size={n} "
                                 "(the linear-attention heads are split over the ranks)")
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads // n, c.linear_num_value_heads // n
        self.k0, self.v0 = tp.rank * self.num_k_heads, tp.rank * self.num_v_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.full_key_dim = c.linear_num_key_heads * self.head_k_dim

    def conv_channels(self) -> List[Tuple[int, int]]:
        """``(start, length)`` of this rank's q, k and v channels among the layer's ``conv_dim``."""
        K = self.full_key_dim
        return [(self.k0 * self.head_k_dim, self.key_dim), (K + self.k0 * self.head_k_dim, self.key_dim),
                (2 * K + self.v0 * self.head_v_dim, self.value_dim)]


class _LinearAttentionParams(CheckpointModule):
    """A Gated DeltaNet layer's small tensors: the convolution weight (checkpoint ``conv1d.weight``
    ``[D, 1, W]``, held ``[D, W]``: this rank's q, k and v channels), ``A_log`` and ``dt_bias``
    (this rank's value heads), all in the model dtype as transformers holds them."""

    def __init__(self, shards: LinearAttentionShards, c: ModelConfig, prefix: str, *, dtype, device):
        super().__init__()
        self.prefix = prefix
        self.shards = shards
        self.full_conv_dim, self.full_v_heads = c.linear_conv_dim, c.linear_num_value_heads
        self.conv_weight = param((shards.conv_dim, c.linear_conv_kernel_dim), dtype, device)
        self.A_log = param((shards.num_v_heads,), dtype, device)
        self.dt_bias = param((shards.num_v_heads,), dtype, device)

    def load_from(self, reader: WeightReader) -> None:
        with torch.no_grad():
            W = self.conv_weight.shape[1]
            w = reader.get_float(f"{self.prefix}.conv1d.weight", (self.full_conv_dim, 1, W)).reshape(-1, W)
            w = torch.cat([w.narrow(0, *span) for span in self.shards.conv_channels()])
            self.conv_weight.copy_(w.to(device=self.conv_weight.device, dtype=self.conv_weight.dtype))
            for name in ("A_log", "dt_bias"):
                t = getattr(self, name)
                v = reader.get_float(f"{self.prefix}.{name}", (self.full_v_heads,))
                t.copy_(v.narrow(0, self.shards.v0, t.shape[0]).to(device=t.device, dtype=t.dtype))

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        D, W = self.conv_weight.shape
        yield f"{self.prefix}.conv1d.weight", self.conv_weight.detach().reshape(D, 1, W)
        yield f"{self.prefix}.A_log", self.A_log.detach()
        yield f"{self.prefix}.dt_bias", self.dt_bias.detach()


class _GatedNormWeight(SingleWeightModule):
    """The gated output norm's weight ``[Dv]`` (``linear_attn.norm.weight``; a plain scale, not
    zero-centred)."""

    def __init__(self, width: int, prefix: str, *, dtype, device):
        super().__init__()
        self.prefix = prefix
        self.weight = param((width,), dtype, device)


# the input projection's parts, in our row order: q, k, v (the convolution's channels), z, b, a
_IN_PROJ_PARTS = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a")


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet mixer (see the module docstring); ``forward(x, batch, (conv_states,
    recurrent_states))`` updates the batch's slots of both pools in place. Under tensor parallelism
    this rank's heads (:class:`LinearAttentionShards`): the input projection column-parallel by
    head, the output projection row-parallel (one all-reduce), the states of its heads only."""

    def __init__(self, c: ModelConfig, prefix: str, lin: dict):
        super().__init__()
        self.ops = lin["ops"]
        sh = self.shards = LinearAttentionShards(c, lin["tp"])
        self.num_k_heads, self.num_v_heads = sh.num_k_heads, sh.num_v_heads
        self.head_k_dim, self.head_v_dim = sh.head_k_dim, sh.head_v_dim
        self.key_dim, self.value_dim, self.conv_dim = sh.key_dim, sh.value_dim, sh.conv_dim
        self.eps = c.rms_norm_eps
        p = f"{prefix}.linear_attn"
        K, V, Hv = c.linear_num_key_heads * sh.head_k_dim, c.linear_num_value_heads * sh.head_v_dim, \
            c.linear_num_value_heads
        parts = [WeightPart(f"{p}.{name}", rows) for name, rows in zip(_IN_PROJ_PARTS, (K, K, V, V, Hv, Hv))]
        self.in_proj = ColumnParallelLinear(c.hidden_size, parts, False, **lin)
        self.params = _LinearAttentionParams(sh, c, p, dtype=lin["dtype"], device=lin["device"])
        self.norm = _GatedNormWeight(self.head_v_dim, f"{p}.norm", dtype=lin["dtype"], device=lin["device"])
        self.out_proj = RowParallelLinear(V, [WeightPart(f"{p}.out_proj", c.hidden_size)], False, **lin)

    def forward(self, x: Tensor, batch: ForwardBatch, state: KVCache, layer_idx: int = -1) -> Tensor:
        if batch.state_slots is None:
            raise ValueError("a linear-attention layer needs the batch's state slots (BatchBuilder.prefill / "
                             "decode with state_slot=)")
        proj = self.in_proj(x)
        if batch.linear_inputs is not None:
            batch.linear_inputs[layer_idx] = proj.index_select(0, batch.linear_input_rows)
        o = self.recurrence(proj, batch.state_cu_seqlens, state, batch.state_slots, batch.has_initial_state)
        T, hv, vd = x.shape[0], self.num_v_heads, self.value_dim
        cd = self.conv_dim
        z = proj[:, cd: cd + vd].reshape(T * hv, self.head_v_dim)
        o = self.ops.gated_rms_norm(o.view(T * hv, self.head_v_dim), z, self.norm.weight, self.eps)
        return self.out_proj(o.view(T, vd))

    def recurrence(self, proj: Tensor, cu_seqlens: Tensor, state: KVCache, slots: Tensor,
                   has_initial_state: Optional[Tensor]) -> Tensor:
        """The convolution and the delta rule over the input projection ``proj`` of each sequence's
        rows (``cu_seqlens``), continuing from (and updating) its slot: the output ``[T, Hv, Dv]``
        before the gated norm."""
        conv_states, recurrent_states = state
        T, ops = proj.shape[0], self.ops
        cd, vd, hv = self.conv_dim, self.value_dim, self.num_v_heads
        mixed = ops.causal_conv1d(proj[:, :cd], self.params.conv_weight, None, cu_seqlens, conv_states,
                                  slots, has_initial_state, "silu")
        q = mixed[:, : self.key_dim].view(T, self.num_k_heads, self.head_k_dim)
        k = mixed[:, self.key_dim: 2 * self.key_dim].view(T, self.num_k_heads, self.head_k_dim)
        v = mixed[:, 2 * self.key_dim:].view(T, hv, self.head_v_dim)
        b = proj[:, cd + vd: cd + vd + hv]
        a = proj[:, cd + vd + hv:]
        beta = ops.rowwise(torch.sigmoid, b)  # in the model dtype, as transformers
        g = -self.params.A_log.float().exp() * ops.rowwise(nn.functional.softplus,
                                                           a.float() + self.params.dt_bias.float())
        return ops.gated_delta_rule(q, k, v, g.contiguous(), beta.contiguous(), cu_seqlens, recurrent_states, slots,
                                    has_initial_state, use_qk_l2norm=True)


class _LinearAttentionReader(WeightReader):
    """A checkpoint's Gated DeltaNet input projections under the names :class:`GatedDeltaNet` reads,
    one tensor per kind of row (``{p}.in_proj_q``, ``in_proj_k``, ``in_proj_v``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, each in head order), so that a rank reads its heads' rows of each:

    - Qwen3.5 (``in_proj_qkv`` ``[2 Hk Dk + Hv Dv, H]``, q then k then v; ``in_proj_z``, ``in_proj_b``,
      ``in_proj_a`` as they are): q, k and v are row ranges of ``in_proj_qkv``;
    - Qwen3-Next (``in_proj_qkvz`` and ``in_proj_ba``): per key head ``g`` the rows
      ``[q_g (Dk), k_g (Dk), v_g (r Dv), z_g (r Dv)]`` and ``[b_g (r), a_g (r)]``, ``r = Hv / Hk``
      (transformers' ``fix_query_key_value_ordering``), gathered into the six.

    Tensors already under the six names (a model's own :meth:`checkpoint_tensors`) and every other
    tensor keep their names."""

    def __init__(self, base: WeightReader, c: ModelConfig, prefixes: Sequence[str]):
        super().__init__(base.description)
        self.base = base
        Hk, Hv, Dk, Dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        K, r = Hk * Dk, Hv // Hk
        # our name -> (base name, row index runs [(start, length), ...])
        self._where: Dict[str, Tuple[str, List[Tuple[int, int]]]] = {}
        for p in prefixes:
            qkv, qkvz, ba = (f"{p}.{n}.weight" for n in ("in_proj_qkv", "in_proj_qkvz", "in_proj_ba"))
            if base.has(qkv):
                runs = {"in_proj_q": (qkv, [(0, K)]), "in_proj_k": (qkv, [(K, K)]),
                        "in_proj_v": (qkv, [(2 * K, Hv * Dv)])}
            elif base.has(qkvz) and base.has(ba):
                g_qkvz, g_ba = 2 * Dk + 2 * r * Dv, 2 * r
                runs = {}
                for name, off, n in (("in_proj_q", 0, Dk), ("in_proj_k", Dk, Dk), ("in_proj_v", 2 * Dk, r * Dv),
                                     ("in_proj_z", 2 * Dk + r * Dv, r * Dv)):
                    runs[name] = (qkvz, [(g * g_qkvz + off, n) for g in range(Hk)])
                for name, off in (("in_proj_b", 0), ("in_proj_a", r)):
                    runs[name] = (ba, [(g * g_ba + off, r) for g in range(Hk)])
            else:
                continue
            for name, where in runs.items():
                self._where[f"{p}.{name}.weight"] = where
        self._renamed = {base_name for base_name, _ in self._where.values()}
        self._cached: Tuple[Optional[str], Optional[Tensor]] = (None, None)

    def names(self) -> Iterable[str]:
        return [n for n in self.base.names() if n not in self._renamed] + list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where or (name not in self._renamed and self.base.has(name))

    def shape(self, name: str) -> Tuple[int, ...]:
        if name not in self._where:
            return self.base.shape(name)
        base_name, runs = self._where[name]
        return (sum(n for _, n in runs),) + tuple(self.base.shape(base_name)[1:])

    def _read(self, name: str) -> Tensor:
        if name not in self._where:
            return self.base._read(name)
        base_name, runs = self._where[name]
        if len(runs) == 1:
            return self.base._read_slice(base_name, runs[0], None)
        if self._cached[0] != base_name:
            self._cached = (base_name, self.base._read(base_name))
        return torch.cat([self._cached[1].narrow(0, *run) for run in runs])

    def _read_slice(self, name, rows, cols) -> Tensor:
        if name not in self._where:
            return self.base._read_slice(name, rows, cols)
        base_name, runs = self._where[name]
        if len(runs) == 1 and rows is not None:
            return self.base._read_slice(base_name, (runs[0][0] + rows[0], rows[1]), cols)
        return super()._read_slice(name, rows, cols)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype, device, ops,
                 quant_config: Optional[QuantizationConfig], tp: ParallelInfo = SINGLE):
        super().__init__()
        c = config
        kv_shard, prefix = init_layer_geometry(self, c, layer_idx, tp, ops)
        kw = dict(dtype=dtype, device=device, ops=ops)
        lin = dict(kw, quant_config=quant_config, tp=tp)

        def norm(width: int, name: str) -> GemmaRMSNorm:  # zero-centred, as Gemma's
            return GemmaRMSNorm(width, c.rms_norm_eps, f"{prefix}.{name}", **kw)

        self.is_linear = c.layer_types[layer_idx] == "linear_attention"
        self.input_layernorm = norm(c.hidden_size, "input_layernorm")
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c, prefix, lin)
        else:
            # q_proj holds each head's query then its output gate: 2 * Hq * D rows
            self.qkv_proj = ColumnParallelLinear(c.hidden_size,
                                                 packed_parts(prefix, "qkv_proj", (2 * c.q_size, c.kv_size, c.kv_size)),
                                                 c.qkv_bias, part_shards=[(tp.rank, tp.world_size), kv_shard, kv_shard],
                                                 **lin)
            self.q_norm = norm(c.head_dim, "self_attn.q_norm")
            self.k_norm = norm(c.head_dim, "self_attn.k_norm")
            self.attn = PagedAttention(self.num_heads, self.num_kv_heads, c.head_dim, float(c.head_dim) ** -0.5, -1,
                                       layer_idx, ops=ops, prefix=f"{prefix}.self_attn", kv_shard=kv_shard,
                                       device=device)
            self.o_proj = RowParallelLinear(c.q_size, packed_parts(prefix, "o_proj", (c.hidden_size,)), c.o_bias, **lin)
        self.post_attention_layernorm = norm(c.hidden_size, "post_attention_layernorm")
        if not init_routed_mlp(self, c, prefix, lin):  # the MoE variants' routed experts, else dense
            F = c.intermediate_size
            self.gate_up_proj = ColumnParallelLinear(c.hidden_size, packed_parts(prefix, "gate_up_proj", (F, F)),
                                                     False, **lin)
            self.down_proj = RowParallelLinear(F, packed_parts(prefix, "down_proj", (c.hidden_size,)), False, **lin)

    def mlp(self, x: Tensor) -> Tensor:
        if self.moe is not None:
            return routed_mlp(self, x)
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))

    def gated_attention(self, x: Tensor, batch: ForwardBatch, kv_cache: KVCache, cos_sin_cache: Tensor) -> Tensor:
        T, D = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        qg = qkv[:, : 2 * self.q_size].view(T, self.num_heads, 2 * D)
        q = self.q_norm(qg[..., :D].contiguous())
        gate = qg[..., D:].reshape(T, self.q_size)
        k = self.k_norm(qkv[:, 2 * self.q_size: 2 * self.q_size + self.kv_size].contiguous().view(T, self.num_kv_heads, D))
        v = qkv[:, 2 * self.q_size + self.kv_size:].view(T, self.num_kv_heads, D)
        self.ops.rotary_embedding(batch.positions, q, k, cos_sin_cache, True)
        out = self.attn(q, k, v, kv_cache, batch).reshape(T, self.q_size)
        return self.o_proj(out * self.ops.rowwise(torch.sigmoid, gate))

    def forward(self, x: Tensor, residual: Optional[Tensor], batch: ForwardBatch, cache: KVCache,
                cos_sin_cache: Tensor) -> Tuple[Tensor, Tensor]:
        """As :meth:`~fastinfer.models.llama.LlamaDecoderLayer.forward`; ``cache``: this layer's
        paged KV or its state pools."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        if self.is_linear:
            x = self.linear_attn(x, batch, cache, self.layer_idx)
        else:
            x = self.gated_attention(x, batch, cache, cos_sin_cache)
        x, residual = self.post_attention_layernorm.add_norm(x, residual)
        return self.mlp(x), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Qwen3.5 text causal LM and its MoE variants (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``,
    ``Qwen3NextForCausalLM``; arguments as
    :class:`~fastinfer.models.LlamaForCausalLM`; ``stage`` must be the whole model and
    ``quant_config`` may quantise the experts only)."""

    decoder_layer = Qwen3_5DecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: Optional[int] = None, ops: Optional[Backend] = None,
                 quant_config: Optional[QuantizationConfig] = None, tp: ParallelInfo = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        if config.architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(f"Qwen3_5ForCausalLM runs {', '.join(HYBRID_ARCHITECTURES)}, not {config.architecture}")
        if stage.num_stages > 1:
            raise ValueError(f"pipeline_parallel_size={stage.num_stages} is not supported for {config.architecture}")
        super().__init__(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                         quant_config=quant_config, tp=tp, stage=stage)
        quantised = [m.prefix for m in self.modules()
                     if isinstance(m, Linear) and not isinstance(m.method, UnquantizedLinearMethod)]
        if quantised:  # a quantisation config may quantise the experts only (fastinfer.quant)
            raise ValueError(f"quantised linears are not supported for {config.architecture} (its linear-attention "
                             f"projections run in float): {quantised[0]} would be {quant_config.name}")

    @torch.no_grad()
    def load_weights(self, reader: WeightReader, progress: bool = False) -> "Qwen3_5ForCausalLM":
        found = [p for p in self.config.text_weights_prefixes if any(n.startswith(p) for n in reader.names())]
        if found:
            reader = _TextModelReader(reader, found[0])
        linear = [f"model.layers.{layer.layer_idx}.linear_attn" for layer in self.layers if layer.is_linear]
        reader = _LinearAttentionReader(reader, self.config, linear)
        # stacked experts (transformers 5's modules' tensors) are read under the per-expert names
        reader = StackedExpertsReader(reader, [layer.moe for layer in self.layers if layer.moe is not None])
        for name in list(reader.names()):
            if name.startswith(_SKIPPED_PREFIXES):
                reader.skip(name)
        return super().load_weights(reader, progress)

    # ---- caches -----------------------------------------------------------------------------
    @property
    def attention_layers(self) -> List[Qwen3_5DecoderLayer]:
        return [layer for layer in self.layers if not layer.is_linear]

    def kv_cache_bytes_per_block(self, block_size: int, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes one KV block takes over the full-attention layers (K and V)."""
        dt = self.dtype if dtype is None else dtype
        per = block_size * self.num_local_kv_heads * self.config.head_dim
        return 2 * len(self.attention_layers) * per * torch.empty((), dtype=dt).element_size()

    def state_bytes_per_seq(self) -> int:
        """Bytes one state slot takes over the linear-attention layers (convolution window in the
        model dtype, float32 recurrent state)."""
        c, sh = self.config, self.linear_shards
        conv = (c.linear_conv_kernel_dim - 1) * sh.conv_dim * torch.empty((), dtype=self.dtype).element_size()
        rec = sh.num_v_heads * sh.head_k_dim * sh.head_v_dim * 4
        return (len(self.layers) - len(self.attention_layers)) * (conv + rec)

    @property
    def linear_shards(self) -> LinearAttentionShards:
        """This rank's share of every linear-attention layer (all of it without tensor parallelism)."""
        return LinearAttentionShards(self.config, self.tp)

    @torch.no_grad()
    def copy_state_slots(self, kv_caches: Sequence[KVCache], copies: Sequence[Tuple[int, int]]) -> None:
        """Copy state slots ``(source, destination)`` of every linear-attention layer, one pair after
        the other (a later pair may read what an earlier one wrote): the engine's prefix cache saves
        a sequence's state as a snapshot and restores one into a sequence's slot."""
        for layer, cache in zip(self.layers, kv_caches):
            if layer.is_linear:
                for pool in cache:
                    for src, dst in copies:
                        pool[dst].copy_(pool[src])

    def keep_chain_inputs(self, batch: ForwardBatch, first_row: int, chains: Sequence[Tuple[int, int]]) -> dict:
        """Before a speculative verification (``chains``: ``(seq_id, rows)`` from row ``first_row`` on):
        make the linear-attention layers keep those rows' input projections; what
        :meth:`commit_chains` needs."""
        n = sum(rows for _, rows in chains)
        batch.linear_input_rows = torch.arange(first_row, first_row + n, dtype=torch.int64, device=self.device)
        batch.linear_inputs = {}
        offsets, off = {}, 0
        for sid, rows in chains:
            offsets[sid] = (off, rows)
            off += rows
        return dict(inputs=batch.linear_inputs, offsets=offsets)

    def commit_chains(self, kv_caches: Sequence[KVCache], kept_inputs: dict, kept: dict) -> None:
        """After the verification: ``kept``: ``seq_id -> (rows kept, state slot, saved slot)``; a chain
        that kept fewer rows than it had gets the state at that length (:meth:`advance_linear_states`)."""
        offsets = kept_inputs["offsets"]
        chains = [(offsets[sid][0], k, slot, saved) for sid, (k, slot, saved) in kept.items() if k < offsets[sid][1]]
        self.advance_linear_states(kv_caches, kept_inputs["inputs"], chains)

    @torch.no_grad()
    def advance_linear_states(self, kv_caches: Sequence[KVCache], inputs: dict,
                              chains: Sequence[Tuple[int, int, int, int]]) -> None:
        """Commit speculative chains at their accepted length: per chain ``(first row, rows kept,
        slot, saved slot)``, the slot gets the saved state (from before the verification) and the
        linear-attention layers re-run the kept rows of the verification's input projections
        (``inputs``: layer index -> rows, :attr:`~fastinfer.layers.ForwardBatch.linear_inputs`), so
        it holds the state after exactly those tokens."""
        if not chains:
            return
        self.copy_state_slots(kv_caches, [(saved, slot) for _, _, slot, saved in chains])
        dev = self.device
        rows = torch.tensor([r for first, kept, _, _ in chains for r in range(first, first + kept)], dtype=torch.int64,
                            device=dev)
        cu = [0]
        for _, kept, _, _ in chains:
            cu.append(cu[-1] + kept)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=dev)
        slots = torch.tensor([slot for _, _, slot, _ in chains], dtype=torch.int32, device=dev)
        for layer, cache in zip(self.layers, kv_caches):
            if layer.is_linear:
                layer.linear_attn.recurrence(inputs[layer.layer_idx].index_select(0, rows), cu_seqlens, cache, slots,
                                             None)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: Optional[torch.dtype] = None,
                          device=None, num_state_slots: int = 0) -> List[KVCache]:
        """Per layer: a full-attention layer's ``(k_cache, v_cache)`` as Llama's, a linear-attention
        layer's zero ``(conv_states [S, W - 1, conv_dim], recurrent_states [S, Hv, Dk, Dv] float32)``
        for ``S = num_state_slots`` sequences (at least 1)."""
        if num_state_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1 for {self.config.architecture} (one state slot per "
                             f"sequence in flight), got {num_state_slots}")
        c = self.config
        shape = self.kv_cache_shape(num_blocks, block_size)
        dt = self.dtype if dtype is None else dtype
        if dt == FP8_KV_CACHE_DTYPE:
            report_fp8_kv_cache_scales((layer.attn for layer in self.attention_layers), c.architecture)
        dev = self.device if device is None else device
        caches: List[KVCache] = []
        sh = self.linear_shards
        for layer in self.layers:
            if layer.is_linear:
                caches.append((torch.zeros((num_state_slots, c.linear_conv_kernel_dim - 1, sh.conv_dim),
                                           dtype=self.dtype, device=dev),
                               torch.zeros((num_state_slots, sh.num_v_heads, sh.head_k_dim, sh.head_v_dim),
                                           dtype=torch.float32, device=dev)))
            else:
                caches.append((torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)))
        return caches
