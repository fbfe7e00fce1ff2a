"""Gemma 2 and Gemma 3 (text) decoders on the Llama-family building blocks.

What differs from :mod:`.llama` (transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``)::

    h = embed(ids) * sqrt(hidden)              # the normaliser rounded to the model dtype first
    per layer:
        x = rms_norm(h)                        # input_layernorm
        q, k = rms_norm(q), rms_norm(k)        # Gemma 3 only (q_norm / k_norm over head_dim)
        rotary_embedding(q, k)                 # sliding layers: their own table on Gemma 3
        a = attention(q, k, v) @ W_o^T         # scale query_pre_attn_scalar ** -0.5, sliding window on
                                               # local layers, scores soft-capped on Gemma 2
        h = h + rms_norm(a)                    # post_attention_layernorm
        m = down(gelu_tanh(gate(x')) * up(x'))  # x' = rms_norm(h): pre_feedforward_layernorm
        h = h + rms_norm(m)                    # post_feedforward_layernorm
    logits = lm_head(rms_norm(h))
    logits = c * tanh(logits / c)              # when final_logit_softcapping = c is set (Gemma 2: 30)

Every Gemma RMSNorm multiplies by ``1 + weight``: :class:`GemmaRMSNorm` holds the checkpoint's
weight and runs ``rms_norm`` / ``fused_add_rms_norm`` with ``weight_offset=1``, which adds the 1 in
float32 inside the kernel, as transformers does. The residual add before each norm rides on ``fused_add_rms_norm`` as in Llama: the layer
returns its post-feed-forward-normed output and the residual stream, and the next layer's (or the
final) norm adds them.

Tensor parallelism, quantised linears, the paged KV cache and the checkpoint names are Llama's
(:data:`~fastinfer.models.llama.PACKED_MODULES`); norms, the two RoPE tables and the soft-caps are
replicated. A ``Gemma3ForConditionalGeneration`` checkpoint runs its text model: the vision tower
and projector tensors are skipped.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..distributed import SINGLE, ParallelInfo
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..layers import (
    ColumnParallelLinear,
    ForwardBatch,
    KVCache,
    PagedAttention,
    QuantizationConfig,
    RMSNorm,
    RowParallelLinear,
    WeightPart,
    WeightReader,
)
from ..ops import Backend
from .config import GEMMA_ARCHITECTURES, ModelConfig
from .llama import LlamaForCausalLM, init_layer_geometry, packed_parts
from .rope import build_cos_sin_cache

__all__ = ["GemmaForCausalLM", "GemmaRMSNorm"]

Tensor = torch.Tensor

# tensors of a Gemma3ForConditionalGeneration checkpoint that belong to the vision side
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` with the checkpoint's
    ``weight``: the 1 is added in float32 by the norm ops (``weight_offset``), never rounded to the
    model dtype."""

    weight_offset = 1.0


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype, device, ops,
                 quant_config: Optional[QuantizationConfig], tp: ParallelInfo = SINGLE):
        super().__init__()
        c = config
        kv_shard, prefix = init_layer_geometry(self, c, layer_idx, tp, ops)

        def parts(slot: str, sizes: Sequence[int]) -> List[WeightPart]:
            return packed_parts(prefix, slot, sizes)

        def norm(width: int, name: str) -> GemmaRMSNorm:
            return GemmaRMSNorm(width, c.rms_norm_eps, f"{prefix}.{name}", **kw)

        kw = dict(dtype=dtype, device=device, ops=ops)
        lin = dict(kw, quant_config=quant_config, tp=tp)
        self.input_layernorm = norm(c.hidden_size, "input_layernorm")
        self.qkv_proj = ColumnParallelLinear(c.hidden_size, parts("qkv_proj", (c.q_size, c.kv_size, c.kv_size)),
                                             c.qkv_bias, part_shards=[(tp.rank, tp.world_size), kv_shard, kv_shard],
                                             **lin)
        self.q_norm = self.k_norm = None
        if c.qk_norm:  # Gemma 3: per-head RMSNorm over head_dim before RoPE
            self.q_norm = norm(c.head_dim, "self_attn.q_norm")
            self.k_norm = norm(c.head_dim, "self_attn.k_norm")
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, c.head_dim, c.attention_scale,
                                   c.window_left(layer_idx), layer_idx, ops=ops,
                                   softcap=c.attn_logit_softcapping or 0.0)
        self.o_proj = RowParallelLinear(c.q_size, parts("o_proj", (c.hidden_size,)), c.o_bias, **lin)
        self.post_attention_layernorm = norm(c.hidden_size, "post_attention_layernorm")
        self.pre_feedforward_layernorm = norm(c.hidden_size, "pre_feedforward_layernorm")
        F = c.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(c.hidden_size, parts("gate_up_proj", (F, F)), False, **lin)
        self.down_proj = RowParallelLinear(F, parts("down_proj", (c.hidden_size,)), False, **lin)
        self.post_feedforward_layernorm = norm(c.hidden_size, "post_feedforward_layernorm")

    def forward(self, x: Tensor, residual: Optional[Tensor], batch: ForwardBatch, kv_cache: KVCache,
                cos_sin_cache: Tensor) -> Tuple[Tensor, Tensor]:
        """``x``: the previous layer's post-feed-forward-normed output (or the scaled embeddings for
        layer 0, with ``residual=None``). Returns ``(output, residual)``, both ``[T, hidden]``; the
        next norm adds them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        return self.attention_mlp(x, residual, batch, kv_cache, cos_sin_cache)

    def attention_mlp(self, x: Tensor, residual: Tensor, batch: ForwardBatch, kv_cache: KVCache,
                      cos_sin_cache: Tensor) -> Tuple[Tensor, Tensor]:
        """The layer after its input norm (``residual`` updated in place)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # rms_norm wants contiguous rows: q, k become [T, H, D] copies
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        self.ops.rotary_embedding(batch.positions, q, k, cos_sin_cache, True)
        x = self.post_attention_layernorm(self.o_proj(self.attn(q, k, v, kv_cache, batch)))
        x, residual = self.pre_feedforward_layernorm.add_norm(x, residual)
        x = self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))
        return self.post_feedforward_layernorm(x), residual


class _TextModelReader(WeightReader):
    """The text model's tensors of a multimodal checkpoint under text-model names (``model.*``,
    ``lm_head.weight``); the vision tower's and the projector's are left out, anything else keeps
    its name (so the loader reports it)."""

    def __init__(self, base: WeightReader, prefix: str):
        super().__init__(base.description)
        self.base = base
        self._where = {}
        for name in base.names():
            if name.startswith(prefix):
                self._where["model." + name[len(prefix):]] = name
            elif name == "language_model.lm_head.weight":
                self._where["lm_head.weight"] = name
            elif not name.startswith(_VISION_PREFIXES):
                self._where[name] = name

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.base.shape(self._where[name])

    def _read(self, name: str) -> Tensor:
        return self.base._read(self._where[name])

    def _read_slice(self, name, rows, cols) -> Tensor:
        return self.base._read_slice(self._where[name], rows, cols)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 causal LM (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``; arguments as
    :class:`~fastinfer.models.LlamaForCausalLM`)."""

    decoder_layer = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: Optional[int] = None, ops: Optional[Backend] = None,
                 quant_config: Optional[QuantizationConfig] = None, tp: ParallelInfo = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        if config.architecture not in GEMMA_ARCHITECTURES:
            raise ValueError(f"GemmaForCausalLM runs {', '.join(GEMMA_ARCHITECTURES)}, not {config.architecture}")
        super().__init__(config, dtype=dtype, device=device, max_positions=max_positions, ops=ops,
                         quant_config=quant_config, tp=tp, stage=stage)
        # transformers multiplies by sqrt(hidden) rounded to the model dtype (55.4256 -> 55.5 in bf16)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32)
                             .to(dtype=dtype, device=self.device), persistent=False)
        self.has_sliding_rope = config.sliding_rope_theta is not None
        if self.has_sliding_rope:  # Gemma 3: sliding layers rotate with rope_local_base_freq, unscaled
            self.register_buffer("sliding_cos_sin_cache", build_cos_sin_cache(
                config, self.max_positions, dtype=torch.float32, device=self.device, sliding=True), persistent=False)

    @torch.no_grad()
    def load_weights(self, reader: WeightReader, progress: bool = False) -> "GemmaForCausalLM":
        # a multimodal checkpoint: its text model (a reader already under text-model names, such as
        # a built model's checkpoint_tensors, is read as it is)
        found = [p for p in self.config.text_weights_prefixes if any(n.startswith(p) for n in reader.names())]
        if found:
            reader = _TextModelReader(reader, found[0])
        return super().load_weights(reader, progress)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def rope_cache(self, layer_idx: int) -> Tensor:
        if self.has_sliding_rope and self.config.is_sliding(layer_idx):
            return self.sliding_cos_sin_cache
        return self.cos_sin_cache

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
