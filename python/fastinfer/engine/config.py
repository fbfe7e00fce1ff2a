"""Engine configuration: everything :class:`~fastinfer.LLM` accepts, validated in one place.

:class:`EngineConfig` holds what the user asked for; what the executor derives from the model and
the device (KV blocks, the final ``max_model_len``) is reported by the executor. Sub-configs:
:class:`SpeculativeConfig` (draft model) and :class:`~fastinfer.quant.QuantOptions` (quantise on
load). ``tensor_parallel_size`` N > 1 shards the target over N processes (:mod:`.workers`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..models import find_gguf
from ..quant import QuantOptions

__all__ = ["EngineConfig", "SpeculativeConfig", "SPEC_MODES", "SPEC_METHODS", "DTYPES", "parse_dtype",
           "default_model_path",
           "is_checkpoint_path"]

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "auto": None}

SPEC_MODES = ("chain", "tree")
SPEC_METHODS = ("draft", "medusa", "eagle", "eagle3")


def parse_dtype(dtype: Any) -> Optional[torch.dtype]:
    """A torch dtype, its name (``DTYPES``) or None / "auto" (the loader's default)."""
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


@dataclass
class SpeculativeConfig:
    """Speculative decoding (see :mod:`fastinfer.engine.speculative`).

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
    """

    draft_model: Any
    mode: Optional[str] = None
    num_tokens: Optional[int] = None
    tree_topk: int = 2
    tree_depth: Optional[int] = None
    method: str = "draft"
    tree: Optional[Any] = None

    def __post_init__(self):
        from .speculative.trees import check_tree

        if self.method not in SPEC_METHODS:
            raise ValueError(f"spec_method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.mode is None:
            self.mode = "tree" if self.method == "medusa" else "chain"
        if self.mode not in SPEC_MODES:
            raise ValueError(f"spec_mode must be one of {SPEC_MODES}, got {self.mode!r}")
        if self.tree is not None:
            if self.method != "medusa" or self.mode != "tree":
                raise ValueError("spec_tree (a static tree of top-k paths) needs spec_method='medusa' in tree mode")
            self.tree = check_tree(self.tree)
        if self.num_tokens is None and self.method != "medusa":
            self.num_tokens = 4 if self.mode == "chain" else 8
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
        what = "draft_model" if self.method == "draft" else "spec_model"
        if isinstance(self.draft_model, str) and not (is_checkpoint_path(self.draft_model) if self.method == "draft"
                                                      else os.path.isdir(self.draft_model)):
            raise ValueError(f"{what} directory not found: {self.draft_model!r}"
                             + (" (nor a .gguf file)" if self.method == "draft" else ""))

    @property
    def spec_model(self) -> Any:
        """The draft model or the heads (one field for every method)."""
        return self.draft_model

    @classmethod
    def from_llm_args(cls, draft_model=None, spec_method=None, spec_model=None, spec_mode=None, num_spec_tokens=None,
                      spec_tree_topk: int = 2, spec_tree_depth=None, spec_tree=None) -> Optional["SpeculativeConfig"]:
        """The config of ``LLM(...)``'s speculative arguments (None: no speculation; the arguments
        are validated either way). ``draft_model=X`` is ``spec_method="draft", spec_model=X``."""
        method = spec_method or "draft"
        if draft_model is not None:
            if spec_model is not None and spec_model is not draft_model:
                raise ValueError("give draft_model= or spec_model=, not both (draft_model=X is spec_model=X with "
                                 "spec_method='draft')")
            if method != "draft":
                raise ValueError(f"draft_model= means spec_method='draft'; for spec_method={method!r} pass the "
                                 "heads as spec_model=")
            spec_model = draft_model
        if spec_method is not None and spec_model is None:
            raise ValueError(f"spec_method={spec_method!r} needs spec_model= (a checkpoint / heads directory)")
        spec = cls(spec_model, spec_mode, num_spec_tokens, spec_tree_topk, spec_tree_depth, method, spec_tree)
        return spec if spec_model is not None else None


@dataclass
class EngineConfig:
    """See :class:`fastinfer.LLM` for the meaning of each field."""

    model: Any = None
    tokenizer: Optional[str] = None
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    max_model_len: Optional[int] = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    num_kv_blocks: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    load_progress: bool = False
    enforce_eager: bool = False
    static_batching: bool = False
    speculative: Optional[SpeculativeConfig] = None
    quantization: Optional[QuantOptions] = None
    tensor_parallel_size: int = 1
    deterministic: bool = False

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
        bs = self.block_size
        if not _is_int(bs) or bs < 8 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two in 8..256, got {bs}")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = int(self.max_num_batched_tokens)
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None:
            self.max_model_len = max(int(self.max_model_len), 1)
        tp = self.tensor_parallel_size
        if not _is_int(tp) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if tp > 1 and not isinstance(self.model, str):
            raise ValueError("tensor_parallel_size > 1 needs a checkpoint path (every rank loads its own shard), "
                             "not a model object")
        if tp > 1 and self.speculative is not None and self.speculative.method != "draft":
            raise ValueError(f"spec_method={self.speculative.method!r} needs the target's hidden states, which "
                             "tensor_parallel_size > 1 does not return yet: use tensor_parallel_size=1")

    @property
    def model_path(self) -> Optional[str]:
        return self.model if isinstance(self.model, str) else None

    @classmethod
    def from_llm_args(cls, *, draft_model=None, spec_method=None, spec_model=None, spec_mode=None,
                      num_spec_tokens=None, spec_tree_topk: int = 2, spec_tree_depth=None, spec_tree=None,
                      quantization=None, quantization_config=None, **kw) -> "EngineConfig":
        """The config of ``LLM(**kw)`` (its flat keyword arguments)."""
        spec = SpeculativeConfig.from_llm_args(draft_model, spec_method, spec_model, spec_mode, num_spec_tokens,
                                               spec_tree_topk, spec_tree_depth, spec_tree)
        return cls(speculative=spec, quantization=QuantOptions.from_any(quantization, quantization_config), **kw)
