"""The flattened ragged batch one model forward runs on, and the one builder that assembles it.

Row layout of the T tokens: all prefill-chunk tokens first (chunk by chunk), then one token per
decoding sequence. A prefill chunk is any run of new tokens of one sequence whose earlier tokens
(if any) are already in the KV cache: a fresh prompt, the next chunk of a long prompt, a prompt
continuing a prefix-cache hit, or (speculative decoding) a tree of draft tokens with a mask.

Per layer the model (1) writes the new K/V rows to the paged cache at ``slot_mapping`` (slot =
block * block_size + offset, -1 = padding, skipped), then (2) runs ``paged_prefill_attention`` over
the prefill rows (their queries are the LAST q_len tokens of each sequence, already in the cache)
and ``paged_decode_attention`` over the decode rows.

Everything that builds a batch (the executor, the draft proposer, CUDA graphs, tests) goes through
:class:`BatchBuilder`; :func:`slot_of` is the one place the slot formula is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor

__all__ = ["ForwardBatch", "BatchBuilder", "slot_of", "host_to_device"]


@dataclass
class ForwardBatch:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64 (rotary positions; depth-based for tree tokens)
    slot_mapping: Tensor  # [T] int64, -1 for padding rows
    # prefill part: rows [0, num_prefill_tokens)
    num_prefill_tokens: int
    prefill_cu_seqlens_q: Optional[Tensor]  # [Bp + 1] int32
    prefill_seq_lens_k: Optional[Tensor]  # [Bp] int32: tokens in the cache after this step
    prefill_block_table: Optional[Tensor]  # [Bp, W] int32
    prefill_max_seqlen_q: int
    # decode part: rows [num_prefill_tokens, T)
    decode_seq_lens: Optional[Tensor]  # [Bd] int32 (including the new token)
    decode_block_table: Optional[Tensor]  # [Bd, W] int32
    # rows whose logits are needed, in the order the logits are returned
    logits_indices: Tensor  # [N] int64
    # speculative tree verification: bool mask per prefill chunk (see paged_prefill_attention)
    custom_mask: Optional[Tensor] = None
    # every prefill chunk starts at cache position 0 with the causal mask: its keys are its own rows
    # (a model may then attend over the new rows without reading the cache)
    prefill_fresh: bool = False
    # hybrid models (linear-attention layers): per sequence, prefill chunks then decode rows, its state
    # slot, its rows (int32 cu_seqlens over all T rows) and whether it continues from its slot (a
    # chunk after the first, every decode row); None when the batch was built without state slots
    state_slots: Optional[Tensor] = None  # [Bp + Bd] int32
    state_cu_seqlens: Optional[Tensor] = None  # [Bp + Bd + 1] int32
    has_initial_state: Optional[Tensor] = None  # [Bp + Bd] bool
    # speculative verification of a hybrid model: each linear-attention layer puts the input
    # projection of these rows (the chains' rows) in ``linear_inputs`` under its layer index, for
    # re-running the accepted ones from the state saved before (see Qwen3_5ForCausalLM)
    linear_input_rows: Optional[Tensor] = None  # [R] int64
    linear_inputs: Optional[dict] = None

    @classmethod
    def decode_only(cls, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, seq_lens: Tensor,
                    block_table: Tensor, logits_indices: Optional[Tensor] = None) -> "ForwardBatch":
        """A batch of decode rows over given (e.g. static, CUDA-graph) tensors; every row has logits."""
        if logits_indices is None:
            logits_indices = torch.arange(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
        return cls(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, num_prefill_tokens=0,
                   prefill_cu_seqlens_q=None, prefill_seq_lens_k=None, prefill_block_table=None,
                   prefill_max_seqlen_q=0, decode_seq_lens=seq_lens, decode_block_table=block_table,
                   logits_indices=logits_indices)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Cache slot of logical position ``position`` of a sequence with ``block_table``."""
    return block_table[position // block_size] * block_size + position % block_size


def host_to_device(data, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on ``device`` (through pinned memory, asynchronously, on CUDA)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _table_tensor(rows: List[Sequence[int]], device: torch.device) -> Tensor:
    width = max(1, max((len(r) for r in rows), default=1))
    return host_to_device([list(r) + [0] * (width - len(r)) for r in rows], torch.int32, device)


LogitsRows = Union[str, Sequence[int]]


#: Tokens per KV-cache block unless told otherwise (the runner's ``block_size`` option defaults to it).
DEFAULT_BLOCK_SIZE = 16


class BatchBuilder:
    """Collects prefill chunks and decode rows, then :meth:`build` makes the :class:`ForwardBatch`.

    The logits come back in the order rows were asked for (``prefill(..., logits=...)`` and
    ``decode(...)`` calls, in call order); each call returns the indices of its rows in them.
    """

    def __init__(self, block_size: int, device=None):
        self.block_size = int(block_size)
        self.device = torch.device("cpu" if device is None else device)
        self._p_ids: List[int] = []
        self._p_pos: List[int] = []
        self._p_slots: List[int] = []
        self._cu = [0]
        self._lens_k: List[int] = []
        self._p_tables: List[Sequence[int]] = []
        self._masks: List[Optional[Tensor]] = []
        self._max_q = 0
        self._d_ids: List[int] = []
        self._d_pos: List[int] = []
        self._d_slots: List[int] = []
        self._d_tables: List[Sequence[int]] = []
        self._want: List[Tuple[bool, int]] = []  # (is_decode, row within its part)
        self._p_state: List[Optional[int]] = []  # per chunk: its state slot (hybrid models) or None
        self._p_continues: List[bool] = []  # per chunk: start > 0
        self._d_state: List[Optional[int]] = []

    def _slot(self, table: Sequence[int], p: int) -> int:
        if p // self.block_size >= len(table):
            raise ValueError(f"position {p} is outside the {len(table)} blocks of the block table")
        return slot_of(table, p, self.block_size)

    def prefill(self, token_ids: Sequence[int], start: int, block_table: Sequence[int], *,
                positions: Optional[Sequence[int]] = None, slot_positions: Optional[Sequence[int]] = None,
                mask: Optional[Tensor] = None, logits: LogitsRows = "last",
                state_slot: Optional[int] = None) -> List[int]:
        """A chunk of new tokens of one sequence.

        ``token_ids`` sit at cache positions ``start ..`` (or ``slot_positions``; the chunk's keys
        end at the last one) with rotary ``positions`` (default: the cache positions; tree nodes
        use ``start + depth``). ``mask``: ``[q, q]`` bool tree mask (default causal). ``logits``:
        "last", "all", "none" or the chunk-local rows that get logits. ``state_slot``: the
        sequence's linear-attention state slot (hybrid models; a chunk at ``start`` 0 starts from
        zeros, a later one continues from the slot).
        """
        toks = list(token_ids)
        q = len(toks)
        if q == 0:
            raise ValueError("empty prefill chunk")
        spos = list(range(start, start + q)) if slot_positions is None else list(slot_positions)
        rpos = spos if positions is None else list(positions)
        if len(spos) != q or len(rpos) != q:
            raise ValueError("positions / slot_positions must have one entry per token")
        base = len(self._p_ids)
        self._p_ids.extend(toks)
        self._p_pos.extend(rpos)
        self._p_slots.extend(self._slot(block_table, p) for p in spos)
        self._cu.append(base + q)
        self._lens_k.append(spos[-1] + 1)
        self._p_tables.append(block_table)
        self._masks.append(mask)
        self._max_q = max(self._max_q, q)
        self._p_state.append(None if state_slot is None else int(state_slot))
        self._p_continues.append(int(start) > 0)
        if isinstance(logits, str):
            if logits not in ("last", "all", "none"):
                raise ValueError(f"logits must be 'last', 'all', 'none' or a list of rows, got {logits!r}")
            rows = {"last": [q - 1], "all": range(q), "none": ()}[logits]
        else:
            rows = logits
        out = []
        for r in rows:
            out.append(len(self._want))
            self._want.append((False, base + int(r)))
        return out

    def decode(self, token_id: int, position: int, block_table: Sequence[int],
               state_slot: Optional[int] = None) -> int:
        """One new token at ``position`` (the sequence then holds ``position + 1`` tokens);
        ``state_slot`` as in :meth:`prefill` (a decode row always continues from it)."""
        self._d_state.append(None if state_slot is None else int(state_slot))
        self._d_ids.append(int(token_id))
        self._d_pos.append(int(position))
        self._d_slots.append(self._slot(block_table, position))
        self._d_tables.append(block_table)
        self._want.append((True, len(self._d_ids) - 1))
        return len(self._want) - 1

    @property
    def num_prefill_chunks(self) -> int:
        return len(self._lens_k)

    @property
    def num_decodes(self) -> int:
        return len(self._d_ids)

    def decode_rows(self) -> Tuple[List[int], List[int], List[int], List[int], List[Sequence[int]]]:
        """The decode part as lists ``(ids, positions, slots, seq_lens, tables)`` (CUDA graphs)."""
        return self._d_ids, self._d_pos, self._d_slots, [p + 1 for p in self._d_pos], self._d_tables

    def build(self) -> ForwardBatch:
        dev = self.device
        P = len(self._p_ids)
        has_p, has_d = bool(self._lens_k), bool(self._d_ids)
        custom_mask = None
        if any(m is not None for m in self._masks):
            lens = [b - a for a, b in zip(self._cu, self._cu[1:])]
            custom_mask = torch.cat([
                (m.to(torch.bool) if m is not None else torch.ones(q, q, dtype=torch.bool).tril_()).reshape(-1)
                for m, q in zip(self._masks, lens)]).to(dev)
        ints = host_to_device([self._p_ids + self._d_ids, self._p_pos + self._d_pos, self._p_slots + self._d_slots],
                              torch.int64, dev)
        state = self._state_tensors()
        return ForwardBatch(
            input_ids=ints[0], positions=ints[1], slot_mapping=ints[2],
            num_prefill_tokens=P,
            prefill_cu_seqlens_q=host_to_device(self._cu, torch.int32, dev) if has_p else None,
            prefill_seq_lens_k=host_to_device(self._lens_k, torch.int32, dev) if has_p else None,
            prefill_block_table=_table_tensor(self._p_tables, dev) if has_p else None,
            prefill_max_seqlen_q=self._max_q,
            decode_seq_lens=host_to_device([p + 1 for p in self._d_pos], torch.int32, dev) if has_d else None,
            decode_block_table=_table_tensor(self._d_tables, dev) if has_d else None,
            logits_indices=host_to_device([r + P if d else r for d, r in self._want], torch.int64, dev),
            custom_mask=custom_mask,
            prefill_fresh=has_p and custom_mask is None and all(
                n == b - a for n, a, b in zip(self._lens_k, self._cu, self._cu[1:])),
            **state,
        )

    def _state_tensors(self) -> dict:
        """The state-slot fields of the batch: every row given a slot, or none."""
        slots = self._p_state + self._d_state
        given = [s is not None for s in slots]
        if not any(given):
            return {}
        if not all(given):
            raise ValueError("state_slot given for some sequences of the batch but not all")
        dev = self.device
        cu = list(self._cu) + [len(self._p_ids) + i + 1 for i in range(len(self._d_ids))]
        return dict(state_slots=host_to_device(slots, torch.int32, dev),
                    state_cu_seqlens=host_to_device(cu, torch.int32, dev),
                    has_initial_state=host_to_device(self._p_continues + [True] * len(self._d_ids), torch.bool, dev))
