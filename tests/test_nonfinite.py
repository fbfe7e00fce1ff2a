"""Non-finite inputs, one contract for every backend: the CPU implementations, the kernels (on the
emulator here, on a GPU in the ``cuda`` twins) and the fp64 / torch references give the same
answer.

The quantisers (docs/design.md "GEMM"): a NaN in a row (per token), a group (per group) or the
tensor (per tensor) makes that scale NaN, as ``amax`` does, and every code under it NaN (e4m3) or 0
(int8, which has no NaN: the NaN scale carries it; an asymmetric NaN row's zero point is 0); an
infinity makes the scale infinite, its own code NaN (inf / inf) and the finite values' codes 0.
Rows without a non-finite value are untouched: bitwise the reference's. The kernels used to drop
the NaN (fmaxf) and write -448 / -127 codes under a finite scale.

merge_attention_states: a NaN lse on either side is a NaN lse and row.

Attention (prefill, paged prefill, decode; a cache in q's dtype or fp8): a NaN query or a NaN key
the row sees makes the row's out and lse NaN, a NaN value the row sees those elements of its out;
a key the causal rule, the window or the mask hides never reaches the row. The other ops: NaN
exactly where the fp64 reference has it, the outputs a NaN cannot reach bitwise those of the same
call without it (docs/design.md "Non-finite values and empty shapes" lists the rule per op).
"""

from __future__ import annotations

import pytest
import torch

from conftest import backend_params, get_backend, make_gen, raw_bits
from fastinfer.reference import attention as ref_attention  # noqa: E402  (conftest imports fastinfer first)
from fastinfer.reference import gemm_fp8 as ref_fp8  # noqa: E402
from fastinfer.reference import gemm_int8 as ref_int8  # noqa: E402
from fastinfer.reference import elementwise as ref_el  # noqa: E402
from fastinfer.reference import gemm as ref_gemm  # noqa: E402
from fastinfer.reference import linear_attention as ref_la  # noqa: E402
from fastinfer.reference import moe as ref_moe  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _x(dtype, m=5, k=256, seed=0):
    """Rows 0 and 3 hold a non-finite value (a NaN at column 7, +inf at column 200), the others are finite."""
    x = torch.randn(m, k, generator=make_gen(seed)).to(dtype)
    x[0, 7] = NAN
    x[3, 200] = INF
    return x


def _same(got: torch.Tensor, want: torch.Tensor, what: str):
    """Equal values, NaN where NaN (any payload: e4m3 has two NaN codes)."""
    g, w = got.cpu().float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), \
        f"{what}: NaN at {g.isnan().nonzero().tolist()}, want {w.isnan().nonzero().tolist()}"
    fin = ~w.isnan()
    assert torch.equal(g[fin], w[fin]), f"{what}: values differ at {(g != w)[fin].nonzero().tolist()[:5]}"


CASES = {"cpu": ["token", "tensor", "group"], "sim": ["token", "tensor", "group"], "cuda": ["token", "tensor", "group"]}


@pytest.mark.parametrize("backend,dtype,mode", backend_params(CASES))
def test_fp8_quantize_nonfinite(backend, dtype, mode):
    be = get_backend(backend)
    x = _x(dtype)
    q, s = be.run(lambda: tuple(t.cpu() for t in be.ns.fp8_quantize(x.to(be.device), mode, 128, None)))
    want_q, want_s = ref_fp8.fp8_quantize(x, mode, 128)
    _same(s, want_s, "scale")
    _same(q.float(), want_q.float(), "codes")
    # the contract itself, not only agreement with the reference
    if mode == "token":
        assert s[0].isnan() and s[3].isinf() and s[[1, 2, 4]].isfinite().all()
        assert q[0].float().isnan().all() and q[3, 200].float().isnan()
        assert (q[3, :200].float() == 0).all() and (q[3, 201:].float() == 0).all()
    elif mode == "tensor":
        assert s.isnan().all() and q.float().isnan().all()
    else:  # groups of 128: row 0's first group, row 3's second
        assert s[0, 0].isnan() and s[0, 1].isfinite() and s[3, 1].isinf() and s[3, 0].isfinite()
        assert q[0, :128].float().isnan().all() and not q[0, 128:].float().isnan().any()


@pytest.mark.parametrize("backend,dtype,mode", backend_params(CASES))
def test_fp8_quantize_given_scale_keeps_nan(backend, dtype, mode):
    """Per tensor with a given scale: a NaN value's code is NaN, the others are the reference's."""
    if mode != "tensor":
        pytest.skip("a given scale is per tensor")
    be = get_backend(backend)
    x = _x(dtype)
    scale = torch.tensor([0.01])
    q, s = be.run(lambda: tuple(t.cpu() for t in be.ns.fp8_quantize(x.to(be.device), "tensor", 128,
                                                                      scale.to(be.device))))
    want_q, _ = ref_fp8.fp8_quantize(x, "tensor", 128, scale)
    _same(q.float(), want_q.float(), "codes")
    assert q[0, 7].float().isnan() and float(q[3, 200].float()) == 448.0  # inf clamps to the largest value


INT8 = {"cpu": [("token", True), ("token", False), ("tensor", True)],
        "sim": [("token", True), ("token", False), ("tensor", True)],
        "cuda": [("token", True), ("token", False), ("tensor", True)]}


@pytest.mark.parametrize("backend,dtype,mode,symmetric", backend_params(INT8))
def test_int8_quantize_nonfinite(backend, dtype, mode, symmetric):
    be = get_backend(backend)
    x = _x(dtype)
    out = be.run(lambda: tuple(t.cpu() for t in be.ns.int8_quantize(x.to(be.device), mode, None, symmetric)))
    want = ref_int8.int8_quantize(x, mode, None, symmetric)
    q, s = out[0], out[1]
    _same(s, want[1], "scale")
    assert torch.equal(raw_bits(q), raw_bits(want[0])), f"codes differ at {(q != want[0]).nonzero().tolist()[:5]}"
    if not symmetric:
        assert torch.equal(out[2], want[2]) and int(out[2][0]) == 0  # the NaN row's zero point
    if mode == "token":  # the inf row: finite values / inf = 0, at the zero point; inf / inf is NaN: 0
        zero = 0 if symmetric else int(out[2][3])
        assert s[0].isnan() and s[3].isinf() and (q[0] == 0).all() and int(q[3, 200]) == 0
        assert (q[3, :200] == zero).all() and (q[3, 201:] == zero).all()
        assert s[[1, 2, 4]].isfinite().all() and (q[1] != 0).any()
    else:
        assert s.isnan().all() and (q == 0).all()


MERGE = {"cpu": [None], "sim": [None], "cuda": [None]}


@pytest.mark.parametrize("backend,dtype,_", backend_params(MERGE))
def test_merge_attention_states_nan_lse(backend, dtype, _):
    """A NaN lse on either side gives a NaN lse and a NaN merged row (the kernel dropped it and kept
    the other side); -inf on both sides still gives zeros and -inf, one side -inf the other side's
    row; finite rows agree with the fp64 reference."""
    be = get_backend(backend)
    g = make_gen(11)
    t, h, d = 4, 3, 64
    va, vb = torch.randn(t, h, d, generator=g).to(dtype), torch.randn(t, h, d, generator=g).to(dtype)
    la, lb = torch.randn(t, h, generator=g) * 3, torch.randn(t, h, generator=g) * 3
    la[0, 0] = NAN  # NaN on a
    lb[1, 2] = NAN  # NaN on b
    la[2, 1] = lb[2, 1] = float("-inf")  # neither side saw a key
    la[3, 0] = float("-inf")  # only b did
    dev = be.device
    v, lse = be.run(lambda: tuple(x.cpu() for x in be.ns.merge_attention_states(va.to(dev), la.to(dev), vb.to(dev),
                                                                                 lb.to(dev))))
    ref_v, ref_lse = ref_attention.merge_attention_states(va, la, vb, lb)
    assert torch.equal(lse.isnan(), ref_lse.isnan()) and lse[0, 0].isnan() and lse[1, 2].isnan()
    assert v[0, 0].float().isnan().all() and v[1, 2].float().isnan().all()
    assert not v.float().isnan()[~ref_lse.isnan()].any()
    assert lse[2, 1] == float("-inf") and (v[2, 1].float() == 0).all()
    assert torch.equal(v[3, 0], vb[3, 0]) and float(lse[3, 0]) == float(lb[3, 0])
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin]).abs().max() < 1e-5
    assert (v.double() - ref_v)[fin].abs().max() < 2e-2


# ---- empty dimensions: the same shapes, dtypes and values from the CPU and the kernels -----------
_BF = torch.bfloat16
EMPTY = [
    ("rms_norm", lambda ns: ns.rms_norm(torch.randn(0, 64, dtype=_BF), torch.ones(64, dtype=_BF), 1e-6)),
    ("silu_and_mul", lambda ns: ns.silu_and_mul(torch.randn(0, 128, dtype=_BF))),
    ("fp8_quantize-token", lambda ns: ns.fp8_quantize(torch.randn(0, 64, dtype=_BF), "token", 128, None)),
    ("fp8_quantize-tensor", lambda ns: ns.fp8_quantize(torch.randn(0, 64, dtype=_BF), "tensor", 128, None)),
    ("int8_quantize-token", lambda ns: ns.int8_quantize(torch.randn(0, 64, dtype=_BF), "token", None, False)),
    ("int8_quantize-tensor", lambda ns: ns.int8_quantize(torch.randn(0, 64, dtype=_BF), "tensor", None, True)),
    ("dense_mm-M0", lambda ns: ns.dense_mm(torch.randn(0, 64, dtype=_BF), torch.randn(32, 64, dtype=_BF), None)),
    ("dense_mm-N0", lambda ns: ns.dense_mm(torch.randn(4, 64, dtype=_BF), torch.randn(0, 64, dtype=_BF), None)),
    ("int4_gemm-M0", lambda ns: ns.int4_gemm(torch.randn(0, 64, dtype=_BF),
                                             ns.int4_pack(torch.full((16, 64), 3, dtype=torch.uint8)),
                                             torch.ones(2, 16, dtype=_BF), None, 32, None, False)),
    ("fp8_scaled_mm-M0", lambda ns: ns.fp8_scaled_mm(torch.zeros(0, 64, dtype=torch.float8_e4m3fn),
                                                     torch.zeros(32, 64, dtype=torch.float8_e4m3fn), torch.ones(1),
                                                     torch.ones(1), _BF, None, False)),
    ("merge_attention_states-T0", lambda ns: ns.merge_attention_states(
        torch.randn(0, 4, 64, dtype=_BF), torch.randn(0, 4), torch.randn(0, 4, 64, dtype=_BF), torch.randn(0, 4))),
    ("moe_topk-T0", lambda ns: ns.moe_topk(torch.randn(0, 8), 2, True, "softmax")),
    ("paged_decode_attention-B0", lambda ns: ns.paged_decode_attention(
        torch.randn(0, 8, 64, dtype=_BF), torch.randn(4, 16, 2, 64, dtype=_BF), torch.randn(4, 16, 2, 64, dtype=_BF),
        torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0.125, -1, 0.0, 0, True)),
    ("prefill_attention-T0", lambda ns: ns.prefill_attention(
        torch.randn(0, 8, 64, dtype=_BF), torch.randn(0, 2, 64, dtype=_BF), torch.randn(0, 2, 64, dtype=_BF),
        torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 0, 0, 0.125, True, -1, 0.0, True)),
]


@pytest.mark.sim
@pytest.mark.parametrize("name,call", EMPTY, ids=[e[0] for e in EMPTY])
def test_empty_dimensions_agree(name, call):
    """An empty batch / row / output dimension: the CPU implementation and the emulated kernels
    return the same shapes, dtypes and values (the per-tensor scale of nothing included)."""
    cpu = call(torch.ops.fastinfer)
    get_backend("sim")
    sim = call(torch.ops.fastinfer_sim)
    cpu, sim = (cpu if isinstance(cpu, tuple) else (cpu,)), (sim if isinstance(sim, tuple) else (sim,))
    assert len(cpu) == len(sim)
    for a, b in zip(cpu, sim):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw_bits(a), raw_bits(b.cpu())), name


# ---- attention: NaN in, NaN out for exactly the rows that see it ---------------------------------
# A NaN query or a NaN key a row sees: that row's out and lse are NaN. A NaN value a row sees: those
# elements of its out (its lse depends on the scores only). A key the causal rule, the window or
# the mask hides never reaches the row, NaN or not. Checked against the fp64 reference, which
# follows the same rule, and spelled out per row so that the reference cannot be wrong alone.
_D, _HQ, _HKV = 64, 4, 2  # heads 0, 1 use KV head 0; heads 2, 3 KV head 1


def _check_attention(out, lse, ref_out, ref_lse, what, tol):
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(out.isnan(), ref_out.isnan()), \
        f"{what}: out NaN at {out.isnan().nonzero().tolist()[:8]}, want {ref_out.isnan().nonzero().tolist()[:8]}"
    assert torch.equal(lse.isnan(), ref_lse.isnan()), \
        f"{what}: lse NaN at {lse.isnan().nonzero().tolist()}, want {ref_lse.isnan().nonzero().tolist()}"
    fin = ~ref_out.isnan()
    assert (out[fin] - ref_out[fin]).abs().max() < tol, what
    lfin = torch.isfinite(ref_lse)
    assert torch.equal(lse[~lfin & ~ref_lse.isnan()], ref_lse[~lfin & ~ref_lse.isnan()])
    assert (lse[lfin] - ref_lse[lfin]).abs().max() < 1e-2, what


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 3e-2


def _poison_slot(cache, table, b, j, head, dim):
    """The element (head, dim) of sequence b's key j in a paged cache: NaN (code 0x7f for e4m3)."""
    bs, hkv, d = cache.shape[1], cache.shape[2], cache.shape[3]
    slot = int(table[b, j // bs]) * bs + j % bs
    if cache.dtype == torch.float8_e4m3fn:
        cache.view(torch.uint8).view(-1, hkv, d)[slot, head, dim] = 0x7F
    else:
        cache.view(-1, hkv, d)[slot, head, dim] = NAN


PREFILL_NAN = {"cpu": [(0, False), (64, True)], "sim": [(0, False), (64, True)], "cuda": [(0, False), (64, True)]}


@pytest.mark.parametrize("backend,dtype,fixed_split,with_sinks", backend_params(PREFILL_NAN))
def test_prefill_attention_nan(backend, dtype, fixed_split, with_sinks):
    """Two causal sequences (q_len 5 over 9 keys, 3 over 3): a NaN query (token 1, head 0), a NaN
    key (sequence 0's key 6 on KV head 1: seen by its queries 2..4 only, hidden from 0 and 1 in
    the same key tile) and a NaN value (sequence 1's key 0 on KV head 0, dim 5: seen by all of
    its queries). The CPU takes ATen's flash kernel for sequence 0 without the NaN."""
    be = get_backend(backend)
    from test_attention import cu
    g = make_gen(21)
    cq, ck = cu([5, 3]), cu([9, 3])
    q = torch.randn(8, _HQ, _D, generator=g).to(dtype)
    k = torch.randn(12, _HKV, _D, generator=g).to(dtype)
    v = torch.randn(12, _HKV, _D, generator=g).to(dtype)
    q[1, 0, 10] = NAN
    k[6, 1, 3] = NAN
    v[9, 0, 5] = NAN
    sinks = torch.randn(_HQ, generator=g) if with_sinks else None
    dev = be.device
    out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.prefill_attention(
        q.to(dev), k.to(dev), v.to(dev), cq.to(dev), ck.to(dev), 5, 9, 0.125, True, -1, 0.0, True, fixed_split,
        None if sinks is None else sinks.to(dev))))
    ref_out, ref_lse = ref_attention.prefill_attention(q, k, v, cq, ck, 0.125, True, -1, 0.0, fixed_split, sinks)
    # the contract row by row
    assert out[1, 0].float().isnan().all() and lse[1, 0].isnan() and not lse[1, 1].isnan()
    assert out[2:5, 2:].float().isnan().all() and lse[2:5, 2:].isnan().all()
    assert not out[0:2, 2:].float().isnan().any() and lse[0:2, 2:].isfinite().all()  # key 6 hidden
    assert out[5:8, 0:2, 5].float().isnan().all() and lse[5:8].isfinite().all()
    assert not out[5:8, :, :5].float().isnan().any() and not out[5:8, 2:].float().isnan().any()
    _check_attention(out, lse, ref_out, ref_lse, "prefill", _tol(dtype))


INF_SCORE = {"cpu": [None], "sim": [None], "cuda": [None]}


@pytest.mark.parametrize("backend,dtype,_", backend_params(INF_SCORE))
def test_prefill_attention_infinite_score(backend, dtype, _):
    """An infinite query element (token 1, head 0) and key element (key 0, seen by every row) make
    scores of +-inf: a row with a +inf score gets NaN out (exp(inf - inf)) and NaN lse, where
    torch.logsumexp and the reference give +inf; a row whose infinite scores are all -inf just
    does not weigh those keys. out agrees with the reference everywhere."""
    be = get_backend(backend)
    from test_attention import cu
    g = make_gen(25)
    q = torch.randn(3, 2, _D, generator=g).to(dtype)
    k, v = torch.randn(5, 1, _D, generator=g).to(dtype), torch.randn(5, 1, _D, generator=g).to(dtype)
    q[1, 0, 3] = INF
    k[0, 0, 9] = -INF
    cq, ck = cu([3]), cu([5])
    dev = be.device
    out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.prefill_attention(
        q.to(dev), k.to(dev), v.to(dev), cq.to(dev), ck.to(dev), 3, 5, 0.125, True, -1, 0.0, True, 0, None)))
    ref_out, ref_lse = ref_attention.prefill_attention(q, k, v, cq, ck, 0.125, True)
    assert torch.equal(out.isnan(), ref_out.isnan()) and out.isnan().any() and not out.isnan().all()
    assert torch.equal(lse.isnan(), ref_lse.isnan() | (ref_lse == INF))
    fin = torch.isfinite(ref_lse)
    assert fin.any() and (lse[fin].double() - ref_lse[fin]).abs().max() < 1e-2
    assert (out.double() - ref_out)[~ref_out.isnan()].abs().max() < _tol(dtype)


PAGED_NAN = {b: [("model", 0), ("model", 64), ("fp8", 0)] for b in ("cpu", "sim", "cuda")}


def _nan_paged_cache(kind, dtype, seq_lens, g):
    from test_attention import make_paged
    from test_attention_fp8_cache import fp8_cache
    if kind == "fp8":
        return fp8_cache(seq_lens, _HKV, _D, 8, g, per_head=True)
    kc, vc, table = make_paged(seq_lens, _HKV, _D, 8, dtype, g)
    return kc, vc, table, None, None


@pytest.mark.parametrize("backend,dtype,cache,fixed_split", backend_params(PAGED_NAN))
def test_paged_prefill_attention_nan(backend, dtype, cache, fixed_split):
    """Paged prefill, causal: sequence 0 (18 queries over 20 keys: the CPU's flash path without
    the NaN) gets a NaN query (token 4, head 3) and a NaN key 18 on KV head 1 (seen by its last
    two queries only); sequence 1 (3 queries over 11 keys) a NaN value (key 2, KV head 0, dim 7:
    seen by all three). An fp8 cache holds the e4m3 NaN code 0x7f, read as NaN (not +-480)."""
    be = get_backend(backend)
    from test_attention import cu
    g = make_gen(22)
    q_lens, seq_lens = [18, 3], [20, 11]
    kc, vc, table, ks, vs = _nan_paged_cache(cache, dtype, seq_lens, g)
    cq, lens = cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(21, _HQ, _D, generator=g).to(dtype)
    q[4, 3, 0] = NAN
    _poison_slot(kc, table, 0, 18, 1, 9)
    _poison_slot(vc, table, 1, 2, 0, 7)
    dev = be.device
    opt = lambda t: None if t is None else t.to(dev)  # noqa: E731
    out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_prefill_attention(
        q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), cq.to(dev), lens.to(dev), 18, 0.125, True, -1, 0.0,
        None, True, None, fixed_split, None, opt(ks), opt(vs))))
    ref_out, ref_lse = ref_attention.paged_prefill_attention(q, kc, vc, table, cq, lens, 0.125, True, -1, 0.0, None,
                                                             ks, vs, fixed_split_size=fixed_split)
    assert out[4, 3].float().isnan().all() and lse[4, 3].isnan()
    assert out[16:18, 2:].float().isnan().all() and lse[16:18, 2:].isnan().all()
    assert not out[:16, 2].float().isnan().any() and lse[:16, 2].isfinite().all()  # key 18 hidden
    assert out[18:21, 0:2, 7].float().isnan().all() and lse[18:21].isfinite().all()
    _check_attention(out, lse, ref_out, ref_lse, "paged prefill", _tol(dtype))


# (cache, window_left, num_splits, fixed_split_size)
DECODE_NAN = {b: [("model", -1, 1, 0), ("model", 8, 3, 0), ("fp8", -1, 3, 0), ("model", -1, 0, 64)]
              for b in ("cpu", "sim", "cuda")}


@pytest.mark.parametrize("backend,dtype,cache,window,splits,fixed_split", backend_params(DECODE_NAN))
def test_paged_decode_attention_nan(backend, dtype, cache, window, splits, fixed_split):
    """Decode over 7, 40 and 1 keys: a NaN query (sequence 0, head 1), a NaN key and a NaN value in
    sequence 1 (key 5 on KV head 0, key 6 on KV head 1, dim 3: outside a window of 8, so hidden
    there) and a NaN value (sequence 2's only key, KV head 1, dim 7). num_splits 3 puts the NaN in
    one split of several (the merge kernel)."""
    be = get_backend(backend)
    g = make_gen(23)
    seq_lens = [7, 40, 1]
    kc, vc, table, ks, vs = _nan_paged_cache(cache, dtype, seq_lens, g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(3, _HQ, _D, generator=g).to(dtype)
    q[0, 1, 2] = NAN
    _poison_slot(kc, table, 1, 5, 0, 11)
    _poison_slot(vc, table, 1, 6, 1, 3)
    _poison_slot(vc, table, 2, 0, 1, 7)
    dev = be.device
    opt = lambda t: None if t is None else t.to(dev)  # noqa: E731
    out, lse = be.run(lambda: tuple(t.cpu() for t in be.ns.paged_decode_attention(
        q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), lens.to(dev), 0.125, window, 0.0, splits, True,
        opt(ks), opt(vs), fixed_split, None)))
    ref_out, ref_lse = ref_attention.paged_decode_attention(q, kc, vc, table, lens, 0.125, window, 0.0, ks, vs,
                                                            fixed_split)
    assert out[0, 1].float().isnan().all() and lse[0, 1].isnan() and not out[0, 0].float().isnan().any()
    assert out[1, 0:2].float().isnan().all() == (window < 0) and lse[1, 0:2].isnan().all() == (window < 0)
    assert out[1, 2:, 3].float().isnan().all() == (window < 0) and lse[1, 2:].isfinite().all()
    assert not out[1, 2:, :3].float().isnan().any() and (window < 0 or not out[1].float().isnan().any())
    assert out[2, 2:, 7].float().isnan().all() and lse[2].isfinite().all() and not out[2, :2].float().isnan().any()
    _check_attention(out, lse, ref_out, ref_lse, "decode", _tol(dtype))


@pytest.mark.parametrize("backend,dtype,fixed_split", backend_params({"cpu": [0, 64]}))
def test_attention_hidden_nan_value_cpu(backend, dtype, fixed_split):
    """A NaN value row that a tree mask hides from some rows reaches only the rows that see it
    (CPU and reference; the prefill kernel multiplies a hidden key's zero weight by its value row
    in the tensor-core P.V product, docs/design.md)."""
    be = get_backend(backend)
    from test_attention import cu, make_paged
    g = make_gen(24)
    kc, vc, table = make_paged([12], _HKV, _D, 8, dtype, g)
    parents = [-1, 0, 0, 1]  # node 3 sees 0, 1, 3; node 2 sees 0, 2
    mask = ref_attention.tree_mask(parents).reshape(-1)
    q = torch.randn(4, _HQ, _D, generator=g).to(dtype)
    _poison_slot(vc, table, 0, 8 + 1, 0, 4)  # node 1's value: seen by nodes 1 and 3
    _poison_slot(kc, table, 0, 8 + 2, 1, 4)  # node 2's key: seen by node 2 only
    cq, lens = cu([4]), torch.tensor([12], dtype=torch.int32)
    out, lse = be.ns.paged_prefill_attention(q, kc, vc, table, cq, lens, 4, 0.125, False, -1, 0.0, mask, True, None,
                                             fixed_split, None, None, None)
    ref_out, ref_lse = ref_attention.paged_prefill_attention(q, kc, vc, table, cq, lens, 0.125, False, -1, 0.0, mask,
                                                             fixed_split_size=fixed_split)
    nan_rows = out.isnan().any(2)
    assert nan_rows.tolist() == [[False] * 4, [True, True, False, False], [False, False, True, True],
                                 [True, True, False, False]]
    assert out[[1, 3], 0:2, 4].isnan().all() and lse[2, 2:].isnan().all() and lse[[0, 1, 3]].isfinite().all()
    _check_attention(out, lse, ref_out, ref_lse, "tree", _tol(dtype))


# ---- the other ops: NaN where the fp64 reference has NaN, everything it cannot reach unchanged ----
def _agree(got, want, clean, reach, what, tol):
    """got: the op on inputs holding a NaN / infinity; want: the fp64 reference on them; clean: the
    op on the same inputs without them; reach: bool, the outputs the non-finite inputs can reach.
    NaN exactly where the reference has NaN (an infinity where it has one), bitwise the clean run
    outside `reach`, the reference's values inside it where finite."""
    g, w = got.cpu().double(), want.double()
    assert w.isnan().any() and (~reach).any(), f"{what}: the case must have NaN and untouched outputs"
    assert torch.equal(g.isnan(), w.isnan()), \
        f"{what}: NaN at {g.isnan().nonzero().tolist()[:8]}, want {w.isnan().nonzero().tolist()[:8]}"
    assert torch.equal(g.isinf(), w.isinf()) and torch.equal(g[w.isinf()], w[w.isinf()]), f"{what}: infinities"
    assert torch.equal(raw_bits(got.cpu())[~reach], raw_bits(clean.cpu())[~reach]), f"{what}: untouched outputs"
    fin = reach & torch.isfinite(w)
    if fin.any():
        assert ((g[fin] - w[fin]).abs() <= tol * (1 + w[fin].abs())).all(), f"{what}: reached finite outputs"


def _rows(shape, rows):
    r = torch.zeros(shape, dtype=torch.bool)
    r[rows] = True
    return r


def _tol2(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


ELEM = {"cpu": [None], "sim": [None], "cuda": [None]}


@pytest.mark.parametrize("backend,dtype,_", backend_params(ELEM))
def test_norms_nonfinite(backend, dtype, _):
    """rms_norm: a NaN makes its row NaN; an infinity makes its row's rms infinite: the finite
    values 0 and the infinity itself inf / inf = NaN. fused_add_rms_norm: the same on the rounded
    sum, whose NaN / inf the residual output keeps. gated_rms_norm: a NaN gate is NaN at its own
    element only, a NaN x its whole row."""
    be = get_backend(backend)
    dev = be.device
    x = _x(dtype, 5, 256, seed=3)
    clean = torch.randn(5, 256, generator=make_gen(3)).to(dtype)
    w = (torch.rand(256, generator=make_gen(4)) + 0.5).to(dtype)
    reach = _rows((5, 256), [0, 3])
    norm = lambda t: be.run(lambda: be.ns.rms_norm(t.to(dev), w.to(dev), 1e-6).cpu())  # noqa: E731
    got = norm(x)
    _agree(got, ref_el.rms_norm(x, w, 1e-6), norm(clean), reach, "rms_norm", _tol2(dtype))
    assert got[0].float().isnan().all() and got[3, 200].float().isnan() and (got[3, :200].float() == 0).all()

    res = torch.randn(5, 256, generator=make_gen(5)).to(dtype)

    def fused(xx):
        def call():
            xd, rd = xx.clone().to(dev), res.clone().to(dev)
            be.ns.fused_add_rms_norm(xd, rd, w.to(dev), 1e-6)
            return xd.cpu(), rd.cpu()
        return be.run(call)
    (gx, gr), (cx, cr) = fused(x), fused(clean)
    want_x, want_r = ref_el.fused_add_rms_norm(x, res, w, 1e-6)
    _agree(gx, want_x, cx, reach, "fused_add_rms_norm x", _tol2(dtype))
    _agree(gr, want_r, cr, reach, "fused_add_rms_norm residual", 0)

    gate = torch.randn(5, 256, generator=make_gen(6)).to(dtype)
    gate[2, 9] = NAN
    xg = clean.clone()
    xg[4, 100] = NAN
    gated = lambda a, b: be.run(lambda: be.ns.gated_rms_norm(a.to(dev), b.to(dev), w.to(dev), 1e-6).cpu())  # noqa: E731
    gate_clean = torch.randn(5, 256, generator=make_gen(6)).to(dtype)
    got = gated(xg, gate)
    _agree(got, ref_el.gated_rms_norm(xg, gate, w, 1e-6), gated(clean, gate_clean), _rows((5, 256), [2, 4]),
           "gated_rms_norm", _tol2(dtype))
    assert got[2, 9].float().isnan() and got[2].float().isnan().sum() == 1 and got[4].float().isnan().all()


@pytest.mark.parametrize("backend,dtype,op", backend_params(
    {b: ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"] for b in ("cpu", "sim", "cuda")}))
def test_gated_activations_nan(backend, dtype, op):
    """out[:, j] = act(gate[:, j]) * up[:, j]: a NaN in either half is NaN at its own column."""
    be = get_backend(backend)
    clean = torch.randn(5, 256, generator=make_gen(7)).to(dtype)
    x = clean.clone()
    x[0, 3] = NAN    # gate column 3
    x[2, 137] = NAN  # up column 9
    f = lambda t: be.run(lambda: getattr(be.ns, op)(t.to(be.device)).cpu())  # noqa: E731
    got = f(x)
    _agree(got, getattr(ref_el, op)(x), f(clean), _rows((5, 128), [0, 2]), op, _tol2(dtype))
    assert got.float().isnan().nonzero().tolist() == [[0, 3], [2, 9]]


@pytest.mark.parametrize("backend,dtype,is_neox", backend_params({b: [True, False] for b in ("cpu", "sim", "cuda")}))
def test_rotary_embedding_nan(backend, dtype, is_neox):
    """A NaN element of q or k reaches the two outputs of its rotation pair and nothing else; a
    pass-through dim (partial rotary: 32 of 64) stays where it is."""
    be = get_backend(backend)
    g = make_gen(8)
    pos = torch.tensor([3, 0, 7, 1, 5])
    cache = torch.randn(8, 32, generator=g).to(dtype)
    q0, k0 = torch.randn(5, 4, 64, generator=g).to(dtype), torch.randn(5, 2, 64, generator=g).to(dtype)
    q, k = q0.clone(), k0.clone()
    q[1, 2, 3] = NAN   # rotated: pairs with dim 19 (neox) or 2 (interleaved)
    k[4, 1, 40] = NAN  # passes through

    def run(qq, kk):
        def call():
            qd, kd = qq.clone().to(be.device), kk.clone().to(be.device)
            be.ns.rotary_embedding(pos.to(be.device), qd, kd, cache.to(be.device), is_neox)
            return qd.cpu(), kd.cpu()
        return be.run(call)
    (gq, gk), (cq, ck) = run(q, k), run(q0, k0)
    wq, wk = ref_el.rotary_embedding(pos, q, k, cache, is_neox)
    _agree(gq, wq, cq, _rows((5, 4, 64), [1]), "rope q", _tol2(dtype))
    _agree(gk, wk, ck, _rows((5, 2, 64), [4]), "rope k", _tol2(dtype))
    assert gq.isnan().nonzero().tolist() == sorted([[1, 2, 3], [1, 2, 19 if is_neox else 2]])
    assert gk.isnan().nonzero().tolist() == [[4, 1, 40]]


GEMM = {"cpu": [None], "sim": [None], "cuda": [None]}


@pytest.mark.parametrize("backend,dtype,_", backend_params(GEMM))
def test_dense_and_int4_gemm_nan(backend, dtype, _):
    """dense_mm: a NaN in a's row i is NaN across out's row i, one in b's row j (output column j)
    NaN down column j. int4_gemm: a NaN activation NaN across its row, a NaN group scale NaN down
    its output column."""
    be = get_backend(backend)
    dev = be.device
    g = make_gen(9)
    a0, b0 = torch.randn(5, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)
    a, b = a0.clone(), b0.clone()
    a[1, 3] = NAN
    b[7, 10] = NAN
    reach = _rows((5, 32), [1])
    reach[:, 7] = True
    mm = lambda x, y: be.run(lambda: be.ns.dense_mm(x.to(dev), y.to(dev), None).cpu())  # noqa: E731
    _agree(mm(a, b), ref_gemm.dense_mm(a, b), mm(a0, b0), reach, "dense_mm", 2e-2)

    w_q = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    s0 = (torch.rand(2, 32, generator=g) * 0.1 + 0.01).to(dtype)
    s = s0.clone()
    s[1, 6] = NAN  # the second K group of output column 6
    reach = _rows((5, 32), [1])
    reach[:, 6] = True
    i4 = lambda x, sc: be.run(lambda: be.ns.int4_gemm(x.to(dev), be.ns.int4_pack(w_q.to(dev)), sc.to(dev), None,  # noqa: E731
                                                       32, None, False).cpu())
    _agree(i4(a, s), ref_gemm.int4_gemm(a, w_q, s, None, 32), i4(a0, s0), reach, "int4_gemm", 2e-2)


@pytest.mark.parametrize("backend,dtype,_", backend_params(GEMM))
def test_scaled_mm_nan(backend, dtype, _):
    """fp8_scaled_mm: the e4m3 NaN code in a's row i and a NaN per-channel scale of column j;
    int8_scaled_mm (no NaN code): a NaN per-token scale of row i and per-channel scale of column j."""
    be = get_backend(backend)
    dev = be.device
    g = make_gen(10)
    e4m3 = torch.float8_e4m3fn
    a8 = (torch.randn(5, 64, generator=g) * 8).to(e4m3)
    b8 = (torch.randn(32, 64, generator=g) * 8).to(e4m3)
    sa0, sb0 = torch.rand(5, generator=g) * 0.01 + 0.001, torch.rand(32, generator=g) * 0.01 + 0.001
    a8n = a8.clone()
    a8n.view(torch.uint8)[2, 30] = 0x7F
    sb = sb0.clone()
    sb[11] = NAN
    reach = _rows((5, 32), [2])
    reach[:, 11] = True
    f8 = lambda x, sbb: be.run(lambda: be.ns.fp8_scaled_mm(x.to(dev), b8.to(dev), sa0.to(dev), sbb.to(dev),  # noqa: E731
                                                            dtype, None, False).cpu())
    _agree(f8(a8n, sb), ref_fp8.fp8_scaled_mm(a8n, b8, sa0, sb, dtype), f8(a8, sb0), reach, "fp8_scaled_mm", 2e-2)

    a_i = torch.randint(-127, 128, (5, 64), generator=g, dtype=torch.int8)
    b_i = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
    sa = sa0.clone()
    sa[2] = NAN
    i8 = lambda x, y: be.run(lambda: be.ns.int8_scaled_mm(a_i.to(dev), b_i.to(dev), x.to(dev), y.to(dev), dtype,  # noqa: E731
                                                           None, None, None, False).cpu())
    _agree(i8(sa, sb), ref_int8.int8_scaled_mm(a_i, b_i, sa, sb, dtype), i8(sa0, sb0), reach, "int8_scaled_mm", 2e-2)


MOE = {"cpu": [None], "sim": [None], "cuda": [None]}


@pytest.mark.parametrize("backend,dtype,_", backend_params(MOE))
def test_fused_moe_nan_token(backend, dtype, _):
    """A NaN in token 2's activation: its output row NaN, the rows of the tokens that share its
    experts unchanged."""
    be = get_backend(backend)
    dev = be.device
    g = make_gen(12)
    t, e, h, i = 5, 4, 64, 32
    x0 = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    wts = torch.rand(t, 2, generator=g) + 0.1
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [3, 1], [2, 0]], dtype=torch.int32)
    x = x0.clone()
    x[2, 3] = NAN
    moe = lambda xx: be.run(lambda: be.ns.fused_moe(xx.to(dev), w13.to(dev), w2.to(dev), wts.to(dev), ids.to(dev),  # noqa: E731
                                                    "silu", None, None, None, None).cpu())
    got = moe(x)
    _agree(got, ref_moe.fused_moe(x, w13, w2, wts, ids), moe(x0), _rows((t, h), [2]), "fused_moe", 3e-2)
    assert got[2].float().isnan().all()


@pytest.mark.parametrize("backend,dtype,scoring", backend_params(
    {b: ["softmax", "topk_softmax"] for b in ("cpu", "sim", "cuda")}, {"cpu": (torch.float32,),
                                                                       "sim": (torch.float32,),
                                                                       "cuda": (torch.float32,)}))
def test_moe_topk_nan_logit(backend, dtype, scoring):
    """A NaN router logit ranks above every number (torch.topk's order): the ids are the
    reference's, the NaN is selected first and its row's weights are NaN under both scorings."""
    be = get_backend(backend)
    logits = torch.randn(4, 8, generator=make_gen(13))
    logits[1, 3] = NAN
    logits[2] = torch.tensor([NAN, 1.0, NAN, NAN, NAN, float("-inf"), NAN, NAN])
    wts, ids = be.run(lambda: tuple(t.cpu() for t in be.ns.moe_topk(logits.to(be.device), 3, False, scoring)))
    want_w, want_ids = ref_moe.moe_topk(logits, 3, False, scoring)
    assert torch.equal(ids.long(), want_ids)
    assert torch.equal(wts.isnan(), want_w.isnan())
    fin = ~want_w.isnan()
    assert ((wts.double() - want_w)[fin]).abs().max() < 1e-6
    assert ids[1, 0] == 3 and ids[2, :2].tolist() == [0, 2] and wts[1:3].isnan().all()
    assert not wts[[0, 3]].isnan().any()


CONV = {"cpu": [None], "sim": [None], "cuda": [None]}
_F32_BF16 = {"cpu": (torch.float32, torch.bfloat16), "sim": (torch.float32, torch.bfloat16),
             "cuda": (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("backend,dtype,_", backend_params(CONV, _F32_BF16))
def test_causal_conv1d_nan(backend, dtype, _):
    """A NaN at token 1, channel 5 of sequence 0 (4 tokens, width 4): that channel of tokens 1..3
    is NaN, and of the sequence's saved state (its last 3 inputs, token 1 first) the first row; the
    other channels and sequence 1 are untouched."""
    be = get_backend(backend)
    dev = be.device
    g = make_gen(14)
    d, w = 64, 4
    x0 = torch.randn(7, d, generator=g).to(dtype)
    weight = (torch.randn(d, w, generator=g) * 0.5).to(dtype)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    states = torch.randn(3, w - 1, d, generator=g).to(dtype)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    x = x0.clone()
    x[1, 5] = NAN

    def run(xx):
        def call():
            s = states.clone().to(dev)
            out = be.ns.causal_conv1d(xx.to(dev), weight.to(dev), None, cu.to(dev), s, slots.to(dev), None, "silu")
            return out.cpu(), s.cpu()
        return be.run(call)
    (got, got_s), (clean, clean_s) = run(x), run(x0)
    want, want_s = ref_la.causal_conv1d(x, weight, None, cu, states, slots, None, "silu")
    reach = torch.zeros(7, d, dtype=torch.bool)
    reach[1:4, 5] = True
    _agree(got, want, clean, reach, "causal_conv1d", _tol2(dtype))
    s_reach = torch.zeros(3, w - 1, d, dtype=torch.bool)
    s_reach[0, 0, 5] = True  # the state holds the last 3 inputs: token 1 is the first
    _agree(got_s, want_s, clean_s, s_reach, "causal_conv1d states", 0)
    assert got[1:4, 5].float().isnan().all() and got_s.float().isnan().nonzero().tolist() == [[0, 0, 5]]


@pytest.mark.parametrize("backend,dtype,_", backend_params(CONV, _F32_BF16))
def test_gated_delta_rule_nan(backend, dtype, _):
    """A NaN in sequence 0's key at token 1 enters the state: the sequence's outputs from token 1
    on and its final state are NaN (every value head of that key head); a NaN query (sequence 1,
    token 3) is NaN in that token's outputs only; the other rows and slots are untouched."""
    be = get_backend(backend)
    dev = be.device
    g = make_gen(15)
    hk, hv, dk, dv = 1, 2, 64, 64
    q0 = torch.nn.functional.normalize(torch.randn(5, hk, dk, generator=g), dim=-1).to(dtype)
    k0 = torch.nn.functional.normalize(torch.randn(5, hk, dk, generator=g), dim=-1).to(dtype)
    v = torch.randn(5, hv, dv, generator=g).to(dtype)
    gg = (-torch.rand(5, hv, generator=g) * 0.5).float()
    beta = torch.rand(5, hv, generator=g).float()
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    states = (torch.randn(3, hv, dk, dv, generator=g) * 0.1).float()
    slots = torch.tensor([1, 0], dtype=torch.int32)
    q, k = q0.clone(), k0.clone()
    k[1, 0, 4] = NAN
    q[3, 0, 7] = NAN

    def run(qq, kk):
        def call():
            s = states.clone().to(dev)
            o = be.ns.gated_delta_rule(qq.to(dev), kk.to(dev), v.to(dev), gg.to(dev), beta.to(dev), cu.to(dev), s,
                                       slots.to(dev), None, None, False, None, False)
            return o.cpu(), s.cpu()
        return be.run(call)
    (got, got_s), (clean, clean_s) = run(q, k), run(q0, k0)
    want, want_s, _h = ref_la.gated_delta_rule(q, k, v, gg, beta, cu, states, slots)
    _agree(got, want, clean, _rows((5, hv, dv), [1, 2, 3]), "gated_delta_rule", 5e-2)
    _agree(got_s, want_s, clean_s, _rows((3, hv, dk, dv), [1]), "gated_delta_rule states", 5e-2)
    assert got[1:3].float().isnan().all() and got[3].float().isnan().all() and not got[[0, 4]].float().isnan().any()
