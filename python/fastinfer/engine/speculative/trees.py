"""Draft trees, token- and tensor-free: the parents layout of a draft, and the static candidate trees
of draft heads (Medusa) as lists of paths.

A draft of ``N`` nodes is given by ``parents``: node 0 is the root (the last committed token,
``parents[0] = -1``) and every other node's parent has a smaller index (``0 <= parents[i] < i``,
topological order; the layout :func:`fastinfer.ops.tree_verify` expects). For tree attention the
``N`` nodes are the last ``N`` tokens of the sequence in the KV cache; node ``i`` sees its
ancestors and itself (:func:`tree_mask`, the ``custom_mask`` block of ``paged_prefill_attention``)
and sits at position ``start + depth(i)`` (:func:`tree_depths`, for rotary embeddings).

A path ``(i_1, .., i_d)`` names the node at depth d whose token is the ``i_d``-th most probable
token of head ``d - 1`` (head 0 predicts the token after the root), and whose parent is the path
``(i_1, .., i_{d-1})`` (the root for d = 1). A tree is a list of distinct paths in which every
path's parent path comes earlier; node j + 1 of a draft is path j (node 0 is the root).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

__all__ = ["DEFAULT_MEDUSA_TREE", "Path", "check_tree", "chain_tree", "tree_for_heads", "tree_structure",
           "validate_parents", "tree_depths", "tree_mask"]

Path = Tuple[int, ...]

#: The default Medusa tree (12 nodes, depth <= 4): the top-1 chain, the runner-up tokens of the first
#: two heads, and the cross terms of the two most probable tokens near the root, ordered by a rough
#: expected acceptance (node budgets ``num_spec_tokens`` keep its first N paths). Paths deeper than the
#: checkpoint's number of heads are dropped.
DEFAULT_MEDUSA_TREE: Tuple[Path, ...] = (
    (0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (3,), (0, 2), (0, 0, 1), (0, 0, 0, 0), (1, 1))


def check_tree(paths, what: str = "spec_tree") -> List[Path]:
    """``paths`` as a list of tuples, or a ValueError naming the first bad path."""
    try:
        out = [tuple(p) for p in paths]
    except TypeError:
        raise ValueError(f"{what} must be a list of paths (lists of ints), got {paths!r}") from None
    if not out:
        raise ValueError(f"{what} must have at least one path")
    seen = set()
    for p in out:
        if not p or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p):
            raise ValueError(f"{what}: path {list(p)!r} must be a non-empty list of ints >= 0 (top-k ranks)")
        if p in seen:
            raise ValueError(f"{what}: path {list(p)!r} appears twice")
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"{what}: path {list(p)!r} comes before its parent {list(p[:-1])!r} "
                             "(list every path after its prefix)")
        seen.add(p)
    return out


def chain_tree(k: int) -> List[Path]:
    """The top-1 chain of depth k: ``(0,), (0, 0), ..``."""
    return [(0,) * d for d in range(1, k + 1)]


def tree_for_heads(paths: Optional[Sequence[Path]], mode: str, num_tokens: Optional[int], num_heads: int) -> List[Path]:
    """The tree a drafter with ``num_heads`` heads uses: the user's ``paths`` (all must fit the
    heads), else the chain (``mode="chain"``, ``num_tokens`` deep, capped at the heads) or the
    default tree without its too-deep paths; then its first ``num_tokens`` paths."""
    if paths is not None:
        tree = check_tree(paths)
        deep = next((p for p in tree if len(p) > num_heads), None)
        if deep is not None:
            raise ValueError(f"spec_tree: path {list(deep)!r} is deeper than the {num_heads} heads of the checkpoint")
    elif mode == "chain":
        tree = chain_tree(min(num_tokens or num_heads, num_heads))
    else:
        tree = [p for p in DEFAULT_MEDUSA_TREE if len(p) <= num_heads]
    return tree[:num_tokens] if num_tokens else tree


def tree_structure(paths: Sequence[Path]) -> Tuple[List[int], List[int]]:
    """``(parents, depths)`` of the draft nodes: root first, then one node per path."""
    index = {(): 0}
    parents, depths = [-1], [0]
    for j, p in enumerate(paths, 1):
        index[p] = j
        parents.append(index[p[:-1]])
        depths.append(len(p))
    return parents, depths


def validate_parents(parents: Sequence[int]) -> List[int]:
    """``parents`` as a list of ints, or a ValueError unless ``parents[0] == -1`` and
    ``0 <= parents[i] < i`` for ``i >= 1``."""
    p = [int(x) for x in parents]
    if not p or p[0] != -1:
        raise ValueError("parents[0] must be -1 (node 0 is the root)")
    for i, x in enumerate(p[1:], 1):
        if not 0 <= x < i:
            raise ValueError(f"parents[{i}] = {x} must be in [0, {i}): nodes must be in topological order "
                             "(parent index < child index) forming a tree rooted at node 0")
    return p


def tree_depths(parents: Sequence[int]) -> List[int]:
    """The depth of every node (the root has depth 0)."""
    p = validate_parents(parents)
    depth = [0] * len(p)
    for i in range(1, len(p)):  # parents precede children: one pass
        depth[i] = depth[p[i]] + 1
    return depth


def tree_mask(parents: Sequence[int]) -> List[List[bool]]:
    """``N`` rows of ``N`` bools: ``mask[i][j]`` iff node j is node i or an ancestor of it."""
    p = validate_parents(parents)
    mask: List[List[bool]] = []
    for i, par in enumerate(p):  # a node sees what its parent sees, and itself
        row = list(mask[par]) if par >= 0 else [False] * len(p)
        row[i] = True
        mask.append(row)
    return mask
