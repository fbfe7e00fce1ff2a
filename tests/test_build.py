"""Build checks: the compiled CUDA kernels carry sm_80 and sm_90a code and none spills registers or
uses a stack frame (from the ptxas -v report kept at build time, and cuobjdump when installed)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fastinfer

PKG_DIR = os.path.dirname(importlib.util.find_spec("fastinfer").origin)
REPORT = os.path.join(PKG_DIR, "ptxas_report.txt")
BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("fastinfer::rms_norm", "CUDA")
needs_cuda_build = pytest.mark.skipif(not BUILT_WITH_CUDA, reason="extension built without CUDA kernels")
REQUIRED_ARCHS = {"sm_80", "sm_90a"}


def parse_ptxas_report(text):
    """{(kernel, arch): {"stack": int, "spill_stores": int, "spill_loads": int, "registers": int}}"""
    entries, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            current = (m.group(1), m.group(2))
            entries[current] = {}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            entries[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entries[current]["registers"] = int(m.group(1))
    return entries


def test_parse_ptxas_report_finds_spills():
    text = (
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_80'\n"
        "ptxas info    : Function properties for _Z1kv\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 0 barriers\n"
    )
    assert parse_ptxas_report(text) == {
        ("_Z1kv", "sm_80"): {"stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 255}
    }


@needs_cuda_build
def test_every_kernel_built_for_required_archs_without_spills():
    assert os.path.exists(REPORT), f"{REPORT} missing: the build must keep the ptxas -v report"
    entries = parse_ptxas_report(open(REPORT).read())
    assert entries, "no kernel found in the ptxas report"
    kernels = {k for k, _ in entries}
    archs = {a for _, a in entries}
    assert REQUIRED_ARCHS <= archs, f"built for {sorted(archs)}, need {sorted(REQUIRED_ARCHS)}"
    missing = [(k, a) for k in kernels for a in REQUIRED_ARCHS if (k, a) not in entries]
    assert not missing, f"kernels without code for an arch: {missing[:5]}"
    bad = {key: v for key, v in entries.items() if v.get("stack", 1) or v.get("spill_stores", 1) or v.get("spill_loads", 1)}
    assert not bad, "kernels with a stack frame or register spills:\n" + "\n".join(f"{k} {a}: {v}" for (k, a), v in bad.items())


def find_cuobjdump():
    spec = importlib.util.find_spec("nvidia")
    for base in list(spec.submodule_search_locations) if spec else []:
        for sub in ("cu13/bin/cuobjdump", "cuda_cuobjdump/bin/cuobjdump"):
            path = os.path.join(base, sub)
            if os.path.exists(path):
                return path
    return shutil.which("cuobjdump")


@needs_cuda_build
def test_extension_contains_sm80_and_sm90a_cubins():
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    ext = importlib.util.find_spec("fastinfer._C").origin
    listing = subprocess.run([tool, "--list-elf", ext], capture_output=True, text=True, check=True).stdout
    found = set(re.findall(r"\.(sm_\d+a?)\.cubin", listing))
    assert REQUIRED_ARCHS <= found, f"cubins in {ext}: {sorted(found)}"
    usage = subprocess.run([tool, "--dump-resource-usage", ext], capture_output=True, text=True, check=True).stdout
    stacks = [int(s) for s in re.findall(r"STACK:(\d+)", usage)]
    assert stacks and max(stacks) == 0, "a kernel uses a stack frame:\n" + usage[:2000]
