#!/usr/bin/env bash
# GPU tests of the CUDA backend, in two steps, from the repository root:
#
#   scripts/gpu-test.sh build   # where Go is: builds the test binaries into .gpu/
#   scripts/gpu-test.sh         # on the GPU machine (no Go needed): runs them
#
# build cross-compiles each package's tests with CGO_ENABLED=0 for
# linux/amd64 (the binaries dlopen the NVIDIA libraries at run time, so the
# build machine needs no CUDA) plus Go's test2json. The run step runs each
# binary with -test.v from its package folder and writes, under $OUT (or
# .gpu/out): <pkg>.log (the raw output), <pkg>.json (test2json events) and
# summary.json (per-package counts and the "figure:" lines the tests log).
# It prints a short table last and exits non-zero if any package failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(backend/cuda/driver backend/cuda kernels)
BIN=.gpu

name_of() { echo "${1//\//_}"; }

if [[ "${1:-}" == "build" ]]; then
  set -e
  mkdir -p "$BIN"
  for pkg in "${PACKAGES[@]}"; do
    CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go test -c -o "$BIN/$(name_of "$pkg").test" "./$pkg"
  done
  CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -o "$BIN/test2json" cmd/test2json
  printf '%s\n' "${PACKAGES[@]}" >"$BIN/packages.txt"
  ls -l "$BIN"
  exit 0
fi

OUT="${OUT:-$BIN/out}"
mkdir -p "$OUT"
# Multi-GPU hosts: NVLink multicast stays off (it can take shared GPUs out
# of service).
export NCCL_NVLS_ENABLE=0
root=$(pwd)

echo "== machine"
uname -srm
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
echo

rows=()
figures=()
pkg_json=()
status=0
while read -r pkg; do
  [[ -z "$pkg" ]] && continue
  n=$(name_of "$pkg")
  test_bin="$root/$BIN/$n.test"
  if [[ ! -x "$test_bin" ]]; then
    echo "== $pkg: $test_bin missing (run scripts/gpu-test.sh build first)"
    rows+=("$pkg|missing|0|0|0|0")
    status=1
    continue
  fi
  echo "== $pkg"
  start=$(date +%s%N)
  (cd "$root/$pkg" && "$test_bin" -test.v=test2json -test.timeout=300s -test.count=1) >"$OUT/$n.log" 2>&1
  rc=$?
  secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.2f", (b - a) / 1e9 }')
  if [[ -x "$root/$BIN/test2json" ]]; then
    "$root/$BIN/test2json" -t -p "$pkg" <"$OUT/$n.log" >"$OUT/$n.json"
  fi
  # The log with test2json's framing bytes removed.
  tr -d '\026' <"$OUT/$n.log" | grep -v '^=== \(RUN\|PAUSE\|CONT\|NAME\)' | tail -n 60
  pass=$(tr -d '\026' <"$OUT/$n.log" | grep -c -- '--- PASS')
  fail=$(tr -d '\026' <"$OUT/$n.log" | grep -c -- '--- FAIL')
  skip=$(tr -d '\026' <"$OUT/$n.log" | grep -c -- '--- SKIP')
  result=ok
  if [[ $rc -ne 0 ]]; then result="FAIL($rc)"; status=1; fi
  rows+=("$pkg|$result|$pass|$fail|$skip|$secs")
  pkg_json+=("{\"package\":\"$pkg\",\"exit\":$rc,\"passed\":$pass,\"failed\":$fail,\"skipped\":$skip,\"seconds\":${secs:-0}}")
  while IFS= read -r line; do
    figures+=("$line")
  done < <(tr -d '\026' <"$OUT/$n.log" | sed -n 's/.*figure: \(.*\) = \([^ ]*\) \(.*\)$/\1|\2|\3/p')
  echo
done <"$BIN/packages.txt"

# summary.json, with plain shell quoting: names hold no quotes.
{
  echo "{\"packages\":["
  (IFS=,; echo "${pkg_json[*]:-}")
  echo "],\"figures\":["
  first=1
  for f in "${figures[@]:-}"; do
    [[ -z "$f" ]] && continue
    IFS='|' read -r fname fval funit <<<"$f"
    [[ $first -eq 0 ]] && echo ","
    printf '{"name":"%s","value":%s,"unit":"%s"}' "$fname" "$fval" "$funit"
    first=0
  done
  echo "]}"
} >"$OUT/summary.json"

echo "== figures"
for f in "${figures[@]:-}"; do
  [[ -z "$f" ]] && continue
  IFS='|' read -r fname fval funit <<<"$f"
  printf '  %-52s %10s %s\n' "$fname" "$fval" "$funit"
done
echo
echo "== summary"
printf '  %-22s %-9s %5s %5s %5s %8s\n' package result pass fail skip seconds
for r in "${rows[@]}"; do
  IFS='|' read -r p res pa fa sk se <<<"$r"
  printf '  %-22s %-9s %5s %5s %5s %8.1f\n' "$p" "$res" "$pa" "$fa" "$sk" "$se"
done
exit $status
