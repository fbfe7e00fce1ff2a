"""The executor: the only owner of device tensors (models, KV pools, CUDA graphs, sampling
generators) and the only place they are touched.

``Executor(config)`` loads the model (and the draft model), sizes and allocates the paged KV pools,
captures CUDA graphs; ``execute(step) -> ModelOutput`` runs one engine step: the draft's proposals,
one target forward over the ragged batch (prefill chunks, speculative trees, decode rows), the
verification of the drafts (KV slot moves applied here), and sampling. What it returns is token
ids and numbers, never a tensor. This is the in-process executor; a multi-process one (tensor
parallelism) runs the same forward on every rank from the same :class:`StepInput`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch

from ..layers import BatchBuilder, TensorDictReader
from ..models import LlamaForCausalLM, load_config, load_model
from ..quant import resolve_quantization
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .sampler import Sampler, logprob_dict
from .scheduler import SchedulerOutput, SpecPlan
from .sequence import Sequence
from .speculative import Draft, Drafter, DraftModelDrafter, commit_moves, verify
from .speculative.drafter import move_slots

__all__ = ["Executor", "StepInput", "SpecWork", "ModelOutput", "SampledToken", "VerifiedDraft", "nvtx_range"]


def nvtx_range(name: str, enabled: bool):
    """``torch.cuda.nvtx.range`` on CUDA, a no-op elsewhere."""
    return torch.cuda.nvtx.range(name) if enabled else contextlib.nullcontext()


@dataclass
class SpecWork:
    seq: Sequence
    plan: SpecPlan
    draft_computed: int  # leading tokens the draft has K/V for (the proposer's state)


@dataclass
class StepInput:
    scheduled: SchedulerOutput
    spec: List[SpecWork] = field(default_factory=list)
    # parent seq_id -> the new sequences (n > 1) whose first token is sampled from the parent's row
    forks: Dict[int, List[Sequence]] = field(default_factory=dict)
    finished_seq_ids: List[int] = field(default_factory=list)  # since the last step


@dataclass
class SampledToken:
    seq: Sequence
    token: int
    logprobs: Optional[Dict[int, float]]


@dataclass
class VerifiedDraft:
    seq: Sequence
    tokens: List[int]  # the accepted draft tokens, then the bonus / residual sample
    logprobs: Optional[List[Dict[int, float]]]
    num_draft: int
    num_accepted: int
    max_depth: int
    draft_computed: int  # leading tokens with draft K/V after the commit


@dataclass
class ModelOutput:
    sampled: List[SampledToken] = field(default_factory=list)
    verified: List[VerifiedDraft] = field(default_factory=list)


def _seed_for(seed: int, index: int) -> int:
    return (int(seed) * 1_000_003 + index * 7_919 + 12_345) % (2 ** 63 - 1)


class Executor:
    """Loads and runs the models of an :class:`EngineConfig` (see the module docstring).

    After construction: ``model``, ``draft_model`` (or None), ``kv_caches``, ``num_kv_blocks``,
    ``max_model_len`` (capped by the model's positions and the KV pool), ``device``.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        self.model = self._load_target(config)
        self.device = self.model.device
        self.use_nvtx = self.device.type == "cuda"
        model_max = int(self.model.max_positions)
        self.max_model_len = min(model_max, config.max_model_len) if config.max_model_len else model_max
        spec = config.speculative
        self.draft_model = self._load_draft(spec, model_max) if spec is not None else None
        self.num_kv_blocks = self._num_kv_blocks()
        self.max_model_len = min(self.max_model_len, self.num_kv_blocks * self.block_size)
        self.kv_caches = self.model.allocate_kv_cache(self.num_kv_blocks, self.block_size)
        self.drafter: Optional[Drafter] = None
        if self.draft_model is not None:
            self.drafter = DraftModelDrafter(
                self.draft_model, self.draft_model.allocate_kv_cache(self.num_kv_blocks, self.block_size),
                self.block_size, self.device, spec.mode, spec.num_tokens, spec.tree_topk,
                config.max_num_batched_tokens)
        # decode-only steps through static buffers / CUDA graphs (see cuda_graphs.py); None: eager
        self.decode_graphs: Optional[DecodeGraphs] = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.enable_decode_graphs(min(config.max_num_seqs, 256), -(-self.max_model_len // self.block_size), True)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(config.seed))
        self.sampler = Sampler(gen)
        self._generators: Dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded request

    # ------------------------------------------------------------------------------------------
    # loading
    # ------------------------------------------------------------------------------------------
    def _load(self, path: str, dtype, max_positions, quantization=None, progress: bool = False):
        cfg = load_config(path)  # a Hugging Face directory or a GGUF file
        qc = resolve_quantization(cfg, quantization, path)
        return load_model(path, dtype=dtype, device=self.device, progress=progress,
                          max_positions=cfg.max_model_len if max_positions is None else max_positions,
                          config=cfg, quant_config=qc)

    def _load_target(self, c: EngineConfig):
        if isinstance(c.model, str):
            model = self._load(c.model, c.dtype, c.max_model_len, c.quantization, c.load_progress)
        else:
            model = c.model
            if c.quantization is not None:  # an already built float model: rebuild it quantised
                qc = resolve_quantization(model.config, c.quantization)
                model = load_model(TensorDictReader(dict(model.checkpoint_tensors()), "the given model"),
                                   config=model.config, dtype=model.dtype, device=model.device,
                                   max_positions=model.max_positions, quant_config=qc,
                                   op_namespace=model.op_namespace)
        model.pack_linears_for_cpu()  # CPU bf16 only: oneDNN-blocked weights
        return model

    def _load_draft(self, spec, max_positions: int):
        """Load / check the draft model: same vocabulary, the target's dtype and device."""
        target = self.model
        if isinstance(spec.draft_model, str):
            dcfg = load_config(spec.draft_model)
            _check_draft_vocab(int(dcfg.vocab_size), int(target.config.vocab_size))
            draft = self._load(spec.draft_model, target.dtype, max_positions)
        else:
            draft = spec.draft_model
            _check_draft_vocab(int(draft.config.vocab_size), int(target.config.vocab_size))
            if torch.device(getattr(draft, "device", self.device)) != self.device:
                raise ValueError(f"draft_model is on {draft.device}, the target on {self.device}")
            if int(getattr(draft, "max_positions", max_positions)) < self.max_model_len:
                raise ValueError(f"draft_model accepts {draft.max_positions} positions, fewer than "
                                 f"max_model_len={self.max_model_len}")
        draft.pack_linears_for_cpu()
        return draft

    def _num_kv_blocks(self) -> int:
        c = self.config
        n = num_kv_blocks_for(self.model, c.block_size, self.device, num_kv_blocks=c.num_kv_blocks,
                              kv_cache_bytes=c.kv_cache_bytes, gpu_memory_utilization=c.gpu_memory_utilization,
                              max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs,
                              max_num_batched_tokens=c.max_num_batched_tokens)
        if self.draft_model is not None and c.num_kv_blocks is None and (
                c.kv_cache_bytes is not None or self.device.type == "cuda"):
            # the byte budget holds both pools (same block ids)
            t_pb = self.model.kv_cache_bytes_per_block(c.block_size)
            n = max(1, n * t_pb // (t_pb + self.draft_model.kv_cache_bytes_per_block(c.block_size)))
        return n

    def enable_decode_graphs(self, max_batch: int, max_blocks: int, use_graphs: bool) -> DecodeGraphs:
        """Capture decode graphs for batch buckets up to ``max_batch`` (``use_graphs=False``: the
        same static-buffer path run eagerly, for tests without a GPU)."""
        graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_blocks, self.device, use_graphs)
        with nvtx_range("capture decode graphs", self.use_nvtx):
            graphs.capture()
        self.decode_graphs = graphs
        return graphs

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

    @torch.inference_mode()
    def execute(self, step: StepInput) -> ModelOutput:
        for sid in step.finished_seq_ids:
            self._generators.pop(sid, None)
        sched = step.scheduled
        drafts: List[Draft] = []
        if step.spec:
            with nvtx_range("draft", self.use_nvtx):
                drafts = self.drafter.propose([(w.seq, w.plan.size, w.draft_computed) for w in step.spec],
                                              [self._gen(w.seq) for w in step.spec])
        logits, sampled = self._forward(sched.prefills, sched.decodes, drafts)
        out = ModelOutput()
        if drafts:
            with nvtx_range("verify", self.use_nvtx):
                out.verified = self._verify(drafts, logits[len(sampled):])
        if sampled:
            with nvtx_range("sample", self.use_nvtx):
                out.sampled = self._sample(logits[: len(sampled)], sampled, step.forks)
        return out

    def _forward(self, prefills: Seq[Tuple[Sequence, int]], decodes: Seq[Sequence],
                 drafts: Seq[Draft]) -> Tuple[torch.Tensor, List[Sequence]]:
        """One target forward. Logits rows: the prefill chunks that complete their sequence (those
        sample), the decode rows, then every node of every draft, draft by draft. Returns the
        logits and the sequences of the sampled rows."""
        b = BatchBuilder(self.block_size, self.device)
        sampled: List[Sequence] = []
        for seq, n in prefills:
            start = seq.num_computed_tokens
            completes = start + n == seq.num_tokens
            b.prefill(seq.token_ids[start:start + n], start, seq.block_table, logits="last" if completes else "none")
            if completes:
                sampled.append(seq)
        for seq in decodes:
            p = seq.num_tokens - 1
            b.decode(seq.token_ids[p], p, seq.block_table)
            sampled.append(seq)
        for d in drafts:  # verification: root + nodes at slots start .., rotary positions start + depth
            start = d.seq.num_computed_tokens
            b.prefill(d.tokens, start, d.seq.block_table, positions=[start + x for x in d.depths], mask=d.mask,
                      logits="all")
        want_hidden = self.drafter is not None and self.drafter.wants_hidden_states
        g = self.decode_graphs
        if (not prefills and not drafts and not want_hidden and g is not None
                and g.fits(len(decodes), max(len(s.block_table) for s in decodes))):
            with nvtx_range(f"decode graph B={len(decodes)}", self.use_nvtx):
                return g.run(*b.decode_rows()), sampled
        batch = b.build()
        name = "prefill" if prefills and not decodes else ("decode" if not prefills else "mixed")
        if drafts:
            name = "verify" if not prefills and not decodes else "mixed+verify"
        with nvtx_range(f"{name} T={batch.num_tokens}", self.use_nvtx):
            if not want_hidden:
                return self.model(batch, self.kv_caches), sampled
            hidden = self.model.hidden_states(batch, self.kv_caches).index_select(0, batch.logits_indices)
            self.drafter.observe_hidden_states(sampled + [d.seq for d in drafts for _ in d.tokens], hidden)
            return self.model.compute_logits(hidden), sampled

    def _verify(self, drafts: List[Draft], logits: torch.Tensor) -> List[VerifiedDraft]:
        """tree_verify, then compact the accepted K/V of both pools; the verdicts as data."""
        verify(drafts, logits, [self._gen(d.seq) for d in drafts], lib=self.model.ops.lib)
        ts, td, ds, dd, computed = commit_moves(drafts, self.block_size)
        move_slots(self.model.ops, self.kv_caches, ts, td, self.device)
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
        tokens, lps = self.sampler(logits, [s.params for s in row_seqs], [s.token_ids for s in row_seqs],
                                   [self._generator(s) for s in row_seqs], [s.num_prompt_tokens for s in row_seqs])
        return [SampledToken(s, t, lp) for s, t, lp in zip(row_seqs, tokens, lps)]

    def stats(self) -> Dict[str, object]:
        return {"spec_num_draft_forwards": self.drafter.num_draft_forwards} if self.drafter is not None else {}


def _check_draft_vocab(draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"draft_model has vocab_size {draft_vocab}, the target {target_vocab}: speculative "
                         "decoding needs a draft with the target's tokenizer and vocabulary")


# ------------------------------------------------------------------------------------------------
# KV cache sizing
# ------------------------------------------------------------------------------------------------

def num_kv_blocks_for(model: LlamaForCausalLM, block_size: int, device: torch.device, *,
                      num_kv_blocks: Optional[int], kv_cache_bytes: Optional[int], gpu_memory_utilization: float,
                      max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """How many KV blocks to preallocate.

    ``num_kv_blocks`` wins; else ``kv_cache_bytes``; else on CUDA ``gpu_memory_utilization`` of the
    device's total memory minus what is already used (weights, other processes) minus an estimate
    of the activation peak of a ``max_num_batched_tokens`` step; on CPU enough blocks for
    ``min(max_num_seqs, 16)`` full-length sequences, capped at 1 GiB.
    """
    per_block = model.kv_cache_bytes_per_block(block_size)
    if num_kv_blocks is not None:
        return int(num_kv_blocks)
    if kv_cache_bytes is not None:
        return max(1, int(kv_cache_bytes) // per_block)
    if device.type == "cuda":
        c = model.config
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        el = torch.empty((), dtype=model.dtype).element_size()
        act = max_num_batched_tokens * (6 * c.hidden_size + 4 * c.intermediate_size
                                        + 2 * (c.q_size + 2 * c.kv_size)) * el
        act += max_num_seqs * c.vocab_size * 4 * 4 + (512 << 20)
        budget = total * gpu_memory_utilization - (total - free) - act
        if budget < per_block:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB at gpu_memory_utilization={gpu_memory_utilization}")
        return int(budget // per_block)
    blocks_per_seq = -(-max_model_len // block_size)
    n = blocks_per_seq * min(max_num_seqs, 16)
    return max(min(n, (1 << 30) // per_block), blocks_per_seq + 1)
