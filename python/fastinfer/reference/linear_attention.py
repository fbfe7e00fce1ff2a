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


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, states: Tensor,
                     state_indices: Tensor, has_initial_state: Optional[Tensor] = None, scale: Optional[float] = None,
                     use_qk_l2norm: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """``(o [T, Hv, Dv], new states [P, Hv, Dk, Dv], history [T, Hv, Dk, Dv])`` in float64,
    ``states`` not mutated (the batch's slots replaced by their final states, the others kept):
    the contract of :func:`fastinfer.ops.gated_delta_rule` as the per-token recurrence
    ``S = exp(g) S; u = beta (v - S^T k); S = S + k u^T; o = S^T (scale q)``, ``history[t]`` the
    state after token ``t``."""
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk})")
    q, k = (x.double().repeat_interleave(Hv // Hk, dim=1) for x in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    if use_qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (Dk ** -0.5 if scale is None else scale)
    o = torch.empty(T, Hv, Dv, dtype=torch.float64)
    history = torch.empty(T, Hv, Dk, Dv, dtype=torch.float64)
    new_states = states.double().clone()
    cu = cu_seqlens.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        initial = has_initial_state is None or bool(has_initial_state[b])
        S = states[slot].double().clone() if initial else torch.zeros(Hv, Dk, Dv, dtype=torch.float64)
        for t in range(cu[b], cu[b + 1]):
            S = S * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q[t], S)
            history[t] = S
        new_states[slot] = S
    return o, new_states, history
