"""bench/gpu_check.sh without a GPU: its shell syntax, its header (phases and deadlines documented, in
sync with the script, within the 8-minute budget), and the phase machinery in dry-run mode
(GPU_CHECK_DRY_RUN=1: each phase's command replaced by a stub) -- a failing phase and a timed-out
phase do not stop the later ones, every phase writes its JSON, the summary aggregates them, and what
lands under $OUT fits what the device tool brings back (8 files, 2 folders deep). The report helper's
parsers (junit XML, compute-sanitizer logs) run on hand-made inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
REPORT = ROOT / "bench" / "gpu_check_report.py"
PHASES = ["build", "pytest", "probe", "sanitizer", "ncu", "bench"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def _array(name):
    m = re.search(rf"declare -A {name}=\(([^)]*)\)", SCRIPT.read_text())
    return {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", m.group(1))}


def _scalar(name):
    return int(re.search(rf"^{name}=(?:\$\{{\w+:-)?(\d+)", SCRIPT.read_text(), re.M).group(1))


def header_table():
    head = SCRIPT.read_text().split("\nset -uo pipefail", 1)[0]
    rows = {}
    for name, mx, res in re.findall(r"^#   (\w+)\s+(\d+)\s+(\d+|-)?\s", head, re.M):
        rows[name] = (int(mx), None if res in ("-", "") else int(res))
    return head, rows


def test_shell_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_header_documents_phases_and_budget():
    head, doc = header_table()
    maxd, reserve = _array("MAXD"), _array("RESERVE")
    total, final, env = _scalar("TOTAL"), _scalar("FINAL"), _scalar("ENV_DEADLINE")
    assert list(maxd) == PHASES and set(reserve) == set(PHASES)
    for p in PHASES:
        assert doc[p] == (maxd[p], reserve[p]), f"header {p}: {doc[p]}, script: {(maxd[p], reserve[p])}"
    assert doc["env"][0] == env and doc["then"][0] == final and doc["total"][0] == total == 480
    assert env + sum(reserve.values()) + final <= total
    # the rule of deadline_of, with every phase running to its deadline: the whole check ends by TOTAL
    t = env
    for i, p in enumerate(PHASES):
        d = max(min(maxd[p], total - final - t - sum(reserve[q] for q in PHASES[i + 1:])), min(reserve[p], maxd[p]))
        t += d
    assert t + final <= total
    assert "Critical path" in head and "fp8_gemm_sm90.cu" in head and "make abi-check" in head


def _run(tmp_path, env_extra, expect_rc=None):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_WORK=str(work), GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    env.update(env_extra)
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    if expect_rc is not None:
        assert r.returncode == expect_rc, r.stdout + r.stderr
    return r, out


def _files_ok(out: Path):
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3, rel  # $OUT/a/b/file at most
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert p.stat().st_size < 16 << 20
    return files


def _fake_inputs(tmp_path):
    """A junit report, sanitizer logs and an ncu export for the stubs to feed the real parsers."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_compare_model as t  # the hand-made ncu export

    (tmp_path / "raw.csv").write_text(t.raw_csv())
    (tmp_path / "ncu.log").write_text(t.console_log())
    (tmp_path / "cases.json").write_text(json.dumps(t.MANIFEST))
    (tmp_path / "junit.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" time="12.5">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad[cuda]">'
        '<failure message="assert 1 == 2">x</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>")
    (tmp_path / "memcheck.log").write_text(
        "========= COMPUTE-SANITIZER\nMCASE 0 begin rms_norm | T=4 H=4096\nMCASE 0 end\n"
        "MCASE 7 begin paged_decode_attention | B=2 ctx=300\n"
        "========= Invalid __global__ read of size 16 bytes\n"
        "=========     at void fastinfer::attention::decode::decode_merge_splits_kernel<__nv_bfloat16>"
        "(fastinfer::DecodeAttentionParams)+0x1a0 in attention_decode.cuh:210\n"
        "=========     by thread (3,0,0) in block (0,1,0)\n=========     Address 0x7f00 is out of bounds\n"
        "MCASE 7 end\n========= ERROR SUMMARY: 1 error\n")
    (tmp_path / "racecheck.log").write_text(
        "========= COMPUTE-SANITIZER\nMCASE 0 begin rms_norm | T=4 H=4096\nMCASE 0 end\n"
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")


def test_dry_run_phases_continue_after_failure_and_timeout(tmp_path):
    _fake_inputs(tmp_path)
    rep = f"{sys.executable} {REPORT}"
    nm = f"{sys.executable} {ROOT / 'bench' / 'ncu_metrics.py'}"
    stubs = {
        # a pipeline whose first command fails fails the phase (pipefail inside phases)
        "GPU_CHECK_STUB_BUILD": ("echo '{\"cuda_available\": false, \"torch\": \"2.11.0\"}' > \"$PHASE_DETAILS\"; "
                                 "false | tail -n 1"),
        "GPU_CHECK_STUB_PYTEST": f"{rep} pytest --junit {tmp_path}/junit.xml --out \"$PHASE_DETAILS\"; exit 1",
        "GPU_CHECK_STUB_PROBE": "echo probing; sleep 60",
        "GPU_CHECK_DEADLINE_PROBE": "2",
        "GPU_CHECK_STUB_SANITIZER": (f"{rep} sanitizer --log memcheck={tmp_path}/memcheck.log "
                                     f"--log racecheck={tmp_path}/racecheck.log --out \"$PHASE_DETAILS\""),
        "GPU_CHECK_STUB_NCU": (f"{nm} parse --raw {tmp_path}/raw.csv --log {tmp_path}/ncu.log "
                               f"--manifest {tmp_path}/cases.json --attempt full --json \"$PHASE_DETAILS\""),
    }
    r, out = _run(tmp_path, stubs, expect_rc=1)  # not all phases ok
    files = _files_ok(out)
    assert {p.name for p in files} == {f"{p}.json" for p in PHASES} | {"gpu_check.json"}
    phase = {p: json.loads((out / "phases" / f"{p}.json").read_text()) for p in PHASES}
    assert phase["build"]["status"] == "fail" and phase["build"]["details"]["cuda_available"] is False
    assert phase["build"]["deadline"] == 220 and phase["probe"]["deadline"] == 2
    assert phase["pytest"]["status"] == "fail" and phase["pytest"]["rc"] == 1
    assert phase["pytest"]["details"]["failed"] == 1 and phase["pytest"]["details"]["passed"] == 1
    assert phase["pytest"]["details"]["failures"][0]["test"] == "tests.test_a::test_bad[cuda]"
    assert phase["probe"]["status"] == "timeout" and phase["probe"]["seconds"] < 20
    assert "probing" in phase["probe"]["log_tail"]
    # the phases after the failures and the timeout still ran
    san = phase["sanitizer"]["details"]["tools"]
    assert phase["sanitizer"]["status"] == "ok" and san["memcheck"]["errors"] == 1 and san["racecheck"]["errors"] == 0
    assert san["memcheck"]["by_case"] == {"7 paged_decode_attention | B=2 ctx=300": 1}
    assert "decode_merge_splits_kernel" in next(iter(san["memcheck"]["by_kernel"]))
    ncu = phase["ncu"]["details"]
    assert phase["ncu"]["status"] == "ok" and len(ncu["launches"]) == 5 and ncu["attributed"] == 4
    assert phase["bench"]["status"] == "ok" and "dry run" in phase["bench"]["log_tail"]
    for p in PHASES:
        assert phase[p]["deadline"] and phase[p]["command"]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["status"] == dict(build="fail", pytest="fail", probe="timeout", sanitizer="ok", ncu="ok", bench="ok")
    assert summary["all_ok"] is False and summary["budget_s"]["probe"] == 2
    assert summary["phases"]["ncu"]["details"]["attributed"] == 4
    assert "pytest     fail" in r.stdout and "probe      timeout" in r.stdout


def test_dry_run_selected_phases_and_all_ok(tmp_path):
    r, out = _run(tmp_path, {"GPU_CHECK_PHASES": "ncu bench"}, expect_rc=0)
    _files_ok(out)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["status"] == dict(build="skipped", pytest="skipped", probe="skipped", sanitizer="skipped",
                                     ncu="ok", bench="ok")
    assert summary["all_ok"] is True


def test_dry_run_deadlines_shrink_to_fit_the_total(tmp_path):
    """With a 20 s total the build's 220 s maximum is cut to what is left (minus the later reserves)."""
    env = {"GPU_CHECK_TOTAL": "20", "GPU_CHECK_STUB_BUILD": "sleep 60"}
    env.update({f"GPU_CHECK_RESERVE_{p.upper()}": "1" for p in PHASES})
    r, out = _run(tmp_path, env, expect_rc=1)
    build = json.loads((out / "phases" / "build.json").read_text())
    assert build["status"] == "timeout" and build["max_deadline"] == 220
    assert 1 <= build["deadline"] <= 20 - 10 - 5 and build["seconds"] < 15
    assert json.loads((out / "phases" / "bench.json").read_text())["deadline"] <= 20 - 10 - build["deadline"]


def test_dry_run_no_phases(tmp_path):
    r, out = _run(tmp_path, {"GPU_CHECK_PHASES": ""}, expect_rc=0)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert set(summary["status"].values()) == {"skipped"} and list(summary["status"]) == PHASES


def test_report_helpers_on_missing_inputs(tmp_path):
    """A phase whose tool never ran still gets a JSON (the parsers do not crash on absent files)."""
    py = [sys.executable, str(REPORT)]
    subprocess.run(py + ["pytest", "--junit", str(tmp_path / "none.xml"), "--out", str(tmp_path / "p.json")],
                   check=True)
    assert "no junit report" in json.loads((tmp_path / "p.json").read_text())["error"]
    subprocess.run(py + ["sanitizer", "--log", f"memcheck={tmp_path}/none.log", "--out", str(tmp_path / "s.json")],
                   check=True)
    assert json.loads((tmp_path / "s.json").read_text())["tools"]["memcheck"]["errors"] is None
    subprocess.run(py + ["probe", "--gpu", str(tmp_path / "g.txt"), "--sim", str(tmp_path / "s.txt"), "--out",
                         str(tmp_path / "pr.json")], check=True)
    assert json.loads((tmp_path / "pr.json").read_text())["match"] is False
    (tmp_path / "g.txt").write_text("a\nb\n")
    (tmp_path / "s.txt").write_text("a\nc\n")
    subprocess.run(py + ["probe", "--gpu", str(tmp_path / "g.txt"), "--sim", str(tmp_path / "s.txt"), "--out",
                         str(tmp_path / "pr.json")], check=True)
    d = json.loads((tmp_path / "pr.json").read_text())
    assert d["match"] is False and d["differences"] == 1
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_metrics.py"), "parse", "--raw",
                        str(tmp_path / "none.csv"), "--json", str(tmp_path / "n.json")])
    assert r.returncode == 1 and "header" in json.loads((tmp_path / "n.json").read_text())["error"]


FAKE_NCU = r'''#!/usr/bin/env bash
# stands in for ncu: --query-metrics, --import (CSV export), and a profiling run (writes the report and the
# case manifest the real run's case runner would, prints the console log)
case " $* " in
  *" --version "*) echo "NVIDIA (R) Nsight Compute Command Line Profiler (stand-in)"; exit 0 ;;
  *" --query-metrics "*) cat "$FAKE_DIR/query.txt"; exit 0 ;;
  *" --import "*)
    if [[ " $* " == *" --print-nvtx-rename kernel "* ]]; then cat "$FAKE_DIR/nvtx.csv"; else cat "$FAKE_DIR/raw.csv"; fi
    exit 0 ;;
esac
printf '%s\n' "$@" > "$FAKE_DIR/ncu_args.txt"
if [ -n "${FAKE_NCU_FAIL_FULL:-}" ] && [[ " $* " != *" --quick "* ]]; then
  echo "==ERROR== Failed to find metric l1tex__nonexistent"; exit 1
fi
out=; man=; prev=
for a in "$@"; do
  [ "$prev" = "-o" ] && out=$a
  [ "$prev" = "--manifest" ] && man=$a
  prev=$a
done
echo report > "$out.ncu-rep"; cp "$FAKE_DIR/cases.json" "$man"; cat "$FAKE_DIR/ncu.log"
'''

FAKE_SANITIZER = r'''#!/usr/bin/env bash
tool=memcheck; prev=
for a in "$@"; do [ "$prev" = "--tool" ] && tool=$a; prev=$a; done
echo "$*" >> "$FAKE_DIR/sanitizer_args.txt"
cat "$FAKE_DIR/$tool.log"
[ "$tool" = memcheck ] && exit 3
exit 0
'''


def test_real_phases_with_stand_in_tools(tmp_path):
    """The real sanitizer and ncu phase bodies (not stubs) with stand-ins for compute-sanitizer and ncu on
    PATH: their arguments, the files they pass between steps, the parsing, and the model comparison."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_compare_model as t

    _fake_inputs(tmp_path)
    (tmp_path / "nvtx.csv").write_text(t.raw_csv(rename=True))
    (tmp_path / "query.txt").write_text("Metric Name  Description\n"
                                        "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts  # of sectors\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("ncu", FAKE_NCU), ("compute-sanitizer", FAKE_SANITIZER)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = {"GPU_CHECK_DRY_RUN": "0", "GPU_CHECK_PHASES": "sanitizer ncu", "FAKE_DIR": str(tmp_path),
           "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    r, out = _run(tmp_path, env, expect_rc=1)  # memcheck "found" an error
    _files_ok(out)
    san = json.loads((out / "phases" / "sanitizer.json").read_text())
    assert san["status"] == "fail", san["log_tail"]
    assert san["details"]["tools"]["memcheck"]["errors"] == 1 and san["details"]["tools"]["racecheck"]["errors"] == 0
    sargs = [a for a in (tmp_path / "sanitizer_args.txt").read_text().splitlines() if a != "--version"]  # env
    assert [a.split()[1] for a in sargs] == ["memcheck", "racecheck"]
    assert all("--error-exitcode 3" in a and "bench/gpu_cases.py --sanitize --manifest" in a for a in sargs)
    ncu = json.loads((out / "phases" / "ncu.json").read_text())
    assert ncu["status"] == "ok", ncu["log_tail"]
    d = ncu["details"]
    assert len(d["launches"]) == 5 and d["attributed"] == 4 and d["attempt"] == "full"
    assert "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum" in d["metrics"]  # optional, listed by the query
    assert "l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum" in d["optional_left_out"]
    args = (tmp_path / "ncu_args.txt").read_text().splitlines()
    assert args[args.index("--metrics") + 1] == ",".join(d["metrics"])
    assert args[args.index("-k") + 1] == "regex:.*(fastinfer::|cutlass::device_kernel).*"
    assert "--nvtx" in args and args[args.index("--clock-control") + 1] == "none"
    i = args.index("--ncu")
    assert args[i - 1].endswith("bench/gpu_cases.py") and args[i + 1] == "--deadline" and int(args[i + 2]) > 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["status"]["ncu"] == "ok" and summary["status"]["build"] == "skipped"
    # the comparison ran on the summary against the shipped model file: rms_norm T=1 is one of its cases
    cmp_cases = {(c["family"], c["case"]): c for c in summary["compare_model"]["cases"]}
    rms = cmp_cases[("rms_norm", "T=1 H=4096")]
    assert rms["status"] == "matched" and rms["gpu_us"] == pytest.approx(3.0)
    assert "time, GPU / model" in r.stdout


def test_ncu_phase_retries_with_the_minimal_set(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    import test_compare_model as t
    import ncu_metrics as nm

    _fake_inputs(tmp_path)
    (tmp_path / "nvtx.csv").write_text(t.raw_csv(rename=True))
    (tmp_path / "query.txt").write_text("")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ncu").write_text(FAKE_NCU)
    (bindir / "ncu").chmod(0o755)
    env = {"GPU_CHECK_DRY_RUN": "0", "GPU_CHECK_PHASES": "ncu", "FAKE_DIR": str(tmp_path), "FAKE_NCU_FAIL_FULL": "1",
           "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    r, out = _run(tmp_path, env, expect_rc=0)
    ncu = json.loads((out / "phases" / "ncu.json").read_text())
    assert ncu["status"] == "ok" and ncu["details"]["attempt"] == "minimal", ncu["log_tail"]
    assert "retrying with the minimal metric set" in ncu["log_tail"]
    args = (tmp_path / "ncu_args.txt").read_text().splitlines()  # the second run's
    assert "--quick" in args
    assert args[args.index("--metrics") + 1] == ",".join(m.ncu for m in nm.METRICS if m.key in nm.MINIMAL)
