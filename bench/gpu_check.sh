#!/usr/bin/env bash
# bench/gpu_check.sh: the whole GPU check in one call on a GPU machine, in phases that each run
# under their own deadline; a failing (or timed-out) phase never stops the later ones. JSON under $OUT.
#
# Phases, in order (seconds):
#   phase     max reserve  what
#   env        20       -  GPU, driver, torch, nvcc, ncu, compute-sanitizer versions, cores, arch (in the summary)
#   build     220     120  pip install --no-build-isolation for this GPU's arch only (FASTINFER_CUDA_ARCHS=90a on
#                          an H200) without the simt profile module (--config-settings=
#                          cmake.define.FASTINFER_SIMT_PROFILE_MODULE=OFF), into /tmp/fi; then `import fastinfer`,
#                          fastinfer.cuda_available(), and the slowest ninja steps of this build (its critical path)
#   pytest     90      40  pytest -m cuda (438 tests today; -n 4 with pytest-xdist and --timeout 120 with
#                          pytest-timeout when they import); the junit XML parsed into counts and failed tests
#   probe      25      10  the mma/ldmatrix fragment probe: cpp/simt/tests/fragment_probe.cu built with nvcc and run,
#                          diffed against the same program in the emulator (python -m fastinfer.simt run)
#   sanitizer  60      30  compute-sanitizer memcheck (45%: 27 s) then racecheck (the rest) on one small case of every
#                          kernel family and main code path (bench/gpu_cases.py --sanitize, 22 cases), with
#                          PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor its own allocation); errors by kernel/case
#   ncu        90      45  Nsight Compute on bench/model.py's cases (bench/gpu_cases.py --ncu: the modelled shapes on
#                          torch.ops.fastinfer, an NVTX range per case, round robin over families, no new case after
#                          its deadline) collecting bench/ncu_metrics.py's metrics (the simt profiler's counters:
#                          requests, sectors, shared wavefronts, bank conflicts, DRAM bytes; plus duration and
#                          launch statistics; --clock-control none); the report exported to CSV and parsed into
#                          per-launch records attributed to the model's cases (optional metrics filtered by
#                          `ncu --query-metrics`; a retry with a minimal metric set if no report was written)
#   bench      40      15  CUDA-event times of the model's cases (gpu_cases.py --time), then bench/ops.py
#                          --no-compile, attention.py, gemm_fp8.py, gemm_int4.py, gemm_int8.py, gemm_dense.py, tree_verify.py,
#                          each with a short --deadline (they stop starting shapes)
#   then       10       -  bench/compare_model.py (ncu launches vs bench/results/model-after.json) and the summary
#   total     480          = 8 minutes, never more
# A phase's deadline is min(max, 480 - 10 - elapsed - the reserves of the selected phases after it), and at
# least its reserve: when the build is slow the later phases shrink toward their reserves, the whole check
# still ends within 8 minutes (worst case, every phase at its deadline: 20+220+90+25+55+45+15+10 = 480);
# typical runs (a ~130 s build) give every phase its max, 465 s in all.
#
# The sm_90a-only build, measured on the 2-core development machine (AMD EPYC, 2026-12-01; the machine was
# shared with other builds, load 3-7, so parallel wall times were inflated 4-7x and CPU times are what count):
#   command: FASTINFER_CUDA=ON FASTINFER_CUDA_ARCHS=90a CUTLASS_DIR=.venv/cutlass CMAKE_BUILD_PARALLEL_LEVEL=2 \
#            pip install --no-build-isolation --no-deps --no-compile --target /tmp/fi90a \
#            --config-settings=build-dir=/tmp/fi90a-build .
#   with the simt profile module: 1085 s wall, 71 ninja steps. As gpu_check builds it (profile module off, 57
#   steps; `ninja -j2` after a clean): 855 s wall, 585 s CPU (532 user + 53 sys); reconfigure 7.5 s.
#   Critical path: cuda/src/fp8_gemm_sm90.cu, the CUTLASS 3.x TMA/wgmma fp8 GEMMs (6 kernels in one translation
#   unit): 112 s wall, 110 s CPU alone on one core (nvcc --time: cicc 86 s, host compile 14 s, cudafe++ 8 s,
#   ptxas 1.3 s; 6.2 GB peak memory). Every other step is under 25 s of CPU (each torch binding .cpp was
#   15-20 s against the full ATen headers, e.g. cpu_attention.cpp 17.9 s; on the stable ABI about 1 s; of the
#   .cu files attention_decode.cu is the longest). Only the archive and the _C link (~3 s) follow it.
#   cuda/src/int8_gemm_sm90.cu (the int8 wgmma GEMMs, 6 kernels, same shared template) is a second such
#   step: 154 s CPU (138 user + 15 sys; measured 2026-12-01 at load ~14, so inflated against the 110 s above),
#   independent of fp8_gemm_sm90.cu, so the two run side by side (~6 GB each).
#   Estimate for the 16-core H200 machine: configure ~20 s + the longer of the two *_sm90.cu ~110-150 s (the
#   other 475 s of CPU spread over 14 cores, ~35 s, run beside them) + link, ptxas report, install ~15 s:
#   ~150-185 s at this machine's per-core speed, within the 220 s maximum. Splitting each *_sm90.cu per tile
#   configuration (3 TUs each) would cut the critical path to about 40-50 s and the build to ~90 s.
#
# The GPU machine's torch (2.11) is the oldest the extension targets: the bindings use only the LibTorch
# stable ABI at version 2.11 (cmake/torch.cmake), and CI (`make abi-check`, run by .ci/run after make
# test) installs the wheel built against the pinned torch next to torch 2.11 and runs the op tests there.
#
# The device call, from the repository root of a session (prepare the CUTLASS wheel once; the machine has
# no network):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl nvidia-cutlass==4.2.0
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Rerun chosen phases on the still-warm machine (the /tmp/fi build is kept; a fresh machine needs build):
#   run(command="GPU_CHECK_PHASES='ncu bench' bash bench/gpu_check.sh", carry=[".whl"], timeout_s=300)
# Then commit $OUT/gpu_check.json as bench/results/gpu_check-<date>.json (with the commit it ran: the
# machine's copy may have no .git) and run
#   python bench/compare_model.py --gpu bench/results/gpu_check-<date>.json
#
# What comes back (the device tool returns at most 8 files, 2 folders deep): $OUT/gpu_check.json (the
# summary: env, per-phase status / seconds / deadline / key numbers, every phase's details, the model
# comparison) and $OUT/phases/<phase>.json (status, rc, seconds, deadline, the command, the phase's details
# and the last 60 lines of its log): 7 files. Logs, reports and builds stay in $GPU_CHECK_WORK (/tmp/gpu_check).
#
# Knobs: GPU_CHECK_PHASES="build pytest ..." (the phases to run, others recorded as skipped; empty: none),
# GPU_CHECK_DEADLINE_<PHASE>=S (its max), GPU_CHECK_RESERVE_<PHASE>=S, GPU_CHECK_TOTAL=S, GPU_CHECK_WORK=DIR,
# PYTHON=python3, and GPU_CHECK_DRY_RUN=1: the same phase machinery (deadlines, logs, JSON, summary) with
# each phase's command replaced by a stub (GPU_CHECK_STUB_<PHASE>='shell command'; default: print the
# command it stands for), for testing without a GPU (tests/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
PHASES=" ${GPU_CHECK_PHASES-build pytest probe sanitizer ncu bench} "  # set but empty: none
FI_PREFIX=${GPU_CHECK_PREFIX:-/tmp/fi}
export ROOT OUT WORK PY DRY FI_PREFIX PYTHONUNBUFFERED=1
REPORT="$PY $ROOT/bench/gpu_check_report.py"
export REPORT

# Phase deadlines: at most MAXD seconds, never past the total (TOTAL, minus FINAL for the comparison and
# the summary) less the reserves of the selected phases after it, and never below its own reserve.
ORDER=(build pytest probe sanitizer ncu bench)
declare -A MAXD=([build]=220 [pytest]=90 [probe]=25 [sanitizer]=60 [ncu]=90 [bench]=40)
declare -A RESERVE=([build]=120 [pytest]=40 [probe]=10 [sanitizer]=30 [ncu]=45 [bench]=15)
TOTAL=${GPU_CHECK_TOTAL:-480}
FINAL=10
ENV_DEADLINE=20
for p in "${ORDER[@]}"; do
  v="GPU_CHECK_DEADLINE_${p^^}"
  if [ -n "${!v:-}" ]; then MAXD[$p]=${!v}; fi
  v="GPU_CHECK_RESERVE_${p^^}"
  if [ -n "${!v:-}" ]; then RESERVE[$p]=${!v}; fi
done

mkdir -p "$OUT/phases" "$WORK"
rm -f "$OUT"/phases/*.json "$OUT/gpu_check.json" "$WORK/env.json"
start=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }
export -f log
export start

# within SECONDS CMD...: run CMD under `timeout`, never past the current phase's end (PHASE_END, epoch s,
# minus a 3 s margin), so that inner deadlines expire before the phase's own.
within() {
  local want=$1 left
  shift
  left=$(( ${PHASE_END:-$(( $(date +%s) + want + 10 ))} - $(date +%s) - 3 ))
  (( want > left )) && want=$left
  if (( want < 2 )); then echo "within: no time left for: $*"; return 124; fi
  timeout -k 5 "$want" "$@"
}
export -f within

export PYTHONPATH="$FI_PREFIX:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

# ---- env ------------------------------------------------------------------------------------------
ARCH=90a
if [ "$DRY" != 1 ]; then
  a=$(timeout "$ENV_DEADLINE" $PY - "$WORK/env.json" <<'PYEOF'
import json, os, shutil, subprocess, sys
def run(*cmd):
    if not shutil.which(cmd[0]):
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=4)
        return (r.stdout or r.stderr).strip()[-300:]
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"
git = run("git", "rev-parse", "HEAD")  # the device machine's copy may have no .git
env = dict(nproc=os.cpu_count(), python=sys.version.split()[0], commit=git if git and "fatal" not in git else None,
           nvidia_smi=run("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                          "--format=csv,noheader"),
           nvcc=run("nvcc", "--version"), ncu=run("ncu", "--version"), sanitizer=run("compute-sanitizer", "--version"))
try:
    import torch
    M, m = torch.cuda.get_device_capability()
    env.update(torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name(),
               sms=torch.cuda.get_device_properties(0).multi_processor_count, arch=f"{M}{m}" + ("a" if M >= 9 else ""))
except Exception as e:  # noqa: BLE001
    env["torch_error"] = str(e)
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env.get("arch", ""))
PYEOF
  )
  [ -n "$a" ] && ARCH=$a
  [ -s "$WORK/env.json" ] || echo '{"error": "env probe failed or timed out"}' >"$WORK/env.json"
else
  echo '{"dry_run": true}' >"$WORK/env.json"
fi
export ARCH
log "env: arch $ARCH, $(nproc) cores, phases:${PHASES}"

# ---- phases: each a function run as `timeout DEADLINE bash -c phase_<name>` ------------------------------
phase_build() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || echo "wheel install failed"
  fi
  rm -rf "$FI_PREFIX"
  FASTINFER_CUDA=ON FASTINFER_CUDA_ARCHS="$ARCH" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    within $((PHASE_DEADLINE - 15)) $PY -m pip install --no-build-isolation --no-deps --no-compile -q --target "$FI_PREFIX" \
    --config-settings=build-dir="$WORK/build" --config-settings=cmake.define.FASTINFER_SIMT_PROFILE_MODULE=OFF .
  local rc=$?
  within 30 $PY - "$PHASE_DETAILS" "$WORK/build/.ninja_log" "$rc" <<'PYEOF'
import json, os, sys
out, ninja_log, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
d = dict(pip_rc=rc)
try:
    rows = []
    for line in open(ninja_log):
        if not line.startswith("#"):
            s, e, _, name, _ = line.rstrip("\n").split("\t")
            rows.append((int(e) - int(s), int(s), name))
    rows.sort(reverse=True)
    d["ninja_span_s"] = round((max(s + t for t, s, _ in rows) - min(s for _, s, _ in rows)) / 1e3, 1)
    d["ninja_sum_s"] = round(sum(t for t, _, _ in rows) / 1e3, 1)
    d["slowest_steps"] = [dict(seconds=round(t / 1e3, 1), start_s=round(s / 1e3, 1), output=n) for t, s, n in rows[:12]]
except (OSError, ValueError) as e:
    d["ninja_log"] = f"unreadable: {e}"
try:
    import torch, fastinfer
    d.update(torch=torch.__version__, fastinfer=os.path.dirname(fastinfer.__file__),
             cuda_available=fastinfer.cuda_available())
except Exception as e:  # noqa: BLE001
    d["import_error"] = f"{type(e).__name__}: {e}"
json.dump(d, open(out, "w"), indent=1)
print({k: v for k, v in d.items() if k != "slowest_steps"})
PYEOF
  return $rc
}

phase_pytest() {
  local extra=()
  $PY -c "import xdist" 2>/dev/null && extra+=(-n 4)
  $PY -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 120)
  within $((PHASE_DEADLINE - 8)) $PY -m pytest -m cuda -q -ra -p no:cacheprovider --durations=15 "${extra[@]}" \
    --junitxml="$WORK/pytest.xml" tests
  local rc=$?
  $REPORT pytest --junit "$WORK/pytest.xml" --out "$PHASE_DETAILS"
  return $rc
}

phase_probe() {
  local rc=1
  if within 15 nvcc -std=c++20 -O2 -gencode=arch=compute_${ARCH},code=sm_${ARCH} -I cuda/include \
       cpp/simt/tests/fragment_probe.cu -o "$WORK/fragment_probe" &&
     within 5 "$WORK/fragment_probe" >"$WORK/probe_gpu.txt" &&
     within 15 $PY -m fastinfer.simt run cpp/simt/tests/fragment_probe.cu >"$WORK/probe_sim.txt"; then
    rc=0
  fi
  $REPORT probe --gpu "$WORK/probe_gpu.txt" --sim "$WORK/probe_sim.txt" --out "$PHASE_DETAILS"
  $PY -c "import json, sys; sys.exit(0 if json.load(open('$PHASE_DETAILS'))['match'] else 1)" || rc=1
  return $rc
}

phase_sanitizer() {
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  local rc=0 m=$(( PHASE_DEADLINE * 45 / 100 ))  # memcheck 45% (25 s of 60), racecheck the rest
  within "$m" compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 30 \
    $PY bench/gpu_cases.py --sanitize --manifest "$WORK/sanitize_memcheck.json" >"$WORK/memcheck.log" 2>&1 || rc=1
  tail -n 15 "$WORK/memcheck.log"
  within "$PHASE_DEADLINE" compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 30 \
    $PY bench/gpu_cases.py --sanitize --manifest "$WORK/sanitize_racecheck.json" >"$WORK/racecheck.log" 2>&1 || rc=1
  tail -n 15 "$WORK/racecheck.log"
  $REPORT sanitizer --log memcheck="$WORK/memcheck.log" --log racecheck="$WORK/racecheck.log" --out "$PHASE_DETAILS"
  return $rc
}

phase_ncu() {
  local rep="$WORK/ncu" regex metrics rc left attempt=full
  regex=$($PY bench/ncu_metrics.py regex)
  within 30 ncu --query-metrics >"$WORK/ncu_query.txt" 2>&1 || echo "ncu --query-metrics failed (optional metrics left out)"
  metrics=$($PY bench/ncu_metrics.py list --query "$WORK/ncu_query.txt" --dropped "$WORK/ncu_dropped.txt")
  rm -f "$rep.ncu-rep"
  # 20 s kept for the export and the parse; the case runner starts no case in the run's last 15 s
  left=$(( PHASE_END - $(date +%s) - 20 ))
  within "$left" ncu --nvtx --clock-control none --kernel-name-base demangled -k "$regex" --metrics "$metrics" \
    -f -o "$rep" $PY bench/gpu_cases.py --ncu --deadline $((left - 15)) --manifest "$WORK/ncu_cases.json" \
    >"$WORK/ncu_run.log" 2>&1
  rc=$?
  tail -n 20 "$WORK/ncu_run.log"
  left=$(( PHASE_END - $(date +%s) - 20 ))
  if [ ! -s "$rep.ncu-rep" ] && (( left > 35 )); then  # e.g. a metric this ncu does not know: the minimal set
    attempt=minimal
    metrics=$($PY bench/ncu_metrics.py list --minimal)
    echo "ncu: no report; retrying with the minimal metric set on --quick cases"
    within "$left" ncu --nvtx --clock-control none --kernel-name-base demangled -k "$regex" --metrics "$metrics" \
      -f -o "$rep" $PY bench/gpu_cases.py --ncu --quick --deadline $((left - 15)) --manifest "$WORK/ncu_cases.json" \
      >"$WORK/ncu_run.log" 2>&1
    rc=$?
    tail -n 20 "$WORK/ncu_run.log"
  fi
  within 8 ncu --import "$rep.ncu-rep" --csv --page raw --print-units base >"$WORK/ncu_raw.csv" 2>"$WORK/ncu_export.err"
  within 8 ncu --import "$rep.ncu-rep" --csv --page raw --print-units base --print-nvtx-rename kernel \
    >"$WORK/ncu_nvtx.csv" 2>>"$WORK/ncu_export.err"
  head -c 2000 "$WORK/ncu_export.err"
  within 10 $PY bench/ncu_metrics.py parse --raw "$WORK/ncu_raw.csv" --nvtx "$WORK/ncu_nvtx.csv" \
    --log "$WORK/ncu_run.log" --manifest "$WORK/ncu_cases.json" --metrics "$metrics" \
    --dropped "$WORK/ncu_dropped.txt" --attempt "$attempt" --json "$PHASE_DETAILS" || rc=1
  return $rc
}

phase_bench() {
  local d="$WORK/bench" rc=0 b=$PHASE_DEADLINE
  mkdir -p "$d"
  # share(PERCENT): this step's wall limit; its script's own --deadline (stop starting shapes) is ~5 s less
  share() { echo $(( b * $1 / 100 )); }
  dl() { local x=$(( b * $1 / 100 - 5 )); (( x < 1 )) && x=1; echo $x; }
  within "$(share 35)" $PY bench/gpu_cases.py --time --deadline "$(dl 35)" --manifest "$d/cases_time.json" | tail -n 5 || rc=1
  within "$(share 20)" $PY bench/ops.py --no-compile --deadline "$(dl 20)" --json "$d/ops.json" | tail -n 12 || rc=1
  within "$(share 20)" $PY bench/attention.py --deadline "$(dl 20)" --json "$d/attention.json" | tail -n 12 || rc=1
  within "$(share 7)" $PY bench/gemm_fp8.py --deadline 1 --json "$d/gemm_fp8.json" | tail -n 6 || rc=1
  within "$(share 7)" $PY bench/gemm_int4.py --deadline 1 --json "$d/gemm_int4.json" | tail -n 6 || rc=1
  within "$(share 6)" $PY bench/gemm_int8.py --deadline 1 --json "$d/gemm_int8.json" | tail -n 6 || rc=1
  within "$(share 5)" $PY bench/gemm_dense.py --deadline 1 --json "$d/gemm_dense.json" | tail -n 6 || rc=1
  within "$PHASE_DEADLINE" $PY bench/tree_verify.py --deadline 1 --json "$d/tree_verify.json" | tail -n 6 || rc=1
  $REPORT bench --dir "$d" --out "$PHASE_DETAILS"
  return $rc
}
export -f phase_build phase_pytest phase_probe phase_sanitizer phase_ncu phase_bench

# The real command of each phase, recorded in its JSON (and printed by the dry-run stubs).
declare -A WHAT=(
  [build]="pip install --no-build-isolation --target $FI_PREFIX (FASTINFER_CUDA_ARCHS=$ARCH, profile module off)"
  [pytest]="pytest -m cuda tests"
  [probe]="nvcc cpp/simt/tests/fragment_probe.cu vs python -m fastinfer.simt run (diff)"
  [sanitizer]="compute-sanitizer --tool memcheck|racecheck python bench/gpu_cases.py --sanitize"
  [ncu]="ncu --nvtx --metrics \$(bench/ncu_metrics.py list) python bench/gpu_cases.py --ncu"
  [bench]="bench/gpu_cases.py --time; bench/{ops,attention,gemm_fp8,gemm_int4,gemm_int8,gemm_dense,tree_verify}.py"
)

# deadline_of NAME: min(MAXD, TOTAL - FINAL - elapsed - reserves of the selected phases after NAME), at least
# min(RESERVE, MAXD).
deadline_of() {
  local name=$1 after=0 seen=0 p left d floor
  for p in "${ORDER[@]}"; do
    if (( seen )) && [[ "$PHASES" == *" $p "* ]]; then after=$(( after + RESERVE[$p] )); fi
    [ "$p" = "$name" ] && seen=1
  done
  left=$(( start + TOTAL - FINAL - $(date +%s) - after ))
  d=${MAXD[$name]} floor=${RESERVE[$name]}
  (( floor > d )) && floor=$d
  (( left < d )) && d=$left
  (( d < floor )) && d=$floor
  echo "$d"
}

run_phase() {
  local name=$1 deadline plog="$WORK/$1.log" details="$WORK/$1.details.json" rc t0 t1 ms
  deadline=$(deadline_of "$name")
  rm -f "$details"
  t0=$(date +%s%N)
  if [[ "$PHASES" != *" $name "* ]]; then
    echo "phase $name not selected (GPU_CHECK_PHASES=${PHASES# })" >"$plog"
    rc=200
  else
    log "phase $name (deadline ${deadline} s)"
    local body="phase_$name"
    if [ "$DRY" = 1 ]; then
      local sv="GPU_CHECK_STUB_${name^^}"
      body="${!sv:-echo \"dry run: ${WHAT[$name]}\"}"
    fi
    PHASE_DEADLINE=$deadline PHASE_END=$(( $(date +%s) + deadline )) PHASE_DETAILS=$details \
      timeout -k 10 "$deadline" bash -o pipefail -c "$body" >"$plog" 2>&1
    rc=$?
    tail -n 25 "$plog"
  fi
  t1=$(date +%s%N)
  ms=$(( (t1 - t0) / 1000000 ))
  $REPORT phase --name "$name" --rc "$rc" --seconds "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))" --deadline "$deadline" \
    --max-deadline "${MAXD[$name]}" --log "$plog" --details "$details" --command "${WHAT[$name]}" \
    --out "$OUT/phases/$name.json"
  log "phase $name: rc=$rc"
}

for name in "${ORDER[@]}"; do
  run_phase "$name"
done

# ---- model comparison and summary -------------------------------------------------------------------
rm -f "$WORK/compare.json"
$REPORT summary --out-dir "$OUT" --env "$WORK/env.json" >/dev/null
if [ "$DRY" != 1 ]; then  # the summary holds the ncu launches and the event times of the cases
  timeout 10 $PY bench/compare_model.py --gpu "$OUT/gpu_check.json" --json "$WORK/compare.json" | tail -n 25
fi
$REPORT summary --out-dir "$OUT" --env "$WORK/env.json" --compare "$WORK/compare.json"
log "done: $OUT/gpu_check.json"
$PY -c "import json, sys; sys.exit(0 if json.load(open('$OUT/gpu_check.json'))['all_ok'] else 1)"
