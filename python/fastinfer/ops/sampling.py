"""Python wrapper for constrained decoding's mask (``torch.ops.fastinfer.apply_token_bitmask``)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["apply_token_bitmask"]


def apply_token_bitmask(
    logits: Tensor, bitmask: Tensor, indices: Union[Tensor, Sequence[int], None] = None, *, lib=None
) -> Tensor:
    """Sets the logits of the tokens a grammar disallows to -inf, **in place**.

    The bitmask layout is xgrammar's and FlashInfer's (``xgrammar.allocate_token_bitmask`` /
    ``GrammarMatcher.fill_next_token_bitmask`` fill it): bit ``j`` of int32 word ``i`` of a row is 1
    when token ``32 i + j`` is allowed. For each selected row ``r`` and token ``t < V``:
    ``logits[r, t] = -inf`` where the bit is 0; allowed tokens are not written.

    Args:
        logits: ``[B, V]`` float32, float16 or bfloat16, contiguous; modified in place.
        bitmask: ``[B, W]`` int32, contiguous, ``32 W >= V`` (a wider mask, e.g. one allocated for a
            padded vocabulary, is fine: bits beyond ``V`` are ignored; a narrower one is refused,
            where xgrammar would leave the uncovered tokens unmasked).
        indices: optional ``[K]`` int32/int64 (or a list): the rows to mask, indexing logits and
            bitmask alike (xgrammar's ``indices``); the other rows are left untouched. Values in
            ``[0, B)``, checked on CPU tensors always and on CUDA tensors with
            ``FASTINFER_CHECK_INDICES=1`` (otherwise the kernel skips out-of-range rows).

    Returns:
        ``logits``, for chaining.
    """
    if indices is not None and not isinstance(indices, Tensor):
        indices = torch.tensor(list(indices), dtype=torch.int64, device=logits.device)
    (lib or torch.ops.fastinfer).apply_token_bitmask(logits, bitmask, indices)
    return logits


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("apply_token_bitmask")
def _apply_token_bitmask_fake(ns, logits, bitmask, indices=None):
    op = "apply_token_bitmask"
    check_dim(ns, op, "logits", logits, 2, "[batch, vocab]")
    check_dim(ns, op, "bitmask", bitmask, 2, "[batch, ceil(vocab / 32)]")
    check(ns, op, bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}")
    same_device(ns, op, "logits", logits, bitmask=bitmask, indices=indices)
    return None
