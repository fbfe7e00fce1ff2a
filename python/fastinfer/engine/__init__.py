"""The fastinfer inference engine.

Request path: :class:`LLM` (``llm.py``, the offline driver) -> :class:`EngineCore` (``core.py``:
scheduler -> block manager, speculative proposer; token ids only) -> :class:`Executor`
(``executor.py``: models, KV pools, CUDA graphs, sampler, drafter; the only owner of tensors; the
core sees it as a ``StepExecutor`` and both speak the step messages of ``messages.py``) ->
:class:`OutputProcessor` (``output_processor.py``: detokenisation, stop strings, outputs). The target
forward is a :class:`~.model_runner.ForwardPlan` run by a ``ModelRunner`` (``model_runner.py``); under
tensor parallelism on every rank (``workers.py``: rank 0's side; ``worker.py``: ranks > 0).

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput`, :class:`CompletionOutput`,
:class:`StructuredOutputs`, :class:`Tokenizer`, :class:`EngineConfig`.
"""

from .params import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputs  # noqa: F401
from .tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: F401
from .config import EngineConfig, SpeculativeConfig, default_model_path  # noqa: F401
from .block_manager import BlockManager  # noqa: F401
from .scheduler import Scheduler  # noqa: F401
from .sampler import Sampler  # noqa: F401
from .executor import Executor  # noqa: F401
from .core import EngineCore  # noqa: F401
from .output_processor import OutputProcessor  # noqa: F401
from .llm import LLM  # noqa: F401

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "Tokenizer", "IncrementalDetokenizer",
           "EngineConfig", "SpeculativeConfig", "BlockManager", "Scheduler", "Sampler", "Executor", "EngineCore",
           "OutputProcessor", "default_model_path"]
