"""Paged attention of one layer over a :class:`~fastinfer.layers.batch.ForwardBatch`.

Writes the new tokens' K/V to the layer's paged cache (``reshape_and_cache``), then attends:
``paged_prefill_attention`` for the prefill rows (chunks, prefix-cache continuations, speculative
trees with their ``custom_mask``; a sliding window applies on top of a tree mask by tree position)
and ``paged_decode_attention`` for the decode rows.

fp8 KV cache: a cache of dtype :data:`FP8_KV_CACHE_DTYPE` holds ``e4m3(K / k_scale)`` and
``e4m3(V / v_scale)``; the layer then gives its ``k_scale`` / ``v_scale`` to all three ops, so every
path that writes or reads the cache (prefill chunks, prefix-cache hits, decode, speculative trees,
recompute after preemption, CUDA graphs) uses the same scales. A cache in the model dtype takes
none. The scales are float32 buffers on the model's device, created with the layer (CUDA graphs
capture these tensors): 1.0, or what the checkpoint holds under ``<prefix>.k_scale`` /
``<prefix>.v_scale`` (``model.layers.{i}.self_attn.k_scale``: vLLM's name, and what
compressed-tensors writes for a ``kv_cache_scheme``), one value per tensor or one per KV head (then
sliced to this rank's KV heads under tensor parallelism).

Attention sinks (gpt-oss): a layer built with ``sinks_shard`` loads ``<prefix>.sinks`` (one logit
per query head, transformers' ``self_attn.sinks``; this rank's heads under tensor parallelism) into
a float32 buffer and gives it to both attention ops: each head's softmax denominator gains
``exp(sinks[h])``, a key with no value.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Tuple

import torch

from .batch import ForwardBatch
from .weights import CheckpointModule, WeightReader

Tensor = torch.Tensor
KVCache = Tuple[Tensor, Tensor]

__all__ = ["PagedAttention", "KVCache", "FP8_KV_CACHE_DTYPE", "KV_SCALE_NAMES", "report_fp8_kv_cache_scales"]

logger = logging.getLogger(__name__)

#: The element type of an fp8 KV cache (what the attention ops read and ``reshape_and_cache`` writes).
FP8_KV_CACHE_DTYPE = torch.float8_e4m3fn

#: A layer's KV-cache scale tensors, relative to its checkpoint prefix.
KV_SCALE_NAMES = ("k_scale", "v_scale")


class PagedAttention(CheckpointModule):
    """``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` (views into the fused qkv output are fine) ->
    ``[T, Hq * D]``. ``window_left`` >= 0: sliding window (Mistral, Gemma), -1: full attention.
    ``softcap`` > 0: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2), 0: off.

    ``prefix``: the checkpoint module whose ``k_scale`` / ``v_scale`` this layer loads (None: it
    loads none); ``kv_shard``: ``(index, count)`` of this rank's slice of the checkpoint's KV
    heads (as the K/V projections are sliced); ``sinks_shard``: the layer has attention sinks
    (``<prefix>.sinks``), of which this rank holds slice ``(index, count)`` (its query heads); None:
    no sinks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window_left: int,
                 layer_idx: int, *, ops, softcap: float = 0.0, prefix: Optional[str] = None,
                 kv_shard: Tuple[int, int] = (0, 1), sinks_shard: Optional[Tuple[int, int]] = None, device=None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.window_left = int(window_left)
        self.softcap = float(softcap)
        self.layer_idx = layer_idx
        self.ops = ops
        self.prefix = prefix
        self.kv_shard = (int(kv_shard[0]), int(kv_shard[1]))
        for name in KV_SCALE_NAMES:
            self.register_buffer(name, torch.ones(1, dtype=torch.float32, device=device), persistent=False)
        self.scales_from_checkpoint = False
        self.sinks_shard = sinks_shard
        if sinks_shard is not None and prefix is None:
            raise ValueError("attention sinks are read from the checkpoint: the layer needs its prefix")
        self.register_buffer("sinks", None if sinks_shard is None else
                             torch.zeros(num_heads, dtype=torch.float32, device=device), persistent=False)

    # ---- fp8 cache scales -------------------------------------------------------------------------
    @property
    def checkpoint_num_kv_heads(self) -> int:
        """KV heads in the checkpoint (this rank holds slice ``kv_shard`` of them)."""
        return self.num_kv_heads * self.kv_shard[1]

    def load_from(self, reader: WeightReader) -> None:
        """The layer's sinks (when built with them) and its ``k_scale`` / ``v_scale`` when the
        checkpoint has them (both or neither)."""
        if self.prefix is None:
            return
        if self.sinks_shard is not None:
            index, count = self.sinks_shard
            name = f"{self.prefix}.sinks"
            whole = reader.get_float(name, (self.num_heads * count,))
            with torch.no_grad():
                self.sinks.copy_(whole.reshape(count, self.num_heads)[index].to(torch.float32))
        names = [f"{self.prefix}.{n}" for n in KV_SCALE_NAMES]
        present = [reader.has(n) for n in names]
        if not any(present):
            return
        if not all(present):
            have, lack = (names[0], names[1]) if present[0] else (names[1], names[0])
            raise ValueError(f"checkpoint {reader.description} has {have!r} but not {lack!r}: KV-cache scales come "
                             "in pairs")
        with torch.no_grad():
            for attr, name in zip(KV_SCALE_NAMES, names):
                value = self._rank_scale(name, reader.get(name))
                buf = getattr(self, attr)
                if buf.shape == value.shape:
                    buf.copy_(value)
                else:  # per KV head: a buffer of the new shape, made before any graph captures it
                    setattr(self, attr, value.to(buf.device))
        self.scales_from_checkpoint = True

    def _rank_scale(self, name: str, t: Tensor) -> Tensor:
        """Checkpoint scale ``name`` as this rank uses it: float32 ``[1]`` (per tensor: replicated) or
        ``[Hkv]`` (per KV head: this rank's slice)."""
        total = self.checkpoint_num_kv_heads
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; a KV-cache scale is a float tensor")
        # per tensor: any shape of one element; per KV head: [Hkv] or compressed-tensors' [Hkv, 1, 1]
        per_head = t.numel() == total and total > 1 and sum(d != 1 for d in t.shape) == 1 and t.shape[0] == total
        if t.numel() != 1 and not per_head:
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}: a KV-cache scale has one element (per "
                             f"tensor) or one per KV head ({total})")
        t = t.detach().reshape(-1).to(torch.float32)
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise ValueError(f"tensor {name!r} holds {t.tolist()}: KV-cache scales must be positive and finite")
        if per_head:
            index, count = self.kv_shard
            t = t.reshape(count, -1)[index].contiguous()
        return t

    def checkpoint_tensors(self) -> Iterable[Tuple[str, Tensor]]:
        """The sinks (this rank's) and the scales the checkpoint gave (none when they are the default 1.0)."""
        if self.sinks is not None:
            yield f"{self.prefix}.sinks", self.sinks.detach()
        if self.scales_from_checkpoint and self.prefix is not None:
            for name in KV_SCALE_NAMES:
                yield f"{self.prefix}.{name}", getattr(self, name).detach()

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, batch: ForwardBatch) -> Tensor:
        k_cache, v_cache = kv_cache
        ops = self.ops
        # an fp8 cache holds K / k_scale and V / v_scale: the write and both reads take the same scales
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if k_cache.dtype == FP8_KV_CACHE_DTYPE else {}
        ops.reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping, **scales)
        if self.sinks is not None:
            scales = dict(scales, sinks=self.sinks)
        T, P = q.shape[0], batch.num_prefill_tokens
        parts = []
        if P > 0:
            parts.append(ops.paged_prefill_attention(
                q[:P], k_cache, v_cache, batch.prefill_block_table, batch.prefill_cu_seqlens_q,
                batch.prefill_seq_lens_k, int(batch.prefill_max_seqlen_q), scale=self.scale, causal=True,
                window_left=self.window_left, softcap=self.softcap, custom_mask=batch.custom_mask, **scales))
        if T > P:
            parts.append(ops.paged_decode_attention(
                q[P:], k_cache, v_cache, batch.decode_block_table, batch.decode_seq_lens, scale=self.scale,
                window_left=self.window_left, softcap=self.softcap, **scales))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return attn.reshape(T, self.num_heads * self.head_dim)


def report_fp8_kv_cache_scales(layers: Iterable[PagedAttention], model_name: str) -> None:
    """Before an fp8 KV pool is allocated for ``layers``: say (log, info) when the checkpoint gave no
    scales, so 1.0 applies."""
    layers = list(layers)
    loaded = sum(layer.scales_from_checkpoint for layer in layers)
    if not loaded:
        logger.info("%s: fp8 KV cache without k_scale / v_scale in the checkpoint: every scale is 1.0", model_name)
    elif loaded < len(layers):
        logger.info("%s: fp8 KV cache with k_scale / v_scale for %d of %d layers; the others use 1.0", model_name,
                    loaded, len(layers))
