"""fp64 oracle of a DFlash drafter's block forward (z-lab/dflash ``dflash/model.py``:
``DFlashDraftModel.forward``, ``Qwen3DFlashDecoderLayer``, ``Qwen3DFlashAttention``), one sequence,
written as plain dense torch from that code (no paged cache, no fused ops):

* ``target_hidden [S, m H]``: the target's layer outputs of the S context positions, concatenated;
  ``ctx = hidden_norm(fc(target_hidden))``.
* ``noise [B, H]``: the block's input embeddings (the anchor token's, then the mask token's).
* each layer: ``h = input_layernorm(x)``; ``q = q_norm(q_proj(h))`` per head; ``k = k_norm(k_proj([ctx; h]))``
  per head, ``v = v_proj([ctx; h])``; RoPE (rotate-half, default inverse frequencies
  ``theta ** (-2i / D)``) on q at the block's positions and on k at the context's then the block's;
  attention of every block row over all S + B keys (no mask: ``is_causal=False``), GQA by repeating
  the KV heads; ``x = x + o_proj(attn)``; ``x = x + down(silu(gate(n)) * up(n))`` with
  ``n = post_attention_layernorm(x)``.
* ``logits = lm_head(norm(x))`` for every block row.

Weights are a dict under the checkpoint's own names (``layers.{i}.self_attn.q_proj.weight``,
``fc.weight``, ``hidden_norm.weight``, ``norm.weight``, ...) plus ``lm_head`` (the target's).
"""

from __future__ import annotations

from typing import Dict

import torch

Tensor = torch.Tensor

__all__ = ["dflash_block_logits"]


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """``x [T, heads, D]`` rotated (rotate-half / neox) at positions ``pos [T]``."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None]  # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    half = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + half * sin


def dflash_block_logits(weights: Dict[str, Tensor], lm_head: Tensor, target_hidden: Tensor, noise: Tensor,
                        context_positions: Tensor, block_positions: Tensor, *, num_layers: int, num_heads: int,
                        num_kv_heads: int, head_dim: int, eps: float, rope_theta: float) -> Tensor:
    """float64 logits ``[B, V]`` of every block row (module docstring)."""
    w = {k: v.double() for k, v in weights.items()}
    D = head_dim
    ctx = _rms(target_hidden.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = noise.double()
    S, B = ctx.shape[0], x.shape[0]
    kpos = torch.cat([context_positions, block_positions])
    for i in range(num_layers):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([ctx, h])
        q = _rms((h @ w[p + "self_attn.q_proj.weight"].T).view(B, num_heads, D), w[p + "self_attn.q_norm.weight"], eps)
        k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(S + B, num_kv_heads, D),
                 w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(S + B, num_kv_heads, D)
        q, k = _rope(q, block_positions, rope_theta), _rope(k, kpos, rope_theta)
        rep = num_heads // num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        att = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(B, num_heads * D)
        x = x + att @ w[p + "self_attn.o_proj.weight"].T
        n = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps) @ lm_head.double().T
