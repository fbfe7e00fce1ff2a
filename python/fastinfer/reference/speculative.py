"""fp64 oracle of ``tree_verify`` (docs/design.md "Speculative decoding"): a readable walk per sequence.

Semantics (the executable specification):

* Node 0 is the root (the last committed token), ``parents[b, 0] = -1`` and ``parents[b, i] < i``.
  The children of a node are tried in ascending node order; the walk moves to the first accepted
  child and stops at a node where every child is rejected (or that has none).
* ``greedy``: child ``c`` is accepted when its token equals the argmax of the target logits at
  the current node (lowest token id on ties); ``next_token`` is the argmax at the last node.
* sampling, ``p = softmax(target_logits[b, node] / temperature[b])``, child ``c`` with token ``x``
  and ``u = uniforms[b, c]``:

  - without ``draft_probs`` (deterministic candidates): accept when ``u < p(x)``; on rejection
    ``p(x) <- 0`` and ``p`` is renormalised;
  - with ``draft_probs`` (children drawn without replacement from the draft distribution
    ``q = draft_probs[b, node]``): accept when ``u * q(x) < p(x)``; on rejection
    ``p <- norm(max(p - q, 0))`` and ``q <- norm(q with q(x) = 0)``. ``q`` is used as given until
    the first rejection at a node (it is a distribution). A normalisation of an all-zero vector
    leaves it zero.

  ``next_token`` is the inverse-CDF sample of the residual ``r`` (the current ``p``) at the last
  node with ``u = uniforms[b, N]``: the smallest ``t`` with ``cumsum(r)[t] > u * sum(r)`` (if
  none -- only through rounding -- the largest ``t`` with ``r[t] > 0``, or 0 if ``r`` is zero).
* Outputs (dtype of ``draft_tokens``): ``accepted_nodes [B, N]`` the path root first, -1 padded;
  ``num_accepted [B]`` the number of accepted DRAFT nodes (path length - 1, so
  ``accepted_nodes[b, :num_accepted[b] + 1]`` is the path); ``next_token [B]``.
* A draft token outside ``[0, V)`` has ``p(x) = q(x) = 0`` (the ops reject such inputs anyway).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

__all__ = ["tree_verify", "inverse_cdf"]


def inverse_cdf(r: Tensor, u: float) -> int:
    """Smallest t with cumsum(r)[t] > u * sum(r); else the largest t with r[t] > 0; else 0."""
    r = r.double()
    hits = (torch.cumsum(r, 0) > u * r.sum()).nonzero()
    if hits.numel():
        return int(hits[0])
    pos = (r > 0).nonzero()
    return int(pos[-1]) if pos.numel() else 0


def _normalise(v: Tensor) -> Tensor:
    s = v.sum()
    return v / s if s > 0 else v


def tree_verify(
    draft_tokens: Tensor,
    parents: Tensor,
    target_logits: Tensor,
    draft_probs: Optional[Tensor],
    temperature: Tensor,
    uniforms: Tensor,
    greedy: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The fp64 walk; returns ``(accepted_nodes [B, N], num_accepted [B], next_token [B])``."""
    B, N = draft_tokens.shape
    V = target_logits.shape[-1]
    accepted = torch.full((B, N), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    next_token = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        tokens = draft_tokens[b].tolist()
        par = parents[b].tolist()
        children = [[c for c in range(N) if par[c] == node] for node in range(N)]
        logits = target_logits[b].cpu().double()
        u = uniforms[b].cpu().double().tolist()
        path = [0]
        node = 0
        while True:
            row = logits[node]
            chosen = None
            if greedy:
                best = int((row == row.max()).nonzero()[0])  # lowest id on ties
                chosen = next((c for c in children[node] if tokens[c] == best), None)
                if chosen is None:
                    next_token[b] = best
            else:
                p = torch.softmax(row / float(temperature[b]), 0)
                q = draft_probs[b, node].cpu().double() if draft_probs is not None else None
                for c in children[node]:
                    x = tokens[c]
                    valid = 0 <= x < V
                    px = float(p[x]) if valid else 0.0
                    if q is not None:
                        qx = float(q[x]) if valid else 0.0
                        if u[c] * qx < px:
                            chosen = c
                            break
                        if valid:
                            p = _normalise((p - q).clamp_min(0))
                            q = q.clone()
                            q[x] = 0
                            q = _normalise(q)
                    else:
                        if u[c] < px:
                            chosen = c
                            break
                        if px > 0:
                            p = p.clone()
                            p[x] = 0
                            p = _normalise(p)
                if chosen is None:
                    next_token[b] = inverse_cdf(p, u[N])
            if chosen is None:
                break
            node = chosen
            path.append(node)
        accepted[b, : len(path)] = torch.tensor(path)
        num_accepted[b] = len(path) - 1
    dt = draft_tokens.dtype
    return accepted.to(dt), num_accepted.to(dt), next_token.to(dt)
