"""The simt memory-access profiler (cpp/simt/src/profile.cpp, python/fastinfer/simt/_profile.py).

Known answers: cpp/simt/tests/profile_rules.cu has one kernel per access pattern whose counters
per warp request are known exactly (coalesced / strided global accesses, shared-memory bank
conflicts of 32/64/128-bit accesses, ldmatrix on swizzled and unswizzled tiles, cp.async,
atomics, broadcasts, the DRAM footprint, mma counts). Every check is also run under each
deliberately wrong rule (FASTINFER_SIMT_PROFILE_WRONG_RULE) and must then fail, so the checks can
detect the rule they target. The Python entry point (fastinfer.simt.profile on torch.ops.fastinfer_sim)
is checked on rms_norm, whose DRAM footprint and sectors are known in closed form.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "cpp" / "simt" / "tests" / "profile_rules.cu"


def _load_runner():
    path = ROOT / "python" / "fastinfer" / "simt" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_fastinfer_simt_runner_prof", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


runner = _load_runner()
pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("addr2line") is None,
                                reason="g++ / addr2line not available")


def _profile(wrong_rule: str | None = None):
    env_key = "FASTINFER_SIMT_PROFILE_WRONG_RULE"
    old = os.environ.get(env_key)
    try:
        if wrong_rule:
            os.environ[env_key] = wrong_rule
        else:
            os.environ.pop(env_key, None)
        r, report = runner.profile_program(PROGRAM, capture_output=True, timeout=120)
    finally:
        if old is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = old
    assert r.returncode == 0, r.stdout + r.stderr
    assert "profile_rules: OK" in r.stdout
    assert report is not None
    return report


def _kernel(report, name):
    for k in report["kernels"]:
        if k["name"].startswith(name + "("):
            return k
    raise AssertionError(f"kernel {name} not in {[k['name'] for k in report['kernels']]}")


def _lines(k, op, space=None):
    return [e for e in k["lines"] if e["op"] == op and (space is None or e["space"] == space)]


def _per_req(e, field):
    return e[field] / e["requests"]


def checks(report) -> dict[str, bool]:
    """name -> passed, for every known answer of profile_rules.cu."""
    c: dict[str, bool] = {}
    k = _kernel(report, "copy_f32")
    ld, st = _lines(k, "ld.global"), _lines(k, "st.global")
    c["copy_f32 ld.global 4 sectors/request"] = (len(ld) == 1 and ld[0]["requests"] == 128 and
                                                 _per_req(ld[0], "sectors") == 4 and _per_req(ld[0], "ideal_sectors") == 4)
    c["copy_f32 st.global 4 sectors/request"] = len(st) == 1 and _per_req(st[0], "sectors") == 4
    c["copy_f32 DRAM bytes"] = k["totals"]["dram_read_bytes"] == 16384 and k["totals"]["dram_write_bytes"] == 16384
    k = _kernel(report, "copy_16b")
    ld = _lines(k, "ld.global")
    c["copy_16b ld.global 16 sectors/request (ideal)"] = (len(ld) == 1 and ld[0]["requests"] == 32 and
                                                          _per_req(ld[0], "sectors") == 16 and
                                                          _per_req(ld[0], "ideal_sectors") == 16)
    k = _kernel(report, "load_stride2")
    ld = _lines(k, "ld.global")
    c["load_stride2 8 sectors/request, ideal 4"] = (len(ld) == 1 and _per_req(ld[0], "sectors") == 8 and
                                                    _per_req(ld[0], "ideal_sectors") == 4)
    k = _kernel(report, "broadcast")
    ls, lg = _lines(k, "ld.shared"), _lines(k, "ld.global")
    c["broadcast ld.shared 1 wavefront"] = len(ls) == 1 and ls[0]["wavefronts"] == 1 and ls[0]["requests"] == 1
    c["broadcast ld.global 1 sector"] = len(lg) == 1 and lg[0]["sectors"] == 1 and lg[0]["requests"] == 1
    k = _kernel(report, "transpose_naive")
    ls, ss = _lines(k, "ld.shared"), _lines(k, "st.shared")
    c["transpose_naive column read 32-way"] = (len(ls) == 1 and ls[0]["requests"] == 32 and
                                               _per_req(ls[0], "wavefronts") == 32 and
                                               _per_req(ls[0], "ideal_wavefronts") == 1)
    c["transpose_naive row write 1-way"] = len(ss) == 1 and _per_req(ss[0], "wavefronts") == 1
    k = _kernel(report, "transpose_padded")
    ls = _lines(k, "ld.shared")
    c["transpose_padded column read 1-way"] = len(ls) == 1 and _per_req(ls[0], "wavefronts") == 1
    k = _kernel(report, "shared_wide")
    ss, ls = _lines(k, "st.shared"), _lines(k, "ld.shared")
    c["shared_wide loop store: 16 requests of 1 wavefront"] = (len(ss) == 1 and ss[0]["requests"] == 16 and
                                                               ss[0]["wavefronts"] == 16)
    ok = len(ls) == 3
    c["shared_wide float2: 2 wavefronts (ideal 2)"] = ok and ls[0]["wavefronts"] == 2 and ls[0]["ideal_wavefronts"] == 2
    c["shared_wide float4: 4 wavefronts (ideal 4)"] = ok and ls[1]["wavefronts"] == 4 and ls[1]["ideal_wavefronts"] == 4
    c["shared_wide float4 stride 32 B: 8 wavefronts (ideal 4)"] = (ok and ls[2]["wavefronts"] == 8 and
                                                                   ls[2]["ideal_wavefronts"] == 4)
    k = _kernel(report, "ldmatrix_tiles")
    lm = _lines(k, "ldmatrix")
    ok = len(lm) == 2 and all(e["requests"] == 1 for e in lm)
    c["ldmatrix unswizzled: 32 wavefronts (8-way)"] = ok and lm[0]["wavefronts"] == 32 and lm[0]["ideal_wavefronts"] == 4
    c["ldmatrix swizzled: 4 wavefronts"] = ok and lm[1]["wavefronts"] == 4 and lm[1]["ideal_wavefronts"] == 4
    k = _kernel(report, "cp_async_copy")
    ca = _lines(k, "cp.async")
    c["cp.async 16 sectors + 4 wavefronts"] = (len(ca) == 1 and ca[0]["sectors"] == 16 and ca[0]["wavefronts"] == 4 and
                                               ca[0]["ideal_wavefronts"] == 4 and ca[0]["bytes"] == 512)
    c["cp.async DRAM read"] = k["totals"]["dram_read_bytes"] == 512
    k = _kernel(report, "atomics")
    sa, ga = _lines(k, "atomic", "shared"), _lines(k, "atomic", "global")
    c["shared atomic on one word: 32 serialised"] = len(sa) == 1 and _per_req(sa[0], "wavefronts") == 32
    c["global atomic on one word: 1 sector"] = len(ga) == 1 and _per_req(ga[0], "sectors") == 1 and ga[0]["requests"] == 2
    c["atomics DRAM footprint: one sector"] = (k["totals"]["dram_read_bytes"] == 32 and
                                               k["totals"]["dram_write_bytes"] == 32 and
                                               k["totals"]["footprint_bytes"] == 32)
    k = _kernel(report, "early_exit")
    rec = k["records"][0]
    c["blocks_storing: 4 of 8 blocks store"] = (rec["blocks_run"] == 8 and rec["blocks_storing"] == 4 and
                                                 k["totals"]["blocks_storing"] == 4)
    k = _kernel(report, "mma_once")
    c["mma count: 2 warps x 4096 FLOPs"] = (k["totals"]["tensor_flops"] == 8192 and
                                           k["totals"]["mma"]["m16n8k16.bf16"] == 2)
    return c


@pytest.fixture(scope="module")
def report():
    return _profile()


def test_known_answers(report):
    failed = [name for name, ok in checks(report).items() if not ok]
    assert not failed, "failed known answers: " + "; ".join(failed) + "\n" + runner._profile_module().format_table(report)


def test_report_layout(report):
    assert report["format"] == "fastinfer-simt-profile"
    for k in report["kernels"]:
        assert isinstance(k["name"], str) and k["launches"] >= 1
        for e in k["lines"]:
            assert e["op"] in ("ld.global", "st.global", "ld.shared", "st.shared", "ldmatrix", "cp.async", "atomic")
            for f in ("requests", "sectors", "wavefronts", "bytes"):
                assert isinstance(e[f], int) and e[f] >= 0
            assert e["file"].endswith("profile_rules.cu"), e  # attributed to the kernel's own lines
            assert isinstance(e["line"], int) and e["line"] > 0
            if e["op"] in ("ld.shared", "st.shared", "ldmatrix"):
                assert e["sectors"] == 0
            if e["op"] in ("ld.global", "st.global"):
                assert e["wavefronts"] == 0


# Each wrong rule must make the check(s) aimed at it fail.
WRONG_RULES = {
    "sector64": ["copy_f32 ld.global 4 sectors/request", "load_stride2 8 sectors/request, ideal 4"],
    "banks16": ["transpose_padded column read 1-way"],
    "no_phases": ["shared_wide float4: 4 wavefronts (ideal 4)", "cp.async 16 sectors + 4 wavefronts"],
    "no_broadcast": ["broadcast ld.shared 1 wavefront"],
    "ldmatrix_one_phase": ["ldmatrix swizzled: 4 wavefronts", "ldmatrix unswizzled: 32 wavefronts (8-way)"],
    "no_occurrence": ["shared_wide loop store: 16 requests of 1 wavefront"],
    "dram_no_dedupe": ["atomics DRAM footprint: one sector"],
    "every_block_stores": ["blocks_storing: 4 of 8 blocks store"],
}


@pytest.mark.parametrize("rule", sorted(WRONG_RULES))
def test_checks_fail_under_a_wrong_rule(rule):
    got = checks(_profile(rule))
    still_passing = [name for name in WRONG_RULES[rule] if got[name]]
    assert not still_passing, f"wrong rule {rule}: these checks did not notice: {still_passing}"


def test_profile_cli_writes_json(tmp_path):
    """`python -m fastinfer.simt profile FILE.cu --json OUT` (source-tree runner)."""
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, str(ROOT / "python" / "fastinfer" / "simt" / "__init__.py"), "profile",
                        str(PROGRAM), "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "transpose_naive" in r.stdout and "ld.shared" in r.stdout  # the table
    data = json.loads(out.read_text())
    assert {k["name"].split("(")[0] for k in data["kernels"]} >= {"copy_f32", "ldmatrix_tiles", "atomics"}


def test_profile_of_a_failing_program_keeps_its_exit_code(tmp_path):
    src = tmp_path / "bad.cu"
    src.write_text('#include "fastinfer/common/launch.cuh"\n'
                   "__global__ void k(float* p) { p[threadIdx.x] = 1.f; }\n"
                   "int main() { float* p; cudaMalloc((void**)&p, 128); "
                   "fastinfer::launch_kernel(k, dim3(1), dim3(32), 0, nullptr, p); return 3; }\n")
    r, report = runner.profile_program(src, capture_output=True, timeout=120)
    assert r.returncode == 3
    k = report["kernels"][0]
    assert k["lines"][0]["op"] == "st.global" and k["lines"][0]["sectors"] == 4


# ---- the Python entry point on the sim ops ------------------------------------------------------
def _simprof_available():
    try:
        import fastinfer  # noqa: F401
        importlib.import_module("fastinfer._simprof")
        importlib.import_module("fastinfer._sim")
    except ImportError:
        return False
    return True


needs_simprof = pytest.mark.skipif(not _simprof_available(), reason="fastinfer._simprof not built")


@needs_simprof
def test_python_profile_of_rms_norm():
    import torch

    import fastinfer.simt as simt

    T, H = 8, 1024
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.randn(H, generator=g).to(torch.bfloat16)
    expected = torch.ops.fastinfer_sim.rms_norm(x, w, 1e-6)
    rep = simt.profile(lambda: torch.ops.fastinfer_sim.rms_norm(x, w, 1e-6))
    assert torch.equal(rep.result, expected)  # the profile build computes the same bits
    k = rep.kernel("rms_norm_kernel")
    assert k["launches"] == 1
    t = k["totals"]
    assert t["dram_read_bytes"] == (T * H + H) * 2  # x (read twice, counted once) + weight
    assert t["dram_write_bytes"] == T * H * 2
    loads = _lines(k, "ld.global")
    assert loads and all(e["sectors"] == e["ideal_sectors"] == 16 * e["requests"] for e in loads)
    assert any(e["file"].endswith("rms_norm.cuh") for e in loads)
    assert torch.ops.__dict__.get("fastinfer_sim") is not torch.ops.fastinfer_simprof  # restored


@needs_simprof
def test_python_profile_launch_only_records_grids_without_running():
    import torch

    import fastinfer.simt as simt

    x = torch.zeros(3000, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    rep = simt.profile(lambda: torch.ops.fastinfer_sim.rms_norm(x, w, 1e-6), launch_only=True)
    (rec,) = rep.kernel("rms_norm_kernel")["records"]
    assert rec["grid"] == [3000, 1, 1] and rec["block"] == [512, 1, 1] and rec["executed"] is False


@needs_simprof
def test_python_profile_sampling_runs_every_kth_cta():
    import torch

    import fastinfer.simt as simt

    T, H = 64, 1024
    x = torch.randn(T, H).to(torch.bfloat16)
    w = torch.randn(H).to(torch.bfloat16)
    rep = simt.profile(lambda: torch.ops.fastinfer_sim.rms_norm(x, w, 1e-6), sample=4)
    (rec,) = rep.kernel("rms_norm_kernel")["records"]
    assert rec["grid"] == [T, 1, 1] and rec["blocks_run"] == T // 4  # rows 2, 6, 10, ... (one y: offset k/2)
    assert rec["dram_read_bytes"] == (T // 4) * H * 2 + H * 2
    assert rec["dram_write_bytes"] == (T // 4) * H * 2


@needs_simprof
def test_python_profile_run_whole_exempts_index_producers():
    """fused_moe under sampling: its alignment (whose output the GEMMs gather by) runs every CTA
    when named in run_whole, and only the sampled ones otherwise; the other launches stay sampled."""
    import torch

    import fastinfer.simt as simt

    T, E, k, H, I = 64, 16, 2, 256, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    weights, ids = torch.ops.fastinfer.moe_topk(torch.randn(T, E, generator=g), k, True, "softmax")

    def run():
        return torch.ops.fastinfer_sim.fused_moe(x, w13, w2, weights, ids, "silu", None, None, None, None)

    whole = simt.profile(run, sample=4, run_whole=("moe_align_kernel",))
    (align,) = whole.kernel("moe_align_kernel")["records"]
    assert align["grid"] == [E, 1, 1] and align["blocks_run"] == E
    (combine,) = whole.kernel("moe_combine_kernel")["records"]
    assert combine["blocks_run"] == T // 4
    # Without the exemption the alignment is sampled like any launch (and fused_moe's GEMMs would
    # gather rows through unwritten indices: the reason for run_whole).
    align_only = simt.profile(lambda: torch.ops.fastinfer_sim.moe_align(ids, E, 16), sample=4)
    (sampled,) = align_only.kernel("moe_align_kernel")["records"]
    assert sampled["blocks_run"] == E // 4


@needs_simprof
def test_python_profile_sampling_is_unbiased_along_x(monkeypatch):
    """Causal prefill on the work-item grid: item x of a sequence is its (n - 1 - x)-th q-tile, so a
    CTA's mma count falls linearly with x. With 4 KV heads (grid y) and one CTA in 8, the sampled
    CTAs' mma count scaled by 8 must match the full run's: the per-row offsets cover the residues
    evenly. (The first rule, (x + 7919 y) % 8 == 0, kept x = 0..3 and 8..11 only: +24% here.)"""
    import torch

    import fastinfer.simt as simt

    T, HQ, HKV, D = 1024, 8, 4, 64
    monkeypatch.setenv("FASTINFER_TEST_DEFAULT_KEY_SPLITS", "1")  # no key split: one CTA per (item, KV head)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, HQ, D, generator=g).to(torch.bfloat16)
    k = torch.randn(T, HKV, D, generator=g).to(torch.bfloat16)
    v = torch.randn(T, HKV, D, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, T], dtype=torch.int32)

    def run():
        return torch.ops.fastinfer_sim.prefill_attention(q, k, v, cu, cu, T, T, D ** -0.5, True)

    def launch(rep):
        (rec,) = rep.kernel("prefill_attention_kernel")["records"]
        return rec

    full = launch(simt.profile(run))
    part = launch(simt.profile(run, sample=8))
    assert full["grid"] == part["grid"] == [T * (HQ // HKV) // 128, HKV, 1]
    assert part["blocks_run"] == full["blocks_run"] // 8
    scaled = part["tensor_flops"] * full["blocks_run"] / part["blocks_run"]
    assert abs(scaled / full["tensor_flops"] - 1) < 0.08, (scaled, full["tensor_flops"])
