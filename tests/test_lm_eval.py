"""lm-evaluation-harness (the pinned ``lm_eval``) against ``fastinfer serve``: the shipped tiny model
served float32 and scored by lm-eval's ``local-completions`` model, and the same checkpoint scored by
lm-eval's own ``hf`` model (transformers, float32, CPU) on the same local tasks (tests/data/lm_eval_tasks:
a multiple-choice loglikelihood task and a greedy generate_until task). lm-eval and transformers are
the oracle: per-item loglikelihoods agree within 1e-3, accuracies are equal, generated texts equal.
Each evaluation runs in its own interpreter with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set and a
private HF cache, bounded by a timeout, so nothing is downloaded and nothing outside tmp is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import fastinfer

pytest.importorskip("lm_eval", reason="lm_eval (lm-evaluation-harness, the `test` extra) is not installed")

from serve_helpers import ServerProcess  # noqa: E402

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lm_eval_tasks")
TINY = os.path.join(os.path.dirname(os.path.abspath(fastinfer.__file__)), "assets", "tiny-llama")
TASKS = ["fastinfer_tiny_mc", "fastinfer_tiny_gen"]

# simple_evaluate on TASKS; prints one JSON line: per task, the metric and per document the
# responses lm-eval filtered (loglikelihoods of each choice / generated texts)
EVALUATE = textwrap.dedent("""
    import json, sys
    import lm_eval
    from lm_eval.tasks import TaskManager
    model, model_args, tasks = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3].split(",")
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                  task_manager=TaskManager(include_path="."), log_samples=True,
                                  batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    res = {}
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        res[task] = {"metrics": {k: v for k, v in out["results"][task].items() if isinstance(v, (int, float))},
                     "resps": [s["filtered_resps"] for s in samples]}
    print("RESULT " + json.dumps(res))
""")


def _evaluate(tmp_path, model: str, model_args: dict) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "datasets"),
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-c", EVALUATE, model, json.dumps(model_args), ",".join(TASKS)],
                       cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"lm_eval {model} failed ({r.returncode}):\n{r.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# add_bos_token on both sides: lm-eval's hf model otherwise follows the tokenizer (which prepends
# <|bos|>) and its API models send no BOS, so the two would score different token sequences.
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm_eval")
    server = ServerProcess(TINY, "--served-model-name", "tiny-llama")
    try:
        served = _evaluate(tmp, "local-completions", {
            "model": "tiny-llama", "base_url": server.base_url + "/v1/completions",
            "tokenizer_backend": "huggingface", "tokenizer": TINY, "tokenized_requests": True,
            "add_bos_token": True, "max_retries": 1, "timeout": 120, "num_concurrent": 1})
    finally:
        server.stop()
    reference = _evaluate(tmp, "hf", {"pretrained": TINY, "dtype": "float32", "device": "cpu",
                                           "add_bos_token": True})
    return served, reference


def test_multiple_choice_loglikelihoods_and_accuracy(results):
    served, reference = (r["fastinfer_tiny_mc"] for r in results)
    assert len(served["resps"]) == len(reference["resps"]) == 11
    worst = 0.0
    for doc_s, doc_r in zip(served["resps"], reference["resps"]):
        assert len(doc_s) == len(doc_r) >= 3
        for (ll_s, greedy_s), (ll_r, greedy_r) in zip(doc_s, doc_r):
            assert ll_s < 0 and ll_r < 0
            assert greedy_s == greedy_r
            worst = max(worst, abs(ll_s - ll_r))
    print(f"lm-eval mc: worst |loglikelihood difference| {worst:.2e}, acc {served['metrics']['acc,none']:.4f}")
    assert worst < 1e-3, worst
    assert served["metrics"]["acc,none"] == reference["metrics"]["acc,none"]
    # the choices' loglikelihoods differ enough for the accuracy to mean something
    assert any(len({round(ll, 2) for ll, _ in doc}) > 1 for doc in reference["resps"])


def test_generate_until_texts(results):
    served, reference = (r["fastinfer_tiny_gen"] for r in results)
    assert len(served["resps"]) == len(reference["resps"]) == 6
    assert served["resps"] == reference["resps"]
    assert any(text for doc in reference["resps"] for text in doc), "every generation came back empty"
    assert all("\n" not in text for doc in served["resps"] for text in doc)
    assert served["metrics"]["exact_match,none"] == reference["metrics"]["exact_match,none"]
