"""Python wrappers for mixture-of-experts routing (``torch.ops.fastinfer.moe_topk``)."""

from __future__ import annotations

from typing import Tuple

import torch

from ._fake import check, check_dim, fake

Tensor = torch.Tensor

__all__ = ["moe_topk", "MOE_SCORINGS"]

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


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("moe_topk")
def _moe_topk_fake(ns, router_logits, top_k, renormalize, scoring):
    op = "moe_topk"
    check_dim(ns, op, "router_logits", router_logits, 2, "[num_tokens, num_experts]")
    check(ns, op, scoring in MOE_SCORINGS, f"scoring must be 'softmax' or 'topk_softmax', got '{scoring}'")
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32)
