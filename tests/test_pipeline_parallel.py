"""Pipeline parallelism on this CPU: stages as processes (rank 0 here + spawned workers), gloo over
127.0.0.1.

The layer partition (even by default as vLLM's ``get_pp_indices``, or given), its validation and the
command-line flags; stage-local models (each holds only its layers, the embedding on the first stage,
the final norm and the LM head on the last, a tied LM head reading the embedding's tensor) chained in
one process against the whole model; then engines: PP=2 must equal PP=1 (float32 logits of a
prefill and a decode step within 1e-5 relative norm, identical greedy tokens) on random Llama (GQA),
Qwen2 (tied embeddings: the embedding and the LM head on different stages) and Mistral (sliding
window) checkpoints written by transformers, an uneven partition, fp8 and int4 quantisation on
load, prefix-cache hits and forced preemption with two batches in flight, Mixtral and Qwen3-MoE (also
with expert parallelism inside each stage); PP x TP in one host and under torchrun, ``fastinfer
serve``, faults (killed and hung stages, rank 0 killed), the order of rank 0's point-to-point
operations, speculative decoding and the deterministic mode, and bench/pp.py's counts.

Every engine is shut down at teardown even when a test fails; collectives have deadlines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")

from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.distributed.pipeline import PipelineStage, parse_partition, partition_layers  # noqa: E402
from fastinfer.engine.config import EngineConfig, default_model_path  # noqa: E402
from fastinfer.engine.workers import TensorParallelError  # noqa: E402
from fastinfer.entrypoints import args as cli_args  # noqa: E402
from fastinfer.layers import BatchBuilder  # noqa: E402
from fastinfer.models import load_model  # noqa: E402
from model_helpers import make_hf_model  # noqa: E402
from model_helpers import plan_logits as _plan_logits  # noqa: E402

PP = 2
REL_TOL = 1e-5
VOCAB = 300
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ASSETS = os.path.dirname(default_model_path())

CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False, num_hidden_layers=3)),  # GQA 4/2
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=40,
                            max_window_layers=1)),  # qkv bias, tied embeddings
    "mistral": ("mistral", dict(sliding_window=24)),  # window < prompt
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    # 8 experts, 3 per token; layers 1 and 3 routed (decoder_sparse_step=2), layer 2 dense (mlp_only_layers)
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=2,
                                    mlp_only_layers=[2], rope_theta=1e6)),
}

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            kind, over = CASES[name]
            path = tmp_path_factory.mktemp(name)
            make_hf_model(kind, seed=len(cache) + 11, **over).save_pretrained(path)
            cache[name] = str(path)
        return cache[name]

    return get


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _prompts(n=3, length=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length - 6 * i,), generator=g).tolist() for i in range(n)]


# ------------------------------------------------------------------------------------------------
# the partition, the options, the flags
# ------------------------------------------------------------------------------------------------
def test_partition_even_by_default_as_vllm_and_given():
    # vLLM's documented examples (docs "Pipeline parallelism", VLLM_PP_LAYER_PARTITION): 61 layers over
    # 2 stages -> 31, 30; over 4 -> 15, 15, 16, 15 (the remainder to the stages before the last)
    assert partition_layers(61, 2) == [(0, 31), (31, 61)]
    assert partition_layers(61, 4) == [(0, 15), (15, 30), (30, 46), (46, 61)]
    assert partition_layers(32, 2) == [(0, 16), (16, 32)]
    assert partition_layers(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert partition_layers(5, 1) == [(0, 5)]
    assert partition_layers(32, 3, "10,10,12") == [(0, 10), (10, 20), (20, 32)]
    assert partition_layers(32, 3, [12, 10, 10]) == [(0, 12), (12, 22), (22, 32)]
    assert parse_partition(" 3, 2") == (3, 2) and parse_partition(None) is None


@pytest.mark.parametrize("args, message", [
    ((32, 3, "10,10"), "pipeline_partition 10,10 has 2 stages, pipeline_parallel_size is 3"),
    ((32, 2, "10,20"), "pipeline_partition 10,20 holds 30 layers, the model has 32"),
    ((4, 2, "4,0"), "needs at least one layer per stage"),
    ((4, 2, "2;2"), "layer counts separated by commas"),
    ((4, 2, [2.0, 2]), "must hold ints"),
    ((3, 4, None), "pipeline_parallel_size=4 is larger than the model's 3 layers"),
    ((3, 0, None), "pipeline_parallel_size must be >= 1"),
])
def test_partition_errors_name_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        partition_layers(*args)


@pytest.mark.parametrize("kw, message", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an int >= 1, got 0"),
    (dict(pipeline_parallel_size=True), "pipeline_parallel_size must be an int >= 1"),
    (dict(pipeline_parallel_size=2, pipeline_partition="5"), "has 1 stages, pipeline_parallel_size is 2"),
    (dict(pipeline_parallel_size=2, pipeline_partition="2,2"), "2,2 holds 4 layers, the model has 5"),
    (dict(pipeline_partition="3"), "pipeline_partition 3 holds 3 layers, the model has 5"),  # one stage, wrong sum
    (dict(pipeline_partition="3,2"), "has 2 stages, pipeline_parallel_size is 1"),
    (dict(pipeline_parallel_size=6), "pipeline_parallel_size=6 is larger than the model's 5 layers"),
    (dict(pipeline_parallel_size=2, pipeline_batches_in_flight=3),
     r"pipeline_batches_in_flight must be an int in 1..pipeline_parallel_size=2, got 3"),
    (dict(pipeline_parallel_size=2, draft_model=os.path.join(ASSETS, "tiny-llama-draft")),
     r"speculative decoding \(spec_method='draft'\) with pipeline_parallel_size=2 runs one batch at a time.*"
     "set pipeline_batches_in_flight=1"),
    (dict(pipeline_parallel_size=2, pipeline_batches_in_flight=1, spec_method="eagle",
          spec_model=os.path.join(ASSETS, "tiny-llama-eagle")),
     "spec_method='eagle' needs the target's hidden states, which pipeline_parallel_size=2 does not return yet: "
     r"use one process \(.*pipeline_parallel_size=1\)"),
    (dict(pipeline_parallel_size=2, pipeline_batches_in_flight=1, spec_method="medusa",
          spec_model=os.path.join(ASSETS, "tiny-llama-medusa")),
     "spec_method='medusa' needs the target's hidden states, which pipeline_parallel_size=2 does not return"),
])
def test_options_are_validated_before_anything_starts(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **kw)


def test_a_model_object_is_refused():
    m = LLM(num_kv_blocks=8).model
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 needs a checkpoint path"):
        EngineConfig(model=m, device="cpu", pipeline_parallel_size=2)


def test_world_size_is_stages_times_the_stage_group():
    c = EngineConfig(device="cpu", pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_partition="3,2")
    assert (c.stage_size, c.world_size) == (2, 4)


def test_flags_on_every_command_and_torchrun_default(monkeypatch):
    for names in (cli_args.GENERATE_OPTIONS, cli_args.SERVE_OPTIONS, cli_args.BENCH_OPTIONS):
        p = argparse.ArgumentParser()
        cli_args.add_cli_args(p, names)
        got = cli_args.llm_kwargs(p.parse_args(["--pipeline-parallel-size", "2", "--pipeline-partition", "3,2"]),
                                  names)
        assert got == {"pipeline_parallel_size": 2, "pipeline_partition": "3,2"}
        assert EngineConfig(device="cpu", **got).world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    p = argparse.ArgumentParser()
    cli_args.add_cli_args(p, cli_args.GENERATE_OPTIONS)
    got = cli_args.llm_kwargs(p.parse_args(["--pipeline-parallel-size", "2"]), cli_args.GENERATE_OPTIONS)
    assert got == {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}


# ------------------------------------------------------------------------------------------------
# stage-local models, chained in this process
# ------------------------------------------------------------------------------------------------
def _stages(path, split, **kw):
    L = sum(split)
    ranges = partition_layers(L, len(split), list(split))
    return [load_model(path, dtype=torch.float32, stage=PipelineStage(i, len(split), a, b), **kw)
            for i, (a, b) in enumerate(ranges)]


def _chained_logits(stages, prompt, whole):
    """Logits of a whole-prompt prefill through ``stages`` one after the other, and through ``whole``."""
    bs = 16
    table = list(range(-(-len(prompt) // bs)))
    b = BatchBuilder(bs, torch.device("cpu"))
    b.prefill(prompt, 0, table, logits="all")
    batch = b.build()
    x = residual = None
    for m in stages:
        kv = m.allocate_kv_cache(len(table), bs)
        assert len(kv) == len(m.layers)  # a stage's KV cache: its layers only
        x, residual = m.stage_layers(batch, kv, x, residual)
    got = stages[-1].final_logits(batch, x, residual)
    return got, whole(batch, whole.allocate_kv_cache(len(table), bs))


@pytest.mark.parametrize("name, split, quant", [("llama", (2, 1), None), ("llama", (1, 2), None),
                                                ("llama", (1, 1, 1), None), ("qwen2", (1, 1), None),
                                                ("mistral", (1, 1), None), ("llama", (1, 2), "fp8"),
                                                ("llama", (2, 1), "int4")])
def test_stage_models_hold_their_layers_and_chain_to_the_whole(ckpts, name, split, quant):
    from fastinfer.quant import QuantOptions, resolve_quantization
    from fastinfer.models import load_config

    path = ckpts(name)
    qc = None
    if quant is not None:
        opts = QuantOptions.from_any(quant, {"group_size": 64} if quant == "int4" else None)
        qc = resolve_quantization(load_config(path), opts, path)
    whole = load_model(path, dtype=torch.float32, quant_config=qc)
    stages = _stages(path, split, quant_config=qc)
    first, last = stages[0], stages[-1]
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert last.embed_tokens is None and last.lm_head is not None and last.norm is not None
    assert [[layer.layer_idx for layer in m.layers] for m in stages] == [list(range(a, b)) for a, b in
                                                                       partition_layers(sum(split), len(split), split)]
    if whole.config.tie_word_embeddings:  # the last stage read the embedding's tensor as its LM head
        assert torch.equal(last.lm_head.weight, whole.embed_tokens.weight)
    if quant is not None:
        assert type(last.layers[0].down_proj.method) is type(whole.layers[0].down_proj.method)
        assert type(whole.layers[0].down_proj.method).__name__ == f"{quant.capitalize()}LinearMethod"
    got, ref = _chained_logits(stages, _prompts(1)[0], whole)
    assert got.shape == ref.shape == (30, VOCAB)
    assert torch.equal(got, ref)  # the same operations on the same tensors: bit for bit


def test_a_stage_reads_only_its_tensors(ckpts):
    """Loading a stage marks only its tensors read; an unknown tensor is still an error (on the last stage)."""
    from fastinfer.layers import SafetensorsReader, TensorDictReader

    path = ckpts("llama")
    reader = SafetensorsReader(path)
    m = load_model(reader, dtype=torch.float32, config=load_model(path).config, stage=PipelineStage(0, 2, 0, 2))
    assert sorted(reader.used) == sorted(n for n in reader.names() if n.startswith(("model.layers.0.",
                                                                                     "model.layers.1.",
                                                                                     "model.embed_tokens")))
    assert len(m.layers) == 2
    tensors = {n: reader._read(n) for n in reader.names()}
    tensors["model.extra.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_model(TensorDictReader(tensors, "test"), dtype=torch.float32, config=m.config,
                   stage=PipelineStage(1, 2, 2, 3))


# ------------------------------------------------------------------------------------------------
# engines: PP=2 against PP=1
# ------------------------------------------------------------------------------------------------
def _track_in_flight(llm, monkeypatch):
    """Counts, on ``llm``'s executor, the most batches submitted and not yet collected at once."""
    ex, seen = llm.executor, {"now": 0, "max": 0}
    submit, collect = ex.submit, ex.collect

    def counted_submit(step):
        seen["now"] += 1
        seen["max"] = max(seen["max"], seen["now"])
        return submit(step)

    def counted_collect(pending):
        seen["now"] -= 1
        return collect(pending)

    monkeypatch.setattr(ex, "submit", counted_submit)
    monkeypatch.setattr(ex, "collect", counted_collect)
    return seen


def _check_equal(ref_llm, llm, prompts):
    a, b = _plan_logits(ref_llm, prompts[0]), _plan_logits(llm, prompts[0])
    assert a.shape == b.shape == (len(prompts[0]) + 1, ref_llm.model.config.vocab_size)
    assert _rel(b, a) < REL_TOL, _rel(b, a)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == ref
    return _rel(b, a)


@pytest.mark.parametrize("name, partition", [("llama", None), ("llama", "1,2"), ("qwen2", None),
                                             ("mistral", None)])
def test_pp2_equals_pp1_random_models(ckpts, engines, monkeypatch, name, partition):
    path = ckpts(name)
    pp1 = engines(path, num_kv_blocks=32, dtype="float32")
    pp2 = engines(path, num_kv_blocks=32, dtype="float32", pipeline_parallel_size=PP, pipeline_partition=partition)
    in_flight = _track_in_flight(pp2, monkeypatch)
    L = pp1.model.config.num_hidden_layers
    first = partition_layers(L, PP, partition)[0]
    assert [m.layer_idx for m in pp2.model.layers] == list(range(*first))  # rank 0 holds stage 0 only
    assert pp2.model.lm_head is None and len(pp2.executor.kv_caches) == first[1] - first[0]
    prompts = _prompts()
    _check_equal(pp1, pp2, prompts)
    assert in_flight["max"] == PP  # the default: one batch per stage
    # prefix-cache hits in both batches in flight: each table starts with cached blocks
    hits = pp2.stats()["prefix_cache_hits"]
    again = [p + [7, 8, 9 + i] for i, p in enumerate(prompts)] + [prompts[0] + [11, 12]]
    assert ([o.outputs[0].token_ids for o in pp2.generate(again, GREEDY)]
            == [o.outputs[0].token_ids for o in pp1.generate(again, GREEDY)])
    assert pp2.stats()["prefix_cache_hits"] - hits >= pp2.block_size * len(again)  # (tokens: a block each)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_pp2_equals_pp1_quantised_on_load(ckpts, engines, quant):
    path = ckpts("llama")
    qc = {"group_size": 64} if quant == "int4" else None
    pp1 = engines(path, num_kv_blocks=32, dtype="float32", quantization=quant, quantization_config=qc)
    pp2 = engines(path, num_kv_blocks=32, dtype="float32", quantization=quant, quantization_config=qc,
                  pipeline_parallel_size=PP)
    assert type(pp2.model.layers[0].down_proj.method).__name__ == f"{quant.capitalize()}LinearMethod"
    _check_equal(pp1, pp2, _prompts(n=2))


@pytest.mark.parametrize("name, kw", [("mixtral", {}), ("qwen3_moe", {}), ("qwen3_moe", dict(expert_parallel_size=2))])
def test_pp2_equals_pp1_mixture_of_experts(ckpts, engines, name, kw):
    """Mixtral (both layers routed, one per stage) and Qwen3-MoE (which layers are routed follows the layer's index
    in the whole model: stage 0 holds dense layer 0 and routed layer 1, stage 1 dense layer 2 and
    routed layer 3) under PP=2, and PP=2 x EP=2 (4 processes, each stage's 8 experts split 4 + 4
    over its two ranks). Every logit is one process's bit for bit (float32): a stage boundary passes
    the tensors as they are, and expert parallelism is bit for bit itself."""
    from fastinfer.layers import FusedMoE

    path = ckpts(name)
    pp1 = engines(path, num_kv_blocks=32, dtype="float32")
    pp2 = engines(path, num_kv_blocks=32, dtype="float32", pipeline_parallel_size=PP, **kw)
    routed = [isinstance(getattr(layer, "moe", None), FusedMoE) for layer in pp2.model.layers]
    assert routed == ([True] if name == "mixtral" else [False, True])  # Mixtral: 2 layers, 1 + 1
    moe = pp2.model.layers[-1].moe
    assert (moe.first_expert, moe.num_local_experts) == ((0, 4) if kw else (0, moe.num_experts))
    prompts = _prompts()
    a, b = _plan_logits(pp1, prompts[0]), _plan_logits(pp2, prompts[0])
    assert torch.equal(a, b)
    assert _check_equal(pp1, pp2, prompts) == 0.0
    if kw:  # rank 0 counts the routing of its stage's MoE layers (layer 1: 3 slots per token), per EP rank
        before = sum(pp2.stats()["expert_parallel_routed_slots"])
        _plan_logits(pp2, prompts[1])
        assert len(pp2.stats()["expert_parallel_routed_slots"]) == 2
        assert sum(pp2.stats()["expert_parallel_routed_slots"]) - before == (len(prompts[1]) + 1) * 3


def test_pp2_equals_pp1_with_forced_preemption(engines, monkeypatch):
    """The shipped model (tied embeddings, 5 layers: 3 + 2) with a KV pool small enough to preempt,
    two batches in flight."""
    kw = dict(num_kv_blocks=10, max_num_seqs=6, dtype="float32")
    prompts = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "for i in range(10):",
               "while True:", "x = ["]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    a = engines(**kw)
    b = engines(pipeline_parallel_size=PP, **kw)
    in_flight = _track_in_flight(b, monkeypatch)
    ref = [o.outputs[0].token_ids for o in a.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in b.generate(prompts, sp)]
    assert got == ref
    assert b.stats()["num_preemptions"] > 0
    assert b.stats()["num_preemptions"] == a.stats()["num_preemptions"]
    assert in_flight["max"] == PP


# ------------------------------------------------------------------------------------------------
# faults, shutdown, torchrun
# ------------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
            return f.read().split(") ")[1][0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _wait_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), pids


def test_killed_and_hung_stages_fail_within_10_s_naming_rank_and_stage(ckpts, engines, monkeypatch):
    """A killed stage fails its engine within 10 s naming the rank and the stage, and every later
    call too; a hung (stopped) stage of another engine misses the 3 s deadline and fails it within
    10 s; shutdown leaves no process behind."""
    monkeypatch.setenv("FASTINFER_TP_TIMEOUT", "3")
    path = ckpts("llama")
    a = engines(path, num_kv_blocks=16, dtype="float32", pipeline_parallel_size=PP)
    b = engines(path, num_kv_blocks=16, dtype="float32", pipeline_parallel_size=PP)
    pids = a.executor.runner.worker_pids + b.executor.runner.worker_pids
    prompt = _prompts(n=1)
    ref = a.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert b.generate(prompt, GREEDY)[0].outputs[0].token_ids == ref

    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"pipeline-parallel worker rank 1 \(stage 1 of 2, pid \d+\) "
                                                  r"died \(killed by SIGKILL\)"):
        a.generate(prompt, GREEDY)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TensorParallelError, match="the pipeline-parallel engine has stopped"):
        a.generate(prompt, GREEDY)
    assert b.generate(prompt, GREEDY)[0].outputs[0].token_ids == ref  # the other engine is untouched

    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"pipeline-parallel worker rank 1 \(stage 1 of 2, pid \d+\) "
                                                  "is alive but did not answer"):
        b.generate(prompt, GREEDY)
    assert time.monotonic() - t0 < 10
    for e in (a, b):
        e.shutdown()
        e.shutdown()  # idempotent
    _wait_gone(pids)


def test_a_stage_killed_with_two_batches_in_flight_fails_within_10_s(engines, monkeypatch):
    """The last stage killed while a generate call keeps two batches in the pipeline (rank 0
    waiting for logits, its posted sends unfinished): the call raises within 10 s of the kill,
    naming the rank and its stage."""
    import threading

    monkeypatch.setenv("FASTINFER_TP_TIMEOUT", "3")
    llm = engines(num_kv_blocks=32, max_num_seqs=4, dtype="float32", pipeline_parallel_size=PP)
    pid = llm.executor.runner.worker_pids[0]
    in_flight = _track_in_flight(llm, monkeypatch)
    killed = []

    def kill_when_both_in_flight():
        deadline = time.monotonic() + 60
        while in_flight["now"] < PP and time.monotonic() < deadline:
            time.sleep(0.01)
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=kill_when_both_in_flight, daemon=True)
    t.start()
    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    with pytest.raises(TensorParallelError, match=r"pipeline-parallel worker rank 1 \(stage 1 of 2, pid \d+\) "
                                                  r"died \(killed by SIGKILL\)"):
        llm.generate(["def fibonacci(n):", "class Stack:", "import os", "while True:"], sp)
    t.join(10)
    assert killed and time.monotonic() - killed[0] < 10
    llm.shutdown()
    _wait_gone([pid])


def test_workers_exit_when_rank0_is_killed(tmp_path):
    """Rank 0 of PP=2 x TP=2 killed outright (no shutdown runs): its 3 workers (stage 0's second
    rank and both ranks of stage 1) notice and exit within seconds."""
    import fastinfer

    code = ("import time, torch; torch.set_num_threads(1)\n"
            "from fastinfer import LLM\n"
            "if __name__ == '__main__':\n"
            "    llm = LLM(num_kv_blocks=16, pipeline_parallel_size=2, tensor_parallel_size=2)\n"
            "    print(*llm.executor.runner.worker_pids, flush=True)\n"
            "    time.sleep(120)\n")
    script = tmp_path / "rank0.py"
    script.write_text(code)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(fastinfer.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_root, os.environ.get("PYTHONPATH", "")]),
               FASTINFER_TP_THREADS="1")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        workers = [int(w) for w in line.split()]
        assert len(workers) == 3 and all(_alive(w) for w in workers), line
    finally:
        p.kill()
        p.wait(10)
    _wait_gone(workers, within=10.0)


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_two_stages(tmp_path, nproc):
    """``torchrun --nproc-per-node N -m fastinfer generate --pipeline-parallel-size 2``: rank 0 runs
    stage 0 and the scheduler; with 2 processes rank 1 is stage 1, with 4 (``--tensor-parallel-size``
    defaults to WORLD_SIZE / 2) ranks 0, 1 are stage 0 and 2, 3 stage 1, each a tensor-parallel
    group; the tokens are the in-process engine's."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to the interpreter")
    import fastinfer

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(fastinfer.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_root, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", FASTINFER_TP_THREADS="1")
    prompt = "def fibonacci(n):"
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0", "-m", "fastinfer",
           "generate", "--prompt", prompt, "--max-tokens", "10", "--json", "--ignore-eos", "--dtype", "float32",
           "--pipeline-parallel-size", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout[out.stdout.index("["):])[0]["outputs"][0]["token_ids"]
    ref = LLM(num_kv_blocks=64, dtype="float32").generate(prompt, GREEDY)
    assert got == ref[0].outputs[0].token_ids


def test_bench_counts_the_communication_the_model_scales(tmp_path):
    """bench/pp.py: rank 0's counts of a decode step under TP=2 and PP=2 x TP=2 (6 processes in
    turn) equal the formula, the rates derived from them are 2 all-reduces per layer + 1, one value
    per row and hidden unit an all-reduce, two a boundary (hidden state + residual), 4 bytes per
    logit; the model's network bytes per GPU are those rates at Llama-3-70B's shape (hand-worked:
    80 layers, hidden 8192, vocabulary 128256, bf16)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    try:
        import pp as bench_pp
    finally:
        sys.path.pop(0)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=320)
    c = bench_pp.counted(str(tmp_path), 3, shape)
    assert c["measured"] == c["formula"] and c["matches"], c
    assert c["measured"]["PP=2 x TP=2"] == dict(all_reduces=5, all_reduce_bytes=5 * 3 * 128 * 4,
                                                boundary_bytes=2 * 3 * 128 * 4, logits_bytes=3 * 320 * 4)
    assert c["rates"] == dict(all_reduces_per_layer=2, fixed_all_reduces=1, all_reduce_values_per_row_hidden=1,
                              boundary_values_per_row_hidden=2, logits_bytes_per_row_vocab=4)
    tp16, pp1, pp2 = bench_pp.model_step(bench_pp.MODEL_SHAPES["llama3-70b"], 8, 10e-6, 25e-6, c["rates"])
    assert tp16["collectives"] == 2 * 80 + 1 + 1
    assert tp16["network_bytes_per_gpu"] == 161 * 2 * 15 / 16 * 8 * 8192 * 2 + 8 * 128256 * 4 / 16
    assert pp1["network_bytes_per_gpu"] == pp2["network_bytes_per_gpu"] == 8 * (2 * 8192 * 2 + 128256 * 4)
    assert pp1["collectives"] == 2 * 40 + 1 + 2


def _in_group(pid: int, pgid: int) -> bool:
    try:
        return os.getpgid(pid) == pgid
    except (ProcessLookupError, PermissionError):
        return False


def test_serve_with_two_stages(engines):
    """``fastinfer serve --pipeline-parallel-size 2`` (a loopback port, bounded): 4 concurrent greedy
    completions (two batches in flight) are the in-process engine's; SIGTERM stops the server and
    its stage-1 worker with exit status 0."""
    from concurrent.futures import ThreadPoolExecutor

    from serve_helpers import ServerProcess

    prompts = ["def fibonacci(n):", "class Stack:", "import os", "while True:"]
    srv = ServerProcess("--pipeline-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        def complete(prompt):
            status, _, body = srv.request("POST", "/v1/completions", {
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                "ignore_eos": True}, timeout=120)
            assert status == 200, body
            return json.loads(body)["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        group = [int(d) for d in os.listdir("/proc") if d.isdigit() and _in_group(int(d), srv.proc.pid)]
        assert len(group) >= 2, group  # the server and its worker
    finally:
        code = srv.stop()
    assert code == 0
    _wait_gone(group)
    ref = engines(num_kv_blocks=64, dtype="float32").generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                                      ignore_eos=True))
    assert got == [o.outputs[0].text for o in ref]


def test_rank0_posts_the_logits_receive_after_the_hidden_state_send(engines, monkeypatch):
    """NCCL runs the sends and receives between two ranks in the order they were posted, on one
    stream: a receive of batch k's logits from stage 1 posted before the send of batch k's hidden
    state to stage 1 would wait for logits that need that hidden state (a deadlock at PP=2). Rank
    0's pipeline traffic, two batches in flight: per batch, send to stage 1, then receive from it."""
    llm = engines(num_kv_blocks=32, dtype="float32", pipeline_parallel_size=PP)
    comm, order = llm.executor.runner.stage.comm, []
    post_send, post_recv = comm.post_send, comm.post_recv

    def send(t, dst, tag=0):
        order.append(("send", dst, tag))
        return post_send(t, dst, tag)

    def recv(t, src, tag=0):
        order.append(("recv", src, tag))
        return post_recv(t, src, tag)

    monkeypatch.setattr(comm, "post_send", send)
    monkeypatch.setattr(comm, "post_recv", recv)
    llm.generate(["def fibonacci(n):", "class Stack:", "import os"], SamplingParams(max_tokens=6, temperature=0.0,
                                                                                   ignore_eos=True))
    assert len(order) >= 2 * 6 and len(order) % 2 == 0
    for i in range(0, len(order), 2):
        (a, dst, tag), (b, src, tag2) = order[i], order[i + 1]
        assert (a, dst, b, src, tag2) == ("send", 1, "recv", 1, tag), order[i: i + 2]


# ------------------------------------------------------------------------------------------------
# PP x TP
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_pp2_x_tp2_equals_one_process(ckpts, engines, name):
    """4 processes: stage 0 = ranks 0, 1 and stage 1 = ranks 2, 3, each stage tensor-parallel; the
    hidden state goes rank 0 -> 2 and 1 -> 3, the logits (gathered on rank 2) back to rank 0. Qwen2:
    the tied LM head on stage 1 reads its vocabulary slice of the embedding."""
    path = ckpts(name)
    one = engines(path, num_kv_blocks=32, dtype="float32")
    four = engines(path, num_kv_blocks=32, dtype="float32", pipeline_parallel_size=PP, tensor_parallel_size=2)
    assert len(four.executor.runner.worker_pids) == 3
    c = one.model.config
    assert four.model.layers[0].o_proj.weight.shape[1] == c.num_attention_heads * c.head_dim // 2  # a TP shard
    assert four.model.embed_tokens.weight.shape[0] == 384 // 2  # 300 padded to a multiple of 64 * 2
    _check_equal(one, four, _prompts(n=2))


@pytest.mark.cuda
def test_nccl_pp2_equals_pp1(ckpts, engines):
    """NCCL, one GPU per stage, two batches in flight (bf16: greedy tokens must mostly agree, logits
    within bf16 rounding)."""
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= PP):
        pytest.skip("needs 2 GPUs")
    path = ckpts("llama")
    pp1 = engines(path, device="cuda", num_kv_blocks=64)
    pp2 = engines(path, device="cuda", num_kv_blocks=64, pipeline_parallel_size=PP)
    prompts = _prompts()
    a, b = _plan_logits(pp1, prompts[0]), _plan_logits(pp2, prompts[0])
    assert _rel(b, a) < 2e-2
    ref = [o.outputs[0].token_ids for o in pp1.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in pp2.generate(prompts, GREEDY)]
    agree = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g)) / sum(len(r) for r in ref)
    assert agree > 0.9, (ref, got)


# ------------------------------------------------------------------------------------------------
# batches in flight (the engine core, with a token-only executor)
# ------------------------------------------------------------------------------------------------
class _InFlightExecutor:
    """Next token = a function of the sequence's tokens; ``max_batches_in_flight`` batches may be
    submitted before the oldest is collected. Records what was in flight together."""

    max_model_len, vocab_size, draft_tree = 64, 97, None

    def __init__(self, in_flight: int, num_kv_blocks: int):
        self.max_batches_in_flight = in_flight
        self.num_kv_blocks = num_kv_blocks
        self.pending = []
        self.max_seen = 0
        self.batches = 0

    def _rows(self, step):
        sched = step.scheduled
        return [s for s, n in sched.prefills if s.num_computed_tokens + n == s.num_tokens] + sched.decodes

    def submit(self, step):
        from fastinfer.engine.messages import SampledToken

        ids = [s.seq_id for s, _ in step.scheduled.prefills] + [s.seq_id for s in step.scheduled.decodes]
        for other in self.pending:
            assert not set(ids) & set(other), "a sequence in two batches in flight"
        self.pending.append(ids)
        self.max_seen = max(self.max_seen, len(self.pending))
        self.batches += 1
        # computed at submit time, as the device would: the tokens cannot change while in flight
        return step, [SampledToken(s, (sum(s.token_ids) * 31 + len(s.token_ids)) % self.vocab_size, None)
                      for s in self._rows(step)]

    def collect(self, pending):
        from fastinfer.engine.messages import ModelOutput

        step, sampled = pending
        self.pending.pop(0)
        for s, _ in step.scheduled.prefills:  # never preempted while in flight: its blocks are still held
            assert s.block_table or s.is_finished
        return ModelOutput(sampled=sampled)

    def execute(self, step):
        return self.collect(self.submit(step))

    def stats(self):
        return {}


def _run_core(in_flight, num_kv_blocks=64, abort_after=None):
    from types import SimpleNamespace

    from fastinfer.engine.core import EngineCore
    from fastinfer.engine.params import SamplingParams as P

    config = SimpleNamespace(block_size=4, max_num_seqs=6, max_num_batched_tokens=16, enable_prefix_caching=True,
                             speculative=None, static_batching=False)
    ex = _InFlightExecutor(in_flight, num_kv_blocks)
    core = EngineCore(config, ex, eos_token_ids=[])
    for i in range(6):
        assert core.add_request(f"r{i}", [3 + i] * (5 + 3 * i), P(max_tokens=12, ignore_eos=True)) is None
    got, steps = {}, 0
    while core.has_unfinished_requests() and steps < 500:
        steps += 1
        if abort_after is not None and steps == abort_after:
            core.abort_request("r0")
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got, ex, core


def test_batches_in_flight_split_the_sequences_and_give_the_same_tokens():
    ref, ex1, _ = _run_core(1)
    got, ex2, core = _run_core(2)
    assert got == ref and all(len(t) == 12 for t in got.values())
    assert ex1.max_seen == 1 and ex2.max_seen == 2
    assert not core._in_flight and not core.has_unfinished_requests()
    # a small KV pool: sequences are preempted, never one in flight (the executor checks), same tokens
    small, ex3, core3 = _run_core(2, num_kv_blocks=14)
    assert small == ref and core3.scheduler.num_preemptions > 0 and ex3.max_seen == 2
    # a request aborted while its batch is in flight: its results are dropped, the others are unchanged
    aborted, _, core4 = _run_core(2, abort_after=4)
    assert len(aborted.get("r0", [])) < 12
    assert {k: v for k, v in aborted.items() if k != "r0"} == {k: v for k, v in ref.items() if k != "r0"}
    assert core4.block_manager.num_free_blocks == core4.block_manager.num_blocks


def test_pp2_batches_in_flight_overlap_the_stages_and_give_the_same_tokens(ckpts, engines):
    """Two batches in flight (the default at PP=2) against one: the same greedy tokens, the running
    sequences split over the two (twice the engine steps), each stage's busy seconds counted."""
    path = ckpts("llama")
    prompts = _prompts(n=4)
    kw = dict(num_kv_blocks=32, dtype="float32", pipeline_parallel_size=PP)
    one = engines(path, pipeline_batches_in_flight=1, **kw)
    two = engines(path, **kw)
    assert (one.executor.max_batches_in_flight, two.executor.max_batches_in_flight) == (1, 2)
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    busy = two.executor.runner.stage_busy_seconds()
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)] == ref
    after = two.executor.runner.stage_busy_seconds()
    assert len(after) == 2 and all(b > a for a, b in zip(busy, after))
    assert two.stats()["num_steps"] >= 2 * one.stats()["num_steps"] - 2


# ------------------------------------------------------------------------------------------------
# speculative decoding and the deterministic mode
# ------------------------------------------------------------------------------------------------
def test_pp2_speculative_decoding_with_a_draft_model_and_preemption(engines):
    """The shipped model and draft (tree mode: rank 0 drafts, every stage verifies its layers, the KV
    slot moves of a verification travel with the next plan) with a KV pool small enough to preempt:
    the greedy completions of one process."""
    kw = dict(draft_model=os.path.join(ASSETS, "tiny-llama-draft"), spec_mode="tree", num_spec_tokens=6,
              num_kv_blocks=10, max_num_seqs=6, dtype="float32")
    prompts = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "for i in range(10):",
               "while True:", "x = ["]
    sp = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=(i % 3 != 2))
          for i in range(len(prompts))]
    a = engines(**kw)
    b = engines(pipeline_parallel_size=PP, pipeline_batches_in_flight=1, **kw)
    assert [o.outputs[0].token_ids for o in b.generate(prompts, sp)] == \
        [o.outputs[0].token_ids for o in a.generate(prompts, sp)]
    st = b.stats()
    assert st["num_preemptions"] > 0 and st["spec_num_accepted_tokens"] > 0, st


def test_pp2_deterministic_mode_is_bitwise_one_process(ckpts, engines):
    """The batch-invariant mode under PP=2 with two batches in flight: the logits of one process bit
    for bit (a stage boundary passes the tensors as they are; micro-batches do not change a row), and
    the same tokens."""
    path = ckpts("qwen2")
    kw = dict(num_kv_blocks=32, dtype="float32", deterministic=True)
    one = engines(path, **kw)
    two = engines(path, pipeline_parallel_size=PP, **kw)
    prompts = _prompts(n=4)
    assert torch.equal(_plan_logits(one, prompts[0]), _plan_logits(two, prompts[0]))
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)] == \
        [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]


def test_errors_name_the_rank_and_its_stage():
    from fastinfer.engine.workers import rank_text

    c = EngineConfig(device="cpu", pipeline_parallel_size=2, tensor_parallel_size=2)
    assert rank_text(c, 3, 77) == "pipeline-parallel worker rank 3 (stage 1 of 2, pid 77)"
    assert rank_text(c, 1) == "pipeline-parallel worker rank 1 (stage 0 of 2)"
    assert rank_text(EngineConfig(device="cpu", tensor_parallel_size=2), 1, 5) == "tensor-parallel worker rank 1 (pid 5)"
