"""fp64 oracles of the linear-attention ops."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], cu_seqlens: Tensor, conv_states: Tensor,
                  state_indices: Tensor, has_initial_state: Optional[Tensor] = None,
                  activation: str = "silu") -> Tuple[Tensor, Tensor]:
    """``(out [T, D], new conv_states [S, W - 1, D])`` in float64, ``conv_states`` not mutated (the
    slots of the batch's sequences replaced, the others kept): the contract of
    :func:`fastinfer.ops.causal_conv1d` written as a loop over sequences and taps."""
    if activation not in ("silu", "none"):
        raise ValueError(f"activation must be 'silu' or 'none', got {activation!r}")
    x, w = x.double(), weight.double()
    D, W = w.shape
    out = torch.empty(x.shape, dtype=torch.float64)
    states = conv_states.double().clone()
    cu = cu_seqlens.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        start, end = cu[b], cu[b + 1]
        initial = has_initial_state is None or bool(has_initial_state[b])
        prefix = conv_states[slot].double() if initial else torch.zeros(W - 1, D, dtype=torch.float64)
        pad = torch.cat([prefix, x[start:end]])  # [W - 1 + L, D]
        for t in range(end - start):
            acc = bias.double().clone() if bias is not None else torch.zeros(D, dtype=torch.float64)
            for i in range(W):
                acc = acc + w[:, i] * pad[t + i]
            out[start + t] = acc * torch.sigmoid(acc) if activation == "silu" else acc
        states[slot] = pad[end - start:]
    return out, states
