#!/usr/bin/env python
"""The one mapping between the simt profiler's counters and Nsight Compute metrics.

``bench/model.py`` builds its modelled H200 time on counters of the emulated execution
(cpp/simt/README.md, "Profiling"); Nsight Compute (``ncu``) reads the same quantities off the GPU.
This module is the single place that says which ncu metric measures which profiler counter. It is
used by ``bench/gpu_check.sh`` (the ``--metrics`` list of its ncu phase, and the parsing of ncu's
CSV export into the phase JSON) and by ``bench/compare_model.py`` (the derived ratios).

Metric names follow Nsight Compute's metric structure (Kernel Profiling Guide, "Metrics Structure"
and "Metrics Decoder": ``unit__[subunit_]quantity_pipe_<pipe>_mem_<space>_op_<op>.rollup``;
https://docs.nvidia.com/nsight-compute/ProfilingGuide/). Per launch:

simt profiler counter (model input)     Nsight Compute metric (per launch)
--------------------------------------  ----------------------------------------------------------
ld.global requests / sectors            l1tex__t_{requests,sectors}_pipe_lsu_mem_global_op_ld.sum
st.global requests / sectors            l1tex__t_{requests,sectors}_pipe_lsu_mem_global_op_st.sum
cp.async, global side (optional)        l1tex__t_{requests,sectors}_pipe_lsu_mem_global_op_ldgsts.sum
global atomics (optional)               l1tex__t_{requests,sectors}_pipe_lsu_mem_global_op_{atom,red}.sum
ld.shared / st.shared wavefronts        l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{ld,st}.sum
  wavefronts - ideal wavefronts         l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st}.sum
ldmatrix wavefronts (optional)          l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum
  wavefronts - ideal (optional)         l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum
every shared op (optional; the          l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,
  model's "shared" aggregate)           l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
shared requests (optional)              smsp__inst_executed_op_shared_{ld,st}.sum, smsp__inst_executed_op_ldsm.sum
DRAM bytes read / written (footprint)   dram__bytes_read.sum, dram__bytes_write.sum
mma.sync count (optional)               sm__inst_executed_pipe_tensor.sum
(the modelled time)                     gpu__time_duration.sum
grid, block, registers, smem            launch__grid_size, launch__block_size, launch__registers_per_thread,
                                        launch__shared_mem_per_block_{static,dynamic}
CTAs per SM and its limiter             launch__occupancy_limit_{registers,shared_mem,warps,blocks}
waves, occupancy                        launch__waves_per_multiprocessor, sm__maximum_warps_per_active_cycle_pct,
  (achieved: not modelled)              sm__warps_active.avg.pct_of_peak_sustained_active

Semantics that make the two comparable: a request is one warp-level instruction (the profiler's
(warp, call site, occurrence) group); a sector is a 32-byte segment; a shared wavefront is one pass
of the shared-memory pipeline (at most 128 bytes), and ncu's bank-conflict count is the wavefronts
beyond the ideal (NVIDIA developer forum, "Clarification: bank conflicts metric vs wavefronts for
shared memory LDS.128"), so the measured conflict ways are wavefronts / (wavefronts - conflicts),
the model's wavefronts / ideal wavefronts. (Forum reports say ncu's conflict counter can also
count stalls that are not bank conflicts of one instruction, so a measured value slightly above 1 on
a kernel the model finds conflict-free is to be checked against the source view, not taken as a
model error.) DRAM bytes under ncu's default cache control (caches
flushed before each replay) are cold-cache bytes, as the model's distinct-sector footprint is.

"Required" metrics are always requested; "optional" ones only when ``ncu --query-metrics`` lists
them on the device (a name ncu does not know makes it fail the whole collection).

    python bench/ncu_metrics.py list [--query QUERY.txt] [--minimal]   # the --metrics argument
    python bench/ncu_metrics.py parse --raw RAW.csv [--nvtx NVTX.csv] [--log NCU.log] \\
        [--manifest CASES.json] --json OUT.json                         # ncu export -> launches
    python bench/ncu_metrics.py table                                   # the mapping, as text
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence


@dataclass(frozen=True)
class Metric:
    key: str  # field name in the parsed launch records
    ncu: str  # Nsight Compute metric name
    counterpart: str  # what the simt profiler / bench/model.py calls it
    required: bool = True  # always requested (else only when --query-metrics lists it)
    unit: str = ""  # base unit of the value after parsing


METRICS: List[Metric] = [
    Metric("time_ns", "gpu__time_duration.sum", "model_time_us (x 1000)", unit="ns"),
    # global memory: warp-level requests and 32-byte sectors
    Metric("global_ld_requests", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", "requests of ld.global lines"),
    Metric("global_ld_sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "sectors of ld.global lines"),
    Metric("global_st_requests", "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum", "requests of st.global lines"),
    Metric("global_st_sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum", "sectors of st.global lines"),
    Metric("global_ldgsts_requests", "l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum",
           "requests of cp.async lines (global side)", required=False),
    Metric("global_ldgsts_sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum",
           "sectors of cp.async lines (global side)", required=False),
    Metric("global_atom_requests", "l1tex__t_requests_pipe_lsu_mem_global_op_atom.sum",
           "requests of global atomic lines", required=False),
    Metric("global_atom_sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum",
           "sectors of global atomic lines", required=False),
    Metric("global_red_requests", "l1tex__t_requests_pipe_lsu_mem_global_op_red.sum",
           "requests of global reductions", required=False),
    Metric("global_red_sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum",
           "sectors of global reductions", required=False),
    # shared memory: wavefronts and bank conflicts (= wavefronts beyond the ideal)
    Metric("shared_ld_wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "wavefronts of ld.shared"),
    Metric("shared_st_wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "wavefronts of st.shared"),
    Metric("shared_ld_conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
           "wavefronts - ideal_wavefronts of ld.shared"),
    Metric("shared_st_conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
           "wavefronts - ideal_wavefronts of st.shared"),
    Metric("shared_ldsm_wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum",
           "wavefronts of ldmatrix", required=False),
    Metric("shared_ldsm_conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum",
           "wavefronts - ideal_wavefronts of ldmatrix", required=False),
    Metric("shared_wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
           "wavefronts of every shared operation (the model's shared aggregate)", required=False),
    Metric("shared_conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
           "wavefronts - ideal of every shared operation", required=False),
    Metric("shared_ld_insts", "smsp__inst_executed_op_shared_ld.sum", "requests of ld.shared", required=False),
    Metric("shared_st_insts", "smsp__inst_executed_op_shared_st.sum", "requests of st.shared", required=False),
    Metric("shared_ldsm_insts", "smsp__inst_executed_op_ldsm.sum", "requests of ldmatrix", required=False),
    # DRAM
    Metric("dram_read_bytes", "dram__bytes_read.sum", "dram_read_bytes (distinct sectors read x 32)", unit="byte"),
    Metric("dram_write_bytes", "dram__bytes_write.sum", "dram_write_bytes (distinct sectors written x 32)",
           unit="byte"),
    Metric("tensor_insts", "sm__inst_executed_pipe_tensor.sum", "mma instructions (tensor_flops / flops per mma)",
           required=False),
    # launch statistics and occupancy
    Metric("grid_size", "launch__grid_size", "grid (CTAs)"),
    Metric("block_size", "launch__block_size", "threads per CTA"),
    Metric("registers", "launch__registers_per_thread", "registers (ptxas report)"),
    Metric("smem_static", "launch__shared_mem_per_block_static", "smem_static (ptxas report)", unit="byte"),
    Metric("smem_dynamic", "launch__shared_mem_per_block_dynamic", "smem_dynamic (launch record)", unit="byte"),
    Metric("limit_registers", "launch__occupancy_limit_registers", "CTAs per SM allowed by registers"),
    Metric("limit_shared_mem", "launch__occupancy_limit_shared_mem", "CTAs per SM allowed by shared memory"),
    Metric("limit_warps", "launch__occupancy_limit_warps", "CTAs per SM allowed by threads"),
    Metric("limit_blocks", "launch__occupancy_limit_blocks", "CTAs per SM allowed by the CTA limit"),
    Metric("waves", "launch__waves_per_multiprocessor", "waves"),
    Metric("occupancy_theoretical_pct", "sm__maximum_warps_per_active_cycle_pct", "occupancy x 100"),
    Metric("occupancy_achieved_pct", "sm__warps_active.avg.pct_of_peak_sustained_active",
           "(not modelled: latency hiding)"),
]

BY_NCU = {m.ncu: m for m in METRICS}
BY_KEY = {m.key: m for m in METRICS}
# The smallest set that still compares time, DRAM bytes and coalescing (a retry when the full list fails;
# the CSV export's "Grid Size" / "Block Size" columns come without asking).
MINIMAL = ["time_ns", "global_ld_requests", "global_ld_sectors", "global_st_requests", "global_st_sectors",
           "dram_read_bytes", "dram_write_bytes"]

# ncu's kernel filter for our kernels (demangled names): the fastinfer:: kernels and the CUTLASS sm_90a
# fp8 GEMM (cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>).
KERNEL_REGEX = r"regex:.*(fastinfer::|cutlass::device_kernel).*"
# NVTX range around each model case (bench/gpu_cases.py): "mcase:<index>".
CASE_RANGE = "mcase:{}"
_CASE_RE = re.compile(r"mcase:(\d+)")


def base_name(metric: str) -> str:
    """``l1tex__t_sectors_..._ld.sum`` -> ``l1tex__t_sectors_..._ld`` (what --query-metrics lists)."""
    return metric.split(".", 1)[0]


def parse_query(text: str) -> set:
    """Base metric names listed by ``ncu --query-metrics`` (first token of each metric line)."""
    names = set()
    for line in text.splitlines():
        tok = line.strip().split(" ", 1)[0].strip()
        if re.fullmatch(r"[a-z0-9]+__[A-Za-z0-9_]+", tok):
            names.add(tok)
    return names


def select(available: Optional[set] = None, minimal: bool = False):
    """(metrics to request, optional ones dropped because the device does not list them)."""
    chosen, dropped = [], []
    for m in METRICS:
        if minimal and m.key not in MINIMAL:
            continue
        if m.required or (available and base_name(m.ncu) in available):
            chosen.append(m)
        else:
            dropped.append(m)
    return chosen, dropped


# ---- CSV export -> launch records ------------------------------------------------------------------
_UNIT_SCALE = {
    "": 1.0, "nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9,
    "s": 1e9, "byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12, "kibyte": 1024.0,
    "mibyte": 1024.0 ** 2, "gibyte": 1024.0 ** 3,
}


def parse_number(text: str, unit: str = "") -> Optional[float]:
    """``"1,234.5"`` -> 1234.5, scaled to the base unit (ns, bytes); None when not a number."""
    if text is None:
        return None
    t = text.strip().replace(",", "")
    if t in ("", "n/a", "N/A", "nan"):
        return None
    try:
        v = float(t)
    except ValueError:
        return None
    return v * _UNIT_SCALE.get(unit.strip().lower(), 1.0)


def _rows(text: str) -> List[List[str]]:
    """CSV rows of an ncu export, skipping ==PROF== / program lines before the header."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"') or l.startswith("ID,")), None)
    if start is None:
        raise ValueError("ncu CSV: header row (\"ID\", ...) not found")
    return list(csv.reader(io.StringIO("\n".join(lines[start:]))))


def parse_csv(text: str) -> Dict[int, dict]:
    """{ID: {"kernel": name, "grid": str, "block": str, "metrics": {ncu name: value}}} from an ncu CSV export:
    the raw page (one row per launch, a units row under the header) or the details page (one row per
    metric: "Metric Name", "Metric Unit", "Metric Value")."""
    rows = _rows(text)
    header = rows[0]
    col = {h: i for i, h in enumerate(header)}
    out: Dict[int, dict] = {}

    def launch(r):
        i = int(float(r[col["ID"]].replace(",", "")))
        rec = out.setdefault(i, {"id": i, "kernel": r[col["Kernel Name"]] if "Kernel Name" in col else "",
                                 "metrics": {}})
        for src, dst in (("Grid Size", "grid"), ("Block Size", "block")):
            if src in col and r[col[src]]:
                rec[dst] = r[col[src]]
        return rec

    if "Metric Name" in col:  # details page
        for r in rows[1:]:
            if len(r) < len(header) or not r[col["ID"]].strip():
                continue
            name = r[col["Metric Name"]]
            if not name:
                continue
            v = parse_number(r[col["Metric Value"]], r[col["Metric Unit"]] if "Metric Unit" in col else "")
            launch(r)["metrics"][name] = v if v is not None else r[col["Metric Value"]]
        return out
    units = {}
    body = rows[1:]
    if body and not re.fullmatch(r"\s*[\d,]+\s*", body[0][col["ID"]] or ""):  # the units row
        units = {h: body[0][i] for i, h in enumerate(header)}
        body = body[1:]
    for r in body:
        if len(r) < len(header) or not r[col["ID"]].strip():
            continue
        rec = launch(r)
        for h, i in col.items():
            if "__" in h:
                v = parse_number(r[i], units.get(h, ""))
                rec["metrics"][h] = v if v is not None else r[i]
    return out


def parse_log_order(text: str) -> Dict[int, int]:
    """{ncu launch ID: case index} from ncu's console log of the profiled run, where the case runner
    prints ``MCASE <index> begin`` / ``end`` around each case and ncu prints ``==PROF== Profiling "name" - ID: ...``
    while it profiles each launch (the fallback when the NVTX export carries no case names)."""
    out, case, seq = {}, None, 0
    for line in text.splitlines():
        m = re.search(r"MCASE (\d+) (begin|end|error)", line)
        if m:
            case = int(m.group(1)) if m.group(2) == "begin" else None
            continue
        m = re.search(r'==PROF== Profiling "[^"]*"(?: - (\d+))?', line)
        if m:
            i = int(m.group(1)) if m.group(1) is not None else seq
            seq = i + 1
            if case is not None:
                out[i] = case
    return out


def derive(metrics: dict) -> dict:
    """Per-launch quantities in the model's terms (missing metrics count as absent, not zero)."""
    out = {}
    for m in METRICS:
        v = metrics.get(m.ncu)
        out[m.key] = v if isinstance(v, (int, float)) else None
    req = [out[f"global_{o}_requests"] for o in ("ld", "st", "ldgsts", "atom", "red")]
    sec = [out[f"global_{o}_sectors"] for o in ("ld", "st", "ldgsts", "atom", "red")]
    r = sum(x for x in req if x)
    s = sum(x for x in sec if x)
    out["global_requests"] = r if any(x is not None for x in req) else None
    out["global_sectors"] = s if any(x is not None for x in sec) else None
    out["sectors_per_request"] = s / r if r else None
    if out["shared_wavefronts"] is not None and out["shared_conflicts"] is not None:
        w, c = out["shared_wavefronts"], out["shared_conflicts"]
    else:
        parts = [(out[f"shared_{o}_wavefronts"], out[f"shared_{o}_conflicts"]) for o in ("ld", "st", "ldsm")]
        parts = [(a, b) for a, b in parts if a is not None]
        w = sum(a for a, _ in parts) if parts else None
        c = sum(b or 0 for _, b in parts) if parts else None
    out["shared_wavefronts_all"], out["shared_conflicts_all"] = w, c
    out["conflict_ways"] = w / (w - c) if w and c is not None and w > c else None
    insts = [out[k] for k in ("shared_ld_insts", "shared_st_insts", "shared_ldsm_insts") if out[k] is not None]
    out["shared_requests"] = sum(insts) if insts else None
    out["wavefronts_per_request"] = w / out["shared_requests"] if w and out["shared_requests"] else None
    rd, wr = out["dram_read_bytes"], out["dram_write_bytes"]
    out["dram_bytes"] = (rd or 0) + (wr or 0) if rd is not None or wr is not None else None
    lim = [out[k] for k in ("limit_registers", "limit_shared_mem", "limit_warps", "limit_blocks") if out[k] is not None]
    out["ctas_per_sm"] = int(min(lim)) if lim else None
    return out



def launches(raw: str, nvtx: Optional[str] = None, log: Optional[str] = None,
             manifest: Optional[dict] = None) -> List[dict]:
    """Launch records (ID order) with their model case: by the NVTX-renamed export when it names a
    case, else by the console log's order; family/case labels from the case runner's manifest."""
    recs = parse_csv(raw)
    case_of: Dict[int, int] = {}
    if log:
        case_of.update(parse_log_order(log))
    if nvtx:
        try:
            for i, r in parse_csv(nvtx).items():
                m = _CASE_RE.search(r.get("kernel", ""))
                if m:
                    case_of[i] = int(m.group(1))
        except ValueError:
            pass
    cases = {c["index"]: c for c in (manifest or {}).get("cases", [])}
    out = []
    for i in sorted(recs):
        r = recs[i]
        idx = case_of.get(i)
        c = cases.get(idx, {})
        out.append(dict(id=i, kernel=r["kernel"], grid=r.get("grid"), block=r.get("block"), case_index=idx,
                        family=c.get("family"), case=c.get("case"), **derive(r["metrics"])))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("list", help="print the comma-separated --metrics argument")
    pl.add_argument("--query", default=None, help="output of `ncu --query-metrics` (optional metrics need it)")
    pl.add_argument("--minimal", action="store_true", help="the minimal set (retry after a failed collection)")
    pl.add_argument("--dropped", default=None, help="write the optional metrics left out to this file")
    pp = sub.add_parser("parse", help="ncu CSV export -> JSON launch records")
    pp.add_argument("--raw", required=True)
    pp.add_argument("--nvtx", default=None)
    pp.add_argument("--log", default=None)
    pp.add_argument("--manifest", default=None)
    pp.add_argument("--metrics", default=None, help="the --metrics argument used (recorded)")
    pp.add_argument("--dropped", default=None, help="file listing the optional metrics left out (recorded)")
    pp.add_argument("--attempt", default=None, help="free text recorded (full / minimal)")
    pp.add_argument("--json", required=True)
    sub.add_parser("table", help="print the mapping")
    sub.add_parser("regex", help="print ncu's kernel filter (-k) for our kernels")
    a = p.parse_args(argv)
    if a.cmd == "list":
        avail = None
        if a.query:
            try:
                avail = parse_query(open(a.query, errors="replace").read())
            except OSError:
                avail = None
        chosen, dropped = select(avail, a.minimal)
        if a.dropped:
            with open(a.dropped, "w") as f:
                f.write("\n".join(m.ncu for m in dropped) + ("\n" if dropped else ""))
        print(",".join(m.ncu for m in chosen))
        return 0
    if a.cmd == "regex":
        print(KERNEL_REGEX)
        return 0
    if a.cmd == "table":
        for m in METRICS:
            print(f"{m.key:<26} {m.ncu:<64} {'required' if m.required else 'optional':<9} {m.counterpart}")
        return 0
    def read(path):
        try:
            return open(path, errors="replace").read() if path else None
        except OSError:
            return None

    manifest = None
    if a.manifest:
        try:
            manifest = json.load(open(a.manifest))
        except (OSError, ValueError):
            manifest = None
    doc = dict(kind="ncu", attempt=a.attempt, metrics=a.metrics.split(",") if a.metrics else None,
               optional_left_out=[x for x in (read(a.dropped) or "").split() if x])
    if manifest is not None:
        doc["cases"] = dict(ran=sum(c.get("status") == "ok" for c in manifest.get("cases", [])),
                            total=len(manifest.get("cases", [])), deadline_cut=manifest.get("deadline_cut"),
                            errors=[c for c in manifest.get("cases", []) if c.get("status") == "error"][:20])
    rc = 0
    try:
        recs = launches(read(a.raw) or "", read(a.nvtx), read(a.log), manifest)
    except ValueError as e:  # no CSV (ncu failed): the phase JSON says so
        recs, rc = [], 1
        doc["error"] = f"{e}"
    doc.update(launches=recs, attributed=sum(r["case_index"] is not None for r in recs))
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"ncu: {len(recs)} launches, {doc['attributed']} attributed to a model case"
          + (f" ({doc['error']})" if "error" in doc else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
