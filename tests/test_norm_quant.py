"""rms_norm_quant and fused_add_rms_norm_quant: RMSNorm fused with the e4m3 / int8 activation
quantisation of the W8A8 GEMMs.

The contract is the unfused pair composed: rms_norm (or fused_add_rms_norm) rounded to x's dtype,
then fp8_quantize / int8_quantize (symmetric) per token or per tensor with a given scale, bit for bit
on each backend (``cpu``; ``sim``: the CUDA kernel in the emulator under two schedule seeds). Also
against the fp64 oracle, the quantisers' NaN rule, opcheck, the fake impls and bad input.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, backend_params, get_backend, make_gen, raw_bits, randn

import fastinfer.reference as ref_ops

E4M3, I8 = torch.float8_e4m3fn, torch.int8
EPS = 1e-5


def _scale_for(out_dtype):
    """A static per-tensor scale that saturates a few of the codes (|norm| reaches ~4)."""
    return torch.tensor([3.0 / 448.0 if out_dtype == E4M3 else 3.0 / 127.0], dtype=torch.float32)


def _inputs(shape, dtype, device, row_pad=0, seed=3):
    """x (rows row_pad elements wider than H when row_pad > 0: a column slice), residual, weight."""
    gen = make_gen(seed)
    rows, h = shape
    buf = randn((rows, h + row_pad), dtype, device, gen, scale=1.5)
    res = randn((rows, h), dtype, device, gen)
    w = randn((h,), dtype, device, gen, scale=0.3, offset=1.0)
    return buf, res, w


def _view(buf, h):
    return buf[:, :h]


def unfused(ns, buf, h, residual, weight, out_dtype, scale):
    """The composition the fused op must equal: the norm (in place on a copy of x's buffer for the
    residual form, so the layout is x's), then the quantiser with the same mode."""
    if residual is None:
        normed = ns.rms_norm(_view(buf, h), weight, EPS)
    else:
        normed = _view(buf.clone(), h)
        ns.fused_add_rms_norm(normed, residual, weight, EPS)
    normed = normed.reshape(-1, h).contiguous()  # the quantisers read 16-byte-aligned rows
    mode = "token" if scale is None else "tensor"
    if out_dtype == E4M3:
        return ns.fp8_quantize(normed, mode, 128, scale)
    q, s, _ = ns.int8_quantize(normed, mode, scale, True, None)
    return q, s


def fused(ns, buf, h, residual, weight, out_dtype, scale):
    x = _view(buf, h)
    if residual is None:
        return ns.rms_norm_quant(x, weight, EPS, out_dtype, scale)
    return ns.fused_add_rms_norm_quant(x, residual, weight, EPS, out_dtype, scale)


def _shapes(cases):
    """backend_params cases of one argument each (a shape is itself a tuple)."""
    return {k: [(shape,) for shape in v] for k, v in cases.items()}


def _check_composition(be, dtype, shape, out_dtype, static, add, weightless, row_pad=0):
    buf, res, w = _inputs(shape, dtype, be.device, row_pad)
    weight = None if weightless else w
    scale = _scale_for(out_dtype).to(be.device) if static else None
    h = shape[-1]

    def run(fn):
        def call():
            b, r = buf.clone(), res.clone() if add else None
            q, s = fn(be.ns, b, h, r, weight, out_dtype, scale)
            assert torch.equal(raw_bits(b), raw_bits(buf)) or not add or fn is unfused, "x must not be modified"
            return (q, s) + ((r,) if add else ())
        return be.run(call)

    got = run(fused)
    want = run(unfused)
    assert got[0].dtype == out_dtype and got[0].shape == shape
    assert got[1].shape == ((1,) if static else (shape[0],)) and got[1].dtype == torch.float32
    assert_bits_equal(got[0].cpu(), want[0].cpu().reshape(shape), "codes")
    assert_bits_equal(got[1].cpu(), want[1].cpu(), "scale")
    if add:
        assert_bits_equal(got[2].cpu(), want[2].cpu(), "residual")
    # fused_add_rms_norm_quant leaves x alone
    if add:
        b = buf.clone()
        fused(be.ns, b, h, res.clone(), weight, out_dtype, scale)
        assert torch.equal(raw_bits(b), raw_bits(buf)), "fused_add_rms_norm_quant must not write x"
    return got


COMPOSE_CASES = {
    # hidden not a multiple of 64; 1 and 37 rows
    "cpu": [(1, 40), (37, 200), (5, 4104)],
    "sim": [(1, 40), (37, 200)],
    "cuda": [(1, 40), (37, 200), (5, 4104), (300, 8192), (17, 16384), (3, 40000)],
}


@pytest.mark.parametrize("weightless", [False, True], ids=["w", "noweight"])
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add"])
@pytest.mark.parametrize("static", [False, True], ids=["token", "static"])
@pytest.mark.parametrize("out_dtype", [E4M3, I8], ids=["e4m3", "int8"])
@pytest.mark.parametrize("bname,dtype,shape", backend_params(_shapes(COMPOSE_CASES)))
def test_matches_unfused_pair(bname, dtype, shape, out_dtype, static, add, weightless):
    _check_composition(get_backend(bname), dtype, shape, out_dtype, static, add, weightless)


# strided rows: a pad of 8 keeps the 16-byte vectors, a pad of 1 takes the one-element path (both
# in the fused and the unfused kernels); 4104 one-element vectors per row are more than the
# registers hold (4 per thread of 1024), so the fused kernel re-reads the row.
STRIDED_CASES = {
    "cpu": [((37, 200), 8), ((37, 200), 1)],
    "sim": [((37, 200), 8), ((37, 200), 1), ((2, 4104), 1)],
    "cuda": [((37, 200), 8), ((37, 200), 1), ((64, 4104), 1), ((64, 4096), 8)],
}


@pytest.mark.parametrize("add", [False, True], ids=["norm", "add"])
@pytest.mark.parametrize("out_dtype", [E4M3, I8], ids=["e4m3", "int8"])
@pytest.mark.parametrize("bname,dtype,shape,row_pad", backend_params(STRIDED_CASES))
def test_strided_rows(bname, dtype, shape, row_pad, out_dtype, add):
    _check_composition(get_backend(bname), dtype, shape, out_dtype, False, add, False, row_pad)


REF_CASES = {"cpu": [(37, 200), (3, 37), (2, 5, 24)], "sim": [(37, 200), (3, 37)], "cuda": [(300, 8192), (3, 37)]}


@pytest.mark.parametrize("static", [False, True], ids=["token", "static"])
@pytest.mark.parametrize("out_dtype", [E4M3, I8], ids=["e4m3", "int8"])
@pytest.mark.parametrize("bname,dtype,shape", backend_params(_shapes(REF_CASES)))
def test_against_reference(bname, dtype, shape, out_dtype, static):
    """Against the fp64 oracle (norm rounded to x's dtype, then the quantiser's reference): any
    rank, any hidden (37: no 16-byte vectors). The rounded norm may differ from the oracle's by one
    ulp of x's dtype where the fp32 product lies at a rounding boundary, so a few codes may differ
    by one step."""
    be = get_backend(bname)
    gen = make_gen(5)
    x = randn(shape, dtype, be.device, gen, scale=1.5)
    w = randn((shape[-1],), dtype, be.device, gen, scale=0.3, offset=1.0)
    scale = _scale_for(out_dtype).to(be.device) if static else None
    q, s = be.run(lambda: be.ns.rms_norm_quant(x, w, EPS, out_dtype, scale))
    q_ref, s_ref = ref_ops.rms_norm_quant(x.cpu(), w.cpu(), EPS, out_dtype, scale.cpu() if static else None)
    assert q.shape == x.shape and q.dtype == out_dtype
    rows = x.numel() // shape[-1]
    assert s.shape == ((1,) if static else (rows,))
    torch.testing.assert_close(s.cpu(), s_ref, rtol=2 ** -7, atol=0)
    deq = q.cpu().float().reshape(rows, -1).double() * s.cpu().double().reshape(-1, 1)
    deq_ref = q_ref.float().reshape(rows, -1).double() * s_ref.double().reshape(-1, 1)
    rel = ((deq - deq_ref).norm() / deq_ref.norm()).item()
    assert rel < 1e-2, rel
    same = (raw_bits(q.cpu()) == raw_bits(q_ref)).double().mean().item()
    assert same > 0.98, same
    # the norm itself is recovered to the code's precision (e4m3: 3 mantissa bits; int8: 1/127 of amax)
    normed = ref_ops.rms_norm(x.cpu(), w.cpu(), EPS).reshape(rows, -1)
    tol = 0.07 if out_dtype == E4M3 else 0.02
    if static:
        normed = normed.clamp(-s_ref.item() * (448 if out_dtype == E4M3 else 127),
                              s_ref.item() * (448 if out_dtype == E4M3 else 127))
    assert ((deq - normed).norm() / normed.norm()).item() < tol


@pytest.mark.parametrize("add", [False, True], ids=["norm", "add"])
@pytest.mark.parametrize("out_dtype", [E4M3, I8], ids=["e4m3", "int8"])
@pytest.mark.parametrize("bname,dtype", backend_params({"cpu": [()], "sim": [()], "cuda": [()]}))
def test_nan_row(bname, dtype, out_dtype, add):
    """The quantisers' non-finite rule (tests/test_nonfinite.py): a NaN in a row makes that row's
    dynamic scale NaN and its codes NaN (e4m3) or 0 (int8); the other rows are untouched by it."""
    be = get_backend(bname)
    shape, bad = (37, 200), 11
    buf, res, w = _inputs(shape, dtype, be.device)
    buf[bad, 17] = float("nan")
    got = _check_composition_with(be, buf, res if add else None, w, out_dtype)
    q, s = got
    assert torch.isnan(s.cpu()[bad]) and torch.isfinite(s.cpu()[torch.arange(37) != bad]).all()
    codes = q.cpu()[bad]
    if out_dtype == E4M3:
        assert torch.isnan(codes.float()).all()
    else:
        assert (codes == 0).all()
    assert not torch.isnan(q.cpu()[bad + 1].float()).any()


def _check_composition_with(be, buf, res, w, out_dtype):
    h = buf.shape[1]

    def call(fn):
        return lambda: fn(be.ns, buf.clone(), h, res.clone() if res is not None else None, w, out_dtype, None)

    got = be.run(call(fused))
    want = be.run(call(unfused))
    assert_bits_equal(got[0].cpu(), want[0].cpu(), "codes")
    assert_bits_equal(got[1].cpu(), want[1].cpu(), "scale")
    return got


# ---- opcheck, fake impls, wrappers -----------------------------------------------------------


def _op_args(dtype, out_dtype, static, add):
    gen = make_gen(9)
    x = randn((5, 96), dtype, "cpu", gen)
    w = randn((96,), dtype, "cpu", gen, offset=1.0)
    scale = _scale_for(out_dtype) if static else None
    if add:
        return "fused_add_rms_norm_quant", (x, randn((5, 96), dtype, "cpu", gen), w, 1e-6, out_dtype, scale, 0.0)
    return "rms_norm_quant", (x, w, 1e-6, out_dtype, scale, 0.0)


@pytest.mark.parametrize("add", [False, True], ids=["norm", "add"])
@pytest.mark.parametrize("static", [False, True], ids=["token", "static"])
@pytest.mark.parametrize("out_dtype", [E4M3, I8], ids=["e4m3", "int8"])
@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_opcheck(bname, out_dtype, static, add):
    be = get_backend(bname)
    name, args = _op_args(torch.bfloat16, out_dtype, static, add)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if out_dtype == E4M3:  # test_schema compares values with arithmetic that has no fp8 kernels on CPU
        utils = utils[1:]
    torch.library.opcheck(getattr(be.ns, name).default, args, test_utils=utils)


@pytest.mark.parametrize("static", [False, True], ids=["token", "static"])
def test_fake_shapes(static):
    """The fake impls on meta tensors: codes shaped like x, scale [rows] or [1], any rank."""
    get_backend("cpu")
    x = torch.empty(2, 3, 40, dtype=torch.bfloat16, device="meta")
    w = torch.empty(40, dtype=torch.bfloat16, device="meta")
    scale = torch.empty(1, device="meta") if static else None
    for out_dtype in (E4M3, I8):
        q, s = torch.ops.fastinfer.rms_norm_quant(x, w, 1e-6, out_dtype, scale)
        assert q.shape == x.shape and q.dtype == out_dtype and q.device.type == "meta"
        assert s.shape == ((1,) if static else (6,)) and s.dtype == torch.float32
        q, s = torch.ops.fastinfer.fused_add_rms_norm_quant(x, torch.empty_like(x), w, 1e-6, out_dtype, scale)
        assert q.shape == x.shape and s.shape == ((1,) if static else (6,))


def test_wrappers_match_ops():
    import fastinfer.ops as fo

    get_backend("cpu")
    buf, res, w = _inputs((7, 64), torch.float32, "cpu")
    for out_dtype in (E4M3, I8):
        for scale in (None, _scale_for(out_dtype)):
            a = fo.rms_norm_quant(buf, w, 1e-6, out_dtype, scale)
            b = torch.ops.fastinfer.rms_norm_quant(buf, w, 1e-6, out_dtype, scale, 0.0)
            assert all(torch.equal(raw_bits(u), raw_bits(v)) for u, v in zip(a, b))
            r1, r2 = res.clone(), res.clone()
            a = fo.fused_add_rms_norm_quant(buf, r1, w, 1e-6, out_dtype, scale)
            b = torch.ops.fastinfer.fused_add_rms_norm_quant(buf, r2, w, 1e-6, out_dtype, scale, 0.0)
            assert all(torch.equal(raw_bits(u), raw_bits(v)) for u, v in zip(a, b)) and torch.equal(r1, r2)
    # weight_offset reaches the op: 1 + w in fp32 equals a weight of 1 + w when that is exact
    w0 = torch.full((64,), 0.5)
    a = fo.rms_norm_quant(buf, w0, 1e-6, E4M3, weight_offset=1.0)
    b = fo.rms_norm_quant(buf, w0 + 1.0, 1e-6, E4M3)
    assert torch.equal(raw_bits(a[0]), raw_bits(b[0]))


# ---- bad input ----------------------------------------------------------------------------------

BF = torch.bfloat16


def _r(*shape, dtype=BF):
    return torch.randn(*shape).to(dtype)


def _w(n=64, dtype=BF):
    return (torch.rand(n) + 0.5).to(dtype)


BAD_CASES = [
    ("rms_norm_quant", "dtype-x", lambda: (_r(5, 64, dtype=torch.float64), _w(dtype=torch.float64), 1e-6, E4M3), r"\bx\b"),
    ("rms_norm_quant", "dtype-x-int", lambda: (torch.ones(5, 64, dtype=torch.int32), _w(), 1e-6, E4M3), r"\bx\b"),
    ("rms_norm_quant", "out_dtype", lambda: (_r(5, 64), _w(), 1e-6, BF), r"\bout_dtype\b"),
    ("rms_norm_quant", "out_dtype-uint8", lambda: (_r(5, 64), _w(), 1e-6, torch.uint8), r"\bout_dtype\b"),
    ("rms_norm_quant", "shape-weight", lambda: (_r(5, 64), _w(65), 1e-6, E4M3), r"\bweight\b"),
    ("rms_norm_quant", "dtype-weight", lambda: (_r(5, 64), _w(dtype=torch.float16), 1e-6, E4M3), r"\bweight\b"),
    ("rms_norm_quant", "rank-x", lambda: (torch.tensor(1.0, dtype=BF), _w(1), 1e-6, E4M3), r"\bx\b"),
    ("rms_norm_quant", "hidden-0", lambda: (_r(5, 0), None, 1e-6, E4M3), r"\bx\b"),
    ("rms_norm_quant", "noncontig-x", lambda: (_r(64, 5).t(), _w(), 1e-6, E4M3), r"\bx\b"),
    ("rms_norm_quant", "scale-dtype", lambda: (_r(5, 64), _w(), 1e-6, E4M3, torch.tensor([0.1], dtype=torch.float64)),
     r"\bscale\b"),
    ("rms_norm_quant", "scale-shape", lambda: (_r(5, 64), _w(), 1e-6, I8, torch.tensor([0.1, 0.2])), r"\bscale\b"),
    ("rms_norm_quant", "scale-device", lambda: (_r(5, 64), _w(), 1e-6, I8, torch.empty(1, device="meta")),
     r"\bscale\b|device"),
    ("rms_norm_quant", "eps", lambda: (_r(5, 64), _w(), float("nan"), E4M3), r"\beps\b"),
    ("rms_norm_quant", "offset-noweight", lambda: (_r(5, 64), None, 1e-6, E4M3, None, 1.0), r"\bweight_offset\b"),
    ("fused_add_rms_norm_quant", "shape-residual", lambda: (_r(5, 64), _r(4, 64), _w(), 1e-6, E4M3), r"\bresidual\b"),
    ("fused_add_rms_norm_quant", "dtype-residual", lambda: (_r(5, 64), _r(5, 64, dtype=torch.float16), _w(), 1e-6, I8),
     r"\bresidual\b"),
    ("fused_add_rms_norm_quant", "noncontig-residual", lambda: (_r(5, 64), _r(64, 5).t(), _w(), 1e-6, I8),
     r"\bresidual\b"),
    ("fused_add_rms_norm_quant", "out_dtype", lambda: (_r(5, 64), _r(5, 64), _w(), 1e-6, torch.float32),
     r"\bout_dtype\b"),
]


@pytest.mark.parametrize("ns_name", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("op,case,make_args,arg_re", BAD_CASES, ids=[f"{c[0]}-{c[1]}" for c in BAD_CASES])
def test_bad_input(ns_name, op, case, make_args, arg_re):
    be = get_backend("sim" if ns_name == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        getattr(be.ns, op)(*make_args())
    msg = str(exc.value)
    assert f"{ns_name}.{op}:" in msg or "device" in msg, msg


def test_fp32_rejected_by_sim():
    be = get_backend("sim")
    with pytest.raises(RuntimeError, match=r"\bx\b"):
        be.ns.rms_norm_quant(torch.randn(2, 64), torch.ones(64), 1e-6, E4M3)


def test_empty_rows():
    """No rows: empty codes; per token an empty scale, per tensor the given scale's copy."""
    for bname in ("cpu", "sim"):
        be = get_backend(bname)
        x = torch.empty(0, 64, dtype=BF)
        q, s = be.ns.rms_norm_quant(x, _w(), 1e-6, E4M3)
        assert q.shape == (0, 64) and s.shape == (0,)
        q, s = be.ns.rms_norm_quant(x, _w(), 1e-6, I8, torch.tensor([0.25]))
        assert q.shape == (0, 64) and s.tolist() == [0.25]


@pytest.mark.cuda
def test_bad_device_cuda():
    """CUDA x with a CPU residual, weight or scale: RuntimeError naming the CPU argument."""
    be = get_backend("cuda")
    x = _r(5, 64).cuda()
    with pytest.raises(RuntimeError, match=r"\bresidual\b"):
        be.ns.fused_add_rms_norm_quant(x, _r(5, 64), _w().cuda(), 1e-6, E4M3)
    with pytest.raises(RuntimeError, match=r"\bweight\b"):
        be.ns.rms_norm_quant(x, _w(), 1e-6, I8)
    with pytest.raises(RuntimeError, match=r"\bscale\b"):
        be.ns.rms_norm_quant(x, _w().cuda(), 1e-6, E4M3, torch.tensor([0.5]))
