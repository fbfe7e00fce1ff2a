"""Attention ops against the fp64 references: CPU impls, the CUDA kernels in the simt emulator
(two schedule seeds, bit-identical), and the GPU (-m cuda). Odd lengths on purpose, batches mixing
lengths, GQA 1/4/8, D 64/128, causal or not, windows, softcap, LSE, paged caches with shuffled
block tables and block sizes 8/16/64, tree masks, fp8 caches, split-KV."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import BACKENDS, assert_bits_equal, assert_fa_close, get_backend, make_gen, poison_, randn, raw_bits
import fastinfer.reference.attention as R

BACKEND_NAMES = ["cpu", "sim", "cuda"]
MARKS = {"sim": [pytest.mark.sim], "cuda": [pytest.mark.cuda]}


def params(cases, dtypes=None):
    """(backend, dtype, case) params: CPU also runs float32; sim and cuda fp16/bf16."""
    out = []
    for b in BACKEND_NAMES:
        for dt in dtypes or ((torch.float32, torch.bfloat16) if b == "cpu" else (torch.bfloat16, torch.float16)):
            for i, c in enumerate(cases):
                out.append(pytest.param(b, dt, c, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}-{i}"))
    return out


def cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def naive_attention(q, k, v, visible, scale, softcap):
    """The same computation in the input precision (the error-rule baseline). q [ql, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1).to(q.dtype), v.repeat_interleave(group, 1).to(q.dtype)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(s.float(), -1).to(q.dtype)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vv), lse.transpose(0, 1)


def check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, name=""):
    assert_fa_close(out, ref_out, naive_out, name=f"{name} out")
    if lse is None:
        return
    assert lse.dtype == torch.float32
    lse, ref_lse, naive_lse = lse.cpu().double(), ref_lse.double(), naive_lse.cpu().double()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), f"{name}: lse must be -inf exactly for rows that see no key"
    assert (out.cpu()[empty].float() == 0).all(), f"{name}: rows that see no key must be zero"
    if (~empty).any():
        assert_fa_close(lse[~empty], ref_lse[~empty], naive_lse[~empty], rel_tol=1e-3, floor=1e-3, name=f"{name} lse")


# ---------------------------------------------------------------------------------------------
# prefill_attention (contiguous ragged K/V)
# (q_lens, k_lens, Hq, Hkv, D, causal, window_left, softcap)
PREFILL_CASES = [
    ([1], [1], 4, 4, 64, True, -1, 0.0),
    ([17, 2, 100], [17, 2, 100], 8, 2, 64, True, -1, 0.0),
    ([15, 1], [40, 257], 8, 1, 128, True, -1, 0.0),
    ([33, 17], [33, 70], 4, 1, 64, False, -1, 0.0),
    ([100], [100], 4, 4, 128, True, 16, 0.0),
    ([65, 9], [80, 9], 8, 2, 64, False, 7, 30.0),
    ([20, 3], [12, 5], 4, 2, 64, True, -1, 0.0),  # q_len > k_len: leading queries see no key
    ([70], [70], 4, 1, 64, True, 0, 0.0),  # window 0: each query sees only itself
    ([43, 1, 100, 0, 5], [50, 1, 100, 3, 5], 6, 2, 128, True, -1, 0.0),  # group 3: tiles split a token's heads
    ([26, 77], [40, 77], 5, 1, 64, False, 20, 0.0),  # group 5
]


@pytest.mark.parametrize("backend,dtype,case", params(PREFILL_CASES))
def test_prefill_attention(backend, dtype, case):
    be = get_backend(backend)
    q_lens, k_lens, hq, hkv, d, causal, window, softcap = case
    g = make_gen(sum(q_lens) + d)
    q = randn((sum(q_lens), hq, d), dtype, gen=g)
    k = randn((sum(k_lens), hkv, d), dtype, gen=g)
    v = randn((sum(k_lens), hkv, d), dtype, gen=g)
    cq, ck = cu(q_lens), cu(k_lens)
    scale = 1.0 / math.sqrt(d)
    dev = be.device

    def run():
        out, lse = be.ns.prefill_attention(q.to(dev), k.to(dev), v.to(dev), cq.to(dev), ck.to(dev), max(q_lens),
                                           max(k_lens), scale, causal, window, softcap, True)
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.prefill_attention(q, k, v, cq, ck, scale, causal, window, softcap)
    naive_out, naive_lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=dtype)
    for b in range(len(q_lens)):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        vis = R.visibility_mask(qe - qs, ke - ks, causal, window)
        naive_out[qs:qe], naive_lse[qs:qe] = naive_attention(q[qs:qe], k[ks:ke], v[ks:ke], vis, scale, softcap)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "prefill")


# ---------------------------------------------------------------------------------------------
# paged caches
def make_paged(seq_lens, hkv, d, bs, dtype, g, spare_blocks=3):
    """A shuffled paged cache holding `seq_lens` tokens per sequence; unused slots are poisoned."""
    blocks = [math.ceil(n / bs) for n in seq_lens]
    nb = sum(blocks) + spare_blocks
    width = max(blocks + [1]) + 1  # a spare column: tables are usually wider than needed
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    table = torch.full((len(seq_lens), width), -7, dtype=torch.int32)  # unused entries: garbage ids
    k_cache = poison_(torch.empty((nb, bs, hkv, d), dtype=dtype))
    v_cache = poison_(torch.empty((nb, bs, hkv, d), dtype=dtype))
    used = 0
    for b, n in enumerate(seq_lens):
        table[b, : blocks[b]] = perm[used : used + blocks[b]]
        used += blocks[b]
        kv = randn((2, n, hkv, d), torch.float32, gen=g)
        for j in range(n):
            blk, off = int(table[b, j // bs]), j % bs
            k_cache[blk, off] = kv[0, j].to(dtype)
            v_cache[blk, off] = kv[1, j].to(dtype)
    return k_cache, v_cache, table


def naive_paged(q, k_cache, v_cache, table, cq, seq_lens, scale, causal, window, softcap, mask=None, ks=None, vs=None):
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=q.dtype)
    off = 0
    for b in range(len(seq_lens)):
        qs, qe, n = int(cq[b]), int(cq[b + 1]), int(seq_lens[b])
        m = None
        if mask is not None:
            m = mask[off : off + (qe - qs) ** 2]
            off += (qe - qs) ** 2
        vis = R.visibility_mask(qe - qs, n, causal, window, m)
        kb = R.gather_paged(k_cache, table[b], n, ks).to(q.dtype)
        vb = R.gather_paged(v_cache, table[b], n, vs).to(q.dtype)
        out[qs:qe], lse[qs:qe] = naive_attention(q[qs:qe], kb, vb, vis, scale, softcap)
    return out, lse


# (q_lens, seq_lens, Hq, Hkv, D, BS, causal, window, softcap, tree)
PAGED_PREFILL_CASES = [
    ([1, 17], [1, 40], 4, 4, 64, 16, True, -1, 0.0, False),
    ([15, 2, 100], [15, 70, 257], 8, 2, 128, 8, True, -1, 0.0, False),
    ([9, 33], [9, 33], 8, 1, 64, 64, False, -1, 0.0, False),
    ([30], [95], 4, 1, 64, 16, True, 10, 20.0, False),
    ([7, 1, 12], [20, 5, 12], 8, 2, 64, 16, True, -1, 0.0, True),  # tree attention (speculative verify)
    ([16, 5], [48, 37], 4, 4, 128, 8, True, -1, 0.0, True),
    ([9, 1, 16, 4], [40, 5, 16, 30], 12, 2, 64, 16, True, -1, 0.0, True),  # group 6 trees
    ([3] * 34 + [40], [20] * 34 + [90], 4, 2, 64, 8, True, -1, 0.0, False),  # 35 sequences (work-item search)
]


@pytest.mark.parametrize("backend,dtype,case", params(PAGED_PREFILL_CASES))
def test_paged_prefill_attention(backend, dtype, case):
    be = get_backend(backend)
    q_lens, seq_lens, hq, hkv, d, bs, causal, window, softcap, tree = case
    g = make_gen(7 * sum(seq_lens) + bs)
    k_cache, v_cache, table = make_paged(seq_lens, hkv, d, bs, dtype, g)
    q = randn((sum(q_lens), hq, d), dtype, gen=g)
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    mask = None
    if tree:
        mask = torch.cat([R.tree_mask(R.random_tree_parents(n, g)).flatten() for n in q_lens])
    scale = 1.0 / math.sqrt(d)
    dev = be.device

    def run():
        out, lse = be.ns.paged_prefill_attention(
            q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), cq.to(dev), lens.to(dev), max(q_lens), scale,
            causal, window, softcap, None if mask is None else mask.to(dev), True)
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.paged_prefill_attention(q, k_cache, v_cache, table, cq, lens, scale, causal, window, softcap, mask)
    naive_out, naive_lse = naive_paged(q, k_cache, v_cache, table, cq, lens, scale, causal, window, softcap, mask)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "paged prefill")


# ---------------------------------------------------------------------------------------------
# the bit-packed custom mask (8 entries per byte) gives the bool form's results, bit for bit
def test_pack_custom_mask_round_trip():
    from fastinfer.ops import pack_custom_mask

    g = make_gen(4)
    for n in (0, 1, 7, 8, 9, 63, 200):
        m = torch.rand(n, generator=g) < 0.4
        packed = pack_custom_mask(m)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
        assert torch.equal(R.unpack_custom_mask(packed, n), m)
        for e in range(n):  # entry e in bit e % 8 of byte e // 8
            assert bool((int(packed[e // 8]) >> (e % 8)) & 1) == bool(m[e])


# (q_lens, seq_lens, Hq, Hkv, D, BS, window): sequences start mid-byte (7^2 = 49 entries first)
PACKED_CASES = [
    ([7, 1, 12], [20, 5, 12], 8, 2, 64, 16, -1),
    ([5, 17], [23, 61], 4, 1, 128, 8, 2),  # with a window: tree positions from the packed mask
]


@pytest.mark.parametrize("backend,case", [
    pytest.param(b, c, marks=MARKS.get(b, []), id=f"{b}-{i}") for b in BACKEND_NAMES for i, c in enumerate(PACKED_CASES)])
def test_paged_prefill_packed_custom_mask(backend, case):
    from fastinfer.ops import pack_custom_mask

    be = get_backend(backend)
    q_lens, seq_lens, hq, hkv, d, bs, window = case
    dtype = torch.bfloat16
    g = make_gen(13 * sum(seq_lens))
    k_cache, v_cache, table = make_paged(seq_lens, hkv, d, bs, dtype, g)
    q = randn((sum(q_lens), hq, d), dtype, gen=g)
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    mask = torch.cat([R.tree_mask(deep_tree_parents(n, g)).flatten() for n in q_lens])
    packed = pack_custom_mask(mask)
    dev = be.device

    def run(bool_mask, bits):
        out, lse = be.ns.paged_prefill_attention(
            q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), cq.to(dev), lens.to(dev), max(q_lens), 0.1,
            True, window, 0.0, None if bool_mask is None else bool_mask.to(dev), True,
            None if bits is None else bits.to(dev))
        return out.cpu(), lse.cpu()

    out_b, lse_b = be.run(lambda: run(mask, None))
    out_p, lse_p = be.run(lambda: run(None, packed))
    assert torch.equal(raw_bits(out_p), raw_bits(out_b)) and torch.equal(lse_p, lse_b)
    ref_out, ref_lse = R.paged_prefill_attention(q, k_cache, v_cache, table, cq, lens, 0.1, True, window, 0.0,
                                                 packed_custom_mask=packed)
    ref_b = R.paged_prefill_attention(q, k_cache, v_cache, table, cq, lens, 0.1, True, window, 0.0, mask)
    assert torch.equal(ref_out, ref_b[0]) and torch.equal(ref_lse, ref_b[1])
    naive_out, naive_lse = naive_paged(q, k_cache, v_cache, table, cq, lens, 0.1, True, window, 0.0, mask)
    check_out_lse(out_p, lse_p, ref_out, ref_lse, naive_out, naive_lse, "packed mask")


# ---------------------------------------------------------------------------------------------
# GQA packing and the work-item grid: a ragged batch (a prompt next to speculative trees) launches
# one CTA per (work item, KV head), each of which writes output, instead of one per (64-row tile
# of the longest sequence, query head, sequence)
@pytest.mark.sim
def test_prefill_ragged_batch_launches_no_idle_ctas():
    import importlib.util

    if importlib.util.find_spec("fastinfer._simprof") is None:
        pytest.skip("fastinfer._simprof not built")
    import fastinfer.simt as simt

    g = make_gen(21)
    q_lens, seq_lens, hq, hkv, d = [130] + [8] * 9, [130] + [40] * 9, 8, 2, 64
    k_cache, v_cache, table = make_paged(seq_lens, hkv, d, 16, torch.bfloat16, g)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    q = randn((sum(q_lens), hq, d), torch.bfloat16, gen=g)
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    mask = torch.cat([torch.ones(130, 130, dtype=torch.bool).tril().flatten()] +
                     [R.tree_mask(R.random_tree_parents(8, g)).flatten() for _ in range(9)])
    rep = simt.profile(lambda: torch.ops.fastinfer_sim.paged_prefill_attention(
        q, k_cache, v_cache, table, cq, lens, 130, 0.125, True, -1, 0.0, mask, False))
    k = next(k for k in rep["kernels"] if "prefill_attention_kernel" in k["name"])
    (rec,) = k["records"]
    group, rows = hq // hkv, 128
    items = math.ceil(130 * group / rows) + 9 * math.ceil(8 * group / rows)  # 5 + 9
    assert rec["grid"][1] == hkv and rec["blocks_storing"] == items * hkv
    # the host's bound (no lengths on the host): at most one CTA per sequence and KV head idle
    assert items <= rec["grid"][0] <= items + len(q_lens)
    ref = R.paged_prefill_attention(q, k_cache, v_cache, table, cq, lens, 0.125, True, -1, 0.0, mask)[0]
    assert ((rep.result[0].double() - ref).norm() / ref.norm()).item() < 1e-2


# ---------------------------------------------------------------------------------------------
# tree attention with a sliding window: the window applies on top of the mask by absolute
# position, node i being at (k_len - q_len) + depth(i) (docs/design.md; R.tree_positions).
def test_reference_tree_window_by_hand():
    """The oracle's rule on a small tree, written out by hand. Prefix of 3 keys (positions 0..2),
    tree parents [-1, 0, 0, 1, 3]: depths 0, 1, 1, 2, 3, so nodes 0..4 (keys 3..7) are at
    positions 3, 4, 4, 5, 6. Window W = 1: node i sees the keys its mask shows at positions
    >= p_i - 1."""
    parents = [-1, 0, 0, 1, 3]
    mask = R.tree_mask(parents)
    assert R.tree_positions(mask, 5, 8).tolist() == [3, 4, 4, 5, 6]
    vis = R.visibility_mask(5, 8, True, 1, mask.reshape(-1))
    expect = torch.tensor([
        # keys: 0  1  2 | n0 n1 n2 n3 n4
        [0, 0, 1, 1, 0, 0, 0, 0],  # node 0, p 3: prefix key 2 (pos 2) and itself
        [0, 0, 0, 1, 1, 0, 0, 0],  # node 1, p 4: node 0 (pos 3), itself
        [0, 0, 0, 1, 0, 1, 0, 0],  # node 2, p 4: node 0 (pos 3), itself (by index it would be at 5)
        [0, 0, 0, 0, 1, 0, 1, 0],  # node 3, p 5: node 1 (pos 4), itself; node 0 (pos 3) is out
        [0, 0, 0, 0, 0, 0, 1, 1],  # node 4, p 6: node 3 (pos 5), itself
    ], dtype=torch.bool)
    assert torch.equal(vis, expect), vis.int()
    # without the window: the whole prefix and every ancestor
    assert torch.equal(R.visibility_mask(5, 8, True, -1, mask.reshape(-1))[:, 3:], mask)


def deep_tree_parents(n, g):
    """Random speculation-like trees where depth and index part ways: a first level of
    max(2, n // 4) children of the root, then a chain hanging from the last of them (a node of
    depth 1 at a high index): the first half of the remaining nodes (at least 2) extend it, the
    others extend it with probability 3/4 or hang from a random earlier node. Windows shorter than the depth
    then drop ancestors, and which ones depends on depth, not index."""
    width = min(n - 1, max(2, n // 4))
    parents = [-1] + [0] * width
    tail, sure = width, max(2, (n - width - 1) // 2)
    for i in range(width + 1, n):
        if i <= width + sure or bool(torch.rand((), generator=g) < 0.75):
            parents.append(tail)
            tail = i
        else:
            parents.append(int(torch.randint(0, i, (1,), generator=g)))
    return parents


def wrong_rule_visibility(rule, q_len, k_len, window, mask):
    """Visibility under a WRONG rule, which the tests require the ops not to match: "no window";
    "by index" (query i and trailing key m at k_len - q_len + i / + m, as for a causal chain);
    "keys by index" (queries at their tree positions, trailing keys at their index)."""
    vis = R.visibility_mask(q_len, k_len, True, -1, mask)
    if rule == "no window":
        return vis
    prefix = k_len - q_len
    tree_pos = R.tree_positions(mask, q_len, k_len)
    q_pos = tree_pos if rule == "keys by index" else prefix + torch.arange(q_len)
    j = torch.arange(k_len).unsqueeze(0)
    return vis & (j >= q_pos.unsqueeze(1) - window)


WRONG_RULES = ("no window", "by index", "keys by index")


# (q_lens, seq_lens, Hq, Hkv, D, BS, window, softcap); windows shorter than the prefix and than
# the trees' depth; q_len <= 16 runs the CPU impl's short path, 17 and 70 its long path.
TREE_WINDOW_CASES = [
    ([1, 5, 17], [40, 23, 61], 4, 1, 64, 16, 1, 0.0),
    ([16, 17], [37, 90], 4, 4, 128, 8, 3, 20.0),
    ([17, 1, 5], [17, 9, 5], 1, 1, 64, 16, 1, 0.0),   # no prefix (k_len == q_len) in two sequences
    ([70], [135], 4, 1, 64, 16, 8, 30.0),             # two query CTAs in the kernel
]


def _tree_window_inputs(case, dtype, seed):
    q_lens, seq_lens, hq, hkv, d, bs, window, softcap = case
    g = make_gen(seed)
    k_cache, v_cache, table = make_paged(seq_lens, hkv, d, bs, dtype, g)
    q = randn((sum(q_lens), hq, d), dtype, gen=g)
    mask = torch.cat([R.tree_mask(deep_tree_parents(n, g)).flatten() for n in q_lens])
    return q, k_cache, v_cache, table, cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), mask


@pytest.mark.parametrize("backend,dtype,case", [
    pytest.param(b, dt, c, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}-{i}")
    for b, dts in (("cpu", (torch.float32, torch.bfloat16)), ("sim", (torch.bfloat16,)),
                   ("cuda", (torch.bfloat16, torch.float16)))
    for dt in dts for i, c in enumerate(TREE_WINDOW_CASES)])
def test_paged_prefill_tree_mask_with_window(backend, dtype, case):
    be = get_backend(backend)
    q_lens, seq_lens, hq, hkv, d, bs, window, softcap = case
    q, k_cache, v_cache, table, cq, lens, mask = _tree_window_inputs(case, dtype, 5 * sum(seq_lens) + window)
    scale = 1.0 / math.sqrt(d)
    dev = be.device

    def run():
        out, lse = be.ns.paged_prefill_attention(
            q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), cq.to(dev), lens.to(dev), max(q_lens), scale,
            True, window, softcap, mask.to(dev), True)
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.paged_prefill_attention(q, k_cache, v_cache, table, cq, lens, scale, True, window, softcap, mask)
    naive_out, naive_lse = naive_paged(q, k_cache, v_cache, table, cq, lens, scale, True, window, softcap, mask)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "tree + window")

    # The ops must not match a wrong rule on any sequence where that rule's answer differs (and
    # every case has sequences, short ones included, where each wrong rule differs: the test
    # cannot pass with the window ignored or with positions taken by index).
    off = 0
    seen = {rule: [] for rule in WRONG_RULES}
    for b, n in enumerate(q_lens):
        qs, k_len = int(cq[b]), seq_lens[b]
        m = mask[off:off + n * n]
        off += n * n
        kb, vb = R.gather_paged(k_cache, table[b], k_len), R.gather_paged(v_cache, table[b], k_len)
        ref_b = ref_out[qs:qs + n]
        for rule in WRONG_RULES:
            vis = wrong_rule_visibility(rule, n, k_len, window, m)
            wrong = R.attention_one_sequence(q[qs:qs + n], kb, vb, scale, vis, softcap)[0]
            dist = ((wrong - ref_b).norm() / ref_b.norm()).item()
            if dist > 0.05:
                seen[rule].append(n)
                got = ((out[qs:qs + n].double() - wrong).norm() / ref_b.norm()).item()
                assert got > dist / 2, f"sequence {b} (q_len {n}): the op follows the wrong rule '{rule}'"
    for rule, lens_seen in seen.items():
        assert lens_seen, f"test case does not distinguish the rule from '{rule}'"
        if any(5 <= n <= 16 for n in q_lens):
            assert any(n <= 16 for n in lens_seen), f"no short sequence distinguishes '{rule}'"


@pytest.mark.parametrize("backend,dtype", [
    pytest.param(b, dt, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}")
    for b, dt in (("cpu", torch.float32), ("cpu", torch.bfloat16), ("sim", torch.bfloat16), ("cuda", torch.bfloat16))])
def test_paged_prefill_tree_window_row_that_sees_nothing(backend, dtype):
    """A (non-tree) mask row with no trailing key, no prefix (k_len == q_len) and a window: the
    query sees no key -> zeros and lse = -inf, never NaN; the other rows are unaffected. q_len 5
    (CPU short path) and 20 (long path)."""
    be = get_backend(backend)
    g = make_gen(17)
    q_lens = [5, 20]
    k_cache, v_cache, table = make_paged(q_lens, 2, 64, 8, dtype, g)
    q = randn((sum(q_lens), 4, 64), dtype, gen=g)
    masks = []
    for n in q_lens:
        m = R.tree_mask(deep_tree_parents(n, g))
        m[n // 2] = False  # row n // 2 sees no trailing key: position k_len - q_len - 1 = -1
        masks.append(m.flatten())
    mask = torch.cat(masks)
    cq, lens = cu(q_lens), torch.tensor(q_lens, dtype=torch.int32)
    dev = be.device

    def run():
        out, lse = be.ns.paged_prefill_attention(
            q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), cq.to(dev), lens.to(dev), max(q_lens), 0.125,
            True, 3, 0.0, mask.to(dev), True)
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.paged_prefill_attention(q, k_cache, v_cache, table, cq, lens, 0.125, True, 3, 0.0, mask)
    naive_out, naive_lse = naive_paged(q, k_cache, v_cache, table, cq, lens, 0.125, True, 3, 0.0, mask)
    empty_rows = [2, 5 + 10]
    assert torch.isinf(ref_lse[empty_rows]).all()
    assert not out.isnan().any() and not lse.isnan().any()
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "row without keys")


# ---------------------------------------------------------------------------------------------
# paged_decode_attention
# (seq_lens, Hq, Hkv, D, BS, window, softcap, fp8)
DECODE_CASES = [
    ([1, 2, 15, 17, 100, 257], 8, 2, 128, 16, -1, 0.0, False),
    ([33, 0, 64], 4, 4, 64, 8, -1, 0.0, False),  # an empty sequence: zeros and lse = -inf
    ([200, 31], 8, 1, 64, 64, 50, 0.0, False),
    ([129, 5], 8, 1, 128, 16, -1, 25.0, False),
    ([77, 300, 8], 8, 2, 128, 16, -1, 0.0, True),  # fp8 e4m3 cache
]


@pytest.mark.parametrize("backend,dtype,case", params(DECODE_CASES))
def test_paged_decode_attention(backend, dtype, case):
    be = get_backend(backend)
    seq_lens, hq, hkv, d, bs, window, softcap, fp8 = case
    g = make_gen(3 * sum(seq_lens) + d)
    k_cache, v_cache, table = make_paged(seq_lens, hkv, d, bs, dtype if not fp8 else torch.float32, g)
    ks = vs = None
    if fp8:
        ks, vs = torch.tensor([0.02]), torch.tensor([0.03])
        k_cache = (k_cache.float() / ks).clamp(-448, 448).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / vs).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = randn((len(seq_lens), hq, d), dtype, gen=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    dev = be.device

    def run():
        out, lse = be.ns.paged_decode_attention(
            q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), lens.to(dev), scale, window, softcap, 0, True,
            None if ks is None else ks.to(dev), None if vs is None else vs.to(dev))
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, window, softcap, ks, vs)
    cq = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    naive_out, naive_lse = naive_paged(q, k_cache, v_cache, table, cq, lens, scale, True, window, softcap, None, ks, vs)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "decode")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=MARKS.get(b, [])) for b in ["sim", "cuda"]])
def test_decode_split_counts_agree(backend):
    """num_splits 1..8 (and automatic) give the same answer, within fp32 rounding of the merge."""
    be = get_backend(backend)
    g = make_gen(11)
    seq_lens = [300, 1, 77]
    k_cache, v_cache, table = make_paged(seq_lens, 2, 64, 16, torch.bfloat16, g)
    q = randn((3, 8, 64), torch.bfloat16, gen=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    dev = be.device
    results = []
    for splits in [1, 2, 3, 5, 8, 0]:
        out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_decode_attention(
            q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), lens.to(dev), 0.125, -1, 0.0, splits, True)))
        results.append((splits, out.float(), lse))
    base_out, base_lse = results[0][1], results[0][2]
    for splits, out, lse in results[1:]:
        assert (out - base_out).abs().max().item() <= 1.6e-2, f"num_splits={splits} differs from 1"
        assert (lse - base_lse).abs().max().item() <= 1e-4, f"num_splits={splits} lse differs from 1"


# ---------------------------------------------------------------------------------------------
# split-KV in the default mode (attention.h): each CTA's key range in S parts of whole 64-key
# tiles, a CTA per part, fp32 partials merged per row. The plan splits long contexts at small
# batch (too slow for the emulator); FASTINFER_TEST_DEFAULT_KEY_SPLITS forces S on small odd
# shapes: S = 1 is the unsplit kernel, 2 and 3 leave parts a row sees nothing of (windows, causal
# rows, sequences of fewer tiles than parts).
# (paged, q_lens, k_lens, Hq, Hkv, D, causal, window, softcap, tree)
DEFAULT_SPLIT_CASES = [
    (False, [17, 0, 100, 20], [17, 5, 300, 12], 8, 2, 64, True, -1, 0.0, False),  # empty q; q > k rows see nothing
    (False, [33, 9], [200, 9], 6, 2, 128, False, 40, 20.0, False),  # group 3, window + softcap
    (True, [7, 1, 12, 0], [150, 5, 201, 4], 8, 2, 64, True, -1, 0.0, True),  # trees, an empty sequence
    (True, [5, 17], [130, 61], 4, 1, 128, True, 30, 0.0, True),  # trees with a window (tree positions)
    (True, [40], [257], 4, 4, 64, True, 70, 0.0, False),  # chunk after a prefix, window
]


def _run_prefill_case(be, case, g, dtype):
    paged, q_lens, k_lens, hq, hkv, d, causal, window, softcap, tree = case
    q = randn((sum(q_lens), hq, d), dtype, gen=g)
    cq, scale, dev = cu(q_lens), 1.0 / math.sqrt(d), be.device
    if not paged:
        k = randn((sum(k_lens), hkv, d), dtype, gen=g)
        v = randn((sum(k_lens), hkv, d), dtype, gen=g)
        ck = cu(k_lens)
        run = lambda: tuple(t.cpu() for t in be.ns.prefill_attention(  # noqa: E731
            q.to(dev), k.to(dev), v.to(dev), cq.to(dev), ck.to(dev), max(q_lens), max(k_lens), scale, causal, window,
            softcap, True))
        ref = R.prefill_attention(q, k, v, cq, ck, scale, causal, window, softcap)
        naive_out, naive_lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=dtype)
        for b in range(len(q_lens)):
            qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
            vis = R.visibility_mask(qe - qs, ke - ks, causal, window)
            naive_out[qs:qe], naive_lse[qs:qe] = naive_attention(q[qs:qe], k[ks:ke], v[ks:ke], vis, scale, softcap)
        return run, ref, (naive_out, naive_lse)
    k_cache, v_cache, table = make_paged(k_lens, hkv, d, 16, dtype, g)
    lens = torch.tensor(k_lens, dtype=torch.int32)
    mask = None
    if tree:
        parents = deep_tree_parents if window >= 0 else R.random_tree_parents
        mask = torch.cat([R.tree_mask(parents(n, g)).flatten() if n else torch.zeros(0, dtype=torch.bool)
                          for n in q_lens])
    run = lambda: tuple(t.cpu() for t in be.ns.paged_prefill_attention(  # noqa: E731
        q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), cq.to(dev), lens.to(dev), max(q_lens), scale,
        causal, window, softcap, None if mask is None else mask.to(dev), True))
    ref = R.paged_prefill_attention(q, k_cache, v_cache, table, cq, lens, scale, causal, window, softcap, mask)
    naive = naive_paged(q, k_cache, v_cache, table, cq, lens, scale, causal, window, softcap, mask)
    return run, ref, naive


@pytest.mark.sim
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("case", DEFAULT_SPLIT_CASES, ids=[f"case{i}" for i in range(len(DEFAULT_SPLIT_CASES))])
def test_prefill_default_key_splits(monkeypatch, case, splits):
    be = get_backend("sim")
    monkeypatch.setenv("FASTINFER_TEST_DEFAULT_KEY_SPLITS", str(splits))
    dtype = torch.bfloat16 if splits != 2 else torch.float16
    run, (ref_out, ref_lse), (naive_out, naive_lse) = _run_prefill_case(be, case, make_gen(41 + splits), dtype)
    out, lse = be.run(run)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, f"default mode, {splits} key splits")


def _prefill_launches(fn):
    import fastinfer.simt as simt

    rep = simt.profile(fn, launch_only=True)
    grids = [tuple(r["grid"]) for k in rep["kernels"] if "prefill_attention_kernel" in k["name"] for r in k["records"]]
    merges = sum(len(k["records"]) for k in rep["kernels"] if "prefill_merge_splits_kernel" in k["name"])
    return grids, merges


@pytest.mark.sim
def test_prefill_default_key_splits_launch(monkeypatch):
    """The split is what runs: the forced S is the attention kernel's grid.z, followed by one merge;
    unforced, a short context is not split, and the plan splits B = 1 tree verification at ctx 4096
    (Llama-3-8B heads, 132 SMs under the emulator) into 16 parts on its own (launches only: the
    kernels do not run)."""
    import importlib.util

    if importlib.util.find_spec("fastinfer._simprof") is None:
        pytest.skip("fastinfer._simprof not built")
    be = get_backend("sim")
    g = make_gen(43)
    run, _, _ = _run_prefill_case(be, DEFAULT_SPLIT_CASES[2], g, torch.bfloat16)
    assert _prefill_launches(run) == ([(4, 2, 1)], 0)
    monkeypatch.setenv("FASTINFER_TEST_DEFAULT_KEY_SPLITS", "3")
    assert _prefill_launches(run) == ([(4, 2, 3)], 1)
    monkeypatch.delenv("FASTINFER_TEST_DEFAULT_KEY_SPLITS")
    nodes, ctx, bs = 16, 4096, 16
    k_cache = torch.zeros(ctx // bs, bs, 8, 128, dtype=torch.bfloat16)
    table = torch.arange(ctx // bs, dtype=torch.int32).view(1, -1)
    q = torch.zeros(nodes, 32, 128, dtype=torch.bfloat16)
    mask = R.tree_mask(R.random_tree_parents(nodes, g)).flatten()
    grids, merges = _prefill_launches(lambda: torch.ops.fastinfer_sim.paged_prefill_attention(
        q, k_cache, k_cache, table, cu([nodes]), torch.tensor([ctx], dtype=torch.int32), nodes, 0.088, True, -1, 0.0,
        mask, True))
    assert grids == [(1, 8, 16)] and merges == 1


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,dtype,case", params([(7, 4, 64), (1, 8, 128), (33, 2, 64)],
                                                      dtypes=None))
def test_merge_attention_states(backend, dtype, case):
    be = get_backend(backend)
    t, h, d = case
    g = make_gen(t * h)
    va, vb = randn((t, h, d), dtype, gen=g), randn((t, h, d), dtype, gen=g)
    la, lb = randn((t, h), torch.float32, gen=g, scale=3), randn((t, h), torch.float32, gen=g, scale=3)
    la[0, 0] = float("-inf")  # one side saw no key
    lb[-1, -1] = float("-inf")
    if t > 1:
        la[1, 0] = lb[1, 0] = float("-inf")  # neither did
    dev = be.device
    v, lse = be.run(lambda: tuple(x.cpu() for x in be.ns.merge_attention_states(va.to(dev), la.to(dev), vb.to(dev), lb.to(dev))))
    ref_v, ref_lse = R.merge_attention_states(va, la, vb, lb)
    naive_v = (va * torch.exp(la - ref_lse.float()).nan_to_num(0).unsqueeze(-1).to(dtype)
               + vb * torch.exp(lb - ref_lse.float()).nan_to_num(0).unsqueeze(-1).to(dtype))
    assert_fa_close(v, ref_v, naive_v, name="merged v")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend,dtype,case", params([(7, 4, 64), (5, 3, 24)], dtypes=None))
def test_merge_attention_states_mask(backend, dtype, case):
    """FlashInfer's merge_state_in_place mask: masked-out tokens keep state a bit for bit (even
    where state b is NaN), the others equal the unmasked merge bit for bit."""
    be = get_backend(backend)
    t, h, d = case
    g = make_gen(t + d)
    va, vb = randn((t, h, d), dtype, gen=g), randn((t, h, d), dtype, gen=g)
    la, lb = randn((t, h), torch.float32, gen=g, scale=3), randn((t, h), torch.float32, gen=g, scale=3)
    mask = torch.tensor([i % 3 != 1 for i in range(t)])
    lb[1] = float("nan")  # token 1 is masked out: its NaN second state must not leak
    dev = be.device
    v, lse = be.run(lambda: tuple(x.cpu() for x in be.ns.merge_attention_states(
        va.to(dev), la.to(dev), vb.to(dev), lb.to(dev), mask.to(dev))))
    full_v, full_lse = (x.cpu() for x in be.ns.merge_attention_states(va.to(dev), la.to(dev), vb.to(dev), lb.to(dev)))
    keep = ~mask
    assert_bits_equal(v[keep], va[keep], "masked-out v")
    assert_bits_equal(lse[keep], la[keep], "masked-out lse")
    assert_bits_equal(v[mask], full_v[mask], "merged v")
    assert_bits_equal(lse[mask], full_lse[mask], "merged lse")
    ref_v, ref_lse = R.merge_attention_states(va, la, vb, lb, mask)
    assert torch.equal(ref_v[keep], va[keep].double()) and torch.equal(ref_lse[keep], la[keep].double())
    assert (v[mask].double() - ref_v[mask]).abs().max().item() < 2e-2


@pytest.mark.parametrize("backend,dtype", [pytest.param(b, dt, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}")
                                           for b in BACKEND_NAMES for dt in (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_move_kv_slots(backend, dtype, slot_dtype):
    be = get_backend(backend)
    g = make_gen(5)
    k_cache = randn((6, 8, 2, 64), torch.float32, gen=g).to(dtype)
    v_cache = randn((6, 8, 2, 64), torch.float32, gen=g).to(dtype)
    src = torch.tensor([5, 7, 20, 47], dtype=slot_dtype)  # chain: 5 -> 4, 7 -> 5 (read before written)
    dst = torch.tensor([4, 5, 6, 0], dtype=slot_dtype)
    ref_k, ref_v = R.move_kv_slots(k_cache, v_cache, src, dst)
    dev = be.device

    def run():
        kc, vc = k_cache.to(dev).clone(), v_cache.to(dev).clone()
        be.ns.move_kv_slots(kc, vc, src.to(dev), dst.to(dev))
        return kc.cpu(), vc.cpu()

    kc, vc = be.run(run)
    assert torch.equal(raw_bits(kc), raw_bits(ref_k)) and torch.equal(raw_bits(vc), raw_bits(ref_v))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_index_tensors_any_layout(backend):
    """The index tensors may be views with any strides, on every backend: a block_table that is a
    column slice of a wider table (contiguous rows), one with strided rows, strided seq_lens and
    cu_seqlens give the bits of their contiguous copies (the CPU refused the first, the kernels the
    others)."""
    be = get_backend(backend)
    g = make_gen(21)
    bf = torch.bfloat16
    kc, vc, table = make_paged([20, 3], 2, 64, 16, bf, g)
    kc, vc = kc.nan_to_num(0.5), vc.nan_to_num(0.5)
    q = randn((5, 8, 64), bf, gen=g)
    lens = torch.tensor([20, 3], dtype=torch.int32)
    wide = torch.full((2, table.shape[1] + 5), -3, dtype=torch.int32)
    wide[:, 2:2 + table.shape[1]] = table
    col_slice = wide[:, 2:2 + table.shape[1]]  # stride(0) > width, stride(1) == 1
    strided_rows = table.t().contiguous().t()  # stride(1) != 1
    lens_view = torch.tensor([20, 99, 3, 99], dtype=torch.int32)[::2]
    cu_view = torch.tensor([0, 9, 2, 9, 5, 9], dtype=torch.int32)[::2]
    dev = be.device

    def run(tab, ln, cq):
        d = be.ns.paged_decode_attention(q[:2].to(dev), kc.to(dev), vc.to(dev), tab.to(dev), ln.to(dev), 0.125, -1, 0.0,
                                         0, True)
        p = be.ns.paged_prefill_attention(q.to(dev), kc.to(dev), vc.to(dev), tab.to(dev), cq.to(dev), ln.to(dev), 3,
                                          0.125, True, -1, 0.0, None, True)
        return tuple(t.cpu() for t in (*d, *p))

    want = be.run(lambda: run(table, lens, cu([2, 3])))
    for tab, ln, cq in ((col_slice, lens, cu([2, 3])), (strided_rows, lens_view, cu_view)):
        assert not (tab.is_contiguous() and ln.is_contiguous() and cq.is_contiguous())
        got = be.run(lambda: run(tab, ln, cq))
        for a, b in zip(got, want):
            assert torch.equal(raw_bits(a), raw_bits(b))
    k = randn((12, 2, 64), bf, gen=g)
    cq, ck = torch.tensor([0, 9, 4, 9, 10], dtype=torch.int32)[::2], torch.tensor([0, 9, 5, 9, 12], dtype=torch.int32)[::2]
    got = be.run(lambda: tuple(t.cpu() for t in be.ns.prefill_attention(q.repeat(2, 1, 1).to(dev), k.to(dev), k.to(dev),
                                                                         cq.to(dev), ck.to(dev), 6, 7, 0.125, True, -1,
                                                                         0.0, True)))
    want = be.run(lambda: tuple(t.cpu() for t in be.ns.prefill_attention(q.repeat(2, 1, 1).to(dev), k.to(dev), k.to(dev),
                                                                          cq.contiguous().to(dev), ck.contiguous().to(dev),
                                                                          6, 7, 0.125, True, -1, 0.0, True)))
    for a, b in zip(got, want):
        assert torch.equal(raw_bits(a), raw_bits(b))


# ---------------------------------------------------------------------------------------------
# bad input: a RuntimeError naming the argument, never a crash
def _prefill_args(**over):
    q = torch.randn(10, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 64, dtype=torch.bfloat16)
    args = dict(q=q, k=k, v=k.clone(), cu_seqlens_q=cu([4, 6]), cu_seqlens_k=cu([5, 7]), max_seqlen_q=6,
                max_seqlen_k=7, scale=0.125, causal=True, window_left=-1, softcap=0.0, return_lse=False)
    args.update(over)
    return list(args.values())


def _paged_args(**over):
    k_cache = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
    args = dict(q=torch.randn(5, 8, 64, dtype=torch.bfloat16), k_cache=k_cache, v_cache=k_cache.clone(),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), cu_seqlens_q=cu([2, 3]),
                seq_lens_k=torch.tensor([20, 3], dtype=torch.int32), max_seqlen_q=3, scale=0.125, causal=True,
                window_left=-1, softcap=0.0, custom_mask=None, return_lse=False, packed_custom_mask=None)
    args.update(over)
    return list(args.values())


def _decode_args(**over):
    k_cache = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
    args = dict(q=torch.randn(2, 8, 64, dtype=torch.bfloat16), k_cache=k_cache, v_cache=k_cache.clone(),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([20, 3], dtype=torch.int32), scale=0.125, window_left=-1, softcap=0.0,
                num_splits=0, return_lse=False, k_scale=None, v_scale=None)
    args.update(over)
    return list(args.values())


BAD = [
    ("prefill_attention", "gqa", lambda: _prefill_args(k=torch.randn(12, 3, 64, dtype=torch.bfloat16),
                                                       v=torch.randn(12, 3, 64, dtype=torch.bfloat16)), "num_kv_heads"),
    ("prefill_attention", "head_dim", lambda: _prefill_args(q=torch.randn(10, 8, 80, dtype=torch.bfloat16)), "head_dim"),
    ("prefill_attention", "cu_seqlens-size", lambda: _prefill_args(cu_seqlens_k=cu([5, 3, 4])), "cu_seqlens"),
    ("prefill_attention", "cu_seqlens-total", lambda: _prefill_args(cu_seqlens_q=cu([4, 5])), "cu_seqlens_q"),
    ("prefill_attention", "cu_seqlens-dtype", lambda: _prefill_args(cu_seqlens_q=cu([4, 6]).long()), "cu_seqlens_q"),
    ("prefill_attention", "max_seqlen", lambda: _prefill_args(max_seqlen_q=5), "max_seqlen_q"),
    ("prefill_attention", "q-noncontig", lambda: _prefill_args(q=torch.randn(10, 64, 8, dtype=torch.bfloat16).transpose(1, 2)), r"\bq\b"),
    ("prefill_attention", "dtype", lambda: _prefill_args(k=torch.randn(12, 2, 64, dtype=torch.float16),
                                                         v=torch.randn(12, 2, 64, dtype=torch.float16)), r"\bk\b"),
    ("paged_prefill_attention", "table-dtype", lambda: _paged_args(block_table=torch.tensor([[0, 1], [2, 3]])), "block_table"),
    ("paged_prefill_attention", "table-rows", lambda: _paged_args(block_table=torch.tensor([[0, 1]], dtype=torch.int32)), "block_table"),
    ("paged_prefill_attention", "seq-too-long", lambda: _paged_args(seq_lens_k=torch.tensor([33, 3], dtype=torch.int32)), "seq_lens_k"),
    ("paged_prefill_attention", "block-id", lambda: _paged_args(block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)), "block_table"),
    ("paged_prefill_attention", "q-longer-than-k", lambda: _paged_args(seq_lens_k=torch.tensor([1, 3], dtype=torch.int32)), "queries"),
    ("paged_prefill_attention", "mask-size", lambda: _paged_args(custom_mask=torch.ones(5, dtype=torch.bool)), "custom_mask"),
    ("paged_prefill_attention", "packed-mask-dtype",
     lambda: _paged_args(packed_custom_mask=torch.ones(2, dtype=torch.bool)), "packed_custom_mask must be uint8"),
    ("paged_prefill_attention", "packed-mask-size",
     lambda: _paged_args(packed_custom_mask=torch.ones(13, dtype=torch.uint8)), "packed_custom_mask must have"),
    ("paged_prefill_attention", "packed-mask-dim",
     lambda: _paged_args(packed_custom_mask=torch.ones(1, 2, dtype=torch.uint8)), "packed_custom_mask"),
    ("paged_prefill_attention", "both-masks", lambda: _paged_args(custom_mask=torch.ones(13, dtype=torch.bool),
                                                                  packed_custom_mask=torch.ones(2, dtype=torch.uint8)),
     "custom_mask and packed_custom_mask"),
    ("paged_prefill_attention", "block-size", lambda: _paged_args(k_cache=torch.randn(4, 12, 2, 64, dtype=torch.bfloat16),
                                                                  v_cache=torch.randn(4, 12, 2, 64, dtype=torch.bfloat16)), "block_size"),
    ("paged_decode_attention", "seq_lens-size", lambda: _decode_args(seq_lens=torch.tensor([3], dtype=torch.int32)), "seq_lens"),
    ("paged_decode_attention", "seq-too-long", lambda: _decode_args(seq_lens=torch.tensor([3, 40], dtype=torch.int32)), "seq_lens"),
    ("paged_decode_attention", "fp8-no-scale", lambda: _decode_args(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn),
                                                                    v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn)), "k_scale"),
    ("paged_decode_attention", "splits", lambda: _decode_args(num_splits=-2), "num_splits"),
    # the scalar options: NaN is refused, never read as "off"; bounds checked before any launch
    ("prefill_attention", "softcap-nan", lambda: _prefill_args(softcap=float("nan")), "softcap must be a finite number"),
    ("prefill_attention", "softcap-negative", lambda: _prefill_args(softcap=-1.0), "softcap"),
    ("prefill_attention", "scale-nan", lambda: _prefill_args(scale=float("nan")), "scale must be a finite number"),
    ("prefill_attention", "scale-inf", lambda: _prefill_args(scale=float("inf")), "scale"),
    ("prefill_attention", "window", lambda: _prefill_args(window_left=-2), "window_left must be >= -1"),
    ("prefill_attention", "max_seqlen_q-2^31", lambda: _prefill_args(max_seqlen_q=2 ** 31), r"max_seqlen_q must be in \[0, 2\^31 - 1\]"),
    ("prefill_attention", "max_seqlen_k-2^31", lambda: _prefill_args(max_seqlen_k=2 ** 31), "max_seqlen_k"),
    ("paged_prefill_attention", "softcap-nan", lambda: _paged_args(softcap=float("nan")), "softcap"),
    ("paged_prefill_attention", "window", lambda: _paged_args(window_left=-7), "window_left"),
    ("paged_prefill_attention", "max_seqlen_q-2^31", lambda: _paged_args(max_seqlen_q=2 ** 31), "max_seqlen_q"),
    ("paged_prefill_attention", "seq_lens-negative", lambda: _paged_args(seq_lens_k=torch.tensor([20, -3], dtype=torch.int32)),
     r"seq_lens_k\[1\] = -3 is negative"),
    ("paged_decode_attention", "softcap-nan", lambda: _decode_args(softcap=float("nan")), "softcap"),
    ("paged_decode_attention", "scale-nan", lambda: _decode_args(scale=float("nan")), "scale"),
    ("paged_decode_attention", "window", lambda: _decode_args(window_left=-2), "window_left"),
    ("paged_decode_attention", "seq_lens-negative", lambda: _decode_args(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
     r"seq_lens\[0\] = -1 is negative"),
    ("merge_attention_states", "lse-shape", lambda: [torch.randn(3, 4, 64), torch.randn(3, 5), torch.randn(3, 4, 64), torch.randn(3, 5)], "lse_a"),
    ("merge_attention_states", "head_dim-0", lambda: [torch.randn(3, 4, 0), torch.randn(3, 4), torch.randn(3, 4, 0), torch.randn(3, 4)],
     "head_dim > 0"),
    ("merge_attention_states", "lse-dtype", lambda: [torch.randn(3, 4, 64), torch.randn(3, 4).double(), torch.randn(3, 4, 64), torch.randn(3, 4)], "lse_a"),
    ("move_kv_slots", "count", lambda: [torch.randn(2, 8, 2, 64), torch.randn(2, 8, 2, 64), torch.tensor([1, 2]), torch.tensor([3])], "dst_slots"),
    ("move_kv_slots", "range", lambda: [torch.randn(2, 8, 2, 64), torch.randn(2, 8, 2, 64), torch.tensor([1, 16]), torch.tensor([3, 4])], "src_slots"),
]


MASK_BAD = [
    ("dtype", lambda: torch.ones(3, dtype=torch.int32)),
    ("shape", lambda: torch.ones(4, dtype=torch.bool)),
    ("rank", lambda: torch.ones(3, 4, dtype=torch.bool)),
    ("noncontig", lambda: torch.ones(6, dtype=torch.bool)[::2]),
    ("device", lambda: torch.ones(3, dtype=torch.bool, device="meta")),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,make_mask", MASK_BAD, ids=[c[0] for c in MASK_BAD])
def test_merge_attention_states_bad_mask(ns, case, make_mask):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    v, lse = torch.randn(3, 4, 64).to(torch.bfloat16), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"\bmask\b") as exc:
        be.ns.merge_attention_states(v, lse, v.clone(), lse.clone(), make_mask())
    assert f"{ns}.merge_attention_states:" in str(exc.value)


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("op,case,make_args,arg_re", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_attention_bad_input(ns, op, case, make_args, arg_re):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    args = make_args()
    if ns == "fastinfer_sim":  # the kernels take fp16/bf16 only
        args = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args]
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        getattr(be.ns, op)(*args)
    assert f"{ns}.{op}:" in str(exc.value)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_attention_opcheck(ns):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    g = make_gen(3)
    bf = torch.bfloat16
    q, k = randn((10, 4, 64), bf, gen=g), randn((12, 2, 64), bf, gen=g)
    kc, vc, table = make_paged([20, 3], 2, 64, 16, bf, g)
    kc, vc = kc.nan_to_num(0.5), vc.nan_to_num(0.5)
    lens = torch.tensor([20, 3], dtype=torch.int32)
    cases = [
        ("prefill_attention", (q, k, k.clone(), cu([4, 6]), cu([5, 7]), 6, 7, 0.125, True, -1, 0.0, True)),
        ("paged_prefill_attention", (q[:5], kc, vc, table, cu([2, 3]), lens, 3, 0.125, True, -1, 0.0,
                                     torch.ones(13, dtype=torch.bool), True)),
        ("paged_prefill_attention", (q[:5], kc, vc, table, cu([2, 3]), lens, 3, 0.125, True, 4, 0.0,
                                     torch.arange(13) % 3 != 1, True)),  # a mask with a window
        ("paged_prefill_attention", (q[:5], kc, vc, table, cu([2, 3]), lens, 3, 0.125, True, 4, 0.0, None, True,
                                     torch.tensor([0b10110111, 0b1], dtype=torch.uint8))),  # the packed form
        ("paged_decode_attention", (q[:2], kc, vc, table, lens, 0.125, -1, 0.0, 2, True, None, None)),
        ("merge_attention_states", (q, randn((10, 4), torch.float32, gen=g), q.clone(), randn((10, 4), torch.float32, gen=g))),
        ("merge_attention_states", (q, randn((10, 4), torch.float32, gen=g), q.clone(), randn((10, 4), torch.float32, gen=g),
                                    torch.arange(10) % 3 != 0)),
        ("move_kv_slots", (kc.clone(), vc.clone(), torch.tensor([3, 4]), torch.tensor([4, 9]))),
    ]
    for op, args in cases:
        torch.library.opcheck(getattr(be.ns, op).default, args)


@pytest.mark.cuda
def test_decode_is_cuda_graph_capturable():
    """No host sync and no allocation outside the caching allocator: capture, then replay."""
    be = get_backend("cuda")
    g = make_gen(9)
    k_cache, v_cache, table = make_paged([700, 33], 8, 128, 16, torch.bfloat16, g)
    k_cache, v_cache, table = k_cache.nan_to_num(0.0).cuda(), v_cache.nan_to_num(0.0).cuda(), table.clamp_min(0).cuda()
    q = randn((2, 32, 128), torch.bfloat16, gen=g).cuda()
    lens = torch.tensor([700, 33], dtype=torch.int32, device="cuda")
    eager, _ = be.ns.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.088, -1, 0.0, 0, False)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up on the capture stream
        be.ns.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.088, -1, 0.0, 0, False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = be.ns.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.088, -1, 0.0, 0, False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_prefill_short_chunks_random(dtype):
    """The CPU impl's short-chunk path (<= 16 queries per sequence: speculative verification, small
    prefill chunks) mixed with longer chunks in one batch: random shapes, causal or not, windows,
    softcap, tree masks, empty chunks; out and lse against the fp64 reference."""
    import random

    g = make_gen(11)
    rnd = random.Random(11 + (dtype == torch.bfloat16))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for trial in range(40):
        B, hkv = rnd.randint(1, 4), rnd.choice([1, 2])
        hq, d, bs = hkv * rnd.choice([1, 2, 4]), rnd.choice([64, 128]), rnd.choice([8, 16])
        qls = [rnd.choice([0, 1, 3, 5, 16, 17, 40]) for _ in range(B)]
        kls = [max(ql + rnd.randint(0, 70), 1) for ql in qls]
        nbl = [(k + bs - 1) // bs for k in kls]
        nb = sum(nbl) + 2
        perm = torch.randperm(nb, generator=g)[: sum(nbl)].to(torch.int32)
        table = torch.zeros(B, max(nbl), dtype=torch.int32)
        for b, o in enumerate([sum(nbl[:i]) for i in range(B)]):
            table[b, : nbl[b]] = perm[o:o + nbl[b]]
        kc, vc = randn((nb, bs, hkv, d), dtype, gen=g), randn((nb, bs, hkv, d), dtype, gen=g)
        q = randn((sum(qls), hq, d), dtype, gen=g)
        cu = torch.tensor([0] + [sum(qls[: i + 1]) for i in range(B)], dtype=torch.int32)
        lens = torch.tensor(kls, dtype=torch.int32)
        causal, softcap = rnd.random() < 0.7, rnd.choice([0.0, 0.0, 5.0])
        window = rnd.choice([-1, -1, 3, 17])
        mask = None
        if rnd.random() < 0.4:  # tree masks, with windows too
            mask = torch.cat([R.tree_mask(R.random_tree_parents(ql, g)).reshape(-1) if ql else
                              torch.zeros(0, dtype=torch.bool) for ql in qls])
        out, lse = torch.ops.fastinfer.paged_prefill_attention(q, kc, vc, table, cu, lens, max(qls + [1]), 0.125,
                                                               causal, window, softcap, mask, True)
        ref_out, ref_lse = R.paged_prefill_attention(q.double(), kc.double(), vc.double(), table, cu, lens, 0.125,
                                                     causal, window, softcap, mask)[:2]
        what = f"trial {trial}: q_lens {qls} k_lens {kls} causal {causal} window {window} softcap {softcap}"
        if ref_out.numel():
            assert (out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-12) < tol, what
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), what
        if finite.any():
            lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
            assert lse_err < (1e-4 if dtype == torch.float32 else 2e-2), what
