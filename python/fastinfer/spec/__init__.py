"""Speculative decoding helpers (token trees). The verification op is :func:`fastinfer.ops.tree_verify`."""

from .tree import flatten_tree_masks, tree_depths, tree_mask, tree_positions, validate_parents  # noqa: F401

__all__ = ["flatten_tree_masks", "tree_depths", "tree_mask", "tree_positions", "validate_parents"]
