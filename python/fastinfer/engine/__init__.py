"""The fastinfer inference engine.

Request path: :class:`~.llm.LLM` (``llm.py``, the offline driver) -> :class:`~.core.EngineCore`
(``core.py``: scheduler -> block manager, speculative proposer; token ids only) ->
:class:`~.executor.Executor` (``executor.py``: models, KV pools, CUDA graphs, sampler, drafter; the
only owner of tensors; the core sees it as a ``StepExecutor`` and both speak the step messages of
``messages.py``) -> :class:`~.output_processor.OutputProcessor` (``output_processor.py``:
detokenisation, stop strings, outputs). The target forward is a :class:`~.model_runner.ForwardPlan`
run by a ``ModelRunner`` (``model_runner.py``); under tensor parallelism on every rank
(``workers.py``: rank 0's side; ``worker.py``: ranks > 0). The KV pool's size is
:mod:`.kv_sizing`'s.

This package's face imports nothing, so the token side (``core.py`` and what it imports) loads
without torch: import the defining modules (``fastinfer.engine.llm``, ``fastinfer.engine.params``,
...). The public API is offered by the package root, loaded on first use: ``fastinfer.LLM``,
``fastinfer.SamplingParams``, ``fastinfer.StructuredOutputs``, ``fastinfer.RequestOutput``,
``fastinfer.CompletionOutput``, ``fastinfer.EngineConfig``.
"""
