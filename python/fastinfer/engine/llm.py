"""``LLM``: the offline engine (vLLM-shaped API), a thin driver over the engine core, the executor
and the output processor.

    llm = LLM("path/to/hf-llama")                 # or LLM() for the shipped tiny model
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    for o in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
        print(o.outputs[0].text)                  # cumulative, only stable text

Lower level (a server loop): ``add_request(prompt, params) -> request_id``, ``step() ->
list[RequestOutput]`` (the requests that changed; a finished request's last output comes once, then
it is forgotten and its id may be reused), ``has_unfinished_requests()``, ``abort_request(id)``.

Module map: :mod:`.config` (EngineConfig) -> :mod:`.executor` (tensors: models, KV pools, CUDA
graphs, sampling) and :mod:`.core` (scheduler, block manager, proposer; token ids only) ->
:mod:`.output_processor` (text, stop strings, RequestOutput) -> this driver.
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence as Seq, Tuple, Union

from .config import EngineConfig, option_fields, options_doc
from .core import EngineCore
from .executor import Executor
from .output_processor import OutputProcessor
from .params import RequestOutput, SamplingParams
from .speculative.tokenizers import check_draft_tokenizer
from .structured import GrammarBackend
from .tokenizer import Tokenizer, has_tokenizer

__all__ = ["LLM"]

PromptType = Union[str, List[int], Dict[str, Any]]


class LLM:
    """Offline inference engine: ``LLM(model, **options)``.

    ``model`` and every option below are the fields of :class:`~fastinfer.engine.config.EngineConfig`
    (their defaults, types and help text are stated there once); an unknown option name is a
    TypeError naming the closest valid one. ``fastinfer <command> --help`` shows the same options
    as flags (``block_size`` is ``--block-size``).

    {options}
    """

    def __init__(self, model: Any = None, **options: Any):
        self.config = config = EngineConfig.from_options(model=model, **options)
        self.model_path: Optional[str] = config.model_path
        self.tokenizer = self._load_tokenizer(config.tokenizer)
        spec = config.speculative
        check_draft_tokenizer(spec, self.tokenizer)
        self.executor = Executor(config)
        eos = set(self.executor.model.config.eos_token_ids or [])
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = {self.tokenizer.eos_token_id}
        if self.tokenizer is not None:
            self.executor.grammar = GrammarBackend(self.tokenizer, self.executor.vocab_size, eos)
        self.engine_core = EngineCore(config, self.executor, eos)
        self.output_processor = OutputProcessor(self.tokenizer, speculative=spec is not None)
        self._next_id = 0
        self._streams: Dict[str, Deque[RequestOutput]] = {}  # request id -> outputs for its stream()
        self._finals: Dict[str, Optional[RequestOutput]] = {}  # request id -> final output for generate()
        self._unclaimed: List[RequestOutput] = []  # outputs of add_request()'s requests for the next step()

    def _load_tokenizer(self, tokenizer: Optional[str]) -> Optional[Tokenizer]:
        path = tokenizer if tokenizer is not None else self.model_path
        if has_tokenizer(path):  # a tokenizer.json, or a GGUF file's metadata
            return Tokenizer(path)
        if tokenizer is not None:
            raise ValueError(f"no tokenizer.json (or GGUF file) in {tokenizer!r}")
        return None

    # ---- what the engine runs ---------------------------------------------------------------------
    @property
    def model(self):
        return self.executor.model

    @property
    def draft_model(self):
        return self.executor.draft_model

    @property
    def device(self):
        return self.executor.device

    @property
    def vocab_size(self) -> int:
        return self.engine_core.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def kv_cache_dtype(self):
        """The torch dtype of the KV pool (the ``kv_cache_dtype`` option resolved: "auto" is the
        model's dtype, "fp8" ``torch.float8_e4m3fn``)."""
        return self.executor.kv_cache_dtype

    # ---- requests ---------------------------------------------------------------------------------
    def _tokenize(self, prompt: Any) -> Tuple[Optional[str], List[int], Optional[str]]:
        """``(text, token ids, error)`` of a prompt: text, token ids or {"prompt_token_ids": [...]}
        / {"prompt": str}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"]), None
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt, [], "text prompt given but the model has no tokenizer.json (pass token ids)"
            return prompt, self.tokenizer.encode(prompt), None
        try:
            return None, list(prompt), None
        except TypeError:
            return None, [], f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue one prompt (text, token ids, or {"prompt_token_ids": [...]} / {"prompt": str}).
        Returns its request id. Never raises for a bad prompt: the request finishes with
        finish_reason "error" instead (its output comes with the next step; see
        :mod:`fastinfer.engine.params`)."""
        params = params if params is not None else SamplingParams()
        if request_id is None:
            while str(self._next_id) in self.output_processor:
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.output_processor:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids, error = self._tokenize(prompt)
        if error is None and params.stop and self.tokenizer is None:
            error = "stop strings need a tokenizer (the model directory has no tokenizer.json)"
        if error is None:
            error = self.engine_core.add_request(request_id, ids, params)
        self.output_processor.add_request(request_id, text, ids, params, error)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (its KV blocks return to the pool); it produces no further output."""
        self.engine_core.abort_request(request_id)
        self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    # ---- stepping -----------------------------------------------------------------------------------
    def _engine_step(self) -> List[RequestOutput]:
        """One core step; outputs go to the stream / generate call that owns their request, the
        rest is returned."""
        res = self.output_processor.process(self.engine_core.step(), wanted=lambda rid: rid not in self._finals)
        for rid, index in res.stop:
            self.engine_core.stop_sequence(rid, index)
        free = []
        for o in res.outputs:
            q = self._streams.get(o.request_id)
            if q is not None:
                q.append(o)
            elif o.request_id in self._finals:
                self._finals[o.request_id] = o
            else:
                free.append(o)
        return free

    def step(self) -> List[RequestOutput]:
        """Schedule, run the model once, sample; returns the outputs of the requests that changed
        (of requests added with :meth:`add_request`; :meth:`stream` and :meth:`generate` keep theirs)."""
        out, self._unclaimed = self._unclaimed + self._engine_step(), []
        return out

    def generate(self, prompts: Any, sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
                 use_tqdm: bool = False) -> List[RequestOutput]:
        """Generate completions for ``prompts`` (one prompt or a list: str, list of token ids, or
        {"prompt_token_ids": [...]}); ``sampling_params`` one for all or one per prompt. Returns
        one finished :class:`RequestOutput` per prompt, in prompt order."""
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"{len(params)} sampling params for {len(plist)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(plist, params)]
        self._finals.update((rid, None) for rid in ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            done = 0
            while done < len(ids):
                self._unclaimed.extend(self._engine_step())
                d = sum(self._finals[r] is not None for r in ids)
                if bar is not None:
                    bar.update(d - done)
                done = d
            return [self._finals[r] for r in ids]
        finally:
            for r in ids:
                if self._finals.pop(r, None) is None:
                    self.abort_request(r)  # interrupted
            if bar is not None:
                bar.close()

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a :class:`RequestOutput` after every step that changed
        it. Texts are cumulative and only contain stable text (no half characters, nothing that
        might still become a stop string); the last yield has ``finished=True``. Other queued
        requests progress meanwhile (other streams included: each gets its own outputs). Closing
        the iterator early aborts the request."""
        rid = self.add_request(prompt, sampling_params)
        q = self._streams[rid] = deque()
        try:
            while True:
                while not q:
                    if rid not in self.output_processor:
                        return  # aborted by someone else
                    self._unclaimed.extend(self._engine_step())
                out = q.popleft()
                yield out
                if out.finished:
                    return
        finally:
            del self._streams[rid]
            if rid in self.output_processor:
                self.abort_request(rid)

    def chat(self, messages: Any, sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> List[RequestOutput]:
        """Apply the chat template to one conversation ([{"role", "content"}, ...]) or a list of
        conversations, then :meth:`generate`."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(c, add_generation_prompt, tokenize=True)}
                   for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for o, c in zip(outs, convs):
            o.prompt = self.tokenizer.apply_chat_template(c, add_generation_prompt)
        return outs

    def stats(self) -> Dict[str, Any]:
        """Engine counters; with a draft model also the speculative ones (``spec_*``: mean accepted
        draft tokens per verification, acceptance rate per depth, ...) and
        ``target_forwards_per_generated_token`` (engine steps / generated tokens)."""
        return dict(self.engine_core.stats(), num_registered_requests=len(self.output_processor))

    def reset_prefix_cache(self) -> None:
        self.engine_core.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, release their ports (no-op at TP 1); idempotent."""
        self.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _signature() -> inspect.Signature:
    """``LLM(self, model=None, *, <every other option>=<its default>)``, for help() and editors."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in option_fields():
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
    return inspect.Signature(params)


LLM.__doc__ = LLM.__doc__.replace("    {options}", options_doc())
LLM.__init__.__signature__ = _signature()


def _as_prompt_list(prompts: Any) -> List[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
