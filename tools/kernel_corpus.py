"""A fixed corpus of kernel op outputs, as hashes of their bytes, to show that a change to the
kernels' structure leaves every output bit for bit as it was.

    python tools/kernel_corpus.py write before.json        # with the build before the change
    python tools/kernel_corpus.py compare before.json      # with the build after it

The cases run the CUDA kernel sources through the emulator (``torch.ops.fastinfer_sim``; on a GPU,
``--backend cuda``):

* attention: the prefill kernel's modes (default, the default-mode key split, the deterministic
  fold, split-parallel and tree phases), contiguous and paged K/V, fp8 caches, tree masks, windows,
  softcap and sinks, for each head dim and half dtype; decode beside it;
* gemm: fp8_scaled_mm (per tensor, per token x per channel, blockwise; bias; deterministic),
  int8_scaled_mm (zero points too), dense_mm and int4_gemm (groups, zero points, AWQ / GPTQ
  checkpoints, act-order, split-K, the dequantise path), over each kernel configuration's M
  bucket with M, N and K tails;
* quantize: fp8_quantize (token, group, tensor) and int8_quantize (token symmetric / asymmetric,
  tensor), with rows of zeros, infinities, NaNs and saturating values, rows short enough to stay
  in registers and longer ones;
* moe: moe_topk (both scorings), moe_align, and fused_moe / fused_moe_fp8 (per channel,
  blockwise) / fused_moe_int4 (symmetric, zero points) / fused_moe_fp4 (NVFP4 with global scales,
  MXFP4) over their tile tiers, silu and gpt-oss's swiglu with biases, -1 slots.

Inputs come from fixed seeds, so two builds see the same bytes; the test overrides
(docs/design.md) force the plans that the shapes would not choose on their own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Callable, Dict, List, Tuple

import torch

Case = Tuple[str, Dict[str, str], Callable[[], Tuple[torch.Tensor, ...]]]


def _randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def _tree_mask(q_len: int, gen) -> torch.Tensor:
    """A random tree over q_len nodes (node i's parent an earlier node), row i seeing its ancestors."""
    from fastinfer.reference import random_tree_parents, tree_mask

    return tree_mask(random_tree_parents(q_len, gen)).flatten()


def _paged(k_lens, hkv, d, dtype, gen, block_size=16, fp8=False):
    blocks = [(n + block_size - 1) // block_size for n in k_lens]
    nb = sum(blocks) + 3
    perm = torch.randperm(nb, generator=gen).to(torch.int32)
    table = torch.zeros(len(k_lens), max(blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[at:at + n]
        at += n
    k = _randn((nb, block_size, hkv, d), dtype, gen)
    v = _randn((nb, block_size, hkv, d), dtype, gen)
    if fp8:
        k, v = (k.float() * 8).to(torch.float8_e4m3fn), (v.float() * 8).to(torch.float8_e4m3fn)
    return k, v, table, torch.tensor(k_lens, dtype=torch.int32)


def attention_cases(ns, dtypes, head_dims) -> List[Case]:
    out: List[Case] = []
    for dtype in dtypes:
        for d in head_dims:
            tag = f"{str(dtype)[6:]}-d{d}"

            def contiguous(q_lens, k_lens, hq, hkv, causal, window, softcap, fixed, sinks, seed, dtype=dtype, d=d):
                def run():
                    g = torch.Generator().manual_seed(seed)
                    q = _randn((sum(q_lens), hq, d), dtype, g)
                    k, v = _randn((sum(k_lens), hkv, d), dtype, g), _randn((sum(k_lens), hkv, d), dtype, g)
                    s = torch.randn(hq, generator=g) if sinks else None
                    return ns.prefill_attention(q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens),
                                                d ** -0.5, causal, window, softcap, True, fixed, s)
                return run

            def paged(q_lens, k_lens, hq, hkv, window, fixed, tree, fp8, sinks, seed, dtype=dtype, d=d):
                def run():
                    g = torch.Generator().manual_seed(seed)
                    q = _randn((sum(q_lens), hq, d), dtype, g)
                    kc, vc, table, lens = _paged(k_lens, hkv, d, dtype, g, fp8=fp8)
                    mask = torch.cat([_tree_mask(n, g) for n in q_lens]) if tree else None
                    s = torch.randn(hq, generator=g) if sinks else None
                    ks = (torch.rand(hkv, generator=g) * 0.2 + 0.05) if fp8 else None
                    vs = (torch.rand(hkv, generator=g) * 0.2 + 0.05) if fp8 else None
                    return ns.paged_prefill_attention(q, kc, vc, table, _cu(q_lens), lens, max(q_lens), d ** -0.5,
                                                      True, window, 0.0, mask, True, None, fixed, s, ks, vs)
                return run

            def decode(k_lens, hq, hkv, splits, fixed, fp8, sinks, seed, dtype=dtype, d=d):
                def run():
                    g = torch.Generator().manual_seed(seed)
                    q = _randn((len(k_lens), hq, d), dtype, g)
                    kc, vc, table, lens = _paged(k_lens, hkv, d, dtype, g, fp8=fp8)
                    s = torch.randn(hq, generator=g) if sinks else None
                    ks = torch.tensor([0.07]) if fp8 else None
                    vs = torch.tensor([0.11]) if fp8 else None
                    return ns.paged_decode_attention(q, kc, vc, table, lens, d ** -0.5, -1, 0.0, splits, True, ks, vs,
                                                     fixed, s)
                return run

            none: Dict[str, str] = {}
            split3 = {"FASTINFER_TEST_DEFAULT_KEY_SPLITS": "3"}
            out += [
                (f"prefill-{tag}-causal", none, contiguous([37, 5, 70], [37, 9, 70], 4, 2, True, -1, 0.0, 0, False, 1)),
                (f"prefill-{tag}-noncausal-softcap", none, contiguous([20, 3], [45, 130], 6, 2, False, -1, 30.0, 0, False, 2)),
                (f"prefill-{tag}-window-sinks", none, contiguous([90], [90], 4, 1, True, 17, 0.0, 0, True, 3)),
                (f"prefill-{tag}-split", split3, contiguous([9, 4], [200, 150], 4, 2, True, -1, 0.0, 0, True, 4)),
                (f"prefill-{tag}-fold", none, contiguous([33, 70], [160, 70], 4, 2, True, -1, 0.0, 64, True, 5)),
                (f"paged-{tag}-chunk", none, paged([12, 30], [140, 30], 8, 2, -1, 0, False, False, False, 6)),
                (f"paged-{tag}-split-fp8", split3, paged([5, 16], [300, 90], 4, 2, -1, 0, False, True, True, 7)),
                (f"paged-{tag}-tree-window", none, paged([9, 16], [100, 40], 4, 2, 20, 0, True, False, False, 8)),
                (f"paged-{tag}-fold-tree-shared", {"FASTINFER_TEST_FIXED_TREE_PREFIX": "shared"},
                 paged([9, 16], [200, 100], 4, 2, -1, 64, True, False, True, 9)),
                (f"paged-{tag}-fold-tree-per-token", {"FASTINFER_TEST_FIXED_TREE_PREFIX": "per-token"},
                 paged([9, 16], [200, 100], 4, 2, -1, 64, True, True, False, 10)),
                (f"paged-{tag}-fold", none, paged([40, 7], [170, 7], 4, 2, -1, 128, False, True, True, 11)),
                (f"decode-{tag}-splits", none, decode([300, 17, 129], 8, 2, 3, 0, False, True, 12)),
                (f"decode-{tag}-fp8", none, decode([77, 250], 4, 4, 0, 0, True, False, 13)),
                (f"decode-{tag}-fixed", {"FASTINFER_TEST_FIXED_SPLIT_PARTIAL_BYTES": "4096"},
                 decode([300, 17, 129], 8, 2, 0, 64, False, True, 14)),
            ]
    return out


def _e4m3(shape, gen):
    """e4m3 codes over most of the range (finite, never all zero)."""
    v = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen))
    return (v * 32).clamp(-448, 448).to(torch.float8_e4m3fn)


def _int8(shape, gen):
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


def _positive(shape, gen):
    return (torch.rand(shape, generator=gen) + 0.25) * 0.01


def _special_rows(rows, cols, dtype, gen):
    """Activations whose first rows are the edge cases of a dynamic scale (all zeros, a +inf, a NaN,
    values that overflow fp16: inf once cast), then plain random rows of varying magnitude."""
    x = torch.randn(rows, cols, generator=gen) * torch.exp(2 * torch.randn(rows, 1, generator=gen))
    if rows > 3:
        x[0] = 0.0
        x[1, cols // 3] = float("inf")
        x[2, cols // 2] = float("nan")
        x[3, :: max(1, cols // 7)] = 1e6
    return x.to(dtype)


def gemm_cases(ns, dtypes) -> List[Case]:
    out: List[Case] = []

    def fp8_mm(m, n, k, mode, bias, deterministic, dtype, seed):
        def run():
            g = torch.Generator().manual_seed(seed)
            a, b = _e4m3((m, k), g), _e4m3((n, k), g)
            kb, nb = (k + 127) // 128, (n + 127) // 128
            sa, sb = {"tensor": ((1,), (1,)), "token-channel": ((m,), (n,)), "token-tensor": ((m,), (1,)),
                      "tensor-channel": ((1,), (n,)), "block": ((m, kb), (nb, kb))}[mode]
            sa, sb = _positive(sa, g), _positive(sb, g)
            bv = (torch.randn(n, generator=g) * 4).to(dtype) if bias else None
            return ns.fp8_scaled_mm(a, b, sa, sb, dtype, bv, deterministic)
        return run

    def int8_mm(m, n, k, per_row, per_col, bias, azp, deterministic, dtype, seed):
        def run():
            g = torch.Generator().manual_seed(seed)
            a, b = _int8((m, k), g), _int8((n, k), g)
            sa, sb = _positive((m if per_row else 1,), g), _positive((n if per_col else 1,), g)
            bv = (torch.randn(n, generator=g) * 4).to(dtype) if bias else None
            zp = adj = None
            if azp:
                zp = torch.randint(-128, 128, (m if azp == "row" else 1,), generator=g, dtype=torch.int32)
                adj = b.sum(1, dtype=torch.int32)
            return ns.int8_scaled_mm(a, b, sa, sb, dtype, bv, adj, zp, deterministic)
        return run

    def dense(m, n, k, bias, dtype, seed):
        def run():
            g = torch.Generator().manual_seed(seed)
            a, b = _randn((m, k), dtype, g), _randn((n, k), dtype, g)
            bv = _randn((n,), dtype, g) if bias else None
            return ns.dense_mm(a, b, bv)
        return run

    def int4(m, n, k, group, fmt, zeros, deterministic, dtype, seed):
        """fmt: 'pack' (int4_pack of 4-bit values), 'awq', 'gptq' or 'gptq-act-order' (int4_repack)."""
        def run():
            g = torch.Generator().manual_seed(seed)
            a = _randn((m, k), dtype, g)
            scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(dtype)
            perm = None
            if fmt == "pack":
                packed = ns.int4_pack(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
                z = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.uint8) if zeros else None
            else:
                words = lambda *s: torch.randint(-2 ** 31, 2 ** 31, s, generator=g, dtype=torch.int32)  # noqa: E731
                qweight = words(k, n // 8) if fmt == "awq" else words(k // 8, n)
                qzeros = words(k // group, n // 8)
                g_idx = None
                if fmt == "gptq-act-order":  # every group keeps group_size members, in a shuffled order
                    g_idx = torch.empty(k, dtype=torch.int32)
                    g_idx[torch.randperm(k, generator=g)] = (torch.arange(k) // group).to(torch.int32)
                packed, z, perm = ns.int4_repack(qweight, qzeros, "awq" if fmt == "awq" else "gptq", g_idx)
                perm = perm if g_idx is not None else None
            return ns.int4_gemm(a, packed, scales, z, group, perm, deterministic)
        return run

    seed = 100
    for dtype in dtypes:
        tag = str(dtype)[6:]
        # M buckets: <= 16 small tiles, <= 64 medium, larger large (blockwise: medium above 16)
        for m, n, k, mode, bias, det in [
            (1, 64, 128, "tensor", False, False),
            (5, 48, 272, "token-channel", True, False),
            (5, 192, 384, "block", True, False),
            (33, 144, 256, "block", True, False),
            (33, 32, 16, "token-channel", False, True),
            (33, 128, 160, "token-tensor", False, False),
            (80, 80, 384, "tensor-channel", True, False),
            (80, 144, 272, "block", False, True),
            (16, 64, 256, "token-channel", True, False),
            (64, 128, 128, "block", False, False),
            (64, 96, 512, "tensor", False, False),
        ]:
            seed += 1
            out.append((f"fp8_scaled_mm-{tag}-m{m}-n{n}-k{k}-{mode}{'-bias' if bias else ''}"
                        f"{'-deterministic' if det else ''}", {}, fp8_mm(m, n, k, mode, bias, det, dtype, seed)))
        for m, n, k, per_row, per_col, bias, azp, det in [
            (1, 64, 128, False, False, False, None, False),
            (5, 48, 272, True, True, True, "row", False),
            (33, 144, 256, True, False, False, "tensor", False),
            (33, 32, 16, True, True, False, None, True),
            (80, 80, 384, False, True, True, "row", True),
            (16, 64, 256, True, True, False, "row", False),
            (64, 128, 128, False, False, True, None, False),
        ]:
            seed += 1
            out.append((f"int8_scaled_mm-{tag}-m{m}-n{n}-k{k}-{'token' if per_row else 'tensor'}-"
                        f"{'channel' if per_col else 'tensor'}{'-bias' if bias else ''}"
                        f"{'-azp-' + azp if azp else ''}{'-deterministic' if det else ''}", {},
                        int8_mm(m, n, k, per_row, per_col, bias, azp, det, dtype, seed)))
        for m, n, k, bias in [(1, 64, 64, False), (5, 130, 200, True), (16, 64, 128, True), (33, 96, 136, True),
                                (64, 128, 64, False), (80, 130, 256, False)]:
            seed += 1
            out.append((f"dense_mm-{tag}-m{m}-n{n}-k{k}{'-bias' if bias else ''}", {}, dense(m, n, k, bias, dtype, seed)))
        for m, n, k, group, fmt, zeros, det in [
            (1, 32, 128, 32, "pack", False, False),
            (5, 144, 192, 96, "pack", True, False),
            (16, 32, 128, 64, "pack", True, False),
            (32, 144, 128, 32, "pack", False, False),
            (33, 64, 256, 64, "pack", True, False),
            (64, 32, 192, 192, "pack", True, False),
            (33, 128, 256, 256, "pack", False, False),
            (5, 144, 512, 128, "pack", True, True),
            (40, 64, 256, 128, "awq", True, False),
            (5, 32, 256, 64, "gptq", True, False),
            (17, 32, 256, 64, "gptq-act-order", True, False),
            (512, 32, 128, 64, "pack", True, False),  # M >= 512: the dequantise kernel + matmul
        ]:
            seed += 1
            out.append((f"int4_gemm-{tag}-m{m}-n{n}-k{k}-g{group}-{fmt}{'-zeros' if zeros else ''}"
                        f"{'-deterministic' if det else ''}", {}, int4(m, n, k, group, fmt, zeros, det, dtype, seed)))
    return out


def quantize_cases(ns, dtypes) -> List[Case]:
    out: List[Case] = []

    def fp8_q(rows, cols, mode, group, given, dtype, seed):
        def run():
            g = torch.Generator().manual_seed(seed)
            x = _special_rows(rows, cols, dtype, g)
            scale = torch.tensor([0.004]) if given else None  # small: many values saturate at +-448
            return ns.fp8_quantize(x, mode, group, scale)
        return run

    def int8_q(rows, cols, mode, symmetric, given, dtype, seed):
        def run():
            g = torch.Generator().manual_seed(seed)
            x = _special_rows(rows, cols, dtype, g)
            scale = torch.tensor([0.01]) if given else None
            return ns.int8_quantize(x, mode, scale, symmetric)
        return run

    seed = 500
    for dtype in dtypes:
        tag = str(dtype)[6:]
        # token rows of K <= 8192 stay in registers; 8456 re-reads x after the reduction
        for rows, cols, mode, group, given in [
            (7, 256, "token", 128, False), (5, 8456, "token", 128, False), (1, 64, "token", 128, False),
            (6, 512, "group", 128, False), (5, 96, "group", 8, False), (4, 256, "group", 256, False),
            (5, 192, "group", 32, False), (33, 128, "group", 64, False),
            (6, 384, "tensor", 128, False), (5, 136, "tensor", 128, True), (33, 4104, "tensor", 128, False),
        ]:
            seed += 1
            out.append((f"fp8_quantize-{tag}-{rows}x{cols}-{mode}{'-g' + str(group) if mode == 'group' else ''}"
                        f"{'-given' if given else ''}", {}, fp8_q(rows, cols, mode, group, given, dtype, seed)))
        for rows, cols, mode, symmetric, given in [
            (7, 256, "token", True, False), (7, 256, "token", False, False), (5, 8456, "token", True, False),
            (5, 8456, "token", False, False), (1, 64, "token", False, False), (33, 136, "token", False, False),
            (6, 384, "tensor", True, False), (5, 136, "tensor", True, True), (33, 4104, "tensor", True, False),
        ]:
            seed += 1
            out.append((f"int8_quantize-{tag}-{rows}x{cols}-{mode}-{'sym' if symmetric else 'asym'}"
                        f"{'-given' if given else ''}", {}, int8_q(rows, cols, mode, symmetric, given, dtype, seed)))
    return out


def moe_cases(ns, dtypes) -> List[Case]:
    out: List[Case] = []

    def routing(T, E, k, scoring, seed):
        def run():
            gen = torch.Generator().manual_seed(seed)
            logits = _randn((T, E), torch.float32, gen)
            w, ids = ns.moe_topk(logits, k, scoring == "softmax", scoring)
            return w, ids, *ns.moe_align(ids, E, 16)
        return run

    def experts(T, E, k, H, I, fmt, activation, dtype, seed):
        def run():
            gen = torch.Generator().manual_seed(seed)
            x = _randn((T, H), dtype, gen)
            w13 = _randn((E, 2 * I, H), torch.float32, gen) * H ** -0.5
            w2 = _randn((E, H, I), torch.float32, gen) * I ** -0.5
            scores = torch.rand((T, E), generator=gen)
            ids = torch.topk(scores, k, dim=-1).indices.int()
            ids[torch.rand((T, k), generator=gen) < 0.2] = -1
            weights = torch.rand((T, k), generator=gen) + 0.1
            swiglu = (1.702, 7.0) if activation == "swiglu_oai" else (None, None)
            b13 = _randn((E, 2 * I), dtype, gen) if activation == "swiglu_oai" else None
            b2 = _randn((E, H), dtype, gen) if activation == "swiglu_oai" else None
            if fmt == "float":
                return ns.fused_moe(x, w13.to(dtype), w2.to(dtype), weights, ids, activation, *swiglu, b13, b2)
            if fmt.startswith("fp8"):
                def quant(w):
                    if fmt == "fp8-block":
                        e, n, kk = w.shape
                        blocks = w.reshape(e, n // 128, 128, kk // 128, 128)
                        s = blocks.abs().amax(dim=(2, 4)) / 448
                        return (blocks / s[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(e, n, kk), s
                    s = w.abs().amax(-1) / 448
                    return (w / s[..., None]).to(torch.float8_e4m3fn), s
                (q13, s13), (q2, s2) = quant(w13), quant(w2)
                return ns.fused_moe_fp8(x, q13, q2, s13, s2, weights, ids, activation, *swiglu, b13, b2)
            if fmt in ("nvfp4", "mxfp4"):  # random e2m1 codes, e4m3 0.125 .. 8 or e8m0 2^-5 .. 2^4 scales
                group, (lo, hi) = (16, (0x28, 0x50)) if fmt == "nvfp4" else (32, (122, 132))
                packs = []
                for w in (w13, w2):
                    q = torch.randint(0, 16, w.shape, generator=gen, dtype=torch.uint8)
                    packed = torch.stack([torch.ops.fastinfer.int4_pack(q[e]) for e in range(E)])
                    bits = torch.randint(lo, hi, (E, w.shape[2] // group, w.shape[1]), generator=gen,
                                         dtype=torch.int32).to(torch.uint8)
                    packs.append((packed, bits))
                (p13, s13), (p2, s2) = packs
                g13, g2 = ((torch.rand((E, 2), generator=gen) + 1, torch.rand((E,), generator=gen) + 1)
                           if fmt == "nvfp4" else (None, None))
                return ns.fused_moe_fp4(x, p13, p2, s13, s2, g13, g2, weights, ids, fmt, activation, *swiglu, b13, b2)
            zeros = fmt == "int4-zeros"
            packs = []
            for w in (w13, w2):
                q = torch.randint(0, 16, w.shape, generator=gen, dtype=torch.uint8)
                packed = torch.stack([torch.ops.fastinfer.int4_pack(q[e]) for e in range(E)])
                groups = w.shape[2] // 64
                scales = (torch.rand((E, groups, w.shape[1]), generator=gen) * 0.02).to(dtype)
                z = torch.randint(0, 16, (E, groups, w.shape[1]), generator=gen, dtype=torch.uint8) if zeros else None
                packs.append((packed, scales, z))
            (p13, s13, z13), (p2, s2, z2) = packs
            return ns.fused_moe_int4(x, p13, p2, s13, s2, z13, z2, weights, ids, 64, activation, *swiglu, b13, b2)
        return run

    for T, E, k, scoring in ((1, 8, 2, "softmax"), (37, 60, 4, "softmax"), (37, 32, 4, "topk_softmax")):
        out.append((f"moe_routing-T{T}-E{E}-k{k}-{scoring}", {}, routing(T, E, k, scoring, seed=T + E)))
    for dtype in dtypes:
        tag = str(dtype).replace("torch.", "")
        # T * k / E rows per expert: <= 16 (16-row blocks), <= 64 (64-row), more (128-row for float)
        # T * k / E rows per expert: <= 16 (16-row blocks), <= 64 and 300 on 2 col tiles (64-row);
        # float's 128-row tier needs the blocks to fill 132 SMs: 1100 tokens, H 1024
        shapes = [(T, E, k, 256, 128, fmt) for T, E, k in ((3, 8, 2), (37, 2, 2), (300, 2, 2))
                  for fmt in ("float", "fp8-channel", "fp8-block", "int4", "int4-zeros", "nvfp4", "mxfp4")]
        for T, E, k, H, I, fmt in shapes + [(1100, 2, 2, 1024, 16, "float")]:
            for activation in ("silu", "swiglu_oai"):
                out.append((f"moe_{fmt}-{tag}-T{T}-E{E}-k{k}-H{H}-I{I}-{activation}", {},
                            experts(T, E, k, H, I, fmt, activation, dtype, seed=T * 7 + E)))
    return out


FAMILIES = ("attention", "gemm", "quantize", "moe")


def cases(ns, families, dtypes, head_dims) -> List[Case]:
    out: List[Case] = []
    if "attention" in families:
        out += attention_cases(ns, dtypes, head_dims)
    if "gemm" in families:
        out += gemm_cases(ns, dtypes)
    if "quantize" in families:
        out += quantize_cases(ns, dtypes)
    if "moe" in families:
        out += moe_cases(ns, dtypes)
    return out


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in (tensors,) if isinstance(tensors, torch.Tensor) else tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_corpus(backend: str, families, dtypes, head_dims) -> Dict[str, str]:
    import fastinfer  # noqa: F401

    if backend == "sim":
        import fastinfer._sim  # noqa: F401
        ns, device = torch.ops.fastinfer_sim, "cpu"
    else:
        ns, device = torch.ops.fastinfer, "cuda"
    result = {}
    for name, env, run in cases(ns, families, dtypes, head_dims):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with torch.device(device):
                result[name] = digest(run())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("write", "compare"))
    ap.add_argument("path")
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of " + ", ".join(FAMILIES))
    ap.add_argument("--head-dims", default="64,128,256", help="attention head dims")
    args = ap.parse_args(argv)
    families = args.families.split(",")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}")
    head_dims = [int(x) for x in args.head_dims.split(",")]
    got = run_corpus(args.backend, families, (torch.float16, torch.bfloat16), head_dims)
    if args.action == "write":
        with open(args.path, "w") as f:
            json.dump({"backend": args.backend, "digests": got}, f, indent=1, sort_keys=True)
        print(f"{len(got)} outputs written to {args.path}")
        return 0
    with open(args.path) as f:
        want = json.load(f)["digests"]
    common = sorted(set(want) & set(got))
    differ = [n for n in common if want[n] != got[n]]
    for n in differ:
        print(f"differs: {n}")
    print(f"{len(common) - len(differ)} of {len(common)} outputs bitwise equal"
          f" ({len(set(got) - set(want))} new, {len(set(want) - set(got))} missing)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
