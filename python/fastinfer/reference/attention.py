"""fp64 oracles of the attention ops (docs/design.md "Attention"): the executable spec.

Conventions (shared with the kernels, see cuda/include/fastinfer/attention/attention.h):
scores s = (q . k) * scale, then s = softcap * tanh(s / softcap) when softcap > 0. Query i of a
sequence with q_len queries and k_len keys has absolute position p = k_len - q_len + i; causal:
it sees keys j <= p (bottom-right aligned); window_left W >= 0: keys j in [p - W, p] (also without
causal: then j >= p - W). A custom (tree) mask [q_len, q_len] replaces the causal rule among the
trailing q_len keys; prefix keys stay visible. A window applies on top of the mask by absolute
position, a tree node's being the committed length plus its depth: see :func:`tree_positions`.
GQA: query head h uses KV head h // (Hq // Hkv).
lse = log(sum(exp(s))) over visible keys; a query that sees nothing gets out = 0, lse = -inf.
Non-finite values: a NaN query or a NaN visible key makes the row's out and lse NaN; a NaN visible
value makes those elements of out NaN (lse depends on the scores only); a hidden key or value
never reaches a row.
Attention sinks (float32 [Hq]): query head h adds exp(sinks[h]) to the softmax denominator with no
value row, lse includes it, and a query that sees nothing gets out = 0, lse = sinks[h]
(:func:`apply_sinks`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


def tree_positions(custom_mask: Tensor, q_len: int, k_len: int) -> Tensor:
    """int64 [q_len]: the absolute position of each tree node (query i and trailing key i) of one
    sequence, ``(k_len - q_len) + depth(i)`` with ``depth(i)`` = (number of trailing keys row i of
    the mask sees) - 1. For a tree mask (row i sees its ancestors and itself) that is the node's
    depth; the same formula is used for any mask (a row that sees no trailing key gets
    ``k_len - q_len - 1``)."""
    depth = custom_mask.to(torch.bool).reshape(q_len, q_len).sum(1) - 1
    return (k_len - q_len) + depth.to(torch.int64)


def unpack_custom_mask(packed: Tensor, entries: int) -> Tensor:
    """Bool [entries]: the flattened custom mask from its bit-packed form (uint8, entry e in bit
    e % 8 of byte e // 8, little-endian bit order, as numpy.packbits(m, bitorder="little"))."""
    bits = (packed.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=packed.device)) & 1
    return bits.reshape(-1)[:entries].to(torch.bool)


def visibility_mask(
    q_len: int,
    k_len: int,
    causal: bool,
    window_left: int = -1,
    custom_mask: Optional[Tensor] = None,
    device=None,
) -> Tensor:
    """Bool [q_len, k_len]: which keys each query of one sequence sees.

    Without a custom mask query i has position ``p = k_len - q_len + i`` and key j position j.
    With one, query i and trailing key ``k_len - q_len + m`` take the tree positions of nodes i
    and m (:func:`tree_positions`), prefix keys keep theirs, and the window keeps the keys whose
    position is ``>= p - window_left`` (the mask already decides which trailing keys are seen).
    """
    i = torch.arange(q_len, device=device).unsqueeze(1)
    j = torch.arange(k_len, device=device).unsqueeze(0)
    pos = k_len - q_len + i  # [q_len, 1]
    key_pos = j  # [1, k_len]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if custom_mask is not None:
        prefix = k_len - q_len
        tail = torch.zeros(q_len, k_len, dtype=torch.bool, device=device)
        tail[:, prefix:] = custom_mask.to(torch.bool).reshape(q_len, q_len)
        visible = (j < prefix) | tail
        if window_left >= 0:
            node_pos = tree_positions(custom_mask.to(device), q_len, k_len)
            pos = node_pos.unsqueeze(1)
            key_pos = torch.cat([torch.arange(prefix, device=device), node_pos]).unsqueeze(0)
    elif causal:
        visible &= j <= pos
    if window_left >= 0:
        visible &= key_pos >= pos - window_left
    return visible


def attention_one_sequence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    visible: Tensor,
    softcap: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """q [q_len, Hq, D], k/v [k_len, Hkv, D], visible [q_len, k_len] -> (out fp64 [q_len, Hq, D],
    lse fp64 [q_len, Hq])."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1)
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))  # a hidden NaN key never enters
    lse = torch.logsumexp(s, dim=-1)  # [Hq, q_len]; -inf where nothing is visible, NaN after a NaN score
    none = (lse == float("-inf")).unsqueeze(-1)
    p = torch.where(none, torch.zeros_like(s), torch.exp(s - lse.unsqueeze(-1)))
    # Hidden keys' weights are 0; 0 * NaN would still reach the rows that cannot see a non-finite
    # value, so those values are taken out of the product and added back over the visible keys only.
    bad_v = ~torch.isfinite(v64)
    out = torch.einsum("hqk,khd->qhd", p, v64.masked_fill(bad_v, 0.0))
    bad_keys = bad_v.any(dim=2).any(dim=1).nonzero().flatten()
    if bad_keys.numel() > 0:
        v_bad = torch.where(bad_v, v64, torch.zeros_like(v64))[bad_keys]  # the elements left out above
        pv = p[:, :, bad_keys].unsqueeze(-1) * v_bad.permute(1, 0, 2).unsqueeze(1)  # [Hq, q, n, D]
        seen = visible[:, bad_keys].reshape(1, q.shape[0], -1, 1)
        out = out + torch.where(seen, pv, torch.zeros_like(pv)).sum(2).transpose(0, 1)
    return out, lse.transpose(0, 1).contiguous()


def attention_fixed_splits(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    visible: Tensor,
    softcap: float = 0.0,
    fixed_split_size: int = 0,
) -> Tuple[Tensor, Tensor]:
    """:func:`attention_one_sequence` as the deterministic mode defines it: with
    ``fixed_split_size = F > 0`` the keys are reduced in chunks ``[cF, (c + 1)F)`` from key 0 and
    the chunks' (out, lse) merged left to right (:func:`merge_attention_states`); in fp64 the same
    value up to rounding as the unsplit attention (0 = unsplit)."""
    if fixed_split_size <= 0:
        return attention_one_sequence(q, k, v, scale, visible, softcap)
    out = torch.zeros((*q.shape[:2], v.shape[2]), dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for c0 in range(0, k.shape[0], fixed_split_size):
        chunk = torch.zeros_like(visible)
        chunk[:, c0 : c0 + fixed_split_size] = visible[:, c0 : c0 + fixed_split_size]
        o_c, lse_c = attention_one_sequence(q, k, v, scale, chunk, softcap)
        out, lse = merge_attention_states(out, lse, o_c, lse_c)
    return out, lse


def apply_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(out [T, Hq, D], lse [T, Hq]) over the visible keys -> the same with one more denominator
    term exp(sinks[h]) per query head h and no value row: lse' = logaddexp(lse, sinks[h]),
    out' = out * exp(lse - lse') (0 where lse = -inf)."""
    if sinks is None:
        return out, lse
    sink = sinks.to(torch.float64).reshape(1, -1).expand_as(lse)
    merged = torch.logaddexp(lse, sink)
    weight = torch.where(lse == float("-inf"), torch.zeros_like(lse), torch.exp(lse - merged))  # NaN stays
    return out * weight.unsqueeze(-1), merged


def _lens(cu: Tensor) -> list:
    cu = cu.tolist()
    return [(cu[b], cu[b + 1]) for b in range(len(cu) - 1)]


def prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    scale: float,
    causal: bool,
    window_left: int = -1,
    softcap: float = 0.0,
    fixed_split_size: int = 0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Varlen attention over contiguous ragged K/V. Returns (out [T, Hq, D], lse [T, Hq]) fp64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for (qs, qe), (ks, ke) in zip(_lens(cu_seqlens_q), _lens(cu_seqlens_k)):
        vis = visibility_mask(qe - qs, ke - ks, causal, window_left)
        out[qs:qe], lse[qs:qe] = attention_fixed_splits(q[qs:qe], k[ks:ke], v[ks:ke], scale, vis, softcap,
                                                        fixed_split_size)
    return apply_sinks(out, lse, sinks)


def gather_paged(cache: Tensor, block_table_row: Tensor, length: int, scale: Optional[Tensor] = None) -> Tensor:
    """The first `length` token rows [length, Hkv, D] of one sequence from a paged cache
    [NB, BS, Hkv, D], dequantised with `scale` (one element, or one per KV head) for an fp8 cache."""
    bs = cache.shape[1]
    j = torch.arange(length)
    slots = block_table_row.to(torch.int64)[j // bs] * bs + j % bs
    rows = cache.reshape(-1, *cache.shape[2:])[slots]
    rows = rows.to(torch.float64)
    if scale is not None:
        rows = rows * scale.to(torch.float64).reshape(1, -1, 1)
    return rows


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    scale: float,
    causal: bool,
    window_left: int = -1,
    softcap: float = 0.0,
    custom_mask: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    packed_custom_mask: Optional[Tensor] = None,
    fixed_split_size: int = 0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Queries are the last q_len tokens of each sequence (already in the cache). custom_mask:
    bool, per sequence a flattened [q_len, q_len] block, concatenated over the batch;
    packed_custom_mask: the same with 8 entries per byte (:func:`unpack_custom_mask`)."""
    if packed_custom_mask is not None:
        assert custom_mask is None, "give custom_mask or packed_custom_mask, not both"
        entries = sum((qe - qs) ** 2 for qs, qe in _lens(cu_seqlens_q))
        custom_mask = unpack_custom_mask(packed_custom_mask, entries)
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    mask_offset = 0
    for b, (qs, qe) in enumerate(_lens(cu_seqlens_q)):
        q_len, k_len = qe - qs, int(seq_lens_k[b])
        m = None
        if custom_mask is not None:
            m = custom_mask[mask_offset : mask_offset + q_len * q_len]
            mask_offset += q_len * q_len
        vis = visibility_mask(q_len, k_len, causal, window_left, m)
        kb = gather_paged(k_cache, block_table[b], k_len, k_scale)
        vb = gather_paged(v_cache, block_table[b], k_len, v_scale)
        out[qs:qe], lse[qs:qe] = attention_fixed_splits(q[qs:qe], kb, vb, scale, vis, softcap, fixed_split_size)
    return apply_sinks(out, lse, sinks)


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    window_left: int = -1,
    softcap: float = 0.0,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    fixed_split_size: int = 0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """One query per sequence (its last token) against its paged KV. q [B, Hq, D]."""
    b = q.shape[0]
    cu = torch.arange(b + 1, dtype=torch.int32)
    return paged_prefill_attention(q, k_cache, v_cache, block_table, cu, seq_lens, scale, True,
                                   window_left, softcap, None, k_scale, v_scale,
                                   fixed_split_size=fixed_split_size, sinks=sinks)


def merge_attention_states(
    v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor, mask: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """Combine two results over disjoint key sets: lse = logaddexp(lse_a, lse_b),
    v = v_a * exp(lse_a - lse) + v_b * exp(lse_b - lse); both -inf -> v = 0, lse = -inf; a NaN lse
    on either side -> NaN lse and v. ``mask [T]`` bool (FlashInfer's ``merge_state_in_place``
    mask): tokens whose entry is False keep ``(v_a, lse_a)`` unchanged."""
    la, lb = lse_a.to(torch.float64), lse_b.to(torch.float64)
    lse = torch.logaddexp(la, lb)
    none = lse == float("-inf")
    wa = torch.where(none, torch.zeros_like(la), torch.exp(la - lse)).unsqueeze(-1)
    wb = torch.where(none, torch.zeros_like(lb), torch.exp(lb - lse)).unsqueeze(-1)
    v = v_a.to(torch.float64) * wa + v_b.to(torch.float64) * wb
    if mask is not None:
        keep = ~mask.to(torch.bool).reshape(-1, 1)
        v = torch.where(keep.unsqueeze(-1), v_a.to(torch.float64), v)
        lse = torch.where(keep, la, lse)
    return v, lse


def move_kv_slots(k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> Tuple[Tensor, Tensor]:
    """cache[dst] = cache[src] for both caches, all sources read before any write. Returns new
    caches (same dtype: the move is exact)."""
    outs = []
    for cache in (k_cache, v_cache):
        flat = cache.clone().reshape(-1, *cache.shape[2:])
        rows = flat[src_slots.to(torch.int64)].clone()
        flat[dst_slots.to(torch.int64)] = rows
        outs.append(flat.reshape(cache.shape))
    return outs[0], outs[1]


def random_tree_parents(num_nodes: int, generator: Optional[torch.Generator] = None) -> Sequence[int]:
    """A random tree on nodes 0..n-1 rooted at 0 with parents[i] < i (speculative-decoding trees)."""
    parents = [-1]
    for i in range(1, num_nodes):
        parents.append(int(torch.randint(0, i, (1,), generator=generator)))
    return parents


def tree_mask(parents: Sequence[int]) -> Tensor:
    """Bool [n, n]: node i sees node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask
