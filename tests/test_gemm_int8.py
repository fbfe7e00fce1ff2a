"""int8_quantize and int8_scaled_mm against the oracles in ``fastinfer.reference.gemm_int8``.

* quantisation is bit-exact (codes, scales, zero points) on every backend: per token symmetric and
  asymmetric, per tensor computed / given / saturating, odd shapes, a zero row, K > 8192;
* the matmul's int32 accumulators are exact: CPU float32 output with unit scales equals the int64
  product (K across the CPU's 1024-wide exact chunks), the emulated kernel's float16 output equals
  it where fp16 holds the integers; CPU and the emulated kernel agree bit for bit on every case (the
  same epilogue); against the fp64 oracle with the error rule of ``conftest.assert_fa_close``;
  odd M (1, 5, 17, 64, 100, 130) and N up to 8448 (every tile config the launcher picks: 64 x 128
  and 128 x 128 tiles need grids of half / one wave of SMs), M / N / K tails, scale combinations,
  bias, the asymmetric correction;
* sim runs use two schedule seeds and must be bit-identical (conftest);
* opcheck (schema, fake impl, dynamic shapes) for both namespaces; bad inputs name the argument.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, backend_params, get_backend, make_gen

from fastinfer.reference import gemm_int8 as ref  # noqa: E402  (conftest imports fastinfer first)

I8, I32 = torch.int8, torch.int32
BF, HF, F32 = torch.bfloat16, torch.float16, torch.float32


def _x(m, k, dtype, gen, zero_row=None, shift=0.0):
    """Rows of very different magnitudes (and, with shift, off-centre), never all zero unless asked."""
    row_mag = torch.exp(torch.randn(m, 1, generator=gen) * 2.0)
    x = (torch.randn(m, k, generator=gen) + shift * torch.randn(m, 1, generator=gen)) * row_mag
    if zero_row is not None and m > zero_row:
        x[zero_row] = 0.0
    return x.to(dtype)


def _i8(rows, k, gen, lo=-128):
    return torch.randint(lo, 128, (rows, k), generator=gen, dtype=torch.int16).to(I8)


# --------------------------------------------------------------------------------------------
# int8_quantize
# --------------------------------------------------------------------------------------------

# (M, K, mode, symmetric, extra): extra = "zero" (a zero row), "given" (a given scale), "sat" (a
# given scale too small: saturates), "" otherwise.
Q_CASES = [
    (1, 64, "token", True, ""),
    (3, 136, "token", True, "zero"),
    (17, 256, "token", False, ""),
    (5, 200, "token", False, "zero"),
    (2, 8208, "token", True, ""),     # K > 8192: the re-reading path of the per-token kernel
    (2, 8208, "token", False, ""),
    (1, 8, "tensor", True, ""),
    (17, 264, "tensor", True, ""),    # 3 CTAs in the reduction pass
    (100, 136, "tensor", True, "given"),
    (3, 72, "tensor", True, "sat"),
]


def _given_scale(x, extra):
    if extra == "given":
        return torch.tensor([x.float().abs().max().item() / 100.0], dtype=torch.float32)
    if extra == "sat":
        return torch.tensor([x.float().abs().max().item() / 600.0], dtype=torch.float32)
    return None


@pytest.mark.parametrize(
    "bname,dtype,m,k,mode,sym,extra", backend_params({"cpu": Q_CASES, "sim": Q_CASES, "cuda": Q_CASES})
)
def test_int8_quantize(bname, dtype, m, k, mode, sym, extra):
    be = get_backend(bname)
    gen = make_gen(m * 1000 + k + sym)
    x = _x(m, k, dtype, gen, zero_row=1 if extra == "zero" else None, shift=0.0 if sym else 1.5)
    scale = _given_scale(x, extra)
    want = ref.int8_quantize(x, mode, scale, sym)
    if extra == "sat":
        assert (want[0].abs() == 127).sum() > 5, "test inputs do not saturate"

    def run():
        return be.ns.int8_quantize(x.to(be.device), mode, scale.to(be.device) if scale is not None else None, sym)

    q, s, azp = be.run(run)
    assert q.dtype == I8 and s.dtype == F32 and azp.dtype == I32
    assert_bits_equal(s.cpu(), want[1], "scale")
    assert_bits_equal(q.cpu(), want[0], "x_int8")
    if sym:
        assert azp.shape == (0,)
        if scale is None:
            assert q.cpu().abs().amax().item() == 127  # the codes use the range
    else:
        assert_bits_equal(azp.cpu(), want[2], "azp")
        # the range [min(x, 0), max(x, 0)] spans the codes -128..127 (+-1 at the top: rounding)
        qc, xf = q.cpu().int(), x.float()
        neg, pos = xf.amin(1) < 0, xf.amax(1) > 0
        assert (qc.amin(1)[neg] == -128).all() and (qc.amax(1)[pos] >= 126).all()
        assert (azp.cpu()[~neg] == -128).all() and neg.any()


@pytest.mark.parametrize("bname,dtype,m,k,azp", backend_params(
    {"cpu": [(7, 64, -5), (1, 136, 40)], "sim": [(3, 64, -5), (2, 40, 127)], "cuda": [(7, 64, -5), (513, 4096, 40)]}))
def test_int8_quantize_static_asymmetric(bname, dtype, m, k, azp):
    """A given scale and zero point (vLLM's static_scaled_int8_quant with azp): the codes are
    clamp(rne(x / scale) + azp, -128, 127), bit for bit the reference, saturating at both ends."""
    be = get_backend(bname)
    x = _x(m, k, dtype, make_gen(m + k), shift=1.5)
    scale = torch.tensor([x.float().abs().nan_to_num(0).max().item() / 150.0], dtype=torch.float32)  # saturates some
    z = torch.tensor([azp], dtype=I32)
    x[0, 1] = float("nan")  # int8 has no NaN: code 0 (the NaN contract of the given-scale quantisers)
    want_q, want_s, want_z = ref.int8_quantize(x, "tensor", scale, False, z)
    assert want_q[0, 1] == 0
    q, s, zo = be.run(lambda: be.ns.int8_quantize(x.to(be.device), "tensor", scale.to(be.device), False, z.to(be.device)))
    assert_bits_equal(q.cpu(), want_q, "x_int8")
    assert_bits_equal(s.cpu(), want_s, "scale")
    assert_bits_equal(zo.cpu(), want_z, "azp")
    assert ((want_q == 127) | (want_q == -128)).any(), "test inputs do not saturate"
    import fastinfer.ops as fo

    wq, _, wz = fo.int8_quantize(x.to(be.device), "tensor", scale.to(be.device), symmetric=False, azp=z.to(be.device),
                                 lib=be.ns)
    assert_bits_equal(wq.cpu(), want_q, "wrapper x_int8")
    assert_bits_equal(wz.cpu(), want_z, "wrapper azp")


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_int8_quantize_static_asymmetric_worked_example(bname):
    """Worked by hand from vLLM's static_scaled_int8_quant with azp (csrc/quantization/
    compressed_tensors/int8_quant_kernels.cu: dst = rint(x / scale) + azp, saturated to int8),
    scale 0.5, azp 3: 1 -> 2 + 3 = 5; -2.5 -> -5 + 3 = -2; 300 -> 600 + 3 -> 127; -300 -> -128;
    0.25 -> rint(0.5) = 0 -> 3; 0.75 -> rint(1.5) = 2 -> 5; -0.25 -> rint(-0.5) = -0 -> 3; -1 -> 1."""
    be = get_backend(bname)
    x = torch.tensor([[1.0, -2.5, 300.0, -300.0, 0.25, 0.75, -0.25, -1.0]], dtype=BF)
    q, s, z = be.run(lambda: be.ns.int8_quantize(x, "tensor", torch.tensor([0.5]), False, torch.tensor([3], dtype=I32)))
    assert q.tolist() == [[5, -2, 127, -128, 3, 5, 3, 1]]
    assert s.tolist() == [0.5] and z.tolist() == [3]


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_int8_quantize_roundtrip(bname):
    """Dequantised values are within half a step (scale / 2) of x, symmetric and asymmetric."""
    be = get_backend(bname)
    x = _x(5, 256, BF, make_gen(3), shift=1.0)
    xf = x.double()
    for sym in (True, False):
        out = be.run(lambda: be.ns.int8_quantize(x, "token", None, sym))
        q, s = out[0], out[1]
        back = ref.int8_dequantize(q, s, None if sym else out[2])
        bound = s.double().reshape(-1, 1) * 0.5 * 1.0001
        assert ((back - xf).abs() <= bound).all(), sym


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_empty_inputs(bname):
    """M = 0 and K = 0 are legal: empty outputs, range-0 scales, and out = bias when K = 0."""
    be = get_backend(bname)
    q, s, z = be.ns.int8_quantize(torch.empty(0, 64, dtype=BF), "token", None, True)
    assert q.shape == (0, 64) and s.shape == (0,)
    for mode, sym in (("token", True), ("token", False), ("tensor", True)):
        x = torch.empty(3, 0, dtype=BF)
        got = be.ns.int8_quantize(x, mode, None, sym)
        want = ref.int8_quantize(x, mode, None, sym)
        assert got[0].shape == (3, 0)
        assert_bits_equal(got[1], want[1], f"scale ({mode}, K = 0)")
        if not sym:
            assert_bits_equal(got[2], want[2], "azp (K = 0)")
    bias = torch.randn(32).to(BF)
    out = be.ns.int8_scaled_mm(torch.empty(3, 0, dtype=I8), torch.empty(32, 0, dtype=I8), torch.ones(1),
                               torch.ones(1), BF, bias, None, None)
    assert_bits_equal(out, bias.expand(3, 32), "K = 0: out = bias")
    out = be.ns.int8_scaled_mm(torch.empty(0, 64, dtype=I8), _i8(32, 64, make_gen(0)), torch.ones(1),
                               torch.ones(1), BF, None, None, None)
    assert out.shape == (0, 32)


# --------------------------------------------------------------------------------------------
# int8_scaled_mm
# --------------------------------------------------------------------------------------------

# (M, N, K, scales, bias, azp). Tiles (cuda/src/gemm_int8.cu): M <= 16 small (16 x 32); M <= 64
# medium (64 x 128) when that grid is >= half a wave (66 CTAs of the emulator's 132 SMs); M > 64
# large (128 x 128) when >= a wave; else the next smaller; k-tile 128. scales: "tt" per tensor, "tc" per token x per channel, "tokT",
# "tensC" the mixed ones; azp: None, "row" (per token) or "tensor".
MM_CASES = [
    (1, 64, 128, "tt", False, None),
    (5, 48, 272, "tc", True, "row"),       # N tail in a 32-wide tile, K tail (272 = 2 * 128 + 16)
    (17, 32, 16, "tc", False, None),       # the minimum K
    (17, 144, 256, "tokT", True, "tensor"),
    (64, 128, 160, "tensC", False, "row"),
    (100, 80, 384, "tc", True, None),      # large, M / N tails
    (100, 144, 1104, "tc", False, "row"),  # K beyond the CPU's 1024-wide exact chunk
    (40, 8448, 48, "tc", True, "row"),     # medium tiles: 66 CTAs
    (130, 8448, 32, "tokT", False, None),  # large tiles: 132 CTAs, M tail
]
MM_DTYPES = {"cpu": (BF, HF, F32), "sim": (BF, HF), "cuda": (BF, HF)}


def _mm_inputs(m, n, k, scales, bias, azp, out_dtype, seed):
    gen = make_gen(seed)
    a, b = _i8(m, k, gen), _i8(n, k, gen, lo=-127)
    pos = lambda s: (torch.rand(s, generator=gen) + 0.25) * 1e-3  # noqa: E731
    sa = pos(m if scales in ("tc", "tokT") else 1)
    sb = pos(n if scales in ("tc", "tensC") else 1)
    bv = (torch.randn(n, generator=gen) * 4).to(out_dtype) if bias else None
    z = adj = None
    if azp is not None:
        z = torch.randint(-128, 128, (m if azp == "row" else 1,), generator=gen, dtype=I32)
        adj = b.sum(1, dtype=I32)
    return a, b, sa, sb, bv, adj, z


def _naive(a, b, sa, sb, bias, adj, z, out_dtype):
    """fp32 matmul of the int8 values (exact here: |acc| < 2^24 for K <= 1024, and chunked beyond),
    fp32 scaling and bias, one rounding to out_dtype (independent of the impls)."""
    acc = ref.int8_mm_exact(a, b)
    if z is not None:
        acc = acc - z.long().reshape(-1, 1) * adj.long().reshape(1, -1)
    out = acc.float() * (sa.reshape(-1, 1) * sb.reshape(1, -1))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _run_mm(be, args, dtype):
    d = be.device
    a, b, sa, sb, bv, adj, z = (t.to(d) if t is not None else None for t in args)
    return be.run(lambda: be.ns.int8_scaled_mm(a, b, sa, sb, dtype, bv, adj, z))


@pytest.mark.parametrize(
    "bname,dtype,m,n,k,scales,bias,azp",
    backend_params({"cpu": MM_CASES, "sim": MM_CASES, "cuda": MM_CASES}, dtypes=MM_DTYPES),
)
def test_int8_scaled_mm(bname, dtype, m, n, k, scales, bias, azp):
    be = get_backend(bname)
    args = _mm_inputs(m, n, k, scales, bias, azp, dtype, seed=m * 7919 + n * 31 + k)
    a, b, sa, sb, bv, adj, z = args
    expect = ref.int8_scaled_mm(a, b, sa, sb, dtype, bv, adj, z)
    out = _run_mm(be, args, dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_fa_close(out, expect, _naive(*args[:4], bv, adj, z, dtype), floor=1e-6 * expect.abs().max().item(),
                    name=f"int8_scaled_mm[{scales}, azp={azp}]")
    if bname != "cpu":  # the kernel and the CPU implementation compute the same epilogue, bit for bit
        assert_bits_equal(out.cpu(), _run_mm(get_backend("cpu"), args, dtype), "kernel vs CPU")


def test_int8_accumulators_exact_cpu():
    """Unit scales, float32 out: the CPU result is the exact integer product rounded once (K at and
    across the 1024-wide exact chunks; the extreme products 128 * 128 in row / column 0)."""
    cpu = get_backend("cpu")
    gen = make_gen(7)
    for m, n, k in ((3, 32, 1024), (5, 48, 1040), (2, 16, 4096)):
        a, b = _i8(m, k, gen), _i8(n, k, gen)
        a[0, :] = -128  # the extreme products: 128 * 128 per term
        b[0, :] = -128
        out = cpu.ns.int8_scaled_mm(a, b, torch.ones(1), torch.ones(1), F32, None, None, None)
        exact = ref.int8_mm_exact(a, b)
        assert exact.abs().max().item() >= 2**24  # beyond one exact fp32 GEMM: the chunks matter
        # the exact integer, rounded once to float32 (exact wherever |acc| <= 2^24)
        assert torch.equal(out, exact.to(torch.float64).to(F32)), (m, n, k)


@pytest.mark.sim
def test_int8_accumulators_exact_sim():
    """The emulated mma.sync s8 kernel's accumulators are exact: with small codes and unit scales
    the float16 output holds them exactly (|acc| <= 2048), for every tile config."""
    sim = get_backend("sim")
    gen = make_gen(8)
    for m, n in ((3, 48), (40, 8448), (130, 8448)):
        a = torch.randint(-4, 5, (m, 128), generator=gen, dtype=torch.int16).to(I8)
        b = torch.randint(-4, 5, (n, 128), generator=gen, dtype=torch.int16).to(I8)
        out = sim.run(lambda: sim.ns.int8_scaled_mm(a, b, torch.ones(1), torch.ones(1), HF, None, None, None))
        assert torch.equal(out.double(), ref.int8_mm_exact(a, b).double()), m


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_quantize_then_mm(bname):
    """The W8A8 path end to end, symmetric and asymmetric activations (the azp correction with
    azp_adj = b.sum(1)), against the float matmul: int8 has ~2^-8 relative precision per element."""
    import fastinfer.ops as fo

    be = get_backend(bname)
    gen = make_gen(11)
    x = (torch.randn(17, 256, generator=gen) + 0.7).to(BF)  # off-centre rows: asymmetric helps
    w = (torch.randn(128, 256, generator=gen) * 0.05).to(BF)
    exact = x.double() @ w.double().t()
    qw, sw, _ = be.run(lambda: be.ns.int8_quantize(w, "token", None, True))
    qx, sx, _ = be.run(lambda: be.ns.int8_quantize(x, "token", None, True))
    out = be.run(lambda: be.ns.int8_scaled_mm(qx, qw, sx, sw, BF, None, None, None))
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    qa, sa, za = be.run(lambda: be.ns.int8_quantize(x, "token", None, False))
    out_a = be.run(lambda: be.ns.int8_scaled_mm(qa, qw, sa, sw, BF, None, fo.int8_azp_adj(qw), za))
    rel_a = ((out_a.double() - exact).norm() / exact.norm()).item()
    assert rel < 0.01 and rel_a < 0.01, (rel, rel_a)


def test_wrappers():
    import fastinfer.ops as fo

    get_backend("cpu")
    args = _mm_inputs(3, 32, 64, "tc", True, "row", BF, seed=5)
    a, b, sa, sb, bv, adj, z = args
    assert torch.equal(fo.int8_scaled_mm(a, b, sa, sb, BF, bv, adj, z),
                       torch.ops.fastinfer.int8_scaled_mm(a, b, sa, sb, BF, bv, adj, z))
    assert torch.equal(fo.int8_azp_adj(b), b.int().sum(1).int())
    x = _x(3, 64, BF, make_gen(1))
    assert len(fo.int8_quantize(x)) == 2 and len(fo.int8_quantize(x, symmetric=False)) == 3
    for got, want in zip(fo.int8_quantize(x, symmetric=False), torch.ops.fastinfer.int8_quantize(x, "token", None, False)):
        assert_bits_equal(got, want, "int8_quantize wrapper")
    assert fo.backend("fastinfer").int8_quantize is not None


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------


def _opcheck_cases():
    gen = make_gen(21)
    x = _x(5, 256, BF, gen)
    a, b, sa, sb, bv, adj, z = _mm_inputs(5, 48, 256, "tc", True, "row", BF, seed=22)
    return [
        ("int8_quantize", (x, "token", None, True)),
        ("int8_quantize", (x, "token", None, False)),
        ("int8_quantize", (x, "tensor", None, True)),
        ("int8_quantize", (x, "tensor", torch.tensor([0.01]), True)),
        ("int8_quantize", (x, "tensor", torch.tensor([0.01]), False, torch.tensor([-7], dtype=I32))),
        ("int8_quantize", (x[:, :128], "token", None, True)),  # strided rows
        ("int8_scaled_mm", (a, b, sa, sb, BF, bv, None, None)),
        ("int8_scaled_mm", (a, b, sa, sb, HF, None, adj, z)),
    ]


@pytest.mark.parametrize(
    "bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim), pytest.param("cuda", marks=pytest.mark.cuda)]
)
@pytest.mark.parametrize("idx", range(8))
def test_opcheck(bname, idx):
    be = get_backend(bname)
    name, args = _opcheck_cases()[idx]
    args = tuple(t.to(be.device) if isinstance(t, torch.Tensor) else t for t in args)
    torch.library.opcheck(getattr(be.ns, name).default, args)


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def _f(*s):
    return torch.rand(*s) + 0.5


def _r(r, c):
    return _i8(r, c, make_gen(r * 100 + c))


def _mm(a=None, b=None, sa=None, sb=None, out=BF, bias=None, adj=None, z=None):
    return (_r(4, 64) if a is None else a, _r(32, 64) if b is None else b, _f(1) if sa is None else sa,
            _f(1) if sb is None else sb, out, bias, adj, z)


_ADJ = lambda: torch.zeros(32, dtype=I32)  # noqa: E731
_Z = lambda: torch.zeros(4, dtype=I32)  # noqa: E731

BAD_QUANT = [
    ("x_dtype", lambda: (torch.randn(4, 64, dtype=torch.float64), "token", None, True), r"\bx\b.*dtype"),
    ("x_int", lambda: (torch.ones(4, 64, dtype=torch.int32), "token", None, True), r"\bx\b.*dtype"),
    ("x_3d", lambda: (torch.randn(2, 4, 64, dtype=BF), "token", None, True), r"\bx\b.*2-D"),
    ("x_k", lambda: (torch.randn(4, 60, dtype=BF), "token", None, True), r"\bx\b.*multiple of 8"),
    ("mode", lambda: (torch.randn(4, 64, dtype=BF), "group", None, True), r"\bmode\b"),
    ("asym_tensor", lambda: (torch.randn(4, 64, dtype=BF), "tensor", None, False), r"\bsymmetric\b"),
    ("scale_token", lambda: (torch.randn(4, 64, dtype=BF), "token", _f(1), True), r"\bscale\b.*None"),
    ("scale_dtype", lambda: (torch.randn(4, 64, dtype=BF), "tensor", _f(1).double(), True), r"\bscale\b.*float32"),
    ("scale_numel", lambda: (torch.randn(4, 64, dtype=BF), "tensor", _f(2), True), r"\bscale\b.*1 element"),
    ("x_noncontig", lambda: (torch.randn(64, 4, dtype=BF).t(), "token", None, True), r"\bx\b.*contiguous"),
    ("asym_tensor_no_azp", lambda: (torch.randn(4, 64, dtype=BF), "tensor", _f(1), False), r"\bsymmetric\b.*azp"),
    ("azp_symmetric", lambda: (torch.randn(4, 64, dtype=BF), "tensor", _f(1), True, _z1()), r"\bazp\b.*None"),
    ("azp_token", lambda: (torch.randn(4, 64, dtype=BF), "token", None, False, _z1()), r"\bazp\b.*None"),
    ("azp_dtype", lambda: (torch.randn(4, 64, dtype=BF), "tensor", _f(1), False, _z1().long()), r"\bazp\b.*int32"),
    ("azp_numel", lambda: (torch.randn(4, 64, dtype=BF), "tensor", _f(1), False, torch.zeros(2, dtype=I32)), r"\bazp\b.*1 element"),
    ("azp_device", lambda: (torch.randn(4, 64, dtype=BF), "tensor", _f(1), False, _z1().to("meta")), r"\bazp\b"),
]

BAD_MM = [
    ("a_dtype", lambda: _mm(a=torch.randn(4, 64, dtype=BF)), r"\ba\b.*dtype"),
    ("b_uint8", lambda: _mm(b=_r(32, 64).view(torch.uint8)), r"\bb\b.*dtype"),
    ("a_1d", lambda: _mm(a=_r(1, 64)[0]), r"\ba\b.*2-D"),
    ("k_mismatch", lambda: _mm(b=_r(32, 80)), r"\bb\b.*\[N, K\]"),
    ("k_16", lambda: _mm(a=_r(4, 40), b=_r(32, 40)), r"\ba\b.*multiple of 16"),
    ("n_16", lambda: _mm(b=_r(40, 64)), r"\bb\b.*multiple of 16"),
    ("out_dtype", lambda: _mm(out=torch.float64), r"\bout_dtype\b"),
    ("out_int", lambda: _mm(out=torch.int32), r"\bout_dtype\b"),
    ("sa_dtype", lambda: _mm(sa=_f(1).to(BF)), r"\bscale_a\b.*float32"),
    ("sa_shape", lambda: _mm(sa=_f(3)), r"\bscale_a\b.*shape"),
    ("sb_shape", lambda: _mm(sb=_f(7)), r"\bscale_b\b.*shape"),
    ("sb_2d", lambda: _mm(sb=_f(1, 1)), r"\bscale_b\b.*shape"),
    ("bias_dtype", lambda: _mm(bias=torch.randn(32, dtype=HF)), r"\bbias\b.*dtype"),
    ("bias_shape", lambda: _mm(bias=torch.randn(16, dtype=BF)), r"\bbias\b.*shape"),
    ("azp_alone", lambda: _mm(z=_Z()), r"\bazp_adj\b"),
    ("adj_alone", lambda: _mm(adj=_ADJ()), r"\bazp_adj\b"),
    ("azp_dtype", lambda: _mm(adj=_ADJ(), z=_Z().long()), r"\bazp\b.*int32"),
    ("azp_shape", lambda: _mm(adj=_ADJ(), z=torch.zeros(3, dtype=I32)), r"\bazp\b.*shape"),
    ("adj_shape", lambda: _mm(adj=torch.zeros(16, dtype=I32), z=_Z()), r"\bazp_adj\b.*shape"),
    ("adj_dtype", lambda: _mm(adj=_ADJ().float(), z=_Z()), r"\bazp_adj\b.*int32"),
    ("a_noncontig", lambda: _mm(a=_r(64, 4).t()), r"\ba\b.*contiguous"),
    ("b_transposed", lambda: _mm(b=_r(64, 32).t()), r"\bb\b.*row-major"),
    ("sa_noncontig", lambda: _mm(sa=_f(4, 2)[:, 0], sb=_f(32)), r"\bscale_a\b.*contiguous"),
]


def _z1():
    return torch.tensor([3], dtype=I32)


def _bad_params():
    out = []
    for ns in ("fastinfer", "fastinfer_sim"):
        marks = [pytest.mark.sim] if ns == "fastinfer_sim" else []
        for op, cases in (("int8_quantize", BAD_QUANT), ("int8_scaled_mm", BAD_MM)):
            for case, make, rx in cases:
                out.append(pytest.param(ns, op, make, rx, marks=marks, id=f"{ns}-{op}-{case}"))
    return out


@pytest.mark.parametrize("ns_name,op,make_args,arg_re", _bad_params())
def test_bad_input(ns_name, op, make_args, arg_re):
    be = get_backend("sim" if ns_name == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        getattr(be.ns, op)(*make_args())
    assert f"{ns_name}.{op}:" in str(exc.value), str(exc.value)


@pytest.mark.sim
def test_fp32_only_on_cpu():
    """float32 activations / outputs are CPU-only; the kernel namespaces take bf16/fp16."""
    cpu = get_backend("cpu")
    assert cpu.ns.int8_quantize(torch.randn(2, 64), "token", None, True)[0].dtype == I8
    assert cpu.ns.int8_scaled_mm(*_mm(out=F32)).dtype == F32
    sim = get_backend("sim")
    with pytest.raises(RuntimeError, match=r"\bx\b.*dtype"):
        sim.ns.int8_quantize(torch.randn(2, 64), "token", None, True)
    with pytest.raises(RuntimeError, match=r"\bout_dtype\b"):
        sim.ns.int8_scaled_mm(*_mm(out=F32))


@pytest.mark.cuda
def test_bad_device_cuda():
    be = get_backend("cuda")
    a, b, sa, sb, out, _, _, _ = _mm()
    with pytest.raises(RuntimeError, match=r"\bb\b"):
        be.ns.int8_scaled_mm(a.cuda(), b, sa.cuda(), sb.cuda(), out, None, None, None)
    with pytest.raises(RuntimeError, match=r"\bscale\b"):
        be.ns.int8_quantize(torch.randn(2, 64, dtype=BF, device="cuda"), "tensor", _f(1), True)
