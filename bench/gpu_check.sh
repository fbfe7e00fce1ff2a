#!/usr/bin/env bash
# One call on a lent GPU machine: build for this GPU's architecture only, run `pytest -m cuda`,
# compare the emulator's mma/ldmatrix fragment layouts with the GPU's, run the op benchmarks, and
# write JSON (+ logs) under $OUT. Budget: under 9 minutes on an H200 machine (16 cores).
#
# The exact device call, from a session in the repository root (prepare the wheel once):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl nvidia-cutlass==4.2.0
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=560)
# Then commit $OUT/gpu_check.json as bench/results/gpu_check-<date>.json and quote it.
#
# That machine has torch 2.11 (cu130), nvcc 13.0, cmake, ninja, scikit-build-core, pybind11 and no
# network: nothing is downloaded; the package is built with --no-build-isolation into /tmp/fi.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
start=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

arch=$($PY -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}' + ('a' if M >= 9 else ''))")
log "GPU: $($PY -c 'import torch; print(torch.cuda.get_device_name())'), arch $arch, torch $($PY -c 'import torch; print(torch.__version__)')"

log "build (FASTINFER_CUDA_ARCHS=$arch)"
rm -rf /tmp/fi
FASTINFER_CUDA=ON FASTINFER_CUDA_ARCHS="$arch" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  $PY -m pip install --no-build-isolation --no-deps --no-compile -q --target /tmp/fi . >"$OUT/build.log" 2>&1
build_rc=$?
tail -n 30 "$OUT/build.log"
export PYTHONPATH=/tmp/fi${PYTHONPATH:+:$PYTHONPATH}
log "build rc=$build_rc"

log "pytest -m cuda"
timeout 230 $PY -m pytest -m cuda -q -ra -p no:cacheprovider tests --junitxml="$OUT/pytest-cuda.xml" 2>&1 | tee "$OUT/pytest-cuda.log" | tail -n 40
pytest_rc=${PIPESTATUS[0]}

log "fragment probes: GPU vs emulator"
probe_rc=1
if nvcc -std=c++20 -O2 -arch=sm_$arch -I cuda/include cpp/simt/tests/fragment_probe.cu -o /tmp/fragment_probe 2>"$OUT/probe_build.log" &&
   /tmp/fragment_probe >"$OUT/probe_gpu.txt" &&
   $PY -m fastinfer.simt run cpp/simt/tests/fragment_probe.cu >"$OUT/probe_sim.txt"; then
  if diff -u "$OUT/probe_sim.txt" "$OUT/probe_gpu.txt" >"$OUT/probe.diff"; then probe_rc=0; fi
fi
log "probe rc=$probe_rc (0: the emulator's fragment layouts match the GPU's)"

log "benchmarks"
timeout 60 $PY bench/ops.py --deadline 40 --json "$OUT/ops.json" 2>&1 | tee "$OUT/bench.log" | tail -n 40
bench_rc=${PIPESTATUS[0]}
timeout 80 $PY bench/attention.py --deadline 60 --json "$OUT/attention.json" 2>&1 | tee "$OUT/bench-attention.log" | tail -n 60
[ "${PIPESTATUS[0]}" = 0 ] || bench_rc=1
# GEMM and speculative-decoding benches (each stops starting new shapes at its deadline).
for b in gemm_fp8:30 gemm_int4:30 tree_verify:20; do
  name=${b%%:*}; secs=${b##*:}
  [ -f "bench/$name.py" ] || continue
  timeout $((secs + 20)) $PY "bench/$name.py" --deadline "$secs" --json "$OUT/$name.json" 2>&1 | tee "$OUT/bench-$name.log" | tail -n 30
  [ "${PIPESTATUS[0]}" = 0 ] || bench_rc=1
done

$PY - "$OUT" "$build_rc" "$pytest_rc" "$probe_rc" "$bench_rc" <<'PYEOF'
import json, os, subprocess, sys, datetime
out, build_rc, pytest_rc, probe_rc, bench_rc = sys.argv[1], *map(int, sys.argv[2:])
import torch
summary = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
    "build_rc": build_rc, "pytest_cuda_rc": pytest_rc, "fragment_probe_match": probe_rc == 0, "bench_rc": bench_rc,
}
log = os.path.join(out, "pytest-cuda.log")
if os.path.exists(log):
    lines = [l for l in open(log).read().splitlines() if l.strip()]
    summary["pytest_cuda_summary"] = lines[-1] if lines else ""
for name in ("ops", "attention", "gemm_fp8", "gemm_int4", "tree_verify"):
    bench = os.path.join(out, f"{name}.json")
    if os.path.exists(bench):
        summary[f"bench_{name}"] = json.load(open(bench))
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if not k.startswith("bench_")}, indent=1))
PYEOF
log "done"
[ "$build_rc" = 0 ] && [ "$pytest_rc" = 0 ]
