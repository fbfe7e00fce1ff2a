"""Parity of the fused elementwise ops and reshape_and_cache against the fp64 oracles.

Backends: ``cpu`` (ATen impls, fp32/fp16/bf16), ``sim`` (CUDA kernel sources in the simt emulator,
fp16/bf16, each call made under two schedule seeds and required bit-identical) and ``cuda``
(``pytest -m cuda``; larger shapes). Error rule: :func:`conftest.assert_fa_close`.

Sim shapes are kept small: the emulator runs every CUDA thread as a fiber.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import (
    assert_bits_equal,
    assert_fa_close,
    backend_params,
    get_backend,
    make_gen,
    poison_,
    poison_like,
    randn,
    raw_bits,
)

import fastinfer.reference as ref_ops

I32, I64 = torch.int32, torch.int64

# --------------------------------------------------------------------------------------------
# naive implementations in the input precision (the yardstick of the error rule)
# --------------------------------------------------------------------------------------------


def naive_rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def naive_silu_and_mul(x):
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


def naive_gelu_and_mul(x):
    f = x.shape[-1] // 2
    return F.gelu(x[..., :f]) * x[..., f:]


def naive_gelu_tanh_and_mul(x):  # PyTorch's own tanh-approximated gelu, in the input precision
    f = x.shape[-1] // 2
    return F.gelu(x[..., :f], approximate="tanh") * x[..., f:]


def naive_rope(positions, x, cache, is_neox):
    rot = cache.shape[-1]
    c = cache.to(x.dtype)[positions.long()]
    cos, sin = c[:, None, : rot // 2], c[:, None, rot // 2 :]
    out = x.clone()
    if is_neox:
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
        out[..., : rot // 2] = x1 * cos - x2 * sin
        out[..., rot // 2 : rot] = x2 * cos + x1 * sin
    else:
        xe, xo = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = xe * cos - xo * sin
        out[..., 1:rot:2] = xo * cos + xe * sin
    return out


def _row_scaled(shape, dtype, device, gen):
    """randn rows with per-row scales in [0.1, 10] (exercises the normalisation)."""
    x = torch.randn(shape, generator=gen)
    s = torch.exp(torch.empty(shape[:-1] + (1,)).uniform_(-2.3, 2.3, generator=gen))
    return (x * s).to(dtype).to(device)


def _one_arg(cases):
    """Wrap each case of a single-argument case table (a shape tuple) into a 1-tuple."""
    return {k: [(c,) for c in v] for k, v in cases.items()}


# --------------------------------------------------------------------------------------------
# rms_norm / rms_norm_out
# --------------------------------------------------------------------------------------------

NORM_CASES = {
    # shape of x (rank >= 1; last dim = H)
    "cpu": [
        (1, 64), (7, 96), (100, 64), (7, 4095), (1, 8192), (100, 8192), (3, 5, 96), (96,), (0, 64),
    ],
    "sim": [(1, 64), (7, 96), (100, 64), (3, 4095), (7, 8192), (100, 8192), (2, 3, 64), (96,), (0, 64)],
    "cuda": [
        (1, 64), (7, 96), (100, 64), (7, 4095), (1, 8192), (100, 8192), (3, 5, 96), (96,),
        (0, 64), (4096, 8192), (4096, 4096), (4099, 5120),
    ],
}


@pytest.mark.parametrize("use_out", [False, True], ids=["ret", "out"])
@pytest.mark.parametrize("bname,dtype,shape", backend_params(_one_arg(NORM_CASES)))
def test_rms_norm(bname, dtype, shape, use_out):
    be = get_backend(bname)
    gen = make_gen(1)
    h = shape[-1]
    x = _row_scaled(shape, dtype, be.device, gen)
    w = randn((h,), dtype, be.device, gen, scale=0.2, offset=1.0)
    eps = 1e-5

    def run():
        xc = x.clone()
        if use_out:
            out = poison_like(xc)
            r = be.ns.rms_norm_out(out, xc, w, eps)
            assert r is None
        else:
            out = be.ns.rms_norm(xc, w, eps)
        assert torch.equal(xc, x), "rms_norm must not modify x"
        return out

    out = be.run(run)
    assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
    assert_fa_close(out, ref_ops.rms_norm(x.cpu(), w.cpu(), eps), naive_rms_norm(x, w, eps), name="rms_norm")


@pytest.mark.parametrize(
    "bname,dtype,shape",
    backend_params(_one_arg({"cpu": [(7, 4096)], "sim": [(7, 4096)], "cuda": [(7, 4096)]}),
                   dtypes={"cpu": (torch.float16,), "sim": (torch.float16,), "cuda": (torch.float16,)}),
)
def test_rms_norm_fp16_large_values(bname, dtype, shape):
    """|x| ~ 3000: x**2 overflows fp16, so the sum of squares must be accumulated in fp32.

    The naive fp16 computation overflows here; the yardstick is the naive computation in fp32
    rounded once to fp16.
    """
    be = get_backend(bname)
    gen = make_gen(11)
    x = randn(shape, dtype, be.device, gen, scale=3000.0)
    w = randn(shape[-1:], dtype, be.device, gen, scale=0.2, offset=1.0)
    out = be.run(lambda: be.ns.rms_norm(x, w, 0.0))
    naive = naive_rms_norm(x.float(), w.float(), 0.0).to(dtype)
    assert_fa_close(out, ref_ops.rms_norm(x.cpu(), w.cpu(), 0.0), naive, name="rms_norm")


WEIGHTLESS_CASES = {"cpu": [(7, 96), (3, 5, 4095), (1, 8)], "sim": [(3, 96), (2, 33)], "cuda": [(7, 96), (513, 4095)]}


@pytest.mark.parametrize("bname,dtype,shape", backend_params(_one_arg(WEIGHTLESS_CASES)))
def test_rms_norm_weightless(bname, dtype, shape):
    """weight=None (elementwise_affine=False): against the fp64 oracle without a weight and bit
    for bit a weight of ones, in both rms_norm and fused_add_rms_norm."""
    be = get_backend(bname)
    gen = make_gen(21)
    x = _row_scaled(shape, dtype, be.device, gen)
    res = _row_scaled(shape, dtype, be.device, gen)
    ones = torch.ones(shape[-1], dtype=dtype, device=be.device)
    eps = 1e-6

    def run():
        plain = be.ns.rms_norm(x, None, eps)
        xc, rc = x.clone(), res.clone()
        be.ns.fused_add_rms_norm(xc, rc, None, eps)
        return plain, xc, rc

    plain, x_out, res_out = be.run(run)
    assert_fa_close(plain, ref_ops.rms_norm(x.cpu(), None, eps), naive_rms_norm(x, 1.0, eps), name="rms_norm")
    assert_bits_equal(plain.cpu(), be.ns.rms_norm(x, ones, eps).cpu(), "weightless vs ones")
    out = poison_like(x)
    be.ns.rms_norm_out(out, x, None, eps)
    assert_bits_equal(out.cpu(), plain.cpu(), "rms_norm_out(weight=None)")
    x_ref, res_ref = ref_ops.fused_add_rms_norm(x.cpu(), res.cpu(), None, eps)
    assert_bits_equal(res_out.cpu(), res_ref.to(dtype), "residual")
    assert_fa_close(x_out, x_ref, naive_rms_norm(x + res, 1.0, eps), name="fused_add x")
    xo, ro = x.clone(), res.clone()
    be.ns.fused_add_rms_norm(xo, ro, ones, eps)
    assert_bits_equal(x_out.cpu(), xo.cpu(), "fused_add weightless vs ones")


def test_rms_norm_weightless_reference_is_torch():
    """The oracle without a weight against torch.nn.functional.rms_norm (the convention's owner)."""
    x = randn((5, 37), torch.float64, "cpu", make_gen(22), scale=3.0)
    assert torch.allclose(ref_ops.rms_norm(x, None, 1e-6), F.rms_norm(x, (37,), None, 1e-6), rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------
# fused_add_rms_norm
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bname,dtype,shape", backend_params(_one_arg(NORM_CASES)))
def test_fused_add_rms_norm(bname, dtype, shape):
    be = get_backend(bname)
    gen = make_gen(2)
    h = shape[-1]
    x = _row_scaled(shape, dtype, be.device, gen)
    res = _row_scaled(shape, dtype, be.device, gen)
    w = randn((h,), dtype, be.device, gen, scale=0.2, offset=1.0)
    eps = 1e-6

    def run():
        xc, rc = x.clone(), res.clone()
        r = be.ns.fused_add_rms_norm(xc, rc, w, eps)
        assert r is None
        return xc, rc

    x_out, res_out = be.run(run)
    x_ref, res_ref = ref_ops.fused_add_rms_norm(x.cpu(), res.cpu(), w.cpu(), eps)
    # The residual is specified as ONE rounding of the fp32 sum: bit-exact.
    assert_bits_equal(res_out.cpu(), res_ref.to(dtype), "residual")
    naive_res = x + res
    assert_fa_close(x_out, x_ref, naive_rms_norm(naive_res, w, eps), name="x")


# --------------------------------------------------------------------------------------------
# zero-centred (weight_offset) and gated RMSNorm
# --------------------------------------------------------------------------------------------

GATED_NORM_CASES = {
    # shape of x and gate: [..., H] (Gated DeltaNet: [tokens, value heads, Dv])
    "cpu": [(1, 128), (7, 4, 128), (33, 96), (5, 4095), (2, 3, 64), (0, 128)],
    "sim": [(1, 128), (7, 4, 128), (5, 96), (3, 4095), (0, 128)],
    "cuda": [(1, 128), (7, 4, 128), (33, 96), (5, 4095), (4096, 32, 128), (0, 128)],
}


def naive_gated_rms_norm(x, z, w, eps):
    return naive_rms_norm(x, w, eps) * F.silu(z)


@pytest.mark.parametrize("bname,dtype,shape", backend_params(_one_arg(NORM_CASES)))
def test_rms_norm_zero_centred(bname, dtype, shape):
    """weight_offset=1: x_normed * (1 + w) with small w (Gemma, Qwen3.5), the 1 added in fp32; and
    the residual step with it."""
    be = get_backend(bname)
    gen = make_gen(23)
    h = shape[-1]
    x = _row_scaled(shape, dtype, be.device, gen)
    res = _row_scaled(shape, dtype, be.device, gen)
    w = randn((h,), dtype, be.device, gen, scale=0.05)
    eps = 1e-6

    def run():
        plain = be.ns.rms_norm(x, w, eps, weight_offset=1.0)
        out = poison_like(x)
        be.ns.rms_norm_out(out, x, w, eps, weight_offset=1.0)
        xc, rc = x.clone(), res.clone()
        be.ns.fused_add_rms_norm(xc, rc, w, eps, weight_offset=1.0)
        return plain, out, xc, rc

    plain, out, x_out, res_out = be.run(run)
    one_plus_w = w.float() + 1.0  # the naive yardstick in the input precision keeps the fp32 weight
    assert_fa_close(plain, ref_ops.rms_norm(x.cpu(), w.cpu(), eps, 1.0),
                    naive_rms_norm(x.float(), one_plus_w, eps).to(dtype), name="rms_norm offset")
    assert_bits_equal(out.cpu(), plain.cpu(), "rms_norm_out offset")
    x_ref, res_ref = ref_ops.fused_add_rms_norm(x.cpu(), res.cpu(), w.cpu(), eps, 1.0)
    assert_bits_equal(res_out.cpu(), res_ref.to(dtype), "residual")
    assert_fa_close(x_out, x_ref, naive_rms_norm((x + res).float(), one_plus_w, eps).to(dtype), name="fused_add offset")
    if dtype != torch.float32 and x.numel() > 0:
        # rounding 1 + w to the dtype first (what a plain norm on a pre-added weight does) is visibly worse
        pre_added = be.ns.rms_norm(x, (w.float() + 1.0).to(dtype), eps).cpu().double()
        ref = ref_ops.rms_norm(x.cpu(), w.cpu(), eps, 1.0)
        assert (plain.cpu().double() - ref).norm() < (pre_added - ref).norm()


@pytest.mark.parametrize("bname,dtype,shape", backend_params(_one_arg(GATED_NORM_CASES)))
def test_gated_rms_norm(bname, dtype, shape):
    """rms_norm(x) * silu(gate), x and gate read as strided rows of wider buffers (Qwen3.5 takes z
    from a fused projection), weighted, zero-centred and weightless."""
    be = get_backend(bname)
    gen = make_gen(24)
    h = shape[-1]
    xz = _row_scaled(shape[:-1] + (3 * h,), dtype, be.device, gen)
    x, z = xz[..., :h], xz[..., 2 * h:]  # strided rows, the gate 2h elements after x
    w = randn((h,), dtype, be.device, gen, scale=0.2, offset=1.0)
    eps = 1e-6

    def run():
        return (be.ns.gated_rms_norm(x, z, w, eps), be.ns.gated_rms_norm(x, z, None, eps),
                be.ns.gated_rms_norm(x, z, w, eps, weight_offset=1.0))

    weighted, weightless, centred = be.run(run)
    for out in (weighted, weightless, centred):
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    xc, zc = x.cpu(), z.cpu()
    assert_fa_close(weighted, ref_ops.gated_rms_norm(xc, zc, w.cpu(), eps),
                    naive_gated_rms_norm(x, z, w, eps), name="gated")
    assert_fa_close(weightless, ref_ops.gated_rms_norm(xc, zc, None, eps),
                    naive_gated_rms_norm(x, z, 1.0, eps), name="gated weightless")
    assert_fa_close(centred, ref_ops.gated_rms_norm(xc, zc, w.cpu(), eps, 1.0),
                    naive_gated_rms_norm(x.float(), z.float(), w.float() + 1.0, eps).to(dtype), name="gated offset")
    # the same rows contiguous give the same bits
    assert_bits_equal(be.ns.gated_rms_norm(x.contiguous(), z.contiguous(), w, eps).cpu(), weighted.cpu(), "contiguous")


def _qwen3_5_norms():
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    return modeling.Qwen3_5RMSNorm, modeling.Qwen3_5RMSNormGated


def test_norm_references_are_transformers():
    """The oracles against the models' own definitions: Qwen3.5's zero-centred RMSNorm, Gemma's
    (1 + weight) norm and Qwen3.5's gated norm (Gated DeltaNet's output norm)."""
    GemmaRMSNorm = pytest.importorskip("transformers.models.gemma.modeling_gemma").GemmaRMSNorm

    RMSNorm, RMSNormGated = _qwen3_5_norms()
    gen = make_gen(25)
    x = randn((6, 3, 64), torch.float64, "cpu", gen, scale=2.0)
    z = randn((6, 3, 64), torch.float64, "cpu", gen, scale=2.0)
    w = randn((64,), torch.float64, "cpu", gen, scale=0.1)
    with torch.no_grad():
        centred = RMSNorm(64, eps=1e-6).double()
        centred.weight.copy_(w)
        gated = RMSNormGated(64, eps=1e-6).double()
        gated.weight.copy_(w + 1.0)
        gemma = GemmaRMSNorm(64, eps=1e-6).double()
        gemma.weight.copy_(w)
        # the modules cast to float32 inside whatever their input: agreement to float32 precision,
        # and dropping the offset (or the gate) is far outside it
        want = ref_ops.rms_norm(x, w, 1e-6, 1.0)
        torch.testing.assert_close(want, centred(x).double(), rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(want, gemma(x).double(), rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(ref_ops.gated_rms_norm(x, z, w + 1.0, 1e-6), gated(x, z).double(),
                                   rtol=2e-6, atol=1e-6)
        assert (ref_ops.rms_norm(x, w, 1e-6) - centred(x)).abs().max() > 0.1


def test_zero_centred_fp32_matches_transformers():
    """On the CPU in float32 the zero-centred and gated norms agree with transformers' modules to an
    fp32 ulp or two (the sum of squares is accumulated in a different order)."""
    RMSNorm, RMSNormGated = _qwen3_5_norms()
    gen = make_gen(26)
    x = _row_scaled((9, 4, 128), torch.float32, "cpu", gen)
    z = _row_scaled((9, 4, 128), torch.float32, "cpu", gen)
    w = randn((128,), torch.float32, "cpu", gen, scale=0.1)
    with torch.no_grad():
        centred = RMSNorm(128, eps=1e-6)
        centred.weight.copy_(w)
        gated = RMSNormGated(128, eps=1e-6)
        gated.weight.copy_(w + 1.0)
        torch.testing.assert_close(get_backend("cpu").ns.rms_norm(x, w, 1e-6, weight_offset=1.0), centred(x),
                                   rtol=3e-7, atol=0)
        torch.testing.assert_close(get_backend("cpu").ns.gated_rms_norm(x, z, w + 1.0, 1e-6), gated(x, z),
                                   rtol=5e-7, atol=1e-30)


# --------------------------------------------------------------------------------------------
# silu_and_mul / silu_and_mul_out
# --------------------------------------------------------------------------------------------

SILU_CASES = {
    # shape of x: [..., 2F]
    "cpu": [(1, 128), (7, 192), (100, 2 * 4095), (7, 2 * 14336), (100, 2 * 96), (2, 3, 128), (0, 128), (2,)],
    "sim": [(1, 128), (7, 192), (100, 2 * 96), (100, 2 * 4095), (2, 2 * 14336), (2, 3, 128), (0, 128), (2,)],
    "cuda": [
        (1, 128), (7, 192), (100, 2 * 4095), (7, 2 * 14336), (100, 2 * 96), (2, 3, 128), (0, 128),
        (2,), (4096, 2 * 14336), (513, 2 * 11008),
    ],
}


# The gated activations: the op, its fp64 reference, the plain-torch version in the input precision.
GATED = {
    "silu": ("silu_and_mul", ref_ops.silu_and_mul, naive_silu_and_mul),
    "gelu": ("gelu_and_mul", ref_ops.gelu_and_mul, naive_gelu_and_mul),
    "gelu_tanh": ("gelu_tanh_and_mul", ref_ops.gelu_tanh_and_mul, naive_gelu_tanh_and_mul),
}


@pytest.mark.parametrize("act", list(GATED))
@pytest.mark.parametrize("use_out", [False, True], ids=["ret", "out"])
@pytest.mark.parametrize("bname,dtype,shape", backend_params(_one_arg(SILU_CASES)))
def test_gated_and_mul(bname, dtype, shape, use_out, act):
    op, reference, naive = GATED[act]
    be = get_backend(bname)
    x = randn(shape, dtype, be.device, make_gen(3), scale=2.0)
    f = shape[-1] // 2

    def run():
        xc = x.clone()
        if use_out:
            out = poison_(torch.empty(shape[:-1] + (f,), dtype=dtype, device=be.device))
            assert getattr(be.ns, f"{op}_out")(out, xc) is None
        else:
            out = getattr(be.ns, op)(xc)
        assert torch.equal(xc, x), f"{op} must not modify x"
        return out

    out = be.run(run)
    assert out.dtype == dtype and tuple(out.shape) == shape[:-1] + (f,)
    assert_fa_close(out, reference(x.cpu()), naive(x), name=op)


# float32 silu_and_mul against torch's own F.silu(gate) * up (vLLM's activation test asks for
# bitwise equality with it). torch's CPU silu computes runs of 2 * vector-width elements with
# SLEEF's expf and the rest of each run of contiguous elements (the tail of a row) with libm's expf;
# the CPU impl uses SLEEF's everywhere. So: rows whose F is a multiple of 32 (any vector width up to
# AVX-512) are equal bit for bit; in the other rows the vector part is, and the tail (the two exps
# differ by up to 1 ulp) within 2 ulp of the product.
@pytest.mark.parametrize("shape", [(7, 2 * 4096), (3, 5, 2 * 96), (1, 2 * 14336), (100, 2 * 4095), (9, 2 * 31)])
def test_silu_and_mul_fp32_matches_torch(shape):
    be = get_backend("cpu")
    x = randn(shape, torch.float32, "cpu", make_gen(5), scale=4.0)
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, -88.5, 1e-30])  # exp's range ends, a subnormal product
    f = shape[-1] // 2
    out = be.ns.silu_and_mul(x)
    expect = F.silu(x[..., :f]) * x[..., f:]
    if f % 32 == 0:
        assert_bits_equal(out, expect, "silu_and_mul vs F.silu * up")
    else:
        ulps = (raw_bits(out).long() - raw_bits(expect).long()).abs()
        assert ulps.max().item() <= 2, f"silu_and_mul is {ulps.max().item()} ulp from torch"
        assert torch.equal(raw_bits(out)[..., : f - f % 32], raw_bits(expect)[..., : f - f % 32])


def test_silu_and_mul_fp32_ulp_vs_oracle():
    """As close to the fp64 oracle as torch's silu: the same max ulp (they agree bit for bit on
    these rows)."""
    be = get_backend("cpu")
    x = randn((64, 2 * 4096), torch.float32, "cpu", make_gen(6), scale=4.0)
    f = x.shape[-1] // 2
    ref = ref_ops.silu_and_mul(x)
    spacing = lambda t: (torch.nextafter(t.abs(), torch.tensor(float("inf"))) - t.abs()).double()
    def max_ulp(o):
        return ((o.double() - ref).abs() / spacing(ref.float())).max().item()
    ours, torchs = max_ulp(be.ns.silu_and_mul(x)), max_ulp(F.silu(x[:, :f]) * x[:, f:])
    assert ours <= torchs + 1e-9, f"silu_and_mul {ours:.2f} ulp vs torch's {torchs:.2f}"


def test_gelu_tanh_reference_is_torch_gelu_tanh():
    """The fp64 reference against PyTorch's definition (the convention's owner), in float64."""
    x = randn((5, 2 * 33), torch.float64, "cpu", make_gen(4), scale=3.0)
    expect = F.gelu(x[:, :33], approximate="tanh") * x[:, 33:]
    assert torch.allclose(ref_ops.gelu_tanh_and_mul(x), expect, rtol=1e-12, atol=1e-12)


def test_gelu_reference_is_torch_gelu():
    x = randn((5, 2 * 33), torch.float64, "cpu", make_gen(4), scale=3.0)
    assert torch.allclose(ref_ops.gelu_and_mul(x), F.gelu(x[:, :33]) * x[:, 33:], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# activation: transformers' gelu_new, gelu_fast, quick_gelu
# --------------------------------------------------------------------------------------------

PLAIN_ACTS = {"gelu_new": ref_ops.gelu_new, "gelu_fast": ref_ops.gelu_fast, "quick_gelu": ref_ops.quick_gelu}
ACT_CASES = {
    "cpu": [(7, 96), (3, 5, 33), (100, 4095), (0, 64), (5,), ()],
    "sim": [(3, 96), (2, 33), (7,)],
    "cuda": [(7, 96), (3, 5, 33), (4096, 14336), (0, 64), (5,), ()],
}


# The yardstick of FlashAttention's rule: the formulas as transformers' activations.py modules
# write them, evaluated in the input precision (here, so that the ABI check's environment, which has
# no transformers, runs these tests too).
NAIVE_ACTS = {
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def _transformers_act(name):
    # the convention's owner (a pinned test dependency; absent from the ABI check's environment)
    return pytest.importorskip("transformers.activations").ACT2FN[name]


@pytest.mark.parametrize("act", list(PLAIN_ACTS))
@pytest.mark.parametrize("use_out", [False, True], ids=["ret", "out"])
@pytest.mark.parametrize("bname,dtype,shape", backend_params(_one_arg(ACT_CASES)))
def test_activation(bname, dtype, shape, use_out, act):
    be = get_backend(bname)
    x = randn(shape, dtype, be.device, make_gen(31), scale=3.0)

    def run():
        xc = x.clone()
        if use_out:
            out = poison_like(xc)
            assert be.ns.activation_out(out, xc, act) is None
        else:
            out = be.ns.activation(xc, act)
        assert torch.equal(xc, x), "activation must not modify x"
        return out

    out = be.run(run)
    assert out.dtype == dtype and out.shape == x.shape
    assert_fa_close(out, PLAIN_ACTS[act](x.cpu()), NAIVE_ACTS[act](x), name=act)


@pytest.mark.parametrize("act", list(PLAIN_ACTS))
def test_activation_reference_is_transformers(act):
    """The fp64 oracles and the yardsticks against transformers' activations.py modules, in float64
    and in bfloat16 (bit for bit: the same formula in the same precision)."""
    x = randn((5, 37), torch.float64, "cpu", make_gen(32), scale=4.0)
    assert torch.allclose(PLAIN_ACTS[act](x), _transformers_act(act)(x), rtol=1e-13, atol=1e-15)
    xb = x.to(torch.bfloat16)
    assert torch.equal(NAIVE_ACTS[act](xb), _transformers_act(act)(xb))


# --------------------------------------------------------------------------------------------
# rotary_embedding
# --------------------------------------------------------------------------------------------

# (T, Hq, Hkv, D, R, positions dtype, layout, cache dtype: "f32" or "same")
# layout "sep": separate contiguous q and k; "qkv": q, k are token-strided views into a fused
# [T, (Hq + 2 Hkv) * D] buffer; "pad": views with a padded token stride.
ROPE_CPU = [
    (1, 1, 1, 64, 64, I64, "sep", "f32"),
    (7, 4, 1, 128, 128, I32, "qkv", "f32"),
    (100, 8, 8, 64, 64, I64, "qkv", "same"),
    (7, 8, 4, 128, 64, I64, "sep", "f32"),  # partial rotary R = D/2
    (100, 4, 4, 128, 32, I32, "pad", "f32"),  # partial rotary R = D/4
    (7, 1, 1, 64, 48, I64, "qkv", "same"),  # partial rotary, R/2 not a power of two
    (7, 4, 2, 64, 2, I64, "qkv", "f32"),  # a single rotated pair per head
    (100, 8, 1, 128, 128, I32, "pad", "same"),
    (0, 4, 1, 64, 64, I64, "sep", "f32"),
]
ROPE_SIM = ROPE_CPU + [
    (7, 4, 1, 128, 128, I32, "qkv", "same"),
    (3, 4, 4, 64, 48, I32, "qkv", "f32"),
]
ROPE_CUDA = ROPE_CPU + [
    (4096, 32, 8, 128, 128, I64, "qkv", "f32"),
    (4096, 32, 8, 128, 64, I32, "qkv", "same"),
    (1, 32, 8, 128, 128, I64, "qkv", "f32"),
]
MAX_POS = 4096 + 37


def _make_qk(t, hq, hkv, d, dtype, device, layout, gen):
    """Return (buffer, q, k, v) where q/k/v are views of one allocation per ``layout``."""
    if layout == "sep":
        q = randn((t, hq, d), dtype, device, gen)
        k = randn((t, hkv, d), dtype, device, gen)
        v = randn((t, hkv, d), dtype, device, gen)
        return (q, k, v), q, k, v
    pad = 0 if layout == "qkv" else 3 * d + 5
    width = (hq + 2 * hkv) * d + pad
    buf = randn((t, width), dtype, device, gen)
    q = buf[:, : hq * d].view(t, hq, d)
    k = buf[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = buf[:, (hq + hkv) * d : (hq + 2 * hkv) * d].view(t, hkv, d)
    return (buf,), q, k, v


def _rebuild(bufs, layout, hq, hkv, d):
    """Clone ``bufs`` and return fresh (bufs, q, k) views of the clones."""
    bufs = tuple(b.clone() for b in bufs)
    if layout == "sep":
        return bufs, bufs[0], bufs[1]
    buf = bufs[0]
    t = buf.shape[0]
    q = buf[:, : hq * d].view(t, hq, d)
    k = buf[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    return bufs, q, k


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "bname,dtype,t,hq,hkv,d,rot,pos_dtype,layout,cache_kind",
    backend_params({"cpu": ROPE_CPU, "sim": ROPE_SIM, "cuda": ROPE_CUDA}),
)
def test_rotary_embedding(bname, dtype, t, hq, hkv, d, rot, pos_dtype, layout, cache_kind, is_neox):
    from fastinfer.ops import build_rope_cache

    be = get_backend(bname)
    gen = make_gen(4)
    bufs, q, k, _ = _make_qk(t, hq, hkv, d, dtype, be.device, layout, gen)
    cdt = torch.float32 if cache_kind == "f32" else dtype
    cache = build_rope_cache(MAX_POS, rot, theta=10000.0, dtype=cdt, device=be.device)
    positions = torch.randint(0, MAX_POS, (t,), generator=gen, dtype=torch.int64)
    if t >= 2:
        positions[0], positions[1] = 0, MAX_POS - 1  # both ends of the table
    positions = positions.to(pos_dtype).to(be.device)

    def run():
        b2, q2, k2 = _rebuild(bufs, layout, hq, hkv, d)
        assert be.ns.rotary_embedding(positions, q2, k2, cache, is_neox) is None
        return (*b2, q2, k2)

    res = be.run(run)
    out_bufs, q_out, k_out = res[:-2], res[-2], res[-1]
    q_ref, k_ref = ref_ops.rotary_embedding(positions.cpu(), q.cpu(), k.cpu(), cache.cpu(), is_neox)
    assert_fa_close(q_out, q_ref, naive_rope(positions, q, cache, is_neox), name="q")
    assert_fa_close(k_out, k_ref, naive_rope(positions, k, cache, is_neox), name="k")
    # Non-rotated dims (partial rotary) are untouched, bit for bit.
    assert_bits_equal(q_out[..., rot:], q[..., rot:], "q[..., R:]")
    assert_bits_equal(k_out[..., rot:], k[..., rot:], "k[..., R:]")
    # Everything outside q and k in a fused buffer (v, padding) is untouched.
    if layout != "sep":
        before, after = bufs[0].clone(), out_bufs[0].clone()
        before[:, : (hq + hkv) * d] = 0
        after[:, : (hq + hkv) * d] = 0
        assert_bits_equal(after, before, "fused buffer outside q/k")
    else:
        assert_bits_equal(out_bufs[2], bufs[2], "v")


def test_build_rope_cache_matches_hf_formula():
    from fastinfer.ops import build_rope_cache

    c = build_rope_cache(64, 128, theta=500000.0, dtype=torch.float64)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    ang = torch.arange(64, dtype=torch.float64)[:, None] * inv[None, :]
    assert c.shape == (64, 128)
    torch.testing.assert_close(c[:, :64], ang.cos(), rtol=0, atol=1e-15)
    torch.testing.assert_close(c[:, 64:], ang.sin(), rtol=0, atol=1e-15)


def test_reference_rope_matches_hf_rotate_half():
    """The neox oracle equals HF Llama's ``q * cos + rotate_half(q) * sin``."""
    from fastinfer.ops import build_rope_cache

    gen = make_gen(5)
    q = torch.randn(5, 3, 64, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 3, 9, 1, 15])
    cache = build_rope_cache(16, 64, dtype=torch.float64)
    cos = torch.cat([cache[pos, :32]] * 2, -1)[:, None]
    sin = torch.cat([cache[pos, 32:]] * 2, -1)[:, None]
    rot_half = torch.cat([-q[..., 32:], q[..., :32]], -1)
    expect = q * cos + rot_half * sin
    got, _ = ref_ops.rotary_embedding(pos, q, q[:, :1], cache, True)
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-14)


# --------------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------------

# (T, Hkv, D, NB, BS, slot dtype, layout, cache kind: "same" | "fp8" | "fp8-head" (one scale per KV
# head), number of -1 slots)
RAC_CPU = [
    (1, 1, 64, 2, 8, I64, "sep", "same", 0),
    (7, 4, 128, 3, 16, I32, "qkv", "same", 2),
    (100, 8, 64, 9, 16, I64, "pad", "same", 5),
    (7, 1, 128, 2, 8, I64, "sep", "fp8", 1),
    (100, 8, 128, 16, 8, I32, "qkv", "fp8", 3),
    (0, 4, 64, 2, 16, I64, "sep", "same", 0),
    (5, 4, 64, 2, 8, I64, "sep", "same", 5),  # all padding: nothing written
    (9, 4, 64, 3, 8, I64, "qkv", "fp8-head", 2),
]
RAC_SIM = RAC_CPU + [
    (17, 8, 64, 4, 8, I64, "pad", "fp8", 3),
    (7, 1, 128, 2, 16, I32, "qkv", "fp8", 1),
    (13, 3, 64, 4, 8, I32, "pad", "fp8-head", 2),
    (40, 2, 4, 6, 8, I64, "sep", "fp8-head", 1),  # D = 4: vectors would straddle heads (scalar path)
]
RAC_CUDA = RAC_CPU + [
    (4096, 8, 128, 300, 16, I64, "qkv", "same", 17),
    (4096, 8, 128, 300, 16, I32, "qkv", "fp8", 17),
]


@pytest.mark.parametrize(
    "bname,dtype,t,hkv,d,nb,bs,slot_dtype,layout,cache_kind,n_pad",
    backend_params({"cpu": RAC_CPU, "sim": RAC_SIM, "cuda": RAC_CUDA}),
)
def test_reshape_and_cache(bname, dtype, t, hkv, d, nb, bs, slot_dtype, layout, cache_kind, n_pad):
    be = get_backend(bname)
    gen = make_gen(6)
    hq = hkv  # q is irrelevant here; reuse the qkv layout helper
    _, _, k, v = _make_qk(t, hq, hkv, d, dtype, be.device, layout, gen)
    k = k * 3  # wide dynamic range (fp8 saturates for some elements below)
    k = k if layout == "sep" else _restride_like(k, layout)
    n = nb * bs
    assert t - n_pad <= n
    slots = torch.randperm(n, generator=gen)[:t].clone()
    if n_pad:
        slots[torch.randperm(t, generator=gen)[:n_pad]] = -1
    slots = slots.to(slot_dtype).to(be.device)

    fp8 = cache_kind.startswith("fp8")
    cdt = torch.float8_e4m3fn if fp8 else dtype
    k_cache0 = poison_(torch.empty((nb, bs, hkv, d), dtype=cdt, device=be.device))
    v_cache0 = poison_(torch.empty((nb, bs, hkv, d), dtype=cdt, device=be.device))
    if fp8:
        # scales chosen so that roughly the largest 10% of |k| / |v| saturate at +-448
        k_scale = (k.float().abs().amax() / 448 * 0.7).reshape(1).to(be.device)
        # a power of two: v / v_scale is exact, so many values sit exactly on e4m3 rounding ties
        # (round-half-even) and the small ones land in the e4m3 subnormal range (< 2^-6)
        v_scale = torch.tensor([0.25], dtype=torch.float32, device=be.device)
        if cache_kind == "fp8-head":  # head h: k_scale x (1 + h / 2), v_scale 0.25 x 2^(h % 2)
            heads = torch.arange(hkv, dtype=torch.float32, device=be.device)
            k_scale = k_scale * (1 + heads / 2)
            v_scale = 0.25 * 2.0 ** (heads % 2)
    else:
        k_scale = v_scale = None

    def run():
        kc, vc = k_cache0.clone(), v_cache0.clone()
        assert be.ns.reshape_and_cache(k, v, kc, vc, slots, k_scale, v_scale) is None
        return kc, vc

    kc, vc = be.run(run)
    k_ref, v_ref = ref_ops.reshape_and_cache(
        k.cpu(), v.cpu(), k_cache0.cpu(), v_cache0.cpu(), slots.cpu(),
        None if k_scale is None else k_scale.cpu(), None if v_scale is None else v_scale.cpu(),
    )
    if fp8:
        # exact e4m3 encoding, untouched rows keep the 0x7F poison
        assert_bits_equal(kc.cpu(), k_ref, "k_cache")
        assert_bits_equal(vc.cpu(), v_ref, "v_cache")
        if t - n_pad > 0:
            sat = (k.float().cpu().abs() / k_scale.cpu().reshape(-1, 1) > 448).sum().item()
            vq = (v.float().cpu() / v_scale.cpu().reshape(-1, 1)).abs()
            sub = ((vq < 2 ** -6) & (vq > 0)).sum().item()
            ties = (vq * 8 / 2 ** torch.floor(torch.log2(vq.clamp_min(2 ** -6)))).frac().eq(0.5).sum().item()
            assert sat > 0, "test inputs should exercise saturation"
            assert ties > 0 or dtype == torch.float32, "test inputs should exercise rounding ties"
            assert t < 50 or sub > 0, "test inputs should exercise e4m3 subnormals"
    else:
        # exact copy of the written rows (NaN == NaN for the poisoned, untouched rows; their bit
        # pattern is checked below)
        for name, got, want in (("k_cache", kc, k_ref), ("v_cache", vc, v_ref)):
            torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=0, equal_nan=True, msg=name)
    # rows not named by a slot still hold the poison
    written = torch.zeros(n, dtype=torch.bool)
    s = slots.cpu().long()
    written[s[s >= 0]] = True
    poison_bits = raw_bits(poison_(torch.empty((1,), dtype=cdt)))
    for name, c in (("k_cache", kc), ("v_cache", vc)):
        untouched = raw_bits(c.view(n, hkv, d)[~written.to(c.device)])
        assert (untouched == poison_bits).all(), f"{name}: a row that no slot names was modified"


def _restride_like(k, layout):
    """Return a non-contiguous view of a copy of ``k`` with a padded token stride."""
    t, h, d = k.shape
    pad = 7 * d if layout == "pad" else d
    buf = poison_(torch.empty((t, h * d + pad), dtype=k.dtype, device=k.device))
    view = buf[:, : h * d].view(t, h, d)
    view.copy_(k)
    return view


# --------------------------------------------------------------------------------------------
# CUDA-only: optional device-side index checking
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_reshape_and_cache_cuda_index_check(monkeypatch):
    be = get_backend("cuda")
    monkeypatch.setenv("FASTINFER_CHECK_INDICES", "1")
    k = torch.randn(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    kc = torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    vc = kc.clone()
    slots = torch.tensor([0, 1, 16, 3], device="cuda")
    with pytest.raises(RuntimeError, match="slot_mapping"):
        be.ns.reshape_and_cache(k, k, kc, vc, slots, None, None)
        torch.cuda.synchronize()
