"""Batch-invariant GEMMs: dense_mm, and fp8_scaled_mm / int8_scaled_mm / int4_gemm with
deterministic=True.

Invariance is bit for bit (``torch.equal`` of the raw bits, never a tolerance): a probe row's
output is the same at M = 1, 3, 17, 64, 300, placed last behind the other rows, and every other
row matches its own result in the M = 300 batch. On CPU and in sim (the CUDA kernel sources run by
the emulator; every tile configuration of a kernel is crossed: M <= 16, <= 64 and larger). The
default paths are shown to differ across M (torch.matmul on CPU; the M-chosen split-K of int4_gemm
in sim; the ATen GEMM behind the default CPU fp8 and int4 paths), so the invariance checks can fail.

dense_mm has the full op contract here: fp64 parity (FlashAttention error rule vs a naive
implementation in the input precision), opcheck, bad inputs, no shared-memory bank conflicts.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_fa_close, backend_params, get_backend, make_gen, poison_, randn, raw_bits

import fastinfer.ops as ops
import fastinfer.reference as ref

MS = (1, 3, 17, 64, 300)
ROWS = max(MS)
F8 = torch.float8_e4m3fn


def _row_index(m: int) -> torch.Tensor:
    """Rows 1..m-1 of the data, then the probe row 0 last."""
    return torch.cat([torch.arange(1, m), torch.zeros(1, dtype=torch.long)])


def assert_batch_invariant(fn, ms=MS):
    """fn(idx) runs the op on the data rows idx (a LongTensor) and returns [len(idx), N]."""
    full = raw_bits(fn(torch.arange(ROWS)))
    for m in ms:
        out = raw_bits(fn(_row_index(m)))
        assert torch.equal(out[-1], full[0]), f"probe row differs at M={m} (vs M={ROWS})"
        assert torch.equal(out[:-1], full[1:m]), f"other rows differ at M={m} (vs M={ROWS})"


def assert_not_batch_invariant(fn, ms=MS):
    """The same check run on a default path: it must fail (so the invariance tests can fail)."""
    with pytest.raises(AssertionError, match="differs? at M="):
        assert_batch_invariant(fn, ms)


# ---- inputs ---------------------------------------------------------------------------------------


def dense_inputs(n, k, dtype, seed, bias=True):
    gen = make_gen(seed)
    a = randn((ROWS, k), dtype, gen=gen)
    b = randn((n, k), dtype, gen=gen, scale=k ** -0.5)
    bv = randn((n,), dtype, gen=gen) if bias else None
    return a, b, bv


def fp8_inputs(n, k, blockwise, seed):
    gen = make_gen(seed)
    a = randn((ROWS, k), torch.float32, gen=gen, scale=4.0).to(F8)
    b = randn((n, k), torch.float32, gen=gen, scale=4.0).to(F8)
    if blockwise:
        sa = torch.rand((ROWS, (k + 127) // 128), generator=gen) * 0.02 + 0.005
        sb = torch.rand(((n + 127) // 128, (k + 127) // 128), generator=gen) * 0.02 + 0.005
    else:
        sa = torch.rand((ROWS,), generator=gen) * 0.02 + 0.005
        sb = torch.rand((n,), generator=gen) * 0.02 + 0.005
    return a, b, sa, sb


def int4_inputs(n, k, group, dtype, seed):
    gen = make_gen(seed)
    w_q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand((k // group, n), generator=gen) * 0.045 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.uint8)
    return randn((ROWS, k), dtype, gen=gen), w_q, scales, zeros


# ---- the default paths are not batch invariant (so the checks below can fail) --------------------


def test_torch_matmul_rows_depend_on_m():
    a, b, _ = dense_inputs(64, 256, torch.float32, seed=1, bias=False)
    assert_not_batch_invariant(lambda idx: a[idx] @ b.t())


def test_default_cpu_fp8_and_int4_paths_depend_on_m():
    get_backend("cpu")
    a, b, sa, sb = fp8_inputs(64, 256, False, seed=2)
    assert_not_batch_invariant(lambda idx: ops.fp8_scaled_mm(a[idx], b, sa[idx], sb, torch.float32))
    x, w_q, scales, zeros = int4_inputs(64, 512, 128, torch.float32, seed=3)
    packed = ops.int4_pack(w_q)
    assert_not_batch_invariant(lambda idx: ops.int4_gemm(x[idx], packed, scales, zeros, 128))


# int4 in sim: the shape of the deterministic test below. The default split count follows M
# (132 SMs: 32 splits at M = 1, 7 at M = 17, 2 at M = 300), which flips a few fp16 roundings.
INT4_SIM = (128, 2048)


@pytest.mark.sim
def test_default_sim_int4_split_k_depends_on_m():
    be = get_backend("sim")
    x, w_q, scales, zeros = int4_inputs(*INT4_SIM, 128, torch.float16, seed=4)
    packed = be.ns.int4_pack(w_q)
    assert_not_batch_invariant(lambda idx: be.ns.int4_gemm(x[idx], packed, scales, zeros, 128, None), ms=(17,))


# ---- invariance -------------------------------------------------------------------------------------

# (N, K): CPU cases with K tails of the 8-lane micro-kernel and N tails of its 3-column blocks;
# sim cases small (the emulator is slow) but crossing the 16 / 64 / 128-row tile configurations.
# Odd N (1, 3, 263: an odd vocabulary's LM head): the CUDA kernel's one-element stores.
DENSE_CPU = [(64, 256), (46, 200), (1, 64), (3, 72), (263, 64)]
DENSE_SIM = [(32, 136), (1, 64), (3, 64), (263, 64)]


@pytest.mark.parametrize("backend,dtype,n,k", backend_params({"cpu": DENSE_CPU, "sim": DENSE_SIM}))
def test_dense_mm_batch_invariant(backend, dtype, n, k):
    be = get_backend(backend)
    a, b, bv = dense_inputs(n, k, dtype, seed=n + k)
    assert_batch_invariant(lambda idx: be.ns.dense_mm(a[idx], b, bv))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("blockwise", [False, True])
def test_fp8_scaled_mm_deterministic_batch_invariant(backend, blockwise):
    be = get_backend(backend)
    n, k = (32, 256) if backend == "sim" else (144, 512)
    a, b, sa, sb = fp8_inputs(n, k, blockwise, seed=5)
    out_dtype = torch.bfloat16 if backend == "sim" else torch.float32
    assert_batch_invariant(lambda idx: be.ns.fp8_scaled_mm(a[idx], b, sa[idx].contiguous(), sb, out_dtype, None, True))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_int8_scaled_mm_deterministic_batch_invariant(backend):
    be = get_backend(backend)
    gen = make_gen(6)
    n, k = (32, 256) if backend == "sim" else (80, 2048)  # K > 1024: the CPU's chunked GEMM path
    a = torch.randint(-128, 128, (ROWS, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    sa = torch.rand((ROWS,), generator=gen) * 0.01 + 1e-3
    sb = torch.rand((n,), generator=gen) * 0.01 + 1e-3
    azp = torch.randint(-20, 20, (ROWS,), generator=gen, dtype=torch.int32)
    adj = ops.int8_azp_adj(b)
    bias = randn((n,), torch.bfloat16, gen=gen)
    assert_batch_invariant(
        lambda idx: be.ns.int8_scaled_mm(a[idx], b, sa[idx], sb, torch.bfloat16, bias, adj, azp[idx], True))


@pytest.mark.parametrize(
    "backend,dtype,n,k", backend_params({"cpu": [(64, 512)], "sim": [INT4_SIM]},
                                        dtypes={"cpu": (torch.float32, torch.bfloat16), "sim": (torch.float16,)}))
def test_int4_gemm_deterministic_batch_invariant(backend, dtype, n, k):
    """In sim N = 128, K = 2048 gives 8 deterministic splits (split-K with the workspace reduction)
    at every M, where the default path changes its split count with M (test above)."""
    be = get_backend(backend)
    x, w_q, scales, zeros = int4_inputs(n, k, 128, dtype, seed=7)
    packed = be.ns.int4_pack(w_q)
    assert_batch_invariant(lambda idx: be.ns.int4_gemm(x[idx], packed, scales, zeros, 128, None, True))


@pytest.mark.sim
def test_int4_gemm_deterministic_rows_chunked_launches():
    """Above 256 rows the deterministic split-K path runs one launch per 256-row chunk: rows past
    the first chunk must still match their M = 1 result."""
    be = get_backend("sim")
    x, w_q, scales, zeros = int4_inputs(16, 512, 128, torch.float16, seed=8)
    packed = be.ns.int4_pack(w_q)
    full = raw_bits(be.ns.int4_gemm(x, packed, scales, zeros, 128, None, True))
    for r in (0, 255, 256, 299):
        one = raw_bits(be.ns.int4_gemm(x[r:r + 1].contiguous(), packed, scales, zeros, 128, None, True))
        assert torch.equal(one[0], full[r]), f"row {r}"


# ---- dense_mm: parity with the fp64 oracle -----------------------------------------------------------


def naive_dense(a, b, bias):
    """The input-precision implementation: 64-wide partial products and the running sum rounded to
    a's dtype."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=a.dtype)
    for k0 in range(0, a.shape[1], 64):
        part = (a[:, k0:k0 + 64].double() @ b[:, k0:k0 + 64].double().t()).to(a.dtype)
        acc = (acc.double() + part.double()).to(a.dtype)
    return acc if bias is None else (acc.double() + bias.double()).to(a.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_mm_cpu_kernels_agree(monkeypatch, dtype):
    """The CPU micro-kernel's AVX2 form (intrinsics, bf16 / fp16 weights converted in registers, lane
    sums transposed in registers) and its portable form (an fp32 copy of the weights, std::fma per
    lane, cpu::tree_sum) are one arithmetic: the same bits at every M
    (FASTINFER_TEST_CPU_DENSE_PORTABLE=1 forces the portable one)."""
    be = get_backend("cpu")
    a, b, bv = dense_inputs(46, 200, dtype, seed=9)
    fast = be.ns.dense_mm(a, b, bv)
    monkeypatch.setenv("FASTINFER_TEST_CPU_DENSE_PORTABLE", "1")
    portable = be.ns.dense_mm(a, b, bv)
    assert torch.equal(fast, portable)
    for m in (1, 3, 5):  # the 1 x 8 tail blocks and a 4 x 3 block
        assert torch.equal(be.ns.dense_mm(a[:m], b, bv), fast[:m])


REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# (M, N, K, bias): M across the tile configurations, N / K tails (K % 8 == 0), odd N (1, 3, 263).
PARITY_SIM = [(1, 32, 64, True), (5, 48, 72, False), (17, 130, 128, True), (100, 16, 200, True),
              (9, 1, 64, True), (17, 3, 72, True), (70, 263, 64, True), (5, 263, 136, False)]
PARITY_CPU = PARITY_SIM + [(33, 250, 1000, False), (4, 1024, 512, True)]


@pytest.mark.parametrize("backend,dtype,m,n,k,bias",
                         backend_params({"cpu": PARITY_CPU, "sim": PARITY_SIM, "cuda": PARITY_CPU}))
def test_dense_mm_vs_reference(backend, dtype, m, n, k, bias):
    be = get_backend(backend)
    gen = make_gen(m * 7 + n + k)
    a = randn((m, k), dtype, gen=gen)
    b = randn((n, k), dtype, gen=gen, scale=k ** -0.5)
    bv = randn((n,), dtype, gen=gen) if bias else None
    dev = be.device
    out = be.run(lambda: be.ns.dense_mm(a.to(dev), b.to(dev), None if bv is None else bv.to(dev)))
    assert out.dtype == dtype and out.shape == (m, n)
    assert_fa_close(out, ref.dense_mm(a, b, bv), naive_dense(a, b, bv), rel_tol=REL_TOL[dtype], floor=1e-5)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_dense_mm_empty_and_k0(backend):
    be = get_backend(backend)
    b = torch.ones(16, 64, dtype=torch.bfloat16, device=be.device)
    assert be.ns.dense_mm(torch.ones(0, 64, dtype=torch.bfloat16, device=be.device), b).shape == (0, 16)
    bias = torch.arange(16, dtype=torch.bfloat16, device=be.device)
    out = be.ns.dense_mm(torch.ones(3, 0, dtype=torch.bfloat16, device=be.device),
                         torch.ones(16, 0, dtype=torch.bfloat16, device=be.device), bias)
    assert torch.equal(out.cpu(), bias.cpu().expand(3, 16))


def test_dense_mm_writes_every_output():
    """Poisoned inputs outside the operands cannot leak: an output built over a NaN-poisoned buffer
    (the operands are views into it) stays finite and exact against the reference."""
    get_backend("cpu")
    gen = make_gen(11)
    buf = poison_(torch.empty(3 * 64 + 8, dtype=torch.float32))
    a = buf[:3 * 64].view(3, 64).copy_(torch.randn(3, 64, generator=gen))
    b = randn((18, 64), torch.float32, gen=gen)
    out = ops.dense_mm(a, b)
    assert torch.isfinite(out).all()
    assert_fa_close(out, ref.dense_mm(a, b), naive_dense(a, b, None), rel_tol=1e-5)


# ---- dense_mm: opcheck, bad inputs, shared-memory access pattern -------------------------------------


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_dense_mm_opcheck(ns):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    gen = make_gen(12)
    a = randn((5, 64), torch.bfloat16, gen=gen)
    b = randn((48, 64), torch.bfloat16, gen=gen)
    bv = randn((48,), torch.bfloat16, gen=gen)
    op = getattr(torch.ops, ns).dense_mm.default
    torch.library.opcheck(op, (a, b, bv))
    torch.library.opcheck(op, (a, b, None))


def _dense_args():
    gen = make_gen(13)
    return dict(a=randn((3, 64), torch.bfloat16, gen=gen), b=randn((16, 64), torch.bfloat16, gen=gen),
                bias=randn((16,), torch.bfloat16, gen=gen))


BAD_DENSE = [
    ("a_dtype", lambda d: dict(a=d["a"].to(torch.int32)), r"a must have dtype in"),
    ("a_fp64", lambda d: dict(a=d["a"].double(), b=d["b"].double(), bias=None), r"a must have dtype in"),
    ("b_dtype", lambda d: dict(b=d["b"].half()), r"b must have the dtype of a"),
    ("a_3d", lambda d: dict(a=d["a"].unsqueeze(0)), r"a must be 2-D"),
    ("b_1d", lambda d: dict(b=d["b"][0]), r"b must be 2-D"),
    ("k_mismatch", lambda d: dict(b=d["b"][:, :32].contiguous()), r"b must have shape \[N, K\] with K = 64"),
    ("k_not_8", lambda d: dict(a=d["a"][:, :60].contiguous(), b=d["b"][:, :60].contiguous()),
     r"a must have K a multiple of 8"),
    ("bias_shape", lambda d: dict(bias=d["bias"][:8].contiguous()), r"bias must have shape \[N\]"),
    ("bias_dtype", lambda d: dict(bias=d["bias"].float()), r"bias must have dtype"),
    ("a_noncontig", lambda d: dict(a=torch.cat([d["a"], d["a"]], 1)[:, ::2]), r"a must be contiguous"),
    ("b_transposed", lambda d: dict(b=d["b"].t().contiguous().t()), r"b must be \[N, K\] row-major contiguous"),
    ("b_device", lambda d: dict(b=d["b"].to("meta")), r"b must be on the device of a"),
    ("bias_device", lambda d: dict(bias=d["bias"].to("meta")), r"bias must be on the device of a"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,override,arg_re", BAD_DENSE, ids=[c[0] for c in BAD_DENSE])
def test_dense_mm_bad_input(ns, case, override, arg_re):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    d = _dense_args()
    d.update(override(d))
    with pytest.raises(RuntimeError, match=r"dense_mm: " + arg_re):
        getattr(torch.ops, ns).dense_mm(d["a"], d["b"], d["bias"])


@pytest.mark.sim
def test_dense_mm_sim_rejects_fp32():
    get_backend("sim")
    with pytest.raises(RuntimeError, match=r"dense_mm: a must have dtype in"):
        torch.ops.fastinfer_sim.dense_mm(torch.ones(2, 64), torch.ones(16, 64))


@pytest.mark.sim
@pytest.mark.parametrize("m", [1, 40, 130])
def test_dense_mm_shared_accesses_conflict_free(m):
    """Every shared-memory request of the kernel (cp.async stores, ldmatrix) is 1-way (simt profile)."""
    get_backend("sim")
    from fastinfer import simt

    gen = make_gen(14)
    a = randn((m, 128), torch.bfloat16, gen=gen)
    b = randn((128, 128), torch.bfloat16, gen=gen)
    rep = simt.profile(lambda: torch.ops.fastinfer_sim.dense_mm(a, b))
    (kern,) = [k for k in rep["kernels"] if "dense_mm_kernel" in k["name"]]
    shared = [e for e in kern["lines"] if e["op"] in ("ldmatrix", "cp.async", "ld.shared", "st.shared")
              and e["wavefronts"]]
    assert any(e["op"] == "ldmatrix" for e in shared)
    for e in shared:
        assert e["wavefronts"] == e["ideal_wavefronts"], f"{e['op']} at {e['file']}:{e['line']}: bank conflicts"


def test_python_wrapper_and_backend():
    get_backend("cpu")
    a, b, bv = dense_inputs(16, 64, torch.float32, seed=15)
    assert torch.equal(ops.dense_mm(a, b, bv), torch.ops.fastinfer.dense_mm(a, b, bv))
    assert ops.backend("fastinfer").dense_mm is not None
