#!/usr/bin/env bash
# One command for a lent GPU: build with the machine's own torch, run the CUDA tests, the
# sanitizers, the benchmarks and the Nsight summary, and collect the results.
#
#   bench/gpu_check.sh [--stages LIST] [--deadline S] [--dry-run] [--e2e-args "ARGS"]
#                      [--pytest-args "ARGS"]
#   bench/gpu_check.sh --pack          # here, before a device call: fills .gpucarry/
#
# Stages, in order (default: all but e2e; LIST is comma-separated):
#   env       nvidia-smi, torch, nvcc: what the machine is
#   build     the extension in place (TORCH_CUDA_ARCH_LIST = the GPU's own arch) and the gtest
#             binary (CMake, same arch), side by side; skipped when .gpucarry/build holds a
#             build of the same sources for the same torch and Python (what an earlier call
#             brought back: see --pack and bench/README.md "GPU check")
#   probe     bench/gpu_probe.py --gdb: does an error raised in C++ reach Python (torch's own,
#             our CPU op, our CUDA ops, through pybind11), each in its own process, with a
#             cuda-gdb backtrace of each crash (two CUDA bad inputs crashed on 2026-11-26)
#   test      pytest on the kernel tests (store, selection, attention, the custom ops' opcheck,
#             the patch-time head_dim checks, the gtest cases, patched tiny models on CUDA): the cases
#             named cuda or build, one pytest process per file, so that a crash in one file
#             does not hide the others
#   sanitize  compute-sanitizer memcheck, then racecheck and synccheck, on the gtest CUDA cases
#   bench     bench/kernels.py and bench/attention.py on cuda
#   ncu       bench/nsight/profile.sh --set detailed (attention and compaction kernels)
#   e2e       bench/e2e.py with --e2e-args (default: one 32K x 16 case and 8K x 1/4, see below)
#
# --deadline S: a stage that would start more than S seconds after the script did is skipped
# (recorded as such), so that one call stays within the device's 10-minute limit.
#
# Every stage writes bench/results/gpu-check/<stage>.log; a summary with the device, date,
# commit, and each stage's status and seconds goes to bench/results/gpu-check-<gpu>-<date>.json.
# When $OUT is set (the device tool), everything new under bench/results/ and the build (for
# the next call to carry) is packed into $OUT, which comes back to the calling machine.
#
# Environment: PYTHON (default python3), MAX_JOBS (default: all cores).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"

ALL_STAGES="env build probe test sanitize bench ncu e2e"
stages="env,build,probe,test,sanitize,bench,ncu"
dry=0
pack=0
e2e_args="--contexts 8192,32768 --batches 1,4,16 --budgets 1024 --steps 64"
pytest_args=""
deadline=0
PYTHON=${PYTHON:-python3}
carry="$root/.gpucarry"
results="$root/bench/results"
logs="$results/gpu-check"

die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --stages) [ $# -ge 2 ] || die "--stages needs a list, e.g. --stages build,test"; stages=$2; shift ;;
    --dry-run) dry=1 ;;
    --deadline) [ $# -ge 2 ] || die "--deadline needs seconds"; deadline=$2; shift ;;
    --pack) pack=1 ;;
    --e2e-args) [ $# -ge 2 ] || die "--e2e-args needs a quoted argument list"; e2e_args=$2; shift ;;
    --pytest-args) [ $# -ge 2 ] || die "--pytest-args needs a quoted argument list"; pytest_args=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done
[[ $deadline =~ ^[0-9]+$ ]] || die "--deadline takes whole seconds (0: none), got '$deadline'"
IFS=',' read -r -a stage_list <<< "$stages"
for s in "${stage_list[@]}"; do
  case " $ALL_STAGES " in *" $s "*) ;; *) die "unknown stage '$s'; stages are: $ALL_STAGES" ;; esac
done

# The sources whose build can be reused: same hash, same Python and torch.
source_hash() {
  find csrc setup.py CMakeLists.txt -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' \
    -o -name '*.py' -o -name '*.txt' \) | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-16
}

# --- --pack: run here, before a device call ------------------------------------------------
if [ "$pack" = 1 ]; then
  mkdir -p "$carry"  # ignored by .gitignore: it travels only when named in carry
  # GoogleTest's source (Debian's libgtest-dev ships it): the device has no libgtest.
  if [ ! -d "$carry/googletest" ]; then
    [ -d /usr/src/googletest ] || die "/usr/src/googletest not found: apt-get install libgtest-dev"
    cp -r /usr/src/googletest "$carry/googletest"
  fi
  commit=$(git rev-parse --short HEAD)
  git diff --quiet HEAD -- . ':!bench/results' || commit="$commit+dirty"
  echo "$commit" > "$carry/commit"
  echo "packed $carry ($(du -sh "$carry" | cut -f1)): googletest source, commit $commit"
  echo "carry it: run(command='bench/gpu_check.sh ...', carry=['.gpucarry'])"
  exit 0
fi

commit=$(cat "$carry/commit" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
export KVCACHE_EXT_COMMIT=$commit
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
jobs=${MAX_JOBS:-$(nproc)}
export MAX_JOBS=$jobs

if [ "$dry" = 1 ]; then
  gpu_tag="GPU"; arch="9.0"; date_tag=$(date +%F)
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || die "no NVIDIA GPU (nvidia-smi -L failed)"
  read -r gpu_tag arch < <("$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(p.name.replace(' ', '-'), f'{p.major}.{p.minor}')") || die "$PYTHON cannot see the GPU through torch"
  date_tag=$(date +%F)
fi
summary="$results/gpu-check-$gpu_tag-$date_tag.json"
gtest_bin="$root/build/gtest/kvcache_ext_gtest"
mkdir -p "$logs"

# run_stage NAME COMMAND...: runs (or, with --dry-run, prints) one stage, logging it.
declare -A status seconds
run_stage() {
  local name=$1; shift
  if [ "$deadline" -gt 0 ] && [ "$SECONDS" -gt "$deadline" ]; then
    echo "== [$name] skipped: past the deadline of $deadline s"
    status[$name]="skipped (deadline)"; seconds[$name]=0
    return 0
  fi
  if [ "$dry" = 1 ]; then
    echo "[$name] would run: $*"
    status[$name]=dry-run; seconds[$name]=0
    return 0
  fi
  echo "== [$name] $(date +%T)"
  local t0=$SECONDS rc
  ( "$@" ) > "$logs/$name.log" 2>&1
  rc=$?
  seconds[$name]=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then status[$name]=passed; else status[$name]="failed (exit $rc)"; fi
  echo "   ${status[$name]} in ${seconds[$name]} s; last lines of $logs/$name.log:"
  tail -n 15 "$logs/$name.log" | sed 's/^/   | /'
  return 0
}

# --- the stages ---------------------------------------------------------------------------
stage_env() {
  nvidia-smi
  "$PYTHON" -c "import sys, torch; print('python', sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda); p = torch.cuda.get_device_properties(0); print(p)"
  nvcc --version || /usr/local/cuda/bin/nvcc --version
  command -v compute-sanitizer ncu cmake ninja || true
  echo "commit $commit, source hash $(source_hash)"
}

build_key() { echo "$(source_hash) $("$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)')"; }

stage_build() {
  local key; key=$(build_key)
  if [ -f "$carry/build/key" ] && [ "$(cat "$carry/build/key")" = "$key" ]; then
    echo "reusing the carried build ($key)"
    cp "$carry"/build/_C*.so kvcache_ext/
    mkdir -p build/gtest && cp "$carry/build/kvcache_ext_gtest" "$gtest_bin"
  else
    export TORCH_CUDA_ARCH_LIST=$arch KVCACHE_EXT_CUDA=1
    local cmake_arch=${arch/./}
    local gtest_args=()
    # No system GoogleTest on the device: build the carried source (bench/gpu_check.sh --pack).
    if [ ! -f /usr/lib/x86_64-linux-gnu/libgtest.a ] && [ -d "$carry/googletest" ]; then
      cmake -S "$carry/googletest" -B build/googletest -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_INSTALL_PREFIX="$root/build/googletest-install" -DBUILD_GMOCK=OFF >/dev/null \
        && cmake --build build/googletest -j "$jobs" >/dev/null && cmake --install build/googletest >/dev/null \
        || { echo "building GoogleTest from $carry/googletest failed"; return 1; }
      gtest_args=(-DCMAKE_PREFIX_PATH="$root/build/googletest-install")
    fi
    # The extension and the gtest binary compile the same .cu files: side by side.
    ( "$PYTHON" setup.py build_ext --inplace > build-ext.log 2>&1; echo $? > build-ext.rc ) &
    local ext_pid=$!
    cmake -S . -B build/gtest -G Ninja -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
      -DKVCACHE_EXT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$cmake_arch" "${gtest_args[@]}" \
      && cmake --build build/gtest -j "$jobs"
    local gtest_rc=$?
    wait $ext_pid
    echo "--- setup.py build_ext (exit $(cat build-ext.rc)):"; tail -n 40 build-ext.log
    [ "$(cat build-ext.rc)" = 0 ] && [ $gtest_rc -eq 0 ] || return 1
    mkdir -p "$carry/build"
    cp kvcache_ext/_C*.so "$gtest_bin" "$carry/build/" && echo "$key" > "$carry/build/key"
  fi
  "$PYTHON" -c "import kvcache_ext, json; info = kvcache_ext.build_info(); print(json.dumps(info)); \
assert info['cuda'], 'built without CUDA'" || return 1
  # A private static libstdc++ in _C made every error that formats an integer crash (2026-11-26):
  # stop here on such a build (the test says why), before the stages that would crash on it.
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_build.py -k libstdcxx
}

TEST_FILES="tests/test_build.py tests/test_store.py tests/test_select.py tests/test_attention.py
  tests/test_ops.py tests/test_patch.py tests/test_cpp_kernels.py tests/test_cuda_model.py"

stage_probe() {
  "$PYTHON" bench/gpu_probe.py --gdb
}

stage_test() {
  local rc=0 f frc
  for f in $TEST_FILES; do
    echo "--- $f"
    # shellcheck disable=SC2086  # pytest_args is a list
    KVCACHE_EXT_GTEST_BIN="$gtest_bin" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs "$f" \
      -k "cuda or build" ${pytest_args}
    frc=$?
    # 5: no test selected in the file; 139 (128 + SIGSEGV) and the like: the process died.
    [ $frc -eq 0 ] || [ $frc -eq 5 ] || rc=1
    echo "--- $f: exit $frc"
  done
  return $rc
}

stage_sanitize() {
  local rc=0
  command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not found"; return 1; }
  # memcheck over every CUDA case; racecheck and synccheck over the shared-memory kernels.
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$gtest_bin" --gtest_filter='*Cuda*' \
    --gtest_brief=1 || rc=1
  timeout 90 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 "$gtest_bin" \
    --gtest_filter='Cases/Store.*Cuda*:Cases/AttentionRandom.*Cuda*' --gtest_brief=1 || rc=1
  timeout 60 compute-sanitizer --tool synccheck --error-exitcode 9 "$gtest_bin" \
    --gtest_filter='Cases/Store.*Cuda*:Cases/AttentionRandom.*Cuda*' --gtest_brief=1 || rc=1
  return $rc
}

stage_bench() {
  local rc=0
  "$PYTHON" bench/kernels.py --device cuda || rc=1
  "$PYTHON" bench/attention.py --device cuda || rc=1
  return $rc
}

stage_ncu() {
  PYTHON=$PYTHON bench/nsight/profile.sh --set detailed
}

stage_e2e() {
  # shellcheck disable=SC2086  # the arguments are a list
  "$PYTHON" bench/e2e.py --no-progress --out "$results/e2e-$gpu_tag-$date_tag-$(date +%H%M).json" $e2e_args
}

for s in "${stage_list[@]}"; do
  if [ "$dry" = 1 ]; then
    case $s in
      env) run_stage env nvidia-smi + torch/nvcc versions ;;
      build) run_stage build "TORCH_CUDA_ARCH_LIST=<gpu arch> $PYTHON setup.py build_ext --inplace &" \
               "cmake -S . -B build/gtest -G Ninja -DKVCACHE_EXT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=<arch>" \
               "&& cmake --build build/gtest (or reuse .gpucarry/build when its key matches)" ;;
      probe) run_stage probe "$PYTHON bench/gpu_probe.py --gdb" ;;
      test) run_stage test "for f in" $TEST_FILES "; do KVCACHE_EXT_GTEST_BIN=$gtest_bin" \
              "$PYTHON -m pytest \$f -k 'cuda or build' $pytest_args; done" ;;
      sanitize) run_stage sanitize "compute-sanitizer --tool memcheck|racecheck|synccheck $gtest_bin --gtest_filter=*Cuda*" ;;
      bench) run_stage bench "$PYTHON bench/kernels.py --device cuda; $PYTHON bench/attention.py --device cuda" ;;
      ncu) run_stage ncu "bench/nsight/profile.sh --set detailed" ;;
      e2e) run_stage e2e "$PYTHON bench/e2e.py --no-progress --out bench/results/e2e-<gpu>-<date>-<time>.json $e2e_args" ;;
    esac
    continue
  fi
  if [ "$s" != env ] && [ "$s" != build ] && [ ! -x "$gtest_bin" ] && [ "${status[build]:-}" = "" ]; then
    run_stage build stage_build  # a later stage alone: the build first (reused when carried)
  fi
  run_stage "$s" "stage_$s"
done

# --- the summary, and what goes back -------------------------------------------------------
"$PYTHON" - "$summary" "$commit" "$dry" <<PY
import datetime, json, os, sys
path, commit, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
stages = {$(for s in "${!status[@]}"; do printf '"%s": {"status": "%s", "seconds": %s}, ' "$s" "${status[$s]}" "${seconds[$s]}"; done)}
if dry:
    print("dry run: would write", path, "with", json.dumps(stages))
    sys.exit(0)
import torch
doc = json.load(open(path)) if os.path.exists(path) else {"stages": {}}
doc.update(device=torch.cuda.get_device_name(0), date=datetime.date.today().isoformat(), commit=commit,
           torch=torch.__version__)
for name, st in stages.items():
    st["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    doc["stages"][name] = st
json.dump(doc, open(path, "w"), indent=2)
print("summary:", json.dumps(doc["stages"]))
PY
if [ "$dry" = 0 ] && [ -n "${OUT:-}" ]; then
  tar czf "$OUT/results.tar.gz" bench/results
  [ -d "$carry/build" ] && tar czf "$OUT/build.tar.gz" -C "$root" .gpucarry/build
  ls -la "$OUT"
fi
