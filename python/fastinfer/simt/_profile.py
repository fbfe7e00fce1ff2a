"""Memory-access profiles of kernels run in the simt emulator (see cpp/simt/README.md, "Profiling").

The emulator's profiler (``cpp/simt/src/profile.cpp``) groups every global and shared memory
access of profile-built code into warp-level requests and counts, per call site, requests, 32-byte
sectors (global), shared-memory wavefronts (bank conflicts) and bytes, and per launch the distinct
DRAM sectors read and written and the mma.sync instructions. It writes them as "raw" JSON with
call sites as (module, offset); this module maps the call sites to source lines with ``addr2line``
and aggregates them into the report::

    {"kernels": [{"name": str, "launches": int,
                  "lines": [{"file": str, "line": int, "op": "ld.global" | "st.global" | "ld.shared" |
                             "st.shared" | "ldmatrix" | "cp.async" | "atomic",
                             "requests": int, "sectors": int, "wavefronts": int, "bytes": int,
                             "ideal_sectors": int, "ideal_wavefronts": int, "space": str,
                             "function": str, "stack": [str]}],
                  "records": [per launch: grid, block, dynamic_smem, dram_read_bytes, dram_write_bytes,
                              footprint_bytes, mma counts, tensor_flops],
                  "totals": {...}}]}

``file``/``line`` is the innermost source line of the inline chain outside the helper headers
(``fastinfer/common``, ``fastinfer/simt``, system headers): the kernel's own line that called
``Vec::load`` rather than vec.cuh. ``stack`` lists the whole chain, innermost first.

This module must not import torch at import time (:func:`profile` imports it when called).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

OPS = ("ld.global", "st.global", "ld.shared", "st.shared", "ldmatrix", "cp.async", "atomic")
# Floating-point operations of one warp-level mma.sync (2 * M * N * K).
MMA_FLOPS = {"m16n8k16.f16": 2 * 16 * 8 * 16, "m16n8k16.bf16": 2 * 16 * 8 * 16, "m16n8k32.e4m3": 2 * 16 * 8 * 32,
             "m16n8k32.s8": 2 * 16 * 8 * 32}  # s8: integer operations, counted like flops

_HELPER_PARTS = ("/fastinfer/common/", "/fastinfer/simt/", "/include/c++/", "/bits/", "/usr/include/",
                 "/cuda_fp16.hpp", "/cuda_bf16.hpp", "/cuda_fp8.hpp")
_REPO_DIR = Path(__file__).resolve().parents[3]
_compile_program: Any = None  # fastinfer.simt.compile_program (set by fastinfer.simt._profile_module)


def _is_helper(path: str) -> bool:
    return path.startswith("??") or any(p in path for p in _HELPER_PARTS)


def _short_path(path: str) -> str:
    """cuda/include/... for the kernel headers wherever they were compiled from; else the path
    relative to the source tree or the current directory when inside them."""
    for marker in ("/cuda/include/", "/cpp/simt/", "/tests/kernels/", "/cuda/src/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1:]
    p = Path(path)
    for root in (_REPO_DIR, Path.cwd()):
        try:
            return str(p.resolve().relative_to(root.resolve()))
        except (ValueError, OSError):
            pass
    return path


def _addr2line() -> str:
    tool = shutil.which("addr2line")
    if tool is None:
        raise RuntimeError("addr2line (binutils) is needed to map call sites to source lines")
    return tool


def symbolize(sites: Sequence[tuple[str, int]]) -> dict[tuple[str, int], list[tuple[str, str, int]]]:
    """(module, offset of a return address) -> inline chain [(function, file, line)], innermost first.
    The address looked up is offset - 1 (inside the call instruction)."""
    by_module: dict[str, list[int]] = defaultdict(list)
    for mod, off in sites:
        by_module[mod].append(off)
    out: dict[tuple[str, int], list[tuple[str, str, int]]] = {}
    tool = _addr2line() if sites else ""
    for mod, offs in by_module.items():
        offs = sorted(set(offs))
        if not mod or not os.path.exists(mod):
            for o in offs:
                out[(mod, o)] = [("??", "??", 0)]
            continue
        for i in range(0, len(offs), 2000):
            chunk = offs[i:i + 2000]
            r = subprocess.run([tool, "-e", mod, "-f", "-C", "-i", "-a"] + [hex(max(o - 1, 0)) for o in chunk],
                               capture_output=True, text=True)
            frames: dict[int, list[tuple[str, str, int]]] = {}
            cur = None
            lines = r.stdout.splitlines()
            j = 0
            while j < len(lines):
                ln = lines[j]
                if ln.startswith("0x") and all(c in "0123456789abcdefx" for c in ln.strip()):
                    cur = int(ln, 16) + 1
                    frames[cur] = []
                    j += 1
                    continue
                if cur is None or j + 1 >= len(lines):
                    j += 1
                    continue
                func, loc = ln, lines[j + 1]
                loc = loc.split(" (discriminator")[0]
                file, _, line = loc.rpartition(":")
                try:
                    lno = int(line)
                except ValueError:
                    lno = 0
                frames[cur].append((func, file or "??", lno))
                j += 2
            for o in chunk:
                out[(mod, o)] = frames.get(o) or [("??", "??", 0)]
    return out


def function_names(entries: Sequence[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """(module, offset of a function's entry) -> its demangled name (addr2line reads the symbol
    table and line tables, which also hold the hidden symbols dladdr cannot see)."""
    by_module: dict[str, list[int]] = defaultdict(list)
    for mod, off in entries:
        by_module[mod].append(off)
    out: dict[tuple[str, int], str] = {}
    tool = _addr2line() if entries else ""
    for mod, offs in by_module.items():
        offs = sorted(set(offs))
        if not mod or not os.path.exists(mod):
            continue
        r = subprocess.run([tool, "-e", mod, "-f", "-C"] + [hex(o) for o in offs], capture_output=True, text=True)
        lines = r.stdout.splitlines()
        for i, o in enumerate(offs):
            if 2 * i < len(lines) and lines[2 * i] not in ("??", ""):
                out[(mod, o)] = lines[2 * i]
    return out


def _pick_frame(chain: list[tuple[str, str, int]]) -> tuple[str, str, int]:
    for fr in chain:
        if not _is_helper(fr[1]):
            return fr
    return chain[0]


def build_report(raw: dict, label: Optional[str] = None) -> dict:
    """The report (module docstring) from the emulator's raw profile."""
    sites = {(s["module"], s["offset"]) for k in raw.get("kernels", []) for s in k["sites"]}
    syms = symbolize(sorted(sites))
    names = function_names(sorted({(k.get("module", ""), k.get("offset", 0)) for k in raw.get("kernels", [])}))
    kernels = []
    for k in raw.get("kernels", []):
        name = k["name"]
        if name.startswith("kernel@"):
            name = names.get((k.get("module", ""), k.get("offset", 0)), name)
        lines: dict[tuple, dict] = {}
        for s in k["sites"]:
            chain = syms.get((s["module"], s["offset"]), [("??", "??", 0)])
            func, file, line = _pick_frame(chain)
            key = (_short_path(file), line, s["op"], s["space"])
            e = lines.get(key)
            if e is None:
                e = lines[key] = dict(file=key[0], line=line, op=s["op"], space=s["space"], requests=0, sectors=0,
                                      wavefronts=0, bytes=0, ideal_sectors=0, ideal_wavefronts=0, function=func,
                                      stack=[f"{_short_path(f)}:{n}" for _, f, n in chain])
            for f in ("requests", "sectors", "wavefronts", "bytes", "ideal_sectors", "ideal_wavefronts"):
                e[f] += s[f]
        records = []
        totals: dict[str, Any] = dict(dram_read_bytes=0, dram_write_bytes=0, footprint_bytes=0, tensor_flops=0,
                                      mma={m: 0 for m in MMA_FLOPS}, blocks_run=0, blocks_storing=0)
        for r in k["records"]:
            r = dict(r)
            r["tensor_flops"] = sum(MMA_FLOPS[m] * n for m, n in r["mma"].items())
            records.append(r)
            r.setdefault("blocks_storing", 0)
            for f in ("dram_read_bytes", "dram_write_bytes", "footprint_bytes", "tensor_flops", "blocks_run",
                      "blocks_storing"):
                totals[f] += r[f]
            for m, n in r["mma"].items():
                totals["mma"][m] += n
        kernels.append(dict(name=name, launches=k["launches"], totals=totals,
                            lines=sorted(lines.values(), key=lambda e: (e["file"], e["line"], OPS.index(e["op"]))),
                            records=records))
    out = dict(format="fastinfer-simt-profile", version=1, mode=raw.get("mode", "count"), kernels=kernels,
               note="exact counts of the emulated execution (sectors per warp request, shared wavefronts, "
                    "distinct DRAM sectors); not a GPU measurement")
    if label:
        out["program"] = label
    return out


def format_table(report: dict) -> str:
    """Human-readable summary: per kernel and line, requests, sectors/request (ideal) and
    wavefronts/request (ideal)."""
    rows = []
    for k in report["kernels"]:
        t = k["totals"]
        rows.append(f"{k['name']}  launches={k['launches']}  DRAM read={t['dram_read_bytes']} B "
                    f"write={t['dram_write_bytes']} B  tensor FLOPs={t['tensor_flops']}")
        for e in k["lines"]:
            req = max(e["requests"], 1)
            if e["op"] in ("ld.global", "st.global") or (e["op"] == "atomic" and e["space"] == "global"):
                metric = f"sectors/req {e['sectors'] / req:6.2f} (ideal {e['ideal_sectors'] / req:5.2f})"
            elif e["op"] == "cp.async":
                metric = (f"sectors/req {e['sectors'] / req:6.2f} (ideal {e['ideal_sectors'] / req:5.2f})  "
                          f"wavefronts/req {e['wavefronts'] / req:5.2f} (ideal {e['ideal_wavefronts'] / req:4.2f})")
            else:
                metric = f"wavefronts/req {e['wavefronts'] / req:5.2f} (ideal {e['ideal_wavefronts'] / req:4.2f})"
            rows.append(f"  {e['file']}:{e['line']:<5} {e['op']:<10} requests {e['requests']:>9}  {metric}")
    return "\n".join(rows)


def run_profiled_program(source, args: Sequence[str] = (), seed: Optional[int] = None, verbose: bool = False,
                         timeout: Optional[float] = None, capture_output: bool = False,
                         extra_flags: Sequence[str] = ()):
    """Compile the profile build of a program, run it, and return (CompletedProcess, report)."""
    exe = _compile_program(source, extra_flags=extra_flags, verbose=verbose, profile=True)
    env = dict(os.environ)
    if seed is not None:
        env["FASTINFER_SIMT_SEED"] = str(seed)
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        env["FASTINFER_SIMT_PROFILE_OUT"] = str(raw_path)
        r = subprocess.run([str(exe)] + list(args), env=env, timeout=timeout, capture_output=capture_output,
                           text=capture_output)
        if not raw_path.exists():
            return r, None
        raw = json.loads(raw_path.read_text())
    return r, build_report(raw, label=str(Path(source)))


class ProfileReport(dict):
    """The report of :func:`profile` (a dict with the JSON layout); ``result`` holds the callable's
    return value."""

    result: Any = None

    def kernel(self, substring: str) -> dict:
        """The (first) kernel whose name contains ``substring``."""
        for k in self["kernels"]:
            if substring in k["name"]:
                return k
        raise KeyError(f"no kernel matching {substring!r} in {[k['name'] for k in self['kernels']]}")

    def table(self) -> str:
        return format_table(self)


def _simprof_lib():
    import ctypes
    import importlib

    mod = importlib.import_module("fastinfer._simprof")
    lib = ctypes.CDLL(mod.__file__)
    lib.fastinfer_simt_profile_begin.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.fastinfer_simt_profile_end.argtypes = [ctypes.c_char_p]
    lib.fastinfer_simt_profile_run_whole.argtypes = [ctypes.c_char_p]
    return lib


def profile(fn: Callable, *args, launch_only: bool = False, sample: int = 1, run_whole: Sequence[str] = (),
            **kwargs) -> ProfileReport:
    """Run ``fn(*args, **kwargs)`` with ``torch.ops.fastinfer_sim`` served by the profile build of
    the kernels (``fastinfer._simprof``, namespace ``fastinfer_simprof``) and return its report.

    ``fn`` must look the ops up at call time (``torch.ops.fastinfer_sim.rms_norm(...)`` inside the
    callable): during the call ``torch.ops.fastinfer_sim`` is the profiled namespace. With
    ``launch_only`` the kernels do not run (outputs stay uninitialised): only the launch
    configurations (grids, blocks, dynamic smem, the kernel sequence) are recorded, which is
    cheap at any shape. With ``sample`` = k > 1 only one CTA in k runs (every k-th blockIdx.x at
    an offset per blockIdx.y spread over the k residues, every blockIdx.z of them: cpp/simt/README.md,
    "Sampling"): outputs are incomplete,
    the counters are those of the CTAs that ran, and each launch record gives ``blocks_run`` next
    to its grid so that the counters can be scaled (bench/model.py). The launches of kernels whose
    name contains a string of ``run_whole`` run every CTA even under sampling: kernels whose
    outputs later launches index by (fused_moe's alignment orders the rows its GEMMs gather).
    """
    import torch

    import fastinfer  # noqa: F401 (loads torch and the package)

    lib = _simprof_lib()
    ns = torch.ops.fastinfer_simprof
    saved = torch.ops.__dict__.get("fastinfer_sim")
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        setattr(torch.ops, "fastinfer_sim", ns)
        lib.fastinfer_simt_profile_begin(1 if launch_only else 0, max(1, int(sample)))
        lib.fastinfer_simt_profile_run_whole("\n".join(run_whole).encode())
        try:
            result = fn(*args, **kwargs)
        finally:
            ok = lib.fastinfer_simt_profile_end(str(raw_path).encode()) == 0
            if saved is None:
                torch.ops.__dict__.pop("fastinfer_sim", None)
            else:
                setattr(torch.ops, "fastinfer_sim", saved)
        if not ok:
            raise RuntimeError("the simt profiler could not write its data")
        raw = json.loads(raw_path.read_text())
    rep = ProfileReport(build_report(raw))
    rep.result = result
    return rep


def main_profile(ns) -> int:
    """`python -m fastinfer.simt profile FILE.cu [--json OUT]`."""
    r, report = run_profiled_program(ns.file, ns.prog_args, seed=ns.seed, verbose=ns.verbose,
                                     extra_flags=ns.flags)
    if report is None:
        print("fastinfer.simt: the program wrote no profile (did it crash before exit?)", file=sys.stderr)
    else:
        if ns.json and ns.json != "-":
            Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
            Path(ns.json).write_text(json.dumps(report, indent=1))
        if not ns.quiet:
            print(format_table(report), file=sys.stderr if ns.json == "-" else sys.stdout)
        if ns.json == "-":
            print(json.dumps(report, indent=1))
    rc = r.returncode
    return 128 - rc if rc < 0 else rc
