"""Paged KV cache bookkeeping: physical blocks with reference counts and a prefix cache.

Prefix caching: a FULL block of a sequence is identified by a hash chain,
``h_i = hash((h_{i-1}, tokens of block i))`` (the token ids are kept too, so a hash collision can
never serve wrong K/V). When a block becomes full and computed, its hash is registered. A new
sequence first looks its leading full blocks up and reuses the hits (ref count + 1) instead of
recomputing them. A block whose ref count drops to 0 keeps its hash and goes to an LRU list of
cached-free blocks; it is only evicted (hash dropped) when allocation runs out of never-cached
free blocks, least recently freed first (``on_evict`` hears of each dropped hash: a hybrid model's
state snapshot goes with its block, :class:`StateSlots`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Dict, List, Optional, Tuple

from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: Optional[Tuple[int, ...]] = None


def block_hash(parent: Optional[int], tokens) -> int:
    return hash((parent if parent is not None else -1, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_uncached: deque = deque(range(num_blocks))
        self.free_cached: "OrderedDict[int, None]" = OrderedDict()  # LRU: oldest first
        self.hash_to_block: Dict[int, int] = {}
        self.version: List[int] = [0] * num_blocks  # see the module docstring
        # counters (tokens)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.on_evict: Optional[Callable[[int], None]] = None  # called with each hash an eviction drops

    # ------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free_block(self) -> int:
        if self.free_uncached:
            bid = self.free_uncached.popleft()
        else:
            bid, _ = self.free_cached.popitem(last=False)  # evict the least recently freed
            blk = self.blocks[bid]
            if blk.hash is not None and self.hash_to_block.get(blk.hash) == bid:
                del self.hash_to_block[blk.hash]
                if self.on_evict is not None:
                    self.on_evict(blk.hash)
            blk.hash = None
            blk.token_ids = None
        blk = self.blocks[bid]
        assert blk.ref_count == 0
        blk.ref_count = 1
        self.version[bid] += 1  # new contents
        return bid

    def _ref(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self.free_cached[bid]
        blk.ref_count += 1

    def _unref(self, bid: int) -> None:
        blk = self.blocks[bid]
        assert blk.ref_count > 0, f"block {bid} freed twice"
        blk.ref_count -= 1
        if blk.ref_count == 0:
            if blk.hash is not None:
                self.free_cached[bid] = None  # most recently freed at the end
            else:
                self.free_uncached.append(bid)

    # ------------------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> List[int]:
        """Cached blocks for the leading full blocks of ``seq`` (at least one token is always left
        to compute, so the last position has logits). Does not take references."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hits: List[int] = []
        parent: Optional[int] = None
        for i in range(max_blocks):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, toks)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != toks:
                break
            hits.append(bid)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, cached_blocks: List[int] = ()) -> bool:
        """Whether ``seq`` (taking ``cached_blocks`` first when it has no blocks yet) can hold
        ``num_tokens`` tokens."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_blocks)
        # cached hits that are currently free do not count as free capacity any more
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return max(need, 0) <= self.num_free_blocks - revived

    def allocate_prefix(self, seq: Sequence, cached_blocks: List[int]) -> None:
        """Give a block-less sequence its prefix-cache hits."""
        assert not seq.block_table
        bs = self.block_size
        parent: Optional[int] = None
        for bid in cached_blocks:
            self._ref(bid)
            seq.block_table.append(bid)
            parent = self.blocks[bid].hash
            seq.block_hashes.append(parent)
        seq.num_computed_tokens = len(cached_blocks) * bs
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table of ``seq`` to hold ``num_tokens`` tokens (caller checked space)."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def share(self, src: Sequence, dst: Sequence, num_blocks: int) -> None:
        """Fork: ``dst`` (block-less) shares the first ``num_blocks`` blocks of ``src``."""
        assert not dst.block_table
        for bid in src.block_table[:num_blocks]:
            self._ref(bid)
            dst.block_table.append(bid)
        dst.block_hashes = list(src.block_hashes[:num_blocks])
        dst.num_computed_tokens = num_blocks * self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop the references of ``seq`` (tail first, so tail blocks are evicted first)."""
        for bid in reversed(seq.block_table):
            self._unref(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks of ``seq`` beyond what ``num_tokens`` tokens need (speculative
        decoding: the slots of rejected draft nodes)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())
        del seq.block_hashes[keep:]

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the full, computed blocks of ``seq`` not hashed yet and publish them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), n_full):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, toks)
            bid = seq.block_table[i]
            blk = self.blocks[bid]
            if blk.hash is None and h not in self.hash_to_block:
                blk.hash = h
                blk.token_ids = toks
                self.hash_to_block[h] = bid
            seq.block_hashes.append(h)
            parent = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (blocks in use keep working, unhashed)."""
        for blk in self.blocks:
            blk.hash = None
            blk.token_ids = None
        if self.on_evict is not None:
            for h in self.hash_to_block:
                self.on_evict(h)
        self.hash_to_block.clear()
        while self.free_cached:
            bid, _ = self.free_cached.popitem(last=False)
            self.free_uncached.append(bid)

    def check_invariants(self) -> None:  # used by tests
        free = set(self.free_uncached) | set(self.free_cached)
        assert len(free) == len(self.free_uncached) + len(self.free_cached)
        for blk in self.blocks:
            assert (blk.ref_count == 0) == (blk.block_id in free), blk.block_id


class StateSlots:
    """The state slots of a hybrid model (its linear-attention layers' per-sequence state, allocated
    by the executor beside the paged KV): one per running sequence, taken when the scheduler admits
    it, given back when it finishes or is preempted (a preempted sequence is recomputed from its
    tokens, so its state is rebuilt on readmission).

    With prefix caching the slots not running hold state snapshots: the state after the leading
    full blocks of some sequence, keyed by the hash of the last of those blocks (the block
    manager's hash chain, which names the whole prefix). A sequence whose cached prefix ends at a
    snapshot restores it into its own slot and continues from there. Snapshots are least recently
    used first to go: when a running sequence or a newer snapshot needs a slot, and with their
    block when the block manager evicts it (:meth:`drop`). The copies between slots are queued
    (:attr:`pending_copies`, ``(source slot, destination slot)`` in order) and applied before the
    next forward pass, which is the only thing that writes a running slot.

    With speculative decoding (``slots_per_seq=2``) a running sequence also takes a scratch slot
    (``seq.scratch_slot``): its state before a verification, from which the accepted rows are
    re-run."""

    def __init__(self, num_slots: int, slots_per_seq: int = 1):
        need = max(slots_per_seq, 1)
        if num_slots < need:
            raise ValueError(f"a hybrid model needs at least {need} state slot{'s' if need > 1 else ''}, "
                             f"got {num_slots}")
        self.num_slots = num_slots
        self.slots_per_seq = slots_per_seq
        self._free: deque = deque(range(num_slots))
        self._snapshots: "OrderedDict[int, int]" = OrderedDict()  # block hash -> slot, LRU first
        self.pending_copies: List[Tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        """Slots a running sequence can take (free ones and those of snapshots, which give way)."""
        return len(self._free) + len(self._snapshots)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def can_take(self, num_seqs: int) -> bool:
        """Whether ``num_seqs`` more sequences can run (each takes ``slots_per_seq`` slots)."""
        return self.num_free >= num_seqs * self.slots_per_seq

    def _take_slot(self) -> Optional[int]:
        if self._free:
            return self._free.popleft()
        if self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
            return slot
        return None

    def take(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            if not self.can_take(1):
                raise RuntimeError(f"no free state slot for sequence {seq.seq_id} (all {self.num_slots} in use)")
            seq.state_slot = self._take_slot()
            if self.slots_per_seq == 2:
                seq.scratch_slot = self._take_slot()

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None
        if seq.scratch_slot is not None:
            self._free.append(seq.scratch_slot)
            seq.scratch_slot = None

    # ---- snapshots ---------------------------------------------------------------------------
    def cached_prefix(self, hits: List[int], hashes: List[int]) -> int:
        """How many of the leading ``hits`` (prefix-cache block hits, ``hashes`` theirs) end at a
        snapshot: the deepest one with a snapshot bounds a hybrid model's usable prefix."""
        for k in range(len(hits), 0, -1):
            if hashes[k - 1] in self._snapshots:
                return k
        return 0

    def restore(self, seq: Sequence, block_hash: int) -> None:
        """Queue the copy of the snapshot at ``block_hash`` into the slot of ``seq`` (taken)."""
        slot = self._snapshots[block_hash]
        self._snapshots.move_to_end(block_hash)
        self.pending_copies.append((slot, seq.state_slot))

    def save(self, seq: Sequence, block_hash: int) -> bool:
        """Queue a snapshot of the slot of ``seq`` (its state after the block ``block_hash`` names)
        into a free slot, or that of the least recently used snapshot; False when every slot runs a
        sequence."""
        if block_hash in self._snapshots:
            self._snapshots.move_to_end(block_hash)
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self._snapshots[block_hash] = slot
        self.pending_copies.append((seq.state_slot, slot))
        return True

    def drop(self, block_hash: int) -> None:
        """The block manager evicted the block ``block_hash`` names: its snapshot goes too."""
        slot = self._snapshots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def take_copies(self) -> List[Tuple[int, int]]:
        """The queued copies, in order (the executor applies them before its next forward)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies
