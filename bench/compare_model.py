#!/usr/bin/env python
"""How far bench/model.py's MODEL is from the GPU: ncu's counters and times against the model's.

Inputs: a GPU results file written by bench/gpu_check.sh (its summary ``gpu_check.json``, the ncu
phase's ``phases/ncu.json``, or ``bench/ncu_metrics.py parse`` output: launch records of the model's
cases, each attributed to its (family, case)), and a model results file (``bench/model.py --json``,
``bench/results/model-*.json``). The metric mapping is bench/ncu_metrics.py's.

Per kernel launch of every case that both files hold (launches matched in order by kernel name, then
by the kernel's base name when template arguments differ, e.g. another split count):

* time: ncu's ``gpu__time_duration`` vs the model's time, and measured / model;
* DRAM bytes: ncu's ``dram__bytes_read + dram__bytes_write`` vs the model's DRAM bytes, and the ratio;
* global sectors per request (ld + st + cp.async + atomics) measured vs model;
* shared-memory conflict ways: measured wavefronts / (wavefronts - bank conflicts) vs the model's
  wavefronts / ideal wavefronts;
* grid, registers per thread and CTAs per SM (the model's occupancy inputs), GPU vs model.

Per case the launches' sums, and a summary of how far the model is off: the geometric mean of
measured / model time and DRAM bytes over the cases (overall and per family), the share of cases
within 2x, and the cases furthest off either way. Time ratios above 1 mean the GPU is slower than the
model says. Kernels the model does not emulate (the CUTLASS sm_90a fp8 GEMM; the dense matmul after
int4 dequantisation) show as "gpu only" and their cases as "kernels differ".

    python bench/compare_model.py [--gpu bench/results/gpu_check-DATE.json] [--model bench/results/model-after.json]
                                  [--json OUT.json] [--all]

Without ``--gpu`` the newest ``bench/results/gpu_check-*.json`` is used; when there is none yet the
script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

NO_GPU_MESSAGE = (
    "compare_model: no GPU results file yet ({where}).\n"
    "  Run bench/gpu_check.sh on a GPU machine (make gpu-check; see the script's header),\n"
    "  commit its $OUT/gpu_check.json as bench/results/gpu_check-<date>.json, then run\n"
    "  python bench/compare_model.py [--gpu FILE] [--model bench/results/model-after.json]")


# ---- loading --------------------------------------------------------------------------------------
def find_gpu_file() -> Optional[str]:
    files = sorted(glob.glob(os.path.join(RESULTS, "gpu_check-*.json")))
    return files[-1] if files else None


def find_model_file() -> Optional[str]:
    after = os.path.join(RESULTS, "model-after.json")
    if os.path.exists(after):
        return after
    files = sorted(glob.glob(os.path.join(RESULTS, "model-*.json")))
    return files[-1] if files else None


def gpu_launches(doc: dict) -> List[dict]:
    """The ncu launch records inside any of the GPU file layouts."""
    for path in (("launches",), ("details", "launches"), ("phases", "ncu", "details", "launches"),
                 ("phases", "ncu", "launches"), ("ncu", "launches")):
        d = doc
        for k in path:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, list):
            return d
    return []


def gpu_case_times(doc: dict) -> Dict[tuple, float]:
    """{(family, case): CUDA-event time in us} from the bench phase's gpu_cases --time run, if any."""
    for path in (("phases", "bench", "cases_time", "cases"), ("phases", "bench", "details", "cases_time", "cases"),
                 ("cases_time", "cases")):
        d = doc
        for k in path:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, list):
            return {(c["family"], c["case"]): c["time_us"] for c in d if c.get("time_us") is not None}
    return {}


# ---- names ----------------------------------------------------------------------------------------
def strip_params(name: str) -> str:
    """``void ns::k<a, b>(P)`` -> ``ns::k<a,b>`` (no return type, no parameter list, no spaces)."""
    n = re.sub(r"^\s*void\s+", "", name or "")
    depth, cut = 0, len(n)
    for i, ch in enumerate(n):  # the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    return re.sub(r"\s+", "", n[:cut])


def base(name: str) -> str:
    """The kernel's function name without templates: ``fastinfer::norm::rms_norm_kernel``."""
    n = strip_params(name)
    out, depth = [], 0
    for ch in n:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def short(name: str) -> str:
    b = base(name)
    if b.startswith("cutlass::device_kernel"):
        return "cutlass_sm90_gemm" if "Sm90" in (name or "") or "sm90" in (name or "").lower() else "cutlass_kernel"
    return b.rsplit("::", 1)[-1] if b else (name or "?")


def grid_tuple(g) -> Optional[tuple]:
    if g is None:
        return None
    if isinstance(g, (list, tuple)):
        return tuple(int(x) for x in g)
    nums = re.findall(r"\d+", str(g))
    return tuple(int(x) for x in nums) if nums else None


# ---- matching -------------------------------------------------------------------------------------
def match_launches(model_launches: List[dict], gpu: List[dict]):
    """[(model launch or None, gpu launch or None, how)]: in order by full name, then by base name."""
    pairs, used = [], set()
    pending = []
    for m in model_launches:
        j = next((k for k, g in enumerate(gpu) if k not in used and strip_params(g["kernel"]) ==
                  strip_params(m["kernel"])), None)
        if j is None:
            pending.append(m)
            continue
        used.add(j)
        pairs.append((m, gpu[j], "name"))
    for m in pending:
        j = next((k for k, g in enumerate(gpu) if k not in used and base(g["kernel"]) == base(m["kernel"])), None)
        if j is None:
            pairs.append((m, None, "model only"))
            continue
        used.add(j)
        pairs.append((m, gpu[j], "base name"))
    for k, g in enumerate(gpu):
        if k not in used:
            pairs.append((None, g, "gpu only"))
    order = {id(g): k for k, g in enumerate(gpu)}
    pairs.sort(key=lambda p: order.get(id(p[1]), len(gpu)) if p[1] is not None else len(gpu))
    return pairs


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def _model_lines(row, kernel_name, single):
    """(sectors/request, conflict ways) of the model for one kernel: per kernel when the model file has
    them (kernel_lines), else the case's aggregate when the case has a single launch."""
    kl = (row.get("kernel_lines") or {}).get(kernel_name)
    src = kl if kl is not None else (row if single else None)
    if src is None:
        return None, None, None
    g, s = src.get("global"), src.get("shared")
    return (g["sectors_per_request"] if g else None, s["conflict_ways"] if s else None,
            s["wavefronts_per_request"] if s else None)


def compare(gpu_doc: dict, model_doc: dict) -> dict:
    model_rows = {(r["family"], r["case"]): r for r in model_doc.get("rows", []) if "error" not in r}
    launches = gpu_launches(gpu_doc)
    event_times = gpu_case_times(gpu_doc)
    by_case = defaultdict(list)
    unattributed = []
    for g in launches:
        if g.get("family") is None or g.get("case") is None:
            unattributed.append(g)
        else:
            by_case[(g["family"], g["case"])].append(g)
    kernels, cases = [], []
    for key, gl in by_case.items():
        row = model_rows.get(key)
        if row is None:
            cases.append(dict(family=key[0], case=key[1], status="not in model file", launches=len(gl)))
            continue
        single = len(row["launches"]) == 1
        pairs = match_launches(row["launches"], gl)
        for m, g, how in pairs:
            spr_m, ways_m, wpr_m = _model_lines(row, m["kernel"], single) if m else (None, None, None)
            k = dict(family=key[0], case=key[1], match=how,
                     kernel=short((g or m)["kernel"]), model_kernel=short(m["kernel"]) if m else None,
                     gpu_us=g["time_ns"] / 1e3 if g and g.get("time_ns") is not None else None,
                     model_us=m["model_time_us"] if m else None,
                     gpu_dram_bytes=g.get("dram_bytes") if g else None,
                     model_dram_bytes=m["model_dram_bytes"] if m else None,
                     gpu_sectors_per_request=g.get("sectors_per_request") if g else None,
                     model_sectors_per_request=spr_m,
                     gpu_conflict_ways=g.get("conflict_ways") if g else None, model_conflict_ways=ways_m,
                     gpu_wavefronts_per_request=g.get("wavefronts_per_request") if g else None,
                     model_wavefronts_per_request=wpr_m,
                     gpu_grid=grid_tuple(g.get("grid")) if g else None, model_grid=grid_tuple(m["grid"]) if m else None,
                     gpu_registers=g.get("registers") if g else None, model_registers=m.get("registers") if m else None,
                     gpu_ctas_per_sm=g.get("ctas_per_sm") if g else None,
                     model_ctas_per_sm=m.get("ctas_per_sm") if m else None)
            k["time_ratio"] = ratio(k["gpu_us"], k["model_us"])
            k["dram_ratio"] = ratio(k["gpu_dram_bytes"], k["model_dram_bytes"])
            kernels.append(k)
        gt = [g["time_ns"] / 1e3 for g in gl if g.get("time_ns") is not None]
        gd = [g["dram_bytes"] for g in gl if g.get("dram_bytes") is not None]
        sec = sum(g["global_sectors"] or 0 for g in gl if g.get("global_sectors") is not None)
        req = sum(g["global_requests"] or 0 for g in gl if g.get("global_requests") is not None)
        w = sum(g["shared_wavefronts_all"] for g in gl if g.get("shared_wavefronts_all") is not None)
        c = sum(g["shared_conflicts_all"] or 0 for g in gl if g.get("shared_wavefronts_all") is not None)
        differ = any(how in ("gpu only", "model only") for _, _, how in pairs)
        cs = dict(family=key[0], case=key[1], status="kernels differ" if differ else "matched",
                  launches_gpu=len(gl), launches_model=len(row["launches"]),
                  gpu_us=sum(gt) if gt else None, model_us=row["model_time_us"],
                  model_roofline_us=row.get("model_roofline_us"), event_us=event_times.get(key),
                  gpu_dram_bytes=sum(gd) if gd else None, model_dram_bytes=row["model_dram_bytes"],
                  ideal_bytes=row.get("ideal_bytes"),
                  gpu_sectors_per_request=sec / req if req else None,
                  model_sectors_per_request=(row.get("global") or {}).get("sectors_per_request"),
                  gpu_conflict_ways=w / (w - c) if w and w > c else None,
                  model_conflict_ways=(row.get("shared") or {}).get("conflict_ways"))
        cs["time_ratio"] = ratio(cs["gpu_us"], cs["model_us"])
        cs["dram_ratio"] = ratio(cs["gpu_dram_bytes"], cs["model_dram_bytes"])
        cases.append(cs)
    return dict(kernels=kernels, cases=cases, summary=summarise(cases),
                unattributed=[dict(id=g.get("id"), kernel=short(g.get("kernel")),
                                   gpu_us=g["time_ns"] / 1e3 if g.get("time_ns") is not None else None)
                              for g in unattributed],
                model_cases_not_measured=sorted(f"{f} | {c}" for f, c in set(model_rows) - set(by_case)))


def _stats(values: List[float]) -> Optional[dict]:
    v = [x for x in values if x is not None and x > 0 and math.isfinite(x)]
    if not v:
        return None
    return dict(n=len(v), geomean=round(math.exp(sum(math.log(x) for x in v) / len(v)), 3),
                median=round(statistics.median(v), 3), min=round(min(v), 3), max=round(max(v), 3),
                within_2x=round(sum(0.5 * (1 - 1e-9) <= x <= 2 * (1 + 1e-9) for x in v) / len(v), 3))


def summarise(cases: List[dict]) -> dict:
    ok = [c for c in cases if c.get("time_ratio") is not None]
    fam = defaultdict(list)
    for c in ok:
        fam[c["family"]].append(c)
    worst = sorted(ok, key=lambda c: -abs(math.log(c["time_ratio"])) if c["time_ratio"] > 0 else 0)[:8]
    spr = [abs(c["gpu_sectors_per_request"] - c["model_sectors_per_request"]) for c in ok
           if c.get("gpu_sectors_per_request") is not None and c.get("model_sectors_per_request") is not None]
    return dict(
        cases_compared=len(ok),
        time_gpu_over_model=_stats([c["time_ratio"] for c in ok]),
        time_gpu_over_model_matched_kernels=_stats([c["time_ratio"] for c in ok if c["status"] == "matched"]),
        dram_gpu_over_model=_stats([c.get("dram_ratio") for c in ok]),
        sectors_per_request_mean_abs_diff=round(sum(spr) / len(spr), 3) if spr else None,
        per_family={f: dict(time=_stats([c["time_ratio"] for c in v]), dram=_stats([c.get("dram_ratio") for c in v]))
                    for f, v in sorted(fam.items())},
        furthest_off=[dict(family=c["family"], case=c["case"], time_ratio=round(c["time_ratio"], 3),
                           gpu_us=round(c["gpu_us"], 2), model_us=round(c["model_us"], 2)) for c in worst])


# ---- printing -------------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _bytes(x):
    if x is None:
        return "-"
    for unit, s in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= s:
            return f"{x / s:.1f}{unit}"
    return f"{x:.0f}"


def print_report(res: dict, gpu_path: str, model_path: str, all_kernels: bool = False, out=sys.stdout):
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"compare_model: GPU {gpu_path} vs MODEL {model_path}")
    p("measured = ncu (gpu__time_duration, dram__bytes_read/write.sum, l1tex sectors/requests, shared "
      "wavefronts/bank conflicts); model = bench/model.py (simt counters + H200 constants)")
    p(f"{'family':<22} {'case':<40} {'kernel':<28} {'match':<9} {'gpu us':>9} {'model us':>9} {'x':>6} "
      f"{'DRAM gpu':>9} {'model':>8} {'x':>5} {'sec/req g/m':>11} {'ways g/m':>11} {'regs g/m':>8}")
    for k in res["kernels"]:
        if not all_kernels and k["match"] == "model only" and k["gpu_us"] is None:
            continue
        p(f"{k['family'][:22]:<22} {k['case'][:40]:<40} {k['kernel'][:28]:<28} {k['match'][:9]:<9} "
          f"{_f(k['gpu_us']):>9} {_f(k['model_us']):>9} {_f(k['time_ratio']):>6} {_bytes(k['gpu_dram_bytes']):>9} "
          f"{_bytes(k['model_dram_bytes']):>8} {_f(k['dram_ratio']):>5} "
          f"{_f(k['gpu_sectors_per_request'], '{:.1f}'):>5}/{_f(k['model_sectors_per_request'], '{:.1f}'):<5} "
          f"{_f(k['gpu_conflict_ways'], '{:.2f}'):>5}/{_f(k['model_conflict_ways'], '{:.2f}'):<5} "
          f"{_f(k['gpu_registers'], '{:.0f}'):>3}/{_f(k['model_registers'], '{:.0f}'):<4}")
    s = res["summary"]
    p("")
    p(f"cases compared: {s['cases_compared']}; unattributed launches: {len(res['unattributed'])}; "
      f"model cases not measured: {len(res['model_cases_not_measured'])}")
    t = s["time_gpu_over_model"]
    if t:
        p(f"time, GPU / model: geomean {t['geomean']}x (median {t['median']}, range {t['min']}..{t['max']}), "
          f"{t['within_2x'] * 100:.0f}% of cases within 2x")
        tm = s["time_gpu_over_model_matched_kernels"]
        if tm:
            p(f"  cases whose kernels the model emulates: geomean {tm['geomean']}x over {tm['n']}")
    d = s["dram_gpu_over_model"]
    if d:
        p(f"DRAM bytes, GPU / model: geomean {d['geomean']}x (range {d['min']}..{d['max']})")
    if s["sectors_per_request_mean_abs_diff"] is not None:
        p(f"global sectors/request: mean |GPU - model| = {s['sectors_per_request_mean_abs_diff']}")
    for f, v in s["per_family"].items():
        if v["time"]:
            p(f"  {f[:34]:<34} time x{v['time']['geomean']:<7} ({v['time']['n']} cases)"
              f"{'   DRAM x' + str(v['dram']['geomean']) if v['dram'] else ''}")
    if s["furthest_off"]:
        p("furthest off: " + "; ".join(f"{c['family']} {c['case']}: {c['time_ratio']}x" for c in s["furthest_off"][:5]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--gpu", default=None, help="gpu_check.json / phases/ncu.json (default: newest "
                                                "bench/results/gpu_check-*.json)")
    ap.add_argument("--model", default=None, help="model results (default: bench/results/model-after.json)")
    ap.add_argument("--json", default=None, help="write the comparison here")
    ap.add_argument("--all", action="store_true", help="also list model launches the GPU did not run")
    a = ap.parse_args(argv)
    gpu_path = a.gpu or find_gpu_file()
    if gpu_path is None or not os.path.exists(gpu_path):
        where = gpu_path if gpu_path else "no bench/results/gpu_check-*.json"
        print(NO_GPU_MESSAGE.format(where=where), file=sys.stderr)
        return 2
    model_path = a.model or find_model_file()
    if model_path is None or not os.path.exists(model_path):
        print("compare_model: no model results file (bench/model.py --json bench/results/model-after.json)",
              file=sys.stderr)
        return 2
    gpu_doc = json.load(open(gpu_path))
    if not gpu_launches(gpu_doc):
        print(f"compare_model: {gpu_path} holds no ncu launch records (did the ncu phase run?)", file=sys.stderr)
        return 2
    res = compare(gpu_doc, json.load(open(model_path)))
    res.update(gpu_file=gpu_path, model_file=model_path, kind="comparison: ncu measurement vs model")
    print_report(res, gpu_path, model_path, a.all)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
