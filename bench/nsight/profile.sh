#!/usr/bin/env bash
# Profiles the ragged attention, selection and compaction kernels with Nsight Compute, or records an
# Nsight Systems timeline of the same driver (bench/nsight/drive.py). See bench/README.md,
# section "Nsight".
#
#   bench/nsight/profile.sh [--set NAME] [--nsys] [-- DRIVE_ARGS...]
#
#   --set NAME   ncu section set (default: full; "detailed" is quicker and still has the
#                speed-of-light, memory workload and occupancy sections)
#   --nsys       an nsys timeline instead of the ncu profile
#   DRIVE_ARGS   passed to drive.py, e.g. -- --lengths skewed --gib 2
#
# Environment: PYTHON (default python), NCU (default ncu), NSYS (default nsys),
# KERNEL_REGEX (default below: matched against the kernels' function names).
#
# Writes to bench/results/:
#   ncu-<gpu>-<date>.ncu-rep            the report (open it in the Nsight Compute GUI)
#   ncu-<gpu>-<date>-details.csv        ncu --page details --csv, every section of every kernel
#   ncu-<gpu>-<date>-summary.txt        ncu --print-summary per-kernel
#   ncu-<gpu>-<date>-key-metrics.md     the metrics bench/README.md explains, one row per launch
#   ncu-<gpu>-<date>.log                ncu's and the driver's output
# or with --nsys: nsys-<gpu>-<date>.nsys-rep and nsys-<gpu>-<date>-kernels.txt.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
results="$root/bench/results"
PYTHON=${PYTHON:-python}
NCU=${NCU:-ncu}
NSYS=${NSYS:-nsys}
# Every kernel of ours (csrc/attention, csrc/select, csrc/store: namespace kvcache_ext), matched
# against the demangled name, whatever the kernels are called, and CUB's
# kernels that a selection may launch.
KERNEL_REGEX=${KERNEL_REGEX:-'kvcache_ext::|cub::'}

die() { echo "profile.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

set_name=full
mode=ncu
drive_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --set) [ $# -ge 2 ] || die "--set needs a name"; set_name=$2; shift ;;
    --nsys) mode=nsys ;;
    -h|--help) usage; exit 0 ;;
    --) shift; drive_args=("$@"); break ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done

# --- what the profile needs: the profiler, a GPU, torch with CUDA, kvcache_ext with CUDA ------
if [ "$mode" = ncu ]; then
  command -v "$NCU" >/dev/null 2>&1 || die "Nsight Compute CLI '$NCU' not found. It ships with the \
CUDA toolkit (/usr/local/cuda/bin/ncu) or as the nsight-compute package; put it on PATH or set \
NCU=/path/to/ncu."
else
  command -v "$NSYS" >/dev/null 2>&1 || die "Nsight Systems CLI '$NSYS' not found. Install Nsight \
Systems (nsight-systems package, or the CUDA toolkit's nsys); put it on PATH or set NSYS=/path/to/nsys."
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
  || die "no NVIDIA GPU found (nvidia-smi -L failed); these profiles need a CUDA GPU."
tag=$("$PYTHON" - <<'PY'
import sys
try:
    import torch
    import kvcache_ext
except ImportError as e:
    sys.exit(f"cannot import torch/kvcache_ext ({e}); install the package or set PYTHONPATH "
             "to the repository root for an in-place build")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA GPU (a CPU-only torch, or CUDA_VISIBLE_DEVICES hides it)")
if not kvcache_ext.build_info()["cuda"]:
    sys.exit("kvcache_ext was built without CUDA kernels; rebuild it where nvcc is available "
             "(pip install --no-build-isolation .)")
print(torch.cuda.get_device_name(0).replace(" ", "-"))
PY
) || die "the Python environment cannot run the CUDA kernels (see the line above)"

mkdir -p "$results"
date=$(date +%F)

if [ "$mode" = nsys ]; then
  out="$results/nsys-$tag-$date"
  "$NSYS" profile --trace=cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \
    --force-overwrite=true --output="$out" \
    "$PYTHON" "$here/drive.py" ${drive_args[@]+"${drive_args[@]}"}
  # Kernel time summary (report name of recent nsys; older ones call it gpukernsum).
  "$NSYS" stats --report cuda_gpu_kern_sum "$out.nsys-rep" > "$out-kernels.txt" 2>&1 \
    || "$NSYS" stats --report gpukernsum "$out.nsys-rep" > "$out-kernels.txt" 2>&1 \
    || echo "profile.sh: warning: nsys stats failed; open $out.nsys-rep in the Nsight Systems GUI" >&2
  echo "wrote $out.nsys-rep and $out-kernels.txt"
  exit 0
fi

out="$results/ncu-$tag-$date"
# --clock-control none: the GPU runs at its usual (boost) clocks instead of ncu's locked base
# clock, so durations compare with bench/attention.py's timings.
# --profile-from-start off: only the launches between drive.py's cudaProfilerStart/Stop.
set +e
"$NCU" --clock-control none --set "$set_name" --profile-from-start off \
  --kernel-name-base demangled --kernel-name "regex:$KERNEL_REGEX" --target-processes all \
  --force-overwrite --export "$out" \
  "$PYTHON" "$here/drive.py" ${drive_args[@]+"${drive_args[@]}"} 2>&1 | tee "$out.log"
status=${PIPESTATUS[0]}
set -e
if grep -q "ERR_NVGPUCTRPERM" "$out.log"; then
  die "ncu may not read the GPU's performance counters (ERR_NVGPUCTRPERM): run as root, or load \
the driver with NVreg_RestrictProfilingToAdminUsers=0 (see NVIDIA's ERR_NVGPUCTRPERM page)."
fi
[ "$status" -eq 0 ] || die "ncu exited with status $status (log: $out.log)"
[ -f "$out.ncu-rep" ] || die "ncu wrote no report: no kernel matched regex '$KERNEL_REGEX' \
(log: $out.log)"

"$NCU" --import "$out.ncu-rep" --page details --csv > "$out-details.csv"
"$NCU" --import "$out.ncu-rep" --print-summary per-kernel > "$out-summary.txt"
"$PYTHON" "$here/summarize.py" "$out-details.csv" > "$out-key-metrics.md"
cat "$out-key-metrics.md"
echo "wrote $out.ncu-rep, $out-details.csv, $out-summary.txt, $out-key-metrics.md"
