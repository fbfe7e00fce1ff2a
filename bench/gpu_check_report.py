#!/usr/bin/env python
"""The JSON side of bench/gpu_check.sh: one JSON per phase, and the summary that aggregates them.

Standard library only (no torch), so it runs before the build, after a failed build, and in the
dry-run test (tests/test_gpu_check.py). Subcommands:

    phase     --name N --rc RC --seconds S --deadline D --log LOG [--details D.json] [--command C] --out P.json
    summary   --out-dir OUT [--env ENV.json] [--compare CMP.json]    -> OUT/gpu_check.json (+ a table on stdout)
    pytest    --junit X.xml --out D.json                                -> counts and failed tests
    sanitizer --log TOOL=LOG ... --out D.json                           -> errors per tool, kernel and case
    probe     --gpu GPU.txt --sim SIM.txt --out D.json                  -> do the fragment layouts match
    bench     --dir DIR --out D.json                                    -> the benchmark JSONs of the phase

A phase's status is "ok" (exit status 0), "timeout" (killed at its deadline: 124, or 137 after the
grace period) or "fail"; "skipped" when the script was told not to run it. The phase JSON carries the
last lines of its log, so no log file needs to come back from the machine.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

PHASE_ORDER = ["build", "pytest", "probe", "sanitizer", "ncu", "bench"]
TAIL_LINES, TAIL_CHARS = 60, 6000


def status_of(rc: int) -> str:
    if rc == 0:
        return "ok"
    if rc in (124, 137):
        return "timeout"
    if rc == 200:  # gpu_check.sh: phase not selected (GPU_CHECK_PHASES)
        return "skipped"
    return "fail"


def tail(path: str, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> str:
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return ""
    text = "\n".join(text.splitlines()[-lines:])
    return text[-chars:]


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cmd_phase(a):
    details = load(a.details) if a.details else None
    doc = dict(name=a.name, status=status_of(a.rc), rc=a.rc, seconds=round(a.seconds, 1), deadline=a.deadline,
               max_deadline=a.max_deadline, command=a.command, details=details if details is not None else {},
               log_tail=tail(a.log))
    if a.rc in (124, 137):
        doc["note"] = f"killed at its deadline ({a.deadline} s)"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


def key_numbers(p: dict) -> str:
    d = p.get("details") or {}
    n = p.get("name")
    if n == "build":
        return f"cuda_available={d.get('cuda_available')} torch={d.get('torch')}"
    if n == "pytest":
        return (f"{d.get('passed', '?')} passed, {d.get('failed', '?')} failed, {d.get('errors', '?')} errors, "
                f"{d.get('skipped', '?')} skipped")
    if n == "probe":
        return f"match={d.get('match')}"
    if n == "sanitizer":
        return ", ".join(f"{t}: {v.get('errors')} errors" for t, v in (d.get("tools") or {}).items())
    if n == "ncu":
        return f"{len(d.get('launches') or [])} launches, {d.get('attributed', '?')} attributed"
    if n == "bench":
        return ", ".join(sorted(d.get("files") or []))
    return ""


def cmd_summary(a):
    phases = {}
    for path in glob.glob(os.path.join(a.out_dir, "phases", "*.json")):
        p = load(path)
        if p and "name" in p:
            phases[p["name"]] = p
    order = [n for n in PHASE_ORDER if n in phases] + sorted(n for n in phases if n not in PHASE_ORDER)
    env = load(a.env) if a.env else None
    doc = dict(kind="gpu_check", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               env=env or {}, budget_s={n: phases[n].get("deadline") for n in order},
               seconds={n: phases[n].get("seconds") for n in order},
               status={n: phases[n].get("status") for n in order},
               total_seconds=round(sum(phases[n].get("seconds") or 0 for n in order), 1),
               all_ok=all(phases[n].get("status") in ("ok", "skipped") for n in order) and bool(order),
               phases={n: phases[n] for n in order})
    cmp_doc = load(a.compare) if a.compare else None
    if cmp_doc is not None:
        doc["compare_model"] = dict(model_file=cmp_doc.get("model_file"), summary=cmp_doc.get("summary"),
                                    cases=cmp_doc.get("cases"))
    with open(os.path.join(a.out_dir, "gpu_check.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'phase':<10} {'status':<8} {'seconds':>8} {'deadline':>8}  key numbers")
    for n in order:
        p = phases[n]
        print(f"{n:<10} {p.get('status', '?'):<8} {p.get('seconds', 0):>8} {p.get('deadline') or '-':>8}  "
              f"{key_numbers(p)}")
    print(f"total {doc['total_seconds']} s; all ok: {doc['all_ok']}")
    return 0


def cmd_pytest(a):
    out = dict(tests=0, passed=0, failed=0, errors=0, skipped=0, time_s=None, failures=[])
    try:
        root = ET.parse(a.junit).getroot()
    except (OSError, ET.ParseError) as e:
        out["error"] = f"no junit report: {e}"
    else:
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        t = 0.0
        for s in suites:
            t += float(s.get("time", 0) or 0)
            for case in s.iter("testcase"):
                out["tests"] += 1
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                kinds = {c.tag for c in case}
                if "failure" in kinds or "error" in kinds:
                    el = case.find("failure") if "failure" in kinds else case.find("error")
                    out["failed" if "failure" in kinds else "errors"] += 1
                    if len(out["failures"]) < 60:
                        msg = (el.get("message") or el.text or "").strip().splitlines()
                        out["failures"].append(dict(test=name, message=(msg[0] if msg else "")[:300]))
                elif "skipped" in kinds:
                    out["skipped"] += 1
                else:
                    out["passed"] += 1
        out["time_s"] = round(t, 1)
    json.dump(out, open(a.out, "w"), indent=1)
    return 0


# "at void ns::kernel<T, 8>(Params)+0x1a0 in file.cuh:27" -> "void ns::kernel<T, 8>"
_KERNEL_RE = re.compile(r"\b(?:in|at)\s+(?:0x[0-9a-f]+\s+in\s+)?"
                        r"((?:void\s+)?[A-Za-z_][\w:]*(?:<[^\n]*?>)?)\s*(?:\(|\+0x)")


def parse_sanitizer_log(text: str) -> dict:
    """Errors / hazards of one compute-sanitizer run, by kernel and by the case (MCASE lines) they
    appeared in."""
    res = dict(errors=None, hazards=None, warnings=None, by_kernel={}, by_case={}, messages=[])
    m = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    if m:
        res["errors"] = int(m[-1])
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    if m:
        res["hazards"], res["warnings"] = int(m.group(1)), int(m.group(3))
        res["errors"] = int(m.group(2)) if res["errors"] is None else res["errors"]
    case = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        mc = re.search(r"MCASE (\d+) begin (.*)", line)
        if mc:
            case = f"{mc.group(1)} {mc.group(2)}"
            continue
        body = line.replace("=========", "").strip()
        if re.match(r"(Invalid |Misaligned |Out-of-range |Program hit |Uninitialized |Barrier error|Error: |"
                    r"Warning: |ERROR: )", body) and "SUMMARY" not in body:
            kernel = None
            for nxt in lines[i:i + 4]:
                km = _KERNEL_RE.search(nxt.replace("=========", ""))
                if km and ("fastinfer" in km.group(1) or "cutlass" in km.group(1) or "kernel" in km.group(1)):
                    kernel = km.group(1)
                    break
            k = kernel or "?"
            res["by_kernel"][k] = res["by_kernel"].get(k, 0) + 1
            c = case or "(before the first case)"
            res["by_case"][c] = res["by_case"].get(c, 0) + 1
            if len(res["messages"]) < 20:
                res["messages"].append(dict(case=c, kernel=k, message=body[:300]))
    res["cases_started"] = len(re.findall(r"MCASE \d+ begin", text))
    res["cases_ended"] = len(re.findall(r"MCASE \d+ end", text))
    return res


def cmd_sanitizer(a):
    tools = {}
    for spec in a.log:
        name, _, path = spec.partition("=")
        try:
            text = open(path, errors="replace").read()
        except OSError:
            tools[name] = dict(errors=None, note=f"no log ({path})")
            continue
        tools[name] = parse_sanitizer_log(text)
    json.dump(dict(tools=tools), open(a.out, "w"), indent=1)
    return 0


def cmd_probe(a):
    try:
        g = open(a.gpu).read().splitlines()
        s = open(a.sim).read().splitlines()
    except OSError as e:
        json.dump(dict(match=False, error=str(e)), open(a.out, "w"), indent=1)
        return 0
    diff = [f"line {i + 1}: gpu {x!r} sim {y!r}" for i, (x, y) in enumerate(zip(g, s)) if x != y]
    if len(g) != len(s):
        diff.append(f"lengths differ: gpu {len(g)} lines, sim {len(s)} lines")
    json.dump(dict(match=not diff and bool(g), lines=len(g), differences=len(diff), first_differences=diff[:40]),
              open(a.out, "w"), indent=1)
    return 0


def cmd_bench(a):
    files = {}
    for path in sorted(glob.glob(os.path.join(a.dir, "*.json"))):
        doc = load(path)
        if doc is not None:
            files[os.path.splitext(os.path.basename(path))[0]] = doc
    out = dict(files=sorted(files))
    out.update(files)
    json.dump(out, open(a.out, "w"), indent=1)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("phase")
    p.add_argument("--name", required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--deadline", type=int, default=None)
    p.add_argument("--max-deadline", type=int, default=None)
    p.add_argument("--log", required=True)
    p.add_argument("--details", default=None)
    p.add_argument("--command", default=None)
    p.add_argument("--out", required=True)
    p = sub.add_parser("summary")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--env", default=None)
    p.add_argument("--compare", default=None)
    p = sub.add_parser("pytest")
    p.add_argument("--junit", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("sanitizer")
    p.add_argument("--log", action="append", default=[], help="TOOL=PATH")
    p.add_argument("--out", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--gpu", required=True)
    p.add_argument("--sim", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("bench")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    return dict(phase=cmd_phase, summary=cmd_summary, pytest=cmd_pytest, sanitizer=cmd_sanitizer, probe=cmd_probe,
                bench=cmd_bench)[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
