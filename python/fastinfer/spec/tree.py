"""Token-tree helpers for tree attention and verification.

A draft tree of ``N`` nodes is given by ``parents``: node 0 is the root (the last committed token,
``parents[0] = -1``) and every other node's parent has a smaller index (``0 <= parents[i] < i``,
topological order; the layout :func:`fastinfer.ops.tree_verify` expects). For tree attention the
``N`` nodes are the last ``N`` tokens of the sequence in the KV cache; node ``i`` must see its
ancestors and itself (:func:`tree_mask`, the ``custom_mask`` of ``paged_prefill_attention``) and sits
at position ``start + depth(i)`` (:func:`tree_positions`, for rotary embeddings).

All functions accept a list, a 1-D tensor ``[N]`` or a batch ``[B, N]`` of trees of equal size.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

Tensor = torch.Tensor
Parents = Union[Sequence[int], Tensor]

__all__ = ["validate_parents", "tree_depths", "tree_mask", "tree_positions", "flatten_tree_masks"]


def _as_tensor(parents: Parents) -> Tensor:
    t = parents if isinstance(parents, Tensor) else torch.tensor(list(parents))
    if t.dim() not in (1, 2) or t.shape[-1] < 1:
        raise ValueError(f"parents must have shape [N] or [B, N] with N >= 1, got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must be an integer tensor (int32/int64), got {t.dtype}")
    return t.to(torch.int64)


def validate_parents(parents: Parents) -> None:
    """Raise ``ValueError`` unless parents[..., 0] == -1 and 0 <= parents[..., i] < i for i >= 1."""
    p = _as_tensor(parents).cpu()
    if not bool((p[..., 0] == -1).all()):
        raise ValueError("parents[..., 0] must be -1 (node 0 is the root)")
    n = p.shape[-1]
    idx = torch.arange(n)
    bad = ((p < 0) | (p >= idx)) & (idx > 0)
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"parents{list(where)} = {int(p[where])} must be in [0, {where[-1]}): nodes must be in "
                         "topological order (parent index < child index) forming a tree rooted at node 0")


def tree_depths(parents: Parents) -> Tensor:
    """int64 depth of every node (the root has depth 0), shape of ``parents``."""
    p = _as_tensor(parents)
    validate_parents(p)
    depth = torch.zeros_like(p)
    for i in range(1, p.shape[-1]):  # parents precede children: one pass
        depth[..., i] = depth.gather(-1, p[..., i : i + 1]).squeeze(-1) + 1
    return depth


def tree_positions(parents: Parents, start: Union[int, Tensor] = 0) -> Tensor:
    """Positions ``start + depth`` (``start``: the root's absolute position, an int or ``[B]``)."""
    d = tree_depths(parents)
    if isinstance(start, Tensor) and d.dim() == 2:
        start = start.to(d.device, torch.int64).unsqueeze(-1)
    return d + start


def tree_mask(parents: Parents) -> Tensor:
    """Bool ``[N, N]`` (or ``[B, N, N]``): ``mask[i, j]`` iff node j is node i or an ancestor of it."""
    p = _as_tensor(parents)
    validate_parents(p)
    n = p.shape[-1]
    batched = p.dim() == 2
    pb = p if batched else p.unsqueeze(0)
    mask = torch.zeros(pb.shape[0], n, n, dtype=torch.bool, device=p.device)
    eye = torch.eye(n, dtype=torch.bool, device=p.device)
    mask[:, 0] = eye[0]
    for i in range(1, n):  # a node sees what its parent sees, and itself
        par_rows = mask[torch.arange(pb.shape[0], device=p.device), pb[:, i]]
        mask[:, i] = par_rows | eye[i]
    return mask if batched else mask[0]


def flatten_tree_masks(masks: Union[Tensor, Sequence[Tensor]]) -> Tensor:
    """The ``custom_mask`` argument of ``paged_prefill_attention``: every sequence's ``[q_len, q_len]``
    block flattened row-major and concatenated over the batch (trees may differ in size)."""
    if isinstance(masks, Tensor):
        masks = list(masks) if masks.dim() == 3 else [masks]
    return torch.cat([m.reshape(-1) for m in masks]).to(torch.bool)
