"""fused_moe_int4 (INT4 W4A16 experts in int4_pack's layout, group scales, optional zero points)
against the fp64 oracle of ``fastinfer.reference.moe`` (which unpacks with the reference unpacker
and dequantises with ``fastinfer.reference.gemm.int4_dequantize``), and against transformers'
Mixtral block run on the dequantised weights: the CPU implementation, the CUDA kernels in the simt
emulator (both tiers, two schedules, identical bits) and on a GPU (-m cuda)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, assert_fa_close, backend_params, get_backend, make_gen
import fastinfer.ops as ops
import fastinfer.reference.moe as RM
from fastinfer.reference.gemm import quantize_int4
from test_fused_moe import make_case, naive_fused_moe, run as run_variant


def quantize_experts(w, group_size, symmetric):
    """[E, N, K] float -> (packed int32 [E, K/64, 8N], scales [E, K/G, N], zeros [E, K/G, N] or None):
    round-to-nearest group quantisation of each expert, packed by int4_pack."""
    packed, scales, zeros = [], [], []
    for e in range(w.shape[0]):
        q, s, z = quantize_int4(w[e], group_size, symmetric)
        packed.append(torch.ops.fastinfer.int4_pack(q))
        scales.append(s)
        zeros.append(z)
    return torch.stack(packed), torch.stack(scales), None if symmetric else torch.stack(zeros)


def make_int4_case(T, E, k, H, I, activation, bias, skipped, symmetric, group_size, dtype, seed):
    args = make_case(T, E, k, H, I, activation, bias, skipped, dtype, seed)
    args["w13"], args["w13_scales"], args["w13_zeros"] = quantize_experts(args["w13"], group_size, symmetric)
    args["w2"], args["w2_scales"], args["w2_zeros"] = quantize_experts(args["w2"], group_size, symmetric)
    args["group_size"] = group_size
    return args


def dequantized(args):
    """fused_moe's arguments for the same layer: the experts dequantised (rounded to x's dtype)."""
    out = {n: v for n, v in args.items() if not (n.endswith("_scales") or n.endswith("_zeros") or n == "group_size")}
    for name in ("w13", "w2"):
        out[name] = RM.int4_expert_weights(args[name], args[name + "_scales"], args[name + "_zeros"],
                                           args["group_size"], args["x"].dtype)
    return out


def run(args, be=None):
    return run_variant(args, be, op=ops.fused_moe_int4)


# (T, E, k, H, I, activation, bias, skipped, symmetric, group_size)
CASES = [
    (1, 8, 2, 128, 64, "silu", False, False, True, 64),
    (37, 8, 2, 256, 128, "silu", True, True, False, 128),
    (37, 60, 4, 128, 192, "swiglu_oai", True, False, True, 64),
    (37, 32, 4, 128, 64, "silu", False, False, False, 32),
]
# the 64-row tier (rows per expert > 16; int4 has no 128-row tier)
MEDIUM = [(200, 2, 2, 128, 128, "silu", True, False, False, 32)]
PARAMS = backend_params({"cpu": CASES, "sim": CASES + MEDIUM, "cuda": CASES + MEDIUM},
                        {"cpu": (torch.float32, torch.bfloat16, torch.float16), "sim": (torch.bfloat16, torch.float16),
                         "cuda": (torch.bfloat16, torch.float16)})


@pytest.mark.parametrize("backend,dtype,T,E,k,H,I,activation,bias,skipped,symmetric,group_size", PARAMS)
def test_fused_moe_int4_matches_reference(backend, dtype, T, E, k, H, I, activation, bias, skipped, symmetric,
                                          group_size):
    be = get_backend(backend)
    args = make_int4_case(T, E, k, H, I, activation, bias, skipped, symmetric, group_size, dtype, seed=T + E + k)
    out = run(args, be)
    assert out.dtype == dtype and out.shape == (T, H)
    ref = RM.fused_moe_int4(**args)
    assert_fa_close(out, ref, naive_fused_moe(**dequantized(args)), name=f"{backend} {dtype} T{T} E{E} g{group_size}")


def test_int4_experts_approximate_the_float_layer():
    """The quantisation itself (the test can fail: scales of the wrong expert, or the zero points
    ignored, give errors of order 1): round-to-nearest 4-bit groups of 32 on Gaussian weights keep
    the two GEMMs within ~20%."""
    for symmetric in (True, False):
        args = make_int4_case(37, 8, 2, 256, 128, "silu", False, False, symmetric, 32, torch.float32, seed=5)
        full = RM.fused_moe(**make_case(37, 8, 2, 256, 128, "silu", False, False, torch.float32, seed=5))
        err = ((run(args).double() - full).norm() / full.norm()).item()
        assert 1e-3 < err < 0.25, err


def test_int4_matches_transformers_mixtral_block():
    """MixtralSparseMoeBlock (fp32) with its experts replaced by the dequantised int4 weights."""
    get_backend("cpu")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    H, I, E, k, T, G = 256, 128, 8, 2, 37, 64
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                num_experts_per_tok=k)).eval()
    g = make_gen(12)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        w13, s13, z13 = quantize_experts(block.experts.gate_up_proj, G, False)
        w2, s2, z2 = quantize_experts(block.experts.down_proj, G, False)
        block.experts.gate_up_proj.copy_(RM.int4_expert_weights(w13, s13, z13, G, torch.float32))
        block.experts.down_proj.copy_(RM.int4_expert_weights(w2, s2, z2, G, torch.float32))
        x = torch.randn(T, H, generator=g)
        expected = block(x[None])[0]
        logits, _, _ = block.gate(x)
    weights, ids = ops.moe_topk(logits, k, True)
    out = ops.fused_moe_int4(x, w13, w2, s13, s2, z13, z2, weights, ids, G)
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_batch_invariance():
    args = make_int4_case(37, 8, 2, 128, 64, "silu", True, False, False, 64, torch.bfloat16, seed=9)
    batch = run(args)
    for t in (0, 5, 36):
        alone = dict(args, x=args["x"][t:t + 1], topk_weights=args["topk_weights"][t:t + 1],
                     topk_ids=args["topk_ids"][t:t + 1])
        assert_bits_equal(run(alone), batch[t:t + 1], f"token {t}")


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
def test_fused_moe_int4_opcheck(ns, symmetric):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    a = make_int4_case(5, 8, 2, 128, 64, "swiglu_oai", True, True, symmetric, 64, torch.bfloat16, seed=5)
    positional = (a["x"], a["w13"], a["w2"], a["w13_scales"], a["w2_scales"], a["w13_zeros"], a["w2_zeros"],
                  a["topk_weights"], a["topk_ids"], 64, "swiglu_oai", a["swiglu_alpha"], a["swiglu_limit"],
                  a["w13_bias"], a["w2_bias"])
    torch.library.opcheck(getattr(torch.ops, ns).fused_moe_int4.default, positional)


def bad(symmetric=False, **changes):
    def make():
        args = make_int4_case(4, 8, 2, 128, 64, "silu", False, False, symmetric, 64, torch.bfloat16, seed=1)
        for name, value in changes.items():
            args[name] = value(args) if callable(value) else value
        return args
    return make


BAD = [
    ("w13-dtype", bad(w13=lambda a: a["w13"].float()), "w13"),
    ("w13-shape", bad(w13=lambda a: a["w13"][:, :, :512].contiguous()), "w13"),
    ("w2-shape", bad(w2=lambda a: a["w2"][:4].contiguous()), "w2"),
    ("scales-dtype", bad(w13_scales=lambda a: a["w13_scales"].float()), "w13_scales"),
    ("scales-shape", bad(w2_scales=lambda a: a["w2_scales"][:, :, :64].contiguous()), "w2_scales"),
    ("zeros-dtype", bad(w13_zeros=lambda a: a["w13_zeros"].int()), "w13_zeros"),
    ("zeros-range", bad(w13_zeros=lambda a: a["w13_zeros"].clone().fill_(16)), "w13_zeros"),
    ("zeros-one-sided", bad(w2_zeros=None), "w2_zeros"),
    ("group-size", bad(group_size=48), "group_size"),
    ("group-size-not-dividing", bad(group_size=128), "group_size"),
    ("hidden-not-64", bad(x=lambda a: a["x"][:, :96].contiguous()), "hidden"),
    ("ids-out-of-range", bad(topk_ids=lambda a: a["topk_ids"].clone().fill_(8)), "topk_ids"),
    ("activation", bad(activation="gelu"), "activation"),
]


@pytest.mark.parametrize("ns", ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)])
@pytest.mark.parametrize("case,make,arg_re", BAD, ids=[b[0] for b in BAD])
def test_bad_input(ns, case, make, arg_re):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        ops.fused_moe_int4(**make(), lib=getattr(torch.ops, ns))
    assert f"{ns}.fused_moe_int4:" in str(exc.value)


@pytest.mark.parametrize("backend", [pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_batch_invariance_across_tile_tiers(backend):
    """A token alone (16-row blocks) and among 200 tokens on 2 experts (64-row blocks): the same bits."""
    be = get_backend(backend)
    args = make_int4_case(200, 2, 2, 128, 128, "swiglu_oai", True, False, False, 64, torch.bfloat16, seed=13)
    batch = run(args, be)
    for t in (0, 77, 199):
        alone = dict(args, x=args["x"][t:t + 1], topk_weights=args["topk_weights"][t:t + 1],
                     topk_ids=args["topk_ids"][t:t + 1])
        assert_bits_equal(run(alone, be), batch[t:t + 1], f"token {t} alone vs among 200")
