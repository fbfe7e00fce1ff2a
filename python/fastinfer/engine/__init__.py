"""The fastinfer inference engine: sequence -> block manager -> scheduler -> model runner -> sampler.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput`, :class:`CompletionOutput`,
:class:`Tokenizer`.
"""

from .params import CompletionOutput, RequestOutput, SamplingParams  # noqa: F401
from .tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: F401
from .block_manager import BlockManager  # noqa: F401
from .scheduler import Scheduler  # noqa: F401
from .sampler import Sampler  # noqa: F401
from .llm import LLM, default_model_path  # noqa: F401

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Tokenizer",
           "IncrementalDetokenizer", "BlockManager", "Scheduler", "Sampler", "default_model_path"]
