"""Attention sinks (gpt-oss) in the three attention ops: CPU, the CUDA kernels in the simt emulator
and the GPU (-m cuda), against the fp64 reference, which is itself checked against the producer's
definition: transformers' gpt-oss ``eager_attention_forward`` (one learned logit per query head
concatenated to the scores before the softmax, its column dropped after). The same function in the
input precision is the error rule's baseline. Cases: every path that finalises a row (one CTA, the
default-mode key split, decode splits, the deterministic mode's in-kernel fold, split-parallel
merge and tree rows), rows that see no key (out 0, lse = sink), windows, tree masks, fp8 caches."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss

from conftest import assert_bits_equal, assert_fa_close, get_backend, make_gen, randn
import fastinfer.reference.attention as R
from test_attention import cu, make_paged

MARKS = {"sim": [pytest.mark.sim], "cuda": [pytest.mark.cuda]}
DTYPES = {"cpu": (torch.float32, torch.bfloat16), "sim": (torch.bfloat16, torch.float16),
          "cuda": (torch.bfloat16, torch.float16)}


def params(cases):
    return [pytest.param(b, dt, c, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}-{i}")
            for b in DTYPES for dt in DTYPES[b] for i, c in enumerate(cases)]


def make_sinks(hq, gen):
    """Sinks of gpt-oss's magnitude (a few units), some above the scores' range so they matter."""
    return (torch.randn(hq, generator=gen) * 2.0 + 1.0).to(torch.float32)


def gpt_oss_attention(q, k, v, visible, scale, sinks, dtype):
    """transformers' gpt-oss eager attention of one sequence in `dtype`: q [ql, Hq, D], k/v [kl, Hkv,
    D], visible bool [ql, kl] -> out [ql, Hq, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    module = SimpleNamespace(num_key_value_groups=hq // hkv, sinks=sinks.to(dtype), training=False)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))[None, None]
    out, _ = modeling_gpt_oss.eager_attention_forward(
        module, q.to(dtype).transpose(0, 1)[None], k.to(dtype).transpose(0, 1)[None],
        v.to(dtype).transpose(0, 1)[None], mask, scaling=scale, dropout=0.0)
    return out[0]


def naive_sink_attention(q, k, v, visible, scale, softcap, sinks):
    """The error-rule baseline in q's precision: (out, lse). Without softcap the output is
    transformers' own function; its lse (which transformers does not return) the logsumexp of the
    same concatenated logits."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1).to(q.dtype)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))
    logits = torch.cat([s, sinks.to(q.dtype).reshape(-1, 1, 1).expand(-1, s.shape[1], 1)], -1)
    lse = torch.logsumexp(logits.float(), -1).to(q.dtype).transpose(0, 1)
    if softcap > 0:
        p = torch.softmax(logits, -1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(group, 1).to(q.dtype)), lse
    return gpt_oss_attention(q, k, v, visible, scale, sinks, q.dtype), lse


def check(out, lse, ref_out, ref_lse, naive_out, naive_lse, sinks, name):
    assert_fa_close(out, ref_out, naive_out, name=f"{name} out")
    assert lse.dtype == torch.float32
    assert torch.isfinite(lse).all(), f"{name}: with a sink every row's lse is finite"
    lse64 = lse.cpu().double()
    empty = torch.isclose(ref_lse, sinks.double().expand_as(ref_lse), rtol=0, atol=0)
    assert (out.cpu()[empty].float() == 0).all(), f"{name}: rows that see no key must be zero"
    assert torch.equal(lse.cpu()[empty], sinks.expand_as(lse)[empty]), f"{name}: rows that see no key: lse = sink"
    assert_fa_close(lse64, ref_lse, naive_lse.cpu().double(), rel_tol=1e-3, floor=1e-3, name=f"{name} lse")


@pytest.mark.parametrize("causal,window,q_len,k_len", [(True, -1, 5, 9), (False, 3, 4, 11), (True, 0, 6, 6),
                                                       (True, -1, 7, 3)])
def test_reference_is_gpt_oss_attention(causal, window, q_len, k_len):
    """The fp64 reference (apply_sinks) is transformers' gpt-oss attention, rows with no key included."""
    g = make_gen(q_len * 31 + k_len)
    q, k, v = (randn(s, torch.float64, gen=g) for s in ((q_len, 8, 64), (k_len, 2, 64), (k_len, 2, 64)))
    sinks = make_sinks(8, g)
    vis = R.visibility_mask(q_len, k_len, causal, window)
    ref_out, _ = R.apply_sinks(*R.attention_one_sequence(q, k, v, 0.125, vis), sinks)
    hf = gpt_oss_attention(q, k, v, vis, 0.125, sinks, torch.float64)
    assert (hf - ref_out).abs().max().item() < 1e-12


# (q_lens, k_lens, Hq, Hkv, D, causal, window_left, softcap, fixed_split_size)
PREFILL_CASES = [
    ([17, 2, 100], [17, 2, 100], 8, 2, 64, True, -1, 0.0, 0),
    ([20, 3], [12, 5], 4, 2, 64, True, -1, 0.0, 0),  # q_len > k_len: leading rows see no key
    ([33, 9], [33, 70], 4, 1, 128, False, 7, 0.0, 0),
    ([65, 9], [80, 9], 8, 2, 64, True, -1, 20.0, 0),
    ([70, 5], [150, 5], 6, 2, 64, True, -1, 0.0, 64),  # deterministic: in-kernel fold, sink after it
    ([40, 3], [20, 3], 4, 1, 128, True, 30, 0.0, 64),
]


@pytest.mark.parametrize("backend,dtype,case", params(PREFILL_CASES))
def test_prefill_attention_sinks(backend, dtype, case):
    be = get_backend(backend)
    q_lens, k_lens, hq, hkv, d, causal, window, softcap, split = case
    g = make_gen(sum(q_lens) + d + split)
    q, k, v = (randn((n, h, d), dtype, gen=g) for n, h in ((sum(q_lens), hq), (sum(k_lens), hkv), (sum(k_lens), hkv)))
    sinks = make_sinks(hq, g)
    cq, ck = cu(q_lens), cu(k_lens)
    scale, dev = 1.0 / math.sqrt(d), be.device

    def run():
        out, lse = be.ns.prefill_attention(q.to(dev), k.to(dev), v.to(dev), cq.to(dev), ck.to(dev), max(q_lens),
                                           max(k_lens), scale, causal, window, softcap, True, split, sinks.to(dev))
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.prefill_attention(q, k, v, cq, ck, scale, causal, window, softcap, split, sinks)
    naive_out, naive_lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=dtype)
    for b in range(len(q_lens)):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        vis = R.visibility_mask(qe - qs, ke - ks, causal, window)
        naive_out[qs:qe], naive_lse[qs:qe] = naive_sink_attention(q[qs:qe], k[ks:ke], v[ks:ke], vis, scale, softcap,
                                                                  sinks)
    check(out, lse, ref_out, ref_lse, naive_out, naive_lse, sinks, "prefill")


def paged_case(q_lens, seq_lens, hq, hkv, d, bs, dtype, g, tree):
    kc, vc, table = make_paged(seq_lens, hkv, d, bs, dtype, g)
    q = randn((sum(q_lens), hq, d), dtype, gen=g)
    mask = None
    if tree:
        mask = torch.cat([R.tree_mask(R.random_tree_parents(n, g)).reshape(-1) for n in q_lens])
    return q, kc, vc, table, mask


# (q_lens, seq_lens, Hq, Hkv, D, block_size, causal, window, tree mask, fixed_split_size, default splits)
PAGED_CASES = [
    ([5, 1], [40, 77], 8, 2, 64, 16, True, -1, False, 0, 0),  # short chunks
    ([30], [300], 4, 1, 128, 16, True, -1, False, 0, 0),  # a long chunk (CPU: not the flash path)
    ([7, 4], [90, 20], 8, 2, 64, 8, True, 25, True, 0, 0),  # tree mask and window
    ([9], [400], 4, 2, 64, 16, True, -1, False, 0, 3),  # the default-mode key split (forced)
    ([6, 3], [200, 130], 4, 1, 64, 16, True, -1, True, 64, 0),  # deterministic tree rows (keys by rank)
]


@pytest.mark.parametrize("backend,dtype,case", params(PAGED_CASES))
def test_paged_prefill_attention_sinks(backend, dtype, case, monkeypatch):
    be = get_backend(backend)
    q_lens, seq_lens, hq, hkv, d, bs, causal, window, tree, split, key_splits = case
    if key_splits:
        monkeypatch.setenv("FASTINFER_TEST_DEFAULT_KEY_SPLITS", str(key_splits))
    g = make_gen(sum(seq_lens) + d)
    q, kc, vc, table, mask = paged_case(q_lens, seq_lens, hq, hkv, d, bs, dtype, g, tree)
    sinks = make_sinks(hq, g)
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    scale, dev = 1.0 / math.sqrt(d), be.device
    opt = (lambda t: None if t is None else t.to(dev))

    def run():
        out, lse = be.ns.paged_prefill_attention(q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cq.to(dev),
                                                 lens.to(dev), max(q_lens), scale, causal, window, 0.0, opt(mask),
                                                 True, None, split, sinks.to(dev))
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.paged_prefill_attention(q, kc, vc, table, cq, lens, scale, causal, window, 0.0, mask,
                                                 fixed_split_size=split, sinks=sinks)
    naive_out, naive_lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=dtype)
    off = 0
    for b, n in enumerate(seq_lens):
        qs, qe = int(cq[b]), int(cq[b + 1])
        m = None if mask is None else mask[off:off + (qe - qs) ** 2]
        off += (qe - qs) ** 2
        vis = R.visibility_mask(qe - qs, n, causal, window, m)
        kb, vb = (R.gather_paged(c, table[b], n).to(dtype) for c in (kc, vc))
        naive_out[qs:qe], naive_lse[qs:qe] = naive_sink_attention(q[qs:qe], kb, vb, vis, scale, 0.0, sinks)
    check(out, lse, ref_out, ref_lse, naive_out, naive_lse, sinks, "paged prefill")


# (seq_lens, Hq, Hkv, D, window, num_splits, fixed_split_size, fp8 cache)
DECODE_CASES = [
    ([1, 37, 200], 8, 2, 64, -1, 1, 0, False),  # one CTA writes the row
    ([1, 37, 300], 8, 2, 128, -1, 3, 0, False),  # three splits: the merge kernel counts the sink
    ([5, 260], 4, 1, 64, 40, 0, 0, False),
    ([90, 3], 8, 8, 64, -1, 0, 64, False),  # deterministic: split-parallel chunks and their merge
    ([70, 130], 8, 2, 128, -1, 2, 0, True),  # fp8 cache
]


@pytest.mark.parametrize("backend,dtype,case", params(DECODE_CASES))
def test_paged_decode_attention_sinks(backend, dtype, case):
    be = get_backend(backend)
    seq_lens, hq, hkv, d, window, splits, split, fp8 = case
    g = make_gen(sum(seq_lens) + hq + d)
    kc, vc, table = make_paged(seq_lens, hkv, d, 16, dtype, g)
    ks = vs = None
    if fp8:
        ks, vs = torch.tensor([0.02]), torch.tensor([0.03])
        kc = (kc.float().nan_to_num(0.0) / ks).to(torch.float8_e4m3fn)
        vc = (vc.float().nan_to_num(0.0) / vs).to(torch.float8_e4m3fn)
    q = randn((len(seq_lens), hq, d), dtype, gen=g)
    sinks = make_sinks(hq, g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale, dev = 1.0 / math.sqrt(d), be.device
    opt = (lambda t: None if t is None else t.to(dev))

    def run():
        out, lse = be.ns.paged_decode_attention(q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), lens.to(dev), scale,
                                                window, 0.0, splits, True, opt(ks), opt(vs), split, sinks.to(dev))
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.paged_decode_attention(q, kc, vc, table, lens, scale, window, 0.0, ks, vs, split, sinks)
    naive_out, naive_lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=dtype)
    for b, n in enumerate(seq_lens):
        vis = R.visibility_mask(1, n, True, window)
        kb, vb = R.gather_paged(kc, table[b], n, ks).to(dtype), R.gather_paged(vc, table[b], n, vs).to(dtype)
        naive_out[b:b + 1], naive_lse[b:b + 1] = naive_sink_attention(q[b:b + 1], kb, vb, vis, scale, 0.0, sinks)
    check(out, lse, ref_out, ref_lse, naive_out, naive_lse, sinks, "decode")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_sinks_deterministic_mode_bits(backend):
    """fixed_split_size > 0 with sinks: a row's bits are the same through decode (split-parallel
    chunks, the sink in the merge kernel), paged prefill (the in-kernel fold, the sink after the
    last chunk) and prefill over contiguous K/V."""
    be = get_backend(backend)
    dtype, hq, hkv, d, n = torch.bfloat16, 8, 2, 64, 203
    g = make_gen(5)
    kc, vc, table = make_paged([n], hkv, d, 16, dtype, g)
    q = randn((1, hq, d), dtype, gen=g)
    sinks = make_sinks(hq, g)
    lens = torch.tensor([n], dtype=torch.int32)
    k, v = (R.gather_paged(c, table[0], n).to(dtype) for c in (kc, vc))
    dev = be.device
    with torch.no_grad():
        dec = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_decode_attention(
            q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), lens.to(dev), 0.125, -1, 0.0, 0, True, None, None, 64,
            sinks.to(dev))))
        pre = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_prefill_attention(
            q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cu([1]).to(dev), lens.to(dev), 1, 0.125, True, -1, 0.0,
            None, True, None, 64, sinks.to(dev))))
        con = be.run(lambda: tuple(t.cpu() for t in be.ns.prefill_attention(
            q.to(dev), k.to(dev), v.to(dev), cu([1]).to(dev), cu([n]).to(dev), 1, n, 0.125, True, -1, 0.0, True, 64,
            sinks.to(dev))))
    for name, (out, lse) in (("paged prefill", pre), ("prefill", con)):
        assert_bits_equal(out, dec[0], f"{backend} {name} vs decode out")
        assert_bits_equal(lse, dec[1], f"{backend} {name} vs decode lse")


def _args(op, sinks):
    g = make_gen(1)
    q = randn((3, 4, 64), torch.float32, gen=g)
    kc, vc = randn((4, 16, 2, 64), torch.float32, gen=g), randn((4, 16, 2, 64), torch.float32, gen=g)
    table, lens = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32), torch.tensor([20, 5, 3], dtype=torch.int32)
    if op == "prefill_attention":
        return [q, q.clone(), q.clone(), cu([2, 1]), cu([2, 1]), 2, 2, 0.125, True, -1, 0.0, False, 0, sinks]
    if op == "paged_prefill_attention":
        return [q, kc, vc, table[:2], cu([2, 1]), lens[:2], 2, 0.125, True, -1, 0.0, None, False, None, 0, sinks]
    return [q, kc, vc, table, lens, 0.125, -1, 0.0, 0, False, None, None, 0, sinks]


def _to_bf16(args):
    return [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args]


BAD_SINKS = [
    ("dtype", lambda: torch.zeros(4, dtype=torch.float16), "sinks must be float32"),
    ("length", lambda: torch.zeros(3), r"sinks must have shape \[num_q_heads\] = \[4\]"),
    ("rank", lambda: torch.zeros(1, 4), r"sinks must have shape"),
    ("strided", lambda: torch.zeros(8)[::2], "sinks must be contiguous"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("op", ["prefill_attention", "paged_prefill_attention", "paged_decode_attention"])
@pytest.mark.parametrize("case,make,message", BAD_SINKS, ids=[b[0] for b in BAD_SINKS])
def test_sinks_bad_input(ns, op, case, make, message):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    args = _args(op, make())
    if ns == "fastinfer_sim":  # the kernels take fp16/bf16 only (sinks, last, stay as made)
        args = _to_bf16(args[:-1]) + args[-1:]
    with pytest.raises(RuntimeError, match=message) as exc:
        getattr(be.ns, op)(*args)
    assert f"{ns}.{op}:" in str(exc.value)


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_sinks_opcheck(ns):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    g = make_gen(3)
    sinks = make_sinks(4, g)
    args = {op: _args(op, sinks) for op in ("prefill_attention", "paged_prefill_attention", "paged_decode_attention")}
    for op, a in args.items():
        a = _to_bf16(a[:-1]) + a[-1:]
        a[{"prefill_attention": 11, "paged_prefill_attention": 12, "paged_decode_attention": 9}[op]] = True  # return_lse
        torch.library.opcheck(getattr(be.ns, op).default, tuple(a))
