"""EngineConfig states every LLM option once: names checked, help and flags generated from its fields,
validation in one place; the speculative-method registry; the op backend given at construction."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import pydoc
import re

import pytest
import torch

import fastinfer
from fastinfer import LLM, cpu_has_native_bf16
from fastinfer.engine.config import EngineConfig, default_model_path, option_fields
from fastinfer.engine.speculative.registry import SPEC_METHODS, SPEC_REGISTRY, spec_method
from fastinfer.entrypoints import args as cli_args
from fastinfer.entrypoints.cli import build_parser
from fastinfer.ops import backend

ASSETS = os.path.dirname(default_model_path())
DRAFT = os.path.join(ASSETS, "tiny-llama-draft")
MEDUSA = os.path.join(ASSETS, "tiny-llama-medusa")
EAGLE = os.path.join(ASSETS, "tiny-llama-eagle")
PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "fastinfer")

# the flags each command had before they were generated (they must keep working, spelled so)
OLD_FLAGS = {
    "generate": ["--model", "--device", "--dtype", "--max-model-len", "--tensor-parallel-size", "--seed", "--deterministic",
                 "--draft-model", "--spec-method", "--spec-model", "--spec-mode", "--num-spec-tokens",
                 "--spec-tree-topk", "--spec-tree-depth", "--spec-tree", "--quantization", "--group-size",
                 "--symmetric", "--no-pad-groups"],
    "serve": ["--model", "--device", "--dtype", "--max-model-len", "--tensor-parallel-size", "--max-num-seqs",
              "--max-num-batched-tokens", "--block-size", "--num-kv-blocks", "--gpu-memory-utilization",
              "--no-enable-prefix-caching", "--enforce-eager", "--static-batching", "--seed", "--deterministic",
              "--draft-model", "--spec-method", "--spec-model", "--spec-mode", "--num-spec-tokens",
              "--spec-tree-topk", "--spec-tree-depth", "--spec-tree", "--quantization", "--group-size",
              "--symmetric", "--no-pad-groups"],
    "bench": ["--model", "--max-model-len", "--max-num-batched-tokens", "--num-kv-blocks",
              "--gpu-memory-utilization", "--enforce-eager", "--device", "--dtype", "--draft-model",
              "--spec-method", "--spec-model", "--spec-mode", "--num-spec-tokens", "--spec-tree-topk",
              "--spec-tree-depth", "--spec-tree", "--tensor-parallel-size", "--quantization", "--seed",
              "--deterministic"],
    "eval": ["--model", "--dtype", "--device", "--quantization", "--group-size", "--symmetric", "--no-pad-groups"],
}
COMMAND_OPTIONS = {"generate": cli_args.GENERATE_OPTIONS, "serve": cli_args.SERVE_OPTIONS,
                   "bench": cli_args.BENCH_OPTIONS, "eval": cli_args.EVAL_OPTIONS}


def _subparsers():
    ap = build_parser()
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices


def _config(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", **kw)


# ---- option names ---------------------------------------------------------------------------------

def test_unknown_option_is_a_type_error_naming_the_closest():
    with pytest.raises(TypeError, match=r"^unknown option 'blok_size'; did you mean 'block_size'\?$"):
        LLM(blok_size=16)  # raised before anything loads
    with pytest.raises(TypeError, match="did you mean 'spec_tree_topk'"):
        LLM(spec_tree_top_k=3)
    with pytest.raises(TypeError, match=r"unknown option 'zzz' \(options: model, tokenizer, "):
        EngineConfig.from_options(zzz=1)
    with pytest.raises(TypeError, match="unknown option 'speculative'"):  # derived, not an option
        EngineConfig.from_options(speculative=None)


def test_help_and_signature_list_every_option_with_its_default():
    text = pydoc.render_doc(LLM)
    sig = inspect.signature(LLM)
    assert list(sig.parameters) == [f.name for f in option_fields()]
    for f in option_fields():
        assert sig.parameters[f.name].default == f.default
        assert re.search(rf"\b{f.name} \(", text), f.name
        assert f.metadata["help"].split()[0] in text
    assert "block_size (int; default: 16): tokens per KV-cache block" in " ".join(text.split())


# ---- validation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(block_size=12), "block_size must be a power of two in 8..256, got 12"),
    (dict(block_size=512), "block_size must be a power of two"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
    (dict(expert_parallel_size=0), "expert_parallel_size must be an int >= 1, got 0"),
    (dict(tensor_parallel_size=2, expert_parallel_size=4),
     "expert_parallel_size=4 with tensor_parallel_size=2: the experts split over the tensor-parallel processes"),
    (dict(dtype="fp12"), "unknown dtype 'fp12'"),
    (dict(model="/nonexistent/model"), "model directory not found"),
    (dict(spec_method="ngram", spec_model=DRAFT),
     re.escape("spec_method must be one of ('draft', 'medusa', 'eagle', 'eagle3', 'dflash'), got 'ngram'")),
    (dict(spec_method="eagle"), "needs spec_model"),
    (dict(draft_model=DRAFT, spec_tree_topk=0), "spec_tree_topk must be an int >= 1"),
    (dict(draft_model=DRAFT, spec_tree=[[0]]), "spec_tree .* needs spec_method='medusa' or spec_method='dflash' in tree mode"),
    (dict(spec_method="eagle", spec_model=EAGLE, tensor_parallel_size=2), "needs the target's hidden states"),
    (dict(spec_method="eagle", spec_model=EAGLE, expert_parallel_size=2),
     "needs the target's hidden states, which expert_parallel_size=2 does not return yet"),
    (dict(quantization_config={"group_size": 64}), "quantization_config given without quantization"),
])
def test_validation_names_the_option(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


# ---- the method registry ------------------------------------------------------------------------------

def test_spec_registry_defaults():
    assert SPEC_METHODS == tuple(SPEC_REGISTRY) == ("draft", "medusa", "eagle", "eagle3", "dflash")
    with pytest.raises(ValueError, match="spec_method must be one of"):
        spec_method("ngram")
    assert [m for m in SPEC_METHODS if spec_method(m).tensor_parallel] == ["draft"]
    assert [m for m in SPEC_METHODS if spec_method(m).static_tree] == ["medusa", "dflash"]
    s = _config(draft_model=DRAFT).speculative
    assert (s.method, s.mode, s.num_tokens, s.tree_topk) == ("draft", "chain", 4, 2)
    s = _config(draft_model=DRAFT, spec_mode="tree").speculative
    assert (s.mode, s.num_tokens, s.tree_depth) == ("tree", 8, min(8, max(2, 8 // 4 + 1)))
    s = _config(spec_method="medusa", spec_model=MEDUSA).speculative
    assert (s.mode, s.num_tokens) == ("tree", None)
    s = _config(spec_method="eagle", spec_model=EAGLE).speculative
    assert (s.entry, s.mode, s.num_tokens) == (spec_method("eagle"), "chain", 4)
    assert _config().speculative is None


def test_registry_builds_the_method_proposer():
    from fastinfer.engine.block_manager import BlockManager
    from fastinfer.engine.speculative.proposer import (DraftModelProposer, EagleProposer, StaticTreeProposer,
                                                       make_proposer)

    bm = BlockManager(16, 16)
    draft_tree = [(0,), (1,)]
    for method, path, cls in (("draft", DRAFT, DraftModelProposer), ("eagle", EAGLE, EagleProposer),
                              ("medusa", MEDUSA, StaticTreeProposer)):
        spec = _config(spec_method=method, spec_model=path).speculative
        assert type(make_proposer(spec, bm, 64, draft_tree)) is cls


def test_every_method_has_its_builders_on_both_sides():
    """The registry is data; the builders are keyed by its names: the core's proposers, the executor's
    drafters and head loaders (a method without a loader reads the target's hidden states)."""
    from fastinfer.engine.speculative.build import DRAFT_LOADERS, DRAFTER_BUILDERS
    from fastinfer.engine.speculative.proposer import PROPOSER_BUILDERS

    assert tuple(PROPOSER_BUILDERS) == tuple(DRAFTER_BUILDERS) == SPEC_METHODS
    assert set(DRAFT_LOADERS) == set(SPEC_METHODS) - {"medusa"}


# ---- command-line flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command", sorted(OLD_FLAGS))
def test_cli_flags_are_generated_from_the_fields(command):
    p = _subparsers()[command]
    flags = {s for a in p._actions for s in a.option_strings}
    assert set(OLD_FLAGS[command]) <= flags
    by_dest = {a.dest: a for a in p._actions if a.option_strings}
    fields = {f.name: f for f in option_fields()}
    for name in COMMAND_OPTIONS[command]:
        a, f = by_dest[name], fields[name]
        assert cli_args.flag_of(name) in a.option_strings
        assert a.default is None  # not given: the field's default applies
        assert a.help.startswith(f.metadata["help"]) or name in ("model", "max_model_len")
        if isinstance(f.default, bool):
            assert isinstance(a, argparse._StoreFalseAction if f.default else argparse._StoreTrueAction)


def _parsed(command, argv):
    p = argparse.ArgumentParser()
    cli_args.add_cli_args(p, COMMAND_OPTIONS[command])
    if command != "bench":
        cli_args.add_quant_args(p)
    return cli_args.llm_kwargs(p.parse_args(argv), COMMAND_OPTIONS[command])


def test_cli_flags_parse_to_the_same_config():
    argv = ["--device", "cpu", "--block-size", "32", "--max-num-seqs", "7", "--no-enable-prefix-caching",
            "--deterministic", "--gpu-memory-utilization", "0.5", "--seed", "3", "--draft-model", DRAFT,
            "--spec-mode", "tree", "--num-spec-tokens", "6", "--spec-tree-topk", "3",
            "--quantization", "int4", "--group-size", "64", "--symmetric"]
    kw = dict(device="cpu", block_size=32, max_num_seqs=7, enable_prefix_caching=False, deterministic=True,
              gpu_memory_utilization=0.5, seed=3, draft_model=DRAFT, spec_mode="tree", num_spec_tokens=6,
              spec_tree_topk=3, quantization="int4", quantization_config={"group_size": 64, "symmetric": True})
    got = _parsed("serve", argv)
    assert got == kw
    assert EngineConfig.from_options(**got) == EngineConfig(**kw)
    assert _parsed("generate", ["--device", "cpu"]) == {"device": "cpu"}
    assert EngineConfig.from_options(**_parsed("eval", ["--device", "cpu"])) == _config()
    tree = _parsed("generate", ["--spec-method", "medusa", "--spec-model", MEDUSA, "--spec-tree", "[[0], [1, 0]]"])
    assert tree["spec_tree"] == [[0], [1, 0]]
    with pytest.raises(ValueError, match="--spec-tree must be JSON"):
        _parsed("generate", ["--spec-tree", "[[0]"])
    with pytest.raises(ValueError, match="need --quantization int4"):
        _parsed("eval", ["--symmetric"])


def test_expert_parallel_flag_sits_next_to_tensor_parallel():
    for command in ("generate", "serve", "bench"):
        names = COMMAND_OPTIONS[command]
        assert names[names.index("tensor_parallel_size") + 1] == "expert_parallel_size", command
        assert _parsed(command, ["--expert-parallel-size", "2"])["expert_parallel_size"] == 2, command
    assert "expert_parallel_size" not in COMMAND_OPTIONS["eval"]


def test_torchrun_world_size_is_the_default_tp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert _parsed("generate", [])["tensor_parallel_size"] == 2
    assert _parsed("generate", ["--tensor-parallel-size", "1"])["tensor_parallel_size"] == 1


# ---- each default stated once ---------------------------------------------------------------------------

def test_each_default_is_declared_once():
    """The engine's options are defaulted in EngineConfig only: no other module of the engine or the
    entry points restates ``block_size=16`` / ``spec_tree_topk=2`` (or ``tree_topk``) as a default."""
    pattern = re.compile(r"\b(block_size|spec_tree_topk|tree_topk)\s*(:\s*[\w\[\], ]+)?=\s*(16|2)\b")
    hits = []
    for sub in ("engine", "entrypoints"):
        for root, _, names in os.walk(os.path.join(PACKAGE, sub)):
            for n in names:
                path = os.path.join(root, n)
                if not n.endswith(".py") or path.endswith(os.path.join("engine", "config.py")):
                    continue
                with open(path, encoding="utf-8") as f:
                    hits += [f"{path}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)
    assert pattern.search("    block_size: int = 16,") and pattern.search("spec_tree_topk=2")  # the pattern bites


# ---- dtype "auto" ------------------------------------------------------------------------------------------
# tests/conftest.py pins fastinfer.cpu_has_native_bf16 to False for the session; cpu_has_native_bf16
# here is the function itself (imported when the module is collected, before the pin)


@pytest.mark.parametrize("flags, native", [
    ("fpu vme avx2 avx512f avx512bw avx512_vnni", False),  # AVX-512 without BF16
    ("fpu avx2 avx512f avx512_bf16 avx512_vnni", True),  # Cooper Lake, Zen 4
    ("fpu avx2 amx_tile amx_bf16 amx_int8", True),  # AMX alone
    ("fpu avx2 avx512_bf16x", False),  # a whole flag, not a prefix
])
def test_native_bf16_detection_reads_the_cpu_flags(tmp_path, flags, native):
    assert cpu_has_native_bf16.__module__ == "fastinfer"  # the function, not the suite's pin
    info = tmp_path / "cpuinfo"
    # Intel's cpuinfo also has a "vmx flags" line: only "flags" counts
    info.write_text("processor\t: 0\nmodel name\t: x\n"
                    f"flags\t\t: {flags}\nvmx flags\t: vnmi amx_bf16 avx512_bf16\nbugs\t\t: spectre_v1\n\n"
                    f"processor\t: 1\nflags\t\t: {flags}\n")
    assert cpu_has_native_bf16(str(info)) is native
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False  # no cpuinfo (not Linux): float32


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_dtype_auto_on_a_cpu_follows_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(fastinfer, "cpu_has_native_bf16", lambda *a, **k: native)
    for given in ({}, {"dtype": "auto"}, {"dtype": None}):
        c = _config(**given)
        assert (c.dtype, c.model_dtype) == (None, expected), given
    for name, explicit in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        c = _config(dtype=name)  # an explicit dtype always wins
        assert c.dtype == c.model_dtype == explicit
    assert _config(dtype=torch.float32).model_dtype == torch.float32
    assert dataclasses.replace(_config()).model_dtype == expected


def test_tensor_parallel_workers_build_rank_0_s_dtype(monkeypatch):
    from fastinfer.engine.worker import worker_config

    monkeypatch.setattr(fastinfer, "cpu_has_native_bf16", lambda *a, **k: True)
    rank0 = _config(draft_model=DRAFT)
    monkeypatch.setattr(fastinfer, "cpu_has_native_bf16", lambda *a, **k: False)  # what a worker would find
    w = worker_config(rank0)
    assert w.model_dtype == rank0.model_dtype == torch.bfloat16
    assert worker_config(w).model_dtype == torch.bfloat16  # applied again in the worker process
    assert w.speculative is None and not w.load_progress


def test_dtype_auto_on_cuda_is_the_checkpoint_s():
    from fastinfer.models import ModelConfig, default_dtype, load_config

    cuda = torch.device("cuda")
    conf = load_config(default_model_path())
    for stored, expected in ((torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                             (torch.float32, torch.bfloat16), (None, torch.bfloat16)):
        assert default_dtype(dataclasses.replace(conf, torch_dtype=stored), cuda) == expected
    assert isinstance(conf, ModelConfig)


def test_the_engine_runs_the_resolved_dtype_and_says_it_once(monkeypatch, capsys):
    monkeypatch.setattr(fastinfer, "cpu_has_native_bf16", lambda *a, **k: True)
    llm = LLM(device="cpu", num_kv_blocks=16, load_progress=True)
    assert llm.config.model_dtype == llm.model.dtype == llm.kv_cache_dtype == torch.bfloat16
    err = capsys.readouterr().err
    line = (f"fastinfer: loading {default_model_path()} on cpu, bfloat16 "
            "(dtype auto: this CPU computes bfloat16 natively)")
    assert err.count("fastinfer: loading") == 1 and line in err, err
    monkeypatch.setattr(fastinfer, "cpu_has_native_bf16", lambda *a, **k: False)
    llm = LLM(device="cpu", num_kv_blocks=16, load_progress=True)
    assert llm.model.dtype == torch.float32
    assert "float32 (dtype auto: this CPU has no native bfloat16)" in capsys.readouterr().err
    llm = LLM(device="cpu", num_kv_blocks=16, dtype="bfloat16", load_progress=True)
    assert llm.model.dtype == torch.bfloat16
    assert "bfloat16 (dtype given)" in capsys.readouterr().err
    LLM(device="cpu", num_kv_blocks=16)
    assert "fastinfer: loading" not in capsys.readouterr().err  # the library is quiet unless asked


def test_a_given_model_keeps_its_dtype_unless_one_is_given(monkeypatch):
    from fastinfer.models import load_model

    monkeypatch.setattr(fastinfer, "cpu_has_native_bf16", lambda *a, **k: True)  # auto must not convert it
    model = load_model(default_model_path(), dtype=torch.float32)
    same = LLM(model, device="cpu", num_kv_blocks=16)
    assert same.model is model and same.config.model_dtype == torch.float32
    bf16 = LLM(model, device="cpu", num_kv_blocks=16, dtype="bfloat16")
    assert bf16.model is not model and bf16.model.dtype == torch.bfloat16
    assert model.dtype == torch.float32  # the caller's model is left alone


def test_dtype_help_states_the_rule():
    for command in ("generate", "serve", "bench", "eval"):
        a = next(a for a in _subparsers()[command]._actions if "--dtype" in a.option_strings)
        assert "auto: on a CPU bfloat16 where the CPU computes it natively" in a.help, command
        assert "(default: 'auto')" in a.help, command
    assert "auto: on a CPU bfloat16" in LLM.__doc__


# ---- the op backend, given at construction -------------------------------------------------------------

def test_deterministic_mode_is_the_backend_built_from_the_config():
    llm = LLM(device="cpu", num_kv_blocks=16, deterministic=True, draft_model=DRAFT)
    ops = backend("fastinfer", deterministic=True)
    assert llm.config.ops_backend() is ops
    ex = llm.executor
    assert llm.model.ops is ops and ex.draft_model.ops is ops and ex.sampler.ops is ops and ex.ops is ops
    assert ex.drafter.deterministic and ex.sampler.deterministic
    assert all(m.ops is ops for m in llm.model.modules() if hasattr(m, "ops"))


def test_a_given_model_of_another_mode_is_rebuilt_not_changed():
    from fastinfer.models import load_model

    model = load_model(default_model_path(), dtype=torch.float32)
    llm = LLM(model, device="cpu", num_kv_blocks=16, deterministic=True)
    assert model.ops is backend() and not model.ops.deterministic  # the caller's model is left alone
    assert llm.model is not model and llm.model.ops is backend("fastinfer", deterministic=True)
    same = LLM(model, device="cpu", num_kv_blocks=16)
    assert same.model is model


def test_without_speculation_resets_every_spec_option():
    c = _config(draft_model=DRAFT, spec_mode="tree", spec_tree_topk=3, block_size=32)
    w = c.without_speculation()
    assert w.speculative is None and w.block_size == 32 and w.spec_tree_topk == EngineConfig.spec_tree_topk
    assert dataclasses.replace(c) == c  # validation is idempotent
