"""Command-line options of the entry points, generated from :class:`~fastinfer.engine.config.EngineConfig`.

Each engine option a command offers is one :class:`EngineConfig` field: :func:`add_cli_args` makes
its flag (``block_size`` -> ``--block-size``; a bool option that is on by default ->
``--no-<name>``, off by default -> ``--<name>``) with the field's help text and default, and
:func:`llm_kwargs` turns the parsed flags back into ``LLM(...)`` keyword arguments: only the flags
given, so every default is the field's. The option lists of the commands are below; what only a
command has (``--prompt``, ``--host``, ``--batch`` ...) is declared by the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Sequence

from ..engine.config import default_text, option_fields

__all__ = ["add_cli_args", "llm_kwargs", "add_quant_args", "flag_of", "MODEL_OPTIONS", "PARALLEL_OPTIONS",
           "SPEC_OPTIONS", "ENGINE_OPTIONS", "PRECISION_OPTIONS", "GENERATE_OPTIONS", "SERVE_OPTIONS", "BENCH_OPTIONS",
           "EVAL_OPTIONS"]

#: the processes of the engine (tensor, expert and pipeline parallelism)
PARALLEL_OPTIONS = ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size", "pipeline_partition",
                    "pipeline_batches_in_flight")
MODEL_OPTIONS = ("model", "device", "dtype", "max_model_len") + PARALLEL_OPTIONS
SPEC_OPTIONS = ("draft_model", "spec_method", "spec_model", "spec_mode", "num_spec_tokens", "spec_tree_topk",
                "spec_tree_depth", "spec_tree")
ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "gpu_memory_utilization",
                  "enable_prefix_caching", "enforce_eager", "max_cuda_graph_batch_size", "static_batching", "seed",
                  "deterministic")

#: the precision options every command that builds an engine offers: weights and KV cache
PRECISION_OPTIONS = ("quantization", "gguf_weights", "fp4_weights", "kv_cache_dtype")

#: the engine options each command offers as flags
GENERATE_OPTIONS = MODEL_OPTIONS + ("seed", "deterministic") + SPEC_OPTIONS + PRECISION_OPTIONS
SERVE_OPTIONS = MODEL_OPTIONS + ENGINE_OPTIONS + SPEC_OPTIONS + PRECISION_OPTIONS
BENCH_OPTIONS = ("model", "max_model_len", "max_num_batched_tokens", "num_kv_blocks", "gpu_memory_utilization",
                 "enforce_eager", "device", "dtype", "deterministic") + SPEC_OPTIONS + PARALLEL_OPTIONS + PRECISION_OPTIONS
EVAL_OPTIONS = ("model", "dtype", "device") + PRECISION_OPTIONS


def flag_of(name: str) -> str:
    """The flag of option ``name`` (a bool option on by default is switched off: ``--no-...``)."""
    f = _fields()[name]
    return f"--no-{name.replace('_', '-')}" if _switch(f) is True else f"--{name.replace('_', '-')}"


def _switch(f: dataclasses.Field) -> Optional[bool]:
    """A bool option's usual value (its default, or the ``switch`` of one decided at start-up such
    as ``enable_prefix_caching``); None for other options."""
    return f.default if isinstance(f.default, bool) else f.metadata.get("switch")


def _fields() -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in option_fields()}


def add_cli_args(p: argparse.ArgumentParser, names: Sequence[str], help_overrides: Optional[Mapping[str, str]] = None
                 ) -> None:
    """Add the flags of the options ``names`` (:class:`EngineConfig` fields) to ``p``: help text and
    default from the field; ``help_overrides``: a command's own help for an option whose meaning it
    narrows (e.g. bench's default ``--max-model-len``). Every flag parses to None when not given."""
    fields = _fields()
    for name in names:
        f = fields[name]
        if not f.metadata.get("cli"):
            raise ValueError(f"option {name!r} is not offered on the command line")
        meta = f.metadata
        text = (help_overrides or {}).get(name)
        if text is None:
            default = meta.get("cli_default_doc") or default_text(f)
            text = meta["help"] + ("" if _switch(f) is not None else f" (default: {default})")
        flag = flag_of(name)
        if _switch(f) is not None:
            action = "store_false" if _switch(f) else "store_true"
            p.add_argument(flag, dest=name, action=action, default=None, help=text)
            continue
        kind = type(f.default) if f.default is not None and not isinstance(f.default, str) else _cli_type(f)
        p.add_argument(flag, dest=name, type=kind, default=None, choices=meta.get("choices"), help=text)


def _cli_type(f: dataclasses.Field):
    """int / float for the options annotated so (``Optional[int]``), else str."""
    t = str(f.type)
    return {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float}.get(t, str)


def llm_kwargs(args: argparse.Namespace, names: Sequence[str]) -> Dict[str, Any]:
    """``LLM(...)`` keyword arguments of the options ``names`` given on the command line, plus
    ``quantization_config`` (:func:`add_quant_args`' int4 options, when the parser has them) and,
    under torchrun without ``--tensor-parallel-size``, ``tensor_parallel_size=WORLD_SIZE //
    pipeline_parallel_size``."""
    fields = _fields()
    out: Dict[str, Any] = {}
    for name in names:
        v = getattr(args, name)
        if v is not None:
            parse = fields[name].metadata.get("parse")
            out[name] = parse(v) if parse is not None and isinstance(v, str) else v
    if "tensor_parallel_size" in names and "tensor_parallel_size" not in out \
            and "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        out["tensor_parallel_size"] = int(os.environ["WORLD_SIZE"]) // max(1, int(out.get("pipeline_parallel_size", 1)))
    if hasattr(args, "pad_groups"):
        qc = quant_config(args, out.get("quantization"))
        if qc is not None:
            out["quantization_config"] = qc
    return out


def add_quant_args(p: argparse.ArgumentParser) -> None:
    """The int4 options of ``quantization_config`` (``--quantization`` on load, ``--method`` for
    ``fastinfer quantize``)."""
    p.add_argument("--group-size", type=int, default=None,
                   help="int4: input features per scale / zero point, a multiple of 32 (default: 128)")
    p.add_argument("--symmetric", action="store_true",
                   help="int4: no zero points (z = 8, scale = amax / 7) (default: asymmetric, with zero points)")
    p.add_argument("--no-pad-groups", dest="pad_groups", action="store_false",
                   help="int4: refuse a layer whose input size the group size does not divide (default: "
                        "zero-pad its last group, which is exact)")


def quant_config(args: argparse.Namespace, quantization: Optional[str]) -> Optional[Dict[str, Any]]:
    """``quantization_config`` of :func:`add_quant_args`' options (None: none given); they need
    ``--quantization``."""
    if quantization is None:
        if args.group_size is not None or args.symmetric or not args.pad_groups:
            raise ValueError("--group-size / --symmetric / --no-pad-groups need --quantization int4")
        return None
    qc: Dict[str, Any] = {}
    if args.group_size is not None:
        qc["group_size"] = args.group_size
    if args.symmetric:
        qc["symmetric"] = True
    if not args.pad_groups:
        qc["pad_groups"] = False
    return qc or None
