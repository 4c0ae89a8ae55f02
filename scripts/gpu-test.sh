#!/usr/bin/env bash
# GPU tests and the training benchmark of the CUDA backend, in two steps,
# from the repository root:
#
#   scripts/gpu-test.sh build   # where Go is: builds everything into .gpu/
#   scripts/gpu-test.sh         # on the GPU machine (no Go needed): runs it
#
# build cross-compiles, with CGO_ENABLED=0 for linux/amd64 (the binaries
# dlopen the NVIDIA libraries at run time, so the build machine needs no
# CUDA) and without symbol tables (-s -w; panics still print file:line):
# each package's test binary, Go's test2json and mktrain itself; copies the
# PyTorch peers (scripts/peer/*.py) to .gpu/peer/ and the commit to
# .gpu/commit.txt; and packs all of it into .gpu/bundle.tgz (about 20 MB),
# the one file to take to the GPU machine beside the repository (the
# device tool: carry [".gpu/bundle.tgz"]). The run step unpacks the bundle
# when it finds one. .gpu/ is ignored by git.
#
# The run step, on the GPU machine:
#   1. runs each test binary with -test.v from its package folder (engine:
#      its GPU tests only);
#   2. runs `mktrain bench train moe-small --steps 10 --warmup 3` on CUDA,
#      on the embedded corpus (the recipe's data shards are not there),
#      with its breakdown of the step;
#      then the same with --set train.deterministic=true (its tokens/s
#      in summary.json: the cost of the fixed-order adds);
#   3. runs the PyTorch peer (scripts/peer/torch_moe_train.py) on the same
#      model and batch, same step counts;
#   3b. with FINE=1, the same pair for moe-fine (`bench train moe-fine
#      --steps 4 --warmup 2` and the peer with --dim 2048 --experts 64
#      --topk 6 --ffn 1408 --batch 4): train-moe-fine.json and
#      peer-moe-fine.json, tokens/s and peak memory against the peer's;
#      then `bench train moe-large --steps 3 --warmup 1` (the recipe that
#      fits only with recomputation): train-moe-large.json, its peak
#      against the plan's;
#   4. runs the benchmark for the parallel layouts of world 2 and 4
#      (moe-small's per-rank shape; one rank per GPU where the machine
#      has enough GPUs, with the ep layouts under both dispatchers, else
#      virtual ranks of the one GPU);
#   5. `mktrain bench moe`: one MoE layer at W = 1, 2, 4, 8 virtual
#      expert-parallel ranks, moe-small's and a fine-grained shape, with
#      the time of each phase of the unfused path (moe.json), then
#      `mktrain bench kernels`: the fused MoE layer against the unfused
#      one and the grouped products alone (kernels.json), and on a
#      machine with several GPUs the same with one rank per GPU
#      (kernels-gpus.json);
#   5b. `mktrain bench attention --peer $PY`: the attention core against
#      PyTorch SDPA's cuDNN and flash backends (scripts/peer/attention_peer.py,
#      run by mktrain in the same command) at B8 S2048 H16 KV4 Dh64, B2
#      S8192 H16 KV16 Dh128 and B1 S32768 H32 KV8 Dh128, and context-parallel
#      attention (allgather and ring) on W = 2, 4, 8 virtual ranks against
#      the core on the whole sequence, with the bars of issue 27
#      (attention.json); on a machine with several GPUs also the ring
#      rows on one rank per GPU (--gpus, attention-gpus.json);
#   5c. `mktrain bench tp`: tensor parallelism's three patterns (product
#      alone, unfused, fused, deterministic fused) on tp = 2, 4, 8 virtual
#      ranks for moe-small's projections and a Llama-70B-like layer, with
#      the bars of issue 29 (tp.json); on a machine with several GPUs
#      also one rank per GPU (--gpus, tp-gpus.json);
#   6. the Hugging Face checks: scripts/hf_check.py (transformers' loss on
#      an fp32 export against mktrain eval's) and
#      scripts/hf_tokenizer_check.py (an export made with a tokenizer loads
#      with AutoTokenizer, and transformers' greedy continuation equals
#      mktrain sample --temperature 0);
#   7. with PREPARE_BENCH=1, `mktrain bench prepare` on every CPU core
#      beside the Rust tokenizers library (scripts/peer/tokenize_peer.py,
#      one process per core) on the same corpus (the repository's Go and
#      Markdown files as JSON Lines) and tokenizers (the GPT-2 and Llama 2
#      style fixtures of tokenizer/testdata): prepare-gpt2.json and
#      prepare-llama2.json, the peer's figures and the ratio inside.
# It writes under $OUT (or .gpu/out), so that a device call brings them
# back, the files bench/results/<machine>/ keeps (bench/results/README.md;
# copy them there to publish a run, and update docs/performance.md):
# summary.json (the commit, machine and library versions, per-package
# counts, the "figure:" lines the tests log, the two tokens/s figures),
# train-moe-small.json (mktrain's result), peer-moe-small.json (the
# peer's), layouts.json, moe.json, kernels.json, kernels-gpus.json,
# attention.json, tp.json, peer-kernels.json, hf-check.json and
# hf-tokenizer-check.json, each with the commit, date, command and
# machine; and logs.tgz (every raw log and test2json stream, each
# benchmark's JSON again, and clocks.csv, the SM clock and power over the
# run; written again as each test binary ends), which stays out of git.
# Every step on one GPU writes 11 files, more than the 8 a device call
# brings back: a call runs fewer steps (NO_HF=1 saves two files,
# NO_ATTENTION=1, NO_TP=1 or NO_LAYOUTS=1 one each), or, when it also keeps its own
# files (its console, say) or adds PEER_KERNELS=1, fewer still. It prints
# a short table last and exits non-zero if any package or benchmark
# failed.
#
# scripts/gpu_test_script_test.go runs the run step on any machine (go
# test ./scripts: one package's binary, no GPU), so a change that breaks
# it fails there first.
#
# Variables: GPU_TEST_BIN is the folder of the built binaries (default
# .gpu); GPU_TEST_SKIP is passed to every test binary as -test.skip,
# and GPU_TEST_RUN, when set, as -test.run instead of each package's filter;
# GPU_TEST_PACKAGES (a regexp of package paths) runs only those packages;
# GPU_TEST_TIMEOUT is each test binary's -test.timeout (default 420s:
# backend/cuda took 367.5 s on an H100 at 76eb2e2);
# MKTRAIN_GG_VARIANTS names the experiment variants of kernels/dev the
# backend/cuda tests take, comma-separated, or all (default none: the
# kernels as trained with; kernels/dev/README.md); LABS runs labs after
# the packages, each in a process of its own (LABS=pending: every lab
# waiting for a GPU; the format is above PENDING_LABS below);
# NO_BENCH=1 skips steps 2 to 5 and bench kernels, NO_TRAIN=1 steps 2 and 3, NO_LAYOUTS=1 step 4,
# NO_MOE=1 step 5, NO_KERNELS=1 bench kernels, NO_ATTENTION=1 step 5b, NO_TP=1 step 5c,
# NO_HF=1 step 6; NO_DET=1 step 2's deterministic run; FINE=1 runs step 3b (three files more; NO_LARGE=1 leaves
# out its moe-large); PEER_KERNELS=1 also runs scripts/peer/torch_kernels.py
# (peer-kernels.json); PREPARE_BENCH=1 runs step 7;
# PYTHON names the peer's interpreter (default /opt/torch/.venv/bin/python,
# else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export MKTRAIN_GG_VARIANTS="${MKTRAIN_GG_VARIANTS-}"

# Package, and the -test.run filter for it ("" = all tests).
PACKAGES=(
  "backend/cuda/driver|"
  "backend/cuda|"
  "kernels|"
  "engine|^(TestTinyRecipeCUDAMatchesCPU|TestVirtualRanksCUDA|TestLayoutsOnGPUs|TestDispatchersCUDA|TestDispatchersOnGPUs|TestNCCLOneNodeMatchesOneProcess|TestNCCLTwoNodesMatchOneProcess|TestNCCLNodeKilled|TestDeterministicGPURunsRepeat|TestRecomputeCUDA|TestRingCUDA|TestFusedRingCUDA|TestTensorParallelCUDA|TestMemorySavingsCUDA)$"
)
BIN=${GPU_TEST_BIN:-.gpu}
PEER_SRC=scripts/peer
BENCH_ARGS=(bench train moe-small --steps 10 --warmup 3 --set data.train= --set data.val= --set train.backend=cuda)
PEER_ARGS=(--steps 10 --warmup 3)

name_of() { echo "${1//\//_}"; }

if [[ "${1:-}" == "build" ]]; then
  set -e
  mkdir -p "$BIN" "$BIN/peer"
  : >"$BIN/packages.txt"
  files=()
  for entry in "${PACKAGES[@]}"; do
    pkg=${entry%%|*}
    CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go test -c -ldflags='-s -w' -o "$BIN/$(name_of "$pkg").test" "./$pkg"
    echo "$entry" >>"$BIN/packages.txt"
    files+=("$(name_of "$pkg").test")
  done
  CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -ldflags='-s -w' -o "$BIN/test2json" cmd/test2json
  # The commit is stamped explicitly: Go's VCS stamping is off on some
  # build machines (GOFLAGS=-buildvcs=false) and finds nothing in a git
  # worktree.
  rev=$(git rev-parse HEAD)
  git diff --quiet HEAD -- . ':!.gpu' || rev+="+dirty"
  CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -ldflags="-s -w -X main.buildCommit=$rev" -o "$BIN/mktrain" ./cmd/mktrain
  echo "$rev" >"$BIN/commit.txt"
  files+=(test2json mktrain packages.txt commit.txt)
  for peer in torch_moe_train.py torch_kernels.py tokenize_peer.py attention_peer.py; do
    cp -f "$PEER_SRC/$peer" "$BIN/peer/"
    files+=("peer/$peer")
  done
  tar czf "$BIN/bundle.tgz" -C "$BIN" "${files[@]}"
  ls -l "$BIN/bundle.tgz"
  exit 0
fi

if [[ -f "$BIN/bundle.tgz" ]]; then
  tar xzf "$BIN/bundle.tgz" -C "$BIN" || exit 1
fi

OUT="${OUT:-$BIN/out}"
mkdir -p "$OUT"
LOGS=$(mktemp -d)
# Multi-GPU hosts: NVLink multicast stays off (it can take shared GPUs out
# of service).
export NCCL_NVLS_ENABLE=0
root=$(pwd)
# The binaries' folder as an absolute path (run_binary runs each from its
# package's folder).
bin_dir=$(cd "$BIN" 2>/dev/null && pwd)

echo "== machine"
uname -srm
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
echo
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
GPU_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
COMMIT=$(cat "$BIN/commit.txt" 2>/dev/null || echo unknown)
RUN_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
PY="${PYTHON:-/opt/torch/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
# The peers from the bundle (built with the binaries), else from the
# repository.
PEER_DIR="$BIN/peer"
[[ -f "$PEER_DIR/torch_moe_train.py" ]] || PEER_DIR=scripts/peer

# json_str S: S as a JSON string, or null when empty.
json_str() {
  if [[ -z "$1" ]]; then printf null; return; fi
  local v=${1//\\/\\\\}
  printf '"%s"' "${v//\"/\\\"}"
}

# The machine, as the results record it.
machine_json() {
  local cpu
  cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
  printf '{"host":%s,"os":"linux","arch":"amd64","cpus":%s,"cpu":%s,"device":%s,"driver":%s,"gpus":%s,"kernel":%s}' \
    "$(json_str "$(hostname)")" "$(nproc)" "$(json_str "$cpu")" "$(json_str "$GPU_NAME")" \
    "$(json_str "$GPU_DRIVER")" "${NGPU:-0}" "$(json_str "$(uname -sr)")"
}

# wrap_result NAME BENCHMARK COMMAND RAW: $OUT/NAME.json, the JSON a
# script printed (RAW: its output, whole or its last line that is an
# object) as the figures of a result with the commit, date, command and
# machine, as mktrain's own results carry them. Nothing is written if
# RAW holds no JSON.
wrap_result() {
  "$PY" - "$@" "$COMMIT" "$RUN_DATE" "$(machine_json)" "$OUT/$1.json" <<'PYEOF'
import json, sys
name, benchmark, command, raw, commit, date, machine, out = sys.argv[1:9]
text = open(raw).read()
try:
    figures = json.loads(text)
except ValueError:
    lines = [l for l in text.splitlines() if l.startswith("{")]
    if not lines:
        sys.exit("%s: no JSON in %s" % (name, raw))
    figures = json.loads(lines[-1])
result = {"benchmark": benchmark, "commit": commit, "date": date, "command": command,
          "machine": json.loads(machine), "figures": figures}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
PYEOF
}
# The SM clock, board power and clock event reasons (0x4: the software
# power cap) every 50 ms for the whole run (clocks.csv
# in logs.tgz, UTC): the products run near the power limit, so a kernel's
# time depends on the clock the device holds while it runs. Tests that
# log "window:" lines can be read against it.
smi_pid=
if command -v nvidia-smi >/dev/null; then
  TZ=UTC nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,nounits -lms 50 \
    >"$LOGS/clocks.csv" 2>/dev/null &
  smi_pid=$!
  # Stopped however the run ends (a timeout's TERM included).
  trap 'kill "$smi_pid" 2>/dev/null' EXIT
  trap 'exit 143' TERM INT
fi

rows=()
figures=()
pkg_json=()
status=0
skip_args=()
[[ -n "${GPU_TEST_SKIP:-}" ]] && skip_args=(-test.skip "$GPU_TEST_SKIP")

# run_binary PKG NAME FILTER TIMEOUT: runs PKG's test binary from its
# folder with -test.run FILTER ("" = all) under -test.timeout TIMEOUT,
# logging to $LOGS/NAME.* (NAME's slashes as underscores), and adds its
# row, counts and figures.
run_binary() {
  local pkg=$1 n=$2 filter=$3 timeout=$4
  local log="$LOGS/$(name_of "$2")"
  local test_bin="$bin_dir/$(name_of "$pkg").test"
  if [[ ! -x "$test_bin" ]]; then
    echo "== $n: $test_bin missing (run scripts/gpu-test.sh build first)"
    rows+=("$n|missing|0|0|0|0")
    status=1
    return
  fi
  local run_args=()
  [[ -n "$filter" ]] && run_args=(-test.run "$filter")
  echo "== $n ${filter:+(-test.run $filter)}"
  local start rc secs
  start=$(date +%s%N)
  (cd "$root/$pkg" && "$test_bin" -test.v=test2json -test.timeout="$timeout" -test.count=1 "${run_args[@]}" "${skip_args[@]}") >"$log.log" 2>&1
  rc=$?
  secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.2f", (b - a) / 1e9 }')
  if [[ -x "$bin_dir/test2json" ]]; then
    "$bin_dir/test2json" -t -p "$pkg" <"$log.log" >"$log.json"
  fi
  # The log with test2json's framing bytes removed: failures first, then
  # the tail.
  tr -d '\026' <"$log.log" >"$log.txt"
  grep -B2 -A8 -- '--- FAIL' "$log.txt" | head -n 80
  grep -v '^=== \(RUN\|PAUSE\|CONT\|NAME\)' "$log.txt" | tail -n 25
  local pass fail skip result=ok
  # A log that could not be written counts nothing (and the row fails),
  # so summary.json stays valid JSON.
  pass=$(grep -c -- '--- PASS' "$log.txt" 2>/dev/null) || pass=${pass:-0}
  fail=$(grep -c -- '--- FAIL' "$log.txt" 2>/dev/null) || fail=${fail:-0}
  skip=$(grep -c -- '--- SKIP' "$log.txt" 2>/dev/null) || skip=${skip:-0}
  if [[ $rc -ne 0 ]]; then result="FAIL($rc)"; status=1; fi
  rows+=("$n|$result|$pass|$fail|$skip|$secs")
  # Each binary's counts and the logs so far as soon as it ends, so that
  # a run cut short (by a device's time limit, say) still brings them back.
  echo "-- $n: $result, $pass passed, $fail failed, $skip skipped, $secs s"
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
  pkg_json+=("{\"package\":\"$n\",\"exit\":$rc,\"passed\":$pass,\"failed\":$fail,\"skipped\":$skip,\"seconds\":${secs:-0}}")
  local line
  while IFS= read -r line; do
    figures+=("$line")
  done < <(sed -n 's/.*figure: \(.*\) = \([^ ]*\) \(.*\)$/\1|\2|\3/p' "$log.txt")
  echo
}

while IFS='|' read -r pkg filter; do
  [[ -z "$pkg" ]] && continue
  if [[ -n "${GPU_TEST_PACKAGES:-}" ]] && ! [[ "$pkg" =~ ^(${GPU_TEST_PACKAGES})$ ]]; then
    continue
  fi
  [[ -n "${GPU_TEST_RUN:-}" ]] && filter=$GPU_TEST_RUN
  run_binary "$pkg" "$pkg" "$filter" "${GPU_TEST_TIMEOUT:-420s}"
done <"$BIN/packages.txt"

# The kernels/dev labs LABS names (kernels/dev/README.md), each in a
# backend/cuda test process of its own, so that a lab kernel that faults
# or hangs (bounded by LAB_TIMEOUT, default 300s) takes no other lab with
# it: entries "TESTS:VARIANTS" separated by spaces, TESTS a -test.run
# regexp of backend/cuda's tests, VARIANTS the MKTRAIN_GG_VARIANTS they
# get; LABS=pending runs the ones waiting for a GPU (PENDING_LABS, empty
# when none is). A lab that might hang goes last and alone: it holds its
# process until LAB_TIMEOUT.
PENDING_LABS=""
labs=${LABS:-}
if [[ "$labs" == pending ]]; then
  labs=$PENDING_LABS
  [[ -z "${labs//[[:space:]]/}" ]] && echo "LABS=pending: no lab is waiting for a GPU (PENDING_LABS is empty); none run"
fi
variants_before=$MKTRAIN_GG_VARIANTS
for lab in $labs; do
  tests=${lab%%:*}
  variants=${lab#*:}
  [[ "$lab" == *:* ]] || variants=
  export MKTRAIN_GG_VARIANTS=$variants
  # Named by its tests and variants: one test may run in several processes.
  run_binary backend/cuda "lab-${tests//|/+}${variants:+-${variants//,/+}}" "^(${tests})\$" "${LAB_TIMEOUT:-300s}"
done
export MKTRAIN_GG_VARIANTS=$variants_before

# The training benchmark and its PyTorch peer, in the same command on the
# same machine, so their ratio means something.
bench_tps=null
peer_tps=null
det_tps=null
det_rc=-
bench_rc=-
peer_rc=-
if [[ "${NO_BENCH:-}" != 1 && "${NO_TRAIN:-}" != 1 ]]; then
  echo "== mktrain ${BENCH_ARGS[*]}"
  if [[ -x "$BIN/mktrain" ]]; then
    timeout 150 "$BIN/mktrain" "${BENCH_ARGS[@]}" --trace "$LOGS/trace.json" --out "$LOGS/bench" >"$LOGS/bench.log" 2>&1
    bench_rc=$?
    "$PY" -c 'import json,sys; e=json.load(open(sys.argv[1])); e=e.get("traceEvents", e); print("  trace: %d events" % len(e))' "$LOGS/trace.json" 2>&1 | tail -n 1
    tail -n 15 "$LOGS/bench.log"
    if f=$(ls "$LOGS"/bench/train-*.json 2>/dev/null | head -n 1) && [[ -n "$f" ]]; then
      cp "$f" "$OUT/train-moe-small.json"
      bench_tps=$(sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' "$f" | head -n 1)
      bench_tps=${bench_tps:-null}
    fi
    [[ $bench_rc -ne 0 ]] && status=1
    if [[ "${NO_DET:-}" != 1 ]]; then
      echo "== mktrain ${BENCH_ARGS[*]} --set train.deterministic=true"
      timeout 150 "$BIN/mktrain" "${BENCH_ARGS[@]}" --set train.deterministic=true --out "$LOGS/bench-det" >"$LOGS/bench-det.log" 2>&1
      det_rc=$?
      tail -n 4 "$LOGS/bench-det.log"
      if f=$(ls "$LOGS"/bench-det/train-*.json 2>/dev/null | head -n 1) && [[ -n "$f" ]]; then
        det_tps=$(sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' "$f" | head -n 1)
        det_tps=${det_tps:-null}
      fi
      [[ $det_rc -ne 0 ]] && status=1
    fi
  else
    echo "$BIN/mktrain missing (run scripts/gpu-test.sh build first)"
    bench_rc=missing
    status=1
  fi
  echo
  echo "== peer: $PY $PEER_DIR/torch_moe_train.py ${PEER_ARGS[*]}"
  if [[ -f "$PEER_DIR/torch_moe_train.py" ]]; then
    PYTHONUNBUFFERED=1 timeout 100 "$PY" "$PEER_DIR/torch_moe_train.py" "${PEER_ARGS[@]}" >"$LOGS/peer.log" 2>&1
    peer_rc=$?
    tail -n 5 "$LOGS/peer.log"
    peer_tps=$(grep '^{' "$LOGS/peer.log" | tail -n 1 | sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p')
    peer_tps=${peer_tps:-null}
    wrap_result peer-moe-small peer-train "$PY $PEER_DIR/torch_moe_train.py ${PEER_ARGS[*]}" "$LOGS/peer.log"
  else
    echo "peer script missing: $PEER_DIR/torch_moe_train.py"
    peer_rc=missing
  fi
  echo
fi

# moe-fine and its peer (FINE=1): the fine-grained model's tokens/s and
# peak memory against PyTorch's, in the same command; then moe-large.
fine_rc=-
fine_peer_rc=-
large_rc=-
# bench_recipe NAME SECONDS STEPS WARMUP [PROFILE]: bench train NAME on
# CUDA, its result as $OUT/train-NAME.json; PROFILE "profile" adds the
# profiled step's breakdown (two steps more). The exit status is
# bench_recipe's.
bench_recipe() {
  local profile=--profile=false
  [[ "${5:-}" == profile ]] && profile=--profile=true
  local args=(bench train "$1" --steps "$3" --warmup "$4" "$profile" --set data.train= --set data.val= --set train.backend=cuda)
  echo "== mktrain ${args[*]}"
  timeout "$2" "$BIN/mktrain" "${args[@]}" --out "$LOGS/bench-$1" >"$LOGS/bench-$1.log" 2>&1
  local rc=$?
  tail -n 4 "$LOGS/bench-$1.log"
  if f=$(ls "$LOGS/bench-$1"/train-*.json 2>/dev/null | head -n 1) && [[ -n "$f" ]]; then
    cp "$f" "$OUT/train-$1.json"
  fi
  return $rc
}
if [[ "${NO_BENCH:-}" != 1 && "${FINE:-}" == 1 && -x "$BIN/mktrain" ]]; then
  bench_recipe moe-fine 300 4 2 profile
  fine_rc=$?
  [[ $fine_rc -ne 0 ]] && status=1
  fine_peer=(--steps 4 --warmup 2 --dim 2048 --experts 64 --topk 6 --ffn 1408 --batch 4)
  echo "== peer: $PY $PEER_DIR/torch_moe_train.py ${fine_peer[*]}"
  PYTHONUNBUFFERED=1 timeout 200 "$PY" "$PEER_DIR/torch_moe_train.py" "${fine_peer[@]}" >"$LOGS/peer-fine.log" 2>&1
  fine_peer_rc=$?
  tail -n 3 "$LOGS/peer-fine.log"
  wrap_result peer-moe-fine peer-train "$PY $PEER_DIR/torch_moe_train.py ${fine_peer[*]}" "$LOGS/peer-fine.log"
  if [[ "${NO_LARGE:-}" != 1 ]]; then
    bench_recipe moe-large 400 3 1
    large_rc=$?
    [[ $large_rc -ne 0 ]] && status=1
  fi
  echo
fi

# A recipe too big for the GPU is refused by the memory plan before
# anything is allocated: exit 2 with a sentence, within seconds.
refuse_rc=-
if [[ "${NO_BENCH:-}" != 1 && -x "$BIN/mktrain" ]]; then
  echo "== mktrain run moe-small with 512 sequences a micro-batch (must be refused)"
  RD=$(mktemp -d)
  start=$(date +%s.%N)
  timeout 120 "$BIN/mktrain" run moe-small --run-dir "$RD" --set train.backend=cuda --set train.global_batch=512 \
    --set train.micro_batch=512 --set data.train= --set data.val= --set log.progress=off >"$LOGS/refuse.log" 2>&1
  refuse_rc=$?
  secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
  tail -n 2 "$LOGS/refuse.log"
  echo "  exit $refuse_rc after $secs s"
  [[ $refuse_rc -ne 2 ]] && status=1
  "$BIN/mktrain" plan moe-fine --set train.backend=cuda 2>&1 | tail -n 6
  rm -rf "$RD"
  echo
fi

# Parallel layouts: moe-small's per-rank shape (8 sequences of 2048 tokens
# a rank; 16 sequences under cp=2, whose ranks hold half of each) at world
# sizes 1, 2 and 4, each with its breakdown (with one rank per GPU, rank
# 0's, communication included); layouts.json gathers them. The engine
# gives each rank a GPU of its own where the machine has enough, else runs
# virtual ranks of the one GPU; with several GPUs the ep layouts also run
# under the fused dispatcher (auto keeps them unfused there).
if [[ "${NO_BENCH:-}" != 1 && "${NO_LAYOUTS:-}" != 1 && -x "$BIN/mktrain" ]]; then
  echo "== parallel layouts (${NGPU:-0} GPUs: one rank per GPU where they suffice, else virtual ranks)"
  mkdir -p "$LOGS/layouts"
  layouts=("w2_ep2|ep=2|16|8" "w2_dp2|dp=2|16|8" "w2_cp2|cp=2|16|16"
           "w4_ep4|ep=4|32|8" "w4_dp2_ep2|dp=2 ep=2|32|8" "w4_dp2_cp2|dp=2 cp=2|32|16")
  [[ "${NGPU:-0}" -ge 2 ]] && layouts+=("w2_ep2_fused|ep=2|16|8|fused")
  [[ "${NGPU:-0}" -ge 4 ]] && layouts+=("w4_ep4_fused|ep=4|32|8|fused")
  for layout in "${layouts[@]}"; do
    IFS='|' read -r name dims global micro dispatcher <<<"$layout"
    sets=()
    for d in $dims; do sets+=(--set "parallel.$d"); done
    [[ -n "$dispatcher" ]] && sets+=(--set "model.moe.dispatcher=$dispatcher")
    timeout 120 "$BIN/mktrain" "${BENCH_ARGS[@]}" --steps 4 --warmup 2 "${sets[@]}" \
      --set train.global_batch="$global" --set train.micro_batch="$micro" --out "$LOGS/layouts/$name" >"$LOGS/layouts/$name.log" 2>&1
    rc=$?
    echo "  $name (${dims}): exit $rc"
    [[ $rc -ne 0 ]] && { tail -n 5 "$LOGS/layouts/$name.log"; status=1; }
  done
  "$PY" - "$LOGS/layouts" "$OUT/train-moe-small.json" "$COMMIT" "$RUN_DATE" "$(machine_json)" >"$OUT/layouts.json" <<'PYEOF'
import glob, json, os, sys
root, main, commit, date, machine = sys.argv[1:6]
runs = [("w1", main)] + [(os.path.basename(d), f) for d in sorted(glob.glob(root + "/*")) if os.path.isdir(d)
                         for f in glob.glob(d + "/train-*.json")[:1]]
out = []
for name, f in runs:
    try:
        r = json.load(open(f))
    except OSError:
        continue
    fig, par = r["figures"], r["config"]["Parallel"]
    out.append({"layout": name, "dp": par["DP"], "ep": par["EP"], "cp": par["CP"], "ranks": fig["ranks"],
                "dispatcher": r["config"].get("Model", {}).get("MoE", {}).get("Dispatcher"),
                "tokens_per_step": fig["tokens_per_step"], "step_ms": fig["step_ms_median"],
                "tokens_per_s": fig["tokens_per_s"], "peak_memory_bytes": fig.get("peak_memory_bytes"),
                "breakdown": fig.get("breakdown"), "commit": r["commit"], "command": r["command"]})
json.dump({"benchmark": "layouts", "commit": commit, "date": date,
           "command": "mktrain bench train moe-small --steps 4 --warmup 2 per layout (scripts/gpu-test.sh)",
           "machine": json.loads(machine), "layouts": out}, sys.stdout, indent=1)
PYEOF
  "$PY" - "$OUT/layouts.json" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))["layouts"]
print("  %-12s %5s %9s %11s %12s   %s" % ("layout", "ranks", "step ms", "tokens/s", "tok/s/rank", "largest shares"))
for r in rows:
    top = ", ".join("%s %.0f%%" % (k["kind"], 100 * k["share"]) for k in (r["breakdown"] or [])[:3])
    print("  %-12s %5d %9.1f %11.0f %12.0f   %s" % (r["layout"], r["ranks"], r["step_ms"], r["tokens_per_s"],
                                                   r["tokens_per_s"] / r["ranks"], top))
PYEOF
  echo
fi

# One MoE layer on W = 1, 2, 4, 8 virtual expert-parallel ranks, with the
# unfused path's phases (mktrain bench moe): moe.json.
if [[ "${NO_BENCH:-}" != 1 && "${NO_MOE:-}" != 1 && -x "$BIN/mktrain" ]]; then
  echo "== mktrain bench moe (one layer, virtual expert-parallel ranks)"
  mkdir -p "$LOGS/moe"
  timeout 240 "$BIN/mktrain" bench moe --shape moe-small,fine --world 1,2,4,8 --steps 5 --warmup 2 --backend cuda \
    --out "$LOGS/moe" >"$LOGS/moe.log" 2>&1
  rc=$?
  grep -v '^wrote ' "$LOGS/moe.log" | tail -n 14
  [[ $rc -ne 0 ]] && { echo "  bench moe: exit $rc"; status=1; }
  [[ -f "$LOGS/moe/moe.json" ]] && cp "$LOGS/moe/moe.json" "$OUT/moe.json"
  echo
fi

# gpu_worlds: the worlds of 2, 4 and 8 GPUs this machine has, as a
# comma-separated list (the --gpus runs' --tp and --ring-world).
gpu_worlds() {
  local ws=2 w
  for w in 4 8; do [[ $w -le ${NGPU:-0} ]] && ws+=",$w"; done
  echo "$ws"
}

# bench_kernels NAME TIMEOUT ARGS...: one `mktrain bench kernels` run (the
# fused MoE layer against the unfused one and the grouped products alone),
# its log and JSON under $LOGS/NAME, the JSON copied to $OUT/NAME.json.
bench_kernels() {
  local name=$1 limit=$2
  shift 2
  mkdir -p "$LOGS/$name"
  MKTRAIN_CACHE_DIR="$LOGS/$name" timeout "$limit" "$BIN/mktrain" bench kernels --shape moe-small,fine --iters 15 \
    --backend cuda --out "$LOGS/$name" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  grep -v '^wrote ' "$LOGS/$name.log" | tail -n 24
  [[ $rc -ne 0 ]] && { echo "  bench kernels $*: exit $rc"; status=1; }
  local f
  f=$(ls "$LOGS/$name"/kernels*.json 2>/dev/null | head -n 1)
  [[ -n "$f" ]] && cp "$f" "$OUT/$name.json"
  echo
}

# W = 1, 2, 4, 8 virtual ranks of the one GPU: kernels.json; and, where the
# machine has several GPUs, one rank per GPU (--gpus: NCCL groups with peer
# access, the fused kernels reaching the peers' rows over NVLink):
# kernels-gpus.json.
if [[ "${NO_BENCH:-}" != 1 && "${NO_KERNELS:-}" != 1 && -x "$BIN/mktrain" ]]; then
  echo "== mktrain bench kernels (fused vs unfused MoE layer)"
  bench_kernels kernels 300 --world 1,2,4,8
    if [[ "${NGPU:-0}" -ge 2 ]]; then
    worlds=1,$(gpu_worlds)
    echo "== mktrain bench kernels --gpus (world $worlds, one rank per GPU)"
    bench_kernels kernels-gpus 400 --gpus --world "$worlds"
  fi
fi

# The attention core against PyTorch SDPA (cuDNN and flash, run by mktrain
# as a child process in the same command) and context-parallel attention
# on W = 2, 4, 8 virtual ranks against the core on the whole sequence:
# attention.json, its headline ratios in the table at the end.
attn_rc=-
if [[ "${NO_BENCH:-}" != 1 && "${NO_ATTENTION:-}" != 1 && -x "$BIN/mktrain" ]]; then
  echo "== mktrain bench attention --peer $PY (core vs SDPA; ring on virtual ranks)"
  mkdir -p "$LOGS/attention"
  timeout 420 "$BIN/mktrain" bench attention --backend cuda --peer "$PY" --peer-script "$PEER_DIR/attention_peer.py" \
    --out "$LOGS/attention" >"$LOGS/attention.log" 2>&1
  attn_rc=$?
  grep -v '^wrote \|^attention_peer: \|^bench attention: ' "$LOGS/attention.log" | tail -n 24
  [[ $attn_rc -ne 0 ]] && { echo "  bench attention: exit $attn_rc"; grep '^attention_peer: error\|^mktrain:' "$LOGS/attention.log" | tail -n 3; status=1; }
  [[ -f "$LOGS/attention/attention.json" ]] && cp "$LOGS/attention/attention.json" "$OUT/attention.json"
  echo
  # Where the machine has several GPUs, the ring rows on one rank per GPU
  # (--gpus: NCCL groups with peer access, the fused ring reading the
  # peers' k and v over NVLink; the core row on GPU 0):
  # attention-gpus.json.
  if [[ "${NGPU:-0}" -ge 2 ]]; then
    ws=$(gpu_worlds)
    echo "== mktrain bench attention --gpus (ring at W $ws, one rank per GPU)"
    mkdir -p "$LOGS/attention-gpus"
    timeout 420 "$BIN/mktrain" bench attention --backend cuda --gpus --shapes moe-small --ring-world "$ws" \
      --out "$LOGS/attention-gpus" >"$LOGS/attention-gpus.log" 2>&1
    attg_rc=$?
    grep -v '^wrote \|^bench attention: ' "$LOGS/attention-gpus.log" | tail -n 14
    [[ $attg_rc -ne 0 ]] && { echo "  bench attention --gpus: exit $attg_rc"; status=1; }
    [[ -f "$LOGS/attention-gpus/attention-gpus.json" ]] && cp "$LOGS/attention-gpus/attention-gpus.json" "$OUT/attention-gpus.json"
    echo
  fi
fi

# Tensor parallelism's patterns on tp virtual ranks, unfused and fused:
# tp.json, its rows and bars in the table at the end.
tp_rc=-
if [[ "${NO_BENCH:-}" != 1 && "${NO_TP:-}" != 1 && -x "$BIN/mktrain" ]]; then
  echo "== mktrain bench tp (unfused and fused patterns; virtual ranks)"
  mkdir -p "$LOGS/tp"
  timeout 420 "$BIN/mktrain" bench tp --backend cuda --iters 5 --out "$LOGS/tp" >"$LOGS/tp.log" 2>&1
  tp_rc=$?
  tail -n 30 "$LOGS/tp.log"
  [[ $tp_rc -ne 0 ]] && { echo "  bench tp: exit $tp_rc"; status=1; }
  [[ -f "$LOGS/tp/tp.json" ]] && cp "$LOGS/tp/tp.json" "$OUT/tp.json"
  echo
  # Where the machine has several GPUs, one rank per GPU (--gpus: NCCL
  # groups with peer access, the fused kernels reaching the peers' rows
  # over NVLink): tp-gpus.json.
  if [[ "${NGPU:-0}" -ge 2 ]]; then
    tps=$(gpu_worlds)
    echo "== mktrain bench tp --gpus (tp $tps, one rank per GPU)"
    mkdir -p "$LOGS/tp-gpus"
    timeout 420 "$BIN/mktrain" bench tp --backend cuda --gpus --tp "$tps" --iters 5 --out "$LOGS/tp-gpus" >"$LOGS/tp-gpus.log" 2>&1
    tpg_rc=$?
    tail -n 30 "$LOGS/tp-gpus.log"
    [[ $tpg_rc -ne 0 ]] && { echo "  bench tp --gpus: exit $tpg_rc"; status=1; }
    [[ -f "$LOGS/tp-gpus/tp-gpus.json" ]] && cp "$LOGS/tp-gpus/tp-gpus.json" "$OUT/tp-gpus.json"
    echo
  fi
fi

# The PyTorch kernel peer (dense GEMM, torch._grouped_mm, SDPA), for the
# kernel figures the tests log: peer-kernels.json. Only with PEER_KERNELS=1.
if [[ "${PEER_KERNELS:-}" == 1 && -f "$PEER_DIR/torch_kernels.py" ]]; then
  echo "== peer kernels: $PEER_DIR/torch_kernels.py"
  timeout 180 "$PY" "$PEER_DIR/torch_kernels.py" >"$LOGS/peer_kernels.out" 2>"$LOGS/peer_kernels.log"
  echo "  exit $?"
  wrap_result peer-kernels peer-kernels "$PY $PEER_DIR/torch_kernels.py" "$LOGS/peer_kernels.out"
  grep -o '"grouped_mm[^,]*' "$LOGS/peer_kernels.out" | sed 's/^/  /'
  echo
fi

# The Hugging Face check: a short CPU run of the tiny recipe, exported in
# fp32, must give transformers' MixtralForCausalLM the loss mktrain computes.
hf_rc=-
hf_tok_rc=-
if [[ "${NO_HF:-}" != 1 && -x "$BIN/mktrain" ]]; then
  echo "== Hugging Face check (scripts/hf_check.py)"
  HFD=$(mktemp -d)
  {
    "$BIN/mktrain" run tiny --run-dir "$HFD/run" --set train.steps=60 --set train.backend=cpu --set log.progress=off &&
    "$BIN/mktrain" data prepare --out "$HFD/data" --val-fraction 0.5 'engine/*.go' &&
    "$BIN/mktrain" export --format hf --dtype fp32 "$HFD/run" "$HFD/hf" &&
    "$BIN/mktrain" eval --checkpoint "$HFD/run" --data "$HFD/data/val_*.bin" --batches 4 --json >"$HFD/eval.json" &&
    "$PY" scripts/hf_check.py "$HFD/hf" --mktrain-json "$HFD/eval.json" >"$HFD/hf_check.json"
  } >"$LOGS/hf.log" 2>&1
  hf_rc=$?
  tail -n 3 "$LOGS/hf.log"
  cat "$HFD/eval.json" "$HFD/hf_check.json" 2>/dev/null
  [[ -s "$HFD/hf_check.json" ]] && wrap_result hf-check hf-check \
    "scripts/hf_check.py on a 60-step CPU run of tiny, exported in fp32 (scripts/gpu-test.sh)" "$HFD/hf_check.json"
  [[ $hf_rc -ne 0 ]] && status=1
  rm -rf "$HFD"
  echo
  # With a tokenizer: a CPU run of tiny (its 300 steps) on shards made
  # with the Llama 2 style fixture, exported; transformers loads the
  # export with AutoTokenizer and its greedy continuations of three
  # prompts must equal mktrain sample's.
  echo "== Hugging Face tokenizer check (scripts/hf_tokenizer_check.py)"
  HFD=$(mktemp -d)
  TOK=tokenizer/testdata/llama2.json
  PROMPTS=("The run directory" "func (e *Engine) Run(ctx" "Checkpoints are")
  {
    "$BIN/mktrain" data prepare --tokenizer "$TOK" --out "$HFD/data" --val-fraction 0.1 README.md 'docs/*.md' 'engine/*.go' &&
    "$BIN/mktrain" run tiny --run-dir "$HFD/run" --set train.backend=cpu --set log.progress=off \
      --set model.vocab=4096 --set data.tokenizer="$TOK" --set "data.train=$HFD/data/train_*.bin" --set "data.val=$HFD/data/val_*.bin" &&
    "$BIN/mktrain" export --format hf --dtype fp32 "$HFD/run" "$HFD/hf" && {
      check_args=()
      sampled=1
      for i in "${!PROMPTS[@]}"; do
        "$BIN/mktrain" sample --checkpoint "$HFD/run" --prompt "${PROMPTS[$i]}" --tokens 24 --temperature 0 >"$HFD/sample$i.txt" || sampled=0
        check_args+=(--prompt "${PROMPTS[$i]}" --mktrain-sample "$HFD/sample$i.txt")
      done
      [[ $sampled == 1 ]] && "$PY" scripts/hf_tokenizer_check.py "$HFD/hf" "${check_args[@]}" --tokens 24 \
        --texts tokenizer/testdata/texts.json >"$HFD/hf_tokenizer_check.json"
    }
  } >"$LOGS/hf_tokenizer.log" 2>&1
  hf_tok_rc=$?
  tail -n 3 "$LOGS/hf_tokenizer.log"
  cat "$HFD/hf_tokenizer_check.json" 2>/dev/null
  [[ -s "$HFD/hf_tokenizer_check.json" ]] && wrap_result hf-tokenizer-check hf-tokenizer-check \
    "scripts/hf_tokenizer_check.py on a 300-step CPU run of tiny with tokenizer/testdata/llama2.json, exported in fp32, three prompts (scripts/gpu-test.sh)" "$HFD/hf_tokenizer_check.json"
  [[ $hf_tok_rc -ne 0 ]] && status=1
  rm -rf "$HFD"
  echo
fi

# data prepare's speed in MB of text per second per core beside the Rust
# tokenizers library's, both on every core of this machine. Only with
# PREPARE_BENCH=1.
if [[ "${PREPARE_BENCH:-}" == 1 && -x "$BIN/mktrain" ]]; then
  echo "== mktrain bench prepare beside scripts/peer/tokenize_peer.py"
  PD=$(mktemp -d)
  "$PY" - "$PD/corpus.jsonl" <<'PYEOF'
import glob, json, sys
with open(sys.argv[1], "w") as f:
    for p in sorted(glob.glob("**/*.go", recursive=True) + glob.glob("**/*.md", recursive=True)):
        f.write(json.dumps({"text": open(p, encoding="utf-8", errors="replace").read()}) + "\n")
PYEOF
  for tok in gpt2 llama2; do
    timeout 600 "$PY" "$PEER_DIR/tokenize_peer.py" --tokenizer "tokenizer/testdata/$tok.json" --processes "$(nproc)" \
      "$PD/corpus.jsonl" >"$PD/peer-$tok.json" 2>"$LOGS/tokenize_peer_$tok.log"
    echo "  peer ($tok): exit $?"
    peer_flag=()
    [[ -s "$PD/peer-$tok.json" ]] && peer_flag=(--peer-json "$PD/peer-$tok.json")
    timeout 600 "$BIN/mktrain" bench prepare --tokenizer "tokenizer/testdata/$tok.json" --cores "$(nproc)" \
      "${peer_flag[@]}" --out "$OUT" "$PD/corpus.jsonl" 2>&1 | tee "$LOGS/bench_prepare_$tok.log" | tail -n 4
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
  done
  rm -rf "$PD"
  echo
fi

[[ -n "$smi_pid" ]] && kill "$smi_pid" 2>/dev/null && smi_pid=

# The libraries' versions, as the tests log them (the GPU's description,
# the cuBLASLt cache and NCCL lines), and torch's.
first_match() { grep -rhoE "$1" "$LOGS" --include='*.txt' 2>/dev/null | head -n 1; }
sw_cuda=$(first_match 'driver (API )?[0-9]+\.[0-9]+, NVRTC' | grep -oE '[0-9]+\.[0-9]+')
sw_nvrtc=$(first_match 'NVRTC [0-9]+\.[0-9]+' | cut -d' ' -f2)
# version_code N: a library's version code (cuBLASLt's 130100, NCCL's
# 22803) as major.minor.patch, the code beside it.
version_code() { [[ -n "$1" ]] && echo "$(($1 / 10000)).$(($1 / 100 % 100)).$(($1 % 100)) ($1)"; }
sw_cublaslt=$(version_code "$(first_match 'cuBLASLt [0-9]{6}' | cut -d' ' -f2)")
sw_nccl=$(version_code "$(first_match 'NCCL version code [0-9]+' | cut -d' ' -f4)")
sw_torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
# The command, with the variables that shaped the run.
run_cmd="bash scripts/gpu-test.sh"
for v in LABS LAB_TIMEOUT NO_BENCH NO_TRAIN NO_DET FINE NO_LARGE NO_LAYOUTS NO_MOE NO_KERNELS NO_ATTENTION NO_TP NO_HF PEER_KERNELS PREPARE_BENCH MKTRAIN_GG_VARIANTS \
         GPU_TEST_PACKAGES GPU_TEST_RUN GPU_TEST_SKIP GPU_TEST_TIMEOUT; do
  [[ -n "${!v:-}" ]] && run_cmd="$v='${!v}' $run_cmd"
done

# summary.json, with plain shell quoting: names hold no quotes.
{
  printf '{"commit":%s,"date":"%s","command":%s,"machine":%s,' "$(json_str "$COMMIT")" "$RUN_DATE" "$(json_str "$run_cmd")" "$(machine_json)"
  printf '"software":{"cuda_driver_api":%s,"nvrtc":%s,"cublaslt":%s,"nccl":%s,"torch":%s},\n' \
    "$(json_str "$sw_cuda")" "$(json_str "$sw_nvrtc")" "$(json_str "$sw_cublaslt")" "$(json_str "$sw_nccl")" "$(json_str "$sw_torch")"
  echo "\"packages\":["
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
  echo "],\"bench\":{\"exit\":\"$bench_rc\",\"mktrain_tokens_per_s\":$bench_tps,\"peer_exit\":\"$peer_rc\",\"peer_tokens_per_s\":$peer_tps,\"deterministic_exit\":\"$det_rc\",\"deterministic_tokens_per_s\":$det_tps},\"attention_exit\":\"$attn_rc\",\"hf_check_exit\":\"$hf_rc\",\"hf_tokenizer_check_exit\":\"$hf_tok_rc\",\"too_big_refused_exit\":\"$refuse_rc\"}"
} >"$OUT/summary.json"
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
rm -rf "$LOGS"

echo "== figures"
for f in "${figures[@]:-}"; do
  [[ -z "$f" ]] && continue
  IFS='|' read -r fname fval funit <<<"$f"
  printf '  %-60s %10s %s\n' "$fname" "$fval" "$funit"
done
echo
echo "== summary"
printf '  %-22s %-9s %5s %5s %5s %8s\n' package result pass fail skip seconds
for r in "${rows[@]}"; do
  IFS='|' read -r p res pa fa sk se <<<"$r"
  printf '  %-22s %-9s %5s %5s %5s %8.1f\n' "$p" "$res" "$pa" "$fa" "$sk" "$se"
done
if [[ "${NO_BENCH:-}" != 1 && "${NO_TRAIN:-}" != 1 ]]; then
  echo
  echo "== moe-small training, tokens/s (same machine, same command)"
  printf '  %-28s %12s  exit %s\n' "mktrain (CUDA backend)" "$bench_tps" "$bench_rc"
  printf '  %-28s %12s  exit %s\n' "mktrain, deterministic" "$det_tps" "$det_rc"
  printf '  %-28s %12s  exit %s\n' "PyTorch peer (eager)" "$peer_tps" "$peer_rc"
  if [[ "$bench_tps" != null && "$peer_tps" != null ]]; then
    awk -v a="$bench_tps" -v b="$peer_tps" 'BEGIN { printf "  %-28s %12.3f\n", "mktrain / peer", a / b }'
  fi
  if [[ -f "$OUT/train-moe-small.json" ]]; then
    # The profiled step's breakdown, and issue 28's bar on the host's share.
    "$PY" - "$OUT/train-moe-small.json" <<'PYEOF'
import json, sys
fig = json.load(open(sys.argv[1]))["figures"]
rows = fig.get("breakdown") or []
print("  step breakdown (profiled %.1f ms): %s" % (fig.get("profiled_step_ms") or 0,
      ", ".join("%s %.2f" % (k["kind"], k["ms"]) for k in rows)))
host = sum(k["share"] for k in rows if k["kind"] in ("host gaps", "host transfers"))
print("  host gaps and transfers: %.1f%% of the profiled step (bar: under 1%%)" % (100 * host))
PYEOF
  fi
fi
if [[ "$fine_rc" != - ]]; then
  echo
  echo "== moe-fine (exit $fine_rc, peer exit $fine_peer_rc): tokens/s and peak memory against the peer's"
  if [[ -f "$OUT/train-moe-fine.json" && -f "$OUT/peer-moe-fine.json" ]]; then
    "$PY" - "$OUT/train-moe-fine.json" "$OUT/peer-moe-fine.json" <<'PYEOF'
import json, sys
m, p = json.load(open(sys.argv[1]))["figures"], json.load(open(sys.argv[2]))["figures"]
peak, peer_peak = m["peak_memory_bytes"] / 1e9, p["peak_mem_GB"]
print("  mktrain %10.0f tokens/s  peak %6.1f GB (plan %6.1f GB)" % (m["tokens_per_s"], peak, m["plan_peak_memory_bytes"] / 1e9))
print("  peer    %10.0f tokens/s  peak %6.1f GB" % (p["tokens_per_s"], peer_peak))
print("  ratio   %10.3f            peak %6.3f (bars: at least 1.4 and at most 1.0)" % (m["tokens_per_s"] / p["tokens_per_s"], peak / peer_peak))
PYEOF
  fi
  echo "== moe-large (exit $large_rc): peak memory against the plan's"
  if [[ -f "$OUT/train-moe-large.json" ]]; then
    "$PY" - "$OUT/train-moe-large.json" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))["figures"]
print("  mktrain %10.0f tokens/s  peak %6.1f GiB, plan %6.1f GiB (%+.2f%%)" % (m["tokens_per_s"], m["peak_memory_bytes"] / 2**30,
      m["plan_peak_memory_bytes"] / 2**30, 100 * (m.get("plan_peak_memory_error") or 0)))
PYEOF
  fi
fi
if [[ "$tp_rc" != - ]]; then
  echo
  echo "== tensor parallelism (bench tp, exit $tp_rc): fused / product and fused / unfused per row; the bars"
  if [[ -f "$OUT/tp.json" ]]; then
    "$PY" - "$OUT/tp.json" <<'PYEOF'
import json, sys
fig = json.load(open(sys.argv[1]))["figures"]
f = lambda v: "-" if v is None else "%.2f" % v
for r in fig["rows"]:
    print("  %-9s tp %d %-18s unfused/product %s  fused/product %s  fused/unfused %s  overlap %s" % (r["shape"], r["tp"],
          r["pattern"], f(r.get("unfused_over_product")), f(r.get("fused_over_product")), f(r.get("fused_over_unfused")),
          f(r.get("overlap_efficiency"))))
for b in fig["bars"]:
    print("  bar: %s: %s" % (b["bar"], b["verdict"]))
PYEOF
  fi
fi
if [[ "$attn_rc" != - ]]; then
  echo
  echo "== attention (bench attention, exit $attn_rc): the core / cuDNN and / flash SDPA (TFLOP/s ratios); the ring on virtual ranks"
  if [[ -f "$OUT/attention.json" ]]; then
    "$PY" - "$OUT/attention.json" <<'PYEOF'
import json, sys
fig = json.load(open(sys.argv[1]))["figures"]
f = lambda v: "-" if v is None else "%.2f" % v
t = lambda v: "-" if v is None else "%.1f" % v
print("  %-10s %-24s %15s %15s %15s %15s" % ("shape", "", "core TF f/b", "cuDNN TF f/b", "core/cuDNN f/b", "core/flash f/b"))
for r in fig["core"]:
    c = r.get("cudnn") or {}
    shape = "B%d S%d H%d KV%d Dh%d" % (r["batch"], r["seq"], r["heads"], r["kv_heads"], r["head_dim"])
    print("  %-10s %-24s %15s %15s %15s %15s" % (r["name"], shape, t(r["fwd_tflops"]) + "/" + t(r["bwd_tflops"]),
          t(c.get("fwd_tflops")) + "/" + t(c.get("bwd_tflops")), f(r["core_over_cudnn_fwd"]) + "/" + f(r["core_over_cudnn_bwd"]),
          f(r["core_over_flash_fwd"]) + "/" + f(r["core_over_flash_bwd"])))
ring = fig.get("ring")
if ring:
    print("  ring (%s; virtual ranks share one GPU): W, S/W, efficiency f/f+b (core/ring), ring/allgather f/f+b" % ring["geometry"])
    for r in ring["rows"]:
        print("    W %d  S/W %5d  eff %s/%s  r/ag %s/%s%s" % (r["world"], r["seq_per_rank"], f(r["ring_efficiency_fwd"]),
              f(r["ring_efficiency_fwd_bwd"]), f(r["ring_over_allgather_fwd"]), f(r["ring_over_allgather_fwd_bwd"]),
              "  (ring: %s)" % r["ring"]["error"] if r["ring"].get("error") else ""))
for b in fig["bars"]:
    print("  %-13s %s%s" % (b["verdict"], b["bar"], " (%s)" % b["why"] if b.get("why") else ""))
PYEOF
  else
    echo "  no attention.json"
  fi
fi
exit $status
