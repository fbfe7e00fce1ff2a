"""Expert parallelism on this CPU: 2 ranks, gloo over 127.0.0.1.

The collectives (uneven all-to-all, all-gather, empty shares) on two spawned processes; one
:class:`FusedMoE` layer split over 2 ranks against the same layer in one process (bit for bit in
float32 and bfloat16, for batches that leave a rank without tokens too), with each rank's load
checked against the routing; through the engine,
Mixtral, Qwen3-MoE, Qwen2-MoE (a shared expert) and OLMoE tiny random models
(``tests/model_helpers.py``): ``expert_parallel_size=2`` (attention whole on each rank) equals one
process bit for bit (prefill logits of every row, a decode row, greedy tokens),
``tensor_parallel_size=2, expert_parallel_size=2`` equals transformers within 1e-5; the load
counters in ``LLM.stats()`` and the server's ``/metrics``; the refusals. (A GGUF file:
``tests/test_gguf_moe.py``.)

Every process has a deadline and is killed at teardown; every engine is shut down.
"""

from __future__ import annotations

import io
import multiprocessing
import queue
import time
import traceback

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fastinfer  # noqa: E402,F401
from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.distributed import ParallelInfo, build_groups, client_store, master_store  # noqa: E402
from fastinfer.layers import ExpertProjections, FusedMoE, TensorDictReader  # noqa: E402
from fastinfer.layers.moe import expert_parallel_layers, routed_slots_per_rank  # noqa: E402
from fastinfer.ops import backend  # noqa: E402
from model_helpers import plan_logits as _plan_logits  # noqa: E402
from model_helpers import hf_greedy, hf_logits, lazy_checkpoints, make_hf_model, random_prompt, rel_err  # noqa: E402

EP = 2
DEADLINE_S = 120.0
REL_TOL = 1e-5
VOCAB = 300
BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ------------------------------------------------------------------------------------------------
# two spawned ranks
# ------------------------------------------------------------------------------------------------
def _rank_main(fn, rank, world, port, args, results):
    try:
        torch.set_num_threads(1)
        group, ctrl = build_groups(client_store(port), rank, world, torch.device("cpu"), 30.0)
        try:
            # as bytes: a tensor put in a queue as itself is fetched from this process, gone by then
            buf = io.BytesIO()
            torch.save(fn(group, *args), buf)
            results.put((rank, "ok", buf.getvalue()))
        finally:
            group.comm.close()
            ctrl.comm.close()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, *args, world=EP):
    """``fn(group, *args)`` on ``world`` spawned processes (``group``: their ParallelInfo); the
    results in rank order. Each process has DEADLINE_S; a failure or a timeout fails the test."""
    ctx = multiprocessing.get_context("spawn")
    store = master_store(DEADLINE_S)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, store.port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did not answer within "
                                     f"{DEADLINE_S:.0f} s") from None
            assert status == "ok", f"rank {rank} failed:\n{value}"
            got[rank] = torch.load(io.BytesIO(value))
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    return [got[r] for r in range(world)]


def _exchange(group):
    comm, r = group.comm, group.rank
    # rank 0 sends 1 row to itself, 2 to rank 1; rank 1 sends 3 to rank 0, none to itself
    send = [[1, 2], [3, 0]][r]
    rows = (torch.arange(sum(send) * 3, dtype=torch.float32).view(-1, 3) + 100 * r)
    got = comm.all_to_all(rows, send, [[1, 3], [2, 0]][r])
    as_bytes = comm.all_to_all(torch.full((sum(send), 5), r + 1, dtype=torch.uint8), send, [[1, 3], [2, 0]][r])
    empty = comm.all_to_all(torch.empty(0, 4), [0, 0], [0, 0])
    gathered = comm.all_gather(torch.full((2, 3), float(r)))
    with_empty = comm.all_gather(torch.empty(0, 3))
    return got, as_bytes, empty.shape, gathered, with_empty.shape, comm.bytes_all_to_all, comm.bytes_gathered


# ------------------------------------------------------------------------------------------------
# one layer
# ------------------------------------------------------------------------------------------------
H, I, E, K = 64, 32, 8, 3
PROJ = ExpertProjections("w1", "w3", "w2")
BATCHES = (37, 3, 1, 2)  # a batch of 1: rank 1 is home to no token
DTYPES = (torch.float32, torch.bfloat16)


def _layer_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"moe.gate.weight": torch.randn(E, H, generator=g) * 0.5}
    for e in range(E):
        t[f"moe.experts.{e}.w1.weight"] = torch.randn(I, H, generator=g) * 0.2
        t[f"moe.experts.{e}.w3.weight"] = torch.randn(I, H, generator=g) * 0.2
        t[f"moe.experts.{e}.w2.weight"] = torch.randn(H, I, generator=g) * 0.2
    return t


def _layer(weights, dtype, tp=ParallelInfo()):
    m = FusedMoE(H, I, E, K, True, "moe", PROJ, dtype=dtype, device="cpu", ops=backend(), tp=tp)
    reader = TensorDictReader(weights)
    for module in m.modules():
        if module is not m and hasattr(module, "load_from"):
            module.load_from(reader)
    m.load_from(reader)
    assert not reader.unused(), reader.unused()  # the other rank's experts are skipped, not missing
    return m


def _ep_forward(group, weights, xs, dtype):
    m = _layer(weights, dtype, ParallelInfo(0, 1, None, ep=group))
    with torch.no_grad():
        outs = [m(x) for x in xs]
    return outs, list(m.routed_slots), m.w13.shape, m.first_expert


def _inputs(dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(t, H, generator=g).to(dtype) for t in BATCHES]


def _two_rank_session(group, weights):
    return {"exchange": _exchange(group),
            **{dtype: _ep_forward(group, weights, _inputs(dtype), dtype) for dtype in DTYPES}}


@pytest.fixture(scope="module")
def two_ranks():
    """What each of two spawned ranks returned: the exchanges, and the layer's outputs per dtype."""
    weights = _layer_weights()
    return weights, run_ranks(_two_rank_session, weights)


def test_all_to_all_and_all_gather_over_gloo(two_ranks):
    """Uneven splits (a rank sending nothing to itself), bytes, empty exchanges, all-gather."""
    _, ranks = two_ranks
    (got0, bytes0, e0, g0, ge0, a2a0, ag0), (got1, bytes1, _, g1, _, _, _) = [r["exchange"] for r in ranks]
    r0 = torch.arange(9, dtype=torch.float32).view(3, 3)
    r1 = torch.arange(9, dtype=torch.float32).view(3, 3) + 100
    assert torch.equal(got0, torch.cat([r0[:1], r1]))  # its own first row, then rank 1's three
    assert torch.equal(got1, r0[1:])
    assert bytes0.tolist() == [[1] * 5] + [[2] * 5] * 3 and bytes1.tolist() == [[1] * 5] * 2
    assert e0 == (0, 4) and ge0 == (0, 3)
    want = torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2)
    assert torch.equal(g0, want) and torch.equal(g1, want)
    assert (a2a0, ag0) == (3 * 3 * 4 + 3 * 5, 2 * 3 * 4)  # counters: what rank 0 sent


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_split_over_two_ranks_equals_one_process(two_ranks, dtype):
    """Batches of 37, 3, 1 and 2 tokens: bit for bit in float32 and bfloat16 (the op rounds each
    slot's output to the dtype before its sum, as the owner rank returns it). Each rank counts
    every rank's slots, as the routing puts them."""
    weights, ranks = two_ranks
    (outs0, load0, shape0, first0), (outs1, load1, shape1, first1) = [r[dtype] for r in ranks]
    one = _layer(weights, dtype)
    want_load = [0, 0]
    with torch.no_grad():
        for x, a, b in zip(_inputs(dtype), outs0, outs1):
            ref = one(x)
            assert torch.equal(a, b), "the ranks disagree"
            assert torch.equal(a, ref), (x.shape, (a - ref).abs().max())
            _, ids = one.ops.moe_topk(one.router(x), K, True, "softmax")
            for r in range(EP):
                want_load[r] += int((ids.long() // (E // EP) == r).sum())
    assert (shape0, shape1) == ((E // EP, 2 * I, H),) * 2 and (first0, first1) == (0, E // EP)
    assert load0 == load1 == want_load and sum(want_load) == K * sum(BATCHES) and min(want_load) > 0


def test_slot_order_of_the_combine_is_visible():
    """The combine's order matters: summing a token's slots in another order (here the reverse)
    changes float32 bits, so the equality above can fail."""
    weights = _layer_weights()
    one = _layer(weights, torch.float32)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        w, ids = one.ops.moe_topk(one.router(x), K, True, "softmax")
        ref = one.ops.fused_moe(x, one.w13, one.w2, w, ids, "silu")
        slots = [one.ops.fused_moe(x, one.w13, one.w2, torch.ones(64, 1), ids[:, j:j + 1].contiguous(), "silu")
                 for j in range(K)]
        forward = torch.zeros(64, H)
        for j in range(K):
            forward = forward + w[:, j:j + 1] * slots[j]
        backward = torch.zeros(64, H)
        for j in reversed(range(K)):
            backward = backward + w[:, j:j + 1] * slots[j]
    assert torch.equal(forward, ref)
    assert not torch.equal(backward, ref)


def test_layer_refuses_experts_that_do_not_split():
    with pytest.raises(ValueError, match=r"moe: 8 experts do not split over expert_parallel_size=3"):
        FusedMoE(H, I, E, K, True, "moe", PROJ, dtype=torch.float32, device="meta", ops=backend(),
                 tp=ParallelInfo(0, 1, None, ep=ParallelInfo(0, 3)))


# ------------------------------------------------------------------------------------------------
# through the engine
# ------------------------------------------------------------------------------------------------
CASES = {  # one model of each architecture, as tests/test_models_moe.py makes them
    # 4 experts, 2 per token, sliding window 24
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    # 8 experts of width 64, 3 per token, norm_topk_prob; layers 0 and 2 dense
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=2,
                                    mlp_only_layers=[2], rope_theta=1e6)),
    # a shared expert of width 96 on the routed layers 0, 2 and 3; 8 experts of width 64, 3 per token
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                    norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=True,
                                    sliding_window=24, max_window_layers=3)),
    # one KV head, 8 experts of width 256, 3 per token, q / k / v clipped
    "olmoe": ("olmoe", dict(num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=3,
                            clip_qkv=1.5, eos_token_id=2)),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory, CASES, make_hf_model)


def _prompts(n=3, length=40, seed=0):
    return [random_prompt(length - 7 * i, VOCAB, seed + i) for i in range(n)]


ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=24, block_size=BS)


def _moe_layers(model):
    return [layer.moe for layer in model.layers if layer.moe is not None]


def _count_routing(llm, counts):
    """Count, per expert-parallel rank of 2, the slots ``llm``'s routers send there (forward hooks)."""
    def hook(moe):
        def record(module, args, logits):
            _, ids = moe.ops.moe_topk(logits, moe.top_k, moe.renormalize, "softmax")
            owner = ids.long() // (moe.num_experts // EP)
            for r in range(EP):
                counts[r] += int((owner == r).sum())
        return record

    for moe in _moe_layers(llm.model):
        moe.router.register_forward_hook(hook(moe))


@pytest.mark.parametrize("name", list(CASES))
def test_ep2_equals_one_process_bit_for_bit(ckpts, engines, monkeypatch, name):
    """``expert_parallel_size=2`` (rank 0 here + one spawned worker, attention whole on each, half
    the experts each) gives one process's float32 logits bit for bit (a prefill, every row, and a
    decode row) and its greedy tokens; the load counters are every rank's slots as the routing
    sends them (counted from one process's routers), in LLM.stats() and /metrics."""
    from fastinfer.entrypoints.openai.metrics import ServerMetrics

    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")  # every rank's kernels as this process's
    hf, path = ckpts(name)
    one = engines(path, **ENGINE)
    ep = engines(path, expert_parallel_size=EP, **ENGINE)
    moe = _moe_layers(ep.model)[0]  # rank 0's half
    assert moe.w13.shape == (moe.num_experts // EP, 2 * moe.intermediate_size, moe.hidden_size)
    assert moe.first_expert == 0 and ep.executor.runner.worker_pids
    assert "expert_parallel_routed_slots" not in one.stats()
    want = [0] * EP
    _count_routing(one, want)
    prompts = _prompts()
    a, b = _plan_logits(one, prompts[0]), _plan_logits(ep, prompts[0])
    assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max():.3e}"
    assert rel_err(a[:-1], hf_logits(hf, prompts[0])) < REL_TOL
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in ep.generate(prompts, GREEDY)]
    assert got == ref
    assert list(ref[0]) == hf_greedy(hf, prompts[0], GREEDY.max_tokens)
    # every token computed went through every MoE layer, top_k slots each
    tokens = len(prompts[0]) + 1 + sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    slots = ep.stats()["expert_parallel_routed_slots"]
    assert slots == want and sum(slots) == tokens * moe.top_k * len(_moe_layers(ep.model)), (slots, want)
    assert routed_slots_per_rank(expert_parallel_layers(ep.model)) == slots
    assert expert_parallel_layers(one.model) == [] and routed_slots_per_rank([]) is None
    text = ServerMetrics("m", ep.stats).render().decode()
    for rank in range(EP):
        assert f'fastinfer:expert_parallel_routed_slots_total{{model_name="m",rank="{rank}"}} {slots[rank]:.1f}' \
            in text, text
    assert f'fastinfer:expert_parallel_load_imbalance{{model_name="m"}} {max(slots) / (sum(slots) / EP)!r}' in text
    assert "expert_parallel" not in ServerMetrics("m", one.stats).render().decode()


def test_tp2_ep2_matches_transformers(ckpts, engines):
    """``tensor_parallel_size=2, expert_parallel_size=2``: attention and the dense layers
    tensor-parallel, the experts whole and split over the same two ranks (Qwen2-MoE: the experts'
    shares and the shared expert's partial sums reduced by one all-reduce); transformers' logits
    within 1e-5 and its greedy tokens."""
    for name in CASES:
        hf, path = ckpts(name)
        llm = engines(path, tensor_parallel_size=EP, expert_parallel_size=EP, **ENGINE)
        layer = next(layer for layer in llm.model.layers if layer.moe is not None)
        assert layer.num_heads == hf.config.num_attention_heads // EP
        moe = layer.moe
        assert moe.w13.shape == (moe.num_experts // EP, 2 * moe.intermediate_size, moe.hidden_size)
        assert moe.reduce_results == (layer.shared_expert is None)
        ids = random_prompt(40, VOCAB, 4)
        logits = _plan_logits(llm, ids)[:-1]
        assert rel_err(logits, hf_logits(hf, ids)) < REL_TOL, name
        out = llm.generate([ids], GREEDY)
        assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, GREEDY.max_tokens), name
        assert sum(llm.stats()["expert_parallel_routed_slots"]) > 0


def test_refusals(ckpts):
    """Each refused split is a ValueError naming what does not fit, before any process starts (the
    option checks of EngineConfig: tests/test_engine_config.py)."""
    from fastinfer.engine.config import EngineConfig, default_model_path
    from fastinfer.models import load_model

    _, path = ckpts("mixtral")  # 4 experts
    with pytest.raises(ValueError, match=r"4 experts do not split over expert_parallel_size=3"):
        LLM(path, expert_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 needs a mixture-of-experts model; "
                                         r"LlamaForCausalLM has no experts"):
        LLM(default_model_path(), expert_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a checkpoint path"):
        EngineConfig(model=load_model(path), device="cpu", expert_parallel_size=2)
    assert EngineConfig(model=path, device="cpu", expert_parallel_size=2).world_size == 2
    # what each rank's model is built with
    from fastinfer.distributed import model_parallel

    group = ParallelInfo(1, 2)
    assert model_parallel(group, 2, 1) is group and group.ep is None
    alone = model_parallel(group, 1, 2)
    assert (alone.rank, alone.world_size, alone.ep) == (0, 1, group)
    both = model_parallel(group, 2, 2)
    assert (both.rank, both.world_size, both.ep) == (1, 2, group)
    with pytest.raises(ValueError, match="do not describe a group of 2 processes"):
        model_parallel(group, 4, 1)
    assert EngineConfig(model=path, device="cpu", tensor_parallel_size=2, expert_parallel_size=2).world_size == 2
