"""The prefill attention launch plan (cuda/include/fastinfer/attention/launch_plan.h), a host
function: tests/host/prefill_launch_plan_checks.cpp, compiled with the host C++ compiler and linked
against the installed kernel library (the simt build, present in every build; the plan is host
code), checks its choices and workspace layout on a table of shapes without a device."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

import fastinfer  # noqa: F401
from fastinfer.simt import cuda_include_dir

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_DIR = os.path.dirname(importlib.util.find_spec("fastinfer").origin)


def test_prefill_launch_plan_host_checks(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    lib = os.path.join(PKG_DIR, "lib", "libfastinfer_kernels_simt.a")
    if not os.path.exists(lib):
        pytest.skip("the kernel library is not installed")
    exe = tmp_path / "prefill_launch_plan_checks"
    cmd = [cxx, "-std=c++20", "-O1", "-I", os.path.join(PKG_DIR, "include"), "-I", str(cuda_include_dir()),
           os.path.join(HERE, "host", "prefill_launch_plan_checks.cpp"), lib, "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
