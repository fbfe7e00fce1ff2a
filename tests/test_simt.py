"""Self-tests of the simt emulator (cpp/simt): each program in cpp/simt/tests runs on the CPU.

The runner module is loaded from its file, so these tests import neither torch nor the compiled
fastinfer extension.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "cpp" / "simt" / "tests"


def _load_runner():
    path = ROOT / "python" / "fastinfer" / "simt" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_fastinfer_simt_runner", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


runner = _load_runner()

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not available")


def _run(name: str, seed: int | None = None, timeout: float = 60.0, args=()):
    return runner.run(TESTS / name, args=list(args), seed=seed, timeout=timeout, capture_output=True)


def _ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def test_collectives():
    assert "collectives: OK" in _ok(_run("collectives.cu"))


@pytest.mark.parametrize("seed", [0, 7])
def test_warp_gemm_exact(seed):
    out = _ok(_run("warp_gemm.cu", seed=seed))
    assert out.count(": OK") == 3, out


def test_fragment_probe_layouts():
    out = _ok(_run("fragment_probe.cu"))
    assert "documented-layout check: PASS" in out
    assert "mma.m16n8k16.bf16 C->D identity: yes" in out
    assert "mma.m16n8k32.s8 C->D identity: yes" in out and "mma.m16n8k32.s8 B(L31.b7):" in out
    assert "ldmatrix.x4.trans lane 31: r0=m0[6][7],m0[7][7]" in out


def test_race_depends_on_seed():
    a = _ok(_run("race.cu", seed=1))
    b = _ok(_run("race.cu", seed=2))
    a2 = _ok(_run("race.cu", seed=1))
    assert a != b, "a racy kernel must give seed-dependent results"
    assert a == a2, "a given seed must reproduce the same schedule"


def test_barrier_divergence_is_reported_quickly():
    r = _run("barrier_divergence.cu", timeout=20)
    assert r.returncode != 0
    assert "barrier divergence" in r.stdout
    assert "early_exit" in r.stdout  # the kernel is named


def test_faults():
    out = _ok(_run("faults.cu", timeout=30))
    assert "faults: OK" in out
    assert "UNEXPECTED" not in out


def test_cp_async_without_wait_reads_poison():
    out = _ok(_run("cp_async_nowait.cu"))
    assert "64/64 reads saw the 0xFF poison" in out


def test_switch_speed():
    out = _ok(_run("speed.cu", args=["200"]))
    rates = [float(x) for x in re.findall(r"= ([0-9.]+) M switches/s", out)]
    assert len(rates) == 2 and min(rates) > 0.5, out
    print(out)


def test_installed_cli_runs_a_program(tmp_path):
    """`python -m fastinfer.simt run FILE.cu` of the installed package (headers and library from
    the wheel) compiles, runs, and passes the program's exit code on."""
    import os
    import subprocess
    import sys

    pytest.importorskip("fastinfer._C")
    env = dict(os.environ, FASTINFER_SIMT_SEED="3")
    ok = subprocess.run([sys.executable, "-m", "fastinfer.simt", "run", str(TESTS / "warp_gemm.cu")],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count(": OK") == 3, ok.stdout
    bad = subprocess.run([sys.executable, "-m", "fastinfer.simt", "run", str(TESTS / "barrier_divergence.cu")],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert bad.returncode != 0 and "barrier divergence" in bad.stdout + bad.stderr
