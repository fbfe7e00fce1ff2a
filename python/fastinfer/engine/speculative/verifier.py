"""Verification of drafts against the target's logits, and the KV slot moves that commit them.

:func:`verify` runs :func:`fastinfer.ops.tree_verify` per group of drafts of equal size and mode
and fills each draft's accepted ``path`` and ``next_token``. :func:`commit_moves` turns the paths
into data: the slot moves that compact the accepted nodes' K/V to consecutive positions (target
pool, and the draft pool for nodes the draft was fed) and the draft's new KV coverage. The
executor applies the moves; the engine core applies the rest.

Deterministic mode (``verify(..., ops=backend(..., deterministic=True))``), for seeded sampling:
every node's row is turned into the race scores plain decoding would draw the next position's token from
(:func:`~fastinfer.engine.sampler.race_scores` with that position's
:func:`~fastinfer.engine.sampler.position_noise`), and the tree is verified greedily on them: a
child is accepted when it is the token plain decoding would draw there, and ``next_token`` is that
draw at the last accepted node. Exact (every emitted token is the target's own draw) and the same
tokens as without speculation, given the same logits; it ignores draft probabilities, so a chain
draft may accept fewer tokens than with rejection sampling.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch

from ...layers import slot_of
from ...ops import Backend, backend
from ..sampler import position_noise, race_scores
from .drafter import Draft

Tensor = torch.Tensor

__all__ = ["verify", "commit_moves"]


def verify(drafts: List[Draft], logits: Tensor, gens: Seq[torch.Generator], ops: Optional[Backend] = None) -> None:
    """``logits``: the target's rows of every node, draft by draft; ``gens``: each draft's generator
    (deterministic mode: seeded ones give their seed); ``ops``: the engine's op backend (its
    ``tree_verify`` and its mode; default: the compiled ops, default mode). Sets ``path`` /
    ``next_token``."""
    ops = backend() if ops is None else ops
    deterministic = ops.deterministic
    offs = [0]
    for d in drafts:
        offs.append(offs[-1] + d.num_nodes)
    groups: Dict[Tuple[int, bool, bool, bool], List[int]] = {}
    for i, d in enumerate(drafts):
        p = d.seq.params
        race = deterministic and not p.greedy and p.seed is not None  # verified on position draws
        groups.setdefault((d.num_nodes, p.greedy, d.draft_probs is not None and not race, race), []).append(i)
    dev = logits.device
    for (N, greedy, has_dp, race), idx in groups.items():
        rows = torch.cat([torch.arange(offs[i], offs[i] + N) for i in idx]).to(dev)
        tl = logits.index_select(0, rows).reshape(len(idx), N, -1).contiguous()
        dt = torch.tensor([drafts[i].tokens for i in idx], dtype=torch.int64).to(dev)
        pa = torch.tensor([drafts[i].parents for i in idx], dtype=torch.int64).to(dev)
        dp = torch.stack([drafts[i].draft_probs for i in idx]).to(dev).contiguous() if has_dp else None
        temp = torch.tensor([1.0 if greedy else float(drafts[i].seq.params.temperature) for i in idx],
                            dtype=torch.float32).to(dev)
        if race:
            tl = _position_race_scores([drafts[i] for i in idx], tl, temp, [gens[i] for i in idx])
            greedy = True
        if greedy:
            u = torch.zeros(len(idx), N + 1, dtype=torch.float32, device=dev)
        else:
            u = torch.stack([torch.rand(N + 1, generator=gens[i], device=gens[i].device).to(dev) for i in idx])
        acc, num, nxt = ops.tree_verify(dt, pa, tl, dp, temp, u, greedy)
        acc, num, nxt = acc.tolist(), num.tolist(), nxt.tolist()
        for r, i in enumerate(idx):
            drafts[i].path = acc[r][: num[r] + 1]
            drafts[i].next_token = int(nxt[r])


def _position_race_scores(drafts: List[Draft], logits: Tensor, temp: Tensor, gens: Seq[torch.Generator]) -> Tensor:
    """``[G, N, V]`` race scores: node j of a draft rooted at position ``start`` predicts position
    ``start + 1 + depth(j)``, drawn with that position's noise, exactly as the sampler would."""
    G, N, V = logits.shape
    dev = logits.device
    noise = torch.empty(G, N, V, dtype=torch.float32, device=dev)
    for g, (d, gen) in enumerate(zip(drafts, gens)):
        start = d.seq.num_computed_tokens
        by_depth = {}
        for j, depth in enumerate(d.depths):
            if depth not in by_depth:
                by_depth[depth] = position_noise(gen.initial_seed(), start + 1 + depth, V, dev)
            noise[g, j] = by_depth[depth]
    return race_scores(logits.float() / temp[:, None, None], noise)


def commit_moves(drafts: List[Draft], block_size: int) -> Tuple[List[int], List[int], List[int], List[int], List[int]]:
    """``(target src, dst, draft src, dst, draft_computed per draft)``: the slot moves that put the
    accepted nodes at the slots of consecutive positions, and how many leading tokens have draft K/V
    afterwards (the committed ones plus the accepted nodes the draft was fed, in a row)."""
    ts: List[int] = []
    td: List[int] = []
    ds: List[int] = []
    dd: List[int] = []
    computed: List[int] = []
    for d in drafts:
        table = d.seq.block_table
        start = d.seq.num_computed_tokens  # the root's position, n - 1
        n = start + 1
        lead_fed = 0
        for j, a in enumerate(d.path[1:], 1):
            if a != j:
                ts.append(slot_of(table, start + a, block_size))
                td.append(slot_of(table, start + j, block_size))
            if lead_fed == j - 1 and d.fed[a] >= 0:
                lead_fed = j
                if n + d.fed[a] != start + j:
                    ds.append(slot_of(table, n + d.fed[a], block_size))
                    dd.append(slot_of(table, start + j, block_size))
        computed.append(min(d.draft_computed, n) + lead_fed)
    return ts, td, ds, dd, computed
