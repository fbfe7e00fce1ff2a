"""The fp8 e4m3 KV cache through paged_prefill_attention and paged_decode_attention: scales per
tensor or per KV head, every prefill path (short chunks, long chunks, tree masks, the deterministic
mode, the default-mode key split), against the fp64 reference on the dequantised cache; the
same-precision baseline dequantises in q's dtype. The cache is written by reshape_and_cache (whose
encoding tests/test_elementwise_ops.py checks bit for bit against the reference), and a long-context
case checks that the error does not grow with the number of keys (fp32 accumulation across tiles)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_bits_equal, get_backend, make_gen, randn
import fastinfer.reference.attention as R
from test_attention import check_out_lse, cu, make_paged, naive_paged

MARKS = {"sim": [pytest.mark.sim], "cuda": [pytest.mark.cuda]}
DTYPES = {"cpu": (torch.float32, torch.bfloat16), "sim": (torch.bfloat16, torch.float16),
          "cuda": (torch.bfloat16, torch.float16)}


def params(cases, backends=("cpu", "sim", "cuda")):
    return [pytest.param(b, dt, c, marks=MARKS.get(b, []), id=f"{b}-{str(dt)[6:]}-{i}")
            for b in backends for dt in DTYPES[b] for i, c in enumerate(cases)]


def fp8_cache(seq_lens, hkv, d, bs, g, per_head, magnitude=1.0):
    """A paged fp8 cache as the runner writes it: random K/V through reshape_and_cache with scales
    (one, or one per KV head, of different sizes), into shuffled blocks."""
    kc, vc, table = make_paged(seq_lens, hkv, d, bs, torch.float32, g)
    if per_head:
        k_scale = (torch.rand(hkv, generator=g) * 0.02 + 0.005).to(torch.float32)
        v_scale = (torch.rand(hkv, generator=g) * 0.02 + 0.005).to(torch.float32)
    else:
        k_scale, v_scale = torch.tensor([0.011]), torch.tensor([0.017])
    nb, bsz = kc.shape[:2]
    k8 = torch.full((nb, bsz, hkv, d), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN bytes
    v8 = k8.clone()
    slots = [int(table[b, j // bs]) * bs + j % bs for b, n in enumerate(seq_lens) for j in range(n)]
    slots = torch.tensor(slots, dtype=torch.int64)
    rows_k = kc.reshape(-1, hkv, d)[slots] * magnitude
    rows_v = vc.reshape(-1, hkv, d)[slots] * magnitude
    for cache, rows, scale in ((k8, rows_k, k_scale), (v8, rows_v, v_scale)):
        q8 = (rows / scale.reshape(1, -1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        cache.reshape(-1, hkv, d)[slots] = q8
    return k8, v8, table, k_scale, v_scale


# (q_lens, seq_lens, Hq, Hkv, D, block_size, causal, window, tree mask, fixed_split_size, per-head scales)
PAGED_CASES = [
    ([5, 1, 16], [40, 77, 16], 8, 2, 64, 16, True, -1, False, 0, False),  # short chunks
    ([30, 70], [300, 70], 4, 1, 128, 16, True, -1, False, 0, True),  # long chunks (CPU: not the flash path)
    ([7, 4], [90, 20], 8, 2, 64, 8, True, 25, True, 0, True),  # tree mask with a window
    ([33], [160], 4, 2, 128, 16, False, 40, False, 0, False),
    ([6, 3], [200, 130], 4, 1, 64, 16, True, -1, True, 64, True),  # deterministic tree rows
    ([20], [260], 8, 2, 64, 16, True, -1, False, 128, False),  # deterministic fold
]


@pytest.mark.parametrize("backend,dtype,case", params(PAGED_CASES))
def test_paged_prefill_fp8_cache(backend, dtype, case):
    be = get_backend(backend)
    q_lens, seq_lens, hq, hkv, d, bs, causal, window, tree, split, per_head = case
    g = make_gen(sum(seq_lens) + d + hq)
    kc, vc, table, ks, vs = fp8_cache(seq_lens, hkv, d, bs, g, per_head)
    q = randn((sum(q_lens), hq, d), dtype, gen=g)
    mask = torch.cat([R.tree_mask(R.random_tree_parents(n, g)).reshape(-1) for n in q_lens]) if tree else None
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    scale, dev = 1.0 / math.sqrt(d), be.device
    opt = (lambda t: None if t is None else t.to(dev))

    def run():
        out, lse = be.ns.paged_prefill_attention(q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cq.to(dev),
                                                 lens.to(dev), max(q_lens), scale, causal, window, 0.0, opt(mask),
                                                 True, None, split, None, ks.to(dev), vs.to(dev))
        return out.cpu(), lse.cpu()

    out, lse = be.run(run)
    ref_out, ref_lse = R.paged_prefill_attention(q, kc, vc, table, cq, lens, scale, causal, window, 0.0, mask, ks, vs,
                                                 fixed_split_size=split)
    naive_out, naive_lse = naive_paged(q, kc, vc, table, cq, lens, scale, causal, window, 0.0, mask, ks, vs)
    check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, "fp8 paged prefill")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_paged_decode_fp8_cache_per_head_scales(backend):
    be = get_backend(backend)
    dtype, seq_lens, hq, hkv, d = torch.bfloat16, [1, 37, 300], 8, 2, 128
    g = make_gen(77)
    kc, vc, table, ks, vs = fp8_cache(seq_lens, hkv, d, 16, g, per_head=True)
    q = randn((len(seq_lens), hq, d), dtype, gen=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    dev = be.device
    for splits in (1, 3):
        out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_decode_attention(
            q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), lens.to(dev), 0.088, -1, 0.0, splits, True, ks.to(dev),
            vs.to(dev))))
        ref_out, ref_lse = R.paged_decode_attention(q, kc, vc, table, lens, 0.088, -1, 0.0, ks, vs)
        naive_out, naive_lse = naive_paged(q, kc, vc, table, torch.arange(len(seq_lens) + 1, dtype=torch.int32), lens,
                                           0.088, True, -1, 0.0, None, ks, vs)
        check_out_lse(out, lse, ref_out, ref_lse, naive_out, naive_lse, f"fp8 decode splits={splits}")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_cache_error_does_not_grow_with_context(backend):
    """A chunk of queries at the end of 1k and of 16k keys of an fp8 cache: the error against the
    fp64 reference on the dequantised cache stays at the level of the short context (fp32
    accumulation across 64-key tiles; no error that grows with the number of tiles)."""
    be = get_backend(backend)
    dtype, hq, hkv, d, ql = torch.bfloat16, 4, 1, 128, 16
    errors = {}
    for n in (1024, 16384):
        g = make_gen(n)
        kc, vc, table, ks, vs = fp8_cache([n], hkv, d, 64, g, per_head=False)
        q = randn((ql, hq, d), dtype, gen=g)
        cq, lens = cu([ql]), torch.tensor([n], dtype=torch.int32)
        dev = be.device
        out = be.run(lambda: be.ns.paged_prefill_attention(
            q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cq.to(dev), lens.to(dev), ql, 0.088, True, -1, 0.0, None,
            False, None, 0, None, ks.to(dev), vs.to(dev))[0].cpu())
        ref_out, _ = R.paged_prefill_attention(q, kc, vc, table, cq, lens, 0.088, True, -1, 0.0, None, ks, vs)
        errors[n] = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    # The output's own rounding to bf16 dominates both (~2e-3); an accumulation error growing with
    # the 256 tiles of 16k keys would show as a multiple of the 16-tile figure.
    assert errors[16384] <= 1.5 * errors[1024] + 1e-4, errors


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_cache_deterministic_mode_bits(backend):
    """fixed_split_size > 0 with an fp8 cache and per-head scales: the last token's row has the same
    bits through decode (split-parallel chunks and their merge) and paged prefill (the in-kernel
    fold of a 9-token chunk)."""
    be = get_backend(backend)
    dtype, hq, hkv, d, n, ql = torch.bfloat16, 8, 2, 64, 203, 9
    g = make_gen(6)
    kc, vc, table, ks, vs = fp8_cache([n], hkv, d, 16, g, per_head=True)
    q = randn((ql, hq, d), dtype, gen=g)
    lens, dev = torch.tensor([n], dtype=torch.int32), be.device
    dec = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_decode_attention(
        q[-1:].to(dev), kc.to(dev), vc.to(dev), table.to(dev), lens.to(dev), 0.125, -1, 0.0, 0, True, ks.to(dev),
        vs.to(dev), 64)))
    pre = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_prefill_attention(
        q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cu([ql]).to(dev), lens.to(dev), ql, 0.125, True, -1, 0.0,
        None, True, None, 64, None, ks.to(dev), vs.to(dev))))
    assert_bits_equal(pre[0][-1:], dec[0], f"{backend} fp8 paged prefill vs decode out")
    assert_bits_equal(pre[1][-1:], dec[1], f"{backend} fp8 paged prefill vs decode lse")


def _paged_args(kc_dtype=torch.float8_e4m3fn, k_scale=torch.tensor([0.1]), v_scale=torch.tensor([0.1])):
    g = make_gen(2)
    q = randn((3, 4, 64), torch.bfloat16, gen=g)
    kc = randn((4, 16, 2, 64), torch.float32, gen=g).to(kc_dtype)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32)
    return [q, kc, kc.clone(), table, cu([2, 1]), lens, 2, 0.125, True, -1, 0.0, None, False, None, 0, None,
            k_scale, v_scale]


BAD = [
    ("no-scale", lambda: _paged_args(k_scale=None), "k_scale is required"),
    ("scale-len", lambda: _paged_args(v_scale=torch.ones(3)), r"v_scale must be float32 with 1 element .* num_kv_heads = 2"),
    ("scale-dtype", lambda: _paged_args(k_scale=torch.ones(1, dtype=torch.float64)), "k_scale must be float32"),
    ("scale-not-fp8", lambda: _paged_args(kc_dtype=torch.bfloat16), "k_scale must be None unless"),
    ("cache-dtype", lambda: _paged_args(kc_dtype=torch.float16, k_scale=None, v_scale=None), "k_cache must have the dtype of q"),
]


@pytest.mark.parametrize("case,make,message", BAD, ids=[b[0] for b in BAD])
def test_paged_prefill_fp8_bad_input(case, make, message):
    with pytest.raises(RuntimeError, match=message) as exc:
        torch.ops.fastinfer.paged_prefill_attention(*make())
    assert "fastinfer.paged_prefill_attention:" in str(exc.value)


def test_paged_prefill_fp8_opcheck():
    args = _paged_args(k_scale=torch.tensor([0.05, 0.2]))
    args[12] = True  # return_lse
    # test_schema (the mutation check) multiplies every input, which torch does not implement for
    # float8_e4m3fn tensors: the other checks.
    torch.library.opcheck(torch.ops.fastinfer.paged_prefill_attention.default, tuple(args),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
