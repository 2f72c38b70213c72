#!/usr/bin/env bash
# One command for a lent GPU (docs/gpu.md): build for sm_90, then one table of
# every kernel against its baseline with correctness at benchmark scale, the sanitizers, and an
# end-to-end run, within one device call of at most 9 minutes.
#
#   bench/tools/gpu_verify.sh [--stages LIST] [--budget S] [--dry-run] [--e2e-args "ARGS"]
#                       [--pytest-args "ARGS"]
#   bench/tools/gpu_verify.sh --pack          # here, before a call that builds the gtest binary
#   bench/tools/gpu_verify.sh --device cpu --quick --stages bench   # the CPU smoke run (tests/)
#
# Stages, in order (default: env,build,check,bench,tc,sanitize,e2e; LIST is comma-separated):
#   env       nvidia-smi, torch, nvcc, compute-sanitizer: what the machine is
#   build     the extension in place for the GPU's own arch only; skipped when .gpucarry/build
#             holds a build of the same sources for the same torch and Python (what an earlier
#             call sent back in $OUT/build.tar.gz: docs/gpu.md)
#   check     kvcache-ext check --device cuda: every op and a patched tiny model against the
#             plain-PyTorch reference in every dtype, first, so that a wrong kernel is named before
#             anything is timed
#   bench     bench/tools/gpu_verify.py table: top-k (segmented, grouped), compaction, append, decode
#             and prefill attention, each against its torch baseline (wall and kernel time), decode
#             attention over int8 pages against bf16 pages, and the checks against the reference
#             at benchmark scale
#   tc        the tensor-core kernels: the prefill (the default on CUDA,
#             KVCACHE_EXT_TC_PREFILL=0 the scalar kernel) and the decode (opt-in,
#             KVCACHE_EXT_TC_DECODE=1): tests/test_prefill_tc.py and tests/test_decode_tc.py
#             (both paths; they set the switches per test), then bench/tools/gpu_verify.py tc (blocks
#             of 64 and 256 causal queries, and the three decode cases, against the switch at 0
#             and SDPA), in processes of their own so that a fault there leaves the other
#             stages' results whole
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck over bench/tools/gpu_verify.py
#             sanitize-driver (small stores through every op, both compaction paths, a prefill
#             block by default and with KVCACHE_EXT_TC_PREFILL=0, a decode call with
#             KVCACHE_EXT_TC_DECODE=1; and a store of int8 pages through the same ops)
#   e2e       bench/e2e.py: Llama-3.1-8B-shaped random bf16 weights, 8K x batch 1 and 4, one-shot
#             SnapKV at 1024 tokens per head and H2O evicting every step (each eager, and with
#             its decode steps in a CUDA graph: snapkv-graph, h2o-step-graph) and the full
#             cache (the default --e2e-args below: the per-step eviction goal, the host's
#             share of a step at batch 1); Ada-SnapKV and the masked
#             head-wise cache go in a second call (--stages e2e --e2e-args "... --methods ...")
#   Optional, for a second call (not in the default):
#   test      pytest's CUDA cases, one process per file (a crash in one hides no other)
#   gtest     builds the gtest binary (CMake, the same arch; GoogleTest from --pack) and runs
#             its CUDA twins, then memcheck over them
#   probe     bench/tools/gpu_probe.py --gdb: does an error raised in C++ reach Python
#   ncu       bench/nsight/profile.sh --set detailed: Nsight Compute over the store, selection
#             and attention kernels, its summary under bench/results/
#
# --budget S (default 540): the whole run's seconds. Each stage runs under a timeout of what is
# left of the budget (less 15 s to write the report and pack $OUT), and a stage whose estimate
# (--dry-run prints them) does not fit in what is left is skipped, recorded as such.
#
# Every stage writes bench/results/gpu-verify/<stage>.log; the summary (device, date, commit,
# each stage's status and seconds) goes to bench/results/gpu-verify-<gpu>-<date>-stages.json,
# the table's rows to bench/results/gpu-verify-<gpu>-<date>.json, the e2e run's to
# bench/results/e2e-<gpu>-<date>-<time>.json. The last thing printed is the table
# (bench/tools/gpu_verify.py report). When $OUT is set (the device tool), bench/results and the
# build (for the next call to carry) are packed into $OUT.
#
# --device cpu runs the check, bench, tc and e2e stages on the CPU (with --quick: tiny sizes), without a
# GPU: tests/test_gpu_verify.py runs it so that the script's run path cannot rot unseen.
#
# Environment: PYTHON (default python3), MAX_JOBS (default: all cores).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)   # bench/tools
root=$(cd "$here/../.." && pwd)
cd "$root"

ALL_STAGES="env build check bench tc sanitize e2e test gtest probe ncu"
stages="env,build,check,bench,tc,sanitize,e2e"
dry=0
pack=0
device=cuda
quick=
e2e_args="--model llama8b --contexts 8192 --batches 1,4 --budgets 1024 --steps 32 --warmup 4 --repeats 1
  --methods full,snapkv,snapkv-graph,h2o-step,h2o-step-graph"
pytest_args=""
budget=540
reserve=15
PYTHON=${PYTHON:-python3}
carry="$root/.gpucarry"
results=${GPU_VERIFY_RESULTS:-$root/bench/results}   # elsewhere: the CPU smoke test's
logs="$results/gpu-verify"

# Seconds each stage is expected to take on an H100 (16 cores), from the stages' summary of the
# last run there (docs/gpu.md), rounded up for the stages that have grown since and for a slower
# machine: the build (sm_90, no gtest binary) about 110 s; sanitize is mostly torch's start-up
# under the sanitizer, and check mostly torch's and transformers' start-up; memcheck over the gtest
# cases runs past 4 min.
declare -A estimate=([env]=5 [build]=120 [build_carried]=10 [check]=30 [bench]=60 [tc]=100 [sanitize]=80 [e2e]=120
                     [test]=180 [gtest]=240 [probe]=60 [ncu]=200)

die() { echo "gpu_verify.sh: error: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --stages) [ $# -ge 2 ] || die "--stages needs a list, e.g. --stages build,bench"; stages=$2; shift ;;
    --dry-run) dry=1 ;;
    --budget) [ $# -ge 2 ] || die "--budget needs seconds"; budget=$2; shift ;;
    --pack) pack=1 ;;
    --device) [ $# -ge 2 ] || die "--device needs cuda or cpu"; device=$2; shift ;;
    --quick) quick=--quick ;;
    --e2e-args) [ $# -ge 2 ] || die "--e2e-args needs a quoted argument list"; e2e_args=$2; shift ;;
    --pytest-args) [ $# -ge 2 ] || die "--pytest-args needs a quoted argument list"; pytest_args=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done
[[ $budget =~ ^[0-9]+$ ]] && [ "$budget" -gt "$reserve" ] || die "--budget takes whole seconds (> $reserve), got '$budget'"
case $device in cuda|cpu) ;; *) die "--device takes cuda or cpu, got '$device'" ;; esac
IFS=',' read -r -a stage_list <<< "$stages"
for s in "${stage_list[@]}"; do
  case " $ALL_STAGES " in *" $s "*) ;; *) die "unknown stage '$s'; stages are: $ALL_STAGES" ;; esac
  [ "$device" = cuda ] || [ "$s" = check ] || [ "$s" = bench ] || [ "$s" = tc ] || [ "$s" = e2e ] \
    || die "stage '$s' needs a GPU; --device cpu runs check, bench, tc and e2e only"
done

# The sources whose build can be reused: same hash, same Python and torch.
source_hash() {
  find csrc setup.py CMakeLists.txt -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' \
    -o -name '*.py' -o -name '*.txt' \) | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-16
}

# HEAD's short hash, +dirty when the tree differs from it (bench/results aside): bench/common.py's.
tree_commit() {
  local c
  c=$(git rev-parse --short HEAD 2>/dev/null) || return 1
  git diff --quiet HEAD -- . ':!bench/results' || c="$c+dirty"
  echo "$c"
}

# --- --pack: run here, before a device call that builds the gtest binary ------------------
if [ "$pack" = 1 ]; then
  mkdir -p "$carry"  # ignored by .gitignore: it travels only when named in carry
  if [ ! -d "$carry/googletest" ]; then  # the device has no libgtest: Debian's libgtest-dev source
    [ -d /usr/src/googletest ] || die "/usr/src/googletest not found: apt-get install libgtest-dev"
    cp -r /usr/src/googletest "$carry/googletest"
  fi
  commit=$(tree_commit)
  echo "$commit" > "$carry/commit"
  echo "packed $carry ($(du -sh "$carry" | cut -f1)): googletest source, commit $commit"
  echo "carry it: run(command='bash bench/tools/gpu_verify.sh ...', carry=['.gpucarry'])"
  exit 0
fi

# The tree travels to a device machine without .git: the commit --pack recorded names it there.
commit=$(cat "$carry/commit" 2>/dev/null || tree_commit || echo unknown)
[ "$commit" = unknown ] || export KVCACHE_EXT_COMMIT=$commit
# The checkout's kvcache_ext when it holds a built extension (the build stage builds one in
# place), else the installed copy (a pip-installed CI run): as bench/common.py decides.
checkout_first() {
  if compgen -G "$root/kvcache_ext/_C*" > /dev/null; then
    case ":${PYTHONPATH:-}:" in
      *":$root:"*) ;;
      *) export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
  fi
}
checkout_first
export PYTHONUNBUFFERED=1
jobs=${MAX_JOBS:-$(nproc)}
export MAX_JOBS=$jobs

if [ "$dry" = 1 ]; then
  gpu_tag="GPU"; arch="9.0"
elif [ "$device" = cpu ]; then
  gpu_tag="cpu"; arch=""
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || die "no NVIDIA GPU (nvidia-smi -L failed)"
  read -r gpu_tag arch < <("$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(p.name.replace(' ', '-'), f'{p.major}.{p.minor}')") || die "$PYTHON cannot see the GPU through torch"
fi
date_tag=$(date +%F)
table_json="$results/gpu-verify-$gpu_tag-$date_tag.json"
tc_json="$results/gpu-verify-tc-$gpu_tag-$date_tag.json"
summary="$results/gpu-verify-$gpu_tag-$date_tag-stages.json"
e2e_json="$results/e2e-$gpu_tag-$date_tag-$(date +%H%M).json"
gtest_bin="$root/build/gtest/kvcache_ext_gtest"
mkdir -p "$logs"

build_key() { echo "$(source_hash) $("$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)')"; }
carried_build() { [ -f "$carry/build/key" ] && [ "$(cat "$carry/build/key")" = "$(build_key)" ]; }

# run_stage NAME COMMAND...: runs (or, with --dry-run, prints) one stage under the budget.
declare -A status seconds
planned=0
run_stage() {
  local name=$1; shift
  local est=${estimate[$name]}
  [ "$name" = build ] && [ "$dry" = 0 ] && carried_build && est=${estimate[build_carried]}
  if [ "$dry" = 1 ]; then
    planned=$((planned + est))
    printf '[%s] ~%d s (by %d s): would run: %s\n' "$name" "$est" "$planned" "$*"
    status[$name]=dry-run; seconds[$name]=0
    return 0
  fi
  local left=$((budget - reserve - SECONDS))
  if [ "$left" -lt "$est" ] && [ "$name" != env ]; then
    echo "== [$name] skipped: ~$est s expected, $left s left of the budget of $budget s"
    status[$name]="skipped (budget)"; seconds[$name]=0
    return 0
  fi
  echo "== [$name] $(date +%T), up to $left s"
  local t0=$SECONDS rc
  ( timeout --kill-after=5 "$left" bash -c "$(declare -f "$1"); $*" ) \
    > "$logs/$name.log" 2>&1
  rc=$?
  seconds[$name]=$((SECONDS - t0))
  case $rc in
    0) status[$name]=passed ;;
    124|137) status[$name]="stopped at the budget (timeout)" ;;
    *) status[$name]="failed (exit $rc)" ;;
  esac
  echo "   ${status[$name]} in ${seconds[$name]} s; last lines of $logs/$name.log:"
  tail -n 12 "$logs/$name.log" | sed 's/^/   | /'
  return 0
}

# --- the stages (each runs in its own bash, so they read only exported variables) ---------
export -f source_hash build_key   # the build stage's bash reads the carried build's key too
export PYTHON root carry gtest_bin commit table_json tc_json e2e_json arch jobs e2e_args pytest_args device quick

stage_env() {
  nvidia-smi
  "$PYTHON" -c "import sys, torch; print('python', sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda); print(torch.cuda.get_device_properties(0))"
  nvcc --version || /usr/local/cuda/bin/nvcc --version
  command -v compute-sanitizer ncu cmake ninja || true
  echo "commit $commit"
}

stage_build() {
  local key; key=$(build_key)
  if [ -f "$carry/build/key" ] && [ "$(cat "$carry/build/key")" = "$key" ]; then
    echo "reusing the carried build ($key)"
    cp "$carry"/build/_C*.so kvcache_ext/
  else
    # The GPU's own arch only (sm_90 on an H100/H200): a third of the compile of 8.0 + 9.0 + PTX.
    TORCH_CUDA_ARCH_LIST=$arch KVCACHE_EXT_CUDA=1 "$PYTHON" setup.py build_ext --inplace > build-ext.log 2>&1
    local rc=$?
    tail -n 30 build-ext.log
    [ $rc -eq 0 ] || return 1
    mkdir -p "$carry/build"
    cp kvcache_ext/_C*.so "$carry/build/"
    strip --strip-debug "$carry"/build/_C*.so 2>/dev/null || true   # under $OUT's 16 MiB a file
    echo "$key" > "$carry/build/key"
  fi
  "$PYTHON" -c "import kvcache_ext, json; info = kvcache_ext.build_info(); print(json.dumps(info)); \
assert info['cuda'], 'built without CUDA'" || return 1
  # A private static libstdc++ in _C made every error that formats an integer crash.
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_build.py -k libstdcxx
}

# From / : "-m" puts the working directory first on sys.path, where an unbuilt checkout would
# hide the installed copy; checkout_first has put a built checkout on PYTHONPATH.
stage_check() { (cd / && "$PYTHON" -m kvcache_ext check --device "$device"); }

stage_bench() {
  # shellcheck disable=SC2086  # quick is empty or one flag
  "$PYTHON" bench/tools/gpu_verify.py table --device "$device" $quick --out "$table_json"
}

stage_tc() {
  local rc=0
  if [ "$device" = cuda ]; then
    # At most 5 failures listed: a kernel that is wrong is wrong in most of the ~200 cases.
    # Every test sets the switch itself (unset, 1, 0): the environment here does not matter.
    "$PYTHON" -m pytest -q -p no:cacheprovider -rfE --maxfail=5 tests/test_prefill_tc.py tests/test_decode_tc.py || rc=1
  fi
  # shellcheck disable=SC2086  # quick is empty or one flag
  "$PYTHON" bench/tools/gpu_verify.py tc --device "$device" $quick --out "$tc_json" || rc=1
  return $rc
}

stage_sanitize() {
  local rc=0 tool
  command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not found"; return 1; }
  # Small stores, every op, both compaction paths (bench/tools/gpu_verify.py sanitize-driver).
  # racecheck and synccheck instrument our kernels only (kns: a substring of the kernel's name;
  # every kernel of ours is in namespace kvcache_ext): ours are the ones whose shared memory and
  # barriers are in question, and torch's would only slow the run.
  for tool in memcheck racecheck synccheck; do
    echo "--- $tool"
    local extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check no)
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    [ "$tool" != memcheck ] && extra+=(--kernel-name kns=kvcache_ext)
    # Without torch's caching allocator every tensor is its own allocation, so an access past
    # one is out of bounds for memcheck instead of landing in a cached neighbour.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 50 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --print-limit 20 "${extra[@]}" "$PYTHON" bench/tools/gpu_verify.py sanitize-driver --device cuda \
      || { echo "$tool: exit $?"; rc=1; }
  done
  return $rc
}

stage_e2e() {
  # shellcheck disable=SC2086  # the arguments are a list
  "$PYTHON" bench/e2e.py --no-progress --device "$device" --out "$e2e_json" $e2e_args
}

TEST_FILES="tests/test_build.py tests/test_store.py tests/test_store_fork.py tests/test_select.py tests/test_attention.py
  tests/test_ops.py tests/test_patch.py tests/test_cuda_metadata.py tests/test_host_syncs.py
  tests/test_cuda_model.py tests/test_device_map.py tests/test_decode_graph.py tests/test_int8_pages.py"
export TEST_FILES

stage_test() {
  local rc=0 f frc
  for f in $TEST_FILES; do
    echo "--- $f"
    # shellcheck disable=SC2086  # pytest_args is a list
    "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs "$f" -k "cuda or build" ${pytest_args}
    frc=$?
    # 5: no test selected in the file; 139 (128 + SIGSEGV) and the like: the process died.
    [ $frc -eq 0 ] || [ $frc -eq 5 ] || rc=1
    echo "--- $f: exit $frc"
  done
  return $rc
}

stage_gtest() {
  local gtest_args=()
  if [ ! -f /usr/lib/x86_64-linux-gnu/libgtest.a ] && [ -d "$carry/googletest" ]; then
    cmake -S "$carry/googletest" -B build/googletest -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$root/build/googletest-install" -DBUILD_GMOCK=OFF >/dev/null \
      && cmake --build build/googletest -j "$jobs" >/dev/null && cmake --install build/googletest >/dev/null \
      || { echo "building GoogleTest from $carry/googletest failed (bench/tools/gpu_verify.sh --pack first)"; return 1; }
    gtest_args=(-DCMAKE_PREFIX_PATH="$root/build/googletest-install")
  fi
  cmake -S . -B build/gtest -G Ninja -DPython3_EXECUTABLE="$(command -v "$PYTHON")" -DKVCACHE_EXT_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${arch/./}" "${gtest_args[@]}" && cmake --build build/gtest -j "$jobs" || return 1
  "$gtest_bin" --gtest_filter='*Cuda*:AttentionPlan.*' --gtest_brief=1 || return 1
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$gtest_bin" --gtest_filter='*Cuda*' \
    --gtest_brief=1
}

stage_probe() { "$PYTHON" bench/tools/gpu_probe.py --gdb; }

stage_ncu() { PYTHON=$PYTHON bench/nsight/profile.sh --set detailed; }

describe() {
  case $1 in
    env) echo "nvidia-smi; torch, nvcc and compute-sanitizer versions" ;;
    build) echo "TORCH_CUDA_ARCH_LIST=<gpu arch> $PYTHON setup.py build_ext --inplace (or .gpucarry/build when its key matches)" ;;
    check) echo "$PYTHON -m kvcache_ext check --device $device" ;;
    bench) echo "$PYTHON bench/tools/gpu_verify.py table --device $device $quick --out $table_json" ;;
    tc) echo "$PYTHON -m pytest tests/test_prefill_tc.py tests/test_decode_tc.py; $PYTHON bench/tools/gpu_verify.py tc --device $device $quick --out $tc_json" ;;
    sanitize) echo "compute-sanitizer --tool memcheck|racecheck|synccheck $PYTHON bench/tools/gpu_verify.py sanitize-driver" ;;
    e2e) echo "$PYTHON bench/e2e.py --no-progress --device $device --out $e2e_json" $e2e_args ;;
    test) echo "for f in" $TEST_FILES "; do $PYTHON -m pytest \$f -k 'cuda or build' $pytest_args; done" ;;
    gtest) echo "cmake -S . -B build/gtest -DKVCACHE_EXT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=<arch> && $gtest_bin --gtest_filter='*Cuda*'; compute-sanitizer memcheck over it" ;;
    probe) echo "$PYTHON bench/tools/gpu_probe.py --gdb" ;;
    ncu) echo "bench/nsight/profile.sh --set detailed" ;;
  esac
}

for s in "${stage_list[@]}"; do
  if [ "$dry" = 1 ]; then
    run_stage "$s" "$(describe "$s")"
    continue
  fi
  case $s in
    env|build) ;;
    *) [ -n "${status[build]:-}" ] || [ "$device" = cpu ] || run_stage build stage_build ;;  # build first
  esac
  checkout_first
  run_stage "$s" "stage_$s"
done
checkout_first

if [ "$dry" = 1 ]; then
  echo "plan: ~$planned s of the budget of $budget s (less $reserve s for the report and packing)"
  [ "$planned" -le $((budget - reserve)) ] || echo "WARNING: the plan's estimate exceeds the budget: later stages will be skipped"
  echo "dry run: would write $summary, $table_json, $tc_json and print the table (bench/tools/gpu_verify.py report)"
  exit 0
fi

# --- the summary, the table, and what goes back ---------------------------------------------
"$PYTHON" - "$summary" <<PY
import datetime, json, os, sys
path = sys.argv[1]
stages = {$(for s in "${!status[@]}"; do printf '"%s": {"status": "%s", "seconds": %s}, ' "$s" "${status[$s]}" "${seconds[$s]}"; done)}
sys.path.insert(0, "bench")
import torch
from common import run_metadata   # device, date, commit (\$KVCACHE_EXT_COMMIT where there is no .git)
doc = json.load(open(path)) if os.path.exists(path) else {"stages": {}}
doc.update(**run_metadata("cuda" if torch.cuda.is_available() else "cpu"), torch=torch.__version__)
for name, st in stages.items():
    st["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    doc["stages"][name] = st
json.dump(doc, open(path, "w"), indent=2)
PY
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/results.tar.gz" bench/results
  [ -d "$carry/build" ] && tar czf "$OUT/build.tar.gz" -C "$root" .gpucarry/build
fi
echo "stages: $(for s in "${stage_list[@]}"; do printf '%s %s (%s s); ' "$s" "${status[$s]:-not run}" "${seconds[$s]:-0}"; done)"
"$PYTHON" bench/tools/gpu_verify.py report "$table_json" --e2e "$e2e_json" --stages "$summary" --tc "$tc_json"
