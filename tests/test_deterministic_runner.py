"""The runner's deterministic mode, CPU: a probe request's tokens and logprobs are bitwise
the same alone, inside a busy batch with preemption, after a prefix-cache hit, under every prefill
chunk size tried, and with speculation in chain mode (draft model, EAGLE-3) and tree mode (draft
model, EAGLE-2 and EAGLE-3 trees, Medusa's static tree), greedy and seeded; fp32 and bf16. ``torch.equal``-strict: logprobs are compared as floats with ``==``.

The last test runs the same scenarios with the mode off and shows that some of them differ, so
these tests would catch a batch-dependent reduction.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from fastinfer import LLM, SamplingParams
from fastinfer.engine.config import default_model_path
from fastinfer.engine.sampler import position_noise
from fastinfer.ops import DETERMINISTIC_SPLIT_SIZE, backend

from test_spec_decode import _assert_no_leak

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ASSETS = os.path.dirname(default_model_path())
rng = random.Random(18)
PROBE = [rng.randrange(3, 4096) for _ in range(45)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True, logprobs=2)


def _assets(name):
    return os.path.join(ASSETS, name)


def _result(out):
    c = out.outputs[0]
    return c.token_ids, [sorted(d.items()) for d in c.logprobs]


def _llm(dtype, deterministic=True, **kw):
    kw.setdefault("num_kv_blocks", 256)
    return LLM(None, dtype=dtype, device="cpu", deterministic=deterministic, **kw)


def _busy_batch(llm, params):
    """The probe among 40 random requests (different lengths, some sharing its first tokens),
    added in a shuffled order; returns the probe's output."""
    r = random.Random(7)
    prompts, ps = [], []
    for i in range(40):
        body = [r.randrange(3, 4096) for _ in range(r.randint(1, 60))]
        prompts.append(PROBE[: r.randint(1, 40)] + body if i % 4 == 0 else body)
        ps.append(SamplingParams(max_tokens=r.randint(1, 14), temperature=r.choice([0.0, 0.7, 1.2]),
                                 seed=r.choice([None, i]), ignore_eos=True))
    at = r.randrange(len(prompts))
    prompts.insert(at, PROBE)
    ps.insert(at, params)
    outs = llm.generate(prompts, ps)
    return outs[at]


SCENARIOS = ["batch+preemption", "prefix-cache-hit", "chunk-1", "chunk-7", "chunk-16", "chunk-33",
             "draft-chain", "eagle3-chain", "draft-tree", "eagle-tree", "eagle3-tree", "medusa"]
# speculative method and asset of each speculation scenario (tree: top-2 children, depth 3)
SPEC = {"draft": "tiny-llama-draft", "eagle": "tiny-llama-eagle", "eagle3": "tiny-llama-eagle3",
        "medusa": "tiny-llama-medusa"}


def run_scenario(name, dtype, params, deterministic=True):
    if name == "batch+preemption":
        llm = _llm(dtype, deterministic, num_kv_blocks=14, max_num_seqs=32, max_num_batched_tokens=96)
        out = _busy_batch(llm, params)
        assert llm.stats()["num_preemptions"] > 0
    elif name == "prefix-cache-hit":
        llm = _llm(dtype, deterministic)
        llm.generate([PROBE[:40] + [7, 8, 9]], SamplingParams(max_tokens=2))
        out = llm.generate([PROBE], params)[0]
        assert out.num_cached_tokens > 0
    elif name.startswith("chunk-"):
        llm = _llm(dtype, deterministic, max_num_batched_tokens=int(name[6:]), enable_prefix_caching=False)
        out = llm.generate([PROBE], params)[0]
    elif name.split("-")[0] in SPEC:
        method, _, mode = name.partition("-")
        kw = {} if method == "medusa" else dict(spec_mode=mode, num_spec_tokens=3)
        if mode == "tree":
            kw["spec_tree_topk"] = 2
        llm = _llm(dtype, deterministic, spec_method=method, spec_model=_assets(SPEC[method]), **kw)
        out = llm.generate([PROBE], params)[0]
        assert llm.stats()["spec_num_draft_tokens"] > 0
    else:
        raise AssertionError(name)
    _assert_no_leak(llm)
    return _result(out)


@pytest.fixture(scope="module")
def alone():
    cache = {}

    def get(dtype, params, deterministic=True):
        key = (dtype, params.seed, deterministic)
        if key not in cache:
            cache[key] = _result(_llm(dtype, deterministic, enable_prefix_caching=False).generate([PROBE], params)[0])
        return cache[key]

    return get


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_probe_is_bitwise_the_same(scenario, params, dtype, alone):
    ref = alone(dtype, params)
    got = run_scenario(scenario, dtype, params)
    assert got[0] == ref[0], f"{scenario}: tokens differ"
    assert got[1] == ref[1], f"{scenario}: logprobs differ"


def test_mode_off_differs_somewhere(alone):
    """Without the mode the same scenarios do not all reproduce the probe's logprobs bit for bit
    (the CPU GEMMs' reduction order follows M, the decode and prefill attention paths differ)."""
    ref = alone(torch.float32, GREEDY, deterministic=False)
    differ = [s for s in SCENARIOS if run_scenario(s, torch.float32, GREEDY, deterministic=False)[1] != ref[1]]
    assert differ, "every scenario reproduced the probe bit for bit with deterministic=False"


def test_backend_binds_the_invariant_options():
    b = backend("fastinfer", deterministic=True)
    assert b is backend("fastinfer", True) and b is not backend("fastinfer")
    assert b.paged_decode_attention.keywords["fixed_split_size"] == DETERMINISTIC_SPLIT_SIZE
    assert b.int4_gemm.keywords["deterministic"] is True
    assert "fixed_split_size" not in backend("fastinfer").paged_decode_attention.keywords
    x, w = torch.randn(5, 64), torch.randn(32, 64)
    rows = torch.cat([b.linear(x[i:i + 1], w) for i in range(5)])
    assert torch.equal(rows, b.linear(x, w))
    llm = _llm(torch.float32)
    assert llm.model.ops.deterministic and all(m.ops is llm.model.ops for m in llm.model.modules() if hasattr(m, "ops"))
    assert position_noise(1, 2, 8, "cpu").shape == (8,)


ODD_VOCAB = 263  # a vocabulary of odd size: the LM head's dense_mm has N odd


def _odd_vocab_model(dtype):
    """A random Llama (2 layers, hidden 128, head_dim 64) with a 263-token vocabulary; weights N(0, 0.5)
    (25 x random_weights' N(0, 0.02)) so that the logits spread and greedy decoding meets no near ties."""
    from fastinfer.layers import TensorDictReader
    from fastinfer.models import ModelConfig, load_model, random_weights

    cfg = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=ODD_VOCAB,
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False))
    tensors = {k: v if "norm" in k else v * 25 for k, v in random_weights(cfg, dtype, "cpu", seed=5).items()}
    return load_model(TensorDictReader(tensors, "random odd-vocabulary Llama"), config=cfg, dtype=dtype,
                      device="cpu", max_positions=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_vocabulary_runs_deterministic(dtype):
    """deterministic=True on a model with an odd vocabulary (the LM head is dense_mm with N = 263):
    greedy decoding gives the default mode's tokens (their logprobs close), and the probe's tokens and
    logprobs are bitwise the same alone and inside a batch."""
    model = _odd_vocab_model(dtype)
    r = random.Random(3)
    probe = [r.randrange(ODD_VOCAB) for _ in range(21)]
    others = [[r.randrange(ODD_VOCAB) for _ in range(r.randint(1, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(model, device="cpu", deterministic=True, num_kv_blocks=64)
    assert llm.vocab_size == ODD_VOCAB and llm.model.ops.deterministic
    det = _result(llm.generate([probe], params)[0])
    batched = llm.generate(others[:3] + [probe] + others[3:], params)
    assert _result(batched[3]) == det  # batch invariant, bit for bit
    default = _result(LLM(model, device="cpu", num_kv_blocks=64).generate([probe], params)[0])
    assert det[0] == default[0]
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for d, f in zip(det[1], default[1]):
        assert d[0][0] == f[0][0] and abs(d[0][1] - f[0][1]) <= tol, (d, f)
