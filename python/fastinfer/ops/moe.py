"""Python wrappers for mixture-of-experts ops: routing (``torch.ops.fastinfer.moe_topk``,
``moe_align``) and the expert MLPs (``fused_moe``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._fake import check, check_dim, fake, same_device

Tensor = torch.Tensor

__all__ = ["moe_topk", "moe_align", "fused_moe", "fused_moe_fp8", "fused_moe_int4", "fused_moe_fp4", "gpt_oss_expert_weights", "MOE_SCORINGS", "MOE_ACTIVATIONS",
           "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT"]

#: the ``scoring`` values of :func:`moe_topk`
MOE_SCORINGS = ("softmax", "topk_softmax")
#: the ``activation`` values of :func:`fused_moe`
MOE_ACTIVATIONS = ("silu", "swiglu_oai")
#: gpt-oss's clamped swiglu: alpha (fixed in its code) and limit (its config's ``swiglu_limit``)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def moe_topk(
    router_logits: Tensor, top_k: int, renormalize: bool = False, scoring: str = "softmax", *, lib=None
) -> Tuple[Tensor, Tensor]:
    """The ``top_k`` experts of each token and their weights, from the router logits.

    Selection: the ``top_k`` largest logits of the row, in descending order, ties to the lower
    expert id; a NaN logit ranks above every number (``+inf`` included), as in ``torch.topk``, so a
    NaN reaches the weights of its row under both scorings. Selecting on the logits gives the
    same experts as selecting on the softmax probabilities (softmax is monotone) without
    depending on how the exponentials round.

    * ``scoring='softmax'`` (Mixtral, Qwen2/3-MoE, OLMoE): ``p = softmax(router_logits)`` over all
      experts in float32, the weights are ``p`` of the selected experts; ``renormalize=True``
      divides them by their sum (Qwen3's ``norm_topk_prob``; Mixtral always). A NaN anywhere in a
      row makes that row's weights NaN.
    * ``scoring='topk_softmax'`` (gpt-oss): the weights are the softmax of the selected logits.
      They already sum to 1: ``renormalize=True`` is refused. A NaN logit (always among the
      selected) makes the row's weights NaN.

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


def _swiglu_args(activation: str, alpha: Optional[float], limit: Optional[float]):
    """The op's swiglu_alpha / swiglu_limit: gpt-oss's by default with 'swiglu_oai', as floats."""
    if activation == "swiglu_oai":
        alpha = SWIGLU_OAI_ALPHA if alpha is None else alpha
        limit = SWIGLU_OAI_LIMIT if limit is None else limit
    return (None if alpha is None else float(alpha)), (None if limit is None else float(limit))


def fused_moe(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, activation: str = "silu",
    swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None, w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None, *, lib=None,
) -> Tensor:
    """The expert MLPs of a mixture-of-experts layer, weighted and summed per token.

    For token ``t`` and each slot ``j`` with ``e = topk_ids[t, j]``::

        h = x[t] @ w13[e].T (+ w13_bias[e])      # [2I] in fp32: gate = h[:I], up = h[I:]
        a = act(gate, up)                        # [I] in fp32, rounded to x.dtype
        y = a @ w2[e].T (+ w2_bias[e])           # [H] in fp32
        out[t] = sum over j = 0..k-1 (in order, fp32) of topk_weights[t, j] * y, rounded to x.dtype

    ``a`` is rounded to the activation dtype between the two GEMMs, as vLLM's fused_moe does; ``h``
    is not. A token's output depends on its own inputs alone (bit for bit, whatever the batch).
    An id of ``-1`` (a slot routed to no local expert, as with expert parallelism) contributes
    nothing; a token whose slots are all ``-1`` gets zeros.

    * ``activation='silu'`` (Mixtral, Qwen2/3-MoE, OLMoE): ``silu(gate) * up``.
    * ``activation='swiglu_oai'`` (gpt-oss): ``g = min(gate, limit)``, ``u = clamp(up, -limit,
      limit)``, ``(u + 1) * g * sigmoid(alpha * g)``; ``swiglu_alpha`` / ``swiglu_limit`` default
      to gpt-oss's :data:`SWIGLU_OAI_ALPHA` / :data:`SWIGLU_OAI_LIMIT` (and must be None with silu).

    Weight layouts: ``w13`` stacks each expert's gate rows, then its up rows, as vLLM's ``w1`` and
    transformers' Mixtral / Qwen3-MoE ``experts.gate_up_proj`` ``[E, 2I, H]`` (used as is; per-expert
    ``w1`` / ``w3`` / ``w2`` checkpoints pack as ``w13[e] = cat([w1, w3])``); ``w2`` is ``[E, H,
    I]`` (``experts.down_proj``). gpt-oss interleaves gate and up and stores its weights transposed:
    :func:`gpt_oss_expert_weights` converts them.

    Args:
        x: ``[T, H]`` bfloat16 or float16 (float32 on CPU), contiguous; H a multiple of 8.
        w13: ``[E, 2I, H]``, x's dtype, contiguous; I a multiple of 8.
        w2: ``[E, H, I]``, x's dtype, contiguous.
        topk_weights: ``[T, k]`` float32 (:func:`moe_topk`'s weights).
        topk_ids: ``[T, k]`` int32 in ``[-1, E)`` (:func:`moe_topk`'s ids; other values are
            rejected where index values are checked).
        w13_bias: optional ``[E, 2I]`` (gate, then up), x's dtype; w2_bias: optional ``[E, H]``.

    Returns:
        ``out [T, H]`` in x's dtype.

    On CUDA (sm_80+): moe_align, then two grouped tensor-core GEMMs over the slots of each
    expert (gate/up with the activation fused, then down) and the per-token sum in slot order;
    at most 1024 experts. Workspace ``T * k * (I * x.element_size() + 4 * H)`` bytes from the
    caching allocator; no host sync.
    """
    swiglu_alpha, swiglu_limit = _swiglu_args(activation, swiglu_alpha, swiglu_limit)
    return (lib or torch.ops.fastinfer).fused_moe(x, w13, w2, topk_weights, topk_ids, activation,
                                                  swiglu_alpha, swiglu_limit, w13_bias, w2_bias)


def fused_moe_fp8(
    x: Tensor, w13: Tensor, w2: Tensor, w13_scale: Tensor, w2_scale: Tensor, topk_weights: Tensor,
    topk_ids: Tensor, activation: str = "silu", swiglu_alpha: Optional[float] = None,
    swiglu_limit: Optional[float] = None, w13_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None, *,
    lib=None,
) -> Tensor:
    """:func:`fused_moe` with float8_e4m3fn experts, the layouts FP8 checkpoints ship.

    The weights are ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in e4m3 with fp32 scales, either

    * per channel: ``w13_scale [E, 2I]``, ``w2_scale [E, H]`` (a weight row's scale; a per-tensor
      scale is this with every row equal). The GEMM inputs (x, and the activation ``a`` between the
      GEMMs) are quantised per row: ``s = max(amax(row), 1e-12) / 448``, ``q = e4m3(clamp(v / s,
      -448, 448))`` (:func:`fp8_quantize`'s ``'token'`` rule);
    * blockwise, 128 x 128 (DeepSeek-V3, Qwen3-FP8 ``weight_scale_inv``): ``w13_scale [E,
      ceil(2I / 128), ceil(H / 128)]``, ``w2_scale [E, ceil(H / 128), ceil(I / 128)]``; the inputs
      quantised per row and 128-group (``'group'``); H and I multiples of 128.

    Then, for token ``t`` and slot ``j`` with ``e = topk_ids[t, j]``, with ``xq, sx`` the quantised
    row of x and its scales and ``W13 = w13[e] * w13_scale[e]`` (per row, or per block)::

        h = (xq * sx) @ W13.T (+ w13_bias[e])     # fp32 accumulation
        a = act(gate, up)                         # rounded to x.dtype, then quantised as x
        y = (aq * sa) @ W2.T (+ w2_bias[e])
        out[t] = sum over j in order of topk_weights[t, j] * y, rounded to x.dtype

    Everything else (routing, activations, biases, -1 slots, batch invariance) is :func:`fused_moe`'s.
    """
    swiglu_alpha, swiglu_limit = _swiglu_args(activation, swiglu_alpha, swiglu_limit)
    return (lib or torch.ops.fastinfer).fused_moe_fp8(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                                      activation, swiglu_alpha, swiglu_limit,
                                                      w13_bias, w2_bias)


def fused_moe_int4(
    x: Tensor, w13: Tensor, w2: Tensor, w13_scales: Tensor, w2_scales: Tensor, w13_zeros: Optional[Tensor],
    w2_zeros: Optional[Tensor], topk_weights: Tensor, topk_ids: Tensor, group_size: int = 128,
    activation: str = "silu", swiglu_alpha: Optional[float] = None, swiglu_limit: Optional[float] = None,
    w13_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None, *, lib=None,
) -> Tensor:
    """:func:`fused_moe` with INT4 (W4A16) experts: each expert's weights in :func:`int4_gemm`'s
    packed layout with group scales and optional zero points.

    Expert ``e``'s gate/up weight ``W13[e] [2I, H]`` is ``w13[e]`` (``int4_pack`` of its 4-bit
    codes: int32 ``[H / 64, 8 * 2I]``), dequantised as ``(q - z) * s`` with ``s = w13_scales[e][k //
    group_size][n]`` (x's dtype) and ``z = w13_zeros[e][k // group_size][n]`` (uint8 0..15; 8 for
    every weight with ``w13_zeros=None``), the product rounded once to x's dtype (as int4_gemm);
    ``w2`` ``[E, I / 64, 8 * H]`` likewise. Then :func:`fused_moe` on the dequantised weights:
    x is not quantised. The zero points are given for both stacks or for neither. H and I are
    multiples of 64 and of ``group_size`` (a multiple of 32). Per-expert AutoAWQ / GPTQ tensors
    convert with :func:`int4_repack` (act-order, GPTQ's ``g_idx``, is not supported here).

    On CUDA (sm_80+) the grouped GEMMs dequantise the packed words in registers, as int4_gemm does
    (16- and 64-row blocks); otherwise as :func:`fused_moe`.
    """
    swiglu_alpha, swiglu_limit = _swiglu_args(activation, swiglu_alpha, swiglu_limit)
    return (lib or torch.ops.fastinfer).fused_moe_int4(x, w13, w2, w13_scales, w2_scales, w13_zeros, w2_zeros,
                                                       topk_weights, topk_ids, int(group_size), activation,
                                                       swiglu_alpha, swiglu_limit, w13_bias,
                                                       w2_bias)


def fused_moe_fp4(
    x: Tensor, w13: Tensor, w2: Tensor, w13_scales: Tensor, w2_scales: Tensor,
    w13_global_scale: Optional[Tensor], w2_global_scale: Optional[Tensor], topk_weights: Tensor,
    topk_ids: Tensor, format: str = "nvfp4", activation: str = "silu", swiglu_alpha: Optional[float] = None,
    swiglu_limit: Optional[float] = None, w13_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None, *,
    lib=None,
) -> Tensor:
    """:func:`fused_moe` with FP4 (W4A16) experts: each expert's weights in :func:`fp4_gemm`'s
    packed layout (:func:`fp4_repack` of the expert's weight, stacked).

    Expert ``e``'s gate/up weight ``W13[e] [2I, H]`` is ``w13[e]`` (int32 ``[H / 64, 8 * 2I]`` of
    e2m1 codes) with scale bits ``w13_scales[e] [H / G, 2I]`` (uint8): ``format='nvfp4'`` e4m3 scales,
    G = 16; ``'mxfp4'`` e8m0 ``2^(e - 127)``, G = 32 (255, the MX NaN, is refused). Each weight is
    ``e2m1 * s`` with the scale converted to x's dtype and the product rounded to it, as
    :func:`fp4_gemm`; ``w2`` ``[E, I / 64, 8 * H]`` with ``w2_scales [E, I / G, H]`` likewise. NVFP4's
    global scales are divisors (compressed-tensors' ``weight_global_scale``): ``w13_global_scale
    float32 [E, 2]`` (gate, up) and ``w2_global_scale [E]``, both or neither; ``h`` and ``y`` are
    accumulated in fp32 and divided by them in fp32 before the biases. Then :func:`fused_moe`'s
    computation: x is not quantised. H and I are multiples of 64.

    On CUDA (sm_80+) the grouped GEMMs decode the packed words in registers, as fp4_gemm does (the
    kernel of :func:`fused_moe_int4` with the fp4 decoder; 16- and 64-row blocks).
    """
    swiglu_alpha, swiglu_limit = _swiglu_args(activation, swiglu_alpha, swiglu_limit)
    return (lib or torch.ops.fastinfer).fused_moe_fp4(x, w13, w2, w13_scales, w2_scales, w13_global_scale,
                                                      w2_global_scale, topk_weights, topk_ids, format, activation,
                                                      swiglu_alpha, swiglu_limit, w13_bias, w2_bias)


def gpt_oss_expert_weights(gate_up_proj: Tensor, gate_up_proj_bias: Tensor, down_proj: Tensor,
                           down_proj_bias: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """gpt-oss's expert weights (transformers' ``GptOssExperts``) in :func:`fused_moe`'s layout.

    gpt-oss computes ``x @ gate_up_proj[e]`` with ``gate_up_proj [E, H, 2I]`` whose columns
    interleave gate (even) and up (odd), and ``a @ down_proj[e]`` with ``down_proj [E, I, H]``.
    Returns contiguous ``(w13 [E, 2I, H], w13_bias [E, 2I], w2 [E, H, I], w2_bias [E, H])``, the
    gate rows de-interleaved before the up rows.
    """
    w13 = torch.cat([gate_up_proj[..., 0::2], gate_up_proj[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    w13_bias = torch.cat([gate_up_proj_bias[..., 0::2], gate_up_proj_bias[..., 1::2]], dim=-1).contiguous()
    return w13, w13_bias, down_proj.transpose(1, 2).contiguous(), down_proj_bias.contiguous()


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


@fake("fused_moe")
def _fused_moe_fake(ns, x, w13, w2, topk_weights, topk_ids, activation, swiglu_alpha, swiglu_limit, w13_bias,
                    w2_bias):
    op = "fused_moe"
    check_dim(ns, op, "x", x, 2, "[num_tokens, hidden]")
    check_dim(ns, op, "w13", w13, 3, "[num_experts, 2 * intermediate, hidden]")
    check_dim(ns, op, "w2", w2, 3, "[num_experts, hidden, intermediate]")
    check(ns, op, activation in MOE_ACTIVATIONS, f"activation must be 'silu' or 'swiglu_oai', got '{activation}'")
    same_device(ns, op, "x", x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, w13_bias=w13_bias,
                w2_bias=w2_bias)
    return x.new_empty((x.shape[0], x.shape[1]))


@fake("fused_moe_fp8")
def _fused_moe_fp8_fake(ns, x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation, swiglu_alpha,
                        swiglu_limit, w13_bias, w2_bias):
    op = "fused_moe_fp8"
    check_dim(ns, op, "x", x, 2, "[num_tokens, hidden]")
    check_dim(ns, op, "w13", w13, 3, "[num_experts, 2 * intermediate, hidden]")
    check_dim(ns, op, "w2", w2, 3, "[num_experts, hidden, intermediate]")
    check(ns, op, w13.dtype == torch.float8_e4m3fn, f"w13 must be float8_e4m3fn, got {w13.dtype}")
    check(ns, op, activation in MOE_ACTIVATIONS, f"activation must be 'silu' or 'swiglu_oai', got '{activation}'")
    same_device(ns, op, "x", x, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, topk_weights=topk_weights,
                topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias)
    return x.new_empty((x.shape[0], x.shape[1]))


@fake("fused_moe_int4")
def _fused_moe_int4_fake(ns, x, w13, w2, w13_scales, w2_scales, w13_zeros, w2_zeros, topk_weights, topk_ids,
                         group_size, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias):
    op = "fused_moe_int4"
    check_dim(ns, op, "x", x, 2, "[num_tokens, hidden]")
    check_dim(ns, op, "w13", w13, 3, "[num_experts, hidden / 64, 8 * 2 * intermediate]")
    check_dim(ns, op, "w2", w2, 3, "[num_experts, intermediate / 64, 8 * hidden]")
    check(ns, op, w13.dtype == torch.int32, f"w13 must be int32 (int4_pack's layout), got {w13.dtype}")
    check(ns, op, activation in MOE_ACTIVATIONS, f"activation must be 'silu' or 'swiglu_oai', got '{activation}'")
    same_device(ns, op, "x", x, w13=w13, w2=w2, w13_scales=w13_scales, w2_scales=w2_scales, w13_zeros=w13_zeros,
                w2_zeros=w2_zeros, topk_weights=topk_weights, topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias)
    return x.new_empty((x.shape[0], x.shape[1]))


@fake("fused_moe_fp4")
def _fused_moe_fp4_fake(ns, x, w13, w2, w13_scales, w2_scales, w13_global_scale, w2_global_scale, topk_weights,
                        topk_ids, format, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias):
    op = "fused_moe_fp4"
    check_dim(ns, op, "x", x, 2, "[num_tokens, hidden]")
    check_dim(ns, op, "w13", w13, 3, "[num_experts, hidden / 64, 8 * 2 * intermediate]")
    check_dim(ns, op, "w2", w2, 3, "[num_experts, intermediate / 64, 8 * hidden]")
    check(ns, op, w13.dtype == torch.int32, f"w13 must be int32 (fp4_repack's layout), got {w13.dtype}")
    check(ns, op, format in ("nvfp4", "mxfp4"), f"format must be 'nvfp4' or 'mxfp4', got '{format}'")
    check(ns, op, activation in MOE_ACTIVATIONS, f"activation must be 'silu' or 'swiglu_oai', got '{activation}'")
    same_device(ns, op, "x", x, w13=w13, w2=w2, w13_scales=w13_scales, w2_scales=w2_scales,
                w13_global_scale=w13_global_scale, w2_global_scale=w2_global_scale, topk_weights=topk_weights,
                topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias)
    return x.new_empty((x.shape[0], x.shape[1]))
