"""Python wrappers for mixture-of-experts routing (``torch.ops.fastinfer.moe_topk``, ``moe_align``)."""

from __future__ import annotations

from typing import Tuple

import torch

from ._fake import check, check_dim, fake

Tensor = torch.Tensor

__all__ = ["moe_topk", "moe_align", "MOE_SCORINGS"]

#: the ``scoring`` values of :func:`moe_topk`
MOE_SCORINGS = ("softmax", "topk_softmax")


def moe_topk(
    router_logits: Tensor, top_k: int, renormalize: bool = False, scoring: str = "softmax", *, lib=None
) -> Tuple[Tensor, Tensor]:
    """The ``top_k`` experts of each token and their weights, from the router logits.

    Selection: the ``top_k`` largest logits of the row, in descending order, ties to the lower
    expert id; a NaN logit ranks below every number (``-inf`` included), so the ids are always
    valid experts. Selecting on the logits gives the same experts as selecting on the softmax
    probabilities (softmax is monotone) without depending on how the exponentials round.

    * ``scoring='softmax'`` (Mixtral, Qwen2/3-MoE, OLMoE): ``p = softmax(router_logits)`` over all
      experts in float32, the weights are ``p`` of the selected experts; ``renormalize=True``
      divides them by their sum (Qwen3's ``norm_topk_prob``; Mixtral always). A NaN anywhere in a
      row makes that row's weights NaN.
    * ``scoring='topk_softmax'`` (gpt-oss): the weights are the softmax of the selected logits.
      They already sum to 1: ``renormalize=True`` is refused. A NaN among the selected logits
      (a row with fewer than ``top_k`` numbers) makes the row's weights NaN.

    Args:
        router_logits: ``[num_tokens, num_experts]`` float32, float16 or bfloat16, contiguous.
        top_k: experts per token, ``1 <= top_k <= min(num_experts, 32)``.

    Returns:
        ``(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int32)``.
    """
    return tuple((lib or torch.ops.fastinfer).moe_topk(router_logits, int(top_k), bool(renormalize), scoring))


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int, *, lib=None) -> Tuple[Tensor, Tensor, Tensor]:
    """The slots of each expert gathered into blocks of ``block_m`` rows (vLLM's ``moe_align_block_size``).

    Slot ``s = token * top_k + j`` is ``topk_ids[token, j]``. The slots are grouped by expert
    (ascending expert; ascending slot order within an expert, so the output is deterministic),
    and each expert's group is padded to a multiple of ``block_m`` with the sentinel
    ``T * top_k``; an expert with no slot has no block. ``-1`` ids (a slot routed to no local
    expert, as with expert parallelism) are skipped: the slot appears nowhere.

    Args:
        topk_ids: ``[T, top_k]`` int32 or int64 (:func:`moe_topk`'s ids), values in ``[-1, num_experts)``.
        num_experts: ``1 <= num_experts <= 1024``.
        block_m: a power of two (the M tile of the grouped GEMM).

    Returns:
        ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, all int32:
        ``sorted_token_ids [T * top_k + num_experts * (block_m - 1)]`` (the groups back to back,
        then sentinels), ``expert_ids [ceil(len(sorted_token_ids) / block_m)]`` (the expert of each
        block, 0 for the unused trailing blocks) and ``num_tokens_post_padded [1]`` (the used
        length, on the device: no host sync). Sizes depend on the shapes only.

    Value checks of the ids run on CPU tensors always and on CUDA tensors with
    ``FASTINFER_CHECK_INDICES=1``; without them the CUDA kernel skips any id outside
    ``[0, num_experts)``.
    """
    return tuple((lib or torch.ops.fastinfer).moe_align(topk_ids, int(num_experts), int(block_m)))


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("moe_topk")
def _moe_topk_fake(ns, router_logits, top_k, renormalize, scoring):
    op = "moe_topk"
    check_dim(ns, op, "router_logits", router_logits, 2, "[num_tokens, num_experts]")
    check(ns, op, scoring in MOE_SCORINGS, f"scoring must be 'softmax' or 'topk_softmax', got '{scoring}'")
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32)


@fake("moe_align")
def _moe_align_fake(ns, topk_ids, num_experts, block_m):
    op = "moe_align"
    check_dim(ns, op, "topk_ids", topk_ids, 2, "[num_tokens, top_k]")
    check(ns, op, block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}")
    sorted_size = topk_ids.numel() + num_experts * (block_m - 1)
    return (topk_ids.new_empty((sorted_size,), dtype=torch.int32),
            topk_ids.new_empty(((sorted_size + block_m - 1) // block_m,), dtype=torch.int32),
            topk_ids.new_empty((1,), dtype=torch.int32))
