"""fused_moe (the expert MLPs of a MoE layer) against the fp64 oracle of ``fastinfer.reference.moe``,
a same-precision torch loop over the experts, and the MoE blocks of transformers (Mixtral,
Qwen3-MoE, gpt-oss) fed the same routing: the CPU implementation, the CUDA kernels in the simt
emulator (every tile tier, twice with different schedules, bit-identical) and on a GPU (-m cuda).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bits_equal, assert_fa_close, backend_params, get_backend, make_gen, poison_
import fastinfer.ops as ops
import fastinfer.reference.moe as RM

SWIGLU = {"swiglu_alpha": ops.SWIGLU_OAI_ALPHA, "swiglu_limit": ops.SWIGLU_OAI_LIMIT}


def poison_heap(numel, dtype, device="cpu"):
    """Allocate and free poisoned blocks of the output's size, so an element the op does not write
    holds NaN rather than a previous call's (correct) result."""
    for _ in range(4):
        poison_(torch.empty(numel, dtype=dtype, device=device))


def random_ids(T, E, k, seed, skipped=False):
    """Distinct experts per token, skewed towards the low ids (some experts get many tokens, some
    none); ``skipped``: about a quarter of the slots -1 (expert parallelism)."""
    g = make_gen(seed)
    scores = torch.rand(T, E, generator=g) - torch.linspace(0, 0.5, E)
    ids = torch.topk(scores, k, dim=-1).indices.int()
    if skipped:
        ids[torch.rand(T, k, generator=g) < 0.25] = -1
    return ids


def make_case(T, E, k, H, I, activation, bias, skipped, dtype, seed):
    """Inputs of one call: weights scaled so that h and y are O(1) (gpt-oss's: |gate| and |up|
    beyond the limit 7 often enough that the clamps matter)."""
    g = make_gen(seed)
    w13_scale = (4.0 if activation == "swiglu_oai" else 1.0) / H ** 0.5
    args = {
        "x": torch.randn(T, H, generator=g).to(dtype),
        "w13": (torch.randn(E, 2 * I, H, generator=g) * w13_scale).to(dtype),
        "w2": (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype),
        "topk_weights": torch.rand(T, k, generator=g) + 0.1,
        "topk_ids": random_ids(T, E, k, seed, skipped),
        "activation": activation,
    }
    if activation == "swiglu_oai":
        args.update(SWIGLU)
    if bias:
        args["w13_bias"] = torch.randn(E, 2 * I, generator=g).to(dtype)
        args["w2_bias"] = (torch.randn(E, H, generator=g) * 0.5).to(dtype)
    return args


def run(args, be=None, op=ops.fused_moe):
    """``op`` (a fused_moe variant's wrapper) on a backend (default: the CPU implementation), the
    output back on the CPU; the sim backend runs it under two schedules and requires identical bits."""
    be = be or get_backend("cpu")

    def call():
        poison_heap(args["x"].numel(), args["x"].dtype, be.device)
        moved = {n: v.to(be.device) if isinstance(v, torch.Tensor) else v for n, v in args.items()}
        return op(**moved, lib=be.ns).cpu()
    return be.run(call)


def naive_fused_moe(x, w13, w2, topk_weights, topk_ids, activation="silu", swiglu_alpha=None, swiglu_limit=None,
                    w13_bias=None, w2_bias=None):
    """The obvious torch loop over the experts, every op in x's dtype."""
    I = w13.shape[1] // 2
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for e in ids[ids >= 0].unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[tokens], w13[e], None if w13_bias is None else w13_bias[e])
        a = RM.expert_activation(h[:, :I], h[:, I:], activation, swiglu_alpha, swiglu_limit)
        y = F.linear(a, w2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(x.dtype))
    return out


DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (T, E, k, H, I, activation, bias, skipped slots)
CASES = [
    (1, 8, 2, 96, 40, "silu", False, False),       # Mixtral's routing, decode
    (3, 60, 4, 96, 40, "silu", False, False),      # Qwen2-MoE's expert count: most experts unused
    (37, 8, 2, 96, 40, "silu", False, False),
    (37, 60, 4, 64, 24, "silu", False, True),      # -1 slots
    (37, 128, 8, 96, 40, "silu", False, False),    # Qwen3-MoE's routing
    (3, 8, 1, 96, 40, "swiglu_oai", True, False),  # gpt-oss: biases, clamped swiglu
    (37, 32, 4, 96, 40, "swiglu_oai", True, True),
    (37, 8, 2, 96, 40, "silu", True, False),       # biases with silu
]
CASE_IDS = [f"T{c[0]}-E{c[1]}-k{c[2]}-H{c[3]}-I{c[4]}-{c[5]}{'-bias' if c[6] else ''}{'-skip' if c[7] else ''}"
            for c in CASES]


# The kernels' tile tiers (cuda/src/fused_moe.cu) by rows per expert, T k / E: at most 16 (16-row
# blocks), at most 64 (64-row blocks), more (128-row blocks where they fill the 132 SMs the
# emulator reports, else 64): every tier, partial column tiles (I = 40 on 32 and 64 columns).
SIM_CASES = [
    (3, 8, 2, 96, 40, "silu", False, False),        # 16-row blocks
    (37, 60, 4, 64, 24, "silu", False, True),       # -1 slots
    (37, 32, 4, 96, 40, "swiglu_oai", True, True),
    (37, 2, 2, 96, 40, "silu", True, False),        # 64-row blocks
    (1100, 2, 2, 1024, 8, "silu", True, False),     # 128-row blocks
]
SIM_IDS = [f"T{c[0]}-E{c[1]}-k{c[2]}-H{c[3]}-I{c[4]}-{c[5]}{'-bias' if c[6] else ''}{'-skip' if c[7] else ''}"
           for c in SIM_CASES]
PARAMS = backend_params({"cpu": CASES, "sim": SIM_CASES, "cuda": CASES + SIM_CASES})
SIM_AND_CPU = ["cpu", pytest.param("sim", marks=pytest.mark.sim), pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("backend,dtype,T,E,k,H,I,activation,bias,skipped", PARAMS)
def test_fused_moe_matches_reference(backend, dtype, T, E, k, H, I, activation, bias, skipped):
    be = get_backend(backend)
    args = make_case(T, E, k, H, I, activation, bias, skipped, dtype, seed=T * 100 + E + k)
    out = run(args, be)
    assert out.dtype == dtype and out.shape == (T, H)
    ref = RM.fused_moe(**args)
    naive = naive_fused_moe(**args)
    assert_fa_close(out, ref, naive, name=f"{backend} {dtype} T{T} E{E} k{k} {activation}")
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("backend", SIM_AND_CPU)
def test_unused_experts_and_skipped_tokens(backend):
    """Experts chosen by no token cost nothing and change nothing; a token whose slots are all -1
    gets zeros (written, not left as the poison)."""
    be = get_backend(backend)
    args = make_case(5, 60, 4, 96, 40, "silu", False, False, torch.bfloat16, seed=7)
    args["topk_ids"][2] = -1
    used = args["topk_ids"][args["topk_ids"] >= 0].unique()
    assert used.numel() < 20
    out = run(args, be)
    assert torch.equal(out[2], torch.zeros(96, dtype=torch.bfloat16))
    unused = torch.ones(60, dtype=torch.bool)
    unused[used.long()] = False
    args["w13"][unused] = float("nan")  # never read
    args["w2"][unused] = float("nan")
    assert_bits_equal(run(args, be), out, "unused experts")


def alone(args, t):
    return dict(args, x=args["x"][t:t + 1], topk_weights=args["topk_weights"][t:t + 1],
                topk_ids=args["topk_ids"][t:t + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("activation,bias,skipped", [("silu", False, False), ("swiglu_oai", True, True)])
def test_batch_invariance(dtype, activation, bias, skipped):
    """A token's output alone equals, bit for bit, its output inside a batch of 37 tokens that share
    its experts (8 experts, 2 per token: every expert serves several tokens)."""
    args = make_case(37, 8, 2, 96, 40, activation, bias, skipped, dtype, seed=37)
    batch = run(args)
    for t in range(37):
        assert_bits_equal(run(alone(args, t)), batch[t:t + 1], f"token {t} alone vs in the batch")


@pytest.mark.parametrize("backend", [pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("activation,bias,skipped", [("silu", True, False), ("swiglu_oai", True, True)])
def test_batch_invariance_across_tile_tiers(backend, activation, bias, skipped):
    """The kernels: a token alone runs on 16-row blocks, inside 1100 tokens on two experts on
    128-row blocks (and 64-row ones for 37 tokens); its output is the same bits in all three."""
    be = get_backend(backend)
    args = make_case(1100, 2, 2, 1024, 8, activation, bias, skipped, torch.bfloat16, seed=11)
    batch = run(args, be)
    medium = run({n: v[:37] if isinstance(v, torch.Tensor) and n in ("x", "topk_weights", "topk_ids") else v
                  for n, v in args.items()}, be)
    for t in (0, 1, 17, 36, 555, 1099):
        out = run(alone(args, t), be)
        assert_bits_equal(out, batch[t:t + 1], f"token {t} alone vs among 1100")
        if t < 37:
            assert_bits_equal(out, medium[t:t + 1], f"token {t} alone vs among 37")


# ---- outside oracles: the MoE blocks of transformers, fp32 --------------------------------------


def init_random(module, seed):
    g = make_gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return module


def relative_error(out, expected):
    return ((out - expected).abs().max() / expected.abs().max()).item()


HF_MOE_CASES = [
    # (model, E, k, norm_topk_prob)
    ("mixtral", 8, 2, None),
    ("qwen3_moe", 60, 4, True),
    ("qwen3_moe", 128, 8, False),
]


@pytest.mark.parametrize("kind,E,k,norm", HF_MOE_CASES, ids=[f"{c[0]}-E{c[1]}-k{c[2]}-{c[3]}" for c in HF_MOE_CASES])
def test_silu_matches_transformers(kind, E, k, norm):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: router, then the experts in fp32. Their
    experts.gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I] are w13 and w2 as is;
    the routing is moe_topk's on their router's logits (the same experts as theirs)."""
    get_backend("cpu")
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    H, I, T = 96, 40, 37
    if kind == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                    num_experts_per_tok=k))
        renormalize = True
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                                      num_experts_per_tok=k, norm_topk_prob=norm))
        renormalize = norm
    init_random(block, seed=E + k).eval()
    x = torch.randn(T, H, generator=make_gen(E))
    with torch.no_grad():
        expected = block(x[None])[0]
        logits, _, hf_ids = block.gate(x)
    weights, ids = ops.moe_topk(logits, k, renormalize)
    assert torch.equal(ids.long(), hf_ids.long())
    out = ops.fused_moe(x, block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(), weights, ids)
    assert relative_error(out, expected) <= 1e-5, relative_error(out, expected)


def test_swiglu_oai_matches_transformers():
    """GptOssMLP (router with bias, topk_softmax, experts with biases and the clamped swiglu), its
    interleaved [E, H, 2I] weights converted by gpt_oss_expert_weights."""
    get_backend("cpu")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    H, I, E, k, T = 96, 40, 32, 4, 37
    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    assert (config.swiglu_alpha, config.swiglu_limit) == (ops.SWIGLU_OAI_ALPHA, ops.SWIGLU_OAI_LIMIT)
    mlp = init_random(GptOssMLP(config), seed=3).eval()
    with torch.no_grad():
        mlp.experts.gate_up_proj.mul_(4.0)  # gate and up beyond the limit often: the clamps matter
    x = torch.randn(T, H, generator=make_gen(4))
    experts = mlp.experts
    with torch.no_grad():
        expected, _ = mlp(x[None])
        expected = expected[0]
        logits, _, hf_ids = mlp.router(x)
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > config.swiglu_limit).float().mean() > 0.05
    weights, ids = ops.moe_topk(logits, k, scoring="topk_softmax")
    assert torch.equal(ids.long(), hf_ids.long())
    w13, w13_bias, w2, w2_bias = ops.gpt_oss_expert_weights(
        experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach(), experts.down_proj.detach(),
        experts.down_proj_bias.detach())
    out = ops.fused_moe(x, w13, w2, weights, ids, "swiglu_oai", w13_bias=w13_bias, w2_bias=w2_bias)
    assert relative_error(out, expected) <= 1e-5, relative_error(out, expected)


# ---- the op's contract: opcheck, wrapper, meta, bad input, the CUDA registration ----------------


NAMESPACES = ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
def test_fused_moe_opcheck(ns, activation, bias):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    args = make_case(5, 8, 2, 32, 16, activation, bias, True, torch.bfloat16, seed=5)
    positional = (args["x"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"], activation,
                  args.get("swiglu_alpha"), args.get("swiglu_limit"), args.get("w13_bias"), args.get("w2_bias"))
    torch.library.opcheck(getattr(torch.ops, ns).fused_moe.default, positional)


def test_fused_moe_meta_and_wrapper():
    get_backend("cpu")
    meta = dict(device="meta", dtype=torch.bfloat16)
    out = torch.ops.fastinfer.fused_moe(torch.empty(7, 64, **meta), torch.empty(8, 48, 64, **meta),
                                        torch.empty(8, 64, 24, **meta), torch.empty(7, 2, device="meta"),
                                        torch.empty(7, 2, dtype=torch.int32, device="meta"), "silu", None, None,
                                        None, None)
    assert out.shape == (7, 64) and out.dtype == torch.bfloat16
    args = make_case(9, 8, 2, 32, 16, "swiglu_oai", True, False, torch.float32, seed=9)
    by_default = {name: v for name, v in args.items() if not name.startswith("swiglu")}
    assert_bits_equal(ops.fused_moe(**by_default), ops.fused_moe(**args), "gpt-oss's alpha and limit by default")
    assert_bits_equal(ops.backend("fastinfer").fused_moe(**args), ops.fused_moe(**args), "backend")
    empty = dict(args, x=args["x"][:0], topk_weights=args["topk_weights"][:0], topk_ids=args["topk_ids"][:0])
    assert ops.fused_moe(**empty).shape == (0, 32)


def bad(**changes):
    """Valid bf16 arguments with some replaced (a callable receives the valid ones)."""
    def make():
        args = make_case(4, 8, 2, 32, 16, "silu", False, False, torch.bfloat16, seed=1)
        for name, value in changes.items():
            args[name] = value(args) if callable(value) else value
        return args
    return make


BAD = [
    ("x-1d", bad(x=lambda a: a["x"][0]), "x"),
    ("x-fp64", bad(x=lambda a: a["x"].double()), "x"),
    ("x-noncontig", bad(x=lambda a: a["x"].t().contiguous().t()), "x"),
    ("w13-dtype", bad(w13=lambda a: a["w13"].half()), "w13"),
    ("w13-2d", bad(w13=lambda a: a["w13"][0]), "w13"),
    ("w13-hidden", bad(w13=lambda a: a["w13"][:, :, :24].contiguous()), "w13"),
    ("w13-odd-rows", bad(w13=lambda a: a["w13"][:, :31].contiguous()), "w13"),
    ("w13-noncontig", bad(w13=lambda a: a["w13"].transpose(1, 2).contiguous().transpose(1, 2)), "w13"),
    ("w2-noncontig", bad(w2=lambda a: a["w2"].transpose(1, 2).contiguous().transpose(1, 2)), "w2"),
    ("w2-intermediate", bad(w2=lambda a: a["w2"][:, :, :8].contiguous()), "w2"),
    ("w2-experts", bad(w2=lambda a: a["w2"][:4].contiguous()), "w2"),
    ("w2-dtype", bad(w2=lambda a: a["w2"].float()), "w2"),
    ("hidden-not-multiple-of-8", bad(x=lambda a: a["x"][:, :28].contiguous(),
                                     w13=lambda a: a["w13"][:, :, :28].contiguous(),
                                     w2=lambda a: a["w2"][:, :28].contiguous()), "hidden"),
    ("weights-dtype", bad(topk_weights=lambda a: a["topk_weights"].bfloat16()), "topk_weights"),
    ("weights-tokens", bad(topk_weights=lambda a: a["topk_weights"][:3]), "topk_weights"),
    ("ids-int64", bad(topk_ids=lambda a: a["topk_ids"].long()), "topk_ids"),
    ("ids-shape", bad(topk_ids=lambda a: a["topk_ids"][:, :1].contiguous()), "topk_ids"),
    ("ids-out-of-range", bad(topk_ids=lambda a: a["topk_ids"].clone().fill_(8)), "topk_ids"),
    ("ids-below-minus-one", bad(topk_ids=lambda a: a["topk_ids"].clone().fill_(-2)), "topk_ids"),
    ("activation", bad(activation="gelu"), "activation"),
    ("alpha-with-silu", bad(swiglu_alpha=1.702), "swiglu_alpha"),
    ("limit-with-silu", bad(swiglu_limit=7.0), "swiglu_limit"),
    ("limit-negative", bad(activation="swiglu_oai", swiglu_limit=-1.0), "swiglu_limit"),
    ("w13-bias-shape", bad(w13_bias=torch.zeros(8, 16, dtype=torch.bfloat16)), "w13_bias"),
    ("w13-bias-dtype", bad(w13_bias=torch.zeros(8, 32)), "w13_bias"),
    ("w2-bias-shape", bad(w2_bias=torch.zeros(8, 16, dtype=torch.bfloat16)), "w2_bias"),
]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("case,make,arg_re", BAD, ids=[b[0] for b in BAD])
def test_bad_input(ns, case, make, arg_re):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        ops.fused_moe(**make(), lib=getattr(torch.ops, ns))
    assert f"{ns}.fused_moe:" in str(exc.value)


@pytest.mark.sim
def test_kernel_limits():
    """The kernels keep the expert histogram of the alignment in shared memory: at most 1024
    experts (the CPU implementation has no such limit); x must be 16-byte aligned."""
    be = get_backend("sim")
    args = make_case(3, 1025, 2, 32, 16, "silu", False, False, torch.bfloat16, seed=2)
    with pytest.raises(RuntimeError, match="fastinfer_sim.fused_moe: w13 must have num_experts <= 1024"):
        ops.fused_moe(**args, lib=be.ns)
    assert run(args).shape == (3, 32)
    args = make_case(4, 8, 2, 32, 16, "silu", False, False, torch.bfloat16, seed=2)
    shifted = torch.empty(4 * 32 + 1, dtype=torch.bfloat16)[1:].view(4, 32).copy_(args["x"])
    with pytest.raises(RuntimeError, match="fastinfer_sim.fused_moe: x"):
        ops.fused_moe(**dict(args, x=shifted), lib=be.ns)


@pytest.mark.cuda
def test_cuda_wants_cuda_tensors():
    get_backend("cuda")
    args = make_case(4, 8, 2, 32, 16, "silu", False, False, torch.bfloat16, seed=1)
    cuda_args = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    with pytest.raises(RuntimeError, match="fastinfer.fused_moe: topk_ids"):
        ops.fused_moe(**dict(cuda_args, topk_ids=args["topk_ids"]))
