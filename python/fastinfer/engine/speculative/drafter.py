"""Speculative decoding with a draft model (same tokenizer): chain and EAGLE-2-style trees.

One speculative step of a decoding sequence with committed tokens ``t_0 .. t_{n-1}`` (the target has
K/V for ``t_0 .. t_{n-2}``; ``t_{n-1}``, the *root*, is the last sampled token):

1. **Draft** (:meth:`SpecDecoder.propose`). The draft model first catches up: it computes the
   committed tokens it has no K/V for (``seq.draft_num_computed .. n-1``) and yields its
   distribution at the root. Then

   * ``chain`` (k = ``num_spec_tokens``): k tokens ``d_1 .. d_k``, each from the draft's
     distribution at the previous one (``d_i`` is fed to the draft as a decode row at position
     ``n - 1 + i``). Greedy requests take the draft's argmax; sampling requests draw from
     ``q = softmax(draft_logits / temperature)`` (the request's temperature) and the rows of ``q``
     are passed to ``tree_verify`` as ``draft_probs`` (recursive rejection sampling: exact).
   * ``tree`` (EAGLE-2): the root's ``topk`` most probable children form depth 1; for every further
     depth, the ``topk`` nodes of the current depth with the highest cumulative draft
     log-probability are *fed* to the draft (one draft forward per depth, tree attention over the
     fed nodes) and each gets its ``topk`` most probable children. Finally the ``num_spec_tokens``
     best nodes of the whole candidate tree by cumulative log-probability are kept (ties: shallower
     first, so a kept node's parent is always kept). Candidates are deterministic given the draft,
     so ``tree_verify`` runs with ``draft_probs=None`` (exact by the deterministic-candidate rule).

2. **Verify** (one target forward for all sequences): the root and the nodes are one prefill chunk
   of the sequence at slots ``n-1 .. n-2+N`` with positions ``n - 1 + depth`` and, for trees, the
   ancestor ``custom_mask``; every node row gets logits. :func:`fastinfer.ops.tree_verify` (per
   group of equal tree size and mode) returns the accepted path and the next token; uniforms are
   drawn from the request's generator (its seed), so seeded requests are reproducible.

3. **Commit** (:meth:`SpecDecoder.commit_moves`): the accepted nodes' K/V rows are moved to the
   slots of consecutive positions with ``move_kv_slots`` in the target pool and, for nodes the draft
   was fed, in the draft pool; the blocks past the new length go back to the block manager.

KV layout of the draft: its own pool (per layer ``[num_blocks, block_size, Hkv_draft, D_draft]``)
indexed by the SAME block ids as the target's (the sequence's block table), so preemption, forks and
prefix caching need no second allocator. ``BlockManager.draft_valid`` flags full blocks whose draft
K/V is complete, so a prefix-cache hit also spares the draft's recomputation. Fed draft nodes live
at positions ``n + fed_index`` (inside the slots the scheduler reserved, ``spec_span``).

Seeded requests are reproducible: the draft's draws (chain sampling) and the verification uniforms
come from the request's generator. A step in which a sequence cannot speculate (token budget or free
blocks short, see ``Scheduler.spec_span``) samples it the ordinary way, which consumes its generator
differently: under such pressure a seeded completion may depend on the load (it stays exact).

Not speculated (they decode normally, in the same step): requests with ``SamplingParams.speculative
= False``, requests using top-k / top-p / min-p / repetition penalty (the verifier reproduces the
plain temperature distribution only), requests with fewer than 2 tokens left to generate, and
sequences whose tree would not fit ``max_model_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..models.batch import ForwardBatch
from .model_runner import block_table_tensor, host_to_device
from .sequence import Sequence

Tensor = torch.Tensor

SPEC_MODES = ("chain", "tree")


@dataclass
class SpecChunk:
    """One sequence's draft: node 0 is the root (its last committed token)."""

    seq: Sequence
    tokens: List[int]
    parents: List[int]
    depths: List[int]
    mask: Optional[Tensor]  # [N, N] bool (tree) or None (chain: causal)
    draft_probs: Optional[Tensor]  # [N, V] float32 (chain sampling) or None
    fed: List[int]  # per node: index of the draft scratch slot (position n + fed) or -1
    # filled by verify
    path: List[int] = field(default_factory=list)
    next_token: int = -1

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)


def _supported(params) -> bool:
    return (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
            and params.repetition_penalty == 1.0)


class SpecDecoder:
    """Draft model, its KV pool, proposal and verification (see the module docstring)."""

    def __init__(self, draft_model, draft_kv_caches, block_size: int, device: torch.device, mode: str,
                 num_spec_tokens: int, tree_topk: int, tree_depth: Optional[int], max_model_len: int,
                 max_num_batched_tokens: int):
        self.model = draft_model
        self.kv_caches = draft_kv_caches
        self.block_size = block_size
        self.device = device
        self.mode = mode
        self.k = int(num_spec_tokens)
        self.topk = int(tree_topk)
        if tree_depth is None:
            # one draft forward per level; deeper levels rarely survive the best-N cut
            tree_depth = min(self.k, max(2, self.k // (2 * self.topk) + 1))
        self.depth = int(tree_depth)
        self.max_model_len = max_model_len
        self.max_chunk = max(1, int(max_num_batched_tokens))
        self.vocab_size = int(draft_model.config.vocab_size)
        # statistics over the engine's lifetime
        self.num_verify = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.depth_reached: List[int] = []  # [d-1]: verifications whose path reached depth d
        self.depth_offered: List[int] = []  # [d-1]: verifications whose tree had a node at depth d
        self.num_draft_forwards = 0

    # ------------------------------------------------------------------------------------------
    # planning (called by the scheduler through LLM._spec_span)
    # ------------------------------------------------------------------------------------------
    def plan(self, seq: Sequence) -> Tuple[int, int]:
        """``(size, span)``: chain length k (or tree depth) for this step and the KV slots it needs
        past the sequence's computed tokens; ``(0, 0)`` = decode normally."""
        p = seq.params
        if p.speculative is False or not _supported(p):
            return 0, 0
        left = self.max_model_len - seq.num_tokens  # tokens that may still be generated
        if p.max_tokens is not None:
            left = min(left, p.max_tokens - seq.num_output_tokens)
        size = min(self.k if self.mode == "chain" else self.depth, left - 1)
        if size < 1:
            return 0, 0
        if self.mode == "chain":
            span = size + 1
        else:
            span = max(self.k + 1, self.topk * (size - 1) + 1)
        if seq.num_computed_tokens + span > self.max_model_len:
            return 0, 0
        return size, span

    # ------------------------------------------------------------------------------------------
    # draft forwards
    # ------------------------------------------------------------------------------------------
    def _forward(self, chunks: List[Tuple[Sequence, List[int], List[int], List[int], Optional[Tensor], List[int]]],
                 decodes: List[Tuple[Sequence, int, int]]) -> Tensor:
        """One draft forward. ``chunks``: (seq, tokens, rotary positions, slot positions (logical
        positions in the block table; the chunk's keys end at the last one), mask or None, local
        rows wanting logits); ``decodes``: (seq, token, position). Logits rows: the chunks' wanted
        rows in order, then one per decode."""
        bs = self.block_size
        ids: List[int] = []
        pos: List[int] = []
        slots: List[int] = []
        want: List[int] = []
        cu = [0]
        lens_k: List[int] = []
        tables: List[List[int]] = []
        masks: List[Tensor] = []
        any_mask = any(c[4] is not None for c in chunks)
        max_q = 0
        for seq, toks, rpos, spos, mask, rows in chunks:
            base = len(ids)
            t = seq.block_table
            ids.extend(toks)
            pos.extend(rpos)
            slots.extend(t[p // bs] * bs + p % bs for p in spos)
            want.extend(base + r for r in rows)
            cu.append(len(ids))
            lens_k.append(spos[-1] + 1)
            tables.append(t)
            max_q = max(max_q, len(toks))
            if any_mask:
                masks.append(mask if mask is not None else torch.ones(len(toks), len(toks), dtype=torch.bool).tril_())
        num_prefill = len(ids)
        d_lens: List[int] = []
        d_tables: List[List[int]] = []
        for seq, tok, p in decodes:
            t = seq.block_table
            want.append(len(ids))
            ids.append(tok)
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
            d_lens.append(p + 1)
            d_tables.append(t)
        dev = self.device
        batch = ForwardBatch(
            input_ids=host_to_device(ids, torch.int64, dev),
            positions=host_to_device(pos, torch.int64, dev),
            slot_mapping=host_to_device(slots, torch.int64, dev),
            num_prefill_tokens=num_prefill,
            prefill_cu_seqlens_q=host_to_device(cu, torch.int32, dev) if chunks else None,
            prefill_seq_lens_k=host_to_device(lens_k, torch.int32, dev) if chunks else None,
            prefill_block_table=block_table_tensor(tables, dev) if chunks else None,
            prefill_max_seqlen_q=max_q,
            decode_seq_lens=host_to_device(d_lens, torch.int32, dev) if decodes else None,
            decode_block_table=block_table_tensor(d_tables, dev) if decodes else None,
            logits_indices=host_to_device(want, torch.int64, dev),
            custom_mask=torch.cat([m.reshape(-1) for m in masks]).to(dev) if any_mask else None,
        )
        self.num_draft_forwards += 1
        return self.model(batch, self.kv_caches)

    def _catch_up(self, seqs: List[Sequence]) -> Tensor:
        """The draft computes every committed token it lacks; returns its logits at each root."""
        while True:
            lag = [s.num_tokens - s.draft_num_computed for s in seqs]
            if sum(lag) <= self.max_chunk:
                break
            # long catch-up (e.g. right after a long prompt): leading pieces without logits first
            budget = self.max_chunk
            chunks = []
            for s, n in zip(seqs, lag):
                take = min(n - 1, budget)
                if take <= 0:
                    continue
                c = s.draft_num_computed
                chunks.append((s, s.token_ids[c:c + take], list(range(c, c + take)), list(range(c, c + take)), None, []))
                budget -= take
                if budget <= 0:
                    break
            if not chunks:
                break
            self._forward(chunks, [])
            for s, toks, *_ in chunks:
                s.draft_num_computed += len(toks)
        chunks = []
        decodes = []
        order = []
        for s in seqs:
            c, n = s.draft_num_computed, s.num_tokens
            if n - c == 1:
                decodes.append((s, s.token_ids[n - 1], n - 1))
            else:
                chunks.append((s, s.token_ids[c:n], list(range(c, n)), list(range(c, n)), None, [n - c - 1]))
            order.append(s)
        logits = self._forward(chunks, decodes)
        rows = {id(ch[0]): i for i, ch in enumerate(chunks)}
        rows.update({id(d[0]): len(chunks) + i for i, d in enumerate(decodes)})
        for s in seqs:
            s.draft_num_computed = s.num_tokens
        return logits[torch.tensor([rows[id(s)] for s in seqs], device=logits.device)]

    # ------------------------------------------------------------------------------------------
    def propose(self, items: List[Tuple[Sequence, int]], gens: List[torch.Generator]) -> List[SpecChunk]:
        """Draft for every ``(sequence, size)`` (size from :meth:`plan`); ``gens``: the generator of
        each sequence (draws of chain sampling)."""
        seqs = [s for s, _ in items]
        with torch.inference_mode():
            root_logits = self._catch_up(seqs)
            if self.mode == "chain":
                return self._propose_chain(items, gens, root_logits)
            return self._propose_tree(items, root_logits)

    def _propose_chain(self, items, gens, root_logits: Tensor) -> List[SpecChunk]:
        B = len(items)
        V = root_logits.shape[-1]
        sizes = [k for _, k in items]
        toks: List[List[int]] = [[s.token_ids[-1]] for s, _ in items]
        probs: List[List[Tensor]] = [[] for _ in items]
        logits = root_logits.float()
        active = list(range(B))
        for i in range(max(sizes)):
            # draw d_{i+1} for every sequence still drafting, from its row of `logits`
            rows_tok: List[int] = []
            for r, b in enumerate(active):
                s = items[b][0]
                if s.params.greedy:
                    rows_tok.append(-1)
                    continue
                q = torch.softmax(logits[r] / float(s.params.temperature), dim=-1)
                probs[b].append(q)
                c = torch.cumsum(q, 0)
                u = torch.rand((), generator=gens[b], device=gens[b].device).to(c.device)
                t = int(torch.searchsorted(c, (u * c[-1]).reshape(1), right=True).clamp_(max=V - 1))
                rows_tok.append(t)
            greedy_rows = [r for r, t in enumerate(rows_tok) if t < 0]
            if greedy_rows:
                am = logits[greedy_rows].argmax(dim=-1).tolist()
                for r, t in zip(greedy_rows, am):
                    rows_tok[r] = t
            for r, b in enumerate(active):
                toks[b].append(rows_tok[r])
            active = [b for b in active if len(toks[b]) - 1 < sizes[b]]
            if not active:
                break
            # feed d_{i+1} (position n - 1 + (i + 1)) to get the next distribution
            decodes = []
            for b in active:
                s = items[b][0]
                decodes.append((s, toks[b][-1], s.num_tokens - 1 + len(toks[b]) - 1))
            logits = self._forward([], decodes).float()
        out = []
        for b, (s, k) in enumerate(items):
            n_nodes = k + 1
            dp = None
            if not s.params.greedy:
                dp = torch.stack(probs[b] + [torch.zeros(V, dtype=torch.float32, device=root_logits.device)])
            out.append(SpecChunk(s, toks[b], [-1] + list(range(n_nodes - 1)), list(range(n_nodes)), None, dp,
                                 [-1] + list(range(k - 1)) + [-1]))
        return out

    def _propose_tree(self, items, root_logits: Tensor) -> List[SpecChunk]:
        K = self.topk
        B = len(items)
        # per sequence candidate lists; node 0 = root
        tok = [[s.token_ids[-1]] for s, _ in items]
        par = [[-1] for _ in items]
        dep = [[0] for _ in items]
        score = [[0.0] for _ in items]
        fed = [[-1] for _ in items]
        fed_nodes: List[List[int]] = [[] for _ in items]  # candidate index per fed slot

        def expand(b: int, node: int, vals: List[float], idx: List[int]) -> None:
            for v, t in zip(vals, idx):
                tok[b].append(t)
                par[b].append(node)
                dep[b].append(dep[b][node] + 1)
                score[b].append(score[b][node] + min(v, 0.0))
                fed[b].append(-1)

        lp = torch.log_softmax(root_logits.float(), dim=-1)
        v, i = lp.topk(min(K, lp.shape[-1]), dim=-1)
        v, i = v.tolist(), i.tolist()
        for b in range(B):
            expand(b, 0, v[b], i[b])
        for d in range(1, max(k for _, k in items)):
            chunks = []
            frontier_of: List[Tuple[int, int]] = []  # (b, node) per logits row
            for b, (s, depth) in enumerate(items):
                if d >= depth:
                    continue
                layer = [j for j in range(len(tok[b])) if dep[b][j] == d]
                layer.sort(key=lambda j: (-score[b][j], j))
                for j in layer[:K]:
                    fed[b][j] = len(fed_nodes[b])
                    fed_nodes[b].append(j)
                    frontier_of.append((b, j))
                F = len(fed_nodes[b])
                n = s.num_tokens
                nodes = fed_nodes[b]
                mask = torch.zeros(F, F, dtype=torch.bool)
                for a, j in enumerate(nodes):
                    x = j
                    while x > 0:
                        mask[a, fed[b][x]] = True
                        x = par[b][x]
                new = [a for a, j in enumerate(nodes) if dep[b][j] == d]
                chunks.append((s, [tok[b][j] for j in nodes], [n - 1 + dep[b][j] for j in nodes],
                               list(range(n, n + F)), mask, new))
            if not chunks:
                break
            logits = self._forward(chunks, [])
            lp = torch.log_softmax(logits.float(), dim=-1)
            v, i = lp.topk(min(K, lp.shape[-1]), dim=-1)
            v, i = v.tolist(), i.tolist()
            for r, (b, j) in enumerate(frontier_of):
                expand(b, j, v[r], i[r])
        out = []
        for b, (s, _) in enumerate(items):
            cand = sorted(range(1, len(tok[b])), key=lambda j: (-score[b][j], dep[b][j], j))[: self.k]
            keep = sorted(cand, key=lambda j: (dep[b][j], -score[b][j], j))
            new_idx = {0: 0}
            for a, j in enumerate(keep, 1):
                new_idx[j] = a
            nodes = [0] + keep
            parents = [-1] + [new_idx[par[b][j]] for j in keep]
            depths = [dep[b][j] for j in nodes]
            N = len(nodes)
            mask = torch.zeros(N, N, dtype=torch.bool)
            for a in range(N):
                x = a
                while x >= 0:
                    mask[a, x] = True
                    x = parents[x]
            out.append(SpecChunk(s, [tok[b][j] for j in nodes], parents, depths, mask, None,
                                 [fed[b][j] for j in nodes]))
        return out

    # ------------------------------------------------------------------------------------------
    def verify(self, chunks: List[SpecChunk], logits: Tensor, gens: List[torch.Generator]) -> None:
        """``logits``: the target's rows of every node, chunk by chunk. Sets ``path``/``next_token``."""
        offs = [0]
        for ch in chunks:
            offs.append(offs[-1] + ch.num_nodes)
        groups: Dict[Tuple[int, bool, bool], List[int]] = {}
        for i, ch in enumerate(chunks):
            groups.setdefault((ch.num_nodes, ch.seq.params.greedy, ch.draft_probs is not None), []).append(i)
        from ..ops import tree_verify

        dev = logits.device
        for (N, greedy, has_dp), idx in groups.items():
            rows = torch.cat([torch.arange(offs[i], offs[i] + N) for i in idx]).to(dev)
            tl = logits.index_select(0, rows).reshape(len(idx), N, -1).contiguous()
            dt = torch.tensor([chunks[i].tokens for i in idx], dtype=torch.int64).to(dev)
            pa = torch.tensor([chunks[i].parents for i in idx], dtype=torch.int64).to(dev)
            dp = torch.stack([chunks[i].draft_probs for i in idx]).to(dev).contiguous() if has_dp else None
            temp = torch.tensor([1.0 if greedy else float(chunks[i].seq.params.temperature) for i in idx],
                                dtype=torch.float32).to(dev)
            if greedy:
                u = torch.zeros(len(idx), N + 1, dtype=torch.float32, device=dev)
            else:
                u = torch.stack([torch.rand(N + 1, generator=gens[i], device=gens[i].device).to(dev)
                                 for i in idx])
            acc, num, nxt = tree_verify(dt, pa, tl, dp, temp, u, greedy)
            acc, num, nxt = acc.tolist(), num.tolist(), nxt.tolist()
            for r, i in enumerate(idx):
                chunks[i].path = acc[r][: num[r] + 1]
                chunks[i].next_token = int(nxt[r])

    def record(self, ch: SpecChunk) -> None:
        """Statistics of one verified chunk."""
        m = len(ch.path) - 1
        max_depth = max(ch.depths)
        while len(self.depth_offered) < max_depth:
            self.depth_offered.append(0)
            self.depth_reached.append(0)
        for d in range(max_depth):
            self.depth_offered[d] += 1
            if m > d:
                self.depth_reached[d] += 1
        self.num_verify += 1
        self.num_draft_tokens += ch.num_nodes - 1
        self.num_accepted += m
        s = ch.seq
        s.spec_num_verify += 1
        s.spec_num_draft += ch.num_nodes - 1
        s.spec_num_accepted += m

    def commit_moves(self, chunks: List[SpecChunk]) -> Tuple[List[int], List[int], List[int], List[int]]:
        """Slot moves (target src, dst, draft src, dst) that compact the accepted nodes to the slots
        of consecutive positions; updates ``draft_num_computed`` (call before num_computed_tokens
        changes)."""
        bs = self.block_size
        ts, td, ds, dd = [], [], [], []
        for ch in chunks:
            s = ch.seq
            t = s.block_table
            start = s.num_computed_tokens  # the root's position, n - 1
            n = start + 1

            def slot(p: int) -> int:
                return t[p // bs] * bs + p % bs

            lead_fed = 0
            for j, a in enumerate(ch.path[1:], 1):
                if a != j:
                    ts.append(slot(start + a))
                    td.append(slot(start + j))
                if lead_fed == j - 1 and ch.fed[a] >= 0:
                    lead_fed = j
                    if n + ch.fed[a] != start + j:
                        ds.append(slot(n + ch.fed[a]))
                        dd.append(slot(start + j))
            s.draft_num_computed = min(s.draft_num_computed, n) + lead_fed
        return ts, td, ds, dd

    def stats(self) -> Dict[str, object]:
        """Lifetime counters. ``spec_mean_accepted_length``: accepted draft tokens per verification
        (each verification also emits one more token: ``spec_mean_tokens_per_verify``);
        ``spec_acceptance_rate_per_depth[d - 1]``: among verifications whose tree had a node at
        depth d, the fraction whose accepted path reached depth d."""
        nv = max(self.num_verify, 1)
        return {
            "spec_num_verify": self.num_verify,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted,
            "spec_mean_accepted_length": self.num_accepted / nv,  # accepted draft tokens per verification
            "spec_mean_tokens_per_verify": (self.num_accepted + self.num_verify) / nv,  # + the bonus/residual
            "spec_draft_acceptance_rate": self.num_accepted / max(self.num_draft_tokens, 1),
            "spec_acceptance_rate_per_depth": [r / o if o else 0.0 for r, o in zip(self.depth_reached, self.depth_offered)],
            "spec_num_draft_forwards": self.num_draft_forwards,
        }


def move_slots(kv_caches, src: List[int], dst: List[int], device) -> None:
    """``move_kv_slots`` on every layer of one pool (no-op without moves)."""
    if not src:
        return
    s = torch.tensor(src, dtype=torch.int64).to(device)
    d = torch.tensor(dst, dtype=torch.int64).to(device)
    ns = "fastinfer"
    for k, v in kv_caches:
        getattr(torch.ops, ns).move_kv_slots(k, v, s, d)
