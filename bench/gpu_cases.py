#!/usr/bin/env python
"""bench/model.py's cases on the GPU: the modelled shapes through ``torch.ops.fastinfer`` (CUDA).

The cases are bench/model.py's own (``model.all_cases``): each builds its inputs as the model run
does (on the GPU, under ``torch.device("cuda")``, except tree_verify's, which are made on the CPU),
and its ops are called through a proxy that moves any CPU tensor argument to the GPU once (views
keep their strides) and calls ``torch.ops.fastinfer.<op>``. So the GPU runs the shapes, split
heuristics and layouts the model's counters came from (the random values differ), and a launch
profiled here can be compared with the model's launch of the same case (``bench/compare_model.py``).

Modes:

* ``--ncu`` (under ``ncu``, bench/gpu_check.sh's ncu phase): every case once, inside an NVTX range
  ``mcase:<index>`` and between ``MCASE <index> begin`` / ``end`` lines on stdout, followed by a
  device synchronisation, so each profiled launch can be attributed to its case (by the NVTX name,
  or by the order of ncu's ``==PROF== Profiling`` lines in the log). ``<index>`` is the case's
  position in ``model.all_cases()``; the manifest (``--manifest``) maps it to (family, case).
* ``--time``: each case timed with CUDA events (median of batches, the same inputs every call, so
  inputs that fit in the 60 MB L2 are L2-warm): a measured time per case without ncu's replay.
* ``--sanitize``: one small case per kernel family (and per main code path), once each, for
  ``compute-sanitizer`` memcheck / racecheck; ``MCASE`` lines attribute reported errors to cases.

Cases run in an order that visits every family before the second case of any (round robin), and
``--deadline S`` stops starting new cases after S seconds, so a cut keeps every family covered.
Without a GPU, ``--dry-run`` builds each case and lists it (checks the case list itself).

    python bench/gpu_cases.py --ncu [--quick] [--only FAMILY,...] [--deadline S] --manifest CASES.json
    python bench/gpu_cases.py --time --json TIMES.json [--deadline S]
    python bench/gpu_cases.py --sanitize --manifest CASES.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402
from ncu_metrics import CASE_RANGE  # noqa: E402
from timing import device_label, git_commit, time_fn  # noqa: E402


class DeviceOps:
    """``ops.<name>(*args)`` -> ``torch.ops.fastinfer.<name>`` with every CPU tensor argument moved to
    ``device`` once per case (a view is moved with its base and re-viewed with the same strides)."""

    def __init__(self, device):
        self.device = device
        self.memo = {}

    def reset(self):
        self.memo.clear()

    def to(self, x):
        if isinstance(x, torch.Tensor):
            if x.device == self.device:
                return x
            hit = self.memo.get(id(x))
            if hit is None or hit[0] is not x:
                base = x._base
                if base is not None and base.is_contiguous() and base.device == x.device:
                    moved = self.to(base).as_strided(x.size(), x.stride(), x.storage_offset())
                else:
                    moved = x.to(self.device)
                hit = (x, moved)
                self.memo[id(x)] = hit
            return hit[1]
        if isinstance(x, (list, tuple)):
            return type(x)(self.to(y) for y in x)
        return x

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        op = getattr(torch.ops.fastinfer, name)

        def call(*args, **kwargs):
            return op(*[self.to(a) for a in args], **{k: self.to(v) for k, v in kwargs.items()})

        return call


# Families whose case builders need CPU tensors (explicit CPU generators, CPU reference ops).
CPU_BUILT = ("tree_verify",)


def sanitize_cases():
    """One small case per kernel family and main code path (fast under compute-sanitizer)."""
    cs = [M.case_rms_norm(4), M.case_fused_add(4), M.case_rms_norm_quant(4), M.case_fused_add_quant(4), M.case_silu(4), M.case_gelu_tanh(4), M.case_rope(4),
          M.case_reshape_and_cache(20),
          M.case_move_kv_slots(moves=16, nb=16), M.case_merge(32),
          M.case_decode(2, 300, 32, 8),  # split-KV: the attention and the merge-splits kernels
          M.case_mla_decode(2, 300), M.case_mla_decode(1, 2048, fp8=True),  # MLA: unsplit; split-KV, fp8
          M.case_prefill(200, 4, 2, 128, True), M.case_prefill(130, 2, 2, 64, False),
          M.case_prefill(96, 4, 2, 128, True, paged=True),
          M.case_tree_attention(2, 9, 150, 4, 2, 64, fixed_split=64)]  # deterministic tree rows: keys by rank
    cs += [M.case_fp8_quantize(4, 512, mode) for mode in ("token", "group", "tensor")]
    cs += [M.case_fp8_mm(16, 256, 512, "small"),  # CUTLASS sm_90a (per-token x per-channel)
           M.case_fp8_mm(100, 384, 512, "small"),  # ragged M
           M.case_fp8_mm(16, 256, 512, "small", blockwise=True)]  # mma.sync blockwise
    cs += [M.case_int8_quantize(4, 512, "token"), M.case_int8_quantize(4, 512, "token", symmetric=False),
           M.case_int8_quantize(4, 512, "tensor")]
    cs += [M.case_int8_mm(16, 256, 512, "small"), M.case_int8_mm(100, 384, 512, "small")]  # small / large tiles
    cs += [M.case_int4(4, 256, 1024, "small"),  # split-K
           M.case_int4(512, 256, 512, "small"),  # dequantise + dense
           M.case_int4(300, 256, 1024, "small", deterministic=True)]  # fixed split-K, 256-row launches
    cs += [M.case_fp4(4, 256, 1024, "small", "nvfp4"),  # split-K, global scale
           M.case_fp4(100, 256, 512, "small", "mxfp4")]  # 64-row blocks
    cs += [M.case_dense_mm(4, 256, 512, "small"), M.case_dense_mm(100, 384, 520, "small")]  # small / large tiles
    cs += [M.case_tree_verify(2, 8, mode, v=5000) for mode in ("greedy", "sample", "draft")]
    cs += [M.case_moe_topk(37, "tiny"), M.case_moe_align(37, "tiny"),
           M.case_fused_moe(3, "tiny"), M.case_fused_moe(300, "tiny"),  # 16- and 64-row blocks
           M.case_fused_moe_fp8(37, "tiny", False), M.case_fused_moe_fp8(37, "tiny", True),
           M.case_fused_moe_int4(37, "tiny"), M.case_fused_moe_fp4(37, "tiny", "nvfp4"),
           M.case_fused_moe_fp4(300, "tiny", "mxfp4"), M.case_moe_expert_loop(5, "tiny")]
    cs += [M.case_causal_conv1d(3, 1, dim=200), M.case_causal_conv1d(1, 37, dim=200)]  # decode, prefill
    cs += [M.case_gated_delta_rule(3, 1, hk=2, hv=4, d=64),  # decode, Hv = 2 Hk
           M.case_gated_delta_rule(2, 37, hk=1, hv=2, d=128)]  # prefill on the recurrent kernel
    return cs


def interleave(indexed):
    """[(index, case)] reordered round robin over families (each family's own order kept)."""
    groups = OrderedDict()
    for i, c in indexed:
        groups.setdefault(c.family, []).append((i, c))
    out = []
    while any(groups.values()):
        for fam in list(groups):
            if groups[fam]:
                out.append(groups[fam].pop(0))
    return out


def nvtx(push, name=None):
    try:
        if push:
            torch.cuda.nvtx.range_push(name)
        else:
            torch.cuda.nvtx.range_pop()
    except Exception:  # noqa: BLE001 (no NVTX: the log order still attributes launches)
        pass


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--ncu", action="store_true", help="every case once, NVTX-labelled, for ncu")
    mode.add_argument("--time", action="store_true", help="time every case with CUDA events")
    mode.add_argument("--sanitize", action="store_true", help="small cases, once each, for compute-sanitizer")
    p.add_argument("--quick", action="store_true", help="model.py's --quick case list")
    p.add_argument("--only", default=None, help="comma-separated families (prefix match)")
    p.add_argument("--deadline", type=float, default=None, help="stop starting new cases after S seconds")
    p.add_argument("--manifest", "--json", dest="manifest", default=None, help="write the case list/results here")
    p.add_argument("--dry-run", action="store_true", help="build the cases on the CPU and list them (no GPU)")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    deadline = t_start + args.deadline if args.deadline else None
    cases = list(enumerate(sanitize_cases() if args.sanitize else M.all_cases(args.quick)))
    if args.only:
        keys = args.only.split(",")
        cases = [(i, c) for i, c in cases if any(c.family.startswith(k) for k in keys)]
    cases = interleave(cases)

    device = torch.device("cuda")
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("gpu_cases: no CUDA device (use --dry-run to check the case list)", file=sys.stderr)
            return 2
        ops = DeviceOps(device)
        M._OPS = ops  # model's case builders call M.ns(): torch.ops.fastinfer on the GPU now
        torch.cuda.init()

    results, cut = [], False
    for i, c in cases:
        if deadline is not None and time.perf_counter() > deadline:
            cut = True
            results.append(dict(index=i, family=c.family, case=c.label, status="skipped (deadline)"))
            continue
        rec = dict(index=i, family=c.family, case=c.label)
        t0 = time.perf_counter()
        try:
            torch.manual_seed(0)
            # Inputs are made on the GPU (fast; the values are random either way), except
            # tree_verify's, whose builder walks the trees with a CPU generator and the CPU op.
            on_gpu = not args.dry_run and c.family not in CPU_BUILT
            with torch.device("cuda") if on_gpu else contextlib.nullcontext():
                spec = c.build()
            if args.dry_run:
                rec["status"] = "built"
            elif args.time:
                fn = spec["fn"]
                fn()  # moves the inputs, first launch
                torch.cuda.synchronize()
                rec["time_us"] = time_fn(lambda _: fn(), [None], device, budget_s=0.05, reps=5, warmup=2)
                rec["status"] = "ok"
            else:
                print(f"MCASE {i} begin {c.family} | {c.label}", flush=True)
                nvtx(True, CASE_RANGE.format(i))
                try:
                    spec["fn"]()
                    torch.cuda.synchronize()
                finally:
                    nvtx(False)
                print(f"MCASE {i} end", flush=True)
                rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 (one failing case must not hide the others)
            rec["status"] = "error"
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"MCASE {i} error {rec['error']}", flush=True)
            traceback.print_exc(limit=3)
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        results.append(rec)
        if not args.dry_run:
            ops.reset()
            spec = None
            torch.cuda.empty_cache()
        if args.time and rec.get("time_us") is not None:
            print(f"{c.family[:24]:<24} {c.label[:56]:<56} {rec['time_us']:>10.2f} us (events)", flush=True)

    summary = dict(kind="gpu_cases", mode="ncu" if args.ncu else "time" if args.time else "sanitize",
                   dry_run=args.dry_run, device=None if args.dry_run else device_label(device),
                   torch=torch.__version__, commit=git_commit(), deadline_cut=cut,
                   seconds=round(time.perf_counter() - t_start, 2), cases=results,
                   timing_note=("CUDA events around batches of calls on the same inputs (L2-warm below 60 MB)"
                                if args.time else None))
    n_ok = sum(r["status"] in ("ok", "built") for r in results)
    print(f"gpu_cases: {n_ok}/{len(results)} cases ran"
          f"{', deadline cut' if cut else ''}, {summary['seconds']} s", flush=True)
    if args.manifest:
        os.makedirs(os.path.dirname(os.path.abspath(args.manifest)), exist_ok=True)
        with open(args.manifest, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(r["status"] in ("ok", "built", "skipped (deadline)") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
