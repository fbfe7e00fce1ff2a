"""Model runner: owns the model and its paged KV caches, turns a scheduler step into a
:class:`~fastinfer.models.batch.ForwardBatch` and runs the forward pass.

Row layout (the contract of ``ForwardBatch``): prefill-chunk rows first, sequence by sequence, then
one row per decoding sequence. ``logits_indices`` selects the last row of every prefill chunk that
completes its sequence's uncomputed tokens (only those sample) and every decode row.

Speculative verification chunks (:class:`~fastinfer.engine.spec_decode.SpecChunk`, one per
speculating sequence: its last committed token + draft nodes) are prefill chunks placed after the
ordinary ones, with depth-based positions and, for trees, a ``custom_mask`` (then every prefill
chunk of the step gets a mask block: causal for ordinary chunks). Every node row has logits; they
follow the ordinary sampled rows in the returned logits.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence as Seq, Tuple

import torch

from ..models.batch import ForwardBatch
from .cuda_graphs import DecodeGraphs
from .sequence import Sequence


def nvtx_range(name: str, enabled: bool):
    """``torch.cuda.nvtx.range`` on CUDA, a no-op elsewhere."""
    if enabled:
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


def host_to_device(data, dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` (through pinned memory, asynchronously, on CUDA)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def block_table_tensor(rows: List[List[int]], device: torch.device) -> torch.Tensor:
    """Block tables of several sequences as one int32 [len(rows), max width] tensor, 0-padded."""
    width = max(1, max((len(r) for r in rows), default=1))
    return host_to_device([r + [0] * (width - len(r)) for r in rows], torch.int32, device)


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.use_nvtx = device.type == "cuda"
        # decode-only steps through static buffers / CUDA graphs (see cuda_graphs.py); None: eager
        self.decode_graphs: Optional[DecodeGraphs] = None

    def enable_decode_graphs(self, max_batch: int, max_blocks: int, use_graphs: bool) -> DecodeGraphs:
        """Capture decode graphs for batch buckets up to ``max_batch`` (``use_graphs=False``: the
        same static-buffer path run eagerly, for tests without a GPU)."""
        graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_blocks, self.device, use_graphs)
        with nvtx_range("capture decode graphs", self.use_nvtx):
            graphs.capture()
        self.decode_graphs = graphs
        return graphs

    def _to_dev(self, data, dtype) -> torch.Tensor:
        return host_to_device(data, dtype, self.device)

    def _table(self, rows: List[List[int]]) -> torch.Tensor:
        return block_table_tensor(rows, self.device)

    def prepare(self, prefills: Seq[Tuple[Sequence, int]], decodes: Seq[Sequence],
                spec: Seq = ()) -> Tuple[ForwardBatch, List[Sequence]]:
        """Build the batch; returns it and the sequences whose logits it yields (in row order; the
        rows of the ``spec`` chunks follow, every node of every chunk, chunk by chunk)."""
        bs = self.block_size
        input_ids: List[int] = []
        positions: List[int] = []
        slots: List[int] = []
        logits_idx: List[int] = []
        sampled: List[Sequence] = []
        cu_q = [0]
        seq_lens_k: List[int] = []
        p_tables: List[List[int]] = []
        max_q = 0
        for seq, n in prefills:
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu_q.append(cu_q[-1] + n)
            seq_lens_k.append(end)
            p_tables.append(table)
            max_q = max(max_q, n)
            if end == seq.num_tokens:  # chunk completes the sequence: sample
                logits_idx.append(len(input_ids) - 1)
                sampled.append(seq)
        spec_idx: List[int] = []
        masks: List[Optional[torch.Tensor]] = [None] * len(prefills)
        for ch in spec:  # speculative verification: nodes at slots start .. start + N - 1
            seq = ch.seq
            start = seq.num_computed_tokens
            n = len(ch.tokens)
            spec_idx.extend(range(len(input_ids), len(input_ids) + n))
            input_ids.extend(ch.tokens)
            positions.extend(start + d for d in ch.depths)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu_q.append(cu_q[-1] + n)
            seq_lens_k.append(start + n)
            p_tables.append(table)
            max_q = max(max_q, n)
            masks.append(ch.mask)
        custom_mask = None
        if any(m is not None for m in masks):
            lens = [cu_q[i + 1] - cu_q[i] for i in range(len(masks))]
            custom_mask = torch.cat([
                (m.to(torch.bool) if m is not None else torch.ones(q, q, dtype=torch.bool).tril_()).reshape(-1)
                for m, q in zip(masks, lens)]).to(self.device)
        prefills = list(prefills) + [(ch.seq, len(ch.tokens)) for ch in spec]
        num_prefill = len(input_ids)
        d_lens: List[int] = []
        d_tables: List[List[int]] = []
        for seq in decodes:
            p = seq.num_tokens - 1
            input_ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            d_lens.append(p + 1)
            d_tables.append(seq.block_table)
            logits_idx.append(len(input_ids) - 1)
            sampled.append(seq)
        batch = ForwardBatch(
            input_ids=self._to_dev(input_ids, torch.int64),
            positions=self._to_dev(positions, torch.int64),
            slot_mapping=self._to_dev(slots, torch.int64),
            num_prefill_tokens=num_prefill,
            prefill_cu_seqlens_q=self._to_dev(cu_q, torch.int32) if prefills else None,
            prefill_seq_lens_k=self._to_dev(seq_lens_k, torch.int32) if prefills else None,
            prefill_block_table=self._table(p_tables) if prefills else None,
            prefill_max_seqlen_q=max_q,
            decode_seq_lens=self._to_dev(d_lens, torch.int32) if decodes else None,
            decode_block_table=self._table(d_tables) if decodes else None,
            logits_indices=self._to_dev(logits_idx + spec_idx, torch.int64),
            custom_mask=custom_mask,
        )
        return batch, sampled

    @torch.inference_mode()
    def execute(self, prefills: Seq[Tuple[Sequence, int]], decodes: Seq[Sequence],
                spec: Seq = ()) -> Tuple[torch.Tensor, List[Sequence]]:
        """Run one step; returns float32 logits ``[len(sampled) + spec nodes, V]`` and the sampled
        sequences (see :meth:`prepare` for the rows of ``spec`` chunks)."""
        g = self.decode_graphs
        if not prefills and not spec and g is not None and g.fits(len(decodes), max(len(s.block_table) for s in decodes)):
            bs = self.block_size
            pos = [s.num_tokens - 1 for s in decodes]
            with nvtx_range(f"decode graph B={len(decodes)}", self.use_nvtx):
                logits = g.run([s.token_ids[p] for s, p in zip(decodes, pos)], pos,
                               [s.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, pos)],
                               [p + 1 for p in pos], [s.block_table for s in decodes])
            return logits, list(decodes)
        batch, sampled = self.prepare(prefills, decodes, spec)
        name = "prefill" if prefills and not decodes else ("decode" if not prefills else "mixed")
        if spec:
            name = "verify" if not prefills and not decodes else "mixed+verify"

        with nvtx_range(f"{name} T={batch.num_tokens}", self.use_nvtx):
            logits = self.model(batch, self.kv_caches)
        return logits, sampled


# ------------------------------------------------------------------------------------------------
# KV cache sizing
# ------------------------------------------------------------------------------------------------

def num_kv_blocks_for(model, block_size: int, device: torch.device, *, num_kv_blocks: Optional[int],
                      kv_cache_bytes: Optional[int], gpu_memory_utilization: float,
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
