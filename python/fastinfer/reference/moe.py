"""fp64 oracles of the MoE routing ops (docs/design.md "Mixture of experts").

``moe_topk``: the ``top_k`` largest logits of each row (descending, ties to the lower expert id,
NaN after every number), weighted by the softmax over all experts (``scoring='softmax'``,
optionally renormalised over the selected) or by the softmax over the selected logits
(``scoring='topk_softmax'``). NaN propagates through the arithmetic as in ``torch.softmax``.

``moe_align``: vLLM's ``moe_align_block_size`` layout (the golden ``torch_moe_align_block_size`` of
vLLM's tests/kernels/moe/test_moe_align_block_size.py, which also orders an expert's slots
ascending), with ``-1`` ids skipped.
"""

from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor

__all__ = ["moe_topk", "moe_align", "expert_order"]


def expert_order(router_logits: Tensor) -> Tensor:
    """The experts of each row from first to last: descending logit, ties to the lower id, NaN last."""
    x = router_logits.double()
    by_value = torch.sort(torch.where(x.isnan(), float("-inf"), x), dim=-1, descending=True, stable=True).indices
    nan_last = torch.sort(x.isnan().gather(-1, by_value).to(torch.uint8), dim=-1, stable=True).indices
    return by_value.gather(-1, nan_last)


def moe_topk(router_logits: Tensor, top_k: int, renormalize: bool = False,
             scoring: str = "softmax") -> Tuple[Tensor, Tensor]:
    """``(topk_weights [T, top_k] float64, topk_ids [T, top_k] int64)``."""
    x = router_logits.double()
    ids = expert_order(x)[:, :top_k]
    if scoring == "softmax":
        weights = torch.softmax(x, dim=-1).gather(-1, ids)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    elif scoring == "topk_softmax":
        weights = torch.softmax(x.gather(-1, ids), dim=-1)
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    return weights, ids


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, int32, built expert by expert."""
    ids = topk_ids.flatten().long()
    num_slots = ids.numel()
    sorted_size = num_slots + num_experts * (block_m - 1)
    sorted_token_ids = torch.full((sorted_size,), num_slots, dtype=torch.int32)
    expert_ids = torch.zeros((sorted_size + block_m - 1) // block_m, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        slots = (ids == e).nonzero().flatten()  # ascending
        padded = -(-slots.numel() // block_m) * block_m
        sorted_token_ids[pos:pos + slots.numel()] = slots.int()
        expert_ids[pos // block_m:(pos + padded) // block_m] = e
        pos += padded
    return sorted_token_ids, expert_ids, torch.tensor([pos], dtype=torch.int32)
