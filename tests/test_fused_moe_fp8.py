"""fused_moe_fp8 (FP8 experts, per-channel and 128 x 128 blockwise scales) against the fp64 oracle
of ``fastinfer.reference.moe`` and against transformers' Mixtral block run on the dequantised
weights; the CPU implementation, the CUDA kernels in the simt emulator and on a GPU (-m cuda).
The weights are quantised here with the checkpoints' rule (amax / 448 per row or per block)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_fa_close, assert_bits_equal, backend_params, get_backend, make_gen
import fastinfer.ops as ops
import fastinfer.reference.moe as RM
from test_fused_moe import make_case, run as run_variant


def quantize_experts(w, blockwise):
    """[E, N, K] -> (e4m3 weights, fp32 scales [E, N] or [E, N/128, K/128]) as FP8 checkpoints store them."""
    E, N, K = w.shape
    if blockwise:
        blocks = w.float().reshape(E, N // 128, 128, K // 128, 128)
        scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(E, N, K)
        return q, scale.contiguous()
    scale = w.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (w.float() / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale.contiguous()


def make_fp8_case(T, E, k, H, I, activation, bias, skipped, blockwise, dtype, seed):
    args = make_case(T, E, k, H, I, activation, bias, skipped, dtype, seed)
    args["w13"], args["w13_scale"] = quantize_experts(args["w13"], blockwise)
    args["w2"], args["w2_scale"] = quantize_experts(args["w2"], blockwise)
    return args


def naive_fused_moe_fp8(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu",
                        swiglu_alpha=None, swiglu_limit=None, w13_bias=None, w2_bias=None):
    """The obvious torch loop in x's dtype: x and a fake-quantised, the weights dequantised."""
    group = 128 if w13_scale.dim() == 3 else None
    dt, I = x.dtype, w13.shape[1] // 2
    W13 = RM._dequantize_experts(w13, w13_scale).to(dt)
    W2 = RM._dequantize_experts(w2, w2_scale).to(dt)
    xq = RM.fp8_fake_quantize(x, group).to(dt)
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for e in ids[ids >= 0].unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = F.linear(xq[tokens], W13[e], None if w13_bias is None else w13_bias[e])
        a = RM.expert_activation(h[:, :I], h[:, I:], activation, swiglu_alpha, swiglu_limit)
        y = F.linear(RM.fp8_fake_quantize(a, RM.ACT_GROUP).to(dt), W2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(dt))
    return out


def run(args, be=None):
    return run_variant(args, be, op=ops.fused_moe_fp8)


# (T, E, k, H, I, activation, bias, skipped, blockwise)
CASES = [
    (1, 8, 2, 256, 128, "silu", False, False, False),
    (37, 8, 2, 256, 128, "silu", True, True, False),
    (37, 60, 4, 128, 256, "swiglu_oai", True, False, False),
    (1, 8, 2, 256, 128, "silu", False, False, True),
    (37, 8, 2, 256, 128, "silu", False, True, True),
    (37, 60, 4, 128, 256, "swiglu_oai", True, False, True),
    (200, 2, 2, 256, 128, "silu", False, False, True),
]
# where float weights take the 128-row tier (e4m3 stays on 64-row blocks: registers)
LARGE = [(1100, 2, 2, 1024, 16, "silu", True, False, False)]
PARAMS = backend_params({"cpu": CASES, "sim": CASES + LARGE, "cuda": CASES + LARGE},
                        {"cpu": (torch.float32, torch.bfloat16), "sim": (torch.bfloat16, torch.float16),
                         "cuda": (torch.bfloat16, torch.float16)})


@pytest.mark.parametrize("backend,dtype,T,E,k,H,I,activation,bias,skipped,blockwise", PARAMS)
def test_fused_moe_fp8_matches_reference(backend, dtype, T, E, k, H, I, activation, bias, skipped, blockwise):
    be = get_backend(backend)
    args = make_fp8_case(T, E, k, H, I, activation, bias, skipped, blockwise, dtype, seed=T + E + k + blockwise)
    out = run(args, be)
    assert out.dtype == dtype and out.shape == (T, H)
    ref = RM.fused_moe_fp8(**args)
    name = f"{backend} {dtype} T{T} E{E} {'block' if blockwise else 'channel'}"
    if dtype != torch.float32:
        assert_fa_close(out, ref, naive_fused_moe_fp8(**args), name=name)
        return
    # fp32: the activation a is computed in fp32 here and in fp64 by the oracle, so where it lies on
    # an e4m3 rounding boundary its code can differ by one step (quantisation is discontinuous): a
    # few such elements give ~2e-5 relative, and no same-precision bound holds element by element.
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, f"{name}: relative error {rel:.2e}"
    assert (out.double() - ref).abs().max() < 2e-3 * ref.abs().max(), name


def test_fp8_experts_approximate_the_float_layer():
    """The quantisation error itself: the FP8 layer against the bf16 layer it was quantised from
    (the test can fail: the per-row scales or the blocks transposed give errors of order 1)."""
    for blockwise in (False, True):
        args = make_fp8_case(37, 8, 2, 256, 128, "silu", False, False, blockwise, torch.bfloat16, seed=5)
        full = RM.fused_moe(**make_case(37, 8, 2, 256, 128, "silu", False, False, torch.bfloat16, seed=5))
        out = run(args).double()
        assert ((out - full).norm() / full.norm()).item() < 0.08


@pytest.mark.parametrize("blockwise", [False, True])
def test_fp8_matches_transformers_mixtral_block(blockwise):
    """transformers' MixtralSparseMoeBlock (fp32) with its experts replaced by the dequantised FP8
    weights, fed x fake-quantised as the op quantises it: within the activation quantisation."""
    get_backend("cpu")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    H, I, E, k, T = 256, 128, 8, 2, 37
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                num_experts_per_tok=k)).eval()
    g = make_gen(11)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        w13, s13 = quantize_experts(block.experts.gate_up_proj, blockwise)
        w2, s2 = quantize_experts(block.experts.down_proj, blockwise)
        block.experts.gate_up_proj.copy_(RM._dequantize_experts(w13, s13).float())
        block.experts.down_proj.copy_(RM._dequantize_experts(w2, s2).float())
        x = torch.randn(T, H, generator=g)
        expected = block(x[None])[0]
        logits, _, _ = block.gate(x)
    weights, ids = ops.moe_topk(logits, k, True)
    out = ops.fused_moe_fp8(x, w13, w2, s13, s2, weights, ids)
    err = ((out - expected).norm() / expected.norm()).item()
    assert err < 0.06, err  # e4m3 activations (x and a): a few per cent
    assert err > 1e-4  # the activations really are quantised


@pytest.mark.parametrize("backend", [pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_batch_invariance_across_tile_tiers(backend):
    """A token alone (16-row blocks; a quantised by fp8_quantize's kernel) and among 1100 or 200
    tokens (64-row blocks; a quantised by the gate/up epilogue): the same bits."""
    be = get_backend(backend)
    for T, I, blockwise in ((1100, 80, False), (200, 128, True)):  # 80: a's last group of 16
        args = make_fp8_case(T, 2, 2, 1024 if T > 200 else 256, I, "silu", True, False, blockwise,
                             torch.bfloat16, seed=13)
        batch = run(args, be)
        for t in (0, 77, T - 1):
            alone = dict(args, x=args["x"][t:t + 1], topk_weights=args["topk_weights"][t:t + 1],
                         topk_ids=args["topk_ids"][t:t + 1])
            assert_bits_equal(run(alone, be), batch[t:t + 1], f"token {t} alone vs among {T}")


def test_batch_invariance():
    for blockwise in (False, True):
        args = make_fp8_case(37, 8, 2, 256, 128, "silu", True, False, blockwise, torch.bfloat16, seed=9)
        batch = run(args)
        for t in (0, 5, 36):
            alone = dict(args, x=args["x"][t:t + 1], topk_weights=args["topk_weights"][t:t + 1],
                         topk_ids=args["topk_ids"][t:t + 1])
            assert_bits_equal(run(alone), batch[t:t + 1], f"token {t}")


NAMESPACES = ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("blockwise", [False, True])
def test_fused_moe_fp8_opcheck(ns, blockwise):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    a = make_fp8_case(5, 8, 2, 128, 128, "swiglu_oai", True, True, blockwise, torch.bfloat16, seed=5)
    positional = (a["x"], a["w13"], a["w2"], a["w13_scale"], a["w2_scale"], a["topk_weights"], a["topk_ids"],
                  "swiglu_oai", a["swiglu_alpha"], a["swiglu_limit"], a["w13_bias"], a["w2_bias"])
    # test_schema compares the inputs before and after with arithmetic that has no fp8 kernels on CPU
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(getattr(torch.ops, ns).fused_moe_fp8.default, positional, test_utils=utils)


def bad(blockwise=False, **changes):
    def make():
        args = make_fp8_case(4, 8, 2, 128, 128, "silu", False, False, blockwise, torch.bfloat16, seed=1)
        for name, value in changes.items():
            args[name] = value(args) if callable(value) else value
        return args
    return make


BAD = [
    ("w13-bf16", bad(w13=lambda a: a["w13"].bfloat16()), "w13"),
    ("w2-bf16", bad(w2=lambda a: a["w2"].bfloat16()), "w2"),
    ("w13-scale-dtype", bad(w13_scale=lambda a: a["w13_scale"].bfloat16()), "w13_scale"),
    ("w13-scale-shape", bad(w13_scale=lambda a: a["w13_scale"][:, :128].contiguous()), "w13_scale"),
    ("w2-scale-shape", bad(w2_scale=lambda a: a["w2_scale"][:4].contiguous()), "w2_scale"),
    ("mixed-scales", bad(w2_scale=lambda a: a["w2_scale"][:, :, None].expand(8, 128, 1).contiguous()), "w2_scale"),
    ("block-scale-shape", bad(True, w13_scale=lambda a: a["w13_scale"][:, :1].contiguous()), "w13_scale"),
    ("block-hidden-not-128", bad(True, x=lambda a: a["x"][:, :64].contiguous(),
                                 w13=lambda a: a["w13"][:, :, :64].contiguous(),
                                 w2=lambda a: a["w2"][:, :64].contiguous(),
                                 w2_scale=lambda a: a["w2_scale"]), "multiples of 128"),
    ("scale-noncontig", bad(w13_scale=lambda a: a["w13_scale"].t().contiguous().t()), "w13_scale"),
    ("ids-out-of-range", bad(topk_ids=lambda a: a["topk_ids"].clone().fill_(8)), "topk_ids"),
    ("activation", bad(activation="gelu"), "activation"),
]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("case,make,arg_re", BAD, ids=[b[0] for b in BAD])
def test_bad_input(ns, case, make, arg_re):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        ops.fused_moe_fp8(**make(), lib=getattr(torch.ops, ns))
    assert f"{ns}.fused_moe_fp8:" in str(exc.value)
