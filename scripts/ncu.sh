#!/usr/bin/env bash
# Profiles kernels with Nsight Compute on the device machine, the way
# docs/performance.md's kernel notes were measured: the GPU clocks left as
# they are (--clock-control none), the sections that say where a kernel's
# time goes, a text report under $OUT.
#
#   bash scripts/ncu.sh KERNELS COUNT [SKIP] -- COMMAND...
#
# KERNELS is a regular expression of kernel names (ncu's regex:), COUNT
# how many matching launches to profile after skipping SKIP (default 0);
# COMMAND runs from the repository root, with the bundle of
# `scripts/gpu-test.sh build` unpacked into .gpu first. A test binary runs
# from its package's folder, as gpu-test.sh runs it:
#
#   bash scripts/ncu.sh 'attn_h_forward_d64$' 1 -- backend/cuda: .gpu/backend_cuda.test -test.run '^TestAttentionFigures$'
#   bash scripts/ncu.sh tp_gather_nt 1 3 -- .gpu/mktrain bench tp --shapes llama70b --tp 8 --iters 1 --out /tmp/tp
#
# A COMMAND that starts with "DIR:" runs from DIR (paths in it stay
# relative to the repository root). NCU_SECTIONS replaces the sections
# (none: no section); NCU_METRICS adds --metrics; NCU_TIMEOUT bounds the run (default 300 s);
# NCU_SOURCE=1 also keeps the report ($OUT/ncu-<n>.ncu-rep, for the Nsight
# Compute GUI), writes every SASS instruction of the profiled kernels
# with its warp-stall samples to $OUT/ncu-<n>-sass.csv and prints their
# summary by opcode and instruction (scripts/ncu_sass.py, ncu-<n>-sass.txt).
# NCU_LAUNCHES=1 (with NCU_SECTIONS=none and NCU_METRICS, say
# gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.max,
# smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum,
# lts__t_sector_hit_rate.pct) instead writes the metrics of every launch
# to $OUT/ncu-<n>.csv and prints them per run of launches
# (scripts/ncu_launches.py, ncu-<n>-launches.txt): the way to compare
# builds whose wall-clock figures move more than they differ, such as a
# lab test's variants in one process.
# The report is $OUT/ncu-<n>.txt (the first free n); Nsight Compute's
# kernel replay saves and restores the device memory a kernel may write,
# so a large workload profiles slowly.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 4 ]]; then
  echo "usage: bash scripts/ncu.sh KERNELS COUNT [SKIP] -- COMMAND..." >&2
  exit 2
fi
kernels=$1 count=$2
shift 2
skip=0
if [[ "$1" != "--" ]]; then
  skip=$1
  shift
fi
if [[ "${1:-}" != "--" || $# -lt 2 ]]; then
  echo "ncu.sh: want -- and a command after KERNELS COUNT [SKIP]" >&2
  exit 2
fi
shift
command -v ncu >/dev/null || { echo "ncu.sh: ncu is not on PATH" >&2; exit 1; }
[[ -f .gpu/bundle.tgz ]] && { tar xzf .gpu/bundle.tgz -C .gpu || exit 1; }
export NCCL_NVLS_ENABLE=0
out=${OUT:-.gpu/out}
mkdir -p "$out"
n=1
while [[ -e "$out/ncu-$n.txt" ]]; do n=$((n + 1)); done
report="$out/ncu-$n.txt"
sections=${NCU_SECTIONS:-SpeedOfLight LaunchStats Occupancy ComputeWorkloadAnalysis MemoryWorkloadAnalysis SchedulerStats WarpStateStats SourceCounters}
args=(--clock-control none --kernel-name "regex:$kernels" --launch-skip "$skip" --launch-count "$count" --print-details all)
[[ "$sections" == none ]] && sections=
for s in $sections; do args+=(--section "$s"); done
[[ -n "${NCU_METRICS:-}" ]] && args+=(--metrics "$NCU_METRICS")
dir=.
if [[ "$1" == *: ]]; then
  dir=${1%:}
  shift
fi
root=$(pwd)
prog=$1
shift
[[ "$prog" == /* ]] || prog="$root/$prog"
echo "ncu.sh: $kernels ($count after $skip) in: $*" >"$report"
# NCU_SOURCE and NCU_LAUNCHES keep the report and read pages from it.
rep="$(cd "$out" && pwd)/ncu-$n"  # absolute: the command may run from DIR
keep=()
[[ -n "${NCU_SOURCE:-}${NCU_LAUNCHES:-}" ]] && keep=(--export "$rep" --force-overwrite)
(cd "$dir" && timeout "${NCU_TIMEOUT:-300}" ncu "${args[@]}" "${keep[@]}" "$prog" "$@") >>"$report" 2>&1
rc=$?
py=$(command -v python3 || true)
if [[ -n "${NCU_SOURCE:-}" ]]; then
  # Print the sections from the report, and list every SASS instruction
  # with its warp-stall samples (ncu-<n>-sass.csv).
  ncu --import "$rep.ncu-rep" --print-details all >>"$report" 2>&1
  if ncu --import "$rep.ncu-rep" --page source --csv --print-source sass >"$out/ncu-$n-sass.csv" 2>&1; then
    # The opcodes and instructions with the most stall samples
    # (scripts/ncu_sass.py), printed last.
    [[ -n "$py" ]] && "$py" scripts/ncu_sass.py "$out/ncu-$n-sass.csv" 15 >"$out/ncu-$n-sass.txt" 2>&1
  else
    echo "ncu.sh: no source page (ncu --page source)" >&2
  fi
elif [[ -n "${NCU_LAUNCHES:-}" ]]; then
  # Every launch's metrics as a raw CSV page, summarised per run of
  # launches (scripts/ncu_launches.py), printed last.
  metrics=()
  [[ -n "${NCU_METRICS:-}" ]] && metrics=(--metrics "$NCU_METRICS")
  ncu --import "$rep.ncu-rep" --csv --page raw --print-units base "${metrics[@]}" >"$out/ncu-$n.csv" 2>&1
  rm -f "$rep.ncu-rep"
  [[ -n "$py" ]] && "$py" scripts/ncu_launches.py "$out/ncu-$n.csv" >"$out/ncu-$n-launches.txt" 2>&1
fi
echo "ncu.sh: exit $rc, report $report"
grep -E '^  [a-zA-Z_0-9]+ \(|Duration|Compute \(SM\) Throughput|DRAM Throughput|Pipe Tensor Cycles Active|No Eligible|Stall (Long Scoreboard|Wait|Barrier|MIO Throttle)' "$report" | head -n 40
[[ -f "$out/ncu-$n-sass.txt" ]] && cat "$out/ncu-$n-sass.txt"
[[ -f "$out/ncu-$n-launches.txt" ]] && head -n 60 "$out/ncu-$n-launches.txt"
exit $rc
