"""Pipeline parallelism on this CPU: stages as processes (rank 0 here + spawned workers), gloo over
127.0.0.1.

The layer partition (even by default as vLLM's ``get_pp_indices``, or given), its validation and the
command-line flags; stage-local models (each holds only its layers, the embedding on the first stage,
the final norm and the LM head on the last, a tied LM head reading the embedding's tensor) chained in
one process against the whole model; then engines: PP=2 must equal PP=1 (float32 logits of a
prefill and a decode step within 1e-5 relative norm, identical greedy tokens) on random Llama (GQA),
Qwen2 (tied embeddings: the embedding and the LM head on different stages) and Mistral (sliding
window) checkpoints written by transformers, an uneven partition, fp8 and int4 quantisation on
load, a prefix-cache hit and forced preemption.

Every engine is shut down at teardown even when a test fails; collectives have deadlines.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

pytest.importorskip("transformers")

from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.distributed.pipeline import PipelineStage, parse_partition, partition_layers  # noqa: E402
from fastinfer.engine.config import EngineConfig, default_model_path  # noqa: E402
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
    (dict(pipeline_parallel_size=6), "pipeline_parallel_size=6 is larger than the model's 5 layers"),
    (dict(pipeline_parallel_size=2, draft_model=os.path.join(ASSETS, "tiny-llama-draft")),
     r"speculative decoding \(spec_method='draft'\) with pipeline_parallel_size=2 is not supported"),
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
