"""FP4 (W4A16) ops: fp4_repack (NVFP4 / MXFP4 checkpoint tensors to the kernel layout), fp4_gemm.

Backends cpu / sim / cuda (see conftest). The GEMM is compared with the fp64 oracle
(fastinfer.reference.fp4.fp4_gemm) under the FlashAttention error rule, where the naive
implementation accumulates in the input precision (64-wide K chunks added in the input dtype).
Exactness: the decoded weight is checked bit for bit by multiplying with rows of the identity
(out[m, n] = W[n, m], a single nonzero product), over scales that cover the formats' ranges
(e4m3 subnormals to 448; e8m0 within the activation dtype's range), and the repacked layout is
compared with int4_pack's layout of the same codes and with a hand-worked word.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, backend_params, get_backend, make_gen, randn

import fastinfer.reference as ref
from fastinfer.reference import fp4 as rf

TOL_REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
GLOBAL_SCALE = 3.7


def make_weights(n, k, fmt, gen, wide=False):
    """Random codes uint8 [N, K] and checkpoint scale bits uint8 [N, K / G]. NVFP4: e4m3 of both
    signs (wide: every finite code, subnormals and 448 included; else 0.125 .. 8). MXFP4: e8m0
    exponents 122..131 (wide: 103..139, products from below fp16's smallest subnormal to 6 * 2^12;
    2..250 for bf16 is tested separately: no product overflows or is subnormal)."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    groups = k // rf.FP4_GROUP[fmt]
    if fmt == "nvfp4":
        lo, hi = (1, 0x7F) if wide else (0x28, 0x50)
        mag = torch.randint(lo, hi, (n, groups), generator=gen, dtype=torch.int32)
        sign = (torch.rand((n, groups), generator=gen) < 0.2).to(torch.int32) << 7
        scale = (mag | sign).to(torch.uint8)
    else:
        lo, hi = (103, 140) if wide else (122, 132)
        scale = torch.randint(lo, hi, (n, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    return codes, scale


def naive_gemm(a, codes, scales_t, fmt, global_scale):
    """Input-precision implementation: W rounded to a's dtype, 64-wide partial products and the
    running sum rounded to a's dtype, then divided by the global scale in a's dtype."""
    w = rf.fp4_gemm_weight(codes, scales_t, fmt, a.dtype).to(a.dtype)
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=a.dtype)
    for k0 in range(0, a.shape[1], 64):
        part = (a[:, k0:k0 + 64].float() @ w[:, k0:k0 + 64].float().t()).to(a.dtype)
        acc = (acc.float() + part.float()).to(a.dtype)
    if global_scale is not None:
        acc = (acc.float() / global_scale.float()).to(a.dtype)
    return acc


def _to(dev, *ts):
    return [None if t is None else t.to(dev) for t in ts]


def _gs(with_global):
    return torch.tensor([GLOBAL_SCALE], dtype=torch.float32) if with_global else None


# (M, N, K, format, global scale). N multiple of 16, K of 64; odd M on purpose. M = 1 and 3 split K
# (the sim's SM count leaves tiles idle), M = 100 (two 64-row blocks, partial) runs one split.
SIM_CASES = [
    (1, 48, 256, "nvfp4", True),
    (1, 144, 128, "mxfp4", False),   # partial 128-column CTA tile
    (3, 32, 192, "mxfp4", False),
    (17, 64, 128, "nvfp4", False),
    (100, 32, 128, "nvfp4", True),
]
CPU_CASES = SIM_CASES + [(1, 256, 1024, "mxfp4", False), (33, 80, 512, "nvfp4", True), (520, 272, 128, "mxfp4", False)]


@pytest.mark.parametrize(
    "backend,dtype,m,n,k,fmt,with_global",
    backend_params({"cpu": CPU_CASES, "sim": SIM_CASES, "cuda": CPU_CASES}),
)
def test_fp4_gemm_vs_reference(backend, dtype, m, n, k, fmt, with_global):
    be = get_backend(backend)
    gen = make_gen(2000 + m + n + k)
    codes, scale = make_weights(n, k, fmt, gen)
    gs = _gs(with_global)
    a = randn((m, k), dtype, gen=gen)

    def run():
        w = be.ns.fp4_repack(rf.fp4_pack(codes).to(be.device), scale.to(be.device))
        return be.ns.fp4_gemm(*_to(be.device, a, w[0], w[1], gs), fmt, False)

    out = be.run(run)
    assert out.dtype == dtype and out.shape == (m, n)
    scales_t = scale.t().contiguous()
    expect = rf.fp4_gemm(a, codes, scales_t, gs, fmt)
    assert_fa_close(out, expect, naive_gemm(a, codes, scales_t, fmt, gs), rel_tol=TOL_REL[dtype], floor=1e-5)


@pytest.mark.parametrize(
    "backend,dtype,fmt,m",
    backend_params({"cpu": [("nvfp4", 64), ("mxfp4", 64)],
                    "sim": [("nvfp4", 64), ("mxfp4", 64), ("nvfp4", 17)],
                    "cuda": [("nvfp4", 64), ("mxfp4", 64), ("nvfp4", 17)]}),
)
def test_fp4_gemm_decoded_weight_is_exact(backend, dtype, fmt, m):
    """a = the first m rows of the identity: out[r, n] = W[n, r] with one nonzero product, so the
    in-register decode (prmt tables, sign, scale conversion, one rounding) must equal the oracle's
    weight bit for bit, over scales that span the format's range."""
    be = get_backend(backend)
    n, k = 48, 128
    gen = make_gen(70 + m)
    codes, scale = make_weights(n, k, fmt, gen, wide=True)
    if fmt == "mxfp4" and dtype != torch.float16:
        scale = torch.randint(2, 251, scale.shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    a = torch.eye(k, dtype=dtype)[:m].contiguous()
    out = be.run(lambda: be.ns.fp4_gemm(*_to(be.device, a, *be.ns.fp4_repack(rf.fp4_pack(codes).to(be.device),
                                                                            scale.to(be.device)), None), fmt, False))
    w = rf.fp4_gemm_weight(codes, scale.t().contiguous(), fmt, dtype).to(dtype)
    expect = w[:, :m].t().contiguous()
    # equal values (a weight of -0.0, code 8, sums to +0.0)
    bad = (out.cpu() != expect) | out.cpu().isnan()
    assert not bad.any(), f"{int(bad.sum())} weights differ; first at {tuple(bad.nonzero()[0].tolist())}"
    assert (expect != 0).sum() > expect.numel() // 2, "the test needs nonzero weights"


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_repack_layout(backend, fmt):
    """The packed codes are int4_pack's layout of the codes; the scales are transposed."""
    be = get_backend(backend)
    gen = make_gen(5)
    codes, scale = make_weights(48, 192, fmt, gen)
    packed, scales = be.ns.fp4_repack(rf.fp4_pack(codes).to(be.device), scale.to(be.device))
    assert packed.dtype == torch.int32 and packed.shape == (192 // 64, 8 * 48)
    assert torch.equal(packed.cpu(), ref.int4_pack(codes))
    assert scales.dtype == torch.uint8 and torch.equal(scales.cpu(), scale.t().contiguous())


def test_fp4_repack_hand_worked_word():
    """The reference module's hand-worked row [1.0, -6.0, 0.5, 3.0] -> codes [2, 15, 1, 5] ->
    checkpoint bytes [0xF2, 0x51] (the even element in the low nibble), as row 0, k 0..3 of a
    16 x 64 weight. In the kernel layout (gemm/int4.h) k = 2 t + e of row g = 0 sits in word
    4 * lane + 0, lane = t, nibble 4 e: k 0, 1 -> word 0 nibbles 0, 4 = 0x000F0002; k 2, 3 -> word 4
    (lane 1) nibbles 0, 4 = 0x00050001."""
    row = torch.tensor([1.0, -6.0, 0.5, 3.0])
    codes = rf.e2m1_encode(row)
    assert codes.tolist() == [2, 15, 1, 5]
    weight_packed = torch.zeros(16, 32, dtype=torch.uint8)
    weight_packed[0, :2] = torch.tensor([0xF2, 0x51], dtype=torch.uint8)
    assert torch.equal(rf.fp4_pack(codes), weight_packed[0, :2])
    packed, _ = torch.ops.fastinfer.fp4_repack(weight_packed, torch.full((16, 4), 0x38, dtype=torch.uint8))
    words = packed.view(-1)
    assert words[0].item() == 0x000F0002 and words[4].item() == 0x00050001
    assert int((words != 0).sum()) == 2


@pytest.mark.parametrize(
    "backend,dtype,fmt",
    backend_params({"cpu": [("nvfp4",), ("mxfp4",)], "sim": [("nvfp4",)], "cuda": [("nvfp4",), ("mxfp4",)]}),
)
def test_fp4_gemm_deterministic_is_batch_invariant(backend, dtype, fmt):
    """deterministic=True: a row's bits do not depend on M (the first rows of a batch equal the
    same rows run alone)."""
    be = get_backend(backend)
    gen = make_gen(41)
    n, k = 32, 512
    codes, scale = make_weights(n, k, fmt, gen)
    gs = _gs(fmt == "nvfp4")
    a = randn((19, k), dtype, gen=gen)
    w = be.ns.fp4_repack(rf.fp4_pack(codes).to(be.device), scale.to(be.device))

    def run(rows):
        return be.run(lambda: be.ns.fp4_gemm(*_to(be.device, a[:rows].contiguous(), w[0], w[1], gs), fmt, True))

    full = run(19)
    for rows in (1, 3):
        assert_bits_equal(run(rows).cpu(), full[:rows].cpu(), f"deterministic fp4_gemm, M={rows}")
    expect = rf.fp4_gemm(a, codes, scale.t().contiguous(), gs, fmt)
    assert_fa_close(full, expect, naive_gemm(a, codes, scale.t().contiguous(), fmt, gs), rel_tol=TOL_REL[dtype],
                    floor=1e-5)


# ---- opcheck -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_fp4_opcheck(ns):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    gen = make_gen(4)
    n, k = 32, 128
    cases = []
    for fmt in ("nvfp4", "mxfp4"):
        codes, scale = make_weights(n, k, fmt, gen)
        weight_packed = rf.fp4_pack(codes)
        packed, scales = be.ns.fp4_repack(weight_packed, scale)
        a = randn((3, k), torch.bfloat16, gen=gen)
        cases += [("fp4_repack", (weight_packed, scale)),
                  ("fp4_gemm", (a, packed, scales, _gs(fmt == "nvfp4"), fmt, False))]
    for op, args in cases:
        torch.library.opcheck(getattr(be.ns, op).default, args)


# ---- bad inputs ------------------------------------------------------------------------------------


def _gemm_args(fmt="nvfp4", dtype=torch.bfloat16, m=2, n=32, k=128):
    gen = make_gen(9)
    codes, scale = make_weights(n, k, fmt, gen)
    packed, scales = torch.ops.fastinfer.fp4_repack(rf.fp4_pack(codes), scale)
    return dict(a=randn((m, k), dtype, gen=gen), packed=packed, scales=scales, global_scale=_gs(fmt == "nvfp4"),
                format=fmt)


def _call_gemm(ns, **over):
    args = _gemm_args(over.pop("fmt", "nvfp4"))
    args.update(over)
    return ns.fp4_gemm(args["a"], args["packed"], args["scales"], args["global_scale"], args["format"], False)


BAD_GEMM = [
    ("a_dtype", lambda d: dict(a=d["a"].to(torch.int32)), r"a must have dtype in"),
    ("a_fp64", lambda d: dict(a=d["a"].double()), r"a must have dtype in"),
    ("a_3d", lambda d: dict(a=d["a"].unsqueeze(0)), r"a must be 2-D"),
    ("k_mismatch", lambda d: dict(a=d["a"][:, :64].contiguous()), r"packed must have shape \[K / 64"),
    ("k_not_tile", lambda d: dict(a=torch.ones(2, 96, dtype=torch.bfloat16)), r"multiple of 64 .*minimum tile"),
    ("packed_n_not_tile", lambda d: dict(packed=d["packed"][:, :8 * 24].contiguous()), r"N a multiple of 16.*minimum tile"),
    ("packed_dtype", lambda d: dict(packed=d["packed"].to(torch.int64)), r"packed must have dtype in"),
    ("format", lambda d: dict(format="fp4"), r"format must be 'nvfp4' or 'mxfp4'"),
    ("scales_dtype", lambda d: dict(scales=d["scales"].to(torch.int32)), r"scales must have dtype in"),
    ("scales_shape", lambda d: dict(scales=d["scales"][:4].contiguous()), r"scales must have shape \[K / 16, N\]"),
    ("scales_group_of_other_format", lambda d: dict(format="mxfp4", global_scale=None),
     r"scales must have shape \[K / 32, N\]"),
    ("global_with_mxfp4", lambda d: dict(fmt="mxfp4", global_scale=torch.ones(1)),
     r"global_scale is only defined for format='nvfp4'"),
    ("global_dtype", lambda d: dict(global_scale=torch.ones(1, dtype=torch.float64)), r"global_scale must have dtype in"),
    ("global_shape", lambda d: dict(global_scale=torch.ones(2)), r"global_scale must have shape \[1\]"),
    ("e8m0_nan", lambda d: dict(fmt="mxfp4", global_scale=None,
                                scales=torch.full((4, 32), 255, dtype=torch.uint8)), r"scales values must be in \[0, 255\)"),
    ("a_noncontig", lambda d: dict(a=torch.cat([d["a"], d["a"]], 1)[:, ::2]), r"a must be contiguous"),
    ("scales_noncontig", lambda d: dict(scales=d["scales"].t().contiguous().t()), r"scales must be contiguous"),
    ("packed_device", lambda d: dict(packed=d["packed"].to("meta")), r"packed must be on the device of a"),
    ("global_device", lambda d: dict(global_scale=d["global_scale"].to("meta")), r"global_scale must be on the device of a"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,override,arg_re", BAD_GEMM, ids=[c[0] for c in BAD_GEMM])
def test_fp4_gemm_bad_input(ns, case, override, arg_re):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        _call_gemm(be.ns, **override(_gemm_args()))
    assert f"{ns}.fp4_gemm" in str(exc.value)


def test_fp4_gemm_sim_rejects_fp32():
    get_backend("sim")
    d = _gemm_args(dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"a must have dtype in \{Half, BFloat16\}"):
        _call_gemm(torch.ops.fastinfer_sim, a=d["a"])


BAD_REPACK = [
    (lambda: (torch.zeros(32, 64, dtype=torch.int32), torch.zeros(32, 8, dtype=torch.uint8)),
     r"weight_packed must have dtype in"),
    (lambda: (torch.zeros(24, 64, dtype=torch.uint8), torch.zeros(24, 8, dtype=torch.uint8)),
     r"N \(output features\) must be a positive multiple of 16"),
    (lambda: (torch.zeros(32, 48, dtype=torch.uint8), torch.zeros(32, 6, dtype=torch.uint8)),
     r"K \(input features\) must be a positive multiple of 64"),
    (lambda: (torch.zeros(32, 64, dtype=torch.uint8), torch.zeros(32, 5, dtype=torch.uint8)),
     r"weight_scale must have shape \[N, K / 16\] \(NVFP4\) or \[N, K / 32\] \(MXFP4\)"),
    (lambda: (torch.zeros(32, 64, dtype=torch.uint8), torch.zeros(32, 8, dtype=torch.float32)),
     r"weight_scale must have dtype in"),
    (lambda: (torch.zeros(32, 64, dtype=torch.uint8), torch.zeros(32, 8, dtype=torch.uint8, device="meta")),
     r"weight_scale must be on the device of weight_packed"),
    (lambda: (torch.zeros(32 * 64, dtype=torch.uint8), torch.zeros(32, 8, dtype=torch.uint8)),
     r"weight_packed must be 2-D"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("i", range(len(BAD_REPACK)))
def test_fp4_repack_bad_input(ns, i):
    be = get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    make, arg_re = BAD_REPACK[i]
    with pytest.raises(RuntimeError, match=arg_re):
        be.ns.fp4_repack(*make())


# ---- python wrappers -----------------------------------------------------------------------------


def test_python_wrappers_accept_float8_scales():
    """fp4_repack takes the checkpoint's float8_e4m3fn scales (compressed-tensors' dtype) as bits."""
    import fastinfer.ops as ops

    gen = make_gen(2)
    codes, scale = make_weights(32, 128, "nvfp4", gen)
    w = ops.fp4_repack(rf.fp4_pack(codes), scale.view(torch.float8_e4m3fn))
    assert torch.equal(w.scales, scale.t().contiguous())
    a = randn((3, 128), torch.float32, gen=gen)
    gs = _gs(True)
    out = ops.fp4_gemm(a, w.packed, w.scales, gs, "nvfp4")
    w_ct = rf.nvfp4_dequantize(rf.fp4_pack(codes), scale.view(torch.float8_e4m3fn), gs)
    assert torch.allclose(out.double(), a.double() @ w_ct.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp4_gemm_empty_batch(backend):
    be = get_backend(backend)
    codes, scale = make_weights(32, 128, "mxfp4", make_gen(6))
    packed, scales = be.ns.fp4_repack(rf.fp4_pack(codes).to(be.device), scale.to(be.device))
    out = be.ns.fp4_gemm(torch.empty(0, 128, dtype=torch.bfloat16, device=be.device), packed, scales, None, "mxfp4",
                         False)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


@pytest.mark.compile
def test_fp4_linear_compiles_fullgraph_dynamic():
    """fp4_gemm under torch.compile(fullgraph, dynamic M): the fake impls trace with symbolic
    sizes and the compiled result equals eager bit for bit."""
    import fastinfer.ops as ops

    get_backend("cpu")
    torch._dynamo.reset()
    gen = make_gen(31)
    codes, scale = make_weights(64, 128, "nvfp4", gen)
    w = ops.fp4_repack(rf.fp4_pack(codes), scale)
    gs = _gs(True)

    def linear(x):
        return ops.fp4_gemm(x, w.packed, w.scales, gs, "nvfp4")

    compiled = torch.compile(linear, fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (3, 5):
        x = randn((m, 128), torch.float32, gen=gen)
        assert_bits_equal(compiled(x), linear(x), f"compiled fp4 linear, M={m}")
