"""Python wrappers for the linear-attention ops (``torch.ops.fastinfer.causal_conv1d``): the short
causal convolution of Gated DeltaNet and Mamba layers, with a pool of per-sequence states."""

from __future__ import annotations

from typing import Optional

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["causal_conv1d", "CONV_ACTIVATIONS"]

#: the ``activation`` values of :func:`causal_conv1d`
CONV_ACTIVATIONS = ("silu", "none")


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    cu_seqlens: Tensor,
    conv_states: Tensor,
    state_indices: Tensor,
    has_initial_state: Optional[Tensor] = None,
    activation: str = "silu",
    *,
    lib=None,
) -> Tensor:
    """Causal depthwise convolution over each sequence of a varlen batch, continuing from (and
    updating) each sequence's state slot. ``conv_states`` is modified **in place**.

    Sequence ``b`` is rows ``cu_seqlens[b] .. cu_seqlens[b + 1]`` of ``x``. Its padded input is the
    ``W - 1`` rows of ``conv_states[state_indices[b]]`` (oldest first; zeros instead when
    ``has_initial_state[b]`` is False, and the slot is then not read) followed by its rows of ``x``;
    output row ``t`` is ``act(bias + sum_i weight[:, i] * xpad[t + i])``, ``weight[:, W - 1]``
    multiplying the current token (``torch.nn.Conv1d(D, D, W, groups=D, padding=W - 1)`` truncated
    to the first ``L`` outputs, with ``weight[:, 0, :]``), accumulated in float32 and rounded once.
    Afterwards the slot holds the last ``W - 1`` rows of the padded input. Prefill is a batch with
    ``has_initial_state`` (False for new sequences, True for a continued chunk or a prefix-cache
    hit); decode and speculative verification are the same call with ``has_initial_state=None``
    (every sequence continues from its slot; 1 or more new rows each).

    Args:
        x: ``[T, D]`` float32, float16 or bfloat16, channels contiguous; rows may be strided (a
            slice of a fused projection's output).
        weight: ``[D, W]``, ``2 <= W <= 4``, the dtype of ``x``, contiguous.
        bias: ``[D]`` or None.
        cu_seqlens: int32 ``[B + 1]``, from 0 to ``T``, non-decreasing (empty sequences allowed:
            their slot is still written, with its old rows or zeros).
        conv_states: ``[S, W - 1, D]``, the dtype of ``x``, contiguous (token-major, like ``x``).
        state_indices: int32/int64 ``[B]``, distinct slots in ``[0, S)``.
        has_initial_state: bool ``[B]`` or None (every sequence starts from its slot).
        activation: ``"silu"`` (Qwen3.5 / Qwen3-Next's ``F.silu``) or ``"none"``.

    Index values (cu_seqlens, state_indices) are checked on CPU tensors always, on CUDA tensors
    with ``FASTINFER_CHECK_INDICES=1``.

    Returns:
        ``[T, D]`` in the dtype of ``x``, contiguous.
    """
    return (lib or torch.ops.fastinfer).causal_conv1d(x, weight, bias, cu_seqlens, conv_states, state_indices,
                                                      has_initial_state, activation)


@fake("causal_conv1d")
def _causal_conv1d_fake(ns, x, weight, bias, cu_seqlens, conv_states, state_indices, has_initial_state=None,
                        activation="silu"):
    op = "causal_conv1d"
    check_dim(ns, op, "x", x, 2, "[num_tokens, dim]")
    check_dim(ns, op, "weight", weight, 2, "[dim, width]")
    check_dim(ns, op, "conv_states", conv_states, 3, "[num_slots, width - 1, dim]")
    check(ns, op, activation in CONV_ACTIVATIONS, f"activation must be 'silu' or 'none', got '{activation}'")
    same_device(ns, op, "x", x, weight=weight, bias=bias, cu_seqlens=cu_seqlens, conv_states=conv_states,
                state_indices=state_indices, has_initial_state=has_initial_state)
    return x.new_empty(tuple(x.shape))
