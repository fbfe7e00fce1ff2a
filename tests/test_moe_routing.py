"""MoE routing ops (moe_topk) against the fp64 oracles of ``fastinfer.reference.moe`` and the
routers of transformers (Mixtral, Qwen3-MoE, gpt-oss): the CPU impl, the CUDA kernels in the simt
emulator (two schedule seeds, bit-identical) and the GPU (-m cuda).

Ids are compared exactly (the selection compares the inputs, so every implementation and the
reference agree, ties included); weights within fp32 rounding of the fp64 reference.
"""

from __future__ import annotations

import types

import pytest
import torch

from conftest import backend_params, get_backend, make_gen, poison_
import fastinfer.reference.moe as RM

# Before each call the tests allocate and free poisoned blocks of the outputs' sizes, so an output
# element the op does not write holds the poison rather than a previous call's (correct) result.
def poison_heap(device, *numels):
    for n in numels:
        for dtype in (torch.float32, torch.int32):
            poison_(torch.empty(n, dtype=dtype, device=device))


# Float32 logits too on every backend (routers often run in fp32).
TOPK_DTYPES = {"cpu": (torch.float32, torch.float16, torch.bfloat16), "sim": (torch.float32, torch.bfloat16),
               "cuda": (torch.float32, torch.bfloat16)}

# (num_tokens, num_experts, top_k, scoring, renormalize)
TOPK_CASES = [
    (1, 8, 2, "softmax", True),          # Mixtral
    (3, 60, 4, "softmax", False),        # Qwen2-MoE
    (37, 128, 8, "softmax", True),       # Qwen3-MoE, norm_topk_prob
    (300, 256, 8, "softmax", False),     # DeepSeek's expert count
    (37, 32, 4, "topk_softmax", False),  # gpt-oss-20b
    (3, 128, 1, "topk_softmax", False),
    (300, 8, 1, "softmax", False),
    (5, 64, 32, "softmax", True),        # the largest top_k: one selection per lane
    (2, 20, 20, "topk_softmax", False),  # top_k = num_experts
]
TOPK_PARAMS = backend_params({"cpu": TOPK_CASES, "sim": TOPK_CASES, "cuda": TOPK_CASES}, TOPK_DTYPES)


def random_logits(T, E, dtype, seed, scale=2.0):
    return (torch.randn(T, E, generator=make_gen(seed)) * scale).to(dtype)


def run_topk(be, logits, top_k, renormalize, scoring):
    def call():
        poison_heap(be.device, logits.shape[0] * top_k)
        w, ids = be.ns.moe_topk(logits.to(be.device), top_k, renormalize, scoring)
        return w.cpu(), ids.cpu()
    return be.run(call)


def check_topk(out, logits, top_k, renormalize, scoring, name, rtol=2e-5, atol=1e-7):
    w, ids = out
    ref_w, ref_ids = RM.moe_topk(logits, top_k, renormalize, scoring)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32, name
    assert w.shape == ref_w.shape and ids.shape == ref_ids.shape, name
    if not torch.equal(ids.long(), ref_ids):
        bad = (ids.long() != ref_ids).nonzero()[0].tolist()
        raise AssertionError(f"{name}: topk_ids differ from the reference at {bad}: row {ids[bad[0]].tolist()} vs "
                             f"{ref_ids[bad[0]].tolist()}")
    torch.testing.assert_close(w.double(), ref_w, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{name}: {m}")
    return (w.double() - ref_w).abs().max().item() if w.numel() else 0.0


@pytest.mark.parametrize("backend,dtype,T,E,top_k,scoring,renormalize", TOPK_PARAMS)
def test_moe_topk_matches_reference(backend, dtype, T, E, top_k, scoring, renormalize):
    be = get_backend(backend)
    logits = random_logits(T, E, dtype, seed=T * 1000 + E + top_k)
    out = run_topk(be, logits, top_k, renormalize, scoring)
    check_topk(out, logits, top_k, renormalize, scoring, f"{backend} {dtype} T{T} E{E} k{top_k}")
    if scoring == "topk_softmax" or renormalize:
        torch.testing.assert_close(out[0].sum(-1), torch.ones(T), rtol=0, atol=1e-5)


def test_low_precision_logits_have_ties():
    """bf16 logits of 256 experts tie often: the cases above exercise the tie rule."""
    logits = random_logits(300, 256, torch.bfloat16, seed=300 * 1000 + 256 + 8)
    top = torch.sort(logits.float(), -1, descending=True).values[:, :9]
    assert (top[:, 1:] == top[:, :-1]).any(-1).sum() > 10


# ---- outside oracles: the routers of transformers (run on CPU in fp32) ----------------------


def hf_router(kind, E, top_k, norm_topk_prob=False):
    """A transformers router whose weight is the identity: its router_logits are the input."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = types.SimpleNamespace(num_experts_per_tok=top_k, num_local_experts=E, num_experts=E, hidden_size=E,
                                   norm_topk_prob=norm_topk_prob)
    router = {"mixtral": MixtralTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter, "gpt_oss": GptOssTopKRouter}[kind](config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        if hasattr(router, "bias"):
            router.bias.zero_()
    return router


# (router, num_experts, top_k, norm_topk_prob) -> the arguments of moe_topk
HF_CASES = [
    ("mixtral", 8, 2, None),
    ("qwen3_moe", 128, 8, True),
    ("qwen3_moe", 128, 8, False),
    ("qwen3_moe", 60, 4, False),
    ("gpt_oss", 32, 4, None),
    ("gpt_oss", 128, 4, None),
]


def hf_arguments(kind, norm_topk_prob):
    if kind == "mixtral":
        return "softmax", True  # Mixtral always renormalises
    if kind == "qwen3_moe":
        return "softmax", bool(norm_topk_prob)
    return "topk_softmax", False


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.sim),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind,E,top_k,norm", HF_CASES, ids=[f"{c[0]}-E{c[1]}-k{c[2]}-{c[3]}" for c in HF_CASES])
def test_moe_topk_matches_transformers(backend, kind, E, top_k, norm):
    be = get_backend(backend)
    T = 64
    logits = random_logits(T, E, torch.float32, seed=E * 10 + top_k)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_router(kind, E, top_k, norm)(logits)
    scoring, renormalize = hf_arguments(kind, norm)
    w, ids = run_topk(be, logits, top_k, renormalize, scoring)
    # transformers selects on the fp32 probabilities: rows whose top_k + 1 logits are within 1e-4
    # of each other may round to equal probabilities there (a near-tie), and are not compared.
    top = torch.sort(logits, -1, descending=True).values[:, : top_k + 1]
    clear = (top[:, :-1] - top[:, 1:]).min(-1).values > 1e-4
    assert clear.sum() >= T * 0.9
    assert torch.equal(ids[clear].long(), hf_ids[clear].long()), f"{kind}: ids differ from transformers"
    torch.testing.assert_close(w[clear], hf_weights[clear].float(), rtol=1e-5, atol=1e-7)


# ---- the tie and NaN rules ------------------------------------------------------------------


SIM_AND_CPU = ["cpu", pytest.param("sim", marks=pytest.mark.sim), pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("backend", SIM_AND_CPU)
def test_moe_topk_ties_take_the_lower_expert(backend):
    be = get_backend(backend)
    E = 70  # experts 32 and 64 share a lane with expert 0: ties within and across lanes
    logits = torch.full((3, E), -5.0)
    logits[0, [64, 3, 32, 40]] = 1.0
    logits[1, 6:] = -1.0
    logits[1, [69, 0]] = -0.0
    logits[1, 5] = 0.0
    logits[2, [7, 64]] = 2.0
    logits[2, 1] = 3.0
    w, ids = run_topk(be, logits, 4, False, "softmax")
    assert ids.tolist() == [[3, 32, 40, 64], [0, 5, 69, 6], [1, 7, 64, 0]]
    assert w[0, 0] == w[0, 3] and w[1, 0] == w[1, 2]
    check_topk((w, ids), logits, 4, False, "softmax", backend)


@pytest.mark.parametrize("backend", SIM_AND_CPU)
def test_moe_topk_nan(backend):
    """A NaN logit ranks above every number (torch.topk's order): a row with one gets NaN weights
    under both scorings; NaNs among themselves tie to the lower id."""
    be = get_backend(backend)
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [nan, 1.0, -inf, 0.5, nan, 2.0],
        [nan, nan, -inf, nan, nan, nan],
        [nan, nan, nan, nan, nan, nan],
        [-inf, 0.0, -inf, 1.0, -3.0, 4.0],
    ])
    w, ids = run_topk(be, logits, 3, False, "softmax")
    assert ids.tolist() == [[0, 4, 5], [0, 1, 3], [0, 1, 2], [5, 3, 1]]
    assert w[:3].isnan().all() and not w[3].isnan().any()
    check_topk((w, ids), logits, 3, False, "softmax", backend)
    # torch.topk selects a NaN first too (which of several it leaves unspecified)
    assert torch.equal(logits.gather(1, ids[:, :1].long()).isnan(), torch.topk(logits, 1).values.isnan())
    w, ids = run_topk(be, logits, 3, False, "topk_softmax")
    assert ids.tolist() == [[0, 4, 5], [0, 1, 3], [0, 1, 2], [5, 3, 1]]
    assert w[:3].isnan().all() and not w[3].isnan().any()
    check_topk((w, ids), logits, 3, False, "topk_softmax", backend)
    # -inf experts are never weighted while numbers remain (masked experts)
    w, ids = run_topk(be, logits[3:], 4, True, "softmax")
    assert ids.tolist() == [[5, 3, 1, 4]] and (w > 0).all()


# ---- the op's contract: opcheck, bad input, fake shapes --------------------------------------


NAMESPACES = ["fastinfer", pytest.param("fastinfer_sim", marks=pytest.mark.sim)]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", False)])
def test_moe_topk_opcheck(ns, scoring, renormalize):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    logits = random_logits(5, 16, torch.bfloat16, seed=5)
    torch.library.opcheck(getattr(torch.ops, ns).moe_topk.default, (logits, 4, renormalize, scoring))


TOPK_BAD = [
    ("logits-1d", lambda: (torch.randn(8), 2, False, "softmax"), "router_logits"),
    ("logits-dtype", lambda: (torch.randn(4, 8, dtype=torch.float64), 2, False, "softmax"), "router_logits"),
    ("logits-int", lambda: (torch.ones(4, 8, dtype=torch.int32), 2, False, "softmax"), "router_logits"),
    ("logits-noncontig", lambda: (torch.randn(8, 4).t(), 2, False, "softmax"), "router_logits"),
    ("logits-no-experts", lambda: (torch.randn(4, 0), 1, False, "softmax"), "router_logits"),
    ("topk-zero", lambda: (torch.randn(4, 8), 0, False, "softmax"), "top_k"),
    ("topk-above-experts", lambda: (torch.randn(4, 8), 9, False, "softmax"), "top_k"),
    ("topk-above-cap", lambda: (torch.randn(4, 64), 33, False, "softmax"), "top_k"),
    ("scoring", lambda: (torch.randn(4, 8), 2, False, "sigmoid"), "scoring"),
    ("renormalize-topk-softmax", lambda: (torch.randn(4, 8), 2, True, "topk_softmax"), "renormalize"),
]


def test_moe_topk_cuda_wants_cuda_tensors():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    with pytest.raises(RuntimeError, match="router_logits"):
        torch.ops.fastinfer.moe_topk(torch.randn(4, 8).cuda()[:, ::2], 2, False, "softmax")


def test_moe_topk_meta_and_wrapper():
    import fastinfer.ops as ops

    w, ids = torch.ops.fastinfer.moe_topk(torch.empty(7, 60, device="meta"), 4, True, "softmax")
    assert w.shape == ids.shape == (7, 4) and w.dtype == torch.float32 and ids.dtype == torch.int32
    logits = random_logits(9, 60, torch.float32, seed=2)
    w, ids = ops.moe_topk(logits, 4)
    check_topk((w, ids), logits, 4, False, "softmax", "wrapper defaults")
    w, ids = ops.backend("fastinfer").moe_topk(logits, 4, scoring="topk_softmax")
    check_topk((w, ids), logits, 4, False, "topk_softmax", "backend")
    assert torch.equal(torch.ops.fastinfer.moe_topk(torch.empty(0, 8), 2, False, "softmax")[1],
                       torch.empty(0, 2, dtype=torch.int32))


# ---- moe_align -------------------------------------------------------------------------------
# The layout of vLLM's moe_align_block_size (vllm/model_executor/layers/fused_moe/
# moe_align_block_size.py, csrc/moe/moe_align_sum_kernels.cu; checked against
# tests/kernels/moe/test_moe_align_block_size.py, whose golden sorts the slots stably: ascending
# within an expert, as here).


def run_align(be, topk_ids, num_experts, block_m):
    def call():
        sorted_size = topk_ids.numel() + num_experts * (block_m - 1)
        poison_heap(be.device, sorted_size, sorted_size // block_m + 1, 1)
        return tuple(t.cpu() for t in be.ns.moe_align(topk_ids.to(be.device), num_experts, block_m))
    return be.run(call)


def test_moe_align_worked_example():
    """vLLM's docstring example: topk_ids [[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], block 4.
    (The docstring says num_experts = 4, but uses expert 4: num_experts = 5 here, expert 0 empty.)
    Flattened: slot 0..11 -> experts 2 3 4 1 2 4 1 3 4 1 2 3; each expert has 3 slots, padded with
    one sentinel 12; expert 0 has no block. Length 12 + 5 * 3 = 27, ceil(27 / 4) = 7 blocks."""
    topk_ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, expert_ids, total = torch.ops.fastinfer.moe_align(topk_ids, 5, 4)
    assert sorted_ids.tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12] + [12] * 11
    assert expert_ids.tolist() == [1, 2, 3, 4, 0, 0, 0]
    assert total.tolist() == [16]
    ref = RM.moe_align(topk_ids, 5, 4)
    assert all(torch.equal(a, b) for a, b in zip((sorted_ids, expert_ids, total), ref))


def random_topk_ids(T, E, top_k, seed, dtype=torch.int32):
    """Distinct experts per token (as a router gives), skewed towards the low ids so that some
    experts get many slots (several blocks) and some none."""
    g = make_gen(seed)
    scores = torch.rand(T, E, generator=g) - torch.linspace(0, 0.5, E)
    return torch.topk(scores, top_k, dim=-1).indices.to(dtype)


def check_align(out, topk_ids, E, block_m, name):
    sorted_ids, expert_ids, total = out
    ref = RM.moe_align(topk_ids, E, block_m)
    for o, r, what in zip(out, ref, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert o.dtype == torch.int32 and o.shape == r.shape, f"{name}: {what} {o.dtype} {tuple(o.shape)}"
        if not torch.equal(o, r):
            bad = (o != r).nonzero()[0].item()
            raise AssertionError(f"{name}: {what} differs from the reference at {bad}: {o[bad]} vs {r[bad]}")
    # The invariants vLLM's test checks, on the op's output directly.
    n, used = topk_ids.numel(), int(total)
    ids = topk_ids.flatten().long()
    assert used % block_m == 0 and used >= int((ids >= 0).sum())
    valid = sorted_ids[sorted_ids < n]
    assert torch.equal(valid.sort().values, (ids >= 0).nonzero().flatten().int())  # each slot once
    assert ((expert_ids >= 0) & (expert_ids < E)).all()
    for b in range(used // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        slots = block[block < n].long()
        assert (ids[slots] == expert_ids[b]).all(), f"{name}: block {b} holds another expert's slot"


ALIGN_CASES = [
    # (num_tokens, num_experts, top_k, block_m)
    (1, 8, 2, 16),
    (3, 60, 4, 16),
    (37, 128, 8, 64),
    (300, 256, 8, 64),
    (300, 8, 2, 16),     # Mixtral: blocks of many slots, ids across many tiles
    (37, 256, 1, 16),
    (3, 512, 8, 64),
    (5, 1024, 4, 16),    # the largest expert count
    (0, 8, 2, 16),       # no tokens: sentinels and zero blocks only
]
ALIGN_PARAMS = backend_params({"cpu": ALIGN_CASES, "sim": ALIGN_CASES, "cuda": ALIGN_CASES},
                              {b: (torch.int32, torch.int64) for b in ("cpu", "sim", "cuda")})


@pytest.mark.parametrize("backend,index_dtype,T,E,top_k,block_m", ALIGN_PARAMS)
def test_moe_align_matches_reference(backend, index_dtype, T, E, top_k, block_m):
    be = get_backend(backend)
    topk_ids = random_topk_ids(T, E, top_k, seed=T * 100 + E + top_k, dtype=index_dtype)
    out = run_align(be, topk_ids, E, block_m)
    check_align(out, topk_ids, E, block_m, f"{backend} T{T} E{E} k{top_k} block {block_m}")


@pytest.mark.parametrize("backend", SIM_AND_CPU)
def test_moe_align_skips_minus_one(backend):
    """Expert parallelism: slots routed to no local expert (-1) appear nowhere."""
    be = get_backend(backend)
    topk_ids = random_topk_ids(37, 16, 4, seed=4)
    topk_ids[topk_ids % 3 == 0] = -1
    out = run_align(be, topk_ids, 16, 16)
    check_align(out, topk_ids, 16, 16, f"{backend} -1 ids")
    assert (out[0][: int(out[2])] < topk_ids.numel()).sum() == (topk_ids >= 0).sum()


@pytest.mark.parametrize("ns", NAMESPACES)
def test_moe_align_opcheck(ns):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    topk_ids = random_topk_ids(9, 12, 2, seed=9)
    torch.library.opcheck(getattr(torch.ops, ns).moe_align.default, (topk_ids, 12, 16))


def ids_with(value):
    t = random_topk_ids(4, 8, 2, seed=1)
    t[2, 1] = value
    return t


ALIGN_BAD = [
    ("ids-1d", lambda: (torch.zeros(8, dtype=torch.int32), 8, 16), "topk_ids"),
    ("ids-float", lambda: (torch.zeros(4, 2), 8, 16), "topk_ids"),
    ("ids-int16", lambda: (torch.zeros(4, 2, dtype=torch.int16), 8, 16), "topk_ids"),
    ("ids-noncontig", lambda: (torch.zeros(2, 4, dtype=torch.int32).t(), 8, 16), "topk_ids"),
    ("ids-too-large", lambda: (ids_with(8), 8, 16), "topk_ids"),
    ("ids-below-minus-one", lambda: (ids_with(-2), 8, 16), "topk_ids"),
    ("experts-zero", lambda: (ids_with(0), 0, 16), "num_experts"),
    ("experts-above-cap", lambda: (ids_with(0), 1025, 16), "num_experts"),
    ("block-zero", lambda: (ids_with(0), 8, 0), "block_m"),
    ("block-negative", lambda: (ids_with(0), 8, -16), "block_m"),
    ("block-not-pow2", lambda: (ids_with(0), 8, 48), "block_m"),
]


def test_moe_align_meta_and_wrapper():
    import fastinfer.ops as ops

    sorted_ids, expert_ids, total = torch.ops.fastinfer.moe_align(torch.empty(7, 4, dtype=torch.int32,
                                                                              device="meta"), 60, 16)
    assert sorted_ids.shape == (28 + 60 * 15,) and expert_ids.shape == (-(-(28 + 60 * 15) // 16),)
    assert total.shape == (1,) and sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
    logits = random_logits(11, 60, torch.float32, seed=3)
    _, topk_ids = ops.moe_topk(logits, 4)
    check_align(ops.moe_align(topk_ids, 60, 16), topk_ids, 60, 16, "wrapper")


# ---- bad input: a RuntimeError naming the argument, never a crash ----------------------------
BAD = [("moe_topk", *b) for b in TOPK_BAD] + [("moe_align", *b) for b in ALIGN_BAD]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("op,case,make,arg_re", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_bad_input(ns, op, case, make, arg_re):
    get_backend("sim" if ns == "fastinfer_sim" else "cpu")
    with pytest.raises(RuntimeError, match=arg_re) as exc:
        getattr(getattr(torch.ops, ns), op)(*make())
    assert f"{ns}.{op}:" in str(exc.value)
