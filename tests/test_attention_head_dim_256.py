"""head_dim 256 (Gemma 2 / 3) in the CUDA attention kernels, run by the emulator on small odd
shapes, and on CPU: the prefill kernel's D = 256 instance (4 warps, 64-row CTAs, 16-key tiles, Q
fragments read from shared memory at each k-step) through contiguous and paged prefill (ragged
batches, GQA, causal or not, windows, softcap as Gemma uses them, tree masks, fp8 caches, sinks,
the default-mode key split and the deterministic mode), and decode; fp64 reference and the
same-precision baseline of tests/test_attention.py."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_bits_equal, get_backend, make_gen, randn
import fastinfer.reference.attention as R
from test_attention import check_out_lse, cu, make_paged, naive_attention, naive_paged

MARKS = {"sim": [pytest.mark.sim], "cuda": [pytest.mark.cuda]}
DTYPES = {"cpu": (torch.bfloat16,), "sim": (torch.bfloat16, torch.float16), "cuda": (torch.bfloat16, torch.float16)}
D = 256


def params(cases):
    return [pytest.param(b, dt, c, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}-{i}")
            for b in DTYPES for dt in DTYPES[b] for i, c in enumerate(cases)]


# (q_lens, k_lens, Hq, Hkv, causal, window_left, softcap)
PREFILL_CASES = [
    ([17, 2, 70], [17, 2, 70], 8, 4, True, -1, 0.0),  # Gemma 2 2B heads: group 2
    ([15, 1], [40, 97], 4, 1, True, -1, 50.0),  # softcap (Gemma 2: 50)
    ([33, 9], [33, 70], 2, 1, False, -1, 0.0),
    ([50], [50], 4, 2, True, 16, 0.0),  # a local (sliding-window) layer
    ([20, 3], [12, 5], 4, 2, True, -1, 0.0),  # leading rows see no key
    ([70], [70], 6, 2, True, 0, 0.0),  # group 3: a CTA's 64 rows split a token's heads
]


@pytest.mark.parametrize("backend,dtype,case", params(PREFILL_CASES))
def test_prefill_attention_d256(backend, dtype, case):
    be = get_backend(backend)
    q_lens, k_lens, hq, hkv, causal, window, softcap = case
    g = make_gen(sum(q_lens) + hq)
    q = randn((sum(q_lens), hq, D), dtype, gen=g)
    k, v = randn((sum(k_lens), hkv, D), dtype, gen=g), randn((sum(k_lens), hkv, D), dtype, gen=g)
    cq, ck = cu(q_lens), cu(k_lens)
    scale, dev = 1.0 / math.sqrt(D), be.device
    out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.prefill_attention(
        q.to(dev), k.to(dev), v.to(dev), cq.to(dev), ck.to(dev), max(q_lens), max(k_lens), scale, causal, window,
        softcap, True)))
    ref_out, ref_lse = R.prefill_attention(q, k, v, cq, ck, scale, causal, window, softcap)
    naive_out, naive_lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=dtype)
    for b in range(len(q_lens)):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        vis = R.visibility_mask(qe - qs, ke - ks, causal, window)
        naive_out[qs:qe], naive_lse[qs:qe] = naive_attention(q[qs:qe], k[ks:ke], v[ks:ke], vis, scale, softcap)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "prefill D256")


# (q_lens, seq_lens, Hq, Hkv, block_size, window, softcap, tree, fixed_split_size, default key splits, fp8)
PAGED_CASES = [
    ([5, 1, 16], [40, 77, 16], 8, 4, 16, -1, 0.0, False, 0, 0, False),
    ([30], [200], 4, 1, 16, 40, 50.0, False, 0, 0, False),
    ([7, 4], [90, 20], 4, 2, 8, 25, 0.0, True, 0, 0, False),  # tree mask with a window
    ([9], [300], 4, 2, 16, -1, 0.0, False, 0, 3, False),  # the default-mode key split (forced)
    ([6, 3], [150, 100], 4, 1, 16, -1, 0.0, True, 64, 0, False),  # deterministic tree rows
    ([20], [130], 4, 2, 16, -1, 0.0, False, 64, 0, True),  # deterministic fold, fp8 cache
    ([11, 40], [60, 140], 8, 4, 16, 30, 0.0, False, 0, 0, True),  # fp8 cache
]


@pytest.mark.parametrize("backend,dtype,case", params(PAGED_CASES))
def test_paged_prefill_attention_d256(backend, dtype, case, monkeypatch):
    be = get_backend(backend)
    q_lens, seq_lens, hq, hkv, bs, window, softcap, tree, split, key_splits, fp8 = case
    if key_splits:
        monkeypatch.setenv("FASTINFER_TEST_DEFAULT_KEY_SPLITS", str(key_splits))
    g = make_gen(sum(seq_lens) + hq)
    kc, vc, table = make_paged(seq_lens, hkv, D, bs, dtype, g)
    ks = vs = None
    if fp8:
        ks, vs = torch.tensor([0.013]), torch.tensor([0.019, 0.011] * (hkv // 2) if hkv > 1 else [0.019])
        kc = (kc.float().nan_to_num(0.0) / ks).to(torch.float8_e4m3fn)
        vc = (vc.float().nan_to_num(0.0) / vs.reshape(1, 1, -1, 1)).to(torch.float8_e4m3fn)
    q = randn((sum(q_lens), hq, D), dtype, gen=g)
    mask = torch.cat([R.tree_mask(R.random_tree_parents(n, g)).reshape(-1) for n in q_lens]) if tree else None
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    scale, dev = 1.0 / math.sqrt(D), be.device
    opt = (lambda t: None if t is None else t.to(dev))
    out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_prefill_attention(
        q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cq.to(dev), lens.to(dev), max(q_lens), scale, True, window,
        softcap, opt(mask), True, None, split, None, opt(ks), opt(vs))))
    ref_out, ref_lse = R.paged_prefill_attention(q, kc, vc, table, cq, lens, scale, True, window, softcap, mask, ks, vs,
                                                 fixed_split_size=split)
    naive_out, naive_lse = naive_paged(q, kc, vc, table, cq, lens, scale, True, window, softcap, mask, ks, vs)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "paged prefill D256")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_d256_deterministic_mode_bits(backend):
    """fixed_split_size = 64 (two of the D = 256 kernel's 32-key tiles per chunk): the last token's
    row has the same bits through decode (split-parallel), paged prefill (in-kernel fold) and
    prefill over contiguous K/V, with sinks."""
    be = get_backend(backend)
    dtype, hq, hkv, n, ql = torch.bfloat16, 4, 2, 157, 5
    g = make_gen(8)
    kc, vc, table = make_paged([n], hkv, D, 16, dtype, g)
    q = randn((ql, hq, D), dtype, gen=g)
    sinks = torch.randn(hq, generator=g)
    k, v = (R.gather_paged(c, table[0], n).to(dtype) for c in (kc, vc))
    lens, dev = torch.tensor([n], dtype=torch.int32), be.device
    dec = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_decode_attention(
        q[-1:].to(dev), kc.to(dev), vc.to(dev), table.to(dev), lens.to(dev), 0.0625, -1, 0.0, 0, True, None, None, 64,
        sinks.to(dev))))
    pre = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_prefill_attention(
        q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cu([ql]).to(dev), lens.to(dev), ql, 0.0625, True, -1, 0.0,
        None, True, None, 64, sinks.to(dev))))
    con = be.run(lambda: tuple(t.cpu() for t in be.ns.prefill_attention(
        q.to(dev), k.to(dev), v.to(dev), cu([ql]).to(dev), cu([n]).to(dev), ql, n, 0.0625, True, -1, 0.0, True, 64,
        sinks.to(dev))))
    for name, (out, lse) in (("paged prefill", pre), ("prefill", con)):
        assert_bits_equal(out[-1:], dec[0], f"{backend} D256 {name} vs decode out")
        assert_bits_equal(lse[-1:], dec[1], f"{backend} D256 {name} vs decode lse")
