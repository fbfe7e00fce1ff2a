"""Engine configuration: every option :class:`~fastinfer.LLM` accepts, stated once.

Each option is one field of :class:`EngineConfig` with its default, its type and its help text
(``field(metadata=...)``); the validation is :meth:`EngineConfig.__post_init__`. What is built from
the fields: ``LLM(model, **options)``'s check of the option names (:func:`check_options`: an unknown
one is a TypeError naming the closest), the option list of ``help(LLM)`` (:func:`options_doc`) and
the command-line flags of ``fastinfer generate | serve | bench | eval``
(:func:`fastinfer.entrypoints.args.add_cli_args`).

What the fields derive, after validation: :attr:`EngineConfig.speculative` (a
:class:`SpeculativeConfig`, the method's defaults filled in from
:mod:`.speculative.registry`), :attr:`EngineConfig.quant_options` (:class:`~fastinfer.quant.QuantOptions`)
and :meth:`EngineConfig.ops_backend` (the op backend every model, the sampler, the drafter and the
verifier run with). What the executor derives from the model and the device (KV blocks, the final
``max_model_len``) is reported by the executor.

This module is longer than the engine's others: it holds the help text of every option, once.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..distributed import ParallelInfo
from ..distributed.pipeline import parse_partition, partition_layers
from ..layers.attention import FP8_KV_CACHE_DTYPE
from ..layers.batch import DEFAULT_BLOCK_SIZE
from ..models import default_dtype, find_gguf, load_config
from ..models.qwen3_5 import LinearAttentionShards
from ..quant import FP4_WEIGHTS, QuantOptions
from .speculative.registry import SPEC_METHODS, SPEC_MODES, SpecMethod, spec_method

__all__ = ["EngineConfig", "SpeculativeConfig", "SPEC_MODES", "SPEC_METHODS", "DTYPES", "KV_CACHE_DTYPES",
           "parse_dtype", "default_model_path", "is_checkpoint_path", "option_fields", "check_options", "options_doc"]

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "auto": None}


#: ``kv_cache_dtype`` values -> the KV pool's element type (None: the model's dtype). "fp8_e4m3" is
#: "fp8" spelled as vLLM also accepts it.
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_KV_CACHE_DTYPE, "fp8_e4m3": FP8_KV_CACHE_DTYPE}


def parse_dtype(dtype: Any) -> Optional[torch.dtype]:
    """A torch dtype, its name (``DTYPES``) or None / "auto" (None: resolved by
    :func:`~fastinfer.models.default_dtype`)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {sorted(DTYPES)})")
    return DTYPES[dtype]


def default_model_path() -> str:
    """The tiny model shipped with the package (``fastinfer/assets/tiny-llama``)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-llama")


def is_checkpoint_path(path: str) -> bool:
    """Whether ``path`` can name a checkpoint: a directory (Hugging Face, or holding a GGUF file)
    or a GGUF file (what is inside is checked when it loads)."""
    return os.path.isdir(path) or (os.path.isfile(path) and find_gguf(path) is not None)




def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _option(default: Any, group: str, help: str, *, default_doc: Optional[str] = None, cli: bool = True,
            choices: Optional[Tuple[str, ...]] = None, parse=None, cli_default_doc: Optional[str] = None,
            switch: Optional[bool] = None):
    """An :class:`EngineConfig` field: its default, and in ``metadata`` what documentation and the
    command line need: ``help`` (what it does, its unit), ``group`` (speculative / quantization /
    ...), ``default_doc`` (the default in words when the value alone does not say it), ``cli``
    (whether commands may offer it as a flag), ``choices``, ``parse`` (command-line text -> value)
    and ``cli_default_doc`` (the default of the flag when it is not the option's, e.g. torchrun's
    world size); ``switch``: a bool option whose None default is decided at start-up, on (True) or
    off (False) usually (its flag switches it the other way)."""
    return field(default=default, metadata=dict(help=help, group=group, default_doc=default_doc, cli=cli,
                                                 choices=choices, parse=parse, cli_default_doc=cli_default_doc,
                                                 switch=switch))


def _json_paths(text: str) -> List[List[int]]:
    import json

    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"--spec-tree must be JSON, e.g. '[[0], [1], [0, 0]]': {e}") from None


@dataclass
class SpeculativeConfig:
    """Speculative decoding (see :mod:`fastinfer.engine.speculative`), built by :class:`EngineConfig`
    from the ``spec_*`` options with the method's defaults (:mod:`.speculative.registry`).

    ``method`` "draft": ``draft_model`` is a draft model (checkpoint directory or model object);
    ``mode`` "chain" (default): ``num_tokens`` draft tokens in a row (default 4); "tree": an
    EAGLE-2-style tree of ``num_tokens`` nodes (default 8), ``tree_topk`` children per expanded
    node, ``tree_depth`` levels (default ``min(N, max(2, N // (2 * topk) + 1))``: one draft
    forward per level).

    ``method`` "medusa": ``draft_model`` is a Medusa heads directory (:mod:`.speculative.medusa`)
    or a ``MedusaHeads``; ``mode`` "tree" (default): the static tree ``tree`` (a list of top-k rank
    paths, default :data:`~.speculative.trees.DEFAULT_MEDUSA_TREE`), its first ``num_tokens`` paths
    when given; "chain": the top-1 token of each head, ``num_tokens`` deep (default: every head).

    ``method`` "eagle": ``draft_model`` is an EAGLE(-1/2) head directory (:mod:`.speculative.eagle`)
    or an ``EagleDraftModel``; ``mode`` and the sizes as for a draft model ("tree" is EAGLE-2's).
    ``method`` "eagle3": the same with an EAGLE-3 head (:mod:`.speculative.eagle3`, ``Eagle3DraftModel``).

    ``method`` "dflash": ``draft_model`` is a DFlash drafter directory (:mod:`.speculative.dflash`) or a
    ``DFlashDraftModel``; one forward drafts a block, its candidates a static tree as Medusa's (block
    position d for head d): ``mode`` "chain" (default) ``num_tokens`` positions (default the block's
    ``block_size - 1``), "tree" ``tree`` or the default tree.
    """

    draft_model: Any
    method: str
    mode: Optional[str]
    num_tokens: Optional[int]
    tree_topk: int
    tree_depth: Optional[int]
    tree: Optional[Any]

    def __post_init__(self):
        from .speculative.trees import check_tree

        entry = self.entry
        if self.mode is None:
            self.mode = entry.default_mode
        if self.mode not in SPEC_MODES:
            raise ValueError(f"spec_mode must be one of {SPEC_MODES}, got {self.mode!r}")
        if self.tree is not None:
            if not entry.static_tree or self.mode != "tree":
                statics = " or ".join(f"spec_method={m!r}" for m in SPEC_METHODS if spec_method(m).static_tree)
                raise ValueError(f"spec_tree (a static tree of top-k paths) needs {statics} in tree mode")
            self.tree = check_tree(self.tree)
        if self.num_tokens is None:
            self.num_tokens = entry.default_num_tokens[self.mode]
        k, topk, depth = self.num_tokens, self.tree_topk, self.tree_depth
        if k is not None and (not _is_int(k) or not 1 <= k <= 1024):
            raise ValueError(f"num_spec_tokens must be an int in [1, 1024], got {k!r}")
        if not _is_int(topk) or topk < 1:
            raise ValueError(f"spec_tree_topk must be an int >= 1, got {topk!r}")
        if depth is not None and (not _is_int(depth) or depth < 1):
            raise ValueError(f"spec_tree_depth must be an int >= 1 or None, got {depth!r}")
        if self.tree_depth is None and k is not None:
            # one draft forward per level; deeper levels rarely survive the best-N cut
            self.tree_depth = min(k, max(2, k // (2 * topk) + 1))
        if isinstance(self.draft_model, str):
            found = (is_checkpoint_path(self.draft_model) if entry.spec_model_is_checkpoint
                     else os.path.isdir(self.draft_model))
            if not found:
                raise ValueError(f"{entry.option} directory not found: {self.draft_model!r}"
                                 + (" (nor a .gguf file)" if entry.spec_model_is_checkpoint else ""))

    @property
    def entry(self) -> SpecMethod:
        """The method's registry entry (:mod:`.speculative.registry`)."""
        return spec_method(self.method)

    @property
    def spec_model(self) -> Any:
        """The draft model or the heads (one field for every method)."""
        return self.draft_model


_SPEC = "speculative"
_QUANT = "quantization"


@dataclass
class EngineConfig:
    """Every option of :class:`fastinfer.LLM` (``LLM(model, **options)``), with its default and
    help text; validated on construction (a ValueError naming the option). See the module docstring."""

    # ---- the model ------------------------------------------------------------------------------
    model: Any = _option(
        None, "model",
        "a Hugging Face checkpoint directory (safetensors, Llama/Mistral/Qwen2/Qwen3), a GGUF file (or a "
        "directory holding one; weights dequantised on load, tokenizer and chat template from its metadata), "
        "an already built model object (LlamaForCausalLM), or None for the shipped tiny model",
        default_doc="the shipped tiny model")
    tokenizer: Optional[str] = _option(
        None, "model",
        "directory with tokenizer.json, or a GGUF file (without one, prompts must be token ids and outputs "
        "have empty text)", default_doc="the model's", cli=False)
    dtype: Any = _option(
        "auto", "model", "auto | float32 | bfloat16 | float16 (or a torch dtype; None is auto): the weights' "
        "and activations' dtype. auto: on a CPU bfloat16 where the CPU computes it natively (x86 AVX-512 BF16 "
        "or AMX-BF16, read from /proc/cpuinfo: fastinfer.cpu_has_native_bf16), else float32; on CUDA the "
        "checkpoint's float16 / bfloat16, else bfloat16; a model object: its own dtype. The resolved dtype "
        "is EngineConfig.model_dtype (llm.config.model_dtype)")
    device: Any = _option(
        None, "model", "cpu | cuda",
        default_doc="cuda when fastinfer's CUDA kernels and a GPU are present, else cpu")
    max_model_len: Optional[int] = _option(
        None, "model", "longest prompt + completion, in tokens", default_doc="the model's, capped by the KV pool")
    # ---- scheduler and KV cache -------------------------------------------------------------------
    block_size: int = _option(DEFAULT_BLOCK_SIZE, "kv cache", "tokens per KV-cache block, a power of two in 8..256")
    max_num_seqs: int = _option(256, "scheduler", "sequences in flight at most")
    max_num_batched_tokens: Optional[int] = _option(
        None, "scheduler", "new tokens per engine step, prefill chunks included (chunked prefill)",
        default_doc="2048 on CPU, 8192 on CUDA")
    enable_prefix_caching: Optional[bool] = _option(
        None, "kv cache", "reuse the KV blocks of identical prompt prefixes",
        default_doc="on (hybrid models such as Qwen3.5 also cache their linear-attention state at block-aligned "
                    "prefix ends)",
        switch=True)
    kv_cache_dtype: str = _option(
        "auto", "kv cache", "auto: the KV cache in the model dtype; fp8 (or fp8_e4m3): e4m3 values, K / k_scale and "
        "V / v_scale with each layer's scales from the checkpoint (self_attn.k_scale / v_scale, vLLM and "
        "compressed-tensors checkpoints), else 1.0: one byte per value, so the same memory holds twice the "
        "tokens of a bf16 / fp16 cache", choices=tuple(KV_CACHE_DTYPES))
    num_kv_blocks: Optional[int] = _option(
        None, "kv cache", "KV-cache blocks in the pool (the first given of num_kv_blocks / kv_cache_bytes / "
        "gpu_memory_utilization sizes it; see fastinfer.engine.kv_sizing)",
        default_doc="sized from gpu_memory_utilization (CUDA) or max_model_len x min(max_num_seqs, 16) (CPU)")
    kv_cache_bytes: Optional[int] = _option(None, "kv cache", "bytes of the KV pool", cli=False)
    gpu_memory_utilization: float = _option(0.9, "kv cache", "fraction of GPU memory for weights + KV cache, in (0, 1]")
    seed: int = _option(0, "scheduler", "engine seed: the generator of requests without their own seed")
    load_progress: bool = _option(
        False, "model", "print one line saying what loads, on which device, in which dtype and why (the "
        "commands turn this on), then show a progress bar while the weights load, then one line with the KV "
        "cache's size (fastinfer.engine.kv_sizing)", cli=False)
    enforce_eager: bool = _option(
        False, "scheduler", "CUDA: no CUDA graphs for decode steps (by default one graph per batch bucket 1, "
        "2, 4, ... up to min(max_num_seqs, max_cuda_graph_batch_size) is captured at start-up and replayed for "
        "decode-only steps; with expert_parallel_size > 1 decode steps always run eagerly)")
    max_cuda_graph_batch_size: int = _option(
        256, "scheduler", "CUDA: the largest decode batch captured as a CUDA graph (a decode step of more "
        "sequences runs eagerly); each bucket's graph holds its own activation memory")
    static_batching: bool = _option(
        False, "scheduler", "admit new requests only into a batch still forming, not into a running one "
        "(a baseline for comparisons; default: continuous batching)")
    # ---- speculative decoding ---------------------------------------------------------------------
    draft_model: Any = _option(
        None, _SPEC, "speculative decoding with this draft model (a checkpoint directory or a model object; "
        "same vocabulary, and the same tokenizer when both directories have one); the same as "
        "spec_method='draft', spec_model=DIR. Requests opt out with SamplingParams(speculative=False)",
        default_doc="off")
    spec_method: Optional[str] = _option(
        None, _SPEC, "; ".join(f"{m}: {spec_method(m).description}" for m in SPEC_METHODS)
        + " (needs spec_model; see fastinfer.engine.speculative)", choices=SPEC_METHODS,
        default_doc="draft when draft_model is given")
    spec_model: Any = _option(
        None, _SPEC, "the draft model / heads directory of spec_method", default_doc="none")
    spec_mode: Optional[str] = _option(
        None, _SPEC, "chain: num_spec_tokens draft tokens in a row; tree: an EAGLE-2-style tree of "
        "num_spec_tokens nodes, spec_tree_topk children per expanded node, spec_tree_depth levels (Medusa, "
        "DFlash: their static tree)", choices=SPEC_MODES,
        default_doc=", ".join(f"{m}: {spec_method(m).default_mode}" for m in SPEC_METHODS))
    num_spec_tokens: Optional[int] = _option(
        None, _SPEC, "draft tokens per step: chain length / tree node budget (without the root)",
        default_doc="4 chain, 8 tree; Medusa: every head / the whole tree; DFlash: the block (block_size - 1) / "
        "the whole tree")
    spec_tree_topk: int = _option(2, _SPEC, "tree mode: children per expanded node")
    spec_tree_depth: Optional[int] = _option(
        None, _SPEC, "tree mode: levels, one draft forward each", default_doc="min(N, max(2, N // (2 * topk) + 1))")
    spec_tree: Optional[List[List[int]]] = _option(
        None, _SPEC, "Medusa, DFlash: the static tree as paths of top-k ranks, e.g. [[0], [1], [0, 0]] (JSON on "
        "the command line)", default_doc="fastinfer.engine.speculative.trees.DEFAULT_MEDUSA_TREE", parse=_json_paths)
    # ---- quantisation ------------------------------------------------------------------------------
    quantization: Optional[str] = _option(
        None, _QUANT, "fp8 (W8A8: e4m3 weights per channel, dynamic per-token e4m3 activations) | int4 "
        "(W4A16, group-wise) | int8 (W8A8) | nvfp4 / mxfp4 (W4A16, FP4 weights on fp4_gemm): quantise a float "
        "checkpoint's decoder linears on load; lm_head stays unquantised (see fastinfer.quant)",
        default_doc="run the checkpoint as stored; quantised checkpoints (fastinfer, AutoAWQ, AutoGPTQ) are "
        "detected from config.json")
    gguf_weights: str = _option(
        "auto", _QUANT, "a GGUF file's quantised weights: auto (Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q8_0 linears run as stored on "
        "the int4 kernels, the other types dequantised to the model dtype with a notice naming them) | stored "
        "(as auto, but a decoder linear or expert of a type with no kernel is an error listing the types that "
        "run as stored) | float (every tensor dequantised to the model dtype)", choices=("auto", "stored", "float"))
    fp4_weights: str = _option(
        "stored", _QUANT, "a checkpoint's FP4 weights (compressed-tensors NVFP4A16 linears and experts, gpt-oss's "
        "MXFP4 experts): stored (run as stored on fp4_gemm / fused_moe_fp4; a layer whose shard is not whole tiles "
        "of the kernel is dequantised to the model dtype) | float (every FP4 weight dequantised to the model dtype)",
        choices=FP4_WEIGHTS)
    quantization_config: Optional[Dict[str, Any]] = _option(
        None, _QUANT, "int4 options for quantisation on load: group_size (128), symmetric (False), pad_groups "
        "(True: zero-pad a layer whose input size the group size does not divide); on the command line "
        "--group-size / --symmetric / --no-pad-groups", default_doc="none", cli=False)
    # ---- parallelism and modes ---------------------------------------------------------------------
    tensor_parallel_size: int = _option(
        1, "parallel", "shard the target over this many processes (fastinfer.engine.workers; rank r on "
        "cuda:r, or CPU gloo ranks), started with the spawn method (guard a script's top level with "
        "if __name__ == '__main__':), or under torchrun its processes; LLM.shutdown() stops them. "
        "llm.model is then rank 0's shard: run forwards through the engine",
        cli_default_doc="WORLD_SIZE / pipeline_parallel_size under torchrun, else 1")
    expert_parallel_size: int = _option(
        1, "parallel", "split the experts of mixture-of-experts models over this many processes: rank r holds "
        "experts [r E / N, (r + 1) E / N) whole (E divisible by N); each layer sends every (token, expert) pair "
        "to the rank holding the expert and the expert's output back (all-to-all), and a token's output is bit "
        "for bit that of the experts in one process (float32). 1, or tensor_parallel_size (attention and the "
        "dense layers tensor-parallel over the same processes), or, with tensor_parallel_size=1, processes "
        "that each run attention and the dense layers whole, on every token. The slots each rank's experts "
        "processed: LLM.stats()['expert_parallel_routed_slots']")
    pipeline_parallel_size: int = _option(
        1, "parallel", "split the target's layers into this many stages, each on its own processes (its own "
        "tensor_parallel_size / expert_parallel_size group: the engine has pipeline_parallel_size x "
        "max(tensor_parallel_size, expert_parallel_size) of them, started as tensor_parallel_size's are); "
        "stage s holds only its layers' weights and KV cache (the embedding on the first, the final norm and "
        "lm_head on the last) and sends the hidden state to stage s + 1; rank 0 (stage 0) schedules and "
        "samples. Speculative decoding with a draft model needs pipeline_batches_in_flight=1 (docs/parallelism.md)")
    pipeline_partition: Optional[str] = _option(
        None, "parallel", "layers per pipeline stage, comma-separated, summing to the model's layers (e.g. "
        "'10,10,12'; a list of ints also works)",
        default_doc="even: num_hidden_layers // pipeline_parallel_size each, the remainder one layer each "
        "to the stages before the last")
    pipeline_batches_in_flight: Optional[int] = _option(
        None, "parallel", "pipeline parallelism: batches the scheduler keeps in flight (1 .. "
        "pipeline_parallel_size), each of about 1 / this of the running sequences, so stage s works on one "
        "while stage s + 1 works on the one before; 1: each step runs through every stage before the next "
        "is scheduled", default_doc="pipeline_parallel_size")
    deterministic: bool = _option(
        False, "mode", "batch-invariant mode: a token's logits (and a seeded request's tokens) depend only "
        "on the model, the tokens before it and the sampling parameters, bit for bit, whatever the batch, "
        "prefill chunking, prefix cache or speculation (chain or tree); costs speed (README, "
        "\"Deterministic inference\")")

    # ---- derived on validation (not options) ------------------------------------------------------
    speculative: Optional[SpeculativeConfig] = field(default=None, init=False)
    quant_options: Optional[QuantOptions] = field(default=None, init=False)
    model_dtype: Optional[torch.dtype] = field(default=None, init=False)  # dtype resolved ("auto": the rule)

    def __post_init__(self):
        from .. import cuda_available

        self.dtype = parse_dtype(self.dtype)
        self.device = torch.device(self.device if self.device is not None else
                                   ("cuda" if cuda_available() else "cpu"))
        if self.model is None:
            self.model = default_model_path()
            if not os.path.isdir(self.model):
                raise ValueError(f"no model given and the shipped model is missing ({self.model})")
        if isinstance(self.model, str) and not is_checkpoint_path(self.model):
            raise ValueError(f"model directory not found: {self.model!r} (nor a .gguf file)")
        self.model_dtype = self.dtype
        if self.dtype is None:  # "auto", resolved on rank 0: tensor-parallel workers are given it
            self.model_dtype = (default_dtype(load_config(self.model), self.device) if isinstance(self.model, str)
                                else self.model.dtype)
        bs = self.block_size
        if not _is_int(bs) or bs < 8 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two in 8..256, got {bs}")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not _is_int(self.max_cuda_graph_batch_size) or self.max_cuda_graph_batch_size < 1:
            raise ValueError(f"max_cuda_graph_batch_size must be an int >= 1, got {self.max_cuda_graph_batch_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = int(self.max_num_batched_tokens)
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None:
            self.max_model_len = max(int(self.max_model_len), 1)
        if self.gguf_weights not in ("auto", "stored", "float"):
            raise ValueError(f"gguf_weights must be 'auto', 'stored' or 'float', got {self.gguf_weights!r}")
        if self.fp4_weights not in FP4_WEIGHTS:
            raise ValueError(f"fp4_weights must be 'stored' or 'float', got {self.fp4_weights!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")
        self.speculative = self._speculative()
        self.quant_options = QuantOptions.from_any(self.quantization, self.quantization_config)
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if not _is_int(tp) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if not _is_int(ep) or ep < 1:
            raise ValueError(f"expert_parallel_size must be an int >= 1, got {ep!r}")
        if tp > 1 and ep > 1 and tp != ep:
            raise ValueError(f"expert_parallel_size={ep} with tensor_parallel_size={tp}: the experts split over the "
                             "tensor-parallel processes (expert_parallel_size equal to tensor_parallel_size) or over "
                             "their own (tensor_parallel_size=1), not over a part of them")
        pp = self.pipeline_parallel_size
        if not _is_int(pp) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {pp!r}")
        partition = parse_partition(self.pipeline_partition)
        if partition is not None and len(partition) != pp:
            raise ValueError(f"pipeline_partition {self.pipeline_partition!r} has {len(partition)} stages, "
                             f"pipeline_parallel_size is {pp}")
        inflight = self.pipeline_batches_in_flight
        if inflight is not None and (not _is_int(inflight) or not 1 <= inflight <= pp):
            raise ValueError(f"pipeline_batches_in_flight must be an int in 1..pipeline_parallel_size={pp}, "
                             f"got {inflight!r}")
        if pp > 1 or partition is not None:  # the split is checked before any process starts
            model_config = load_config(self.model) if isinstance(self.model, str) else getattr(self.model, "config", None)
            if model_config is not None:
                partition_layers(model_config.num_hidden_layers, pp, partition)
        self._hybrid_model_options()
        sizes = f"tensor_parallel_size={tp}" if ep == 1 else f"expert_parallel_size={ep}"
        if pp > 1:
            sizes = f"pipeline_parallel_size={pp}"
        if self.world_size > 1 and not isinstance(self.model, str):
            raise ValueError(f"{sizes} needs a checkpoint path (every rank loads its own shard), not a model object")
        if pp > 1 and self.speculative is not None and self.batches_in_flight > 1:
            raise ValueError(f"speculative decoding (spec_method={self.speculative.method!r}) with "
                             f"pipeline_parallel_size={pp} runs one batch at a time (the draft proposes from the "
                             "tokens the last verification accepted, and its KV pool is rank 0's alone): set "
                             "pipeline_batches_in_flight=1")
        if self.world_size > 1 and self.speculative is not None and not self.speculative.entry.tensor_parallel:
            raise ValueError(f"spec_method={self.speculative.method!r} needs the target's hidden states, which "
                             f"{sizes} does not return yet: use one process (tensor_parallel_size=1, "
                             "expert_parallel_size=1, pipeline_parallel_size=1)")

    def _hybrid_model_options(self) -> None:
        """Resolve ``enable_prefix_caching`` (None: on; a hybrid model's cache keeps state snapshots
        too) and refuse what a hybrid model (linear-attention layers with a per-sequence state) cannot
        run yet."""
        model_config = load_config(self.model) if isinstance(self.model, str) else getattr(self.model, "config", None)
        hybrid = model_config is not None and model_config.is_hybrid
        if not hybrid:
            self.enable_prefix_caching = True if self.enable_prefix_caching is None else bool(self.enable_prefix_caching)
            return
        arch = model_config.architecture
        LinearAttentionShards(model_config, ParallelInfo(0, self.tensor_parallel_size))  # the heads split by TP
        spec = self.speculative
        if spec is not None:
            if self.world_size > 1:  # the commit runs on rank 0's state only
                raise ValueError(f"speculative decoding is not supported for {arch} with tensor_parallel_size="
                                 f"{self.tensor_parallel_size}, expert_parallel_size={self.expert_parallel_size} "
                                 "(its linear-attention state is committed in one process): use one process")
            # the verification commits the linear-attention state at the accepted length by
            # re-running the accepted rows of a chain from the state saved before it
            if spec.method != "draft" or spec.mode != "chain":
                raise ValueError(f"speculative decoding with spec_method={spec.method!r}, spec_mode={spec.mode!r} is "
                                 f"not supported for {arch}: its linear-attention state is committed along a chain "
                                 "(use spec_method='draft', spec_mode='chain')")
            draft = spec.draft_model
            draft_config = load_config(draft) if isinstance(draft, str) else getattr(draft, "config", None)
            if draft_config is not None and draft_config.is_hybrid:
                raise ValueError(f"a draft model with linear-attention layers ({draft_config.architecture}) is not "
                                 "supported: the draft keeps no per-sequence state")
        self.enable_prefix_caching = True if self.enable_prefix_caching is None else bool(self.enable_prefix_caching)

    def _speculative(self) -> Optional[SpeculativeConfig]:
        """The :class:`SpeculativeConfig` of the ``spec_*`` options (None: no speculation; the
        options are validated either way). ``draft_model=X`` is ``spec_method="draft", spec_model=X``."""
        draft = "draft"  # the method draft_model= names
        method, model = self.spec_method or draft, self.spec_model
        spec_method(method)  # a ValueError listing the methods
        if self.draft_model is not None:
            if model is not None and model is not self.draft_model:
                raise ValueError("give draft_model= or spec_model=, not both (draft_model=X is spec_model=X with "
                                 f"spec_method={draft!r})")
            if method != draft:
                raise ValueError(f"draft_model= means spec_method={draft!r}; for spec_method={method!r} pass the "
                                 "heads as spec_model=")
            model = self.draft_model
        if self.spec_method is not None and model is None:
            raise ValueError(f"spec_method={self.spec_method!r} needs spec_model= (a checkpoint / heads directory)")
        spec = SpeculativeConfig(draft_model=model, method=method, mode=self.spec_mode,
                                 num_tokens=self.num_spec_tokens, tree_topk=self.spec_tree_topk,
                                 tree_depth=self.spec_tree_depth, tree=self.spec_tree)
        return spec if model is not None else None

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The element type of the KV pools of a model in ``model_dtype`` (``kv_cache_dtype`` "auto":
        that dtype)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    @property
    def batches_in_flight(self) -> int:
        """What ``pipeline_batches_in_flight`` resolves to (1 without pipeline parallelism)."""
        return self.pipeline_batches_in_flight or self.pipeline_parallel_size

    @property
    def stage_size(self) -> int:
        """The processes of one pipeline stage: ``max(tensor_parallel_size, expert_parallel_size)`` (each is
        1 or this)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def world_size(self) -> int:
        """The engine's processes: ``pipeline_parallel_size`` stages of :attr:`stage_size`."""
        return self.pipeline_parallel_size * self.stage_size

    @property
    def model_path(self) -> Optional[str]:
        return self.model if isinstance(self.model, str) else None

    def ops_backend(self, namespace: str = "fastinfer"):
        """The :class:`~fastinfer.ops.Backend` of this config's mode: what the models are built with
        (:func:`~fastinfer.models.load_model`) and what the sampler, the drafter and the verifier
        are given. ``namespace``: the op library ("fastinfer_sim" for a model built on the emulator)."""
        from ..ops import backend

        return backend(namespace, self.deterministic)

    def without_speculation(self) -> "EngineConfig":
        """The same config with every speculative option at its default (a tensor-parallel worker's:
        the draft runs on rank 0 only)."""
        return dataclasses.replace(self, **{f.name: f.default for f in option_fields() if f.metadata["group"] == _SPEC})

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """The config of ``LLM(**options)``: an unknown option name is a TypeError naming the closest."""
        check_options(options)
        return cls(**options)


def option_fields() -> List[dataclasses.Field]:
    """The :class:`EngineConfig` fields that are options (what ``LLM(...)`` accepts), in order."""
    return [f for f in dataclasses.fields(EngineConfig) if f.init]


def check_options(options) -> None:
    """A TypeError for the first name in ``options`` that is not an option, naming the closest one."""
    valid = [f.name for f in option_fields()]
    for name in options:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (options: {', '.join(valid)})"
            raise TypeError(f"unknown option {name!r}{hint}")


def default_text(f: dataclasses.Field) -> str:
    """An option's default as documentation shows it."""
    doc = f.metadata.get("default_doc")
    if doc is not None:
        return doc
    return "none" if f.default is None else repr(f.default)


def options_doc(base: str = "    ", width: int = 100) -> str:
    """The ``Options:`` section of ``help(LLM)``: every option with its type, default and help
    (``base``: the indentation of the docstring it goes in)."""
    import textwrap

    # a blank line after the heading and between options: each option reads as one
    # reStructuredText definition (its first line the term), so the API docs render it too
    lines = [base + "Options (keyword arguments; each is a field of fastinfer.EngineConfig):"]
    for f in option_fields():
        head = f"{f.name} ({f.type}; default: {default_text(f)}): {f.metadata['help']}."
        lines += [""] + textwrap.wrap(head, width, initial_indent=base + "    ",
                                      subsequent_indent=base + "        ")
    return "\n".join(lines)
