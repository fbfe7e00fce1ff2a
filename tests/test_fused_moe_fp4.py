"""fused_moe_fp4 (NVFP4 / MXFP4 W4A16 experts in fp4_repack's layout, with NVFP4's global divisors)
against the fp64 oracle of ``fastinfer.reference.moe`` (which unpacks with the reference unpacker and
decodes with ``fastinfer.reference.fp4.fp4_gemm_weight``) and against transformers' Mixtral block
run on the decoded weights: the CPU implementation, the CUDA kernels in the simt emulator (both
tiers, two schedules, identical bits) and on a GPU (-m cuda)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, backend_params, get_backend, make_gen
import fastinfer.ops as ops
import fastinfer.reference.moe as RM
from fastinfer.reference import fp4 as rf
from test_fused_moe import make_case, naive_fused_moe, run as run_variant


def quantize_fp4(w, fmt):
    """[N, K] float -> (codes uint8 [N, K], scale bits uint8 [N, K / G]): per group of G the scale
    amax / 6 (NVFP4: rounded to e4m3; MXFP4: the e8m0 power of two at or above it), then each value
    / scale rounded to the nearest e2m1 value."""
    G = rf.FP4_GROUP[fmt]
    n, k = w.shape
    groups = w.double().reshape(n, k // G, G)
    amax = groups.abs().amax(-1).clamp(min=1e-6) / 6.0
    if fmt == "nvfp4":
        bits = amax.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        bits = (torch.ceil(torch.log2(amax)) + 127).clamp(1, 254).to(torch.uint8)
    s = rf.fp4_scale_values(bits, fmt)
    table = torch.tensor(rf.E2M1_VALUES, dtype=torch.float64)
    v = groups / s[..., None]
    mag = (v.abs()[..., None] - table).abs().argmin(-1).to(torch.uint8)
    codes = mag | (torch.signbit(v).to(torch.uint8) << 3)
    return codes.reshape(n, k), bits


def quantize_experts(w, fmt, global_scale=None):
    """[E, N, K] float -> (packed int32 [E, K/64, 8N], scale bits uint8 [E, K/G, N]) by fp4_repack of
    each expert; with global_scale [E, halves] each half of the rows is quantised times its divisor."""
    packed, scales = [], []
    for e in range(w.shape[0]):
        we = w[e].double()
        if global_scale is not None:
            halves = global_scale.shape[1]
            we = we * global_scale[e].double().repeat_interleave(w.shape[1] // halves)[:, None]
        codes, bits = quantize_fp4(we, fmt)
        p = ops.fp4_repack(rf.fp4_pack(codes), bits)
        packed.append(p.packed)
        scales.append(p.scales)
    return torch.stack(packed), torch.stack(scales)


def make_fp4_case(T, E, k, H, I, activation, bias, skipped, fmt, with_global, dtype, seed):
    args = make_case(T, E, k, H, I, activation, bias, skipped, dtype, seed)
    g13 = g2 = None
    if with_global:
        gen = make_gen(seed + 1)
        g13 = (torch.rand(E, 2, generator=gen) * 400 + 50).float()
        g2 = (torch.rand(E, generator=gen) * 400 + 50).float()
    args["w13"], args["w13_scales"] = quantize_experts(args["w13"], fmt, g13)
    args["w2"], args["w2_scales"] = quantize_experts(args["w2"], fmt, None if g2 is None else g2[:, None])
    args["w13_global_scale"], args["w2_global_scale"] = g13, g2
    args["format"] = fmt
    return args


def decoded(args):
    """fused_moe's arguments for the same layer: the experts decoded (rounded to x's dtype) and
    divided by their global scales."""
    out = {n: v for n, v in args.items() if not (n.endswith("_scales") or n.endswith("_global_scale") or n == "format")}
    W13 = RM.fp4_expert_weights(args["w13"], args["w13_scales"], args["format"], args["x"].dtype)
    W2 = RM.fp4_expert_weights(args["w2"], args["w2_scales"], args["format"], args["x"].dtype)
    if args["w13_global_scale"] is not None:
        W13 = W13 / args["w13_global_scale"].double().repeat_interleave(W13.shape[1] // 2, dim=1)[:, :, None]
        W2 = W2 / args["w2_global_scale"].double()[:, None, None]
    out["w13"], out["w2"] = W13.to(args["x"].dtype), W2.to(args["x"].dtype)
    return out


def run(args, be=None):
    return run_variant(args, be, op=ops.fused_moe_fp4)


# (T, E, k, H, I, activation, bias, skipped, format, global scales)
CASES = [
    (1, 8, 2, 128, 64, "silu", False, False, "nvfp4", True),
    (37, 8, 2, 256, 128, "silu", True, True, "mxfp4", False),
    (37, 60, 4, 128, 192, "swiglu_oai", True, False, "mxfp4", False),
    (37, 32, 4, 128, 64, "silu", False, False, "nvfp4", False),
    (5, 8, 2, 192, 64, "swiglu_oai", True, False, "nvfp4", True),
]
# the 64-row tier (rows per expert > 16; no 128-row tier for 4-bit experts)
MEDIUM = [(200, 2, 2, 128, 128, "silu", True, False, "nvfp4", True)]
PARAMS = backend_params({"cpu": CASES + MEDIUM, "sim": CASES + MEDIUM, "cuda": CASES + MEDIUM},
                        {"cpu": (torch.float32, torch.bfloat16, torch.float16), "sim": (torch.bfloat16, torch.float16),
                         "cuda": (torch.bfloat16, torch.float16)})


@pytest.mark.parametrize("backend,dtype,T,E,k,H,I,activation,bias,skipped,fmt,with_global", PARAMS)
def test_fused_moe_fp4_matches_reference(backend, dtype, T, E, k, H, I, activation, bias, skipped, fmt, with_global):
    be = get_backend(backend)
    args = make_fp4_case(T, E, k, H, I, activation, bias, skipped, fmt, with_global, dtype, seed=T + E + k)
    out = run(args, be)
    assert out.dtype == dtype and out.shape == (T, H)
    ref = RM.fused_moe_fp4(**args)
    assert_fa_close(out, ref, naive_fused_moe(**decoded(args)), name=f"{backend} {dtype} T{T} E{E} {fmt}")


def test_fp4_experts_approximate_the_float_layer():
    """The quantisation itself (the test can fail: scales of the wrong expert or row, or a global
    scale ignored, give errors of order 1 or more): e2m1 groups on Gaussian weights keep the two
    GEMMs within ~25%."""
    full = RM.fused_moe(**make_case(37, 8, 2, 256, 128, "silu", False, False, torch.float32, seed=5))
    for fmt, with_global in (("nvfp4", True), ("nvfp4", False), ("mxfp4", False)):
        args = make_fp4_case(37, 8, 2, 256, 128, "silu", False, False, fmt, with_global, torch.float32, seed=5)
        err = ((run(args).double() - full).norm() / full.norm()).item()
        assert 1e-3 < err < 0.25, (fmt, with_global, err)


def test_decoded_weight_hand_worked():
    """The oracle's decode of one NVFP4 expert by hand: row 0 holds codes [2, 15] (1.0, -6.0) in its
    first 16-group, whose e4m3 scale is 0x40 (2.0); every other scale is 0x38 (1.0) and every other
    code 0: W[0][0] = 2, W[0][1] = -12, the rest 0 (the unpacker reads fp4_repack's layout back)."""
    codes = torch.zeros(32, 64, dtype=torch.uint8)
    codes[0, 0], codes[0, 1] = 2, 15
    bits = torch.full((32, 4), 0x38, dtype=torch.uint8)
    bits[0, 0] = 0x40
    p = ops.fp4_repack(rf.fp4_pack(codes), bits)
    W = RM.fp4_expert_weights(p.packed[None], p.scales[None], "nvfp4", torch.float32)[0]
    expected = torch.zeros(32, 64, dtype=torch.float64)
    expected[0, 0], expected[0, 1] = 2.0, -12.0
    assert torch.equal(W, expected)


def test_matches_transformers_mixtral_block():
    """MixtralSparseMoeBlock (fp32) with its experts replaced by the decoded NVFP4 weights."""
    get_backend("cpu")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    H, I, E, k, T = 256, 128, 8, 2, 37
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                num_experts_per_tok=k)).eval()
    g = make_gen(12)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        g13 = torch.full((E, 2), 200.0)
        g2 = torch.full((E,), 300.0)
        w13, s13 = quantize_experts(block.experts.gate_up_proj, "nvfp4", g13)
        w2, s2 = quantize_experts(block.experts.down_proj, "nvfp4", g2[:, None])
        block.experts.gate_up_proj.copy_(RM.fp4_expert_weights(w13, s13, "nvfp4", torch.float32) / 200.0)
        block.experts.down_proj.copy_(RM.fp4_expert_weights(w2, s2, "nvfp4", torch.float32) / 300.0)
        x = torch.randn(T, H, generator=g)
        expected = block(x[None])[0]
        logits, _, _ = block.gate(x)
    weights, ids = ops.moe_topk(logits, k, True)
    out = ops.fused_moe_fp4(x, w13, w2, s13, s2, g13, g2, weights, ids, "nvfp4")
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_batch_invariance():
    args = make_fp4_case(37, 8, 2, 128, 64, "silu", True, False, "nvfp4", True, torch.bfloat16, seed=9)
    batch = run(args)
    for t in (0, 5, 36):
        alone = dict(args, x=args["x"][t:t + 1], topk_weights=args["topk_weights"][t:t + 1],
                     topk_ids=args["topk_ids"][t:t + 1])
        assert_bits_equal(run(alone), batch[t:t + 1], f"token {t}")


@pytest.mark.parametrize("fmt,with_global", [("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_fused_moe_fp4_opcheck(ns, fmt, with_global):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    a = make_fp4_case(5, 8, 2, 128, 64, "swiglu_oai", True, True, fmt, with_global, torch.bfloat16, seed=5)
    positional = (a["x"], a["w13"], a["w2"], a["w13_scales"], a["w2_scales"], a["w13_global_scale"],
                  a["w2_global_scale"], a["topk_weights"], a["topk_ids"], fmt, "swiglu_oai", a["swiglu_alpha"],
                  a["swiglu_limit"], a["w13_bias"], a["w2_bias"])
    torch.library.opcheck(getattr(torch.ops, ns).fused_moe_fp4.default, positional)


def bad(fmt="nvfp4", with_global=True, **changes):
    def make():
        args = make_fp4_case(4, 8, 2, 128, 64, "silu", False, False, fmt, with_global, torch.bfloat16, seed=1)
        for name, value in changes.items():
            args[name] = value(args) if callable(value) else value
        return args
    return make


BAD = [
    ("format", bad(format="fp4"), "format"),
    ("w13-dtype", bad(w13=lambda a: a["w13"].float()), "w13"),
    ("w13-shape", bad(w13=lambda a: a["w13"][:, :, :512].contiguous()), "w13"),
    ("w2-shape", bad(w2=lambda a: a["w2"][:4].contiguous()), "w2"),
    ("w2-noncontiguous", bad(w2=lambda a: a["w2"].repeat(1, 1, 2)[:, :, ::2]), "w2"),
    ("scales-dtype", bad(w13_scales=lambda a: a["w13_scales"].float()), "w13_scales"),
    ("scales-shape-nvfp4", bad(w2_scales=lambda a: a["w2_scales"][:, :2].contiguous()), "w2_scales"),
    ("scales-of-mxfp4-for-nvfp4", bad(format="mxfp4", w13_global_scale=None, w2_global_scale=None), "w13_scales"),
    ("mxfp4-nan-scale", bad(fmt="mxfp4", with_global=False, w13_scales=lambda a: a["w13_scales"].clone().fill_(255)),
     "w13_scales"),
    ("global-shape", bad(w13_global_scale=lambda a: a["w13_global_scale"][:, 0].contiguous()), "w13_global_scale"),
    ("global-dtype", bad(w2_global_scale=lambda a: a["w2_global_scale"].double()), "w2_global_scale"),
    ("global-one-sided", bad(w2_global_scale=None), "global_scale"),
    ("global-with-mxfp4", bad(fmt="mxfp4", with_global=False, w13_global_scale=torch.ones(8, 2),
                              w2_global_scale=torch.ones(8)), "w13_global_scale"),
    ("hidden-not-64", bad(x=lambda a: a["x"][:, :96].contiguous()), "hidden"),
    ("ids-out-of-range", bad(topk_ids=lambda a: a["topk_ids"].clone().fill_(8)), "topk_ids"),
    ("x-dtype", bad(x=lambda a: a["x"].to(torch.int32)), "x"),
    ("activation", bad(activation="gelu"), "activation"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,make,arg_re", BAD, ids=[b[0] for b in BAD])
def test_bad_input(ns, case, make, arg_re):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        ops.fused_moe_fp4(**make(), lib=getattr(torch.ops, ns))
    assert f"{ns}.fused_moe_fp4:" in str(exc.value)


@pytest.mark.parametrize("backend", [pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fmt,with_global", [("nvfp4", True), ("mxfp4", False)])
def test_batch_invariance_across_tile_tiers(backend, fmt, with_global):
    """A token alone (16-row blocks) and among 200 tokens on 2 experts (64-row blocks): the same bits."""
    be = get_backend(backend)
    args = make_fp4_case(200, 2, 2, 128, 128, "swiglu_oai", True, False, fmt, with_global, torch.bfloat16, seed=13)
    batch = run(args, be)
    for t in (0, 77, 199):
        alone = dict(args, x=args["x"][t:t + 1], topk_weights=args["topk_weights"][t:t + 1],
                     topk_ids=args["topk_ids"][t:t + 1])
        assert_bits_equal(run(alone, be), batch[t:t + 1], f"token {t} alone vs among 200")
