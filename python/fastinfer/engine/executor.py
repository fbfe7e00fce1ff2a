"""The executor: the only owner of device tensors (models, KV pools, CUDA graphs, sampling
generators) and the only place they are touched.

``Executor(config)`` loads the model (and the draft model), sizes and allocates the paged KV pools,
captures CUDA graphs; ``execute(step) -> ModelOutput`` runs one engine step: the draft's proposals,
one target forward over the ragged batch (prefill chunks, speculative trees, decode rows), the
verification of the drafts (KV slot moves applied here), and sampling. What it returns is token
ids and numbers, never a tensor. The target forward is a tensor-free
:class:`~.model_runner.ForwardPlan` run by the runner: in this process when the engine has one
(``tensor_parallel_size`` and ``expert_parallel_size`` 1), on every rank at once otherwise
(:mod:`.workers`: rank 0 broadcasts the plan, all ranks run their shard, the logits come back
gathered on rank 0, where drafting, verification and sampling stay).
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch

from ..layers.moe import expert_parallel_layers, routed_slots_per_rank
from .config import EngineConfig
from .messages import ModelOutput, PromptLogprobs, SampledToken, StepInput, VerifiedDraft
from .kv_sizing import KVSizing, MemoryPool
from .model_runner import Chunk, ForwardPlan, ModelRunner, nvtx_range
from .sampler import Sampler, logprob_dict, logprob_dicts
from .sequence import Sequence
from .speculative.build import build_drafter, load_draft, plan_slots
from .speculative.drafter import Draft, Drafter
from .speculative.verifier import commit_moves, verify
from .speculative.trees import Path
from .structured import GrammarBackend

__all__ = ["Executor", "nvtx_range"]


def _seed_for(seed: int, index: int) -> int:
    return (int(seed) * 1_000_003 + index * 7_919 + 12_345) % (2 ** 63 - 1)


class Executor:
    """Runs the models of an :class:`EngineConfig` (see the module docstring); the engine core's
    :class:`~.messages.StepExecutor`.

    After construction: ``runner`` (the target's :class:`~.model_runner.ModelRunner`, or under
    tensor parallelism the driver of all ranks' runners), ``model`` (rank 0's target), ``draft_model``
    (or None), ``kv_caches``, ``kv_cache_dtype`` (the torch dtype of the target's and the draft's
    KV pools), ``num_kv_blocks``, ``kv_sizing`` (how it was sized, :mod:`.kv_sizing`; its
    :meth:`~.kv_sizing.KVSizing.report` is printed with ``load_progress``), ``max_model_len`` (capped
    by the model's positions and the KV pool), ``device``.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.block_size = config.block_size
        if config.world_size > 1:
            from .workers import TensorParallelRunner  # spawns the workers

            self.runner = TensorParallelRunner(config)
        else:
            self.runner = ModelRunner(config)
        self.model = self.runner.model
        self.expert_parallel_layers = expert_parallel_layers(self.model)  # their load counters, for stats()
        self.device = self.runner.device
        self.use_nvtx = self.device.type == "cuda"
        spec = config.speculative
        # the one backend of the config's mode, the one the runner built the target with: the draft
        # model, the sampler, the drafter and the verifier are given it
        self.ops = self.model.ops
        try:
            self.draft_model = None  # a draft with its own KV pool: a draft model or an EAGLE head
            if spec is not None:
                self.draft_model = load_draft(spec, self.model, self.runner.max_model_len, self.ops)
            kv_dtype = self.runner.kv_cache_dtype  # the draft's pool too
            extra = ([MemoryPool("draft KV", self.draft_model.kv_cache_bytes_per_block(self.block_size, kv_dtype))]
                     if self.draft_model is not None else [])
            self.kv_sizing: KVSizing = self.runner.agreed_kv_sizing(extra)
            self.runner.init_kv(self.kv_sizing.num_blocks, self.kv_sizing.num_seq_slots)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.max_model_len = self.runner.max_model_len
        if config.load_progress:
            print(self.kv_sizing.report(self.max_model_len), file=sys.stderr, flush=True)
        self.drafter: Optional[Drafter] = None
        if spec is not None:
            self.drafter = build_drafter(spec, self.model, self.draft_model, self.num_kv_blocks, self.block_size,
                                         self.device, config.max_num_batched_tokens, self.ops,
                                         self.runner.kv_cache_dtype)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(config.seed))
        self.sampler = Sampler(gen, self.ops)
        self._generators: Dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded request
        # structured output: set by the driver, which has the tokenizer (None: no tokenizer)
        self.grammar: Optional[GrammarBackend] = None

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def num_state_slots(self) -> int:
        return self.runner.num_state_slots

    @property
    def draft_tree(self) -> Optional[List[Path]]:
        return self.drafter.paths if self.drafter is not None else None

    @property
    def kv_caches(self):
        return self.runner.kv_caches

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.runner.kv_cache_dtype

    @property
    def decode_graphs(self):
        return self.runner.decode_graphs

    def enable_decode_graphs(self, max_batch: int, max_blocks: int, use_graphs: bool):
        return self.runner.enable_decode_graphs(max_batch, max_blocks, use_graphs)

    def structured_output_error(self, spec) -> Optional[str]:
        """Why a request's :class:`~.params.StructuredOutputs` cannot run (it compiles here, once)."""
        if self.grammar is None:
            return "structured output needs a tokenizer (the model directory has no tokenizer.json)"
        return self.grammar.error(spec)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op at world size 1); idempotent."""
        close = getattr(self.runner, "shutdown", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------------------------------
    # one step
    # ------------------------------------------------------------------------------------------
    def _generator(self, seq: Sequence) -> Optional[torch.Generator]:
        """The generator of a seeded request's sequence (None: the sampler's shared one)."""
        if seq.params.seed is None:
            return None
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = self._generators[seq.seq_id] = torch.Generator(device=self.device)
            g.manual_seed(_seed_for(seq.params.seed, seq.index))
        return g

    def _gen(self, seq: Sequence) -> torch.Generator:
        return self._generator(seq) or self.sampler.generator

    @property
    def max_batches_in_flight(self) -> int:
        """Steps the engine core may :meth:`submit` before it :meth:`collect` s the oldest: under
        pipeline parallelism ``pipeline_batches_in_flight`` (one per stage by default), else 1."""
        return self.config.batches_in_flight

    def execute(self, step: StepInput) -> ModelOutput:
        return self.collect(self.submit(step))

    @torch.inference_mode()
    def submit(self, step: StepInput):
        """Start one engine step (drafting, then the target forward as far as it runs before its
        logits are needed); :meth:`collect` finishes it."""
        for sid in step.finished_seq_ids:
            self._generators.pop(sid, None)
        if self.drafter is not None:
            self.drafter.forget(step.finished_seq_ids)
        if self.grammar is not None:
            self.grammar.forget(step.finished_seq_ids)
        sched = step.scheduled
        drafts: List[Draft] = []
        if step.spec:
            with nvtx_range("draft", self.use_nvtx):
                drafts = self.drafter.propose([(w.seq, w.plan.size, w.draft_computed) for w in step.spec],
                                              [self._gen(w.seq) for w in step.spec])
        return step, drafts, self._submit_forward(sched.prefills, sched.decodes, drafts, step.finished_seq_ids,
                                                  sched.state_copies)

    @torch.inference_mode()
    def collect(self, pending) -> ModelOutput:
        """Finish a :meth:`submit` ted step: its logits, verification and sampling."""
        step, drafts, forward = pending
        logits, sampled, prompt_lps = self._collect_forward(*forward)
        out = ModelOutput(prompt_logprobs=prompt_lps)
        if drafts:
            with nvtx_range("verify", self.use_nvtx):
                out.verified = self._verify(drafts, logits[len(sampled):])
        if sampled:
            with nvtx_range("sample", self.use_nvtx):
                out.sampled = self._sample(logits[: len(sampled)], sampled, step.forks)
        return out

    def _submit_forward(self, prefills: Seq[Tuple[Sequence, int]], decodes: Seq[Sequence], drafts: Seq[Draft],
                        finished: List[int], state_copies: Seq[Tuple[int, int]] = ()):
        """Start one target forward (:meth:`_collect_forward` returns its logits). Logits rows: the
        prefill chunks that complete their sequence (those sample), the decode rows, then every node
        of every draft, draft by draft. :meth:`_collect_forward` returns the logits, the sequences
        of the sampled rows and the prompt logprobs the chunks produced (a chunk of a request with
        prompt logprobs also gets the logits of its prompt positions; those rows are used there and
        dropped from the returned logits)."""
        plan = ForwardPlan(finished=finished, state_copies=list(state_copies))
        sampled: List[Sequence] = []
        prompt_parts: List[Tuple[Sequence, int, int, int]] = []  # (seq, first position, first row, rows)
        keep: List[int] = []  # the rows that are not prompt-logprob rows
        num_rows = 0
        for seq, n in prefills:
            start = seq.num_computed_tokens
            completes = start + n == seq.num_tokens
            rows: List[int] = []
            if seq.needs_prompt_logits:
                # the logits at position p give the logprob of prompt token p + 1
                first = max(start, seq.request.num_prompt_logprobs)
                end = min(start + n, seq.num_prompt_tokens - 1)
                if first < end:
                    rows = list(range(first - start, end - start))
                    prompt_parts.append((seq, first, num_rows, len(rows)))
            num_rows += len(rows)
            if completes:
                keep.append(num_rows)
                num_rows += 1
            if rows:
                which = rows + [n - 1] if completes else rows
            else:
                which = "last" if completes else "none"
            plan.chunks.append(Chunk(seq.seq_id, seq.token_ids[start:start + n], start, which))
            if completes:
                sampled.append(seq)
        for seq in decodes:
            p = seq.num_tokens - 1
            plan.decodes.append((seq.seq_id, seq.token_ids[p], p))
            sampled.append(seq)
        for d in drafts:  # verification: root + nodes at slots start .., rotary positions start + depth
            start = d.seq.num_computed_tokens
            plan.trees.append(Chunk(d.seq.seq_id, list(d.tokens), start, "all", [start + x for x in d.depths], d.mask))
        for seq in list(sampled) + [d.seq for d in drafts] + [s for s, _ in prefills]:
            plan.tables[seq.seq_id] = list(seq.block_table)
            if seq.state_slot is not None:
                plan.state_slots[seq.seq_id] = seq.state_slot
        # a hybrid model's chain: its state before the verification, to commit the accepted length from
        plan.state_copies += [(d.seq.state_slot, d.seq.scratch_slot) for d in drafts if d.seq.scratch_slot is not None]
        plan.want_hidden = self.drafter is not None and self.drafter.wants_hidden_states
        if plan.want_hidden:
            plan.hidden_layers = tuple(self.drafter.hidden_layers)
        return self.runner.submit(plan), plan, sampled, prompt_parts, keep, num_rows, drafts

    def _collect_forward(self, pending, plan: ForwardPlan, sampled: List[Sequence], prompt_parts, keep: List[int],
                         num_rows: int, drafts: Seq[Draft]
                         ) -> Tuple[torch.Tensor, List[Sequence], List[PromptLogprobs]]:
        logits, hidden = self.runner.collect(pending)
        prompt_lps: List[PromptLogprobs] = []
        if prompt_parts:
            prompt_lps = self._prompt_logprobs(logits, prompt_parts)
            keep_rows = torch.tensor(keep + list(range(num_rows, logits.shape[0])), dtype=torch.long,
                                     device=logits.device)
            logits = logits.index_select(0, keep_rows)
            if plan.want_hidden and plan.want_hidden != "all":
                hidden = hidden.index_select(0, keep_rows)
        if plan.want_hidden == "all":  # every row, by the KV slot it was computed at
            self.drafter.observe_slot_hidden_states(plan_slots(plan, self.block_size), hidden)
        elif plan.want_hidden:
            self.drafter.observe_hidden_states(sampled + [d.seq for d in drafts for _ in d.tokens], hidden)
        return logits, sampled, prompt_lps

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, parts: List[Tuple[Sequence, int, int, int]]) -> List[PromptLogprobs]:
        """Per part (seq, first position, first row, rows): the logprobs of the prompt tokens after
        those positions, from the raw logits of their rows."""
        out = []
        for seq, first, row, count in parts:
            row_logprobs = logits[row:row + count].float().log_softmax(dim=-1)
            tokens = seq.token_ids[first + 1:first + 1 + count]
            out.append(PromptLogprobs(seq, first + 1, logprob_dicts(row_logprobs, tokens, seq.params.prompt_logprobs)))
        return out

    def _verify(self, drafts: List[Draft], logits: torch.Tensor) -> List[VerifiedDraft]:
        """tree_verify (on the grammar-masked logits of constrained drafts), then compact the
        accepted K/V of both pools; the verdicts as data."""
        verify(drafts, self._mask_drafts(drafts, logits), [self._gen(d.seq) for d in drafts], self.ops)
        self.drafter.on_verified(drafts)
        if self.runner.is_hybrid:  # the linear-attention state at the accepted length: root + accepted nodes
            self.runner.commit_chains({d.seq.seq_id: (len(d.path), d.seq.state_slot, d.seq.scratch_slot)
                                       for d in drafts})
        ts, td, ds, dd, computed = commit_moves(drafts, self.block_size)
        self.runner.move_slots(ts, td)
        self.drafter.move_slots(ds, dd)
        out, off = [], 0
        for d, dc in zip(drafts, computed):
            acc = [d.tokens[a] for a in d.path[1:]]
            new = acc + [d.next_token]
            lps = None
            if d.seq.params.logprobs is not None:
                rows = logits[off: off + d.num_nodes].index_select(
                    0, torch.tensor(d.path, device=logits.device)).float().log_softmax(dim=-1)
                lps = [logprob_dict(rows[j], t, d.seq.params.logprobs) for j, t in enumerate(new)]
            off += d.num_nodes
            out.append(VerifiedDraft(d.seq, new, lps, d.num_nodes - 1, len(acc), max(d.depths), dc))
        return out

    def _mask_drafts(self, drafts: List[Draft], logits: torch.Tensor) -> torch.Tensor:
        """The verification logits with each constrained node's grammar mask applied (a copy: the
        reported logprobs stay those of the raw logits)."""
        if self.grammar is None or not any(d.seq.params.structured is not None for d in drafts):
            return logits
        masks, rows, off = [], [], 0
        for d in drafts:
            if d.seq.params.structured is not None:
                mask, nodes = self.grammar.tree_bitmask(d.seq, d.tokens, d.parents)
                masks.append(mask)
                rows += [off + j for j in nodes]
            else:
                masks.append(self.grammar.allocate(d.num_nodes))
            off += d.num_nodes
        masked = logits.clone()
        dev = logits.device
        self.ops.apply_token_bitmask(masked, torch.cat(masks).to(dev), torch.tensor(rows, dtype=torch.int64).to(dev))
        return masked

    def _sample(self, logits: torch.Tensor, sampled: List[Sequence],
                forks: Dict[int, List[Sequence]]) -> List[SampledToken]:
        """One row per sampled sequence, plus its new forks (n > 1) on the same logits row."""
        rows: List[int] = []
        row_seqs: List[Sequence] = []
        for i, seq in enumerate(sampled):
            for s in [seq] + forks.get(seq.seq_id, []):
                rows.append(i)
                row_seqs.append(s)
        if len(rows) != len(sampled):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        bitmask = self.grammar.row_bitmask(row_seqs) if self.grammar is not None else None
        tokens, lps = self.sampler(logits, [s.params for s in row_seqs], [s.token_ids for s in row_seqs],
                                   [self._generator(s) for s in row_seqs], [s.num_prompt_tokens for s in row_seqs],
                                   bitmask)
        return [SampledToken(s, t, lp) for s, t, lp in zip(row_seqs, tokens, lps)]

    def stats(self) -> Dict[str, object]:
        """``spec_num_draft_forwards`` with speculation; ``expert_parallel_routed_slots`` (per rank, the
        (token, expert) pairs its experts processed, summed over the layers and steps) with expert
        parallelism."""
        st: Dict[str, object] = {}
        if self.drafter is not None:
            st["spec_num_draft_forwards"] = self.drafter.num_draft_forwards
        load = routed_slots_per_rank(self.expert_parallel_layers)
        if load is not None:
            st["expert_parallel_routed_slots"] = load
        return st

