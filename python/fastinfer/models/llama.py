"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) built from :mod:`fastinfer.layers`.

One forward runs a flattened ragged :class:`~fastinfer.layers.ForwardBatch` (prefill chunks first,
then one row per decoding sequence) against per-layer paged KV caches and returns float32 logits
for the rows in ``batch.logits_indices``. Per layer::

    x = rms_norm(h)  (layer 0)  |  fused_add_rms_norm(x, residual)  (later layers)
    qkv = x @ W_qkv^T (+ b)                  # one GEMM, [T, (Hq + 2 Hkv) * D]
    q, k = rms_norm(q [T, Hq, D]), rms_norm(k [T, Hkv, D])   # Qwen3 only (q_norm / k_norm, weight [D])
    rotary_embedding(positions, q, k)        # in place on token-strided views of qkv
    attn = PagedAttention(q, k, v)           # reshape_and_cache, then paged prefill / decode
    x = attn @ W_o^T (+ b);  fused_add_rms_norm(x, residual)
    x = down(silu_and_mul(x @ W_gate_up^T))

then the final norm and ``lm_head`` on the ``logits_indices`` rows only.

Every layer loads its own weights by checkpoint (Hugging Face) name; :data:`PACKED_MODULES` is the
one table of which checkpoint projections are fused into which of our linears.

Tensor parallelism (``tp``, world size N): q/k/v and gate/up are column-parallel, o_proj and
down_proj row-parallel (one all-reduce each), embedding and lm_head vocabulary-parallel; each rank
holds ``Hq / N`` query heads and ``Hkv / N`` KV heads, or, when N exceeds ``Hkv``, one KV head
replicated over ``N / Hkv`` ranks (as vLLM does). Norms and the RoPE table are replicated.

Pipeline parallelism (``stage``, :class:`~fastinfer.distributed.pipeline.PipelineStage`): the model
holds layers ``[stage.start, stage.end)`` only (``layers[j]`` is layer ``stage.start + j``), the
embedding on the first stage, the final norm and ``lm_head`` on the last (a tied ``lm_head`` on a
last stage without the embedding reads the embedding's tensor itself); :meth:`stage_layers` runs a
stage's part of a forward.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..layers import (
    CheckpointModule,
    ColumnParallelLinear,
    ForwardBatch,
    KVCache,
    Linear,
    LMHead,
    PagedAttention,
    QuantizationConfig,
    RMSNorm,
    RowParallelLinear,
    VocabEmbedding,
    WeightPart,
    WeightReader,
)
from ..distributed import SINGLE, ParallelInfo
from ..distributed.pipeline import WHOLE_MODEL, PipelineStage
from ..layers.attention import FP8_KV_CACHE_DTYPE, report_fp8_kv_cache_scales
from ..ops import Backend, backend
from .config import GEMMA_ARCHITECTURES, MLA_ARCHITECTURES, MOE_ARCHITECTURES, ModelConfig
from .rope import build_cos_sin_cache

__all__ = ["LlamaForCausalLM", "PACKED_MODULES", "attention_shards"]

Tensor = torch.Tensor

# Our fused linear -> the checkpoint projections (relative to "model.layers.{i}.") it holds, in row
# order. The loaders, the quantisers and the checkpoint writers all read it through the layers.
PACKED_MODULES: Dict[str, Tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}

# checkpoint tensors that are not weights (rotary tables some exporters write)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".inv_freq")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def attention_shards(config: ModelConfig, tp: ParallelInfo) -> Tuple[int, int, Tuple[int, int]]:
    """``(query heads, KV heads, (index, count) of the K/V row slice)`` of rank ``tp.rank``."""
    n, hq, hkv = tp.world_size, config.num_attention_heads, config.num_key_value_heads
    if hq % n:
        raise ValueError(f"num_attention_heads={hq} does not split over tensor_parallel_size={n}")
    if n <= hkv:
        if hkv % n:
            raise ValueError(f"num_key_value_heads={hkv} does not split over tensor_parallel_size={n}")
        return hq // n, hkv // n, (tp.rank, n)
    if n % hkv:
        raise ValueError(f"tensor_parallel_size={n} is larger than num_key_value_heads={hkv} and not a multiple "
                         "of it: KV heads can only be replicated evenly")
    return hq // n, 1, (tp.rank * hkv // n, hkv)


def init_layer_geometry(layer: nn.Module, config: ModelConfig, layer_idx: int, tp: ParallelInfo,
                        ops) -> Tuple[Tuple[int, int], str]:
    """The attention geometry a decoder layer keeps (its index, this rank's heads, q / kv widths, the
    op backend); returns ``(kv_shard, checkpoint prefix)`` for its linears."""
    layer.layer_idx = layer_idx
    layer.num_heads, layer.num_kv_heads, kv_shard = attention_shards(config, tp)
    layer.head_dim = config.head_dim
    layer.q_size = layer.num_heads * config.head_dim
    layer.kv_size = layer.num_kv_heads * config.head_dim
    layer.ops = ops
    return kv_shard, f"model.layers.{layer_idx}"


def packed_parts(prefix: str, slot: str, sizes: Sequence[int]) -> List[WeightPart]:
    """The checkpoint parts (name under ``prefix``, rows) of our fused linear ``slot``."""
    return [WeightPart(f"{prefix}.{name}", n) for name, n in zip(PACKED_MODULES[slot], sizes)]


def norm_for(norm: nn.Module, x: Tensor, linear: Optional[nn.Module]):
    """``norm(x)`` as ``linear``'s input: an :class:`RMSNorm` may fuse the quantisation its linear
    takes (:meth:`RMSNorm.norm_for`); any other module (the EAGLE-1 head's ``nn.Identity`` input
    norm) runs as it is."""
    if isinstance(norm, RMSNorm):
        return norm.norm_for(x, linear)
    return norm(x)


def add_norm_for(norm: nn.Module, x: Tensor, residual: Tensor, linear: Optional[nn.Module]):
    """``norm.add_norm(x, residual)`` as ``linear``'s input, fused with its quantisation where
    ``norm`` is an :class:`RMSNorm` (:meth:`RMSNorm.add_norm_for`)."""
    if isinstance(norm, RMSNorm):
        return norm.add_norm_for(x, residual, linear)
    return norm.add_norm(x, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype, device, ops,
                 quant_config: Optional[QuantizationConfig], tp: ParallelInfo = SINGLE):
        super().__init__()
        c = config
        kv_shard, prefix = init_layer_geometry(self, c, layer_idx, tp, ops)
        kw = dict(dtype=dtype, device=device, ops=ops)
        lin = dict(kw, quant_config=quant_config, tp=tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, f"{prefix}.input_layernorm", **kw)
        self.init_qkv(c, prefix, kv_shard, lin)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, c.head_dim,
                                   float(c.head_dim) ** -0.5, c.window_left(layer_idx), layer_idx, ops=ops,
                                   prefix=f"{prefix}.self_attn", kv_shard=kv_shard, device=device,
                                   sinks_shard=(tp.rank, tp.world_size) if c.attention_sinks else None)
        self.o_proj = RowParallelLinear(c.q_size, packed_parts(prefix, "o_proj", (c.hidden_size,)), c.o_bias, **lin)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps,
                                                f"{prefix}.post_attention_layernorm", **kw)
        self.init_mlp(c, prefix, lin)

    def init_qkv(self, c: ModelConfig, prefix: str, kv_shard: Tuple[int, int], lin: dict) -> None:
        """The q/k/v projection and the q/k norms (``lin``: the linears' keyword arguments); :meth:`qkv`
        runs them."""
        tp = lin["tp"]
        self.qkv_proj = ColumnParallelLinear(c.hidden_size,
                                             packed_parts(prefix, "qkv_proj", (c.q_size, c.kv_size, c.kv_size)),
                                             c.qkv_bias, part_shards=[(tp.rank, tp.world_size), kv_shard, kv_shard],
                                             **lin)
        self.q_norm = self.k_norm = None
        if c.qk_norm:  # per-head RMSNorm over head_dim before RoPE (Qwen3)
            kw = dict(dtype=lin["dtype"], device=lin["device"], ops=lin["ops"])
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, f"{prefix}.self_attn.q_norm", **kw)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, f"{prefix}.self_attn.k_norm", **kw)

    def qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """This rank's ``q [T, Hq, D]``, ``k``, ``v [T, Hkv, D]`` of the normed input (a tensor or the
        :class:`~fastinfer.layers.QuantizedInput` of ``qkv_proj``), before RoPE (token-strided views
        where no norm copies them)."""
        qkv = self.qkv_proj(x)  # x: a tensor, or a QuantizedInput from the norm
        T = qkv.shape[0]
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # rms_norm wants contiguous rows: q, k become [T, H, D] copies
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        return q, k, v

    def init_mlp(self, c: ModelConfig, prefix: str, lin: dict) -> None:
        """The feed-forward block (``lin``: the linears' keyword arguments); :meth:`mlp` runs it."""
        F = c.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(c.hidden_size, packed_parts(prefix, "gate_up_proj", (F, F)),
                                                 c.mlp_bias, **lin)
        self.down_proj = RowParallelLinear(F, packed_parts(prefix, "down_proj", (c.hidden_size,)), c.mlp_bias, **lin)

    def mlp(self, x: Tensor) -> Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))

    def mlp_input(self) -> Optional[Linear]:
        """The linear that alone reads :meth:`mlp`'s input (its norm may quantise for it), or None."""
        return self.gate_up_proj

    def forward(self, x: Tensor, residual: Optional[Tensor], batch: ForwardBatch, kv_cache: KVCache,
                cos_sin_cache: Tensor) -> Tuple[Tensor, Tensor]:
        """``x``: the previous layer's MLP output (or the embeddings for layer 0, with
        ``residual=None``). Returns ``(mlp_out, residual)``; both ``[T, hidden]``."""
        if residual is None:
            residual, x = x, norm_for(self.input_layernorm, x, self.qkv_proj)
        else:
            x, residual = add_norm_for(self.input_layernorm, x, residual, self.qkv_proj)
        return self.attention_mlp(x, residual, batch, kv_cache, cos_sin_cache)

    def attention_mlp(self, x: Tensor, residual: Tensor, batch: ForwardBatch, kv_cache: KVCache,
                      cos_sin_cache: Tensor) -> Tuple[Tensor, Tensor]:
        """The layer after its input norm: ``x`` the normed input (``qkv_proj``'s width), ``residual``
        the stream (updated in place). Returns ``(mlp_out, residual)``."""
        q, k, v = self.qkv(x)
        self.ops.rotary_embedding(batch.positions, q, k, cos_sin_cache, True)
        x = self.o_proj(self.attn(q, k, v, kv_cache, batch))
        x, residual = add_norm_for(self.post_attention_layernorm, x, residual, self.mlp_input())
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM (weights uninitialised until :meth:`load_weights`, see
    :func:`fastinfer.models.load_model`). Other decoders reuse it through ``decoder_layer`` /
    ``norm_class`` and the :meth:`embed`, :meth:`rope_cache` and :meth:`compute_logits` hooks
    (:class:`~fastinfer.models.gemma.GemmaForCausalLM`).

    Args:
        config: the :class:`ModelConfig`.
        dtype: weight and activation dtype (:func:`fastinfer.models.load_model` and the runner
            pass :func:`fastinfer.models.default_dtype`'s unless one is given).
        device: where weights, RoPE table and (via :meth:`allocate_kv_cache`) caches live.
        max_positions: rows of the RoPE table (largest position + 1 the model accepts); default
            ``config.max_model_len``.
        ops: the :class:`~fastinfer.ops.Backend` every layer calls (default ``backend("fastinfer")``;
            ``backend("fastinfer_sim")``: the CUDA kernel sources run by the CPU emulator, fp16/bf16
            only, slow: tests; ``deterministic=True``: the batch-invariant mode). Fixed for the
            model's life: every layer holds this one backend.
        quant_config: chooses each linear's method (:mod:`fastinfer.quant`); None: float.
        tp: this rank's place in the tensor-parallel group (the model is then its shard).
        stage: the pipeline stage (its layers only; default: the whole model).
    """

    decoder_layer = LlamaDecoderLayer
    norm_class = RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: Optional[int] = None, ops: Optional[Backend] = None,
                 quant_config: Optional[QuantizationConfig] = None, tp: ParallelInfo = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        super().__init__()
        if self.decoder_layer is LlamaDecoderLayer and config.architecture in (GEMMA_ARCHITECTURES + MOE_ARCHITECTURES
                                                                                + MLA_ARCHITECTURES):
            own_class = ("GemmaForCausalLM" if config.architecture in GEMMA_ARCHITECTURES else "DeepseekForCausalLM"
                         if config.architecture in MLA_ARCHITECTURES else "MoeForCausalLM")
            raise ValueError(f"{config.architecture} is not a Llama-family dense model: build it with {own_class} "
                             "(fastinfer.models.model_class / load_model choose it)")
        if config.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {config.head_dim} is not supported by the fastinfer attention ops "
                             "(64, 128 or 256)")
        device = torch.device("cpu" if device is None else device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.quant_config = quant_config
        self.tp = tp
        self.stage = stage
        self.ops = backend() if ops is None else ops
        c = config
        kw = dict(dtype=dtype, device=device)
        self.num_local_kv_heads = attention_shards(c, tp)[1]
        self.embed_tokens = self.norm = self.lm_head = None  # (absent on the stages that do not hold them)
        if stage.is_first:
            self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, "model.embed_tokens", tp=tp, **kw)
        self.layers = nn.ModuleList([self.decoder_layer(c, i, ops=self.ops, quant_config=quant_config, tp=tp, **kw)
                                     for i in stage.layer_range(c.num_hidden_layers)])
        if stage.is_last:
            self.norm = self.norm_class(c.hidden_size, c.rms_norm_eps, "model.norm", ops=self.ops, **kw)
            tied = c.tie_word_embeddings
            self.lm_head = LMHead(c.vocab_size, c.hidden_size, "lm_head", ops=self.ops, quant_config=quant_config,
                                  tie_to=self.embed_tokens if tied else None, tp=tp,
                                  tied_name="model.embed_tokens" if tied and self.embed_tokens is None else None,
                                  **kw)
        self.max_positions = int(c.max_model_len if max_positions is None else max_positions)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(c, self.max_positions, dtype=torch.float32,
                                                                  device=device), persistent=False)

    # ------------------------------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------------------------------
    def linear_layers(self) -> Iterator[Linear]:
        return (m for m in self.modules() if isinstance(m, Linear))

    @torch.no_grad()
    def load_weights(self, reader: WeightReader, progress: bool = False) -> "LlamaForCausalLM":
        """Every layer reads its tensors from ``reader``; a tensor no layer read is an error."""
        modules: Iterable[CheckpointModule] = [m for m in self.modules() if isinstance(m, CheckpointModule)]
        if progress:
            try:
                from tqdm.auto import tqdm

                modules = tqdm(modules, desc="loading weights", unit="layer")
            except ImportError:  # tqdm is optional
                pass
        for m in modules:
            m.load_from(reader)
        for name in reader.unused():
            if not name.endswith(IGNORED_SUFFIXES) and not self._other_stage_tensor(name):
                raise ValueError(f"unexpected tensor {name!r} in checkpoint {reader.description} "
                                 f"(not part of {self.config.architecture})")
        return self

    def _other_stage_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage (this one does not read it)."""
        if self.stage.num_stages == 1:
            return False
        m = _LAYER_INDEX.search(name)
        if m is not None:
            return not self.stage.owns_layer(int(m.group(1)))
        if "embed_tokens" in name:
            return not self.stage.is_first
        return not self.stage.is_last  # the final norm, lm_head

    def checkpoint_tensors(self) -> Iterator[Tuple[str, Tensor]]:
        """The float weights under their checkpoint names (the inverse of :meth:`load_weights`)."""
        for m in self.modules():
            if isinstance(m, CheckpointModule):
                yield from m.checkpoint_tensors()

    def pack_linears_for_cpu(self) -> bool:
        """Pre-pack every float linear's weight for oneDNN when running bf16 on a CPU with mkldnn;
        returns whether it did (a no-op elsewhere, and in the deterministic mode). Costs one extra
        copy of the linear weights."""
        if self.ops.deterministic:
            return False
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return False
        if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            return False
        float_linears = [m for m in self.linear_layers() if hasattr(m.method, "pack_for_cpu")]
        for i, layer in enumerate(float_linears):
            try:
                layer.method.pack_for_cpu(layer)
            except RuntimeError:  # oneDNN's bf16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
                if i == 0:
                    return False
                raise
        return True

    @property
    def op_namespace(self) -> str:
        return self.ops.namespace

    # ------------------------------------------------------------------------------------------
    # KV cache
    # ------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """The layers this model holds (its stage's under pipeline parallelism): one KV cache each."""
        return len(self.layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> Tuple[int, int, int, int]:
        """Shape of ONE of a layer's two caches: ``[num_blocks, block_size, Hkv, D]`` (this rank's
        KV heads under TP)."""
        return (int(num_blocks), int(block_size), self.num_local_kv_heads, self.config.head_dim)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes one KV block takes over all layers (K and V), for sizing the cache."""
        dt = self.dtype if dtype is None else dtype
        per = block_size * self.num_local_kv_heads * self.config.head_dim
        return 2 * self.num_layers * per * torch.empty((), dtype=dt).element_size()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: Optional[torch.dtype] = None,
                          device=None) -> List[KVCache]:
        """Per-layer ``(k_cache, v_cache)`` zero tensors of :meth:`kv_cache_shape` (model dtype
        and device by default; ``dtype`` :data:`~fastinfer.layers.attention.FP8_KV_CACHE_DTYPE`: an
        fp8 cache, written and read with each layer's ``k_scale`` / ``v_scale``)."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        dt = self.dtype if dtype is None else dtype
        if dt == FP8_KV_CACHE_DTYPE:
            report_fp8_kv_cache_scales((layer.attn for layer in self.layers), self.config.architecture)
        dev = self.device if device is None else device
        return [(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
                for _ in range(self.num_layers)]

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: Sequence[KVCache]) -> Tensor:
        """Run one ragged batch; returns float32 logits ``[len(batch.logits_indices), vocab]``.

        Writes the new tokens' K/V into ``kv_caches`` (one ``(k, v)`` per layer) at
        ``batch.slot_mapping``. All index tensors must be on the model's device.
        """
        if batch.num_tokens == 0:  # (every rank sees the same batch: all of them return here)
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=self.device)
        h = self.hidden_states(batch, kv_caches)
        return self.compute_logits(h.index_select(0, batch.logits_indices))

    def hidden_states(self, batch: ForwardBatch, kv_caches: Sequence[KVCache]) -> Tensor:
        """Final-normed hidden states ``[T, hidden]`` of every row (no lm_head)."""
        return self.aux_hidden_states(batch, kv_caches, ())[0]

    def aux_hidden_states(self, batch: ForwardBatch, kv_caches: Sequence[KVCache],
                          layer_ids: Sequence[int]) -> Tuple[Tensor, Tensor]:
        """``(final-normed hidden states [T, hidden], aux [T, len(layer_ids) * hidden])``: aux holds,
        per id ``i`` in order, the residual stream entering layer ``i`` (the un-normed output of
        layer ``i - 1``; id 0 is the embedding), as EAGLE-3 heads read it (vLLM's aux layer ids)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} per-layer kv caches, got {len(kv_caches)}")
        bad = [i for i in layer_ids if not 0 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(f"aux hidden-state layer ids {bad} out of range for {self.num_layers} layers")
        taken: Dict[int, Tensor] = {}
        x, residual = self.stage_layers(batch, kv_caches, None, None, layer_ids, taken)
        aux = torch.cat([taken[int(i)] for i in layer_ids], dim=-1) if layer_ids else x[:, :0]
        if residual is None:  # no layers
            return self.norm(x), aux
        x, _ = self.norm.add_norm(x, residual)
        return x, aux

    def stage_layers(self, batch: ForwardBatch, kv_caches: Sequence[KVCache], x: Optional[Tensor],
                     residual: Optional[Tensor], layer_ids: Sequence[int] = (),
                     taken: Optional[Dict[int, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """The layers this model holds over ``batch``, from the embeddings (``x`` None: the first
        stage) or from the previous stage's ``(x, residual)``; returns ``(x, residual)`` after its
        last layer (the next stage's input; the last stage's go to :meth:`final_logits`). ``taken``: filled
        with the residual stream entering each layer of ``layer_ids`` (:meth:`aux_hidden_states`)."""
        if x is None:
            x = self.embed(batch.input_ids)
        for layer, cache in zip(self.layers, kv_caches):
            i = layer.layer_idx
            if i in layer_ids:  # copies: the next layer's add_norm updates x and residual in place
                taken[i] = x.clone() if residual is None else x + residual
            x, residual = layer(x, residual, batch, cache, self.rope_cache(i))
        return x, residual

    def final_logits(self, batch: ForwardBatch, x: Tensor, residual: Tensor) -> Tensor:
        """The last stage: float32 logits of the ``batch.logits_indices`` rows of its last layer's
        ``(x, residual)`` (final norm, then :meth:`compute_logits`)."""
        x, _ = self.norm.add_norm(x, residual)
        return self.compute_logits(x.index_select(0, batch.logits_indices))

    def embed(self, input_ids: Tensor) -> Tensor:
        """The residual stream entering layer 0: ``[T, hidden]`` in the model dtype."""
        return self.embed_tokens(input_ids)

    def rope_cache(self, layer_idx: int) -> Tensor:
        """The ``cos_sin_cache`` layer ``layer_idx`` rotates q and k with."""
        return self.cos_sin_cache

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits of hidden states ``[N, hidden]`` (under TP: on rank 0; the other ranks get
        their vocabulary slice)."""
        return self.lm_head(hidden)
