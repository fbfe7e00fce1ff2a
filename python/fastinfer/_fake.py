"""Fake (meta) implementations of every op in ``cpp/torch/registration.cpp``: output shapes and
dtypes from the input shapes, symbolic sizes included, for ``torch.compile``, ``opcheck`` and
meta tensors.

The compiled extension uses only the LibTorch stable ABI, which has no symbolic sizes, so these
live in Python. Each extension module registers them for its namespace when it loads
(``cpp/torch/module.cpp`` calls :func:`register`). They check what decides the outputs and that
every tensor is on one device; the full argument checks run in the real implementations.

Imports nothing from fastinfer: it runs while ``fastinfer._C`` is being imported.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

_REGISTERED: set = set()


def _check(ns: str, op: str, cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{ns}.{op}: {msg}")


def _same_device(ns: str, op: str, ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    for name, t in others.items():
        if isinstance(t, torch.Tensor):
            _check(ns, op, t.device == ref.device,
                   f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def _dim(ns: str, op: str, name: str, t: torch.Tensor, dim: int, layout: str) -> None:
    _check(ns, op, t.dim() == dim, f"{name} must be {dim}-D {layout}, got shape {list(t.shape)}")


def _attention_outputs(q: torch.Tensor, return_lse: bool):
    lse = q.new_empty((q.shape[0], q.shape[1]) if return_lse else (0,), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def _fakes(ns: str) -> Dict[str, Callable]:
    def rms_norm(x, weight, eps):
        _same_device(ns, "rms_norm", "x", x, weight=weight)
        _dim(ns, "rms_norm", "weight", weight, 1, "[hidden]")
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def rms_norm_out(out, x, weight, eps):
        _same_device(ns, "rms_norm_out", "x", x, out=out, weight=weight)

    def fused_add_rms_norm(x, residual, weight, eps):
        _same_device(ns, "fused_add_rms_norm", "x", x, residual=residual, weight=weight)

    def silu_and_mul(x):
        _check(ns, "silu_and_mul", x.dim() >= 1, "x must have shape [..., 2 * F], got a 0-D tensor")
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    def silu_and_mul_out(out, x):
        _same_device(ns, "silu_and_mul_out", "x", x, out=out)

    def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
        _same_device(ns, "rotary_embedding", "q", q, positions=positions, k=k, cos_sin_cache=cos_sin_cache)

    def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        _same_device(ns, "reshape_and_cache", "k", k, v=v, k_cache=k_cache, v_cache=v_cache,
                     slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def move_kv_slots(k_cache, v_cache, src_slots, dst_slots):
        _same_device(ns, "move_kv_slots", "k_cache", k_cache, v_cache=v_cache, src_slots=src_slots,
                     dst_slots=dst_slots)

    def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                          window_left=-1, softcap=0.0, return_lse=False, fixed_split_size=0):
        op = "prefill_attention"
        _dim(ns, op, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
        _same_device(ns, op, "q", q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return _attention_outputs(q, return_lse)

    def paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q, scale,
                                causal, window_left=-1, softcap=0.0, custom_mask=None, return_lse=False,
                                packed_custom_mask=None, fixed_split_size=0):
        op = "paged_prefill_attention"
        _dim(ns, op, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
        _same_device(ns, op, "q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                     cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, custom_mask=custom_mask,
                     packed_custom_mask=packed_custom_mask)
        return _attention_outputs(q, return_lse)

    def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, window_left=-1, softcap=0.0,
                               num_splits=0, return_lse=False, k_scale=None, v_scale=None, fixed_split_size=0):
        op = "paged_decode_attention"
        _dim(ns, op, "q", q, 3, "[batch, num_q_heads, head_dim]")
        _same_device(ns, op, "q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                     k_scale=k_scale, v_scale=v_scale)
        return _attention_outputs(q, return_lse)

    def merge_attention_states(v_a, lse_a, v_b, lse_b):
        _same_device(ns, "merge_attention_states", "v_a", v_a, lse_a=lse_a, v_b=v_b, lse_b=lse_b)
        return (torch.empty_like(v_a, memory_format=torch.contiguous_format),
                torch.empty_like(lse_a, memory_format=torch.contiguous_format))

    def fp8_quantize(x, mode="token", group_size=128, scale=None):
        op = "fp8_quantize"
        _dim(ns, op, "x", x, 2, "[M, K]")
        _same_device(ns, op, "x", x, scale=scale)
        _check(ns, op, mode in ("tensor", "token", "group"), f"mode must be 'tensor', 'token' or 'group', got '{mode}'")
        shape = {"tensor": (1,), "token": (x.shape[0],)}.get(mode) or (x.shape[0], x.shape[1] // group_size)
        return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(shape, dtype=torch.float32)

    def fp8_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, deterministic=False):
        _same_device(ns, "fp8_scaled_mm", "a", a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
        return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)

    def int8_quantize(x, mode="token", scale=None, symmetric=True):
        op = "int8_quantize"
        _dim(ns, op, "x", x, 2, "[M, K]")
        _same_device(ns, op, "x", x, scale=scale)
        _check(ns, op, mode in ("tensor", "token"), f"mode must be 'tensor' or 'token', got '{mode}'")
        scale_shape = (1,) if mode == "tensor" else (x.shape[0],)
        azp = x.new_empty((0,) if symmetric else (x.shape[0],), dtype=torch.int32)
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(scale_shape, dtype=torch.float32), azp

    def int8_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, azp_adj=None, azp=None, deterministic=False):
        _same_device(ns, "int8_scaled_mm", "a", a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias,
                     azp_adj=azp_adj, azp=azp)
        return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)

    def tree_verify(draft_tokens, parents, target_logits, draft_probs, temperature, uniforms, greedy):
        op = "tree_verify"
        _dim(ns, op, "draft_tokens", draft_tokens, 2, "[batch, num_nodes]")
        _same_device(ns, op, "draft_tokens", draft_tokens, parents=parents, target_logits=target_logits,
                     draft_probs=draft_probs, temperature=temperature, uniforms=uniforms)
        b = draft_tokens.shape[0]
        return draft_tokens.new_empty(draft_tokens.shape), draft_tokens.new_empty((b,)), draft_tokens.new_empty((b,))

    def int4_pack(w_q):
        _dim(ns, "int4_pack", "w_q", w_q, 2, "[N, K] (the quantised weight, values 0..15)")
        return w_q.new_empty((w_q.shape[1] // 64, 8 * w_q.shape[0]), dtype=torch.int32)

    def int4_repack(qweight, qzeros, fmt, g_idx=None):
        op = "int4_repack"
        _check(ns, op, fmt in ("awq", "gptq"), f"fmt must be 'awq' or 'gptq', got '{fmt}'")
        _same_device(ns, op, "qweight", qweight, qzeros=qzeros, g_idx=g_idx)
        awq = fmt == "awq"
        n = qweight.shape[1] * 8 if awq else qweight.shape[1]
        k = qweight.shape[0] if awq else qweight.shape[0] * 8
        return (qweight.new_empty((k // 64, 8 * n), dtype=torch.int32),
                qweight.new_empty((qzeros.shape[0], n), dtype=torch.uint8),
                qweight.new_empty((k,) if g_idx is not None else (0,), dtype=torch.int64))

    def int4_gemm(a, packed, scales, zeros, group_size=128, perm=None, deterministic=False):
        op = "int4_gemm"
        _dim(ns, op, "a", a, 2, "[M, K]")
        _same_device(ns, op, "a", a, packed=packed, scales=scales, zeros=zeros, perm=perm)
        _check(ns, op, group_size > 0 and group_size % 32 == 0,
               f"group_size must be a positive multiple of 32 (32, 64, 128 (default), ..., K), got {group_size}")
        return a.new_empty((a.shape[0], packed.shape[1] // 8))

    def dense_mm(a, b, bias=None):
        _same_device(ns, "dense_mm", "a", a, b=b, bias=bias)
        return a.new_empty((a.shape[0], b.shape[0]))

    return {f.__name__: f for f in (
        rms_norm, rms_norm_out, fused_add_rms_norm, silu_and_mul, silu_and_mul_out, rotary_embedding,
        reshape_and_cache, move_kv_slots, prefill_attention, paged_prefill_attention, paged_decode_attention,
        merge_attention_states, fp8_quantize, fp8_scaled_mm, int8_quantize, int8_scaled_mm, tree_verify,
        int4_pack, int4_repack, int4_gemm, dense_mm)}


def register(ns: str) -> None:
    """Registers the fake impls of every op of namespace ``ns`` (once per namespace)."""
    if ns in _REGISTERED:
        return
    for name, fn in _fakes(ns).items():
        torch.library.register_fake(f"{ns}::{name}")(fn)
    _REGISTERED.add(ns)
