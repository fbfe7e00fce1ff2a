"""Llama-family decoder (Llama, Mistral, Qwen2) on the fastinfer ops.

One forward runs a flattened ragged :class:`~fastinfer.models.batch.ForwardBatch` (prefill chunks
first, then one row per decoding sequence) against per-layer paged KV caches and returns float32
logits for the rows in ``batch.logits_indices``. Per layer::

    x = rms_norm(h)  (layer 0)  |  fused_add_rms_norm(x, residual)  (later layers)
    qkv = x @ W_qkv^T (+ b)                  # one GEMM, [T, (Hq + 2 Hkv) * D]
    rotary_embedding(positions, q, k)        # in place on token-strided views of qkv
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    attn = paged_prefill_attention(prefill rows) ++ paged_decode_attention(decode rows)
    x = attn @ W_o^T (+ b);  fused_add_rms_norm(x, residual)
    x = down(silu_and_mul(x @ W_gate_up^T))

then the final norm and ``lm_head`` on the ``logits_indices`` rows only.

Weights live in ``nn.Parameter(requires_grad=False)``; names (``layers.0.qkv_proj.weight`` ...) are
what :mod:`fastinfer.models.loader` fills. Tied embeddings share one Parameter.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from .batch import ForwardBatch
from .config import ModelConfig
from .rope import build_cos_sin_cache

__all__ = [
    "LlamaForCausalLM",
    "make_forward_batch",
    "prefill_logits",
]

Tensor = torch.Tensor
KVCache = Tuple[Tensor, Tensor]


def _ops(namespace: str = "fastinfer"):
    return getattr(torch.ops, namespace)


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.packed: Optional[Tensor] = None  # oneDNN-blocked copy of weight (CPU bf16), see pack_for_cpu

    def pack_for_cpu(self, batch_hint: int = 16) -> None:
        """Keep a oneDNN-blocked copy of the weight for CPU bf16 (AMX / AVX-512 BF16): it skips the
        per-call weight reorder, ~1.5-2x faster at decode batch sizes (CPU). ``weight`` stays."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, dtype, device):
        super().__init__()
        self.weight = _param((hidden,), dtype, device)


class _Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype, device):
        super().__init__()
        self.weight = _param((vocab, hidden), dtype, device)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.op_namespace = "fastinfer"
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.q_size = c.q_size
        self.kv_size = c.kv_size
        self.eps = float(c.rms_norm_eps)
        self.scale = float(c.head_dim) ** -0.5
        self.window_left = c.window_left(layer_idx)
        self.input_layernorm = _RMSNorm(c.hidden_size, dtype, device)
        self.qkv_proj = _Linear(c.q_size + 2 * c.kv_size, c.hidden_size, c.qkv_bias, dtype, device)
        self.o_proj = _Linear(c.hidden_size, c.q_size, c.o_bias, dtype, device)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, dtype, device)
        self.gate_up_proj = _Linear(2 * c.intermediate_size, c.hidden_size, c.mlp_bias, dtype, device)
        self.down_proj = _Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, device)

    def _attention(self, q: Tensor, kv_cache: KVCache, batch: ForwardBatch) -> Tensor:
        ops = _ops(self.op_namespace)
        k_cache, v_cache = kv_cache
        T = q.shape[0]
        P = batch.num_prefill_tokens
        window = self.window_left
        parts = []
        if P > 0:
            if batch.custom_mask is not None and window >= 0:
                # The op takes no window with a tree mask; that is exact as long as no sequence is
                # longer than the window (host sync, only on this rare path).
                if int(batch.prefill_seq_lens_k.max().item()) > window + 1:
                    raise ValueError(
                        f"layer {self.layer_idx}: custom_mask (tree attention) with a sliding window "
                        f"({window + 1}) shorter than the sequence is not supported"
                    )
                window = -1
            out, _ = ops.paged_prefill_attention(
                q[:P], k_cache, v_cache, batch.prefill_block_table, batch.prefill_cu_seqlens_q,
                batch.prefill_seq_lens_k, int(batch.prefill_max_seqlen_q), self.scale, True, window,
                0.0, batch.custom_mask, False,
            )
            parts.append(out)
            window = self.window_left
        if T > P:
            out, _ = ops.paged_decode_attention(
                q[P:], k_cache, v_cache, batch.decode_block_table, batch.decode_seq_lens, self.scale,
                window, 0.0, 0, False, None, None,
            )
            parts.append(out)
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return attn.reshape(T, self.q_size)

    def forward(
        self,
        x: Tensor,
        residual: Optional[Tensor],
        batch: ForwardBatch,
        kv_cache: KVCache,
        cos_sin_cache: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        """``x``: the previous layer's MLP output (or the embeddings for layer 0, with
        ``residual=None``). Returns ``(mlp_out, residual)``; both ``[T, hidden]``."""
        ops = _ops(self.op_namespace)
        if residual is None:
            residual = x
            x = ops.rms_norm(x, self.input_layernorm.weight, self.eps)
        else:
            ops.fused_add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        ops.rotary_embedding(batch.positions, q, k, cos_sin_cache, True)
        ops.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], batch.slot_mapping, None, None)
        x = self.o_proj(self._attention(q, kv_cache, batch))
        ops.fused_add_rms_norm(x, residual, self.post_attention_layernorm.weight, self.eps)
        x = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return x, residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM (weights uninitialised until loaded, see
    :func:`fastinfer.models.loader.load_model`).

    Args:
        config: the :class:`ModelConfig`.
        dtype: weight and activation dtype (float32 on CPU; bfloat16/float16 on CUDA).
        device: where weights, RoPE table and (via :meth:`allocate_kv_cache`) caches live.
        max_positions: rows of the RoPE table (largest position + 1 the model accepts); default
            ``config.max_model_len``.
        op_namespace: ``"fastinfer"`` (default) or ``"fastinfer_sim"`` (the CUDA kernel sources
            run by the CPU emulator; needs ``import fastinfer._sim``, fp16/bf16 only, slow: tests).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device=None,
        max_positions: Optional[int] = None,
        op_namespace: str = "fastinfer",
    ):
        super().__init__()
        if config.head_dim not in (64, 128, 256):
            raise ValueError(
                f"head_dim {config.head_dim} is not supported by the fastinfer attention ops "
                "(64 or 128; 256 on CPU)"
            )
        device = torch.device("cpu" if device is None else device)
        self.config = config
        self.dtype = dtype
        self.device = device
        c = config
        self.embed_tokens = _Embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(c, i, dtype, device) for i in range(c.num_hidden_layers)]
        )
        self.norm = _RMSNorm(c.hidden_size, dtype, device)
        self.lm_head = _Linear(c.vocab_size, c.hidden_size, False, dtype, device)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.set_op_namespace(op_namespace)
        self.max_positions = int(c.max_model_len if max_positions is None else max_positions)
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(c, self.max_positions, dtype=torch.float32, device=device),
            persistent=False,
        )

    def pack_linears_for_cpu(self) -> bool:
        """Pre-pack every linear's weight for oneDNN when running bf16 on a CPU with mkldnn;
        returns whether it did (a no-op elsewhere). Costs one extra copy of the linear weights."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return False
        if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            return False
        for m in self.modules():
            if isinstance(m, _Linear):
                m.pack_for_cpu()
        return True

    def set_op_namespace(self, namespace: str) -> None:
        """Route every op call to ``torch.ops.<namespace>`` (``fastinfer`` or ``fastinfer_sim``)."""
        if namespace not in ("fastinfer", "fastinfer_sim"):
            raise ValueError(f"unknown op namespace {namespace!r}")
        self.op_namespace = namespace
        for m in self.modules():  # the layers, and quantised linears (fastinfer.quant)
            if m is not self and hasattr(m, "op_namespace"):
                m.op_namespace = namespace

    # ------------------------------------------------------------------------------------------
    # KV cache
    # ------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> Tuple[int, int, int, int]:
        """Shape of ONE of a layer's two caches: ``[num_blocks, block_size, Hkv, D]``."""
        return (int(num_blocks), int(block_size), self.config.num_key_value_heads, self.config.head_dim)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes one KV block takes over all layers (K and V), for sizing the cache."""
        dt = self.dtype if dtype is None else dtype
        per = block_size * self.config.num_key_value_heads * self.config.head_dim
        return 2 * self.num_layers * per * torch.empty((), dtype=dt).element_size()

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: Optional[torch.dtype] = None, device=None
    ) -> List[KVCache]:
        """Per-layer ``(k_cache, v_cache)`` zero tensors of :meth:`kv_cache_shape` (model dtype
        and device by default)."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        dt = self.dtype if dtype is None else dtype
        dev = self.device if device is None else device
        return [
            (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
            for _ in range(self.num_layers)
        ]

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: Sequence[KVCache]) -> Tensor:
        """Run one ragged batch; returns float32 logits ``[len(batch.logits_indices), vocab]``.

        Writes the new tokens' K/V into ``kv_caches`` (one ``(k, v)`` per layer) at
        ``batch.slot_mapping``. All index tensors must be on the model's device.
        """
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} per-layer kv caches, got {len(kv_caches)}")
        if batch.num_tokens == 0:
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=self.device)
        h = self.hidden_states(batch, kv_caches)
        h = h.index_select(0, batch.logits_indices)
        return self.lm_head(h).float()

    def hidden_states(self, batch: ForwardBatch, kv_caches: Sequence[KVCache]) -> Tensor:
        """Final-normed hidden states ``[T, hidden]`` of every row (no lm_head)."""
        x = torch.nn.functional.embedding(batch.input_ids, self.embed_tokens.weight)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, batch, cache, self.cos_sin_cache)
        if residual is None:  # no layers
            return _ops(self.op_namespace).rms_norm(x, self.norm.weight, float(self.config.rms_norm_eps))
        _ops(self.op_namespace).fused_add_rms_norm(x, residual, self.norm.weight, float(self.config.rms_norm_eps))
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()


# ------------------------------------------------------------------------------------------------
# Engine-free helpers (tests, examples)
# ------------------------------------------------------------------------------------------------


def make_forward_batch(
    prefill: Sequence[Tuple[Sequence[int], int, Sequence[int]]] = (),
    decode: Sequence[Tuple[int, int, Sequence[int]]] = (),
    block_size: int = 16,
    device=None,
    all_logits: bool = False,
    custom_mask: Optional[Tensor] = None,
) -> ForwardBatch:
    """Build a :class:`ForwardBatch` by hand.

    Args:
        prefill: per prefill sequence ``(new_token_ids, num_cached, block_ids)``: the chunk's
            tokens occupy positions ``num_cached .. num_cached + len - 1``; ``block_ids`` is that
            sequence's block table (physical block per logical block; must cover the chunk).
        decode: per decoding sequence ``(token_id, position, block_ids)`` (``position`` = tokens
            already cached; seq_len after the step = position + 1).
        block_size: the caches' block size.
        all_logits: logits for every prefill row (default: the last row of each chunk); decode
            rows always get logits.
    """
    device = torch.device("cpu" if device is None else device)
    ids: List[int] = []
    pos: List[int] = []
    slots: List[int] = []
    logits_idx: List[int] = []

    def slot(blocks: Sequence[int], p: int) -> int:
        if p // block_size >= len(blocks):
            raise ValueError(f"position {p} is outside the {len(blocks)} blocks given")
        return int(blocks[p // block_size]) * block_size + p % block_size

    cu = [0]
    lens_k: List[int] = []
    for toks, start, blocks in prefill:
        toks = list(toks)
        if not toks:
            raise ValueError("empty prefill chunk")
        for i, t in enumerate(toks):
            ids.append(int(t))
            pos.append(start + i)
            slots.append(slot(blocks, start + i))
        if all_logits:
            logits_idx.extend(range(cu[-1], cu[-1] + len(toks)))
        else:
            logits_idx.append(cu[-1] + len(toks) - 1)
        cu.append(cu[-1] + len(toks))
        lens_k.append(start + len(toks))
    num_prefill = len(ids)
    dec_lens: List[int] = []
    for t, p, blocks in decode:
        logits_idx.append(len(ids))
        ids.append(int(t))
        pos.append(int(p))
        slots.append(slot(blocks, p))
        dec_lens.append(int(p) + 1)

    def table(rows: Sequence[Sequence[int]]) -> Tensor:
        width = max(1, max((len(r) for r in rows), default=1))
        t = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, r in enumerate(rows):
            t[i, : len(r)] = torch.tensor(list(r), dtype=torch.int32)
        return t.to(device)

    i64 = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return ForwardBatch(
        input_ids=torch.tensor(ids, **i64),
        positions=torch.tensor(pos, **i64),
        slot_mapping=torch.tensor(slots, **i64),
        num_prefill_tokens=num_prefill,
        prefill_cu_seqlens_q=torch.tensor(cu, **i32) if prefill else None,
        prefill_seq_lens_k=torch.tensor(lens_k, **i32) if prefill else None,
        prefill_block_table=table([b for _, _, b in prefill]) if prefill else None,
        prefill_max_seqlen_q=max((len(list(p[0])) for p in prefill), default=0),
        decode_seq_lens=torch.tensor(dec_lens, **i32) if decode else None,
        decode_block_table=table([b for _, _, b in decode]) if decode else None,
        logits_indices=torch.tensor(logits_idx, **i64),
        custom_mask=custom_mask,
    )


def prefill_logits(model: LlamaForCausalLM, token_ids: Sequence[int], block_size: int = 16) -> Tensor:
    """Logits ``[len(token_ids), vocab]`` (float32) of a whole prompt in one prefill, with a fresh
    cache and the contiguous block table ``0, 1, 2, ...``."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("empty prompt")
    num_blocks = (n + block_size - 1) // block_size
    caches = model.allocate_kv_cache(num_blocks, block_size)
    batch = make_forward_batch(
        prefill=[(list(token_ids), 0, list(range(num_blocks)))],
        block_size=block_size,
        device=model.device,
        all_logits=True,
    )
    return model(batch, caches)
