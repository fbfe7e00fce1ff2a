"""Tensor parallelism for the hybrid (Gated DeltaNet) models on this CPU: 2 ranks (rank 0 here + one
spawned worker), gloo over 127.0.0.1, as tests/test_tensor_parallel.py.

TP=2 must equal TP=1 on tiny random checkpoints written by transformers (Qwen3.5 dense,
Qwen3.5-MoE, Qwen3-Next; linear heads 2 key / 4 value, so each rank holds one key head and its two
value heads; GQA 2/1, the KV head replicated): float32 logits of a prefill (every row) and a decode
step within 1e-5 relative norm, identical greedy tokens with chunked prefill, prefix caching (state
snapshots copied on every rank) and preemption (a small KV pool). Each rank holds only its heads'
rows, channels and states. Expert parallelism (alone: bit-identical to one process; with TP).
Refusals: linear heads that do not split over the ranks (before any process starts), speculative
decoding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fastinfer import SamplingParams  # noqa: E402
from fastinfer.engine.model_runner import Chunk, ForwardPlan  # noqa: E402
from model_helpers import random_prompt, rel_err  # noqa: E402
from test_models_qwen3_5_moe import CONFIGS, hf_model, randomize  # noqa: E402

TP = 2
REL_TOL = 1e-5
VOCAB = 263
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # rank 0; the worker gets cores // 2


def _dense_qwen3_5(seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    d = {k: v for k, v in CONFIGS["qwen3_5_moe"].items() if "expert" not in k}
    torch.manual_seed(seed)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**d, intermediate_size=96)).eval()
    randomize(hf, seed)
    return hf


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache = {}

    def get(kind, **over):
        key = (kind, tuple(sorted(over.items())))
        if key not in cache:
            hf = _dense_qwen3_5() if kind == "qwen3_5" else hf_model(kind, **over)
            path = tmp_path_factory.mktemp(kind)
            hf.save_pretrained(path)
            cache[key] = str(path)
        return cache[key]

    return get


def _plan_logits(llm, prompt):
    """Logits of a whole-prompt prefill (every row) then one decode row, through ``llm``'s runner, in
    state slot 0."""
    table = list(range(-(-(len(prompt) + 1) // llm.block_size)))
    run = llm.executor.runner.forward
    pre, _ = run(ForwardPlan(chunks=[Chunk(-1, list(prompt), 0, "all")], tables={-1: table}, state_slots={-1: 0}))
    nxt = int(pre[-1].argmax())
    dec, _ = run(ForwardPlan(decodes=[(-1, nxt, len(prompt))], tables={-1: table}, finished=[-1],
                             state_slots={-1: 0}))
    return torch.cat([pre, dec])


def _generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_tp2_equals_tp1(ckpts, engines, kind):
    path = ckpts(kind)
    kw = dict(dtype="float32", device="cpu", block_size=16, max_num_seqs=4)
    tp1 = engines(path, num_kv_blocks=64, **kw)
    tp2 = engines(path, num_kv_blocks=64, tensor_parallel_size=TP, **kw)
    m, c = tp2.model, tp2.model.config  # rank 0's shard: one key head, two value heads of 64
    lin = m.layers[0].linear_attn
    assert (lin.num_k_heads, lin.num_v_heads) == (1, 2)
    assert lin.in_proj.weight.shape[0] == 64 + 64 + 128 + 128 + 2 + 2
    assert lin.out_proj.weight.shape[1] == 128 and lin.params.conv_weight.shape[0] == 256
    conv, rec = tp2.executor.kv_caches[0]
    assert conv.shape[2] == 256 and rec.shape[1:] == (2, 64, 64)
    assert m.layers[2].qkv_proj.weight.shape[0] == (2 * 1 + 1 + 1) * c.head_dim  # q + gate of one head, K, V
    if kind != "qwen3_5":
        assert m.layers[0].moe.local_intermediate_size == 16
        assert m.layers[0].shared_expert.down_proj.weight.shape[1] == 24
    prompt = random_prompt(77, VOCAB, seed=3)
    a, b = _plan_logits(tp1, prompt), _plan_logits(tp2, prompt)
    assert a.shape == (78, VOCAB) and rel_err(b, a) < REL_TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    prompts = [random_prompt(n, VOCAB, seed=10 + n) for n in (7, 70, 23, 41)]
    assert _generate(tp2, prompts) == _generate(tp1, prompts)


@pytest.mark.parametrize("sizes", [dict(expert_parallel_size=TP),
                                   dict(expert_parallel_size=TP, tensor_parallel_size=TP)],
                         ids=["ep2", "ep2-tp2"])
def test_expert_parallel_equals_one_process(ckpts, engines, sizes):
    """The experts split whole over the ranks, the Gated DeltaNet layers whole on every rank (EP
    alone: the same bits as one process) or split by head (with TP)."""
    path = ckpts("qwen3_5_moe")
    kw = dict(dtype="float32", device="cpu", block_size=16, max_num_seqs=4, num_kv_blocks=64)
    one = engines(path, **kw)
    ep = engines(path, **sizes, **kw)
    assert ep.model.layers[0].moe.num_local_experts == 4
    prompt = random_prompt(77, VOCAB, seed=3)
    a, b = _plan_logits(one, prompt), _plan_logits(ep, prompt)
    if "tensor_parallel_size" in sizes:
        assert rel_err(b, a) < REL_TOL
    else:
        assert torch.equal(a, b)
    prompts = [random_prompt(n, VOCAB, seed=10 + n) for n in (7, 70, 23, 41)]
    assert _generate(ep, prompts) == _generate(one, prompts)


def test_tp2_chunked_prefill_prefix_cache_preemption(ckpts, engines):
    """Chunked prefill, a small KV pool (preemption) and prefix caching: the state snapshots are
    copies of every rank's own slots; the tokens of the one-process run, with cache hits."""
    path = ckpts("qwen3_next")
    kw = dict(dtype="float32", device="cpu", block_size=16, max_num_seqs=4, max_num_batched_tokens=16,
              num_kv_blocks=12, max_model_len=128, enable_prefix_caching=True)
    shared = random_prompt(40, VOCAB, seed=3)
    batches = [[shared + random_prompt(40, VOCAB, seed=4)],
               [shared + random_prompt(n, VOCAB, seed=60 + n) for n in (10, 21, 35)]]
    tp1 = engines(path, **kw)
    want = [_generate(tp1, b) for b in batches]
    tp2 = engines(path, tensor_parallel_size=TP, **kw)
    assert [_generate(tp2, b) for b in batches] == want
    st = tp2.stats()
    assert st["prefix_cache_hits"] > 0 and st["num_preemptions"] > 0, st


def test_refusals(ckpts, engines):
    from fastinfer import LLM

    path = ckpts("qwen3_5_moe", linear_num_key_heads=1, linear_num_value_heads=2)
    with pytest.raises(ValueError, match=r"linear_num_key_heads=1 does not split over tensor_parallel_size=2"):
        LLM(path, dtype="float32", device="cpu", tensor_parallel_size=TP)
    with pytest.raises(ValueError, match="speculative decoding is not supported for Qwen3_5MoeForCausalLM with "
                                         "tensor_parallel_size=2"):
        LLM(ckpts("qwen3_5_moe"), dtype="float32", device="cpu", tensor_parallel_size=TP, draft_model=path)
