"""The deterministic mode of the attention ops (``fixed_split_size = F > 0``).

A query row's out and lse must be bitwise the same (``torch.equal``, never a tolerance) through
``paged_decode_attention``, ``paged_prefill_attention`` with q_len 1..17 (its prefix already in the
cache: chunked prefill / prefix-cache hits), a tree mask whose chain holds the row (laid out first,
or its ancestors scattered among 50 nodes: keys by rank), and
``prefill_attention`` (whole prompt or a chunk after a prefix), whatever the batch around it (other
sequences before and after it, empty and padding sequences, wider block tables so more key splits
are launched) -- on the CPU impls and on the CUDA kernel sources in the simt emulator. Small odd
shapes (GQA group 3, so a CTA tile splits a token's heads; 151 keys: chunks of 64 and 192 keys
with a ragged last one). Plus: parity with the fp64 reference in this mode, a proof that the
default mode does differ on the same inputs (so the invariance checks can fail), opcheck and bad
input for the new argument."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from conftest import get_backend, make_gen, poison_, randn
from test_attention import check_out_lse, cu, naive_attention, naive_paged
import fastinfer.reference.attention as R
from fastinfer.ops import pack_custom_mask

HQ, HKV, BS = 6, 2, 16
POS = 150  # the probe row: position 150 of its sequence (151 keys)
SIM = [pytest.mark.sim]

# (backend, dtype, head_dim, fixed_split_size, window_left, softcap)
INVARIANCE = [
    ("cpu", torch.float32, 64, 64, -1, 0.0),
    ("cpu", torch.bfloat16, 128, 192, -1, 0.0),
    ("cpu", torch.float16, 64, 64, 40, 30.0),
    ("sim", torch.bfloat16, 64, 64, -1, 0.0),
    ("sim", torch.float16, 64, 192, 40, 30.0),
]


class World:
    """One probe sequence (q, k, v for positions 0..POS) and noise sequences; every op call below
    builds its own shuffled paged cache (unused slots poisoned) or contiguous batch from them."""

    def __init__(self, dtype, d, seed):
        self.g = make_gen(seed)
        self.dtype, self.d = dtype, d
        n = POS + 1
        self.q = randn((n, HQ, d), dtype, gen=self.g)
        self.k = randn((n, HKV, d), dtype, gen=self.g)
        self.v = randn((n, HKV, d), dtype, gen=self.g)
        self.scale = 1.0 / math.sqrt(d)

    def noise(self, n_keys):
        return randn((n_keys, HKV, self.d), self.dtype, gen=self.g), randn((n_keys, HKV, self.d), self.dtype, gen=self.g)

    def noise_q(self, n):
        return randn((n, HQ, self.d), self.dtype, gen=self.g)

    def paged(self, seqs, extra_width=0):
        """seqs: list of (k, v) [n_i, Hkv, D] -> (k_cache, v_cache, table, seq_lens)."""
        blocks = [max(1, math.ceil(k.shape[0] / BS)) for k, _ in seqs]
        nb = sum(blocks) + 2
        perm = torch.randperm(nb, generator=self.g).to(torch.int32)
        table = torch.full((len(seqs), max(blocks) + 1 + extra_width), -7, dtype=torch.int32)
        kc = poison_(torch.empty((nb, BS, HKV, self.d), dtype=self.dtype))
        vc = poison_(torch.empty((nb, BS, HKV, self.d), dtype=self.dtype))
        used = 0
        for b, (k, v) in enumerate(seqs):
            table[b, : blocks[b]] = perm[used : used + blocks[b]]
            used += blocks[b]
            for j in range(k.shape[0]):
                kc[int(table[b, j // BS]), j % BS] = k[j]
                vc[int(table[b, j // BS]), j % BS] = v[j]
        lens = torch.tensor([k.shape[0] for k, _ in seqs], dtype=torch.int32)
        return kc, vc, table, lens


def probe_rows(world, be, split, window, softcap):
    """(name, out [Hq, D], lse [Hq]) of the probe row through every op and batch shape."""
    w, ns = world, be.ns
    kv = (w.k, w.v)
    rows = []

    def decode(name, before, after, extra_width=0):
        seqs = [w.noise(n) for n in before] + [kv] + [w.noise(n) for n in after]
        kc, vc, table, lens = w.paged(seqs, extra_width)
        q = torch.cat([w.noise_q(len(before)), w.q[POS:], w.noise_q(len(after))])
        out, lse = ns.paged_decode_attention(q, kc, vc, table, lens, w.scale, window, softcap, 0, True, None, None,
                                             split)
        rows.append((name, out[len(before)], lse[len(before)]))

    decode("decode alone", [], [])
    decode("decode in a batch (padding rows, a wide table: more splits)", [5, 1, 300], [1, 64], extra_width=9)

    # paged prefill: 17 copies of the probe sequence with q_len 1..17 (their queries the last q_len
    # positions, the prefix already in the cache), an empty sequence and a noise prompt among them.
    seqs, qs, q_lens = [], [], []
    for ql in range(1, 18):
        seqs.append(kv)
        qs.append(w.q[POS + 1 - ql :])
        q_lens.append(ql)
        if ql == 9:
            seqs += [w.noise(20), w.noise(33)]
            qs += [w.noise_q(0), w.noise_q(33)]
            q_lens += [0, 33]
    kc, vc, table, lens = w.paged(seqs)
    cq = cu(q_lens)
    out, lse = ns.paged_prefill_attention(torch.cat(qs), kc, vc, table, cq, lens, max(q_lens), w.scale, True, window,
                                          softcap, None, True, None, split)
    for b, ql in enumerate(q_lens):
        if seqs[b] is kv:
            r = int(cq[b + 1]) - 1
            rows.append((f"paged prefill q_len={ql}", out[r], lse[r]))

    # tree verification: chain nodes 0..3 are positions POS-3..POS (the probe is node 3), branch
    # nodes 4..6 hang off nodes 1, 0, 4 and their keys follow the chain.
    parents = [-1, 0, 1, 2, 1, 0, 4]
    bk, bv = w.noise(3)
    tk, tv = torch.cat([w.k, bk]), torch.cat([w.v, bv])
    kc, vc, table, lens = w.paged([w.noise(40), (tk, tv)])
    mask = torch.cat([R.tree_mask([-1, 0, 1]).reshape(-1), R.tree_mask(parents).reshape(-1)])
    q = torch.cat([w.noise_q(3), w.q[POS - 3 :], w.noise_q(3)])
    out, lse = ns.paged_prefill_attention(q, kc, vc, table, cu([3, 7]), lens, 7, w.scale, True, window, softcap, mask,
                                          True, None, split)
    rows.append(("tree node on the chain", out[3 + 3], lse[3 + 3]))

    # tree verification with the probe's ancestors scattered: 50 nodes, the chain (positions
    # POS-3..POS) at nodes 0, 20, 35, 49, so by index its keys cross 32- and 64-key tile edges and
    # the 192-key split edge that it does not cross in the plain sequence; the keys are taken by
    # rank. Behind a 5-node tree (the mask then starts mid-byte in the packed form).
    chain = [0, 20, 35, 49]
    gen = torch.Generator().manual_seed(11)
    parents = [-1] + [chain[chain.index(i) - 1] if i in chain else int(torch.randint(0, i, (1,), generator=gen))
                      for i in range(1, 50)]
    bk, bv = w.noise(50)
    for depth, node in enumerate(chain):
        bk[node], bv[node] = w.k[POS - 3 + depth], w.v[POS - 3 + depth]
    tk, tv = torch.cat([w.k[: POS - 3], bk]), torch.cat([w.v[: POS - 3], bv])
    kc, vc, table, lens = w.paged([w.noise(12), (tk, tv)])
    mask = torch.cat([R.tree_mask([-1, 0, 0, 1, 2]).reshape(-1), R.tree_mask(parents).reshape(-1)])
    tq = w.noise_q(50)
    tq[chain] = w.q[POS - 3 :]
    q = torch.cat([w.noise_q(5), tq])
    for form, m in (("bool", mask), ("packed", pack_custom_mask(mask))):
        bool_mask, packed = (m, None) if form == "bool" else (None, m)
        out, lse = ns.paged_prefill_attention(q, kc, vc, table, cu([5, 50]), lens, 50, w.scale, True, window,
                                              softcap, bool_mask, True, packed, split)
        rows.append((f"tree node with scattered ancestors ({form} mask)", out[5 + 49], lse[5 + 49]))

    # contiguous prefill: the whole prompt alone, and a 7-token chunk after a prefix in a batch
    out, lse = ns.prefill_attention(w.q, w.k, w.v, cu([POS + 1]), cu([POS + 1]), POS + 1, POS + 1, w.scale, True,
                                    window, softcap, True, split)
    rows.append(("prefill_attention whole prompt", out[POS], lse[POS]))
    nk, nv = w.noise(90)
    q = torch.cat([w.noise_q(12), w.q[POS - 6 :], w.noise_q(1)])
    k, v = torch.cat([nk, w.k, nk[:5]]), torch.cat([nv, w.v, nv[:5]])
    out, lse = ns.prefill_attention(q, k, v, cu([12, 7, 1]), cu([90, POS + 1, 5]), 12, 151, w.scale, True, window,
                                    softcap, True, split)
    rows.append(("prefill_attention chunk after a prefix, in a batch", out[12 + 6], lse[12 + 6]))
    return rows


@pytest.mark.parametrize("backend,dtype,d,split,window,softcap",
                         [pytest.param(*c, marks=SIM if c[0] == "sim" else [], id=f"{c[0]}-{str(c[1])[6:]}-D{c[2]}-F{c[3]}"
                                       + ("-window" if c[4] >= 0 else "")) for c in INVARIANCE])
def test_row_is_bitwise_invariant(backend, dtype, d, split, window, softcap):
    be = get_backend(backend)
    world = World(dtype, d, seed=d + split)
    _assert_rows_equal(probe_rows(world, be, split, window, softcap), split)


def _assert_rows_equal(rows, split):
    name0, out0, lse0 = rows[0]
    assert torch.isfinite(out0.float()).all() and out0.float().abs().sum() > 0
    for name, out, lse in rows[1:]:
        assert torch.equal(out, out0), f"{name}: out differs from {name0} in fixed_split_size={split} mode"
        assert torch.equal(lse, lse0), f"{name}: lse differs from {name0} in fixed_split_size={split} mode"


@pytest.mark.sim
@pytest.mark.parametrize("plan", ["shared", "per-token"])
def test_tree_rows_either_launch_plan(monkeypatch, plan):
    """Under a custom mask the CUDA fold runs either as one launch of per-token work items or as two
    (the sequences' own items over the whole chunks of the prefix, then per-token items over the
    rest from that state), chosen by how many CTAs the sequences' items give; forcing each plan
    gives the decode bits (F = 64: the 150-key prefix spans two whole chunks)."""
    monkeypatch.setenv("FASTINFER_TEST_FIXED_TREE_PREFIX", plan)
    be = get_backend("sim")
    _assert_rows_equal(probe_rows(World(torch.bfloat16, 64, seed=31), be, 64, 40, 30.0), 64)
    if importlib.util.find_spec("fastinfer._simprof") is not None:
        import fastinfer.simt as simt

        w = World(torch.bfloat16, 64, seed=32)
        kc, vc, table, lens = w.paged([w.noise(150)])
        q, mask = w.noise_q(4), R.tree_mask([-1, 0, 0, 1]).reshape(-1)
        rep = simt.profile(lambda: torch.ops.fastinfer_sim.paged_prefill_attention(
            q, kc, vc, table, cu([4]), lens, 4, w.scale, True, -1, 0.0, mask, False, None, 64), launch_only=True)
        launches = sum(len(k["records"]) for k in rep["kernels"] if "prefill_attention_kernel" in k["name"])
        assert launches == (2 if plan == "shared" else 1)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=SIM)])
def test_default_mode_differs(backend):
    """The same rows with fixed_split_size=0 are not all bitwise equal (decode and prefill are
    different kernels / paths), so test_row_is_bitwise_invariant checks something that can fail."""
    be = get_backend(backend)
    world = World(torch.bfloat16, 64, seed=5)
    rows = probe_rows(world, be, 0, -1, 0.0)
    _, out0, _ = rows[0]
    differing = [name for name, out, _ in rows[1:] if not torch.equal(out, out0)]
    assert differing, "the default mode gave the same bits everywhere: the invariance test would prove nothing"


@pytest.mark.sim
def test_decode_split_launches_do_not_change_bits(monkeypatch):
    """Split-parallel decode folds its chunks over several launches (running fp32 state) when the
    partials of one launch would pass a bound (256 MiB; large batches): forcing one chunk per launch
    on a small shape must give the same bits."""
    be = get_backend("sim")
    w = World(torch.bfloat16, 64, seed=23)
    kc, vc, table, lens = w.paged([w.noise(n) for n in (300, 7, 151)], extra_width=3)
    q = w.noise_q(3)

    def run():
        return be.ns.paged_decode_attention(q, kc, vc, table, lens, w.scale, -1, 0.0, 0, True, None, None, 64)

    def merge_launches():
        import fastinfer.simt as simt

        rep = simt.profile(lambda: torch.ops.fastinfer_sim.paged_decode_attention(
            q, kc, vc, table, lens, w.scale, -1, 0.0, 0, True, None, None, 64), launch_only=True)
        return sum(len(k["records"]) for k in rep["kernels"] if "prefill_merge_splits_kernel" in k["name"])

    out, lse = run()
    have_prof = importlib.util.find_spec("fastinfer._simprof") is not None
    if have_prof:
        assert merge_launches() == 1
    monkeypatch.setenv("FASTINFER_TEST_FIXED_SPLIT_PARTIAL_BYTES", "1")
    if have_prof:
        assert merge_launches() == math.ceil(table.shape[1] * BS / 64)  # one chunk per launch
    out1, lse1 = run()
    assert torch.equal(out1, out) and torch.equal(lse1, lse)


# ---------------------------------------------------------------------------------------------
# parity with the fp64 reference in the fixed mode (the sim runs twice, bit-identical)
@pytest.mark.parametrize("backend,dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16),
                                           pytest.param("sim", torch.bfloat16, marks=SIM),
                                           pytest.param("sim", torch.float16, marks=SIM)])
def test_fixed_split_matches_reference(backend, dtype):
    be = get_backend(backend)
    w = World(dtype, 64, seed=17)
    split = 64
    seqs = [w.noise(n) for n in (200, 9, 70)]
    kc, vc, table, lens = w.paged(seqs)
    q_lens = [13, 9, 1]
    q = w.noise_q(sum(q_lens))
    cq = cu(q_lens)
    mask = torch.cat([R.tree_mask([-1, 0, 1, 1, 0, 4, 5, 2, 3, 8, 9, 0, 11]).reshape(-1),
                      torch.tril(torch.ones(9, 9, dtype=torch.bool)).reshape(-1), torch.ones(1, dtype=torch.bool)])

    out, lse = be.run(lambda: be.ns.paged_prefill_attention(q, kc, vc, table, cq, lens, 13, w.scale, True, 30, 0.0,
                                                            mask, True, None, split))
    ref_out, ref_lse = R.paged_prefill_attention(q, kc, vc, table, cq, lens, w.scale, True, 30, 0.0, mask,
                                                 fixed_split_size=split)
    naive_out, naive_lse = naive_paged(q, kc, vc, table, cq, lens, w.scale, True, 30, 0.0, mask)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "paged prefill (tree, window)")

    qd = w.noise_q(3)
    out, lse = be.run(lambda: be.ns.paged_decode_attention(qd, kc, vc, table, lens, w.scale, -1, 0.0, 0, True, None,
                                                           None, split))
    ref_out, ref_lse = R.paged_decode_attention(qd, kc, vc, table, lens, w.scale, fixed_split_size=split)
    naive_out, naive_lse = naive_paged(qd, kc, vc, table, torch.arange(4, dtype=torch.int32), lens, w.scale, True,
                                       -1, 0.0)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "decode")

    k, v = torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs])
    ck = cu([200, 9, 70])
    out, lse = be.run(lambda: be.ns.prefill_attention(q, k, v, cq, ck, 13, 200, w.scale, True, -1, 0.0, True, split))
    ref_out, ref_lse = R.prefill_attention(q, k, v, cq, ck, w.scale, True, fixed_split_size=split)
    naive_out, naive_lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=dtype)
    for b in range(3):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        vis = R.visibility_mask(qe - qs, ke - ks, True, -1)
        naive_out[qs:qe], naive_lse[qs:qe] = naive_attention(q[qs:qe], k[ks:ke], v[ks:ke], vis, w.scale, 0.0)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "prefill_attention")


# ---------------------------------------------------------------------------------------------
def _small():
    g = make_gen(3)
    bf = torch.bfloat16
    q, k = randn((10, 4, 64), bf, gen=g), randn((12, 2, 64), bf, gen=g)
    w = World(bf, 64, seed=3)
    kc, vc, table, lens = w.paged([w.noise(20), w.noise(3)])
    return q, k, kc, vc, table, lens


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=SIM)])
def test_fixed_split_opcheck(ns):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    q, k, kc, vc, table, lens = _small()
    cases = [
        ("prefill_attention", (q, k, k.clone(), cu([4, 6]), cu([5, 7]), 6, 7, 0.125, True, -1, 0.0, True, 64)),
        ("paged_prefill_attention", (q[:5], kc, vc, table, cu([2, 3]), lens, 3, 0.125, True, -1, 0.0,
                                     torch.ones(13, dtype=torch.bool), True, None, 128)),
        ("paged_decode_attention", (q[:2], kc, vc, table, lens, 0.125, -1, 0.0, 0, True, None, None, 64)),
    ]
    for op, args in cases:
        torch.library.opcheck(getattr(be.ns, op).default, args)


def _bad_cases():
    q, k, kc, vc, table, lens = _small()
    prefill = lambda f: ("prefill_attention", (q, k, k.clone(), cu([4, 6]), cu([5, 7]), 6, 7, 0.125, True, -1,  # noqa: E731
                                               0.0, False, f))
    paged = lambda f: ("paged_prefill_attention", (q[:5], kc, vc, table, cu([2, 3]), lens, 3, 0.125, True, -1,  # noqa: E731
                                                   0.0, None, False, None, f))
    decode = lambda f, splits=0: (  # noqa: E731
        "paged_decode_attention", (q[:2], kc, vc, table, lens, 0.125, -1, 0.0, splits, False, None, None, f))
    return [
        ("prefill-not-tile-multiple", prefill(32), r"fixed_split_size must be 0 .* multiple of 64"),
        ("prefill-negative", prefill(-64), r"fixed_split_size must be 0"),
        ("paged-not-tile-multiple", paged(100), r"fixed_split_size must be 0 .* multiple of 64"),
        ("decode-not-tile-multiple", decode(65), r"fixed_split_size must be 0 .* multiple of 64"),
        ("decode-with-num_splits", decode(64, splits=2), r"num_splits must be 0 when fixed_split_size > 0"),
    ]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=SIM)])
def test_fixed_split_bad_input(ns):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    for case, (op, args), pattern in _bad_cases():
        with pytest.raises(RuntimeError, match=pattern) as exc:
            getattr(be.ns, op)(*args)
        assert f"{ns}.{op}:" in str(exc.value), case
