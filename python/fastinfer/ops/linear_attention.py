"""Python wrappers for the linear-attention ops (``torch.ops.fastinfer.causal_conv1d``,
``torch.ops.fastinfer.gated_delta_rule``): the short causal convolution of Gated DeltaNet and Mamba
layers and Gated DeltaNet's recurrence, each with a pool of per-sequence states."""

from __future__ import annotations

from typing import Optional

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["causal_conv1d", "gated_delta_rule", "CONV_ACTIVATIONS"]

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


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    states: Tensor,
    state_indices: Tensor,
    has_initial_state: Optional[Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    state_history: Optional[Tensor] = None,
    deterministic: bool = False,
    *,
    lib=None,
) -> Tensor:
    """Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next) over each sequence of a varlen batch,
    continuing from (and updating) each sequence's state slot. ``states`` (and ``state_history``
    when given) are modified **in place**.

    Sequence ``b`` is tokens ``cu_seqlens[b] .. cu_seqlens[b + 1]``; its state ``S`` (``[Dk, Dv]``
    per value head) starts as ``states[state_indices[b]]`` (zeros instead when
    ``has_initial_state[b]`` is False, and the slot is then not read). Value head ``h`` uses key
    head ``h // (Hv // Hk)`` (transformers' ``repeat_interleave``). Per token, in float32: with
    ``use_qk_l2norm`` q and k become ``x / sqrt(sum(x^2) + 1e-6)``; q is multiplied by ``scale``;
    then ``S = exp(g) S``, ``u = beta (v - S^T k)``, ``S = S + k u^T`` and ``o = S^T q`` (the
    definition of transformers' ``torch_recurrent_gated_delta_rule``). Afterwards the slot holds
    the sequence's final state, and ``state_history[t]`` the state after token ``t`` (speculative
    verification keeps the state at the accepted length). Prefill is a batch with
    ``has_initial_state``; decode and verification the same call with ``has_initial_state=None``.

    On the CPU a sequence longer than 64 tokens takes the chunked (WY / UT transform) form, equal
    to the per-token recurrence to rounding; ``deterministic=True`` (or a ``state_history``) keeps
    the per-token order for every sequence, so one prefill, the same tokens split across calls and
    token-by-token decode give the same bits. The CUDA kernel always runs the per-token recurrence.

    Args:
        q: ``[T, Hk, Dk]`` float32, float16 or bfloat16, heads packed (any token stride: a view into
            the fused projection is taken as is). ``Dk`` 64 or 128.
        k: ``[T, Hk, Dk]``, the dtype and layout rules of ``q``.
        v: ``[T, Hv, Dv]``, ``Hv`` a multiple of ``Hk``, ``Dv`` 64 or 128, the dtype of ``q``.
        g: float32 ``[T, Hv]``, contiguous: the log decay (``-exp(A_log) * softplus(a + dt_bias)``).
        beta: ``[T, Hv]`` float32 or the dtype of ``q``, contiguous (``sigmoid(b)``).
        cu_seqlens: int32 ``[B + 1]``, from 0 to ``T``, non-decreasing (empty sequences allowed:
            their slot is still written, with its old state or zeros).
        states: float32 ``[S, Hv, Dk, Dv]``, contiguous (transformers' recurrent-state layout).
        state_indices: int32/int64 ``[B]``, distinct slots in ``[0, S)``.
        has_initial_state: bool ``[B]`` or None (every sequence starts from its slot).
        scale: the query scale, default ``Dk ** -0.5``; finite and positive.
        use_qk_l2norm: l2-normalise q and k first (Qwen3.5 / Qwen3-Next: True).
        state_history: float32 ``[T, Hv, Dk, Dv]``, contiguous, or None.
        deterministic: the per-token arithmetic order on every path.

    Index values (cu_seqlens, state_indices) are checked on CPU tensors always, on CUDA tensors
    with ``FASTINFER_CHECK_INDICES=1``.

    Returns:
        ``[T, Hv, Dv]`` in the dtype of ``q``, contiguous.
    """
    return (lib or torch.ops.fastinfer).gated_delta_rule(q, k, v, g, beta, cu_seqlens, states, state_indices,
                                                         has_initial_state, scale, use_qk_l2norm, state_history,
                                                         deterministic)


@fake("gated_delta_rule")
def _gated_delta_rule_fake(ns, q, k, v, g, beta, cu_seqlens, states, state_indices, has_initial_state=None,
                           scale=None, use_qk_l2norm=False, state_history=None, deterministic=False):
    op = "gated_delta_rule"
    check_dim(ns, op, "q", q, 3, "[num_tokens, num_k_heads, head_dim_k]")
    check_dim(ns, op, "v", v, 3, "[num_tokens, num_v_heads, head_dim_v]")
    check_dim(ns, op, "states", states, 4, "[num_slots, num_v_heads, head_dim_k, head_dim_v]")
    same_device(ns, op, "q", q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, states=states,
                state_indices=state_indices, has_initial_state=has_initial_state, state_history=state_history)
    return q.new_empty((q.shape[0], v.shape[1], v.shape[2]))
