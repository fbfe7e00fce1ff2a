"""Command-line options shared by the entry points, and their translation to :class:`~fastinfer.LLM`
keyword arguments. Every option says what it does, its unit and its default."""

from __future__ import annotations

import argparse
from typing import Any, Dict

__all__ = ["add_model_args", "add_spec_args", "add_quant_args", "spec_kwargs", "quant_kwargs", "add_engine_args",
           "engine_kwargs", "tp_kwargs", "add_tp_args"]


def add_model_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--device", default=None,
                   help="cpu | cuda (default: cuda when a GPU and fastinfer's CUDA kernels are present, else cpu)")
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 (default: float32 on CPU; the checkpoint's fp16/bf16, "
                        "else bf16, on CUDA)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion, in tokens (default: the model's, capped by the KV pool)")
    add_tp_args(p)


def add_tp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="shard the model over this many processes / GPUs (default: WORLD_SIZE under torchrun, "
                        "else 1)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", default=None,
                   help="speculative decoding with this draft model directory (same tokenizer; default: off); "
                        "the same as --spec-method draft --spec-model DIR")
    p.add_argument("--spec-method", default=None, choices=["draft", "medusa", "eagle", "eagle3"],
                   help="draft: a draft model; medusa: Medusa heads / eagle: an EAGLE head / eagle3: an EAGLE-3 "
                        "head on the target's hidden states (needs --spec-model; default: draft when "
                        "--draft-model is given)")
    p.add_argument("--spec-model", default=None,
                   help="the draft model / heads directory of --spec-method (Medusa: Medusa or vLLM layout; "
                        "EAGLE: the EAGLE repository's layout; EAGLE-3: EAGLE repository or vLLM layout; "
                        "default: none)")
    p.add_argument("--spec-mode", default=None, choices=["chain", "tree"],
                   help="chain: draft tokens in a row; tree: EAGLE-2-style tree of draft tokens (Medusa: its "
                        "static tree) (default: chain for a draft model, tree for Medusa)")
    p.add_argument("--num-spec-tokens", type=int, default=None,
                   help="draft tokens per step: chain length / tree node budget (default: 4 chain, 8 tree; "
                        "Medusa: every head / the whole tree)")
    p.add_argument("--spec-tree-topk", type=int, default=2,
                   help="tree mode: children per expanded node (default: 2)")
    p.add_argument("--spec-tree-depth", type=int, default=None,
                   help="tree mode: levels, one draft forward each (default: min(N, max(2, N // (2 * topk) + 1)))")
    p.add_argument("--spec-tree", default=None,
                   help="Medusa: the static tree as JSON paths of top-k ranks, e.g. '[[0], [1], [0, 0]]' "
                        "(default: the built-in tree, fastinfer.engine.speculative.trees.DEFAULT_MEDUSA_TREE)")


def add_quant_args(p: argparse.ArgumentParser, on_load: bool) -> None:
    if on_load:
        p.add_argument("--quantization", default=None,
                       help="fp8 | int4 | int8: quantise a float checkpoint's linear layers on load (default: run the "
                            "checkpoint as stored; quantised checkpoints are detected from config.json)")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4: input features per scale / zero point, a multiple of 32 (default: 128)")
    p.add_argument("--symmetric", action="store_true",
                   help="int4: no zero points (z = 8, scale = amax / 7) (default: asymmetric, with zero points)")
    p.add_argument("--no-pad-groups", dest="pad_groups", action="store_false",
                   help="int4: refuse a layer whose input size the group size does not divide (default: "
                        "zero-pad its last group, which is exact)")


def spec_kwargs(args) -> Dict[str, Any]:
    """LLM(...) speculative keyword arguments of :func:`add_spec_args` options (none: no speculation)."""
    import json

    if not args.draft_model and not args.spec_model and not args.spec_method:
        return {}
    tree = None
    if args.spec_tree is not None:
        try:
            tree = json.loads(args.spec_tree)
        except ValueError as e:
            raise ValueError(f"--spec-tree must be JSON, e.g. '[[0], [1], [0, 0]]': {e}") from None
    return dict(draft_model=args.draft_model, spec_method=args.spec_method, spec_model=args.spec_model,
                spec_mode=args.spec_mode, num_spec_tokens=args.num_spec_tokens, spec_tree_topk=args.spec_tree_topk,
                spec_tree_depth=args.spec_tree_depth, spec_tree=tree)


def quant_kwargs(args) -> Dict[str, Any]:
    """``quantization`` / ``quantization_config`` for LLM(...) from --quantization and its options."""
    if args.quantization is None:
        if args.group_size is not None or args.symmetric or not args.pad_groups:
            raise ValueError("--group-size / --symmetric / --no-pad-groups need --quantization int4")
        return {}
    qc: Dict[str, Any] = {}
    if args.group_size is not None:
        qc["group_size"] = args.group_size
    if args.symmetric:
        qc["symmetric"] = True
    if not args.pad_groups:
        qc["pad_groups"] = False
    return {"quantization": args.quantization, "quantization_config": qc or None}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Scheduler and KV-cache options (``fastinfer serve``), named as vLLM names them."""
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in flight at most (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="new tokens per engine step, prefill chunks included (default: 2048 on CPU, 8192 on CUDA)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks in the pool (default: sized from --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + KV cache (default: 0.9)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of identical prompt prefixes (default: reuse them)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--static-batching", action="store_true",
                   help="admit new requests only into a batch still forming, not a running one (a baseline "
                        "for benchmarks; default: continuous batching)")
    p.add_argument("--seed", type=int, default=0, help="engine seed, for requests without their own (default: 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: a token's logits (and seeded tokens) do not depend on the batch, "
                        "prefill chunking, prefix cache or speculation, bit for bit (slower)")


def engine_kwargs(args) -> Dict[str, Any]:
    """LLM(...) keyword arguments of :func:`add_model_args` + :func:`add_engine_args` options."""
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
                static_batching=args.static_batching, seed=args.seed, deterministic=args.deterministic)


def tp_kwargs(args) -> Dict[str, Any]:
    """``tensor_parallel_size`` for LLM(...): the option, else torchrun's WORLD_SIZE, else nothing (1)."""
    import os

    n = args.tensor_parallel_size
    if n is None and "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        n = int(os.environ["WORLD_SIZE"])
    return {"tensor_parallel_size": n} if n is not None and n != 1 else {}
