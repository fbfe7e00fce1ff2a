"""The executor's half of speculation: the draft model, its KV pool and its forwards.

:meth:`DraftModelDrafter.propose` catches the draft up on the committed tokens it lacks, then drafts
a chain or a tree per sequence (see :mod:`fastinfer.engine.speculative`). It reads the engine's
sequences (token ids, block tables) and never changes them; what changed in the draft's KV comes
back in each :class:`Draft` (``draft_computed``), for the core's proposer to keep.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch

from ...layers import BatchBuilder, host_to_device
from ..sampler import position_noise, race_scores
from ..sequence import Sequence
from .trees import Path, tree_mask

Tensor = torch.Tensor

__all__ = ["Draft", "Drafter", "DraftModelDrafter"]


@dataclass
class Draft:
    """One sequence's draft: node 0 is the root (its last committed token)."""

    seq: Sequence
    tokens: List[int]
    parents: List[int]
    depths: List[int]
    mask: Optional[Tensor]  # [N, N] bool (tree) or None (chain: causal)
    draft_probs: Optional[Tensor]  # [N, V] float32 (chain sampling) or None
    fed: List[int]  # per node: index of the draft scratch slot (position n + fed) or -1
    draft_computed: int  # leading committed tokens with draft K/V after the catch-up
    # filled by the verifier
    path: List[int] = field(default_factory=list)
    next_token: int = -1

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)


# one chunk of a draft forward: (seq, tokens, rotary positions, cache positions (the chunk's keys
# end at the last one), mask or None, chunk-local rows that want logits)
_Chunk = Tuple[Sequence, List[int], List[int], List[int], Optional[Tensor], List[int]]


class Drafter:
    """The executor-side proposer interface (a draft model, or draft heads on the target's hidden states)."""

    #: ask the executor for the target's final hidden states: True: of every logits row of each
    #: step (:meth:`observe_hidden_states`); "all": of every row (:meth:`observe_slot_hidden_states`)
    wants_hidden_states: object = False
    #: with ``wants_hidden_states``: hand over the inputs of these target layers, concatenated
    #: (:meth:`~fastinfer.models.llama.LlamaForCausalLM.aux_hidden_states`), not the final states
    hidden_layers: Tuple[int, ...] = ()
    #: the static tree of draft heads (Medusa), which the core's proposer plans with; None: the
    #: drafter builds its trees step by step
    paths: Optional[List[Path]] = None

    def propose(self, items: Seq[Tuple[Sequence, int, int]], gens: Seq[torch.Generator]) -> List[Draft]:
        raise NotImplementedError

    def move_slots(self, src: List[int], dst: List[int]) -> None:
        """Compact the drafter's own KV after verification (the moves of :func:`.verifier.commit_moves`)."""

    def observe_hidden_states(self, seqs: List[Sequence], hidden: Tensor) -> None:
        """With ``wants_hidden_states``: the target's hidden states ``[rows, H]`` of this step's
        logits rows (``seqs[i]`` owns row i: sampled sequences, then every node of each draft)."""

    def observe_slot_hidden_states(self, slots: List[int], hidden: Tensor) -> None:
        """With ``wants_hidden_states="all"``: the hidden state ``[rows, H]`` of every row of the
        step's target forward, by the KV slot each row was computed at."""

    def on_verified(self, drafts: List[Draft]) -> None:
        """After :func:`.verifier.verify` filled each draft's ``path`` (before the KV moves)."""

    def forget(self, seq_ids: Seq[int]) -> None:
        """These sequences are finished: drop what is kept for them."""


class DraftModelDrafter(Drafter):
    """A draft model with its own KV pool (same block ids as the target's)."""

    #: where a drafted token's row sits relative to its position (EAGLE: one row earlier)
    position_shift = 0

    def __init__(self, model, kv_caches, block_size: int, device: torch.device, mode: str, num_tokens: int,
                 tree_topk: int, max_num_batched_tokens: int, ops):
        self.model = model
        # the mode of the config's backend ``ops``: in the deterministic mode a seeded chain draws its
        # tokens with the verifier's position noise (coupled draws: a draft token is accepted
        # whenever the draft's draw equals the target's)
        self.deterministic = ops.deterministic
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.mode = mode
        self.k = int(num_tokens)
        self.topk = int(tree_topk)
        self.max_chunk = max(1, int(max_num_batched_tokens))
        self.num_draft_forwards = 0

    # ------------------------------------------------------------------------------------------
    def _forward(self, chunks: List[_Chunk], decodes: List[Tuple[Sequence, int, int]]) -> Tensor:
        """One draft forward; logits rows: the chunks' wanted rows in order, then one per decode
        ``(seq, token, position)``."""
        b = BatchBuilder(self.block_size, self.device)
        for seq, toks, rpos, spos, mask, rows in chunks:
            b.prefill(toks, spos[0], seq.block_table, positions=rpos, slot_positions=spos, mask=mask, logits=rows)
        for seq, tok, p in decodes:
            b.decode(tok, p, seq.block_table)
        self.num_draft_forwards += 1
        return self.model(b.build(), self.kv_caches)

    def _catch_up(self, seqs: List[Sequence], computed: List[int]) -> Tensor:
        """The draft computes every committed token it lacks; returns its logits at each root."""
        computed = list(computed)
        while sum(s.num_tokens - c for s, c in zip(seqs, computed)) > self.max_chunk:
            # long catch-up (e.g. right after a long prompt): leading pieces without logits first
            budget = self.max_chunk
            chunks: List[_Chunk] = []
            for i, s in enumerate(seqs):
                take = min(s.num_tokens - computed[i] - 1, budget)
                if take <= 0:
                    continue
                c = computed[i]
                chunks.append((s, s.token_ids[c:c + take], list(range(c, c + take)), list(range(c, c + take)),
                               None, []))
                computed[i] += take
                budget -= take
                if budget <= 0:
                    break
            if not chunks:
                break
            self._forward(chunks, [])
        chunks, decodes = [], []
        for s, c in zip(seqs, computed):
            n = s.num_tokens
            if n - c == 1:
                decodes.append((s, s.token_ids[n - 1], n - 1))
            else:
                chunks.append((s, s.token_ids[c:n], list(range(c, n)), list(range(c, n)), None, [n - c - 1]))
        logits = self._forward(chunks, decodes)
        rows = {id(ch[0]): i for i, ch in enumerate(chunks)}
        rows.update({id(d[0]): len(chunks) + i for i, d in enumerate(decodes)})
        return logits[torch.tensor([rows[id(s)] for s in seqs], device=logits.device)]

    # ------------------------------------------------------------------------------------------
    def propose(self, items: Seq[Tuple[Sequence, int, int]], gens: Seq[torch.Generator]) -> List[Draft]:
        """Draft for every ``(sequence, size, draft_computed)`` (size: chain length / tree depth of
        the plan); ``gens``: the generator of each sequence (draws of chain sampling)."""
        seqs = [s for s, _, _ in items]
        with torch.inference_mode():
            root_logits = self._catch_up(seqs, [c for _, _, c in items])
            sizes = [k for _, k, _ in items]
            if self.mode == "chain":
                return self._propose_chain(seqs, sizes, gens, root_logits)
            return self._propose_tree(seqs, sizes, root_logits)

    def _propose_chain(self, seqs: List[Sequence], sizes: List[int], gens, root_logits: Tensor) -> List[Draft]:
        V = root_logits.shape[-1]
        toks: List[List[int]] = [[s.token_ids[-1]] for s in seqs]
        probs: List[List[Tensor]] = [[] for _ in seqs]
        logits = root_logits.float()
        active = list(range(len(seqs)))
        for _ in range(max(sizes)):
            # draw d_{i+1} for every sequence still drafting, from its row of `logits`: greedy rows by
            # one argmax, sampled rows by one softmax / cumsum / searchsorted (a draw of each row's
            # generator), seeded rows of the deterministic mode with their position's noise
            row_tok: List[int] = [-1] * len(active)
            greedy_rows, sampled_rows = [], []
            for r, b in enumerate(active):
                s = seqs[b]
                if s.params.greedy:
                    greedy_rows.append(r)
                elif self.deterministic and s.params.seed is not None:
                    position = s.num_tokens - 1 + len(toks[b])
                    noise = position_noise(gens[b].initial_seed(), position, V, logits.device)
                    row_tok[r] = int(race_scores(logits[r] / float(s.params.temperature), noise).argmax())
                    probs[b].append(torch.zeros(V, dtype=torch.float32, device=logits.device))  # unused then
                else:
                    sampled_rows.append(r)
            if greedy_rows:
                for r, t in zip(greedy_rows, logits[greedy_rows].argmax(dim=-1).tolist()):
                    row_tok[r] = t
            if sampled_rows:
                temp = torch.tensor([float(seqs[active[r]].params.temperature) for r in sampled_rows],
                                    dtype=torch.float32, device=logits.device)
                q = torch.softmax(logits[sampled_rows] / temp[:, None], dim=-1)
                c = torch.cumsum(q, -1)
                u = torch.stack([torch.rand((), generator=gens[active[r]], device=gens[active[r]].device).to(c.device)
                                 for r in sampled_rows])
                drawn = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True).clamp_(max=V - 1)
                for k, (r, t) in enumerate(zip(sampled_rows, drawn[:, 0].tolist())):
                    row_tok[r] = t
                    probs[active[r]].append(q[k])
            for r, b in enumerate(active):
                toks[b].append(row_tok[r])
            active = [b for b in active if len(toks[b]) - 1 < sizes[b]]
            if not active:
                break
            # feed d_{i+1} (position n - 1 + (i + 1)) to get the next distribution
            sh = self.position_shift
            logits = self._forward([], [(seqs[b], toks[b][-1], seqs[b].num_tokens - 2 + len(toks[b]) + sh)
                                        for b in active]).float()
        out = []
        for b, (s, k) in enumerate(zip(seqs, sizes)):
            dp = None
            if not s.params.greedy:
                dp = torch.stack(probs[b] + [torch.zeros(V, dtype=torch.float32, device=root_logits.device)])
            out.append(Draft(s, toks[b], [-1] + list(range(k)), list(range(k + 1)), None, dp,
                             [-1] + list(range(k - 1)) + [-1], s.num_tokens))
        return out

    def _propose_tree(self, seqs: List[Sequence], depths: List[int], root_logits: Tensor) -> List[Draft]:
        K = self.topk
        B = len(seqs)
        # per sequence candidate lists; node 0 = root
        tok = [[s.token_ids[-1]] for s in seqs]
        par = [[-1] for _ in seqs]
        dep = [[0] for _ in seqs]
        score = [[0.0] for _ in seqs]
        fed = [[-1] for _ in seqs]
        fed_nodes: List[List[int]] = [[] for _ in seqs]  # candidate index per fed slot

        def expand(b: int, node: int, vals: List[float], idx: List[int]) -> None:
            for v, t in zip(vals, idx):
                tok[b].append(t)
                par[b].append(node)
                dep[b].append(dep[b][node] + 1)
                score[b].append(score[b][node] + min(v, 0.0))
                fed[b].append(-1)

        def top(logits: Tensor) -> Tuple[List[List[float]], List[List[int]]]:
            lp = torch.log_softmax(logits.float(), dim=-1)
            v, i = lp.topk(min(K, lp.shape[-1]), dim=-1)
            return v.tolist(), i.tolist()

        v, i = top(root_logits)
        for b in range(B):
            expand(b, 0, v[b], i[b])
        for d in range(1, max(depths)):
            chunks: List[_Chunk] = []
            frontier: List[Tuple[int, int]] = []  # (b, node) per logits row
            for b, s in enumerate(seqs):
                if d >= depths[b]:
                    continue
                layer = sorted((j for j in range(len(tok[b])) if dep[b][j] == d), key=lambda j: (-score[b][j], j))
                for j in layer[:K]:
                    fed[b][j] = len(fed_nodes[b])
                    fed_nodes[b].append(j)
                    frontier.append((b, j))
                nodes = fed_nodes[b]
                # fed node a sees the fed slots of its ancestors (not the root: a committed token);
                # a virtual root 0 makes the fed forest a tree for tree_mask
                mask = torch.tensor(tree_mask([-1] + [fed[b][par[b][j]] + 1 for j in nodes]))[1:, 1:]
                n = s.num_tokens + self.position_shift
                new = [a for a, j in enumerate(nodes) if dep[b][j] == d]
                chunks.append((s, [tok[b][j] for j in nodes], [n - 1 + dep[b][j] for j in nodes],
                               list(range(n, n + len(nodes))), mask, new))
            if not chunks:
                break
            v, i = top(self._forward(chunks, []))
            for r, (b, j) in enumerate(frontier):
                expand(b, j, v[r], i[r])
        out = []
        for b, s in enumerate(seqs):
            cand = sorted(range(1, len(tok[b])), key=lambda j: (-score[b][j], dep[b][j], j))[: self.k]
            keep = sorted(cand, key=lambda j: (dep[b][j], -score[b][j], j))
            new_idx = {0: 0}
            for a, j in enumerate(keep, 1):
                new_idx[j] = a
            nodes = [0] + keep
            parents = [-1] + [new_idx[par[b][j]] for j in keep]
            out.append(Draft(s, [tok[b][j] for j in nodes], parents, [dep[b][j] for j in nodes],
                             torch.tensor(tree_mask(parents)), None, [fed[b][j] for j in nodes], s.num_tokens))
        return out

    # ------------------------------------------------------------------------------------------
    def move_slots(self, src: List[int], dst: List[int]) -> None:
        """``move_kv_slots`` on every layer of the draft pool (no-op without moves)."""
        move_slots(self.model.ops, self.kv_caches, src, dst, self.device)


def move_slots(ops, kv_caches, src: List[int], dst: List[int], device) -> None:
    """``move_kv_slots`` on every layer of one pool (no-op without moves). A layer whose cache is one
    tensor, ``(latents, None)`` (multi-head latent attention), moves its token rows with an indexed
    copy, every source read before any write as ``move_kv_slots`` does."""
    if not src:
        return
    s = host_to_device(src, torch.int64, device)
    d = host_to_device(dst, torch.int64, device)
    for k, v in kv_caches:
        if v is None:
            rows = k.view(-1, k.shape[-1])
            rows.index_copy_(0, d, rows.index_select(0, s))
        else:
            ops.move_kv_slots(k, v, s, d)


def read_head_weights(path: str, names: Seq[str] = ("model.safetensors",)) -> Tuple[str, Dict[str, torch.Tensor]]:
    """The first of the safetensors files `names` in a speculative head's directory: (its path, its
    tensors). Never a pickle: when only .pt / .bin / .pth files are there the error names them."""
    for name in names:
        wfile = os.path.join(path, name)
        if os.path.isfile(wfile):
            from safetensors.torch import load_file

            return wfile, load_file(wfile)
    pickles = sorted(f for f in os.listdir(path) if f.endswith((".pt", ".bin", ".pth")))
    hint = f" (only pickles: {', '.join(pickles)}; convert them to safetensors)" if pickles else ""
    raise ValueError(f"no {' or '.join(names)} in {path!r}{hint}")
