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
"""

from __future__ import annotations

import pytest
import torch

from conftest import backend_params, get_backend, make_gen, raw_bits
from fastinfer.reference import attention as ref_attention  # noqa: E402  (conftest imports fastinfer first)
from fastinfer.reference import gemm_fp8 as ref_fp8  # noqa: E402
from fastinfer.reference import gemm_int8 as ref_int8  # noqa: E402

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
