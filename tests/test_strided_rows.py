"""Strided rows: the norms, the activations and the quantisers read a tensor whose last dim is
contiguous and whose rows lie further apart than their length (a column slice of a fused qkv or
gate/up output, vLLM's ``*_strided_input`` cases) in place, and write ``out=`` / in-place arguments
the same way; returned outputs are contiguous.

Every case runs the op on the slice and on a contiguous copy of it: the CPU impl (and the sim
kernels where the stride keeps the 16-byte vector path) must agree bit for bit, the columns of the
buffer outside the slice must be untouched, and the result must meet the fp64 oracle. Row strides
that are not a multiple of the vector width take the kernels' one-element path (norms,
activations) or are refused by name (quantisers, which read 16-byte vectors only).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bits_equal, assert_fa_close, get_backend, make_gen, poison_, raw_bits

import fastinfer.reference as ref_ops

BF, HF, F32 = torch.bfloat16, torch.float16, torch.float32

# (backend, dtype, rows, width, pad): x = buffer[:, :width] of buffer [rows, width + pad]; a pad
# that is not a multiple of 8 gives a row stride off the kernels' vector width.
CASES = [
    pytest.param("cpu", F32, 7, 96, 32, id="cpu-f32-7x96+32"),
    pytest.param("cpu", BF, 5, 66, 3, id="cpu-bf16-5x66+3"),
    pytest.param("cpu", HF, 3, 4096, 1024, id="cpu-f16-3x4096+1024"),
    pytest.param("sim", BF, 3, 64, 64, id="sim-bf16-3x64+64", marks=pytest.mark.sim),
    pytest.param("sim", HF, 3, 48, 5, id="sim-f16-3x48+5", marks=pytest.mark.sim),
    pytest.param("cuda", BF, 513, 4096, 1024, id="cuda-bf16-513x4096+1024", marks=pytest.mark.cuda),
    pytest.param("cuda", HF, 7, 96, 3, id="cuda-f16-7x96+3", marks=pytest.mark.cuda),
]


def _buffer(rows, cols, dtype, device, seed):
    g = make_gen(seed)
    return (torch.randn(rows, cols, generator=g) * 2).to(dtype).to(device)


def _vector_path(be, dtype, stride):
    """Whether the kernels take the same path for the slice as for a contiguous copy."""
    return be.name == "cpu" or stride % (16 // torch.tensor([], dtype=dtype).element_size()) == 0


def _check(be, got, expect_contig, ref, naive, stride, name):
    if _vector_path(be, got.dtype, stride):
        assert_bits_equal(got.cpu(), expect_contig.cpu(), f"{name}: strided vs contiguous")
    assert_fa_close(got, ref, naive, name=name)


@pytest.mark.parametrize("bname,dtype,rows,width,pad", CASES)
def test_rms_norm_strided(bname, dtype, rows, width, pad):
    be = get_backend(bname)
    buf = _buffer(rows, width + pad, dtype, be.device, 1)
    w = (torch.rand(width, generator=make_gen(2)) + 0.5).to(dtype).to(be.device)
    x = buf[:, :width]
    assert not x.is_contiguous()
    eps = 1e-6
    stride = width + pad

    out = be.run(lambda: be.ns.rms_norm(x, w, eps))
    assert out.is_contiguous()
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    _check(be, out, be.ns.rms_norm(x.contiguous(), w, eps), ref_ops.rms_norm(x.cpu(), w.cpu(), eps), naive, stride,
           "rms_norm")

    # out= into a strided slice of another buffer: the columns beside it stay as they were
    def run_out():
        dst = poison_(torch.empty(rows, width + pad, dtype=dtype, device=be.device))
        be.ns.rms_norm_out(dst[:, :width], x, w, eps)
        return dst

    dst = be.run(run_out)
    assert_bits_equal(dst[:, :width].cpu(), out.cpu(), "rms_norm_out strided")
    assert torch.isnan(dst[:, width:].float()).all(), "rms_norm_out wrote outside its slice"

    # fused_add_rms_norm: x and residual both slices of wider buffers, updated in place
    res_buf = _buffer(rows, width + pad, dtype, be.device, 3)

    def run_fused():
        xb, rb = buf.clone(), res_buf.clone()
        be.ns.fused_add_rms_norm(xb[:, :width], rb[:, :width], w, eps)
        return xb, rb

    xb, rb = be.run(run_fused)
    assert_bits_equal(xb[:, width:].cpu(), buf[:, width:].cpu(), "x outside the slice")
    assert_bits_equal(rb[:, width:].cpu(), res_buf[:, width:].cpu(), "residual outside the slice")
    x_ref, res_ref = ref_ops.fused_add_rms_norm(x.cpu(), res_buf[:, :width].cpu(), w.cpu(), eps)
    assert_bits_equal(rb[:, :width].cpu(), res_ref.to(dtype), "residual")
    s = x + res_buf[:, :width]
    naive = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w
    xc, rc = x.contiguous(), res_buf[:, :width].contiguous()
    be.ns.fused_add_rms_norm(xc, rc, w, eps)
    _check(be, xb[:, :width], xc, x_ref, naive, stride, "fused_add_rms_norm")


GATED = {
    "silu_and_mul": (ref_ops.silu_and_mul, lambda g, u: F.silu(g) * u),
    "gelu_and_mul": (ref_ops.gelu_and_mul, lambda g, u: F.gelu(g) * u),
    "gelu_tanh_and_mul": (ref_ops.gelu_tanh_and_mul, lambda g, u: F.gelu(g, approximate="tanh") * u),
}


@pytest.mark.parametrize("op", list(GATED))
@pytest.mark.parametrize("bname,dtype,rows,width,pad", CASES)
def test_gated_strided(bname, dtype, rows, width, pad, op):
    be = get_backend(bname)
    if be.is_sim and op != "silu_and_mul" and dtype == HF:
        pytest.skip("one activation per dtype in the emulator (slow)")
    buf = _buffer(rows, width + pad, dtype, be.device, 4)
    x = buf[:, :width]  # [gate | up] of F = width / 2, inside a wider row
    f = width // 2
    reference, naive = GATED[op]

    out = be.run(lambda: getattr(be.ns, op)(x))
    assert out.is_contiguous() and out.shape == (rows, f)
    _check(be, out, getattr(be.ns, op)(x.contiguous()), reference(x.cpu()), naive(x[:, :f], x[:, f:]),
           width + pad, op)

    def run_out():
        dst = poison_(torch.empty(rows, f + pad, dtype=dtype, device=be.device))
        getattr(be.ns, f"{op}_out")(dst[:, :f], x)
        return dst

    dst = be.run(run_out)
    assert_bits_equal(dst[:, :f].cpu(), out.cpu(), f"{op}_out strided")
    assert torch.isnan(dst[:, f:].float()).all(), f"{op}_out wrote outside its slice"


@pytest.mark.parametrize("bname,dtype,rows,width,pad", CASES)
def test_activation_strided(bname, dtype, rows, width, pad):
    be = get_backend(bname)
    x = _buffer(rows, width + pad, dtype, be.device, 5)[:, :width]
    out = be.run(lambda: be.ns.activation(x, "quick_gelu"))
    assert out.is_contiguous()
    _check(be, out, be.ns.activation(x.contiguous(), "quick_gelu"), ref_ops.quick_gelu(x.cpu()),
           x * torch.sigmoid(1.702 * x), width + pad, "activation")


def test_rows_of_higher_rank():
    """[A, B, W] slices whose rows are evenly spaced are accepted; leading dims that are not one
    uniform row stride are refused, naming the argument."""
    be = get_backend("cpu")
    buf = _buffer(6, 40, BF, "cpu", 6)
    x = buf.view(2, 3, 40)[..., :32]
    assert_bits_equal(be.ns.silu_and_mul(x), be.ns.silu_and_mul(x.contiguous()), "rank-3 rows")
    uneven = buf.view(2, 3, 40)[:, :2, :32]  # rows 40 apart within a block, 120 between blocks
    with pytest.raises(RuntimeError, match=r"\bx\b.*evenly spaced rows"):
        be.ns.rms_norm(uneven, None, 1e-6)
    with pytest.raises(RuntimeError, match=r"\bx\b.*contiguous last dim"):
        be.ns.silu_and_mul(buf[:, ::2])


# --------------------------------------------------------------------------------------------
# quantisers: row stride a multiple of 8 elements (16-byte vectors), refused otherwise
# --------------------------------------------------------------------------------------------

QUANT_CASES = [
    pytest.param("cpu", BF, 7, 128, 64, id="cpu-bf16-7x128+64"),
    pytest.param("cpu", F32, 5, 256, 8, id="cpu-f32-5x256+8"),
    pytest.param("sim", HF, 3, 128, 64, id="sim-f16-3x128+64", marks=pytest.mark.sim),
    pytest.param("cuda", BF, 513, 4096, 1024, id="cuda-bf16-513x4096+1024", marks=pytest.mark.cuda),
]

QUANT_MODES = [
    ("fp8_quantize", ("token", 128, None)),
    ("fp8_quantize", ("tensor", 128, None)),
    ("fp8_quantize", ("group", 64, None)),
    ("int8_quantize", ("token", None, True)),
    ("int8_quantize", ("token", None, False)),
    ("int8_quantize", ("tensor", None, True)),
]


@pytest.mark.parametrize("op,args", QUANT_MODES, ids=[f"{o}-{a[0]}-{a[-1]}" for o, a in QUANT_MODES])
@pytest.mark.parametrize("bname,dtype,rows,width,pad", QUANT_CASES)
def test_quantize_strided(bname, dtype, rows, width, pad, op, args):
    """Codes and scales of the slice equal those of a contiguous copy bit for bit (the kernels
    read the same 16-byte vectors), the codes meet the reference."""
    be = get_backend(bname)
    x = _buffer(rows, width + pad, dtype, be.device, 7)[:, :width]
    got = be.run(lambda: getattr(be.ns, op)(x, *args))
    expect = getattr(be.ns, op)(x.contiguous(), *args)
    for i, (g, e) in enumerate(zip(got, expect)):
        assert g.is_contiguous()
        assert torch.equal(raw_bits(g), raw_bits(e)), f"{op} output {i}: strided vs contiguous"
    if op == "fp8_quantize":
        q_ref, s_ref = ref_ops.fp8_quantize(x.cpu(), args[0], group_size=args[1])
        assert_bits_equal(got[1].cpu(), s_ref.reshape(got[1].shape).to(torch.float32), "fp8 scale")
        assert_bits_equal(got[0].cpu(), q_ref, "fp8 codes")


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("op", ["fp8_quantize", "int8_quantize"])
def test_quantize_stride_off_vector_width_refused(bname, op):
    be = get_backend(bname)
    x = _buffer(4, 64 + 4, BF, "cpu", 8)[:, :64]  # rows 68 elements apart: not whole 16-byte vectors
    with pytest.raises(RuntimeError, match=rf"{be.ns_name}\.{op}: x must have a row stride that is a multiple of 8"):
        getattr(be.ns, op)(x, "token")
    one_row = _buffer(1, 64 + 4, BF, "cpu", 8)[:, :64]  # a single row has no row stride to check
    getattr(be.ns, op)(one_row, "token")


# --------------------------------------------------------------------------------------------
# scaled mm: a with rows further apart than K (lda), a multiple of 16 bytes
# --------------------------------------------------------------------------------------------

MM_CASES = [
    pytest.param("cpu", 7, 64, 32, 48, id="cpu-7x64x32+48"),
    pytest.param("sim", 5, 32, 32, 16, id="sim-5x32x32+16", marks=pytest.mark.sim),
    pytest.param("cuda", 300, 4096, 512, 1024, id="cuda-300x4096x512+1024", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("bname,m,k,n,pad", MM_CASES)
def test_scaled_mm_strided_a(bname, m, k, n, pad, fmt):
    """The product of a column slice of a wider buffer equals that of its contiguous copy bit for
    bit (the same k-order, the same codes)."""
    be = get_backend(bname)
    g = make_gen(9)
    xa = torch.randn(m, k + pad, generator=g).to(BF).to(be.device)
    w = torch.randn(n, k, generator=g).to(BF).to(be.device)
    quant = be.ns.fp8_quantize if fmt == "fp8" else be.ns.int8_quantize
    mm = be.ns.fp8_scaled_mm if fmt == "fp8" else be.ns.int8_scaled_mm
    qa, sa = quant(xa, "token")[:2]  # codes of the whole buffer; a is the slice of its first k columns
    qw, sw = quant(w, "token")[:2]
    a = qa[:, :k]
    assert not a.is_contiguous() and a.stride(0) == k + pad
    args = (sw, BF, None) if fmt == "fp8" else (sw, BF, None, None, None)
    got = be.run(lambda: mm(a, qw, sa, *args))
    assert_bits_equal(got.cpu(), mm(a.contiguous(), qw, sa, *args).cpu(), f"{fmt}_scaled_mm strided a")
    ref_mm = ref_ops.fp8_scaled_mm if fmt == "fp8" else ref_ops.int8_scaled_mm
    ref = ref_mm(a.cpu(), qw.cpu(), sa.cpu(), sw.cpu(), torch.float64)
    rel = ((got.cpu().double() - ref).norm() / ref.norm()).item()
    assert rel < 8e-3, f"{fmt}_scaled_mm relative error {rel:.2e}"


@pytest.mark.parametrize("bname", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_scaled_mm_lda_off_16_refused(bname, fmt):
    be = get_backend(bname)
    dt = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
    a = torch.zeros(4, 32 + 8, dtype=torch.uint8).view(dt)[:, :32]  # rows 40 bytes apart
    b = torch.zeros(16, 32, dtype=torch.uint8).view(dt)
    s = torch.ones(1)
    mm = be.ns.fp8_scaled_mm if fmt == "fp8" else be.ns.int8_scaled_mm
    args = (BF, None) if fmt == "fp8" else (BF, None, None, None)
    with pytest.raises(RuntimeError, match=rf"{fmt}_scaled_mm: a must have a row stride that is a multiple of 16"):
        mm(a, b, s, s, *args)
