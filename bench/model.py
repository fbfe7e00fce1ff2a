#!/usr/bin/env python
"""A MODEL of H200 time for every kernel family at the benchmark shapes -- not a measurement.

Every figure this script prints or writes is a model output (labelled "model"): exact counters of
the emulated execution of our kernel sources (the simt profiler: cpp/simt/README.md, "Profiling")
combined with the ptxas resource report and the launch grid into an idealised H200 time. Nothing
here was timed on a GPU.

Per case (a benchmark shape of bench/ops.py, attention.py, gemm_fp8.py, gemm_int4.py (and fp4_gemm
at its shapes), gemm_int8.py, tree_verify.py -- the decode contexts whose KV cache fits a few GB of
host memory, the 70B GEMM layers at decode sizes M = 1, 16; merge_attention_states, move_kv_slots,
fp8_quantize and int8_quantize, which no benchmark times, at representative shapes):

1. The op runs once through ``fastinfer.simt.profile`` (the profile build of the sim kernels) at
   the benchmark shape itself, so grids, split heuristics and per-CTA work are the real ones.
   Where the emulator would be too slow, only about one CTA in ``sample`` runs (a lattice: every
   sample-th blockIdx.x at an offset per blockIdx.y spread over the residues, so work that varies
   along x is sampled without bias; all blockIdx.z of a chosen pair, so split-K / split-KV
   partitions stay whole). **Scaling rule**: a launch's counters (DRAM sectors, mma) are multiplied by
   CTAs in the grid / CTAs that ran; per-request ratios (sectors/request, wavefronts/request)
   need no scaling. For families whose CTAs re-read shared operands (prefill attention, the
   GEMMs) a sampled subset would count every CTA's re-reads as DRAM traffic, so there the model
   DRAM bytes are the ideal bytes times the measured sector over-fetch of the global accesses
   (L2 is assumed to hold the reuse; the profiler cannot see L2 hits), plus the split-K partials
   of int4_gemm and fp4_gemm (2 x splits x M x N x 4 bytes), which are not part of the ideal.
2. DRAM bytes (model) = distinct 32-byte sectors read + written per launch (a lower bound on HBM
   traffic); ideal bytes = every input read once and every output written once.
3. Occupancy: CTAs per SM from registers (ptxas report, sm_90a; 64K registers, 256-register warp
   granules), shared memory (static from ptxas + dynamic + 1 KB reserved, 228 KB per SM), threads
   (2048) and the 32-CTA limit. Waves = CTAs / (132 SMs x CTAs per SM).
4. Time (model) per launch = max(DRAM bytes / 4.3 TB/s, tensor-core FLOPs / 790 TFLOP/s bf16 or
   1580 fp8 / int8 (TOP/s, the same assumed rate)) / SM balance,
   with SM balance = CTAs / (132 x ceil(CTAs / 132)): the CTAs are spread
   over the SMs in waves of 132, every SM that holds work delivers its 1/132 of the chip's
   throughput (shared by the CTAs resident on it), so a launch of fewer than 132 CTAs leaves SMs
   idle and a partial last wave leaves some SMs with one CTA less. An op's time is the sum over
   its launches; roofline = max(ideal bytes / 4.3 TB/s, useful FLOPs / peak); fraction = roofline
   / time. Launches with fewer CTAs than the GPU can hold resident (less than one wave of
   132 x CTAs per SM) are flagged: whether their CTAs keep enough loads in flight to reach the
   SM's share is latency hiding, which the model cannot see.

Two further figures per case, for the work a launch does rather than its time:

- requested bytes (model) = the 32-byte sectors of every global access the CTAs issue (loads,
  stores, the global side of cp.async), times 32, scaled by CTAs in the grid / CTAs that ran: the
  traffic between the SMs and L2, which is also the HBM traffic when L2 holds no reuse. Where the
  CTAs of a kernel re-read shared operands (K/V tiles read by several CTAs) it exceeds the DRAM
  bytes above (which assume L2 serves every re-read).
- CTAs launched / CTAs that stored: the grid, and the CTAs that wrote global memory (the
  profiler's blocks_storing, scaled like the other counters): CTAs that exit without writing
  (early-exit CTAs of a grid sized for the longest sequence) are launched but do no work.

What the model cannot see: latency hiding (an SM with at least one CTA is assumed to reach its
share of the roofline), L2 hits beyond the rule above, instruction issue limits (CUDA-core math,
shuffles, ldmatrix/mma issue), launch overhead, clocks, and the sm_90a CUTLASS fp8 kernel (the
emulator runs the mma.sync path, which H200 uses for blockwise scales and as the fallback).

On a GPU the same cases run on the CUDA ops (bench/gpu_cases.py, under ncu in bench/gpu_check.sh),
and bench/compare_model.py sets the measured counters and times against these model figures (the
metric mapping: bench/ncu_metrics.py); each row's ``kernel_lines`` holds the per-kernel line
summaries that comparison uses.

    python bench/model.py [--quick] [--only FAMILY,...] [--json PATH] [--label before|after]
    python bench/model.py --compare bench/results/model-before.json bench/results/model-after.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import defaultdict

import torch

import fastinfer
import fastinfer.simt as simt

try:
    import fastinfer._sim  # noqa: F401  (torch.ops.fastinfer_sim, used for reference runs)
except ImportError:  # a build without the sim module: bench/gpu_cases.py runs the cases on CUDA only
    pass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import git_commit  # noqa: E402

H200 = dict(
    name="H200 SXM (model constants)", sms=132, regs_per_sm=65536, reg_granule_per_warp=256, max_regs_per_thread=255,
    smem_per_sm=233472, smem_reserved_per_cta=1024, smem_granule=128, max_ctas_per_sm=32, max_threads_per_sm=2048,
    hbm_bytes_per_s=4.3e12, tc_flops_per_s={"bf16": 790e12, "fp8": 1580e12, "int8": 1580e12},
)
LABEL = "MODEL: simt emulator counters + ptxas report + H200 constants; not a GPU measurement"

# Llama-3-8B shapes (bench/ops.py, attention.py)
HIDDEN, FFN, HQ, HKV, HEAD_DIM, BLOCK = 4096, 14336, 32, 8, 128, 16


# bench/gpu_cases.py sets this to an object whose attributes are the ops on the GPU (torch.ops.fastinfer
# with the inputs moved to CUDA), to run the very same cases there.
_OPS = None


# --fixed-split F: run the attention cases in the deterministic mode (fixed_split_size = F) to
# model its cost against a default run of the same cases (--compare of the two JSON files).
FIXED_SPLIT = 0


def _fixed():
    return dict(fixed_split_size=FIXED_SPLIT) if FIXED_SPLIT > 0 else {}


def ns():
    if _OPS is not None:
        return _OPS
    return torch.ops.fastinfer_sim  # looked up at call time: fastinfer.simt.profile swaps it


# ---- ptxas report ------------------------------------------------------------------------------
def load_ptxas(arch="sm_90a"):
    """{normalised demangled kernel name: {"registers": int, "smem": int}} from the build's report."""
    path = os.path.join(os.path.dirname(fastinfer.__file__), "ptxas_report.txt")
    if not os.path.exists(path):
        return {}, None
    entries, cur = {}, None
    for line in open(path):
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            cur = m.group(1) if m.group(2) == arch else None
            if cur:
                entries.setdefault(cur, {"registers": 0, "smem": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entries[cur]["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            entries[cur]["smem"] = int(s.group(1)) if s else 0
    names = list(entries)
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    demangled = r.stdout.splitlines() if r.returncode == 0 else names
    return {_norm(d): entries[n] for n, d in zip(names, demangled)}, path


def _norm(name: str) -> str:
    return re.sub(r"\s+", "", name)


# ---- occupancy, waves, time --------------------------------------------------------------------
def occupancy(threads, regs, smem_static, smem_dynamic, dev=H200):
    warps = math.ceil(threads / 32)
    lim = {"threads": dev["max_threads_per_sm"] // (warps * 32), "ctas": dev["max_ctas_per_sm"]}
    if regs:
        per_warp = math.ceil(regs * 32 / dev["reg_granule_per_warp"]) * dev["reg_granule_per_warp"]
        lim["registers"] = (dev["regs_per_sm"] // per_warp) // warps
    smem = smem_static + smem_dynamic + dev["smem_reserved_per_cta"]
    smem = math.ceil(smem / dev["smem_granule"]) * dev["smem_granule"]
    lim["shared memory"] = dev["smem_per_sm"] // smem
    limiter = min(lim, key=lambda k: (lim[k], k != "registers"))
    ctas = max(lim[limiter], 0)
    return ctas, limiter, ctas * warps / 64


def launch_model(rec, kname, ptxas, peak_kind, dram_bytes, flops, dev=H200):
    grid = rec["grid"]
    ctas = grid[0] * grid[1] * grid[2]
    storing = rec.get("blocks_storing")
    ctas_storing = round(storing * ctas / max(rec["blocks_run"], 1)) if storing is not None else None
    threads = rec["block"][0] * rec["block"][1] * rec["block"][2]
    info = ptxas.get(_norm(kname))
    regs = info["registers"] if info else None
    smem_static = info["smem"] if info else 0
    per_sm, limiter, occ = occupancy(threads, regs, smem_static, rec["dynamic_smem"], dev)
    slots = dev["sms"] * max(per_sm, 1)
    waves = ctas / slots  # waves of resident CTAs (occupancy)
    eff = ctas / (dev["sms"] * math.ceil(ctas / dev["sms"])) if ctas else 1.0  # SM balance
    t_hbm = dram_bytes / dev["hbm_bytes_per_s"]
    t_tc = flops / dev["tc_flops_per_s"][peak_kind] if flops and peak_kind else 0.0
    t = max(t_hbm, t_tc) / eff
    return dict(kernel=kname, grid=grid, ctas=ctas, threads_per_cta=threads, registers=regs,
                registers_known=info is not None, smem_static=smem_static, smem_dynamic=rec["dynamic_smem"],
                ctas_per_sm=per_sm, occupancy_limiter=limiter, occupancy=round(occ, 3), waves=round(waves, 3),
                sm_balance=round(eff, 3), ctas_run=rec["blocks_run"], ctas_storing=ctas_storing,
                model_dram_bytes=int(dram_bytes), model_tensor_flops=int(flops),
                model_t_hbm_us=t_hbm * 1e6, model_t_tc_us=t_tc * 1e6, model_time_us=t * 1e6)


# ---- per-line summaries --------------------------------------------------------------------------
GLOBAL_OPS = ("ld.global", "st.global", "cp.async")
SHARED_OPS = ("ld.shared", "st.shared", "ldmatrix", "cp.async")


def summarise_lines(kernels):
    g = dict(requests=0, sectors=0, ideal=0)
    s = dict(requests=0, wavefronts=0, ideal=0)
    worst_g, worst_s = None, None
    for k in kernels:
        ksec = sum(e["sectors"] for e in k["lines"]) or 1
        kwav = sum(e["wavefronts"] for e in k["lines"]) or 1
        for e in k["lines"]:
            is_g = e["op"] in GLOBAL_OPS or (e["op"] == "atomic" and e["space"] == "global")
            is_s = e["op"] in SHARED_OPS or (e["op"] == "atomic" and e["space"] == "shared")
            if is_g and e["sectors"]:
                g["requests"] += e["requests"]
                g["sectors"] += e["sectors"]
                g["ideal"] += e["ideal_sectors"]
                ratio = e["sectors"] / max(e["ideal_sectors"], 1)
                share = e["sectors"] / ksec
                if share >= 0.05 and (worst_g is None or ratio > worst_g["over_ideal"]):
                    worst_g = dict(line=f"{e['file']}:{e['line']}", op=e["op"], over_ideal=round(ratio, 3),
                                   sectors_per_request=round(e["sectors"] / e["requests"], 2),
                                   ideal_per_request=round(e["ideal_sectors"] / e["requests"], 2),
                                   share_of_kernel_sectors=round(share, 3), kernel=k["name"])
            if is_s and e["wavefronts"]:
                s["requests"] += e["requests"]
                s["wavefronts"] += e["wavefronts"]
                s["ideal"] += e["ideal_wavefronts"]
                ways = e["wavefronts"] / max(e["ideal_wavefronts"], 1)
                share = e["wavefronts"] / kwav
                if share >= 0.05 and (worst_s is None or ways > worst_s["conflict_ways"]):
                    worst_s = dict(line=f"{e['file']}:{e['line']}", op=e["op"], conflict_ways=round(ways, 3),
                                   share_of_kernel_wavefronts=round(share, 3), kernel=k["name"])
    out = {}
    if g["requests"]:
        out["global"] = dict(requests=g["requests"], sectors_per_request=round(g["sectors"] / g["requests"], 3),
                             ideal_sectors_per_request=round(g["ideal"] / g["requests"], 3),
                             over_ideal=round(g["sectors"] / max(g["ideal"], 1), 3), worst_line=worst_g)
    if s["requests"]:
        out["shared"] = dict(requests=s["requests"], wavefronts_per_request=round(s["wavefronts"] / s["requests"], 3),
                             ideal_wavefronts_per_request=round(s["ideal"] / s["requests"], 3),
                             conflict_ways=round(s["wavefronts"] / max(s["ideal"], 1), 3), worst_line=worst_s)
    return out


def requested_bytes(kernels):
    """Global sectors requested by the CTAs x 32, scaled per kernel by CTAs in the grid / CTAs run."""
    total = 0.0
    for k in kernels:
        ctas = sum(r["grid"][0] * r["grid"][1] * r["grid"][2] for r in k["records"])
        run = sum(r["blocks_run"] for r in k["records"])
        scale = ctas / run if run else 1.0
        sectors = sum(e["sectors"] for e in k["lines"]
                      if e["op"] in GLOBAL_OPS or (e["op"] == "atomic" and e["space"] == "global"))
        total += 32 * sectors * scale
    return int(total)


# ---- cases ---------------------------------------------------------------------------------------
class Case:
    def __init__(self, family, label, build, sample=1, reuse=False, extra=None, run_whole=(), tensor_flops=None):
        self.family, self.label, self.build, self.sample, self.reuse = family, label, build, sample, reuse
        self.extra = extra  # (kernel name, launch record) -> bytes outside the ideal (workspaces), "ideal" rule
        self.run_whole = run_whole  # kernels exempt from sampling (fastinfer.simt.profile's run_whole)
        # (kernel name, spec) -> a launch's tensor FLOPs counted on the host, or None: for launches whose
        # CTAs differ in mma work, which a sample of CTAs would weigh by chance
        self.tensor_flops = tensor_flops


def _bf16(*shape, gen=None):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def case_rms_norm(t):
    def build():
        x, w = _bf16(t, HIDDEN), _bf16(HIDDEN)
        return dict(fn=lambda: ns().rms_norm(x, w, 1e-5), ideal=(2 * t * HIDDEN + HIDDEN) * 2)
    return Case("rms_norm", f"T={t} H={HIDDEN}", build, sample=max(1, t // 256))


def case_fused_add(t):
    def build():
        x, r, w = _bf16(t, HIDDEN), _bf16(t, HIDDEN), _bf16(HIDDEN)
        return dict(fn=lambda: ns().fused_add_rms_norm(x, r, w, 1e-5), ideal=(4 * t * HIDDEN + HIDDEN) * 2)
    return Case("fused_add_rms_norm", f"T={t} H={HIDDEN}", build, sample=max(1, t // 256))


def case_rms_norm_quant(t):
    """rms_norm fused with the per-token e4m3 quantisation (x from DRAM once; codes and scales out)."""
    def build():
        x, w = _bf16(t, HIDDEN), _bf16(HIDDEN)
        return dict(fn=lambda: ns().rms_norm_quant(x, w, 1e-5, torch.float8_e4m3fn, None),
                    ideal=t * HIDDEN * 3 + HIDDEN * 2 + t * 4)
    return Case("rms_norm_quant", f"T={t} H={HIDDEN} e4m3/token", build, sample=max(1, t // 256))


def case_fused_add_quant(t):
    def build():
        x, r, w = _bf16(t, HIDDEN), _bf16(t, HIDDEN), _bf16(HIDDEN)
        return dict(fn=lambda: ns().fused_add_rms_norm_quant(x, r, w, 1e-5, torch.float8_e4m3fn, None),
                    ideal=t * HIDDEN * 7 + HIDDEN * 2 + t * 4)
    return Case("fused_add_rms_norm_quant", f"T={t} H={HIDDEN} e4m3/token", build, sample=max(1, t // 256))


def case_silu(t):
    def build():
        x = _bf16(t, 2 * FFN)
        return dict(fn=lambda: ns().silu_and_mul(x), ideal=3 * t * FFN * 2)
    return Case("silu_and_mul", f"T={t} F={FFN}", build, sample=max(1, t // 64))


def case_gelu_tanh(t):
    def build():
        x = _bf16(t, 2 * FFN)
        return dict(fn=lambda: ns().gelu_tanh_and_mul(x), ideal=3 * t * FFN * 2)
    return Case("gelu_tanh_and_mul", f"T={t} F={FFN}", build, sample=max(1, t // 64))


def case_rope(t):
    def build():
        from fastinfer.ops import build_rope_cache

        qkv = _bf16(t, (HQ + 2 * HKV) * HEAD_DIM)
        q = qkv[:, : HQ * HEAD_DIM].view(t, HQ, HEAD_DIM)
        k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(t, HKV, HEAD_DIM)
        pos = torch.randint(0, 8192, (t,))
        cache = build_rope_cache(8192, HEAD_DIM, theta=500000.0)
        ideal = 2 * t * (HQ + HKV) * HEAD_DIM * 2 + t * 8 + t * HEAD_DIM * 4
        return dict(fn=lambda: ns().rotary_embedding(pos, q, k, cache, True), ideal=ideal)
    return Case("rotary_embedding", f"T={t} Hq={HQ} Hkv={HKV} D={HEAD_DIM}", build, sample=max(1, t // 256))


def case_reshape_and_cache(t):
    def build():
        qkv = _bf16(t, (HQ + 2 * HKV) * HEAD_DIM)
        k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(t, HKV, HEAD_DIM)
        v = qkv[:, (HQ + HKV) * HEAD_DIM:].view(t, HKV, HEAD_DIM)
        nb = max(4, math.ceil(t / BLOCK) * 2)
        kc = torch.zeros(nb, BLOCK, HKV, HEAD_DIM, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(nb * BLOCK)[:t]
        return dict(fn=lambda: ns().reshape_and_cache(k, v, kc, vc, slots, None, None),
                    ideal=4 * t * HKV * HEAD_DIM * 2 + t * 8)
    return Case("reshape_and_cache", f"T={t} Hkv={HKV} D={HEAD_DIM} BS={BLOCK}", build, sample=max(1, t // 256))


def case_move_kv_slots(moves=64, nb=512):
    def build():
        kc = _bf16(nb, BLOCK, HKV, HEAD_DIM)
        vc = _bf16(nb, BLOCK, HKV, HEAD_DIM)
        perm = torch.randperm(nb * BLOCK)
        src, dst = perm[:moves], perm[moves: 2 * moves]
        row = HKV * HEAD_DIM * 2
        return dict(fn=lambda: ns().move_kv_slots(kc, vc, src, dst), ideal=2 * moves * row * 2 + 2 * moves * 8)
    return Case("move_kv_slots", f"moves={moves} Hkv={HKV} D={HEAD_DIM} (spec-decode compaction)", build)


def case_merge(t=512):
    def build():
        va, vb = _bf16(t, HQ, HEAD_DIM), _bf16(t, HQ, HEAD_DIM)
        la, lb = torch.randn(t, HQ), torch.randn(t, HQ)
        return dict(fn=lambda: ns().merge_attention_states(va, la, vb, lb),
                    ideal=3 * t * HQ * HEAD_DIM * 2 + 3 * t * HQ * 4)
    return Case("merge_attention_states", f"T={t} H={HQ} D={HEAD_DIM}", build, sample=max(1, t // 128))


def case_decode(b, ctx, hq, hkv, sample=1):
    def build():
        nbs = math.ceil(ctx / BLOCK)
        kc = torch.zeros(b * nbs, BLOCK, hkv, HEAD_DIM, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        table = torch.randperm(b * nbs).to(torch.int32).view(b, nbs)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        q = _bf16(b, hq, HEAD_DIM)
        ideal = 2 * b * ctx * hkv * HEAD_DIM * 2 + 2 * b * hq * HEAD_DIM * 2 + b * nbs * 4
        return dict(fn=lambda: ns().paged_decode_attention(q, kc, vc, table, lens, HEAD_DIM ** -0.5, **_fixed()),
                    ideal=ideal)
    return Case("paged_decode_attention", f"B={b} ctx={ctx} Hq/Hkv={hq}/{hkv} D={HEAD_DIM} BS={BLOCK}", build,
                sample=sample)


# DeepSeek-V3 / R1 decode: 128 query heads over a 576-wide latent cache in FlashMLA's 64-token blocks.
MLA_HEADS, MLA_BLOCK, MLA_ROW, MLA_LATENT = 128, 64, 576, 512


def case_mla_decode(b, ctx, fp8=False, sample=1):
    """mla_decode_attention, one new token per sequence against ctx cached tokens. Ideal bytes: the
    latent read once (576 values a token, and an fp8 cache's per-token scales), q read and out
    written once, the block table; useful FLOPs 2 x B x H x ctx x (576 + 512) at the bf16
    tensor-core peak (an fp8 tile is converted to bf16 in shared memory before the mma)."""
    def build():
        nbs = math.ceil(ctx / MLA_BLOCK)
        cache = torch.zeros(b * nbs, MLA_BLOCK, MLA_ROW, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        scale = torch.full((b * nbs, MLA_BLOCK), 0.01) if fp8 else None
        table = torch.randperm(b * nbs).to(torch.int32).view(b, nbs)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        cu = torch.arange(b + 1, dtype=torch.int32)
        q = _bf16(b, MLA_HEADS, MLA_ROW)
        ideal = (b * ctx * MLA_ROW * (1 if fp8 else 2) + (b * ctx * 4 if fp8 else 0) +
                 b * MLA_HEADS * (MLA_ROW + MLA_LATENT) * 2 + b * nbs * 4)
        flops = 2.0 * b * MLA_HEADS * ctx * (MLA_ROW + MLA_LATENT)
        return dict(fn=lambda: ns().mla_decode_attention(q, cache, table, lens, cu, 192 ** -0.5, True, None, 0, False,
                                                         scale, FIXED_SPLIT),
                    ideal=ideal, flops=flops, peak="bf16")
    return Case("mla_decode_attention", f"B={b} ctx={ctx} H={MLA_HEADS} {'fp8' if fp8 else 'bf16'} cache BS={MLA_BLOCK}",
                build, sample=sample, reuse=True)


def case_prefill(t, hq, hkv, d, causal, paged=False):
    def build():
        q, k, v = _bf16(t, hq, d), _bf16(t, hkv, d), _bf16(t, hkv, d)
        cu = torch.tensor([0, t], dtype=torch.int32)
        flops = 4 * hq * d * (t * (t + 1) / 2 if causal else t * t)
        ideal = (2 * t * hq * d + 2 * t * hkv * d) * 2
        if not paged:
            fn = lambda: ns().prefill_attention(q, k, v, cu, cu, t, t, d ** -0.5, causal, **_fixed())  # noqa: E731
        else:
            nbs = math.ceil(t / BLOCK)
            kc = k.view(nbs, BLOCK, hkv, d).contiguous()
            vc = v.view(nbs, BLOCK, hkv, d).contiguous()
            table = torch.arange(nbs, dtype=torch.int32).view(1, nbs)
            lens = torch.tensor([t], dtype=torch.int32)
            fn = lambda: ns().paged_prefill_attention(q, kc, vc, table, cu, lens, t, d ** -0.5, causal,  # noqa: E731
                                                      **_fixed())
        return dict(fn=fn, ideal=ideal, flops=flops, peak="bf16")
    ctas = math.ceil(t / 64) * hq
    return Case("paged_prefill_attention" if paged else "prefill_attention",
                f"T={t} Hq/Hkv={hq}/{hkv} D={d} {'causal' if causal else 'full'}", build,
                sample=max(1, ctas // 32), reuse=True)


def case_prefill_ragged(long_len=1024, trees=15, nodes=8, ctx=1024, hq=HQ, hkv=HKV, d=HEAD_DIM):
    """A ragged paged prefill as the runner builds it for speculative decoding next to a prompt: one
    prefill of long_len tokens (no prefix) and `trees` verification trees of `nodes` nodes on
    contexts of ctx keys, one call with the runner's custom mask (a causal block for the prefill,
    the tree masks for the trees; layers/batch.py)."""
    def build():
        from fastinfer.reference.attention import random_tree_parents, tree_mask

        g = torch.Generator().manual_seed(0)
        q_lens = [long_len] + [nodes] * trees
        k_lens = [long_len] + [ctx] * trees
        nbs = [math.ceil(n / BLOCK) for n in k_lens]
        kc = _bf16(sum(nbs), BLOCK, hkv, d, gen=g)
        vc = _bf16(sum(nbs), BLOCK, hkv, d, gen=g)
        table = torch.zeros(len(q_lens), max(nbs), dtype=torch.int32)
        off = 0
        for b, n in enumerate(nbs):
            table[b, :n] = torch.arange(off, off + n, dtype=torch.int32)
            off += n
        t = sum(q_lens)
        q = _bf16(t, hq, d, gen=g)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        lens = torch.tensor(k_lens, dtype=torch.int32)
        masks = [torch.ones(long_len, long_len, dtype=torch.bool).tril_()]
        masks += [tree_mask(random_tree_parents(nodes, g)) for _ in range(trees)]
        mask = torch.cat([m.reshape(-1) for m in masks])
        visible = sum(int(m.sum()) + m.shape[0] * (kl - ql) for m, ql, kl in zip(masks, q_lens, k_lens))
        flops = 4.0 * hq * d * visible
        ideal = (2 * t * hq * d + 2 * sum(k_lens) * hkv * d) * 2 + mask.numel() + table.numel() * 4
        fn = lambda: ns().paged_prefill_attention(q, kc, vc, table, cu, lens, long_len, d ** -0.5, True,  # noqa: E731
                                                  -1, 0.0, mask)
        return dict(fn=fn, ideal=ideal, flops=flops, peak="bf16",
                    note=f"q_lens {long_len} + {trees} x {nodes}; useful rows {t * hq}")
    return Case("paged_prefill_attention", f"ragged: {long_len} + {trees} trees x {nodes} ctx {ctx} "
                f"Hq/Hkv={hq}/{hkv} D={d} mask", build, sample=1, reuse=True)


def case_tree_attention(b, nodes, ctx, hq=HQ, hkv=HKV, d=HEAD_DIM, sample=1, fixed_split=None):
    """Speculative verification alone: b sequences, each a random tree of `nodes` nodes behind
    ctx - nodes cached keys, in one paged prefill with the tree masks (with --fixed-split or
    fixed_split, the keys by rank: a work item per node, each reading its prefix)."""
    fixed = _fixed() if fixed_split is None else dict(fixed_split_size=fixed_split)
    def build():
        from fastinfer.reference.attention import random_tree_parents, tree_mask

        g = torch.Generator().manual_seed(0)
        nbs = math.ceil(ctx / BLOCK)
        kc = _bf16(b * nbs, BLOCK, hkv, d, gen=g)
        vc = _bf16(b * nbs, BLOCK, hkv, d, gen=g)
        table = torch.randperm(b * nbs, generator=g).to(torch.int32).view(b, nbs)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        q = _bf16(b * nodes, hq, d, gen=g)
        cu = torch.arange(0, b * nodes + 1, nodes, dtype=torch.int32)
        masks = [tree_mask(random_tree_parents(nodes, g)) for _ in range(b)]
        mask = torch.cat([m.reshape(-1) for m in masks])
        visible = sum(int(m.sum()) + nodes * (ctx - nodes) for m in masks)
        ideal = (2 * b * nodes * hq * d + 2 * b * ctx * hkv * d) * 2 + mask.numel() + table.numel() * 4
        fn = lambda: ns().paged_prefill_attention(q, kc, vc, table, cu, lens, nodes, d ** -0.5, True,  # noqa: E731
                                                  -1, 0.0, mask, **fixed)
        return dict(fn=fn, ideal=ideal, flops=4.0 * hq * d * visible, peak="bf16")
    return Case("paged_prefill_attention", f"tree verify: B={b} x {nodes} nodes ctx={ctx} Hq/Hkv={hq}/{hkv} D={d}"
                + (f" F={fixed_split}" if fixed_split else ""), build, sample=sample, reuse=True)


def case_prefill_chunk(q_len, ctx, b=1, hq=HQ, hkv=HKV, d=HEAD_DIM, sample=16):
    """Chunked prefill continuing a long context: b sequences each appending q_len tokens to
    ctx - q_len cached keys (paged, causal), the shape where one CTA per (work item, KV head) leaves
    most SMs idle and the default mode splits the keys (attention.h). The split's fp32 partials,
    written by the attention kernel and read back by the merge, are outside the ideal bytes: added
    as 2 x splits x rows x (D + 1) x 4."""
    def build():
        nbs = math.ceil(ctx / BLOCK)
        kc = _bf16(b * nbs, BLOCK, hkv, d)
        vc = _bf16(b * nbs, BLOCK, hkv, d)
        table = torch.randperm(b * nbs).to(torch.int32).view(b, nbs)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        q = _bf16(b * q_len, hq, d)
        cu = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32)
        visible = b * (q_len * (ctx - q_len) + q_len * (q_len + 1) // 2)
        ideal = (2 * b * q_len * hq * d + 2 * b * ctx * hkv * d) * 2 + table.numel() * 4
        fn = lambda: ns().paged_prefill_attention(q, kc, vc, table, cu, lens, q_len, d ** -0.5, True,  # noqa: E731
                                                  **_fixed())
        return dict(fn=fn, ideal=ideal, flops=4.0 * hq * d * visible, peak="bf16")

    def split_partials(kname, rec):
        z = rec["grid"][2]
        return 2 * z * b * q_len * hq * (d + 1) * 4 if "prefill_attention_kernel" in kname and z > 1 else 0

    return Case("paged_prefill_attention", f"chunk: B={b} {q_len} tokens after ctx {ctx - q_len} Hq/Hkv={hq}/{hkv} "
                f"D={d}", build, sample=sample, reuse=True, extra=split_partials)


def case_fp8_quantize(m, k, mode):
    def build():
        x = _bf16(m, k)
        scale_bytes = {"token": 4 * m, "group": 4 * m * k // 128, "tensor": 4}[mode]
        return dict(fn=lambda: ns().fp8_quantize(x, mode, 128, None), ideal=m * k * 2 + m * k + scale_bytes)
    return Case("fp8_quantize", f"M={m} K={k} mode={mode}", build, sample=max(1, m * k // (1 << 21)))


def _rand_fp8(*shape):
    return torch.randint(0, 0x7e, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)


def case_fp8_mm(m, n, k, layer, blockwise=False, model="8b"):
    def build():
        a, b = _rand_fp8(m, k), _rand_fp8(n, k)
        if blockwise:
            sa, sb = torch.rand(m, k // 128) + 0.5, torch.rand(n // 128, k // 128) + 0.5
        else:
            sa, sb = torch.rand(m) + 0.5, torch.rand(n) + 0.5
        ideal = m * k + n * k + m * n * 2 + (sa.numel() + sb.numel()) * 4
        return dict(fn=lambda: ns().fp8_scaled_mm(a, b, sa, sb, torch.bfloat16), ideal=ideal, flops=2.0 * m * n * k,
                    peak="fp8")
    bm = 16 if m <= 16 else (64 if m <= 64 or blockwise else 128)
    mma = math.ceil(m / bm) * (bm // 16) * (n // 8) * (k // 32)  # warp-level m16n8k32 instructions
    return Case("fp8_scaled_mm", f"llama3-{model} {layer} M={m} N={n} K={k}{' blockwise' if blockwise else ''}", build,
                sample=max(1, math.ceil(mma / 4e5)), reuse=True)


def case_int8_quantize(m, k, mode, symmetric=True):
    def build():
        x = _bf16(m, k)
        scale_bytes = (4 * m if mode == "token" else 4) + (0 if symmetric else 4 * m)
        return dict(fn=lambda: ns().int8_quantize(x, mode, None, symmetric), ideal=m * k * 2 + m * k + scale_bytes)
    return Case("int8_quantize", f"M={m} K={k} mode={mode}{'' if symmetric else ' asymmetric'}", build,
                sample=max(1, m * k // (1 << 21)))


def case_int8_mm(m, n, k, layer, model="8b"):
    def build():
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        sa, sb = torch.rand(m) + 0.5, torch.rand(n) + 0.5
        ideal = m * k + n * k + m * n * 2 + (m + n) * 4
        return dict(fn=lambda: ns().int8_scaled_mm(a, b, sa, sb, torch.bfloat16, None, None, None), ideal=ideal,
                    flops=2.0 * m * n * k, peak="int8")
    bm = 16 if m <= 16 else (64 if m <= 64 else 128)
    mma = math.ceil(m / bm) * (bm // 16) * (n // 8) * (k // 32)  # warp-level m16n8k32 instructions
    return Case("int8_scaled_mm", f"llama3-{model} {layer} M={m} N={n} K={k}", build,
                sample=max(1, math.ceil(mma / 4e5)), reuse=True)


def case_dense_mm(m, n, k, layer, model="8b"):
    """dense_mm (the batch-invariant bf16 GEMM) against the bf16 roofline."""
    def build():
        a, b = _bf16(m, k), _bf16(n, k)
        ideal = (m * k + n * k + m * n) * 2
        return dict(fn=lambda: ns().dense_mm(a, b, None), ideal=ideal, flops=2.0 * m * n * k, peak="bf16")
    bm = 16 if m <= 16 else (64 if m <= 64 else 128)
    mma = math.ceil(m / bm) * (bm // 16) * (n // 8) * (k // 16)  # warp-level m16n8k16 instructions
    return Case("dense_mm", f"llama3-{model} {layer} M={m} N={n} K={k}", build,
                sample=max(1, math.ceil(mma / 3e5)), reuse=True)


def case_int4(m, n, k, layer, model="8b", deterministic=False):
    def build():
        w_q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        packed = torch.ops.fastinfer.int4_pack(w_q)
        scales = (torch.rand(k // 128, n) * 0.01 + 0.001).to(torch.bfloat16)
        a = _bf16(m, k)
        if m >= 512 and not deterministic:  # dequantise kernel + dense matmul (not ours): the kernel only
            ideal = n * k // 2 + (k // 128) * n * 2 + n * k * 2
            return dict(fn=lambda: ns().int4_gemm(a, packed, scales, None, 128), ideal=ideal)
        ideal = n * k // 2 + (k // 128) * n * 2 + m * k * 2 + m * n * 2
        return dict(fn=lambda: ns().int4_gemm(a, packed, scales, None, 128, None, deterministic), ideal=ideal,
                    flops=2.0 * m * n * k, peak="bf16")
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    mma = math.ceil(m / bm) * (bm // 16) * (n // 8) * (k // 16)
    sample = max(1, math.ceil(mma / 3e5)) if m < 512 else max(1, (n * k) // (1 << 22))
    fam = "int4_gemm" if m < 512 else "int4_dequantize (int4_gemm M>=512)"
    if deterministic:
        fam = "int4_gemm deterministic"

    def split_k_partials(kname, rec):  # fp32 partials [splits, M, N] written by every split, read by the last
        return 2 * rec["grid"][2] * m * n * 4 if "int4_gemm_kernel" in kname and rec["grid"][2] > 1 else 0

    return Case(fam, f"llama3-{model} {layer} M={m} N={n} K={k} g128", build, sample=sample, reuse=m < 512,
                extra=split_k_partials)


def case_fp4(m, n, k, layer, fmt="nvfp4", model="8b"):
    """fp4_gemm (W4A16, NVFP4 e4m3 scales per 16 + a global scale, or MXFP4 e8m0 per 32): the fused
    kernel at every M (it has no dequantise + dense path), split-K by int4_gemm's rule."""
    group = 16 if fmt == "nvfp4" else 32

    def build():
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        lo, hi = (0x30, 0x48) if fmt == "nvfp4" else (120, 128)
        scale = torch.randint(lo, hi, (n, k // group), dtype=torch.uint8)
        packed, scales = torch.ops.fastinfer.fp4_repack(codes, scale)
        gs = torch.tensor([100.0]) if fmt == "nvfp4" else None
        a = _bf16(m, k)
        ideal = n * k // 2 + (k // group) * n + m * k * 2 + m * n * 2
        return dict(fn=lambda: ns().fp4_gemm(a, packed, scales, gs, fmt, False), ideal=ideal,
                    flops=2.0 * m * n * k, peak="bf16")
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    mma = math.ceil(m / bm) * (bm // 16) * (n // 8) * (k // 16)

    def split_k_partials(kname, rec):  # fp32 partials [splits, M, N] written by every split, read by the last
        return 2 * rec["grid"][2] * m * n * 4 if "fp4_gemm_kernel" in kname and rec["grid"][2] > 1 else 0

    return Case(f"fp4_gemm {fmt}", f"llama3-{model} {layer} M={m} N={n} K={k}", build,
                sample=max(1, math.ceil(mma / 3e5)), reuse=True, extra=split_k_partials)


# Mixture-of-experts layers (H, I per expert, E, k): Mixtral-8x7B and Qwen3-30B-A3B.
MOE_MODELS = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8),
              "tiny": (256, 128, 8, 2)}  # the GPU check's sanitizer cases (bench/gpu_cases.py)
MOE_BENCH_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
MOE_TOKENS = (1, 16, 64, 512, 4096)


def _moe_routing(t, E, k):
    """Softmax top-k ids and weights of random router logits (CPU: the routing is an input here)."""
    logits = torch.randn(t, E, generator=torch.Generator().manual_seed(t + E))
    return torch.ops.fastinfer.moe_topk(logits, k, True, "softmax")


def _expert_rows(ids, E):
    """Slots per expert (ids -1 skipped)."""
    return torch.bincount(ids[ids >= 0].long().flatten(), minlength=E).tolist()


def _moe_gemm_flops(H, I):
    """The mma FLOPs of a grouped MoE GEMM launch from the routing (spec["expert_rows"]): a warp whose
    rows (16 or 32, from the tile configuration in the kernel's name) are all padding skips its mmas
    (moe/fused_moe.cuh), so the CTAs of an expert's last block do less work than the others, and a
    sample of CTAs would weigh those blocks by chance. Rows count in whole warps, columns in whole
    tiles, as the kernels issue them."""
    def count(kname, spec):
        m = re.search(r"MoeGemmConfig<(\d+), (\d+), (\d+), \d+, \d+, \(fastinfer::moe::MoeGemm\)(\d)>", kname)
        if m:
            bm, bn, wm, gemm = map(int, m.groups())
            warp_rows = bm // wm
        else:
            m = re.search(r"MoeW4Shape<(\d+), \(fastinfer::moe::MoeGemm\)(\d)>", kname)
            if not m:
                return None
            (bm, gemm), bn, warp_rows = map(int, m.groups()), 16, 16
        n, kdim = (I, H) if gemm == 0 else (H, I)
        cols = -(-n // bn) * bn * (2 if gemm == 0 else 1)
        rows = sum(c // bm * bm + -(-(c % bm) // warp_rows) * warp_rows for c in spec["expert_rows"])
        return 2.0 * rows * cols * kdim
    return count


def _moe_block_m(t, H, E, k):
    """fused_moe's tile tier (cuda/src/fused_moe.cu): the block_m its alignment uses."""
    slots = t * k
    rows = -(-slots // E)
    if rows <= 16:
        return 16
    return 64 if rows <= 64 or -(-slots // 128) * -(-H // 128) < H200["sms"] else 128


# Gated DeltaNet's convolution width: q, k (16 heads x 128) and v (32 heads x 128) of Qwen3-Next /
# Qwen3.5's linear-attention layers, W = 4
GDN_CONV_DIM, GDN_CONV_WIDTH = 2 * 16 * 128 + 32 * 128, 4


def case_causal_conv1d(batch, tokens_per_seq, dim=GDN_CONV_DIM, width=GDN_CONV_WIDTH):
    """causal_conv1d over ``batch`` sequences of ``tokens_per_seq`` new tokens (prefill: one long
    sequence from zeros; decode: one token each from its state). Ideal bytes: x read and out written
    once, each state slot read and written once, the weight read once."""
    def build():
        t = batch * tokens_per_seq
        x, weight, bias = _bf16(t, dim), _bf16(dim, width), _bf16(dim)
        cu = torch.arange(0, t + 1, tokens_per_seq, dtype=torch.int32)
        states = _bf16(batch, width - 1, dim)
        slots = torch.arange(batch, dtype=torch.int32)
        has = torch.full((batch,), tokens_per_seq == 1)
        ideal = (2 * t * dim + 2 * batch * (width - 1) * dim + (width + 1) * dim) * 2
        return dict(fn=lambda: ns().causal_conv1d(x, weight, bias, cu, states, slots, has, "silu"), ideal=ideal)
    return Case("causal_conv1d", f"B={batch} L={tokens_per_seq} D={dim} W={width}", build,
                sample=max(1, batch * tokens_per_seq // 64))


# Qwen3.5-9B's Gated DeltaNet heads (Qwen3-Next's per tensor-parallel pair): 16 key heads, 32 value
# heads, head dims 128
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_DIM = 16, 32, 128


def case_gated_delta_rule(batch, tokens_per_seq, hk=GDN_K_HEADS, hv=GDN_V_HEADS, d=GDN_HEAD_DIM):
    """gated_delta_rule over ``batch`` sequences of ``tokens_per_seq`` tokens, each from its state slot
    (decode: one token; verification: a few). Ideal bytes: each fp32 state [Hv, Dk, Dv] read and
    written once (decode's roofline), q, k, v, g, beta read and out written once."""
    def build():
        t = batch * tokens_per_seq
        q, k, v = _bf16(t, hk, d), _bf16(t, hk, d), _bf16(t, hv, d)
        g, beta = -torch.rand(t, hv), torch.rand(t, hv)
        cu = torch.arange(0, t + 1, tokens_per_seq, dtype=torch.int32)
        states = torch.randn(batch, hv, d, d) * 0.1
        slots = torch.arange(batch, dtype=torch.int32)
        ideal = 2 * batch * hv * d * d * 4 + t * (2 * hk * d + 2 * hv * d) * 2 + 2 * t * hv * 4
        return dict(fn=lambda: ns().gated_delta_rule(q, k, v, g, beta, cu, states, slots, None, None, True, None,
                                                     False), ideal=ideal)
    return Case("gated_delta_rule", f"B={batch} L={tokens_per_seq} Hk={hk} Hv={hv} D={d}", build,
                sample=max(1, batch // 8))


def case_moe_topk(t, model):
    H, I, E, k = MOE_MODELS[model]

    def build():
        logits = _bf16(t, E)
        return dict(fn=lambda: ns().moe_topk(logits, k, True, "softmax"), ideal=t * E * 2 + t * k * 8)
    return Case("moe_topk", f"{model} T={t} E={E} k={k}", build)


def case_moe_align(t, model):
    H, I, E, k = MOE_MODELS[model]
    block_m = _moe_block_m(t, H, E, k)

    def build():
        _, ids = _moe_routing(t, E, k)
        sorted_size = t * k + E * (block_m - 1)
        ideal = t * k * 4 + sorted_size * 4 + -(-sorted_size // block_m) * 4 + 4
        return dict(fn=lambda: ns().moe_align(ids, E, block_m), ideal=ideal)
    return Case("moe_align", f"{model} T={t} E={E} k={k} block_m={block_m}", build)


def _moe_weights(E, H, I):
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16).normal_(0, H ** -0.5)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16).normal_(0, I ** -0.5)
    return w13, w2


def _moe_ideal(t, H, I, ids):
    """x and out once, every expert that a token chose read once, the routing once."""
    used = int(torch.unique(ids[ids >= 0]).numel())
    return t * H * 2 * 2 + used * 3 * H * I * 2 + ids.numel() * 8, used


def case_fused_moe(t, model):
    """fused_moe (alignment, the two grouped GEMMs, the combine) against the roofline of the experts
    the batch uses: their weights read once at small T, 2 x T x k x 3 H I FLOPs at large T. Its
    workspace traffic (a written and read, [T k, I] bf16; y written and read, [T k, H] bf16) is not
    in the ideal: it is added to the GEMM and combine launches."""
    H, I, E, k = MOE_MODELS[model]
    slots = t * k

    def build():
        w13, w2 = _moe_weights(E, H, I)
        weights, ids = _moe_routing(t, E, k)
        x = _bf16(t, H)
        ideal, used = _moe_ideal(t, H, I, ids)
        return dict(fn=lambda: ns().fused_moe(x, w13, w2, weights, ids, "silu", None, None, None, None),
                    ideal=ideal, flops=2.0 * slots * 3 * H * I, peak="bf16", note=f"experts used {used} of {E}",
                    expert_rows=_expert_rows(ids, E))

    def workspace(kname, rec):
        if "moe_gemm_kernel" in kname:
            gate_up = "MoeGemm)0" in kname
            return slots * I * 2 if gate_up else slots * I * 2 + slots * H * 2
        return slots * H * 2 if "moe_combine_kernel" in kname else 0

    return Case("fused_moe", f"{model} T={t} H={H} I={I} E={E} k={k}", build,
                sample=max(1, math.ceil(2.0 * slots * 3 * H * I / 1.2e9)), reuse=True, extra=workspace,
                run_whole=("moe_align_kernel",), tensor_flops=_moe_gemm_flops(H, I))


def case_fused_moe_fp8(t, model, blockwise):
    """fused_moe_fp8 (e4m3 experts: the weights read once at 1 byte, e4m3 FLOPs at large T); the
    quantised copies of x and a and their scales join the workspace traffic (a is written in e4m3
    by the gate/up epilogue on 64-row blocks, in bf16 and quantised by a launch on 16-row ones)."""
    H, I, E, k = MOE_MODELS[model]
    slots = t * k

    def build():
        w13 = _rand_fp8(E, 2 * I, H)
        w2 = _rand_fp8(E, H, I)
        if blockwise:
            s13, s2 = torch.rand(E, 2 * I // 128, H // 128) + 0.5, torch.rand(E, H // 128, I // 128) + 0.5
        else:
            s13, s2 = torch.rand(E, 2 * I) + 0.5, torch.rand(E, H) + 0.5
        weights, ids = _moe_routing(t, E, k)
        x = _bf16(t, H)
        used = int(torch.unique(ids).numel())
        ideal = t * H * 2 * 2 + used * 3 * H * I + ids.numel() * 8
        return dict(fn=lambda: ns().fused_moe_fp8(x, w13, w2, s13, s2, weights, ids, "silu", None, None, None, None),
                    ideal=ideal, flops=2.0 * slots * 3 * H * I, peak="fp8", note=f"experts used {used} of {E}",
                    expert_rows=_expert_rows(ids, E))

    quantize_launches = []

    act_scales = slots * -(-I // 64) * 4  # a's group scales (fp32 per 64 columns)

    def workspace(kname, rec):
        if "moe_gemm_kernel" in kname:
            if "MoeGemm)0" in kname:  # 64-row blocks: a written in e4m3 with its scales; 16-row: in bf16
                return slots * I * 2 if "MoeGemmConfig<16," in kname else slots * I + act_scales
            return slots * I + act_scales + slots * H * 2  # a's e4m3 copy read; y written (bf16)
        if "moe_combine_kernel" in kname:
            return slots * H * 2
        if "quantize" in kname:  # x, then (16-row blocks) a: e4m3 copies written and read, a (bf16) read
            quantize_launches.append(kname)
            return t * H * 2 if len(quantize_launches) == 1 else slots * I * 3
        return 0

    return Case("fused_moe_fp8", f"{model} T={t} H={H} I={I} E={E} k={k} {'blockwise' if blockwise else 'channel'}",
                build, sample=max(1, math.ceil(2.0 * slots * 3 * H * I / 2.4e9)), reuse=True, extra=workspace,
                run_whole=("moe_align_kernel",), tensor_flops=_moe_gemm_flops(H, I))


def case_fused_moe_int4(t, model, group_size=128):
    """fused_moe_int4 (W4A16 experts, int4_pack's layout, symmetric group-128 scales): the weights read
    once at half a byte plus their scales, bf16 FLOPs at large T."""
    H, I, E, k = MOE_MODELS[model]
    slots = t * k

    def build():
        w13 = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, H // 64, 16 * I), dtype=torch.int32)
        w2 = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, I // 64, 8 * H), dtype=torch.int32)
        s13 = (torch.rand(E, H // group_size, 2 * I) * 0.01 + 0.001).to(torch.bfloat16)
        s2 = (torch.rand(E, I // group_size, H) * 0.01 + 0.001).to(torch.bfloat16)
        weights, ids = _moe_routing(t, E, k)
        x = _bf16(t, H)
        used = int(torch.unique(ids).numel())
        scale_bytes = used * (H // group_size * 2 * I + I // group_size * H) * 2
        ideal = t * H * 2 * 2 + used * 3 * H * I // 2 + scale_bytes + ids.numel() * 8
        return dict(fn=lambda: ns().fused_moe_int4(x, w13, w2, s13, s2, None, None, weights, ids, group_size, "silu",
                                                   None, None, None, None),
                    ideal=ideal, flops=2.0 * slots * 3 * H * I, peak="bf16", note=f"experts used {used} of {E}",
                    expert_rows=_expert_rows(ids, E))

    def workspace(kname, rec):
        if "moe_w4_gemm_kernel" in kname:
            return slots * I * 2 if "MoeGemm)0" in kname else slots * I * 2 + slots * H * 2
        return slots * H * 2 if "moe_combine_kernel" in kname else 0

    return Case("fused_moe_int4", f"{model} T={t} H={H} I={I} E={E} k={k} g{group_size}", build,
                sample=max(1, math.ceil(2.0 * slots * 3 * H * I / 1.2e9)), reuse=True, extra=workspace,
                run_whole=("moe_align_kernel",), tensor_flops=_moe_gemm_flops(H, I))


def case_fused_moe_fp4(t, model, fmt):
    """fused_moe_fp4 (W4A16 experts in fp4_repack's layout: NVFP4 with e4m3 scales per 16 and global
    divisors, or MXFP4 with e8m0 scales per 32): the weights read once at half a byte plus a scale
    byte per group, bf16 FLOPs at large T."""
    H, I, E, k = MOE_MODELS[model]
    slots = t * k
    group = 16 if fmt == "nvfp4" else 32

    def build():
        w13 = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, H // 64, 16 * I), dtype=torch.int32)
        w2 = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, I // 64, 8 * H), dtype=torch.int32)
        lo, hi = (0x28, 0x50) if fmt == "nvfp4" else (122, 132)  # e4m3 0.125 .. 8; e8m0 2^-5 .. 2^4
        s13 = torch.randint(lo, hi, (E, H // group, 2 * I), dtype=torch.int32).to(torch.uint8)
        s2 = torch.randint(lo, hi, (E, I // group, H), dtype=torch.int32).to(torch.uint8)
        g13, g2 = (torch.rand(E, 2) + 100.0, torch.rand(E) + 100.0) if fmt == "nvfp4" else (None, None)
        weights, ids = _moe_routing(t, E, k)
        x = _bf16(t, H)
        used = int(torch.unique(ids).numel())
        scale_bytes = used * (H // group * 2 * I + I // group * H)
        ideal = t * H * 2 * 2 + used * 3 * H * I // 2 + scale_bytes + ids.numel() * 8
        return dict(fn=lambda: ns().fused_moe_fp4(x, w13, w2, s13, s2, g13, g2, weights, ids, fmt, "silu",
                                                  None, None, None, None),
                    ideal=ideal, flops=2.0 * slots * 3 * H * I, peak="bf16", note=f"experts used {used} of {E}",
                    expert_rows=_expert_rows(ids, E))

    def workspace(kname, rec):
        if "moe_w4_gemm_kernel" in kname:
            return slots * I * 2 if "MoeGemm)0" in kname else slots * I * 2 + slots * H * 2
        return slots * H * 2 if "moe_combine_kernel" in kname else 0

    return Case("fused_moe_fp4", f"{model} T={t} H={H} I={I} E={E} k={k} {fmt}", build,
                sample=max(1, math.ceil(2.0 * slots * 3 * H * I / 1.2e9)), reuse=True, extra=workspace,
                run_whole=("moe_align_kernel",), tensor_flops=_moe_gemm_flops(H, I))


def case_moe_expert_loop(t, model):
    """The same layer as a loop over the experts of separate launches (what a library without a
    grouped kernel runs): per used expert dense_mm(x_e, w13[e]), silu_and_mul, dense_mm(a, w2[e]).
    The gathers of x_e and the weighted sum run in torch on the host: not counted."""
    H, I, E, k = MOE_MODELS[model]
    slots = t * k

    def build():
        w13, w2 = _moe_weights(E, H, I)
        weights, ids = _moe_routing(t, E, k)
        x = _bf16(t, H)
        ideal, used = _moe_ideal(t, H, I, ids)
        rows = {e: (ids == e).nonzero()[:, 0] for e in torch.unique(ids[ids >= 0]).tolist()}

        def loop():
            for e, tokens in rows.items():
                a = ns().silu_and_mul(ns().dense_mm(x[tokens], w13[e], None))
                ns().dense_mm(a, w2[e], None)
        return dict(fn=loop, ideal=ideal, flops=2.0 * slots * 3 * H * I, peak="bf16",
                    note=f"experts used {used} of {E}")

    return Case("fused_moe per-expert loop", f"{model} T={t} H={H} I={I} E={E} k={k}", build,
                sample=max(1, math.ceil(2.0 * slots * 3 * H * I / 1.2e9)), reuse=True)


def case_tree_verify(b, n, mode, v=128256):
    def build():  # ideal: the visited nodes' logits read once (docs/design.md's baseline; draft mode also reads q)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tree_verify import make_case

        args = make_case(b, n, v, mode, torch.device("cpu"))
        _, num, _ = torch.ops.fastinfer.tree_verify(*args)  # CPU implementation: the visited nodes
        visited = int(num.sum()) + b
        ideal = visited * v * 2
        return dict(fn=lambda: ns().tree_verify(*args), ideal=ideal, note=f"visited nodes {visited}")
    return Case("tree_verify", f"B={b} N={n} V={v} {mode}", build, sample=max(1, b // 4))


def all_cases(quick=False):
    tokens = [1, 512] if quick else [1, 16, 512, 4096]
    cases = []
    for t in tokens:
        cases += [case_rms_norm(t), case_fused_add(t), case_rms_norm_quant(t), case_fused_add_quant(t), case_silu(t),
                  case_rope(t), case_reshape_and_cache(t)]
    if not quick:
        cases.append(case_gelu_tanh(512))
    cases += [case_move_kv_slots(), case_merge(512)]
    dec = [(1, 4096, 32, 8, 1), (64, 4096, 32, 8, 16)] if quick else [
        (1, 512, 32, 8, 1), (1, 4096, 32, 8, 1), (1, 32768, 32, 8, 2), (16, 512, 32, 8, 1), (16, 4096, 32, 8, 4),
        (64, 512, 32, 8, 4), (64, 4096, 32, 8, 16), (256, 512, 32, 8, 16), (1, 4096, 32, 32, 2),
        (16, 4096, 32, 32, 8), (64, 512, 32, 32, 8)]
    cases += [case_decode(*c[:4], sample=c[4]) for c in dec]
    mla = [(1, 4096, 1), (64, 4096, 16)] if quick else [
        (1, 4096, 1), (16, 4096, 4), (64, 4096, 16), (128, 4096, 32), (1, 32768, 2), (16, 32768, 16)]
    cases += [case_mla_decode(b, ctx, fp8, sample) for b, ctx, sample in mla for fp8 in (False, True)]
    pre = [(1024, 32, 32, 128, True), (8192, 32, 32, 128, True)] if quick else [
        (t, hq, hkv, d, c) for t in (1024, 8192) for hq, hkv, d in ((32, 32, 128), (32, 8, 128), (32, 32, 64))
        for c in (True, False)] + [(t, 16, 8, 256, True) for t in (1024, 8192)]  # Gemma 2 9B heads
    cases += [case_prefill(*p) for p in pre]
    cases += [case_prefill(1024, 32, 8, 128, True, paged=True), case_prefill_ragged()]
    cases += [case_tree_attention(*c) for c in ([(16, 8, 1024)] if quick else [(1, 16, 4096), (16, 8, 1024),
                                                                                (16, 16, 4096)])]
    if not quick:
        cases.append(case_prefill_chunk(128, 32768))
    cases += [case_fp8_quantize(m, 4096, mode) for m in ((16, 4096) if not quick else (16,))
              for mode in ("token", "group", "tensor")]
    cases += [case_int8_quantize(m, 4096, mode, sym) for m in ((16, 4096) if not quick else (16,))
              for mode, sym in (("token", True), ("token", False), ("tensor", True))]
    shapes = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
    if quick:
        shapes = shapes[1:2]
    for layer, n, k in shapes:
        for m in ((1, 4096) if quick else (1, 16, 64, 256, 4096)):
            cases.append(case_fp8_mm(m, n, k, layer))
        cases.append(case_fp8_mm(16 if quick else 1, n, k, layer, blockwise=True))
        for m in ((1, 4096) if quick else (1, 16, 64, 256, 4096)):
            cases.append(case_int8_mm(m, n, k, layer))
        for m in ((1, 16) if quick else (1, 16, 64, 256, 4096)):
            cases.append(case_int4(m, n, k, layer))
        for m in ((1, 16) if quick else (1, 16, 64, 256, 4096)):  # Llama-3-8B = Mixtral-8x7B's dense shapes
            cases += [case_fp4(m, n, k, layer, fmt) for fmt in ("nvfp4", "mxfp4")]
        for m in ((1,) if quick else (1, 16, 256)):  # batch-invariant mode: split-K from (N, K) only
            cases.append(case_int4(m, n, k, layer, deterministic=True))
            cases.append(case_dense_mm(m, n, k, layer))
    if not quick:  # Llama-3-70B layers at decode sizes (the larger M behave like the 8B layers above)
        for layer, n, k in (("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192), ("down", 8192, 28672)):
            for m in (1, 16):
                cases.append(case_fp8_mm(m, n, k, layer, model="70b"))
                cases.append(case_int8_mm(m, n, k, layer, model="70b"))
                cases.append(case_int4(m, n, k, layer, model="70b"))
    tv = [(1, 8, "greedy"), (16, 8, "sample")] if quick else [
        (b, 8, mode) for b in (1, 16, 64) for mode in ("greedy", "sample", "draft")] + [
        (1, 64, "greedy"), (16, 64, "greedy"), (16, 64, "sample")]
    cases += [case_tree_verify(*c) for c in tv]
    cases += [case_causal_conv1d(b, 1) for b in ((1, 64) if quick else (1, 16, 64, 256))]
    cases += [case_causal_conv1d(1, t) for t in ((4096,) if quick else (4096, 32768))]
    cases += [case_gated_delta_rule(b, 1) for b in ((1, 64) if quick else (1, 16, 64, 256))]
    if not quick:  # verification of 4 draft tokens
        cases.append(case_gated_delta_rule(16, 4))
    for model in MOE_BENCH_MODELS:
        for t in ((1, 4096) if quick else MOE_TOKENS):
            cases += [case_moe_topk(t, model), case_moe_align(t, model), case_fused_moe(t, model)]
            cases += [case_fused_moe_fp8(t, model, blockwise) for blockwise in (False, True)]
            cases.append(case_fused_moe_int4(t, model))
            cases += [case_fused_moe_fp4(t, model, fmt) for fmt in ("nvfp4", "mxfp4")]
            if not quick:
                cases.append(case_moe_expert_loop(t, model))
    return cases


# ---- run -----------------------------------------------------------------------------------------
def run_case(case, ptxas):
    t0 = time.perf_counter()
    torch.manual_seed(0)
    spec = case.build()
    rep = simt.profile(spec["fn"], sample=case.sample, run_whole=case.run_whole)
    wall = time.perf_counter() - t0
    peak = spec.get("peak")
    lines = summarise_lines(rep["kernels"])
    over = lines.get("global", {}).get("over_ideal", 1.0)
    sampled = any(r["blocks_run"] < r["grid"][0] * r["grid"][1] * r["grid"][2]
                  for k in rep["kernels"] for r in k["records"])
    use_ideal = case.reuse and sampled
    launches = []
    measured_total = 0.0
    for k in rep["kernels"]:
        for r in k["records"]:
            ctas = r["grid"][0] * r["grid"][1] * r["grid"][2]
            scale = ctas / max(r["blocks_run"], 1)
            measured_total += (r["dram_read_bytes"] + r["dram_write_bytes"]) * scale
    for k in rep["kernels"]:
        for r in k["records"]:
            ctas = r["grid"][0] * r["grid"][1] * r["grid"][2]
            scale = ctas / max(r["blocks_run"], 1)
            dram = (r["dram_read_bytes"] + r["dram_write_bytes"]) * scale
            if use_ideal:  # this launch's share of the op's traffic, at ideal x over-fetch
                dram = spec["ideal"] * over * (dram / measured_total if measured_total else 1.0)
                if case.extra:
                    dram += case.extra(k["name"], r)
            flops = r["tensor_flops"] * scale
            exact = case.tensor_flops(k["name"], spec) if case.tensor_flops else None
            if exact is not None:
                flops = exact
            launches.append(launch_model(r, k["name"], ptxas, peak, dram, flops))
    dram_total = sum(x["model_dram_bytes"] for x in launches)
    flops_total = sum(x["model_tensor_flops"] for x in launches)
    t_model = sum(x["model_time_us"] for x in launches)
    useful = spec.get("flops", 0.0)
    t_roof = max(spec["ideal"] / H200["hbm_bytes_per_s"],
                 useful / H200["tc_flops_per_s"][peak] if peak and useful else 0.0) * 1e6
    findings = []
    g, s = lines.get("global"), lines.get("shared")
    if g and g["worst_line"] and g["worst_line"]["over_ideal"] >= 1.25:
        findings.append(f"uncoalesced: {g['worst_line']['line']} {g['worst_line']['op']} "
                        f"{g['worst_line']['sectors_per_request']} sectors/request (ideal "
                        f"{g['worst_line']['ideal_per_request']})")
    if s and s["worst_line"] and s["worst_line"]["conflict_ways"] >= 1.5:
        findings.append(f"bank conflicts: {s['worst_line']['line']} {s['worst_line']['op']} "
                        f"{s['worst_line']['conflict_ways']}-way")
    for x in launches:
        if x["ctas"] < H200["sms"]:
            findings.append(f"SMs idle: {short(x['kernel'])} {x['ctas']} CTAs on {H200['sms']} SMs "
                            f"({x['waves']} waves of {x['ctas_per_sm']}/SM)")
        elif x["waves"] < 0.9:
            findings.append(f"less than one wave: {short(x['kernel'])} {x['ctas']} CTAs, {x['waves']} waves of "
                            f"{x['ctas_per_sm']}/SM")
    if dram_total > 1.2 * spec["ideal"]:
        findings.append(f"DRAM {dram_total / spec['ideal']:.2f}x ideal")
    requested = requested_bytes(rep["kernels"])
    if requested > 1.5 * max(dram_total, 1):
        findings.append(f"requested {requested / 2**20:.1f} MiB from L2 = {requested / spec['ideal']:.2f}x ideal "
                        f"(CTAs re-read shared operands)")
    ctas_launched = sum(x["ctas"] for x in launches)
    storing = [x["ctas_storing"] for x in launches]
    ctas_storing = sum(storing) if all(v is not None for v in storing) else None
    if ctas_storing is not None and ctas_storing < ctas_launched:
        findings.append(f"idle CTAs: {ctas_launched - ctas_storing} of {ctas_launched} launched write nothing")
    row = dict(family=case.family, case=case.label, kind="model", sample_one_in=case.sample, sampled=sampled,
               dram_rule="ideal x measured sector over-fetch" if use_ideal else "distinct sectors x CTA scale",
               ideal_bytes=int(spec["ideal"]), useful_flops=useful, peak=peak, note=spec.get("note"),
               model_dram_bytes=int(dram_total), model_dram_over_ideal=round(dram_total / spec["ideal"], 3),
               model_tensor_flops=int(flops_total), model_time_us=t_model, model_roofline_us=t_roof,
               model_requested_bytes=requested, ctas_launched=ctas_launched,
               ctas_storing=ctas_storing,
               model_fraction_of_roofline=round(t_roof / t_model, 3) if t_model else None,
               launches=launches, findings=findings, profile_wall_s=round(wall, 2),
               kernel_lines={k["name"]: summarise_lines([k]) for k in rep["kernels"]}, **lines)
    del spec, rep
    return row


def short(name):
    m = re.search(r"(\w+)<", name) or re.search(r"(\w+)\(", name)
    return m.group(1) if m else name


def fmt_row(r):
    g, s = r.get("global"), r.get("shared")
    sec = f"{g['sectors_per_request']:.2f}/{g['ideal_sectors_per_request']:.2f}" if g else "-"
    ways = f"{s['conflict_ways']:.2f}" if s else "-"
    occ = ", ".join(sorted({f"{x['ctas_per_sm']}({x['occupancy_limiter'][:4]})" for x in r["launches"]}))
    waves = ", ".join(f"{x['waves']:.2f}" for x in r["launches"][:3]) + (" ..." if len(r["launches"]) > 3 else "")
    return (f"{r['family'][:22]:<22} {r['case'][:44]:<44} {sec:>11} {ways:>5} {r['model_dram_over_ideal']:>6.2f} "
            f"{occ[:16]:>16} {waves[:18]:>18} {r['model_time_us']:>10.2f} {r['model_roofline_us']:>10.2f} "
            f"{r['model_fraction_of_roofline'] or 0:>6.3f}")


HEADER = (f"{'family':<22} {'case':<44} {'sec/req':>11} {'ways':>5} {'DRAM/':>6} {'CTAs/SM(lim)':>16} "
          f"{'waves':>18} {'model us':>10} {'roof us':>10} {'frac':>6}\n"
          f"{'':<22} {'':<44} {'(ideal)':>11} {'':>5} {'ideal':>6}")


def compare(path_a, path_b, all_rows=False):
    """Model before / after table of two result files (cases whose model figures changed)."""
    a = {(r["family"], r["case"]): r for r in json.load(open(path_a))["rows"] if "error" not in r}
    b = {(r["family"], r["case"]): r for r in json.load(open(path_b))["rows"] if "error" not in r}

    def sec(r):
        g = r.get("global")
        return f"{g['sectors_per_request']:.2f}/{g['ideal_sectors_per_request']:.2f}" if g else "-"

    def ways(r):
        return f"{r['shared']['conflict_ways']:.2f}" if r.get("shared") else "-"

    def ctas(r):
        return "+".join(str(x["ctas"]) for x in r["launches"])

    def req(r):
        return f"{r['model_requested_bytes'] / 2**20:.1f}" if r.get("model_requested_bytes") is not None else "-"

    def stored(r):
        return str(r["ctas_storing"]) if r.get("ctas_storing") is not None else "-"

    print(f"{LABEL}\n{'family':<22} {'case':<46} {'sec/req (ideal)':>23} {'ways':>11} {'CTAs':>13} "
          f"{'stored':>13} {'req MiB':>15} {'model us':>17} {'fraction':>13}")
    for key in a:
        if key not in b:
            continue
        x, y = a[key], b[key]
        changed = (sec(x), ways(x), ctas(x), stored(x), req(x), round(x["model_time_us"], 2)) != (
            sec(y), ways(y), ctas(y), stored(y), req(y), round(y["model_time_us"], 2))
        if not (changed or all_rows):
            continue
        print(f"{key[0][:22]:<22} {key[1][:46]:<46} {sec(x):>11}>{sec(y):<11} {ways(x):>5}>{ways(y):<5} "
              f"{ctas(x)[:6]:>6}>{ctas(y)[:6]:<6} {stored(x)[:6]:>6}>{stored(y)[:6]:<6} {req(x):>7}>{req(y):<7} "
              f"{x['model_time_us']:>8.2f}>{y['model_time_us']:<8.2f} "
              f"{x['model_fraction_of_roofline']:>6.3f}>{y['model_fraction_of_roofline']:<6.3f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="print the model figures that changed between two result files and exit")
    p.add_argument("--quick", action="store_true", help="a few cases per family")
    p.add_argument("--only", default=None, help="comma-separated families (prefix match)")
    p.add_argument("--exact", action="store_true", help="--only names whole families (no prefix match)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--label", default=None, help="free text stored in the JSON (e.g. before / after)")
    p.add_argument("--match", default=None, help="only the cases whose label matches this regular expression")
    p.add_argument("--fixed-split", type=int, default=0, metavar="F",
                   help="attention cases in the deterministic mode, fixed_split_size=F (compare with a default run)")
    args = p.parse_args(argv)
    global FIXED_SPLIT
    FIXED_SPLIT = args.fixed_split
    if args.compare:
        compare(*args.compare)
        return
    torch.set_num_threads(1)
    ptxas, ptxas_path = load_ptxas()
    if not ptxas:
        print("model: no ptxas report (built without CUDA): register limits unknown, occupancy from "
              "threads and shared memory only")
    cases = all_cases(args.quick)
    if args.only:
        keys = args.only.split(",")
        cases = [c for c in cases if any(c.family == k if args.exact else c.family.startswith(k) for k in keys)]
    if args.match:
        cases = [c for c in cases if re.search(args.match, c.label)]
    print(LABEL)
    print(HEADER)
    rows = []
    t0 = time.perf_counter()
    for c in cases:
        try:
            r = run_case(c, ptxas)
        except Exception as e:  # keep going: one failing case must not hide the others
            print(f"{c.family} {c.label}: ERROR {type(e).__name__}: {e}")
            rows.append(dict(family=c.family, case=c.label, kind="model", error=f"{type(e).__name__}: {e}"))
            continue
        rows.append(r)
        print(fmt_row(r), flush=True)
        for f in r["findings"]:
            print(f"    model finding: {f}")
    print(f"{LABEL}; {len(rows)} cases, {time.perf_counter() - t0:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(label=LABEL, kind="model", tag=args.label, commit=git_commit(), device_model=H200,
                           ptxas_report=ptxas_path is not None, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
