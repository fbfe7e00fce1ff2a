"""Python wrappers for the attention ops (``torch.ops.fastinfer.*``).

Conventions (docs/design.md "Attention"): scores ``s = (q . k) * scale``, then
``s = softcap * tanh(s / softcap)`` when ``softcap > 0``. Query ``i`` of a sequence with ``q_len``
queries and ``k_len`` keys sits at absolute position ``p = k_len - q_len + i``; causal masks are
bottom-right aligned (it sees keys ``j <= p``); ``window_left = W >= 0`` restricts it to keys
``j >= p - W``. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``lse`` is float32, the
natural log of the sum of ``exp(s)`` over visible keys; a query that sees no key gets zeros and
``lse = -inf``. Attention sinks (``sinks``, float32 ``[Hq]``, gpt-oss): query head ``h`` adds
``exp(sinks[h])`` to every softmax denominator with no value row (``sinks[h]`` is a logit in the
domain of ``s``), ``lse`` includes it, and a query that sees no key gets zeros and ``lse =
sinks[h]``; the split-KV and deterministic merges count it once. :func:`merge_attention_states`
knows nothing of sinks. Paged KV caches are ``[num_blocks, block_size, Hkv, D]`` with ``block_table
[B, max_blocks] int32`` (token ``j`` of sequence ``b`` is row ``j % BS`` of block
``block_table[b, j // BS]``). Index tensors (``cu_seqlens_*``, ``seq_lens*``) are int32; all
index tensors may be views with any strides (a strided one is read through a contiguous copy).

Scalar options, checked by every backend before any launch (an error naming the argument):
``scale`` finite; ``softcap`` finite and ``>= 0`` (0: off; a NaN is refused, never read as off);
``window_left >= -1`` (-1: no window); ``max_seqlen_q`` / ``max_seqlen_k`` in ``[0, 2^31 - 1]``.

Dtypes: q/k/v float16 or bfloat16 (CPU also float32); D in {64, 128, 256}. Index values
are validated on CPU tensors always and on CUDA tensors when ``FASTINFER_CHECK_INDICES=1`` (else
out-of-range block ids or lengths are undefined behaviour, as in other attention libraries).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ._fake import attention_outputs, check_dim, fake, same_device

Tensor = torch.Tensor
_Result = Union[Tensor, Tuple[Tensor, Tensor]]

__all__ = [
    "prefill_attention",
    "paged_prefill_attention",
    "paged_decode_attention",
    "merge_attention_states",
    "move_kv_slots",
    "pack_custom_mask",
    "mla_cache_write",
    "mla_decode_attention",
    "MLA_LATENT_DIM",
    "MLA_ROPE_DIM",
]

#: Multi-head latent attention (DeepSeek-V3 / R1 / V3.2, Kimi K2, GLM-5): a cache row per token is
#: the compressed latent ``kv_c`` (``MLA_LATENT_DIM`` values) followed by the roped key part
#: ``k_pe`` (``MLA_ROPE_DIM``), shared by every query head.
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64


#: The deterministic mode of the three attention ops (``fixed_split_size = F > 0``).
FIXED_SPLIT_DOC = """``F`` a positive multiple of 64 (the kernels' key tile). Every query row's keys are
reduced in chunks of ``F`` keys from absolute key 0, each chunk in the same tile order with the same
arithmetic, and the chunks' (out, lse) merged left to right; on CUDA decode then runs the prefill
kernel (q_len = 1 rows) so all three ops share one arithmetic. A row's out and lse are bitwise the
same through ``prefill_attention``, ``paged_prefill_attention`` (any q_len, chunked or prefix-cached,
or a tree node under a custom mask, wherever its ancestors sit: the keys are then taken by rank, the
prefix and then the trailing keys the row sees in index order, as if contiguous) and
``paged_decode_attention``, whatever the batch around it. Bits still differ between backends (CPU, CUDA) and between ``F``
values. ``F = 0`` keeps the default kernels (batch-dependent split counts on decode)."""


#: The fp8 KV cache of the two paged ops.
FP8_CACHE_DOC = """A ``float8_e4m3fn`` cache (both caches) holds ``x / scale`` rounded to e4m3
(:func:`fastinfer.ops.reshape_and_cache` with the same scales writes it); ``k_scale`` and ``v_scale``
are float32 with one element (per tensor) or ``Hkv`` elements (per KV head), on q's device. The
kernels dequantise exactly (e4m3 values are representable in fp16 / bf16) and apply the scales in
fp32: ``k_scale`` to the scores, ``v_scale`` to the output. Caches in q's dtype take no scales."""


def _result(out_lse: Tuple[Tensor, Tensor], return_lse: bool) -> _Result:
    return (out_lse[0], out_lse[1]) if return_lse else out_lse[0]


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: Optional[float] = None,
    causal: bool = True,
    window_left: int = -1,
    softcap: float = 0.0,
    return_lse: bool = False,
    fixed_split_size: int = 0,
    sinks: Optional[Tensor] = None,
    *,
    lib=None,
) -> _Result:
    """Varlen (ragged batch) attention with contiguous K/V (FlashAttention-2 kernel on CUDA).

    Args:
        q: ``[T, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (heads packed, any token stride).
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32 prefix sums of the per-sequence lengths.
        max_seqlen_q, max_seqlen_k: upper bounds of the lengths (size the launch grid).
        scale: defaults to ``1 / sqrt(D)``.
        fixed_split_size: 0 (default) or the deterministic mode (:data:`FIXED_SPLIT_DOC`).
        sinks: optional float32 ``[Hq]`` attention sinks (module docstring).

    Returns:
        ``out [T, Hq, D]`` (dtype of q), and ``lse [T, Hq]`` float32 when ``return_lse``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    res = (lib or torch.ops.fastinfer).prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                int(max_seqlen_k), float(scale), bool(causal), int(window_left),
                                                float(softcap), bool(return_lse), int(fixed_split_size), sinks)
    return _result(res, return_lse)


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    max_seqlen_q: int,
    scale: Optional[float] = None,
    causal: bool = True,
    window_left: int = -1,
    softcap: float = 0.0,
    custom_mask: Optional[Tensor] = None,
    return_lse: bool = False,
    packed_custom_mask: Optional[Tensor] = None,
    fixed_split_size: int = 0,
    sinks: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    *,
    lib=None,
) -> _Result:
    """Attention of new queries against a paged KV cache: chunked prefill, prefix-cache hits and
    speculative tree verification.

    The ``q_len`` queries of sequence ``b`` are its LAST ``q_len`` tokens, already written to the
    cache (``seq_lens_k[b]`` keys in all). ``custom_mask`` (bool, per sequence a flattened
    ``[q_len, q_len]`` block, concatenated over the batch) replaces the causal rule among those
    trailing keys (tree attention); prefix keys stay visible. ``packed_custom_mask`` is the same
    mask with 8 entries per byte (uint8 ``[ceil(sum q_len^2 / 8)]``, entry ``e`` of the flattened
    mask in bit ``e % 8`` of byte ``e // 8``: :func:`pack_custom_mask`, ``numpy.packbits(mask,
    bitorder="little")``), an eighth of the bytes; give one of the two.

    A window (``window_left = W >= 0``) applies on top of the mask, by absolute position (sliding-
    window models with tree speculation): tree node ``i`` (query ``i`` and trailing key
    ``k_len - q_len + i``) sits at ``p_i = (k_len - q_len) + depth(i)``, where ``depth(i)`` is the
    number of trailing keys mask row ``i`` sees minus one (the node's depth when the row sees
    exactly its ancestors and itself; the op derives it from the mask, no extra input), and
    prefix key ``j`` at ``j``. Query ``i`` sees the prefix keys and the mask-allowed trailing keys
    whose position is ``>= p_i - W`` (:func:`fastinfer.reference.tree_positions`). So prefix keys
    older than ``p_i - W`` and, when ``W`` is smaller than the depth, the shallowest ancestors drop
    out; a tree node always sees itself. CPU, CUDA and sim implement it (on CUDA a small kernel
    derives the depths first, into a scratch buffer from the caching allocator).

    ``fixed_split_size``: 0 (default) or the deterministic mode (:data:`FIXED_SPLIT_DOC`).
    ``sinks``: optional float32 ``[Hq]`` attention sinks (module docstring). An fp8 e4m3 cache
    needs ``k_scale`` / ``v_scale`` (:data:`FP8_CACHE_DOC`).

    Returns:
        ``out [T, Hq, D]``, and ``lse [T, Hq]`` float32 when ``return_lse``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    res = (lib or torch.ops.fastinfer).paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k,
                                                      int(max_seqlen_q), float(scale), bool(causal),
                                                      int(window_left), float(softcap), custom_mask,
                                                      bool(return_lse), packed_custom_mask, int(fixed_split_size),
                                                      sinks, k_scale, v_scale)
    return _result(res, return_lse)


def pack_custom_mask(custom_mask: Tensor) -> Tensor:
    """The bit-packed form of a custom mask for ``paged_prefill_attention(packed_custom_mask=...)``:
    the flattened bool mask (per sequence a ``[q_len, q_len]`` block, concatenated over the batch)
    as uint8 ``[ceil(n / 8)]``, entry ``e`` in bit ``e % 8`` of byte ``e // 8`` (little-endian bit
    order; padding bits 0). On the mask's device."""
    flat = custom_mask.reshape(-1).to(torch.bool)
    n = flat.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: Optional[float] = None,
    window_left: int = -1,
    softcap: float = 0.0,
    num_splits: int = 0,
    return_lse: bool = False,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    fixed_split_size: int = 0,
    sinks: Optional[Tensor] = None,
    *,
    lib=None,
) -> _Result:
    """Decode: one query per sequence (its newest token, position ``seq_lens[b] - 1``) against its
    paged KV. ``num_splits = 0`` picks split-KV automatically from the SM count and the table size.
    An fp8 e4m3 cache needs ``k_scale`` / ``v_scale`` (:data:`FP8_CACHE_DOC`).
    ``fixed_split_size > 0``: the deterministic mode (:data:`FIXED_SPLIT_DOC`; ``num_splits`` must
    be 0; an fp8 cache is read as in the default mode). ``sinks``: optional float32 ``[Hq]`` attention sinks (module
    docstring).

    Returns:
        ``out [B, Hq, D]``, and ``lse [B, Hq]`` float32 when ``return_lse``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    res = (lib or torch.ops.fastinfer).paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, float(scale),
                                                     int(window_left), float(softcap), int(num_splits),
                                                     bool(return_lse), k_scale, v_scale, int(fixed_split_size),
                                                     sinks)
    return _result(res, return_lse)


def merge_attention_states(
    v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor, mask: Optional[Tensor] = None, *, lib=None
) -> Tuple[Tensor, Tensor]:
    """Combine attention over two disjoint key sets (split-KV, shared prefix + suffix):
    ``lse = logaddexp(lse_a, lse_b)``, ``v = v_a * exp(lse_a - lse) + v_b * exp(lse_b - lse)``;
    both ``-inf``: ``v = 0``, ``lse = -inf``; a NaN lse on either side: NaN ``lse`` and ``v``.
    ``v_*``: ``[T, H, D]`` (fp16/bf16/fp32, ``D > 0``); ``lse_*``: ``[T, H]`` float32.
    ``mask``: optional ``[T]`` bool (FlashInfer's ``merge_state_in_place`` mask): tokens whose
    entry is False keep ``(v_a, lse_a)`` bit for bit, so one captured graph serves batches where
    only some tokens have a second state. Returns ``(v, lse)``."""
    return (lib or torch.ops.fastinfer).merge_attention_states(v_a, lse_a, v_b, lse_b, mask)


def move_kv_slots(k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor, *, lib=None) -> None:
    """**In place**: ``cache[dst_slots[i]] = cache[src_slots[i]]`` for both caches (slots index the
    cache viewed as ``[NB * BS, Hkv, D]``), all sources read before any write, so compaction
    chains such as ``5 -> 4, 7 -> 5`` are safe. Slots int32 or int64."""
    (lib or torch.ops.fastinfer).move_kv_slots(k_cache, v_cache, src_slots, dst_slots)


MLA_CACHE_DOC = """The latent cache is ``[num_blocks, block_size, 576]``: per token ``kv_c`` (512) then
``k_pe`` (64), in the activations' dtype or ``float8_e4m3fn``. An fp8 cache holds
``e4m3(clamp(x / scale, -448, 448))`` with ``kv_scale`` float32: one element (per tensor, given by
the caller) or ``[num_blocks, block_size]`` (per token: :func:`mla_cache_write` writes slot ``s``'s
``max(amax of its 576 values, 1e-12) / 448``, the latent and rotary parts together, fp8_quantize's
rule). A cache in the activations' dtype takes no ``kv_scale``."""


def mla_cache_write(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                    kv_scale: Optional[Tensor] = None, *, lib=None) -> None:
    """**In place**: token ``t``'s ``[kv_c[t] | k_pe[t]]`` into row ``slot_mapping[t]`` of the latent
    cache viewed as ``[num_blocks * block_size, 576]`` (slot = block * block_size + offset; ``-1``
    skips the token).

    Args:
        kv_c: ``[T, 512]`` the normalised compressed latent; k_pe: ``[T, 64]`` the roped key part,
            same dtype (float16 / bfloat16; CPU also float32), any row stride (slices of the fused
            projection output).
        kv_cache: ``[NB, BS, 576]``, contiguous (:data:`MLA_CACHE_DOC`).
        slot_mapping: ``[T]`` int32 or int64.
        kv_scale: an fp8 cache's scales: read when per tensor, written (the slots' entries) when
            per token.
    """
    (lib or torch.ops.fastinfer).mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)


def mla_decode_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    causal: bool = True,
    custom_mask: Optional[Tensor] = None,
    num_splits: int = 0,
    return_lse: bool = False,
    kv_scale: Optional[Tensor] = None,
    fixed_split_size: int = 0,
    *,
    lib=None,
) -> _Result:
    """Multi-head latent attention of 1..k new query tokens per sequence against a paged latent
    cache, in the absorbed form (FlashMLA's ``flash_mla_with_kvcache``, FlashInfer's
    ``BatchMLAPagedAttentionWrapper``).

    Query head ``h`` of token ``t`` is ``q[t, h] = [q_nope W_UK | q_pe]`` (576): its first 512 values
    the nope query multiplied by the key up-projection, the last 64 the roped rotary query. Key
    ``j`` is the whole cache row (576), its value the row's first 512 values (the latent), shared by
    every head: ``s = scale * q . k``, ``out = softmax(s) V`` in latent space (the caller applies the
    value up-projection). The query tokens of sequence ``b`` are rows ``cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1``, its last ``q_len`` tokens, already in the cache (``seq_lens[b]`` keys
    in all); ``causal`` is bottom-right aligned, and ``custom_mask`` (bool, per sequence a flattened
    ``[q_len, q_len]`` block, as :func:`paged_prefill_attention` takes it) replaces the causal rule
    among the trailing keys (tree speculation). ``num_splits = 0`` picks split-KV automatically.
    ``fixed_split_size``: 0 or the deterministic mode (:data:`FIXED_SPLIT_DOC`; a row's bits do not
    depend on the batch). :data:`MLA_CACHE_DOC` for an fp8 cache.

    Returns:
        ``out [T, H, 512]`` in q's dtype, and ``lse [T, H]`` float32 when ``return_lse``.
    """
    res = (lib or torch.ops.fastinfer).mla_decode_attention(q, kv_cache, block_table, seq_lens, cu_seqlens_q,
                                                            float(scale), bool(causal), custom_mask, int(num_splits),
                                                            bool(return_lse), kv_scale, int(fixed_split_size))
    return _result(res, return_lse)


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("mla_cache_write")
def _mla_cache_write_fake(ns, kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None):
    same_device(ns, "mla_cache_write", "kv_c", kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping,
                kv_scale=kv_scale)


@fake("mla_decode_attention")
def _mla_decode_attention_fake(ns, q, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, causal=True,
                               custom_mask=None, num_splits=0, return_lse=False, kv_scale=None, fixed_split_size=0):
    op = "mla_decode_attention"
    check_dim(ns, op, "q", q, 3, "[num_tokens, num_heads, 576]")
    same_device(ns, op, "q", q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
                cu_seqlens_q=cu_seqlens_q, custom_mask=custom_mask, kv_scale=kv_scale)
    out = q.new_empty((q.shape[0], q.shape[1], MLA_LATENT_DIM))
    lse = q.new_empty((q.shape[0], q.shape[1]) if return_lse else (0,), dtype=torch.float32)
    return out, lse


@fake("move_kv_slots")
def _move_kv_slots_fake(ns, k_cache, v_cache, src_slots, dst_slots):
    same_device(ns, "move_kv_slots", "k_cache", k_cache, v_cache=v_cache, src_slots=src_slots,
                dst_slots=dst_slots)


@fake("prefill_attention")
def _prefill_attention_fake(ns, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                      window_left=-1, softcap=0.0, return_lse=False, fixed_split_size=0, sinks=None):
    op = "prefill_attention"
    check_dim(ns, op, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    same_device(ns, op, "q", q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    return attention_outputs(q, return_lse)


@fake("paged_prefill_attention")
def _paged_prefill_attention_fake(ns, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, scale,
                            causal, window_left=-1, softcap=0.0, custom_mask=None, return_lse=False,
                            packed_custom_mask=None, fixed_split_size=0, sinks=None, k_scale=None, v_scale=None):
    op = "paged_prefill_attention"
    check_dim(ns, op, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    same_device(ns, op, "q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, custom_mask=custom_mask,
                packed_custom_mask=packed_custom_mask, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    return attention_outputs(q, return_lse)


@fake("paged_decode_attention")
def _paged_decode_attention_fake(ns, q, k_cache, v_cache, block_table, seq_lens, scale, window_left=-1, softcap=0.0,
                           num_splits=0, return_lse=False, k_scale=None, v_scale=None, fixed_split_size=0,
                           sinks=None):
    op = "paged_decode_attention"
    check_dim(ns, op, "q", q, 3, "[batch, num_q_heads, head_dim]")
    same_device(ns, op, "q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    return attention_outputs(q, return_lse)


@fake("merge_attention_states")
def _merge_attention_states_fake(ns, v_a, lse_a, v_b, lse_b, mask=None):
    same_device(ns, "merge_attention_states", "v_a", v_a, lse_a=lse_a, v_b=v_b, lse_b=lse_b, mask=mask)
    return (torch.empty_like(v_a, memory_format=torch.contiguous_format),
            torch.empty_like(lse_a, memory_format=torch.contiguous_format))
