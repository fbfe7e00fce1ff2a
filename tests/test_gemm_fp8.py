"""fp8_quantize and fp8_scaled_mm against the oracles in ``fastinfer.reference.gemm_fp8``.

* quantisation is bit-exact (codes and scales) on every backend, every mode, odd shapes, with
  zero rows / groups (the amax guard) and saturation (a given scale that is too small);
* the scaled matmul follows the error rule of ``conftest.assert_fa_close``: the naive computation is
  fp32 dequantise + fp32 matmul rounded once to ``out_dtype`` (what the kernel does, with another
  summation order); odd M (1, 3, 17, 64, 100: every kernel tile config and M tails), N and K tails
  inside a tile, every scale mode, with and without bias;
* sim runs use two schedule seeds and must be bit-identical (conftest);
* opcheck (schema, fake impl, dynamic shapes) for both namespaces; bad inputs name the argument.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, backend_params, get_backend, make_gen

from fastinfer.reference import gemm_fp8 as ref  # noqa: E402  (conftest imports fastinfer first)

E4M3 = torch.float8_e4m3fn
BF, HF, F32 = torch.bfloat16, torch.float16, torch.float32


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------


def _x(m, k, dtype, gen, zero_row=None, zero_group=None):
    """Rows of very different magnitudes (per-row scales differ), never all zero unless asked."""
    row_mag = torch.exp(torch.randn(m, 1, generator=gen) * 2.0)
    x = torch.randn(m, k, generator=gen) * row_mag
    if zero_row is not None and m > zero_row:
        x[zero_row] = 0.0
    if zero_group is not None:
        r, g0, g1 = zero_group
        if m > r:
            x[r, g0:g1] = 0.0
    return x.to(dtype)


def _fp8(rows, k, gen):
    """Random e4m3 codes over most of the range (finite, never all zero)."""
    v = torch.randn(rows, k, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    return (v * 32).clamp(-448, 448).to(E4M3)


def _scales(mode, m, n, k, gen):
    pos = lambda *s: (torch.rand(*s, generator=gen) + 0.25) * 0.01  # noqa: E731
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    return {
        "tt": (pos(1), pos(1)),
        "tc": (pos(m), pos(n)),
        "tokT": (pos(m), pos(1)),
        "tensC": (pos(1), pos(n)),
        "block": (pos(m, kb), pos(nb, kb)),
    }[mode]


# --------------------------------------------------------------------------------------------
# fp8_quantize
# --------------------------------------------------------------------------------------------

# (M, K, mode, group_size, extra): extra = "zero" (a zero row / group), "given" (given scale),
# "sat" (a given scale too small: saturates), "" otherwise.
Q_CASES = [
    (1, 64, "token", 128, ""),
    (3, 136, "token", 128, "zero"),
    (17, 256, "token", 128, ""),
    (2, 8208, "token", 128, ""),      # K > 8192: the re-reading path of the per-token kernel
    (1, 128, "group", 128, ""),
    (17, 384, "group", 128, "zero"),
    (5, 96, "group", 32, ""),
    (3, 512, "group", 256, ""),
    (4, 64, "group", 8, ""),
    (1, 8, "tensor", 128, ""),
    (17, 264, "tensor", 128, ""),     # 3 CTAs in the reduction pass
    (100, 136, "tensor", 128, "given"),
    (3, 72, "tensor", 128, "sat"),
]


def _given_scale(x, extra):
    if extra == "given":
        return torch.tensor([x.float().abs().max().item() / 300.0], dtype=torch.float32)
    if extra == "sat":
        return torch.tensor([x.float().abs().max().item() / 2000.0], dtype=torch.float32)
    return None


@pytest.mark.parametrize(
    "bname,dtype,m,k,mode,gs,extra",
    backend_params({"cpu": Q_CASES, "sim": Q_CASES, "cuda": Q_CASES}),
)
def test_fp8_quantize(bname, dtype, m, k, mode, gs, extra):
    be = get_backend(bname)
    gen = make_gen(m * 1000 + k)
    zr = 1 if extra == "zero" and mode == "token" else None
    zg = (m - 1, gs, 2 * gs) if extra == "zero" and mode == "group" else None
    x = _x(m, k, dtype, gen, zero_row=zr, zero_group=zg)
    scale = _given_scale(x, extra)
    q_ref, s_ref = ref.fp8_quantize(x, mode, gs, scale)
    if extra == "sat":
        assert (q_ref.float().abs() == 448).any(), "test inputs do not saturate"

    def run():
        s_in = scale.to(be.device) if scale is not None else None
        return be.ns.fp8_quantize(x.to(be.device), mode, gs, s_in)

    q, s = be.run(run)
    assert q.dtype == E4M3 and s.dtype == F32
    assert_bits_equal(s.cpu(), s_ref, "scale")
    assert_bits_equal(q.cpu(), q_ref, "x_fp8")
    # the codes use the range: the largest |code| of each unit is ~448 (dynamic scales)
    if scale is None and x.numel():
        assert q.cpu().float().abs().max().item() >= 400


GIVEN_CASES = {
    "cpu": [(7, 64, "token"), (5, 256, "group"), (3, 136, "channel"), (1, 64, "channel")],
    "sim": [(3, 64, "token"), (2, 128, "group"), (3, 40, "channel")],
    "cuda": [(7, 64, "token"), (513, 4096, "group"), (300, 4096, "channel")],
}


@pytest.mark.parametrize("bname,dtype,m,k,mode", backend_params(GIVEN_CASES))
def test_fp8_quantize_given_scales(bname, dtype, m, k, mode):
    """Static scales per token [M], per group [M, K / 64] and per channel [K] (vLLM's static
    fp8 quantisation with a scale of that shape): codes e4m3(clamp(x / scale[unit])) bit for bit
    the reference, NaN and saturation included; the returned scale is the given one."""
    be = get_backend(bname)
    gen = make_gen(m * 7 + k)
    x = _x(m, k, dtype, gen)
    xa = x.float().abs()
    amax = {"token": lambda: xa.amax(1), "group": lambda: xa.view(m, k // 64, 64).amax(2),
            "channel": lambda: xa.amax(0)}[mode]()
    scale = amax / 448.0 * torch.exp(torch.randn(amax.shape, generator=gen) * 0.5)
    scale.view(-1)[0] *= 0.25  # the first unit saturates
    x[0, 1] = float("nan")
    q_ref, s_ref = ref.fp8_quantize(x, mode, 64, scale)
    q, s = be.run(lambda: be.ns.fp8_quantize(x.to(be.device), mode, 64, scale.to(be.device)))
    assert_bits_equal(s.cpu(), s_ref, "scale")
    assert_bits_equal(q.cpu(), q_ref, "x_fp8")
    assert q_ref.float().isnan()[0, 1] and (q_ref.float().abs() == 448).any()


def test_fp8_quantize_given_scales_reference_worked_example():
    """The reference per channel, worked by hand: x / scale[k] clamped to +-448 and rounded to e4m3
    (3 mantissa bits, ties to even): 5 / 2 = 2.5 (exact), 19 / 2 = 9.5 (a tie between 9 and 10,
    the spacing being 1 in [8, 16): the even mantissa, 10), 1000 -> 448, -3 -> -3."""
    x = torch.tensor([[5.0, 19.0, 1000.0, -3.0, 1.0, 1.0, 1.0, 1.0]])
    scale = torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    q, s = ref.fp8_quantize(x, "channel", 128, scale)
    assert q.float().tolist() == [[2.5, 10.0, 448.0, -3.0, 1.0, 1.0, 1.0, 1.0]] and torch.equal(s, scale)


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_fp8_quantize_roundtrip(bname):
    """Dequantised values are within half an e4m3 step of x (relative 2^-4) for every mode."""
    be = get_backend(bname)
    x = _x(5, 256, BF, make_gen(3))
    for mode in ("token", "group", "tensor"):
        q, s = be.run(lambda: be.ns.fp8_quantize(x, mode, 128, None))
        back = ref.fp8_dequantize(q, s, 128)
        xf = x.double()
        unit = {"token": xf.abs().amax(1, keepdim=True),
                "group": xf.view(5, 2, 128).abs().amax(2, keepdim=True).expand(5, 2, 128).reshape(5, 256),
                "tensor": xf.abs().max()}[mode]
        # e4m3 has 3 mantissa bits: error <= 2^-4 relative, or the subnormal step 2^-9 * scale
        bound = torch.maximum(xf.abs() * 2.0**-4, unit / 448 * 2.0**-9) * 1.0001
        assert ((back - xf).abs() <= bound).all(), mode


@pytest.mark.sim
def test_fp8_quantize_tensor_grid_stride():
    """Per-tensor amax over more vectors than the reduction pass has CTAs (512 x 256 threads x 8):
    the grid-stride loop must see the outlier placed in the last stretch."""
    be = get_backend("sim")
    x = _x(520, 2048, BF, make_gen(4)) * 0.01
    x[517, 1000] = 37.0
    q, s = be.run(lambda: be.ns.fp8_quantize(x, "tensor", 128, None))
    q_ref, s_ref = ref.fp8_quantize(x, "tensor")
    assert s_ref.item() == pytest.approx(37.0 / 448)
    assert_bits_equal(s, s_ref, "scale")
    assert_bits_equal(q, q_ref, "x_fp8")


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_empty_inputs(bname):
    """M = 0 and K = 0 are legal: empty outputs, amax-0 scales, and out = bias when K = 0."""
    be = get_backend(bname)
    q, s = be.ns.fp8_quantize(torch.empty(0, 64, dtype=BF), "token", 128, None)
    assert q.shape == (0, 64) and s.shape == (0,)
    q, s = be.ns.fp8_quantize(torch.empty(0, 64, dtype=BF), "tensor", 128, None)
    assert s.shape == (1,) and s.item() == pytest.approx(1e-12 / 448)
    for mode, shape in (("token", (3,)), ("group", (3, 0)), ("tensor", (1,))):
        q, s = be.ns.fp8_quantize(torch.empty(3, 0, dtype=BF), mode, 128, None)
        assert q.shape == (3, 0) and tuple(s.shape) == shape
        assert_bits_equal(s, ref.fp8_quantize(torch.empty(3, 0, dtype=BF), mode)[1], f"scale ({mode}, K = 0)")
    bias = torch.randn(32).to(BF)
    out = be.ns.fp8_scaled_mm(torch.empty(3, 0, dtype=E4M3), torch.empty(32, 0, dtype=E4M3), torch.ones(1),
                              torch.ones(1), BF, bias)
    assert_bits_equal(out, bias.expand(3, 32), "K = 0: out = bias")
    out = be.ns.fp8_scaled_mm(torch.empty(0, 64, dtype=E4M3), _e(32, 64), torch.ones(1), torch.ones(1), BF, None)
    assert out.shape == (0, 32)


# --------------------------------------------------------------------------------------------
# fp8_scaled_mm
# --------------------------------------------------------------------------------------------

# (M, N, K, scale mode, bias). Kernel configs: M <= 16 small (16 x 64 tiles), <= 64 medium
# (64 x 128), else large (128 x 128); k-tile 128.
MM_CASES = [
    (1, 64, 128, "tt", False),
    (3, 48, 272, "tc", True),          # N tail in a 64-wide tile, K tail (272 = 2 * 128 + 16)
    (3, 192, 384, "block", True),      # small config, blockwise, CTA n0 = 128 -> second b block row
    (17, 144, 256, "block", True),     # medium, N tail, 2 b block rows
    (17, 32, 16, "tc", False),         # the minimum K
    (64, 128, 160, "tokT", False),
    (100, 80, 384, "tensC", True),     # large, M tail
    (100, 144, 272, "block", False),   # large blockwise, M / N / K tails
]
MM_DTYPES = {"cpu": (BF, HF, F32), "sim": (BF, HF), "cuda": (BF, HF)}


def _mm_inputs(m, n, k, mode, bias, out_dtype, seed):
    gen = make_gen(seed)
    a, b = _fp8(m, k, gen), _fp8(n, k, gen)
    sa, sb = _scales(mode, m, n, k, gen)
    bv = (torch.randn(n, generator=gen) * 4).to(out_dtype) if bias else None
    return a, b, sa, sb, bv


def _naive(a, b, sa, sb, bias, out_dtype):
    """fp32 dequantise + fp32 matmul + fp32 bias, one rounding to out_dtype (independent of the impls)."""
    m, k = a.shape
    n = b.shape[0]
    af, bf = a.float(), b.float()
    if sa.dim() == 2:
        af = af * sa.repeat_interleave(128, 1)[:, :k]
        bf = bf * sb.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    else:
        af = af * sa.reshape(-1, 1)
        bf = bf * sb.reshape(-1, 1)
    out = af @ bf.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@pytest.mark.parametrize(
    "bname,dtype,m,n,k,mode,bias",
    backend_params({"cpu": MM_CASES, "sim": MM_CASES, "cuda": MM_CASES}, dtypes=MM_DTYPES),
)
def test_fp8_scaled_mm(bname, dtype, m, n, k, mode, bias):
    be = get_backend(bname)
    a, b, sa, sb, bv = _mm_inputs(m, n, k, mode, bias, dtype, seed=m * 7919 + n * 31 + k)
    expect = ref.fp8_scaled_mm(a, b, sa, sb, dtype, bv)
    naive = _naive(a, b, sa, sb, bv, dtype)
    d = be.device

    def run():
        return be.ns.fp8_scaled_mm(a.to(d), b.to(d), sa.to(d), sb.to(d), dtype, bv.to(d) if bv is not None else None)

    out = be.run(run)
    assert out.dtype == dtype and out.shape == (m, n)
    floor = 1e-5 * expect.abs().max().item()  # fp32 summation-order noise (matters for float32 out only)
    assert_fa_close(out, expect, naive, floor=floor, name=f"fp8_scaled_mm[{mode}]")


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_quantize_then_mm(bname):
    """The W8A8 path end to end: per-token x per-channel and blockwise scales from fp8_quantize
    approximate the bf16 matmul (fp8 has ~2^-4 relative precision per element)."""
    be = get_backend(bname)
    gen = make_gen(11)
    x = (torch.randn(17, 256, generator=gen)).to(BF)
    w = (torch.randn(128, 256, generator=gen) * 0.05).to(BF)
    exact = x.double() @ w.double().t()
    qx, sx = be.run(lambda: be.ns.fp8_quantize(x, "token", 128, None))
    qw, sw = be.run(lambda: be.ns.fp8_quantize(w, "token", 128, None))
    out = be.run(lambda: be.ns.fp8_scaled_mm(qx, qw, sx, sw, BF, None))
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert rel < 0.06, rel
    gx, gsx = be.run(lambda: be.ns.fp8_quantize(x, "group", 128, None))
    qw_t, sw_t = ref.fp8_quantize(w, "tensor")  # per-tensor weight scale broadcast to [1, 2] blocks
    out_b = be.run(lambda: be.ns.fp8_scaled_mm(gx, qw_t, gsx, sw_t.reshape(1, 1).expand(1, 2).contiguous(), BF, None))
    rel_b = ((out_b.double() - exact).norm() / exact.norm()).item()
    assert rel_b < 0.06, rel_b


def test_fp8_scaled_mm_wrapper():
    import fastinfer.ops as fo

    get_backend("cpu")
    a, b, sa, sb, bv = _mm_inputs(3, 32, 64, "tc", True, BF, seed=5)
    assert torch.equal(fo.fp8_scaled_mm(a, b, sa, sb, BF, bv), torch.ops.fastinfer.fp8_scaled_mm(a, b, sa, sb, BF, bv))
    x = _x(3, 64, BF, make_gen(1))
    for got, want in zip(fo.fp8_quantize(x, "group", 32), torch.ops.fastinfer.fp8_quantize(x, "group", 32, None)):
        assert_bits_equal(got, want, "fp8_quantize wrapper")


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------


def _opcheck_cases():
    gen = make_gen(21)
    x = _x(5, 256, BF, gen)
    a, b, sa, sb, bv = _mm_inputs(5, 48, 256, "tc", True, BF, seed=22)
    a2, b2, sa2, sb2, _ = _mm_inputs(5, 48, 256, "block", False, BF, seed=23)
    return [
        ("fp8_quantize", (x, "token", 128, None)),
        ("fp8_quantize", (x, "group", 64, None)),
        ("fp8_quantize", (x, "tensor", 128, None)),
        ("fp8_quantize", (x, "tensor", 128, torch.tensor([0.01]))),
        ("fp8_scaled_mm", (a, b, sa, sb, BF, bv)),
        ("fp8_scaled_mm", (a2, b2, sa2, sb2, HF, None)),
    ]


@pytest.mark.parametrize(
    "bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim), pytest.param("cuda", marks=pytest.mark.cuda)]
)
@pytest.mark.parametrize("idx", range(6))
def test_opcheck(bname, idx):
    be = get_backend(bname)
    name, args = _opcheck_cases()[idx]
    args = tuple(t.to(be.device) if isinstance(t, torch.Tensor) else t for t in args)
    # test_schema compares outputs with arithmetic that has no fp8 kernels on CPU: skip it for fp8 outputs
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(getattr(be.ns, name).default, args, test_utils=utils)


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def _e(r, c):
    return torch.randn(r, c).clamp(-448, 448).to(E4M3)


def _f(*s):
    return torch.rand(*s) + 0.5


def _mm(a=None, b=None, sa=None, sb=None, out=BF, bias=None):
    return (_e(4, 64) if a is None else a, _e(32, 64) if b is None else b, _f(1) if sa is None else sa,
            _f(1) if sb is None else sb, out, bias)


BAD_QUANT = [
    ("x_dtype", lambda: (torch.randn(4, 64, dtype=torch.float64), "token", 128, None), r"\bx\b.*dtype"),
    ("x_int", lambda: (torch.ones(4, 64, dtype=torch.int32), "token", 128, None), r"\bx\b.*dtype"),
    ("x_3d", lambda: (torch.randn(2, 4, 64, dtype=BF), "token", 128, None), r"\bx\b.*2-D"),
    ("x_k", lambda: (torch.randn(4, 60, dtype=BF), "token", 128, None), r"\bx\b.*multiple of 8"),
    ("mode", lambda: (torch.randn(4, 64, dtype=BF), "row", 128, None), r"\bmode\b"),
    ("channel_no_scale", lambda: (torch.randn(4, 64, dtype=BF), "channel", 128, None), r"mode='channel' needs a given scale"),
    ("scale_channel_shape", lambda: (torch.randn(4, 64, dtype=BF), "channel", 128, _f(4)), r"\bscale\b.*\[K\] = \[64\]"),
    ("scale_group_shape", lambda: (torch.randn(4, 64, dtype=BF), "group", 32, _f(4, 3)), r"\bscale\b.*\[M, K / group_size\] = \[4, 2\]"),
    ("scale_token_2d", lambda: (torch.randn(4, 64, dtype=BF), "token", 128, _f(4, 1)), r"\bscale\b.*\[M\] = \[4\]"),
    ("scale_token_dtype", lambda: (torch.randn(4, 64, dtype=BF), "token", 128, _f(4).half()), r"\bscale\b.*float32"),
    ("group_k", lambda: (torch.randn(4, 192, dtype=BF), "group", 128, None), r"\bx\b.*group_size"),
    ("group_size", lambda: (torch.randn(4, 192, dtype=BF), "group", 96, None), r"\bgroup_size\b"),
    ("group_size_big", lambda: (torch.randn(4, 512, dtype=BF), "group", 512, None), r"\bgroup_size\b"),
    ("scale_token", lambda: (torch.randn(4, 64, dtype=BF), "token", 128, _f(1)), r"\bscale\b.*\[M\] = \[4\]"),
    ("scale_dtype", lambda: (torch.randn(4, 64, dtype=BF), "tensor", 128, _f(1).double()), r"\bscale\b.*float32"),
    ("scale_numel", lambda: (torch.randn(4, 64, dtype=BF), "tensor", 128, _f(2)), r"\bscale\b.*1 element"),
    ("x_noncontig", lambda: (torch.randn(64, 4, dtype=BF).t(), "token", 128, None), r"\bx\b.*contiguous"),
]

BAD_MM = [
    ("a_dtype", lambda: _mm(a=torch.randn(4, 64, dtype=BF)), r"\ba\b.*dtype"),
    ("b_dtype", lambda: _mm(b=torch.randn(32, 64).to(torch.float8_e5m2)), r"\bb\b.*dtype"),
    ("a_1d", lambda: _mm(a=_e(1, 64)[0]), r"\ba\b.*2-D"),
    ("k_mismatch", lambda: _mm(b=_e(32, 80)), r"\bb\b.*\[N, K\]"),
    ("k_16", lambda: _mm(a=_e(4, 40), b=_e(32, 40)), r"\ba\b.*multiple of 16"),
    ("n_16", lambda: _mm(b=_e(40, 64)), r"\bb\b.*multiple of 16"),
    ("out_dtype", lambda: _mm(out=torch.float64), r"\bout_dtype\b"),
    ("out_int", lambda: _mm(out=torch.int8), r"\bout_dtype\b"),
    ("sa_dtype", lambda: _mm(sa=_f(1).to(BF)), r"\bscale_a\b.*float32"),
    ("sa_shape", lambda: _mm(sa=_f(3)), r"\bscale_a\b.*shape"),
    ("sb_shape", lambda: _mm(sb=_f(7)), r"\bscale_b\b.*shape"),
    ("sb_2d_with_sa_1d", lambda: _mm(sb=_f(1, 1)), r"\bscale_b\b.*shape"),
    ("block_sa", lambda: _mm(sa=_f(4, 2), sb=_f(1, 1)), r"\bscale_a\b.*ceil"),
    ("block_sb", lambda: _mm(sa=_f(4, 1), sb=_f(2, 1)), r"\bscale_b\b.*ceil"),
    ("bias_dtype", lambda: _mm(bias=torch.randn(32, dtype=HF)), r"\bbias\b.*dtype"),
    ("bias_shape", lambda: _mm(bias=torch.randn(16, dtype=BF)), r"\bbias\b.*shape"),
    ("a_noncontig", lambda: _mm(a=_e(64, 4).t()), r"\ba\b.*contiguous"),
    ("b_transposed", lambda: _mm(b=_e(64, 32).t()), r"\bb\b.*row-major"),
    ("sa_noncontig", lambda: _mm(sa=_f(4, 2)[:, 0], sb=_f(32)), r"\bscale_a\b.*contiguous"),
]


def _bad_params():
    out = []
    for ns in ("fastinfer", "fastinfer_sim"):
        marks = [pytest.mark.sim] if ns == "fastinfer_sim" else []
        for op, cases in (("fp8_quantize", BAD_QUANT), ("fp8_scaled_mm", BAD_MM)):
            for case, make, rx in cases:
                out.append(pytest.param(ns, op, make, rx, marks=marks, id=f"{ns}-{op}-{case}"))
    return out


@pytest.mark.parametrize("ns_name,op,make_args,arg_re", _bad_params())
def test_bad_input(ns_name, op, make_args, arg_re):
    be = get_backend("sim" if ns_name == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        getattr(be.ns, op)(*make_args())
    assert f"{ns_name}.{op}:" in str(exc.value), str(exc.value)


def test_fp32_only_on_cpu():
    """float32 activations / outputs are CPU-only; the kernel namespaces take bf16/fp16."""
    cpu = get_backend("cpu")
    q, s = cpu.ns.fp8_quantize(torch.randn(2, 64), "token", 128, None)
    assert q.dtype == E4M3
    assert cpu.ns.fp8_scaled_mm(*_mm(out=F32)).dtype == F32
    sim = get_backend("sim")
    with pytest.raises(RuntimeError, match=r"\bx\b.*dtype"):
        sim.ns.fp8_quantize(torch.randn(2, 64), "token", 128, None)
    with pytest.raises(RuntimeError, match=r"\bout_dtype\b"):
        sim.ns.fp8_scaled_mm(*_mm(out=F32))


@pytest.mark.cuda
def test_bad_device_cuda():
    be = get_backend("cuda")
    a, b, sa, sb, out, _ = _mm()
    with pytest.raises(RuntimeError, match=r"\bb\b"):
        be.ns.fp8_scaled_mm(a.cuda(), b, sa.cuda(), sb.cuda(), out, None)
    with pytest.raises(RuntimeError, match=r"\bscale\b"):
        be.ns.fp8_quantize(torch.randn(2, 64, dtype=BF, device="cuda"), "tensor", 128, _f(1))
