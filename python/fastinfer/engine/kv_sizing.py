"""Sizing the memory the engine allocates at start-up: how many KV blocks fit, what one block costs,
and the line ``LLM(..., load_progress=True)`` prints about it.

The memory is a list of :class:`MemoryPool` s charged against one budget. A pool costs bytes per KV
block (it is indexed by the target's block ids, so it grows with the block count: the target's K/V
over this rank's layers, a draft's K/V and an EAGLE head's feature rows) and / or bytes per
sequence slot (a hybrid model's recurrent state is such a pool: one slot per running sequence,
plus, with prefix caching, room for as many state snapshots). The slots come off the budget first;
the blocks share the rest.

The budget, by the first option given (:func:`size_kv_pools`): ``num_kv_blocks`` (blocks, nothing
is computed); ``kv_cache_bytes`` (bytes for all pools); on CUDA ``gpu_memory_utilization`` of the
device's total memory minus what is already used (weights, other processes) minus an estimate of
the activation peak of a ``max_num_batched_tokens`` step (:func:`activation_bytes`); on CPU enough
blocks for ``min(max_num_seqs, 16)`` sequences of ``max_model_len`` tokens, the pools capped at
1 GiB. Pure arithmetic: the runner measures the device and the pools' sizes and passes them in.

The sequence slots: ``min(max_num_seqs x slots_per_seq, what fits in STATE_MEMORY_SHARE of the
budget)`` (with ``num_kv_blocks`` the budget is the device's, as if no size were given: the 1 GiB
cap on CPU). The share is SGLang's default split of a hybrid model's memory between its state pool
and its KV pool (``--mamba-full-memory-ratio 0.9``: state : KV = 0.9 : 1), so a model with a large
state (Qwen3.5: tens of MiB per sequence) runs fewer sequences at once instead of starving the KV
cache; the scheduler admits no more running sequences than there are slots. When not even one slot
fits, sizing fails with an error that names ``max_num_seqs``, the bytes per slot and the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

__all__ = ["MemoryPool", "KVSizing", "size_kv_pools", "activation_bytes", "CPU_DEFAULT_SEQS", "CPU_POOL_CAP_BYTES",
           "STATE_MEMORY_SHARE"]

#: on CPU without a size given: room for this many full-length sequences ...
CPU_DEFAULT_SEQS = 16
#: ... in at most this many bytes of pools
CPU_POOL_CAP_BYTES = 1 << 30
#: the most of the budget the per-sequence slots may take: SGLang's state : KV ratio 0.9 as a share
STATE_MEMORY_SHARE = 0.9 / 1.9


@dataclass(frozen=True)
class MemoryPool:
    """One kind of memory the engine allocates at start-up (see the module docstring)."""

    name: str  # as the report says it: "target KV", "draft KV", ...
    bytes_per_block: int = 0  # per KV block (a pool indexed by the target's block ids)
    bytes_per_seq: int = 0  # per sequence slot (see the module docstring for how many)


@dataclass(frozen=True)
class KVSizing:
    """The outcome of :func:`size_kv_pools`: ``num_blocks`` blocks of ``block_size`` tokens for every
    per-block pool, ``num_seq_slots`` slots for every per-sequence pool (``max_num_seqs``: the
    option, for the report); ``source``: the option that decided it."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    pools: Tuple[MemoryPool, ...]
    source: str
    num_seq_slots: int = 0
    slots_per_seq: int = 1  # wanted per max_num_seqs

    @property
    def bytes_per_block(self) -> int:
        return sum(p.bytes_per_block for p in self.pools)

    @property
    def bytes_per_seq(self) -> int:
        return sum(p.bytes_per_seq for p in self.pools)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_seq_slots * self.bytes_per_seq

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def report(self, max_model_len: int) -> str:
        """One line: the blocks, what each costs (per pool), the bytes in all, where the size came
        from, and how many sequences of ``max_model_len`` tokens fit at once."""
        parts = ", ".join(f"{p.name} {_size(p.bytes_per_block)}" for p in self.pools if p.bytes_per_block)
        seqs = ", ".join(f"{p.name} {_size(p.bytes_per_seq)}" for p in self.pools if p.bytes_per_seq)
        line = (f"fastinfer: KV cache: {self.num_blocks} blocks of {self.block_size} tokens ({self.num_tokens} "
                f"tokens), {_size(self.bytes_per_block)} per block ({parts})")
        if seqs:
            line += f", {_size(self.bytes_per_seq)} per slot x {self.num_seq_slots} slots ({seqs})"
            wanted = self.max_num_seqs * self.slots_per_seq
            if self.num_seq_slots < wanted:
                line += (f" ({wanted} wanted for max_num_seqs={self.max_num_seqs}: capped by the slots' "
                         f"{STATE_MEMORY_SHARE:.0%} of the budget)")
        fit = self.num_tokens / max(1, max_model_len)
        return (line + f"; {_size(self.total_bytes)} in all, sized by {self.source}; room for {fit:.2f} sequences "
                f"of max_model_len={max_model_len}")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def activation_bytes(hidden_size: int, intermediate_size: int, q_size: int, kv_size: int, vocab_size: int,
                     element_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An estimate of the activation peak of one step of ``max_num_batched_tokens`` tokens (the
    hidden states, the MLP's and attention's projections in the model's dtype, fp32 logits of
    ``max_num_seqs`` rows with the sampler's copies) plus 512 MiB for the allocator and workspaces."""
    act = max_num_batched_tokens * (6 * hidden_size + 4 * intermediate_size + 2 * (q_size + 2 * kv_size)) * element_size
    return act + max_num_seqs * vocab_size * 4 * 4 + (512 << 20)


def size_kv_pools(pools: Sequence[MemoryPool], *, block_size: int, max_num_seqs: int, max_model_len: int,
                  num_kv_blocks: Optional[int] = None, kv_cache_bytes: Optional[int] = None,
                  gpu_memory_utilization: float = 0.9, device_memory: Optional[Tuple[int, int]] = None,
                  activation: int = 0, slots_per_seq: int = 1) -> KVSizing:
    """How many KV blocks and sequence slots to allocate for ``pools`` (see the module docstring for
    the rule).

    ``device_memory``: ``(free, total)`` bytes of the CUDA device (None: a CPU); ``activation``: the
    activation estimate to keep free on it (:func:`activation_bytes`); ``slots_per_seq``: the
    sequence slots wanted per ``max_num_seqs`` (2 with a hybrid model's prefix cache: one for each
    running sequence, one for a snapshot). A RuntimeError when the GPU budget does not hold one
    block, or any budget not one sequence slot; ``kv_cache_bytes`` too small for a block still gets
    one block."""
    pools = tuple(pools)
    per_block = sum(p.bytes_per_block for p in pools)
    per_seq = sum(p.bytes_per_seq for p in pools)
    if per_block <= 0:
        raise ValueError("the KV pools cost nothing per block: nothing to size")

    if device_memory is not None:
        free, total = device_memory
        budget = total * gpu_memory_utilization - (total - free) - activation
        budget_name = f"gpu_memory_utilization={gpu_memory_utilization}"
    else:
        budget, budget_name = CPU_POOL_CAP_BYTES, "the CPU pool cap"
    if kv_cache_bytes is not None and num_kv_blocks is None:
        budget, budget_name = int(kv_cache_bytes), "kv_cache_bytes"
    wanted = max_num_seqs * slots_per_seq if per_seq else 0
    slots = wanted
    if per_seq:
        slots = min(wanted, int(max(budget, 0) * STATE_MEMORY_SHARE // per_seq))
        if slots < 1:
            raise RuntimeError(
                f"not enough memory for one sequence's state (max_num_seqs={max_num_seqs}): a slot takes "
                f"{_size(per_seq)} ({', '.join(p.name for p in pools if p.bytes_per_seq)}), the slots may take "
                f"{STATE_MEMORY_SHARE:.0%} of the budget of {_size(max(int(budget), 0))} ({budget_name})")
    per_seqs = slots * per_seq

    def sizing(n: int, source: str) -> KVSizing:
        return KVSizing(int(n), block_size, max_num_seqs, pools, source, slots, slots_per_seq)

    if num_kv_blocks is not None:
        return sizing(num_kv_blocks, "num_kv_blocks")
    if kv_cache_bytes is not None:
        return sizing(max(1, (int(kv_cache_bytes) - per_seqs) // per_block), "kv_cache_bytes")
    if device_memory is not None:
        if budget - per_seqs < per_block:
            state = (f" ({slots} sequence slots of {_size(per_seq)} for max_num_seqs={max_num_seqs} taken first)"
                     if per_seq else "")
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB at gpu_memory_utilization={gpu_memory_utilization}{state}")
        return sizing(int((budget - per_seqs) // per_block), budget_name)
    blocks_per_seq = -(-max_model_len // block_size)
    n = blocks_per_seq * min(max_num_seqs, CPU_DEFAULT_SEQS)
    cap = max(0, CPU_POOL_CAP_BYTES - per_seqs) // per_block
    return sizing(max(min(n, cap), blocks_per_seq + 1),
                  f"max_model_len x min(max_num_seqs, {CPU_DEFAULT_SEQS}) (CPU)")
