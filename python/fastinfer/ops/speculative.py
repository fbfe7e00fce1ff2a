"""Python wrapper for speculative-decoding verification (``torch.ops.fastinfer.tree_verify``)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ._fake import check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["tree_verify"]


def tree_verify(
    draft_tokens: Tensor,
    parents: Tensor,
    target_logits: Tensor,
    draft_probs: Optional[Tensor] = None,
    temperature: Union[Tensor, float, None] = None,
    uniforms: Optional[Tensor] = None,
    greedy: bool = False,
    generator: Optional[torch.Generator] = None,
    *,
    lib=None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Verify a tree of draft tokens against the target model: how many to accept, and the next token.

    Node 0 of each sequence is the root (its last committed token); ``parents[b, 0] = -1`` and
    ``0 <= parents[b, i] < i`` (topological order). ``target_logits[b, u]`` are the target's logits
    AT node u (predicting u's children); ``draft_probs[b, u]`` is the draft distribution at node u
    (the one u's children were drawn from). Children are tried in ascending node order; the walk
    follows the first accepted child and stops at a node whose children are all rejected.

    * ``greedy=True``: a child is accepted when its token is the argmax of the target logits at the
      current node (lowest id on ties); ``next_token`` is the argmax at the last accepted node.
      ``temperature`` and ``draft_probs`` are ignored.
    * sampling (``p = softmax(target_logits / temperature)``, exact: the emitted tokens follow the
      target distribution). Child ``c`` with token ``x`` is tested with ``u = uniforms[b, c]``:

      - ``draft_probs=None``: children are deterministic candidates; accept when ``u < p(x)``,
        else ``p(x) <- 0`` and ``p`` is renormalised;
      - with ``draft_probs`` (children drawn WITHOUT replacement from ``q``): accept when
        ``u * q(x) < p(x)``, else ``p <- norm(max(p - q, 0))``, ``q <- norm(q without x)``
        (recursive rejection sampling without replacement).

      ``next_token`` is the residual sample at the last accepted node by inverse CDF with
      ``u = uniforms[b, N]``: the smallest ``t`` with ``cumsum(r)[t] > u * sum(r)``.

    Args:
        draft_tokens: ``[B, N]`` int32 or int64; token of each node (entry 0, the root, is unused).
        parents: ``[B, N]``, dtype of draft_tokens.
        target_logits: ``[B, N, V]`` float32, float16 or bfloat16, finite or -inf (a NaN or +inf
            is refused where the index values are checked: CPU tensors always, CUDA ones with
            ``FASTINFER_CHECK_INDICES=1``).
        draft_probs: ``[B, N, V]`` float32 or None.
        temperature: ``[B]`` float32 (or a float for every sequence), > 0 unless greedy; may be
            None when greedy.
        uniforms: ``[B, N + 1]`` float32 in ``[0, 1)``; drawn with ``torch.rand`` (``generator``)
            when None. All randomness of the op comes from here.

    Returns:
        ``(accepted_nodes [B, N], num_accepted [B], next_token [B])`` in the dtype of
        ``draft_tokens``: ``accepted_nodes[b, :num_accepted[b] + 1]`` is the accepted path root
        first (then -1); ``num_accepted`` counts the accepted DRAFT nodes (path length - 1), so a
        step emits ``num_accepted + 1`` tokens: the accepted nodes' tokens, then ``next_token``.

    Contiguous inputs are required. Value checks (tree structure, token ids in ``[0, V)``,
    temperature, uniforms) run on CPU tensors always and on CUDA tensors with
    ``FASTINFER_CHECK_INDICES=1``; without them the CUDA kernel still never reads out of bounds.
    """
    B, N = draft_tokens.shape
    dev = draft_tokens.device
    if temperature is None:
        if not greedy:
            raise ValueError("tree_verify: temperature is required when sampling (greedy=False)")
        temperature = 1.0
    if not isinstance(temperature, Tensor):
        temperature = torch.full((B,), float(temperature), dtype=torch.float32, device=dev)
    if uniforms is None:
        uniforms = torch.rand((B, N + 1), generator=generator, dtype=torch.float32,
                              device="cpu" if generator is not None else dev).to(dev)
    return tuple((lib or torch.ops.fastinfer).tree_verify(draft_tokens, parents, target_logits, draft_probs, temperature,
                                                 uniforms, bool(greedy)))


# ---- fake impls (output shapes for torch.compile, opcheck and meta tensors) ----


@fake("tree_verify")
def _tree_verify_fake(ns, draft_tokens, parents, target_logits, draft_probs, temperature, uniforms, greedy):
    op = "tree_verify"
    check_dim(ns, op, "draft_tokens", draft_tokens, 2, "[batch, num_nodes]")
    same_device(ns, op, "draft_tokens", draft_tokens, parents=parents, target_logits=target_logits,
                draft_probs=draft_probs, temperature=temperature, uniforms=uniforms)
    b = draft_tokens.shape[0]
    return draft_tokens.new_empty(draft_tokens.shape), draft_tokens.new_empty((b,)), draft_tokens.new_empty((b,))
