"""bench/gpu_cases.py without a GPU: the case lists (the model's, the sanitizer's), the round-robin order
under a deadline, and the proxy that sends the model's op calls to another device -- here the Meta
device (every op's fake impl serves meta tensors), so each case's call reaches torch.ops.fastinfer
with its tensors moved, views keeping their strides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

gc = pytest.importorskip("gpu_cases")
M = gc.M


def test_interleave_round_robin_keeps_each_family_in_order():
    cases = list(enumerate(M.all_cases(quick=True)))
    order = gc.interleave(cases)
    assert sorted(i for i, _ in order) == [i for i, _ in cases]
    families = list(dict.fromkeys(c.family for _, c in cases))
    assert [c.family for _, c in order[:len(families)]] == families  # every family before any family's second
    for fam in families:
        idx = [i for i, c in order if c.family == fam]
        assert idx == sorted(idx)


def test_sanitize_cases_cover_every_model_family():
    model_families = {c.family for c in M.all_cases(quick=False)}
    assert {c.family for c in gc.sanitize_cases()} == model_families


def test_device_ops_moves_arguments_and_keeps_view_strides():
    ops = gc.DeviceOps(torch.device("meta"))
    qkv = torch.randn(4, 6 * 8)
    q = qkv[:, :16].view(4, 2, 8)
    moved = ops.to(q)
    assert moved.device.type == "meta" and moved.stride() == q.stride() and moved.storage_offset() == 0
    k = qkv[:, 16:24].view(4, 1, 8)
    mk = ops.to(k)
    assert mk.stride() == k.stride() and mk.storage_offset() == 16
    assert ops.to(q) is moved  # once per case
    assert ops.to((q, 3, None))[0] is moved
    ops.reset()
    assert ops.to(q) is not moved


@pytest.mark.parametrize("case", gc.sanitize_cases(), ids=lambda c: f"{c.family}:{c.label}")
def test_case_calls_reach_the_ops_on_another_device(case):
    """Each small case's op call, through the proxy, on Meta tensors (shapes and dtypes checked by the
    ops' fake impls): what the GPU run does with CUDA tensors."""
    torch.manual_seed(0)
    spec = case.build()
    saved = M._OPS
    M._OPS = gc.DeviceOps(torch.device("meta"))
    try:
        out = spec["fn"]()
    finally:
        M._OPS = saved
    flat = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
    assert all(t.device.type == "meta" for t in flat)


def test_dry_run_lists_cases(tmp_path):
    man = tmp_path / "cases.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_cases.py"), "--ncu", "--dry-run", "--quick",
                        "--only", "rms_norm,fp8_quantize", "--manifest", str(man)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(man.read_text())
    assert doc["mode"] == "ncu" and doc["dry_run"] and not doc["deadline_cut"]
    # --only matches family prefixes: "rms_norm" selects rms_norm_quant too
    assert {c["family"] for c in doc["cases"]} == {"rms_norm", "rms_norm_quant", "fp8_quantize"}
    assert all(c["status"] == "built" for c in doc["cases"])
    # indices are positions in model.all_cases(quick=True): the ncu launches' key back to the model's cases
    all_q = M.all_cases(quick=True)
    assert all(all_q[c["index"]].label == c["case"] for c in doc["cases"])
