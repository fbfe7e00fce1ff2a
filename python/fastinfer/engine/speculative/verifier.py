"""Verification of drafts against the target's logits, and the KV slot moves that commit them.

:func:`verify` runs :func:`fastinfer.ops.tree_verify` per group of drafts of equal size and mode
and fills each draft's accepted ``path`` and ``next_token``. :func:`commit_moves` turns the paths
into data: the slot moves that compact the accepted nodes' K/V to consecutive positions (target
pool, and the draft pool for nodes the draft was fed) and the draft's new KV coverage. The
executor applies the moves; the engine core applies the rest.
"""

from __future__ import annotations

from typing import Dict, List, Sequence as Seq, Tuple

import torch

from ...layers import slot_of
from ...ops import tree_verify
from .drafter import Draft

Tensor = torch.Tensor

__all__ = ["verify", "commit_moves"]


def verify(drafts: List[Draft], logits: Tensor, gens: Seq[torch.Generator], lib=None) -> None:
    """``logits``: the target's rows of every node, draft by draft. Sets ``path`` / ``next_token``."""
    offs = [0]
    for d in drafts:
        offs.append(offs[-1] + d.num_nodes)
    groups: Dict[Tuple[int, bool, bool], List[int]] = {}
    for i, d in enumerate(drafts):
        groups.setdefault((d.num_nodes, d.seq.params.greedy, d.draft_probs is not None), []).append(i)
    dev = logits.device
    for (N, greedy, has_dp), idx in groups.items():
        rows = torch.cat([torch.arange(offs[i], offs[i] + N) for i in idx]).to(dev)
        tl = logits.index_select(0, rows).reshape(len(idx), N, -1).contiguous()
        dt = torch.tensor([drafts[i].tokens for i in idx], dtype=torch.int64).to(dev)
        pa = torch.tensor([drafts[i].parents for i in idx], dtype=torch.int64).to(dev)
        dp = torch.stack([drafts[i].draft_probs for i in idx]).to(dev).contiguous() if has_dp else None
        temp = torch.tensor([1.0 if greedy else float(drafts[i].seq.params.temperature) for i in idx],
                            dtype=torch.float32).to(dev)
        if greedy:
            u = torch.zeros(len(idx), N + 1, dtype=torch.float32, device=dev)
        else:
            u = torch.stack([torch.rand(N + 1, generator=gens[i], device=gens[i].device).to(dev) for i in idx])
        acc, num, nxt = tree_verify(dt, pa, tl, dp, temp, u, greedy, lib=lib)
        acc, num, nxt = acc.tolist(), num.tolist(), nxt.tolist()
        for r, i in enumerate(idx):
            drafts[i].path = acc[r][: num[r] + 1]
            drafts[i].next_token = int(nxt[r])


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
