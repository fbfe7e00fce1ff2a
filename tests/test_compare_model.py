"""bench/compare_model.py and bench/ncu_metrics.py on hand-made inputs: an ncu CSV export (raw page
with its units row, thousands separators, an NVTX-renamed twin and the console log), a small model
results file, and the comparison's figures computed by hand. No GPU and no torch needed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import compare_model as cm  # noqa: E402
import ncu_metrics as nm  # noqa: E402

RMS = "void fastinfer::norm::rms_norm_kernel<__nv_bfloat16, 8>(fastinfer::RmsNormParams)"
DEC4 = ("void fastinfer::attention::decode::paged_decode_attention_kernel<__nv_bfloat16, __nv_bfloat16, 128, 4>"
        "(fastinfer::DecodeAttentionParams)")
DEC8 = DEC4.replace("128, 4>", "128, 8>")
MERGE = "void fastinfer::attention::decode::decode_merge_splits_kernel<__nv_bfloat16>(fastinfer::DecodeAttentionParams)"
FP8 = ("void fastinfer::fp8::fp8_scaled_mm_kernel<fastinfer::mma::GemmConfig<16, 32, 1, 2, 4>, __nv_bfloat16, false>"
       "(fastinfer::Fp8ScaledMmParams)")
CUTLASS = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
           "cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<4>>>>"
           "(T1::Params)")

# ---- a model results file (bench/model.py --json layout, trimmed to what the comparison reads) ----


def _launch(kernel, us, dram, grid, regs=32, ctas=4):
    return dict(kernel=kernel, model_time_us=us, model_dram_bytes=dram, grid=grid, registers=regs, ctas_per_sm=ctas)


MODEL = dict(kind="model", rows=[
    dict(family="rms_norm", case="T=1 H=4096", model_time_us=1.0, model_dram_bytes=24576, model_roofline_us=0.01,
         ideal_bytes=24576, launches=[_launch(RMS, 1.0, 24576, [1, 1, 1])],
         **{"global": dict(sectors_per_request=16.0, ideal_sectors_per_request=16.0),
            "shared": dict(conflict_ways=1.0, wavefronts_per_request=1.0)}),
    dict(family="paged_decode_attention", case="B=1 ctx=4096", model_time_us=10.0, model_dram_bytes=4_000_000,
         model_roofline_us=2.0, ideal_bytes=4_000_000,
         launches=[_launch(DEC4, 8.0, 3_900_000, [8, 1, 4], regs=96, ctas=2), _launch(MERGE, 2.0, 100_000, [1, 32, 1])],
         **{"global": dict(sectors_per_request=4.0), "shared": dict(conflict_ways=1.5, wavefronts_per_request=2.0)},
         kernel_lines={DEC4: {"global": dict(sectors_per_request=4.5),
                              "shared": dict(conflict_ways=2.0, wavefronts_per_request=3.0)},
                       MERGE: {"global": dict(sectors_per_request=2.0)}}),
    dict(family="fp8_scaled_mm", case="M=16 N=4096 K=4096", model_time_us=20.0, model_dram_bytes=16_000_000,
         model_roofline_us=4.0, ideal_bytes=16_000_000, launches=[_launch(FP8, 20.0, 16_000_000, [128, 1, 1])],
         **{"global": dict(sectors_per_request=8.0)}),
    dict(family="tree_verify", case="B=1 N=8 greedy", model_time_us=5.0, model_dram_bytes=1000, model_roofline_us=1.0,
         ideal_bytes=1000,
         launches=[_launch("void fastinfer::speculative::tree_verify_kernel<float, 4>(P)", 5.0, 1000, [1, 1, 1])]),
    dict(family="silu_and_mul", case="broken", error="RuntimeError: x"),
])

MANIFEST = dict(kind="gpu_cases", cases=[
    dict(index=0, family="rms_norm", case="T=1 H=4096", status="ok"),
    dict(index=22, family="paged_decode_attention", case="B=1 ctx=4096", status="ok"),
    dict(index=52, family="fp8_scaled_mm", case="M=16 N=4096 K=4096", status="ok"),
])

# ---- the ncu export: raw page, one row per launch, a units row, thousands separators ----
METRIC_COLS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
               "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
               "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
               "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
               "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
               "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
               "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
               "launch__registers_per_thread", "launch__occupancy_limit_registers",
               "launch__occupancy_limit_shared_mem", "launch__occupancy_limit_warps", "launch__occupancy_limit_blocks"]
UNITS = ["usecond", "Kbyte", "byte", "", "sector", "", "sector", "", "", "", "", "register/thread", "block", "block",
         "block", "block"]
# id, kernel, grid, metric values (time in us, DRAM read in KB: the units row scales them)
LAUNCHES = [
    (0, RMS, "(1, 1, 1)", ["3.00", "30.72", "2,048", "64", "1,024", "64", "1,024", "200", "0", "72", "0",
                           "30", "4", "16", "4", "32"]),
    (1, DEC8, "(8, 1, 8)", ["30.00", "7,800", "0", "10,000", "50,000", "100", "400", "9,000", "3,000", "1,000", "0",
                            "96", "2", "3", "8", "32"]),
    (2, MERGE, "(1, 32, 1)", ["4.00", "150", "50,000", "500", "1,000", "", "", "", "", "", "", "40", "8", "32", "8",
                              "32"]),
    (3, CUTLASS, "(132, 1, 1)", ["15.00", "16,000", "0", "0", "0", "0", "0", "4,000", "0", "0", "0", "168", "1", "1",
                                 "2", "32"]),
    (4, RMS, "(1, 1, 1)", ["2.00", "0", "0", "1", "1", "", "", "", "", "", "", "30", "4", "16", "4", "32"]),
]
CASE_OF = {0: 0, 1: 22, 2: 22, 3: 52}  # launch 4 ran outside any case (unattributed)
HEAD = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
        "Grid Size", "Device", "CC"]


def _q(fields):
    return ",".join('"' + f.replace('"', '""') + '"' for f in fields)


def raw_csv(rename=False):
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)", _q(HEAD + METRIC_COLS),
             _q([""] * len(HEAD) + UNITS)]
    for i, k, grid, vals in LAUNCHES:
        name = nm.CASE_RANGE.format(CASE_OF[i]) if rename and i in CASE_OF else k
        lines.append(_q([str(i), "4242", "python3.12", "h200", name, "1", "7", "(256, 1, 1)", grid, "0", "9.0"] + vals))
    return "\n".join(lines) + "\n"


def console_log():
    out = ["==PROF== Connected to process 4242"]
    for case, ids in ((0, [0]), (22, [1, 2]), (52, [3])):
        out.append(f"MCASE {case} begin family | case")
        out += [f'==PROF== Profiling "kernel" - {i}: 0%....50%....100% - 9 passes' for i in ids]
        out.append(f"MCASE {case} end")
    out.append('==PROF== Profiling "rms_norm_kernel" - 4: 0%....50%....100% - 9 passes')  # after the last case ended
    return "\n".join(out)


# ---- ncu_metrics ----

def test_parse_raw_csv_units_and_separators():
    recs = nm.parse_csv(raw_csv())
    assert sorted(recs) == [0, 1, 2, 3, 4]
    m = recs[0]["metrics"]
    assert m["gpu__time_duration.sum"] == pytest.approx(3000.0)  # usecond -> ns
    assert m["dram__bytes_read.sum"] == pytest.approx(30720.0)  # Kbyte -> bytes
    assert recs[1]["metrics"]["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"] == 50000
    assert recs[1]["grid"] == "(8, 1, 8)" and recs[1]["kernel"] == DEC8


def test_parse_details_page():
    head = _q(HEAD[:9] + ["Section Name", "Metric Name", "Metric Unit", "Metric Value"])
    rows = [_q(["7", "1", "py", "h", RMS, "1", "7", "(512, 1, 1)", "(4, 1, 1)", "Command line profiler metrics", name,
                unit, val]) for name, unit, val in (("gpu__time_duration.sum", "msecond", "1.50"),
                                                     ("dram__bytes_write.sum", "Mbyte", "2.00"),
                                                     ("launch__registers_per_thread", "register/thread", "30"))]
    recs = nm.parse_csv("\n".join([head] + rows))
    assert recs[7]["metrics"]["gpu__time_duration.sum"] == pytest.approx(1.5e6)
    assert recs[7]["metrics"]["dram__bytes_write.sum"] == pytest.approx(2e6)
    d = nm.derive(recs[7]["metrics"])
    assert d["registers"] == 30 and d["dram_bytes"] == pytest.approx(2e6) and d["sectors_per_request"] is None


def test_no_header_is_an_error():
    with pytest.raises(ValueError, match="header"):
        nm.parse_csv("==ERROR== the profiler failed\n")


def test_derived_quantities():
    rec = nm.parse_csv(raw_csv())[1]
    d = nm.derive(rec["metrics"])
    assert d["global_requests"] == 10100 and d["global_sectors"] == 50400
    assert d["sectors_per_request"] == pytest.approx(50400 / 10100)
    # conflict ways = wavefronts / (wavefronts - conflicts) over ld + st
    assert d["conflict_ways"] == pytest.approx(10000 / 7000)
    assert d["dram_bytes"] == pytest.approx(7.8e6)
    assert d["ctas_per_sm"] == 2  # the smallest occupancy limit
    assert nm.derive(nm.parse_csv(raw_csv())[2]["metrics"])["conflict_ways"] is None  # no shared accesses


def test_attribution_by_nvtx_and_by_log_order():
    by_nvtx = nm.launches(raw_csv(), nvtx=raw_csv(rename=True), manifest=MANIFEST)
    by_log = nm.launches(raw_csv(), log=console_log(), manifest=MANIFEST)
    for recs in (by_nvtx, by_log):
        assert [r["case_index"] for r in recs] == [0, 22, 22, 52, None]
        assert recs[1]["family"] == "paged_decode_attention" and recs[1]["case"] == "B=1 ctx=4096"
    assert nm.parse_log_order(console_log()) == {0: 0, 1: 22, 2: 22, 3: 52}


def test_metric_selection():
    query = ("Device NVIDIA H200 (GH100)\n-----\nMetric Name   Metric Description\n"
             "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldsm   # of wavefronts for ldsm\n"
             "dram__bytes_read   # of bytes read from DRAM\n")
    chosen, dropped = nm.select(nm.parse_query(query))
    names = [m.ncu for m in chosen]
    assert "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum" in names  # optional, listed
    assert "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum" in [m.ncu for m in dropped]  # optional, not listed
    assert all(m.required for m in chosen if m.ncu != "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum")
    assert {"gpu__time_duration.sum", "dram__bytes_read.sum", "launch__grid_size"} <= set(names)
    assert len(set(names)) == len(names)
    minimal, _ = nm.select(None, minimal=True)
    assert [m.key for m in minimal] == [k for k in (m.key for m in nm.METRICS) if k in nm.MINIMAL]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_metrics.py"), "list"], capture_output=True,
                       text=True, check=True)
    assert r.stdout.strip() == ",".join(m.ncu for m in nm.METRICS if m.required)


# ---- compare_model ----

def _gpu_doc():
    return dict(kind="gpu_check", phases=dict(ncu=dict(details=dict(
        launches=nm.launches(raw_csv(), nvtx=raw_csv(rename=True), manifest=MANIFEST)))))


def test_compare_per_kernel_and_case():
    res = cm.compare(_gpu_doc(), MODEL)
    k = {(r["family"], r["kernel"], r["match"]): r for r in res["kernels"]}
    rms = k[("rms_norm", "rms_norm_kernel", "name")]
    assert rms["gpu_us"] == pytest.approx(3.0) and rms["model_us"] == 1.0 and rms["time_ratio"] == pytest.approx(3.0)
    assert rms["gpu_dram_bytes"] == pytest.approx(32768) and rms["dram_ratio"] == pytest.approx(32768 / 24576)
    assert rms["gpu_sectors_per_request"] == pytest.approx(2048 / 128) and rms["model_sectors_per_request"] == 16.0
    assert rms["gpu_conflict_ways"] == pytest.approx(1.0) and rms["model_conflict_ways"] == 1.0
    assert rms["gpu_registers"] == 30 and rms["model_registers"] == 32 and rms["gpu_grid"] == (1, 1, 1)
    # another split count: matched by the kernel's base name, per-kernel model lines used
    dec = k[("paged_decode_attention", "paged_decode_attention_kernel", "base name")]
    assert dec["time_ratio"] == pytest.approx(30.0 / 8.0)
    assert dec["model_sectors_per_request"] == 4.5 and dec["model_conflict_ways"] == 2.0
    assert dec["gpu_grid"] == (8, 1, 8) and dec["model_grid"] == (8, 1, 4)
    merge = k[("paged_decode_attention", "decode_merge_splits_kernel", "name")]
    assert merge["time_ratio"] == pytest.approx(2.0) and merge["model_sectors_per_request"] == 2.0
    # the CUTLASS kernel the model does not emulate
    assert ("fp8_scaled_mm", "cutlass_sm90_gemm", "gpu only") in k
    assert ("fp8_scaled_mm", "fp8_scaled_mm_kernel", "model only") in k
    cases = {c["family"]: c for c in res["cases"]}
    assert cases["paged_decode_attention"]["status"] == "matched"
    assert cases["paged_decode_attention"]["gpu_us"] == pytest.approx(34.0)
    assert cases["paged_decode_attention"]["time_ratio"] == pytest.approx(3.4)
    assert cases["paged_decode_attention"]["gpu_sectors_per_request"] == pytest.approx(51400 / 10600)
    assert cases["paged_decode_attention"]["gpu_conflict_ways"] == pytest.approx(10000 / 7000)
    assert cases["fp8_scaled_mm"]["status"] == "kernels differ"
    assert cases["fp8_scaled_mm"]["time_ratio"] == pytest.approx(0.75)
    assert [u["id"] for u in res["unattributed"]] == [4]
    assert res["model_cases_not_measured"] == ["tree_verify | B=1 N=8 greedy"]


def test_summary_how_far_off():
    s = cm.compare(_gpu_doc(), MODEL)["summary"]
    ratios = [3.0, 3.4, 0.75]
    assert s["cases_compared"] == 3
    t = s["time_gpu_over_model"]
    assert t["geomean"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / 3), abs=1e-3)
    assert t["median"] == pytest.approx(3.0) and t["min"] == 0.75 and t["max"] == 3.4
    assert t["within_2x"] == pytest.approx(1 / 3, abs=1e-3)
    assert s["time_gpu_over_model_matched_kernels"]["n"] == 2
    assert s["furthest_off"][0]["family"] == "paged_decode_attention"
    assert set(s["per_family"]) == {"rms_norm", "paged_decode_attention", "fp8_scaled_mm"}


def test_cli_report_and_json(tmp_path):
    gpu = tmp_path / "gpu_check.json"
    gpu.write_text(json.dumps(_gpu_doc()))
    model = tmp_path / "model.json"
    model.write_text(json.dumps(MODEL))
    out = tmp_path / "cmp.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "compare_model.py"), "--gpu", str(gpu), "--model",
                        str(model), "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "rms_norm_kernel" in r.stdout and "time, GPU / model: geomean" in r.stdout
    assert json.loads(out.read_text())["summary"]["cases_compared"] == 3


def test_no_gpu_results_file_yet(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cm, "RESULTS", str(tmp_path))  # no gpu_check-*.json there
    assert cm.main([]) == 2
    err = capsys.readouterr().err
    assert "no GPU results file yet" in err and "gpu_check.sh" in err
    assert cm.main(["--gpu", str(tmp_path / "missing.json")]) == 2
    empty = tmp_path / "gpu_check-empty.json"
    empty.write_text(json.dumps(dict(kind="gpu_check", phases={})))
    model = tmp_path / "model-after.json"
    model.write_text(json.dumps(MODEL))
    assert cm.main(["--gpu", str(empty), "--model", str(model)]) == 2
    assert "no ncu launch records" in capsys.readouterr().err


def test_gpu_file_layouts():
    recs = [dict(id=0)]
    for doc in (dict(launches=recs), dict(details=dict(launches=recs)), dict(phases=dict(ncu=dict(details=dict(
            launches=recs))))):
        assert cm.gpu_launches(doc) == recs
    assert cm.gpu_launches(dict(phases={})) == []
    cases = [dict(family="rms_norm", case="T=1 H=4096", time_us=2.5), dict(family="x", case="y", status="error")]
    times = dict(phases=dict(bench=dict(details=dict(cases_time=dict(cases=cases)))))
    assert cm.gpu_case_times(times) == {("rms_norm", "T=1 H=4096"): 2.5}


def test_names():
    assert cm.strip_params(RMS) == "fastinfer::norm::rms_norm_kernel<__nv_bfloat16,8>"
    assert cm.base(DEC4) == cm.base(DEC8) == "fastinfer::attention::decode::paged_decode_attention_kernel"
    assert cm.short(CUTLASS) == "cutlass_sm90_gemm" and cm.short(FP8) == "fp8_scaled_mm_kernel"
    assert cm.grid_tuple("(8, 1, 4)") == (8, 1, 4) and cm.grid_tuple([2, 3, 1]) == (2, 3, 1)


def test_the_shipped_model_file_is_comparable():
    """The committed model results carry what the comparison reads (families, cases, launches)."""
    path = cm.find_model_file()
    assert path is not None
    doc = json.load(open(path))
    rows = [r for r in doc["rows"] if "error" not in r]
    assert rows and all({"family", "case", "model_time_us", "model_dram_bytes", "launches"} <= set(r) for r in rows)
    assert all({"kernel", "model_time_us", "model_dram_bytes", "grid"} <= set(x) for r in rows for x in r["launches"])
