"""``LLM``: the offline engine (vLLM-shaped API) tying sequence -> block manager -> scheduler ->
model runner -> sampler together.

    llm = LLM("path/to/hf-llama")                 # or LLM() for the shipped tiny model
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    for o in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
        print(o.outputs[0].text)                  # cumulative, only stable text

Lower level (a server loop): ``add_request(prompt, params) -> request_id``, ``step() ->
list[RequestOutput]`` (the requests that changed), ``has_unfinished_requests()``,
``abort_request(request_id)``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence as Seq, Union

import torch

from .block_manager import BlockManager
from .model_runner import ModelRunner, num_kv_blocks_for, nvtx_range
from .params import CompletionOutput, RequestOutput, SamplingParams
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import Request, Sequence, SequenceStatus
from .spec_decode import SPEC_MODES, SpecChunk, SpecDecoder, move_slots
from .tokenizer import IncrementalDetokenizer, Tokenizer

PromptType = Union[str, List[int], Dict[str, Any]]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "auto": None}


def default_model_path() -> str:
    """The tiny model shipped with the package (``fastinfer/assets/tiny-llama``)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-llama")


def _check_spec_args(mode: Any, k: Any, topk: Any, depth: Any) -> int:
    if mode not in SPEC_MODES:
        raise ValueError(f"spec_mode must be one of {SPEC_MODES}, got {mode!r}")
    if k is None:
        k = 4 if mode == "chain" else 8
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 1024:
        raise ValueError(f"num_spec_tokens must be an int in [1, 1024], got {k!r}")
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"spec_tree_topk must be an int >= 1, got {topk!r}")
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise ValueError(f"spec_tree_depth must be an int >= 1 or None, got {depth!r}")
    return k


def _check_draft_vocab(draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"draft_model has vocab_size {draft_vocab}, the target {target_vocab}: speculative "
                         "decoding needs a draft with the target's tokenizer and vocabulary")


def _check_draft_tokenizer(draft_tok: Tokenizer, target_tok: Tokenizer) -> None:
    dv = draft_tok._tok.get_vocab(with_added_tokens=True)
    tv = target_tok._tok.get_vocab(with_added_tokens=True)
    if dv != tv:
        diff = next((t for t in sorted(set(dv) | set(tv)) if dv.get(t) != tv.get(t)), None)
        raise ValueError(f"draft_model's tokenizer.json differs from the target's (token {diff!r}: draft id "
                         f"{dv.get(diff)}, target id {tv.get(diff)}): speculative decoding needs the same tokenizer")


def _logprob_dict(row_lp: torch.Tensor, tok: int, n: int) -> Dict[int, float]:
    d: Dict[int, float] = {}
    if n > 0:
        vals, idx = row_lp.topk(min(n, row_lp.shape[-1]))
        d.update(zip(idx.tolist(), vals.tolist()))
    d[tok] = float(row_lp[tok])
    return d


def _seed_for(seed: int, index: int) -> int:
    return (int(seed) * 1_000_003 + index * 7_919 + 12_345) % (2 ** 63 - 1)


class LLM:
    """Offline inference engine.

    Args:
        model: a Hugging Face checkpoint directory (safetensors, Llama/Mistral/Qwen2), an already
            built model object (``LlamaForCausalLM``), or None for the shipped tiny model.
        tokenizer: directory with ``tokenizer.json`` (default: the model directory; without one,
            prompts must be token ids and outputs have empty text).
        dtype: "auto"/None (float32 on CPU; the checkpoint's fp16/bf16, else bf16, on CUDA), a
            torch dtype or its name.
        device: "cuda" when fastinfer's CUDA kernels and a GPU are available, else "cpu".
        max_model_len: longest prompt + completion (default: the model's, capped by the KV pool).
        block_size: tokens per KV block.
        max_num_seqs: sequences in flight at most.
        max_num_batched_tokens: new tokens per step (chunked prefill); default 2048 (CPU) / 8192.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        num_kv_blocks / kv_cache_bytes / gpu_memory_utilization: KV pool size (first given wins;
            see :func:`fastinfer.engine.model_runner.num_kv_blocks_for`).
        seed: seeds the generator of requests without their own seed.
        enforce_eager: on CUDA, do not capture CUDA graphs for decode steps (by default one graph
            per batch bucket 1, 2, 4, 8, 16, 32, ... up to min(max_num_seqs, 256) is captured at
            start-up and replayed for decode-only steps).
        draft_model: speculative decoding with this draft model (a checkpoint directory or a model
            object; same vocabulary, and the same tokenizer when both directories have one). See
            :mod:`fastinfer.engine.spec_decode`; requests opt out with
            ``SamplingParams(speculative=False)``. The draft's KV pool uses the target's block ids.
        spec_mode: "chain" (``num_spec_tokens`` draft tokens in a row) or "tree" (EAGLE-2-style
            tree of ``num_spec_tokens`` nodes, ``spec_tree_topk`` children per expanded node,
            ``spec_tree_depth`` levels; default depth ``min(N, max(2, N // (2 * topk) + 1))``: one
            draft forward per level).
        num_spec_tokens: chain length k / tree node budget N (without the root); default 4 (chain)
            or 8 (tree).
        quantization: "fp8" (W8A8: e4m3 weights per channel, dynamic per-token e4m3 activations)
            or "int4" (W4A16, group-wise) quantises a float checkpoint's decoder linears on load;
            None runs the checkpoint as stored (a quantised one, fastinfer / AutoAWQ / AutoGPTQ,
            is detected from its config.json). ``lm_head`` stays unquantised. See :mod:`fastinfer.quant`.
        quantization_config: int4 options for on-the-fly quantisation: ``group_size`` (128),
            ``symmetric`` (False), ``pad_groups`` (True: zero-pad a layer whose input size the
            group size does not divide).
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Optional[str] = None,
        dtype: Any = None,
        device: Any = None,
        max_model_len: Optional[int] = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: Optional[int] = None,
        enable_prefix_caching: bool = True,
        num_kv_blocks: Optional[int] = None,
        kv_cache_bytes: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        load_progress: bool = False,
        enforce_eager: bool = False,
        draft_model: Any = None,
        spec_mode: str = "chain",
        num_spec_tokens: Optional[int] = None,
        spec_tree_topk: int = 2,
        spec_tree_depth: Optional[int] = None,
        quantization: Optional[str] = None,
        quantization_config: Optional[Dict[str, Any]] = None,
    ):
        from .. import cuda_available

        if device is None:
            device = "cuda" if cuda_available() else "cpu"
        self.device = torch.device(device)
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"unknown dtype {dtype!r} (one of {sorted(_DTYPES)})")
            dtype = _DTYPES[dtype]
        if block_size < 8 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in 8..256, got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        num_spec_tokens = _check_spec_args(spec_mode, num_spec_tokens, spec_tree_topk, spec_tree_depth)
        self._spec_mode = spec_mode

        # --- model -------------------------------------------------------------------------------
        if model is None:
            model = default_model_path()
            if not os.path.isdir(model):
                raise ValueError(f"no model given and the shipped model is missing ({model})")
        self.model_path: Optional[str] = model if isinstance(model, str) else None
        if isinstance(model, str):
            from ..models import ModelConfig, load_model

            if not os.path.isdir(model):
                raise ValueError(f"model directory not found: {model!r}")
            config = ModelConfig.from_pretrained(model)
            max_pos = config.max_model_len if max_model_len is None else max(int(max_model_len), 1)
            self.model = load_model(model, dtype=dtype, device=self.device, progress=load_progress,
                                    max_positions=max_pos, config=config, quantization=quantization,
                                    quantization_config=quantization_config)
        else:
            self.model = model
            if quantization is not None:  # an already built float model: quantise it in place
                from ..quant.loader import quantize_model
                from ..quant.quantize import QuantOptions

                quantize_model(self.model, QuantOptions.from_any(quantization, quantization_config))
            self.device = torch.device(getattr(model, "device", self.device))
        self.config = self.model.config
        if hasattr(self.model, "pack_linears_for_cpu"):
            self.model.pack_linears_for_cpu()  # CPU bf16 only: oneDNN-blocked weights
        tok_path = tokenizer if tokenizer is not None else self.model_path
        self.tokenizer: Optional[Tokenizer] = None
        if tok_path is not None and os.path.isfile(os.path.join(tok_path, "tokenizer.json")):
            self.tokenizer = Tokenizer(tok_path)
        elif tokenizer is not None:
            raise ValueError(f"no tokenizer.json in {tokenizer!r}")

        # --- limits and KV pool --------------------------------------------------------------------
        model_max = int(getattr(self.model, "max_positions", self.config.max_model_len))
        self.max_model_len = min(model_max, int(max_model_len)) if max_model_len else model_max
        draft = None
        if draft_model is not None:
            draft = self._load_draft(draft_model, model_max)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.block_size = block_size
        num_blocks = num_kv_blocks_for(
            self.model, block_size, self.device, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        if draft is not None and num_kv_blocks is None and (kv_cache_bytes is not None or self.device.type == "cuda"):
            # the byte budget holds both pools (same block ids)
            t_pb = self.model.kv_cache_bytes_per_block(block_size)
            num_blocks = max(1, num_blocks * t_pb // (t_pb + draft.kv_cache_bytes_per_block(block_size)))
        self.max_model_len = min(self.max_model_len, num_blocks * block_size)
        self.kv_caches = self.model.allocate_kv_cache(num_blocks, block_size)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_caches, block_size, self.device)
        if self.device.type == "cuda" and not enforce_eager:
            self.runner.enable_decode_graphs(min(max_num_seqs, 256), -(-self.max_model_len // block_size), True)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        self.sampler = Sampler(gen)
        self.eos_token_ids = set(self.config.eos_token_ids or [])
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        self.vocab_size = int(self.config.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.spec: Optional[SpecDecoder] = None
        if draft is not None:
            self.draft_model = draft
            self.spec = SpecDecoder(draft, draft.allocate_kv_cache(num_blocks, block_size), block_size, self.device,
                                    spec_mode, num_spec_tokens, spec_tree_topk, spec_tree_depth,
                                    self.max_model_len, self.max_num_batched_tokens)
            self.scheduler.spec_span = lambda seq: self.spec.plan(seq)[1]
        self.num_generated_tokens = 0
        self._requests: Dict[str, Request] = {}
        self._next_id = 0
        self._next_seq_id = 0
        self.num_steps = 0

    def _load_draft(self, draft_model: Any, max_positions: int):
        """Load / check the draft model: same vocabulary, compatible tokenizer, target's dtype."""
        if isinstance(draft_model, str):
            from ..models import ModelConfig, load_model

            if not os.path.isdir(draft_model):
                raise ValueError(f"draft_model directory not found: {draft_model!r}")
            dcfg = ModelConfig.from_pretrained(draft_model)
            _check_draft_vocab(int(dcfg.vocab_size), int(self.config.vocab_size))
            tok_file = os.path.join(draft_model, "tokenizer.json")
            if self.tokenizer is not None and os.path.isfile(tok_file):
                _check_draft_tokenizer(Tokenizer(draft_model), self.tokenizer)
            draft = load_model(draft_model, dtype=self.model.dtype, device=self.device,
                               max_positions=max_positions, config=dcfg)
        else:
            draft = draft_model
            _check_draft_vocab(int(draft.config.vocab_size), int(self.config.vocab_size))
            if torch.device(getattr(draft, "device", self.device)) != self.device:
                raise ValueError(f"draft_model is on {draft.device}, the target on {self.device}")
            if int(getattr(draft, "max_positions", max_positions)) < self.max_model_len:
                raise ValueError(f"draft_model accepts {draft.max_positions} positions, fewer than "
                                 f"max_model_len={self.max_model_len}")
        if self._spec_mode == "tree":
            for name, cfg in (("target", self.config), ("draft", draft.config)):
                if any(cfg.window_left(i) >= 0 for i in range(cfg.num_hidden_layers)):
                    raise ValueError(f"spec_mode='tree' needs full attention, but the {name} model has sliding-window "
                                     "layers (tree attention takes no window): use spec_mode='chain'")
        if hasattr(draft, "pack_linears_for_cpu"):
            draft.pack_linears_for_cpu()
        return draft

    # ------------------------------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------------------------------
    def _new_seq(self, req: Request, index: int) -> Sequence:
        p = req.params
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(_seed_for(p.seed, index))
        seq = Sequence(self._next_seq_id, req, index, req.prompt_token_ids, p, gen)
        self._next_seq_id += 1
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
        return seq

    def _validate(self, prompt_ids: List[int], params: SamplingParams) -> Optional[str]:
        try:
            params.verify()
        except ValueError as e:
            return str(e)
        if not prompt_ids:
            return "empty prompt"
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
        if len(prompt_ids) >= self.max_model_len:
            return (f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                    f"(prompt + at least one generated token must fit)")
        if self.block_manager.blocks_needed(len(prompt_ids) + 1) > self.block_manager.num_blocks:
            return "prompt does not fit in the KV cache"
        if params.n > self.max_num_seqs:
            return f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}"
        if params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer (the model directory has no tokenizer.json)"
        return None

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue one prompt (text, token ids, or {"prompt_token_ids": [...]} / {"prompt": str}).
        Returns its request id. Never raises for a bad prompt: the request finishes with
        finish_reason "error" instead (see :mod:`fastinfer.engine.params`)."""
        params = params if params is not None else SamplingParams()
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        text: Optional[str] = None
        ids: List[int] = []
        error: Optional[str] = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
            else:
                prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            text = prompt
            if self.tokenizer is None:
                error = "text prompt given but the model has no tokenizer.json (pass token ids)"
            else:
                ids = self.tokenizer.encode(prompt)
        elif not isinstance(prompt, dict):
            try:
                ids = list(prompt)
            except TypeError:
                error = f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"
        req = Request(request_id, text, ids, params, time.perf_counter())
        self._requests[request_id] = req
        error = error or self._validate(ids, params)
        if error is not None:
            req.error = error
            req.finished_time = time.perf_counter()
            return request_id
        seq = self._new_seq(req, 0)
        seq.pending_forks = params.n - 1
        req.seqs.append(seq)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        while len(req.seqs) < req.params.n:  # forks never created
            s = self._new_seq(req, len(req.seqs))
            s.status = SequenceStatus.FINISHED
            s.finish_reason = "abort"
            req.seqs.append(s)
        if req.seqs:
            req.seqs[0].pending_forks = 0

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------------
    # one engine step
    # ------------------------------------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if reason == "length" and seq.detok is not None:
            seq.text += seq.detok.flush()  # a trailing incomplete character, if any
        self.scheduler.finish(seq)
        req = seq.request
        if req.finished:
            req.finished_time = time.perf_counter()

    def _append_token(self, seq: Sequence, tok: int, lp: Optional[Dict[int, float]]) -> None:
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        seq.token_ids.append(tok)
        self.num_generated_tokens += 1
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp[tok]
        p = seq.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return self._finish(seq, "stop")
        if tok in p.stop_token_ids:
            return self._finish(seq, "stop", tok)
        if seq.detok is not None:
            delta = seq.detok.add(tok)
            if delta:
                seq.text += delta
                if p.stop:
                    longest = max(len(s) for s in p.stop)
                    start = max(0, len(seq.text) - len(delta) - longest + 1)
                    best = None
                    for s in p.stop:
                        i = seq.text.find(s, start)
                        if i >= 0 and (best is None or i < best[0]):
                            best = (i, s)
                    if best is not None:
                        i, s = best
                        seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                        return self._finish(seq, "stop", s)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return self._finish(seq, "length")
        if seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length")

    def step(self) -> List[RequestOutput]:
        """Schedule, run the model once, sample; returns the outputs of the requests touched."""
        return [self._output(r) for r in self._step()]

    def _step(self) -> List[Request]:
        """:meth:`step` without building outputs (generate() builds them once, at the end)."""
        nv = self.runner.use_nvtx
        with nvtx_range("schedule", nv):
            out = self.scheduler.schedule()
        if out.is_empty:
            if not out.preempted and self.scheduler.waiting and not self.scheduler.running:
                # the oldest waiting sequence can never be admitted (KV pool too small for it)
                seq = self.scheduler.waiting[0]
                self._finish(seq, "length" if seq.num_output_tokens else "error")
                if seq.finish_reason == "error":
                    seq.request.error = "the KV cache is too small for this request"
                return [seq.request]
            return []
        self.num_steps += 1
        chunks: List[SpecChunk] = []
        if out.spec:
            with nvtx_range("draft", nv):
                chunks = self.spec.propose([(s, self.spec.plan(s)[0]) for s, _ in out.spec],
                                           [self._gen(s) for s, _ in out.spec])
        logits, sampled = self.runner.execute(out.prefills, out.decodes, chunks)
        for seq, _ in out.prefills:
            seq.num_target_forwards += 1
        for seq in out.decodes:
            seq.num_target_forwards += 1
        spec_logits = None
        if chunks:
            spec_logits = logits[len(sampled):]
            logits = logits[: len(sampled)]
        self.scheduler.postprocess(out)
        touched: Dict[str, Request] = {}
        if chunks:
            with nvtx_range("verify", nv):
                self._spec_commit(chunks, spec_logits, touched)
        if not sampled:
            return list(touched.values())

        # sampling rows: one per sampled sequence, plus its forks (n > 1) on the same logits row
        rows: List[int] = []
        row_seqs: List[Sequence] = []
        new_forks = set()
        for i, seq in enumerate(sampled):
            rows.append(i)
            row_seqs.append(seq)
            if seq.pending_forks > 0:
                req = seq.request
                for _ in range(seq.pending_forks):
                    child = self._new_seq(req, len(req.seqs))
                    req.seqs.append(child)
                    rows.append(i)
                    row_seqs.append(child)
                    new_forks.add(child.seq_id)
                seq.pending_forks = 0
        if len(rows) != len(sampled):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        with nvtx_range("sample", nv):
            tokens, lps = self.sampler(logits, [s.params for s in row_seqs], [s.token_ids for s in row_seqs],
                                       [s.generator for s in row_seqs])
        # new forks share the parent's full prompt blocks (before the parent may finish and free
        # them) and recompute the partial tail block themselves
        for i, seq in zip(rows, row_seqs):
            if seq.seq_id in new_forks:
                parent = sampled[i]
                n_full = min(parent.num_prompt_tokens // self.block_size, len(parent.block_table))
                self.block_manager.share(parent, seq, n_full)
                seq.num_cached_tokens = parent.num_cached_tokens
                self.scheduler.add_running(seq)
        for seq, tok, lp in zip(row_seqs, tokens, lps):
            self._append_token(seq, tok, lp)
            touched[seq.request.request_id] = seq.request
        return list(touched.values())

    def _gen(self, seq: Sequence) -> torch.Generator:
        return seq.generator if seq.generator is not None else self.sampler.generator

    def _spec_commit(self, chunks: List[SpecChunk], logits: torch.Tensor, touched: Dict[str, Request]) -> None:
        """Verify the drafts (tree_verify), compact the accepted K/V, free rejected slots, append."""
        spec = self.spec
        spec.verify(chunks, logits, [self._gen(ch.seq) for ch in chunks])
        ts, td, ds, dd = spec.commit_moves(chunks)
        move_slots(self.kv_caches, ts, td, self.device)
        move_slots(spec.kv_caches, ds, dd, self.device)
        bm = self.block_manager
        off = 0
        for ch in chunks:
            seq = ch.seq
            seq.num_target_forwards += 1
            spec.record(ch)
            acc = [ch.tokens[a] for a in ch.path[1:]]
            new = acc + [ch.next_token]
            n = seq.num_tokens
            seq.num_computed_tokens = n + len(acc)  # the root and the accepted nodes
            bm.trim(seq, n + len(new))
            bm.mark_draft_blocks(seq)
            seq.token_ids.extend(acc)  # register the now complete blocks (prefix cache) ...
            bm.register_full_blocks(seq)
            del seq.token_ids[n:]  # ... then append one token at a time (stop conditions)
            lps: List[Optional[Dict[int, float]]] = [None] * len(new)
            if seq.params.logprobs is not None:
                rows = logits[off: off + ch.num_nodes].index_select(
                    0, torch.tensor(ch.path, device=logits.device)).float().log_softmax(dim=-1)
                lps = [_logprob_dict(rows[j], t, seq.params.logprobs) for j, t in enumerate(new)]
            off += ch.num_nodes
            for tok, lp in zip(new, lps):
                self._append_token(seq, tok, lp)
                if seq.is_finished:
                    break
            touched[seq.request.request_id] = seq.request

    # ------------------------------------------------------------------------------------------
    # outputs
    # ------------------------------------------------------------------------------------------
    def _output(self, req: Request, streaming: bool = False) -> RequestOutput:
        n = req.params.n
        outs: List[CompletionOutput] = []
        if req.error is not None:
            outs = [CompletionOutput(i, "", [], "error") for i in range(n)]
        else:
            for seq in req.seqs:
                text = seq.text
                if streaming and not seq.is_finished and seq.params.stop:
                    hold = max(len(s) for s in seq.params.stop) - 1  # a stop string may be forming
                    text = text[: max(0, len(text) - hold)]
                outs.append(CompletionOutput(
                    index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    stop_reason=seq.stop_reason,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None))
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        if req.finished_time is not None:
            metrics["finished_time"] = req.finished_time
        if self.spec is not None and req.seqs:
            nv = sum(s.spec_num_verify for s in req.seqs)
            gen_toks = sum(s.num_output_tokens for s in req.seqs)
            fw = sum(s.num_target_forwards for s in req.seqs)
            metrics.update({
                "spec_num_verify": nv,
                "spec_num_draft_tokens": sum(s.spec_num_draft for s in req.seqs),
                "spec_num_accepted_tokens": sum(s.spec_num_accepted for s in req.seqs),
                "spec_mean_accepted_length": sum(s.spec_num_accepted for s in req.seqs) / nv if nv else 0.0,
                "target_forwards": fw,
                "target_forwards_per_token": fw / gen_toks if gen_toks else 0.0,
            })
        cached = req.seqs[0].num_cached_tokens if req.seqs else 0
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outs, req.finished,
                             error=req.error, num_cached_tokens=cached, metrics=metrics)

    # ------------------------------------------------------------------------------------------
    # user API
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _as_prompt_list(prompts: Any) -> List[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [prompts]  # one prompt of token ids
        return prompts

    def generate(self, prompts: Any, sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
                 use_tqdm: bool = False) -> List[RequestOutput]:
        """Generate completions for ``prompts`` (one prompt or a list: str, list of token ids, or
        {"prompt_token_ids": [...]}); ``sampling_params`` one for all or one per prompt. Returns
        one finished :class:`RequestOutput` per prompt, in prompt order."""
        plist = self._as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"{len(params)} sampling params for {len(plist)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(plist, params)]
        reqs = [self._requests[i] for i in ids]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="generate", unit="req", dynamic_ncols=True)
        done = sum(r.finished for r in reqs)
        if bar is not None:
            bar.update(done)
        try:
            while not all(r.finished for r in reqs):
                self._step()
                if bar is not None:
                    d = sum(r.finished for r in reqs)
                    bar.update(d - done)
                    done = d
        finally:
            if bar is not None:
                bar.close()
        outs = [self._output(r) for r in reqs]
        for i in ids:
            del self._requests[i]
        return outs

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a :class:`RequestOutput` after every step that changed
        it. Texts are cumulative and only contain stable text (no half characters, nothing that
        might still become a stop string); the last yield has ``finished=True``. Other queued
        requests progress meanwhile. Closing the iterator early aborts the request."""
        rid = self.add_request(prompt, sampling_params)
        req = self._requests[rid]
        try:
            if req.finished:
                yield self._output(req)
                return
            while not req.finished:
                if any(r is req for r in self._step()):
                    yield self._output(req, streaming=not req.finished)
        finally:
            if not req.finished:
                self.abort_request(rid)
            self._requests.pop(rid, None)

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
        bm = self.block_manager
        st = {
            "num_kv_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "block_size": bm.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "target_forwards_per_generated_token": self.num_steps / max(self.num_generated_tokens, 1),
        }
        if self.spec is not None:
            st.update(self.spec.stats())
        return st

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

