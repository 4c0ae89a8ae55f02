package main

// mktrain bench attention: the attention core (backend.AttentionForward and
// AttentionBackward) against PyTorch SDPA's cuDNN and flash backends, run
// in the same command (scripts/peer/attention_peer.py), with the bar the
// core is held to.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
)

const benchAttentionUsage = `Usage: mktrain bench attention [--shapes moe-small,s8k,s32k] [--ring-world 2,4,8] [--ring-seq 4096,8192] [--iters N] [--backend auto|cpu|cuda] [--peer PYTHON] [--peer-script FILE] [--gpus] [--out DIR]

Times the attention core (the backend's AttentionForward and
AttentionBackward: causal, grouped-query; q, k, v, out and dout in the
backend's operand type, bf16 on the GPU, as a layer on one rank keeps
them and as the peer takes and returns them; lse and the gradients
float32) on
fresh random inputs, after two warm-up calls, as the median of --iters
calls queued back to back, each between two marks of the device's clock
(CUDA events on the GPU), as the peer times PyTorch, with
TFLOP/s from the causal FLOP count (forward 2*2*B*H*S*S*Dh/2, backward
2.5x the forward). Shapes (B batch, S sequence, H query heads, KV
key/value heads, Dh head dim):
  moe-small  B8 S2048 H16 KV4 Dh64     (moe-small's attention)
  s8k        B2 S8192 H16 KV16 Dh128
  s32k       B1 S32768 H32 KV8 Dh128
  tiny       B2 S64 H4 KV2 Dh16        (tests)
With --peer PYTHON (e.g. /opt/torch/.venv/bin/python3) it first runs
--peer-script (default scripts/peer/attention_peer.py) under that Python
on the same shapes: PyTorch SDPA, causal, bf16, with the cuDNN and the
flash backends, timed with CUDA events; it prints the ratios core / cuDNN
and core / flash (TFLOP/s over TFLOP/s: above 1 the core is faster) and
whether the bar holds: the core at least 1.0x cuDNN SDPA, forward and
backward, on every shape. Without --peer the PyTorch columns are absent
and the bar is not measured. A peer that fails is reported (its message,
in the table and the JSON) and the command exits 1 after writing the
core's figures.

Then the ring: context-parallel attention (attention.ContextCore) on W
virtual ranks of the one device for each W of --ring-world (goroutines
over in-process groups: comm.NewLocal with cp = W), each rank holding its
zigzag rows (attention.ZigzagPositions) of one sequence of S = W * S/W
tokens, for each S/W of --ring-seq, at B1 H16 KV4 Dh128 (GQA 4:1). It
times forward and forward+backward in each mode (allgather: k and v
all-gathered, their gradients reduce-scattered; ring: k and v chunks
passed around the ranks: on virtual ranks the fused ring, whose kernels
read the peers' k and v in place, in one pass on Hopper GPUs (one kernel
per rank and direction) and in two elsewhere or under
train.deterministic; the JSON names the path), and mode ring
once more with the groups' peer access hidden, which runs the portable
ring (the path of ranks without peer access: k and v chunks passed over
Send and Recv, the backend's attention ops on each block; outside the
bars, for comparison), from before the first rank starts to after the
last ends, and the core on the whole sequence on one rank (the same
work). Every path of a row is built before any is timed; then each of
2 warm-up and --iters rounds takes one forward and one forward+backward
step of every path, the paths in the rows of a balanced order (each
path first equally often and after every other equally often), and each
figure is its path's median, so that the clocks' drift under the power
cap, and the step before's mark on them, weigh on every path alike (the
JSON's timeline gives every timed step's start and time). On virtual
ranks each step starts after a hold of at least 2 ms on the GPU (a
kernel that waits; 1.5 times the host's time queueing the path's last
step where that is longer, at most 25 ms), behind which the ranks queue their ops after their barriers, so
the times are the GPU's, not the host's queueing (the JSON gives the
longest the host took to queue a timed step, host_queue_max_ms, and how
many outlasted their hold, uncovered_steps, per row and per mode, which
the table flags by path, and each median's fastest and slowest step,
the *_ms_range pairs). q, k and v come in the type each path's
layers keep them in: bf16 for the core and the
one-pass ring, float32 for the others, whose time includes their
rounding. Ring efficiency = core time / ring time, and ring / allgather
= allgather time / ring time (above 1 the ring is faster). Bars:
efficiency at least 0.95 forward and forward+backward at S/W >= 4096, and the ring
faster than allgather at every W. The W virtual ranks share one GPU's
memory and SMs, so the figures show the cost of splitting the work, not
of links between GPUs (NVLink figures come from the multi-GPU issue,
#33). At S/W 8192 and W 8 the sequence is 65,536 tokens: about 11 GB of
float32 tensors over all ranks in allgather mode, well within an H200's
141 GB. --ring-world none leaves the ring out. A mode NewContextCore
refuses is reported and its bars are not measured. With --gpus the ring
rows run on one rank per GPU instead (W on GPUs 0..W-1, each rank's
context group an NCCL communicator with peer access between its GPUs,
as bench kernels --gpus places its ranks; the portable ring over NCCL's
Send and Recv), each rank waiting for its GPU before a step counts as
finished, against the core on GPU 0 alone: the ring's efficiency over
NVLink (the multi-GPU issue, #33).

After a row's timed rounds, on virtual ranks where mode ring is the fused
ring, one more forward+backward step of the core and one of the fused
ring run on a profiling wrapper of the backend (backend/profile): each
op between two marks of the device's clock, the step behind a hold.
The table's last lines and the row's "profile" give each op's calls and
time, their sum and the step's time (the difference is the device's
time between ops): where the ring's step spends what its kernels alone
do not account for.

Writes attention.json (attention-gpus.json with --gpus) into
bench/results/<machine>/ (the latest result
per machine, overwritten by the next run) or into the folder --out
names, with the commit, machine, command, every figure and each bar's
verdict, and prints a short table of the bars last.

Flags:
`

// attnBenchShape is one attention shape of the benchmark.
type attnBenchShape struct {
	Name    string `json:"name"`
	Batch   int    `json:"batch"`
	Seq     int    `json:"seq"`
	Heads   int    `json:"heads"`
	KVHeads int    `json:"kv_heads"`
	HeadDim int    `json:"head_dim"`
}

func attnBenchShapes() []attnBenchShape {
	return []attnBenchShape{
		{"moe-small", 8, 2048, 16, 4, 64},
		{"s8k", 2, 8192, 16, 16, 128},
		{"s32k", 1, 32768, 32, 8, 128},
		{"tiny", 2, 64, 4, 2, 16},
	}
}

func (s attnBenchShape) attn() backend.AttnShape {
	return backend.AttnShape{Batch: s.Batch, Seq: s.Seq, Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HeadDim}
}

func (s attnBenchShape) String() string {
	return fmt.Sprintf("B%d S%d H%d KV%d Dh%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim)
}

// attnForwardFLOPs is causal attention's forward work: two products of
// B*H*S*S*Dh multiply-adds, half of them masked. The backward counts 2.5
// times this (five products instead of two), for the core and the peer
// alike.
func attnForwardFLOPs(batch, seq, heads, headDim int) float64 {
	return 2 * 2 * float64(batch) * float64(heads) * float64(seq) * float64(seq) * float64(headDim) / 2
}

const attnBackwardFactor = 2.5

// tflops is the rate of flops done in ms milliseconds.
func tflops(flops, ms float64) float64 { return flops / (ms / 1e3) / 1e12 }

// The bars, as the tables and the JSON name them.
const (
	coreBar  = "core >= 1.0x cuDNN SDPA forward and backward on every shape"
	coreGoal = 1.0
)

// Verdicts of a bar.
const (
	verdictHeld        = "held"
	verdictNotHeld     = "not held"
	verdictNotMeasured = "not measured"
)

// barVerdict is a bar and whether this run held it; Why says what decided
// it (the rows that missed, or why it was not measured).
type barVerdict struct {
	Bar     string `json:"bar"`
	Verdict string `json:"verdict"`
	Why     string `json:"why,omitempty"`
}

// attnPeerRow is one (shape, backend) of the peer's output.
type attnPeerRow struct {
	Batch     int     `json:"batch"`
	Seq       int     `json:"seq"`
	Heads     int     `json:"heads"`
	KVHeads   int     `json:"kv_heads"`
	HeadDim   int     `json:"head_dim"`
	Backend   string  `json:"backend"`
	GQA       string  `json:"gqa"` // none, enable_gqa, or repeated_kv (k and v copied to every query head)
	InputSets int     `json:"input_sets"`
	FwdMS     float64 `json:"fwd_ms"`
	BwdMS     float64 `json:"bwd_ms"`
	FwdTF     float64 `json:"fwd_tflops"`
	BwdTF     float64 `json:"bwd_tflops"`
}

// attnPeerResult is what the peer script prints.
type attnPeerResult struct {
	Peer   string        `json:"peer"`
	Torch  string        `json:"torch"`
	CUDA   string        `json:"cuda"`
	CuDNN  any           `json:"cudnn"`
	Device string        `json:"device"`
	Rows   []attnPeerRow `json:"rows"`
}

// attnPeerBackends are the SDPA backends the peer times, in its column
// order.
func attnPeerBackends() []string { return []string{"cudnn", "flash"} }

// attnCoreRow is one shape: the core's figures and, with a peer, the
// peer's and the ratios (TFLOP/s over TFLOP/s; null without a peer).
type attnCoreRow struct {
	attnBenchShape
	FwdMS float64 `json:"fwd_ms"`
	BwdMS float64 `json:"bwd_ms"`
	FwdTF float64 `json:"fwd_tflops"`
	BwdTF float64 `json:"bwd_tflops"`

	CuDNN        *attnPeerRow `json:"cudnn"`
	Flash        *attnPeerRow `json:"flash"`
	OverCuDNNFwd *float64     `json:"core_over_cudnn_fwd"`
	OverCuDNNBwd *float64     `json:"core_over_cudnn_bwd"`
	OverFlashFwd *float64     `json:"core_over_flash_fwd"`
	OverFlashBwd *float64     `json:"core_over_flash_bwd"`
}

func cmdBenchAttention(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench attention", benchAttentionUsage, stderr)
	shapesFlag := fs.String("shapes", "moe-small,s8k,s32k", "comma-separated core shapes")
	iters := fs.Int("iters", 10, "timed calls of each kind (the median is kept)")
	backendName := fs.String("backend", "auto", "auto, cpu or cuda")
	peer := fs.String("peer", "", "the Python that runs the PyTorch peer (none: no peer columns)")
	peerScript := fs.String("peer-script", "scripts/peer/attention_peer.py", "the peer script --peer runs")
	ringWorldFlag := fs.String("ring-world", "2,4,8", "comma-separated numbers of context-parallel ranks (2 or more): virtual ranks, or GPUs with --gpus; or none")
	ringSeqFlag := fs.String("ring-seq", "4096,8192", "comma-separated tokens per rank (S/W, even) of the ring rows")
	onGPUs := fs.Bool("gpus", false, "the ring rows on one rank per GPU (W on GPUs 0..W-1, NCCL groups with peer access) instead of W virtual ranks of one device")
	out := fs.String("out", "", "directory for the JSON result (default bench/results/<machine>)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{"bench attention takes no positional arguments"}
	}
	if *iters < 1 {
		return usageError{"--iters must be positive"}
	}
	shapes, err := pickNamed("--shapes", *shapesFlag, attnBenchShapes(), func(s attnBenchShape) string { return s.Name })
	if err != nil {
		return err
	}
	ringWorlds, ringSeqs, err := parseRingFlags(*ringWorldFlag, *ringSeqFlag)
	if err != nil {
		return err
	}
	if *onGPUs && len(ringWorlds) == 0 {
		return usageError{"--gpus places the ring rows on GPUs, and --ring-world none leaves none"}
	}
	if *peer != "" {
		if _, err := os.Stat(*peerScript); err != nil {
			return usageError{fmt.Sprintf("--peer-script: %v", err)}
		}
	}

	// The peer first, while this process holds no GPU memory.
	var (
		peerRes *attnPeerResult
		peerErr error
	)
	if *peer != "" {
		fmt.Fprintf(stderr, "bench attention: peer: %s %s\n", *peer, *peerScript)
		peerRes, peerErr = runAttnPeer(ctx, *peer, *peerScript, shapes, *iters, stderr)
		if ctx.Err() != nil {
			return stoppedError(ctx, "bench attention stopped")
		}
		if peerErr != nil {
			fmt.Fprintf(stderr, "bench attention: the peer failed: %v\n", peerErr)
		}
	}

	b, closeB, err := openBenchBackend(*backendName)
	if err != nil {
		return err
	}
	defer closeB()
	place, closePlace, err := benchPlacer(b, *onGPUs, slices.Max(append([]int{1}, ringWorlds...)), contextMesh, "bench attention", stderr)
	if err != nil {
		return err
	}
	defer closePlace()
	fmt.Fprintf(stderr, "bench attention: on %s, 2 warm-up + %d timed calls of each kind\n", b.Name(), *iters)
	clock := profile.ClockFor(b)
	rng := rand.New(rand.NewPCG(1, 2))
	var rows []attnCoreRow
	for _, s := range shapes {
		if ctx.Err() != nil {
			return stoppedError(ctx, "bench attention stopped")
		}
		fwd, bwd, err := timeAttnCore(b, clock, rng, s, *iters)
		if err != nil {
			return failedRun(fmt.Errorf("bench attention: core at %s (%s): %w", s.Name, s, err))
		}
		runtime.GC() // the shape's device memory back to the backend
		rows = append(rows, coreRow(s, fwd, bwd, peerRes))
	}

	printAttnCore(stdout, rows, *peer, peerRes, peerErr)
	bars := []barVerdict{coreBarVerdict(rows, *peer != "", peerErr)}

	var ring *attnRingResult
	if len(ringWorlds) > 0 {
		ring = &attnRingResult{Geometry: fmt.Sprintf("B1 H%d KV%d Dh%d", ringHeads, ringKV, ringHeadDim), Ranks: "virtual ranks", Note: ringNote}
		if *onGPUs {
			ring.Ranks, ring.Note = "GPUs", ringGPUsNote
		} else if _, ok := clock.(profile.Holder); ok {
			ring.StepHoldMS, ring.StepHoldMaxMS = float64(stepHold)/1e6, float64(stepHoldMax)/1e6
		}
		for _, w := range ringWorlds {
			for _, perRank := range ringSeqs {
				if ctx.Err() != nil {
					return stoppedError(ctx, "bench attention stopped")
				}
				fmt.Fprintf(stderr, "bench attention: ring at W %d, S/W %d (S %d)\n", w, perRank, w*perRank)
				row, err := benchRingRow(b, place, *onGPUs, clock, rng, w, perRank, *iters)
				if err != nil {
					return failedRun(fmt.Errorf("bench attention: ring at W %d, S/W %d: %w", w, perRank, err))
				}
				runtime.GC()
				ring.Rows = append(ring.Rows, row)
			}
		}
		printAttnRing(stdout, ring)
		bars = append(bars, ringEfficiencyVerdict(ring.Rows), ringFasterVerdict(ring.Rows))
	}

	names := make([]string, len(shapes))
	for i, s := range shapes {
		names[i] = s.Name
	}
	figures := map[string]any{
		"core":  rows,
		"bars":  bars,
		"flops": "forward 2*2*B*H*S*S*Dh/2 (causal), backward 2.5x the forward, for the core and the peer",
		"core_timing": fmt.Sprintf("median of %d calls after 2 warm-up calls, queued back to back, each between two marks of the backend's clock (%s); fresh uniform random inputs in [-1, 1); q, k, v, out and dout of the backend's operand type (bf16 on the GPU, as a layer on one rank keeps them), float32 lse and gradients; the ring rows' core (float32 out and dout, as the context-parallel layers keep them): each step waited for before the next and started after a hold of the GPU, as the ranks' steps, in rounds that take one step of every path of the row in a balanced order (each path after every other equally often)",
			*iters, clockName(b)),
	}
	peerFig := map[string]any{"command": nil}
	if *peer != "" {
		peerFig["command"] = *peer + " " + *peerScript + " " + strings.Join(attnPeerArgs(shapes, *iters), " ")
		if peerRes != nil {
			peerFig["torch"], peerFig["cuda"], peerFig["cudnn"], peerFig["device"] = peerRes.Torch, peerRes.CUDA, peerRes.CuDNN, peerRes.Device
		}
		if peerErr != nil {
			peerFig["error"] = peerErr.Error()
		}
	}
	figures["peer"] = peerFig
	figures["ring"] = ring // null with --ring-world none
	benchmark := "attention"
	if *onGPUs { // its own file: one rank per GPU is not the virtual ranks' benchmark
		benchmark = "attention-gpus"
	}
	err = writeResult(stdout, *out, benchmark, b, benchResult{
		Benchmark: benchmark, Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: "mktrain bench attention " + strings.Join(args, " "), Machine: machine(b.Name()),
		Recipe: strings.Join(names, "+"), Config: map[string]any{"shapes": shapes, "ring_worlds": ringWorlds, "ring_seq_per_rank": ringSeqs, "iters": *iters, "peer": *peer, "gpus": *onGPUs},
		Figures: figures,
	})
	if err != nil {
		return err
	}
	printBars(stdout, bars)
	if peerErr != nil {
		return failedRun(fmt.Errorf("bench attention: the peer failed (the core's figures are written): %w", peerErr))
	}
	return nil
}

// clockName says which clock timed the core.
func clockName(b backend.Backend) string {
	if _, ok := b.(profile.ClockSource); ok {
		return "the device's stream (events)"
	}
	return "the host's monotonic clock; the backend's ops are done when they return"
}

// timeAttnCore times the core's forward and backward at s on fresh random
// inputs: the backward on the forward's output and log-sum-exp with a
// random output gradient. q, k, v, out and dout are of the backend's
// operand type, as attention.Layer keeps them on one rank (bf16 on the
// GPU, as the peer's SDPA takes and returns them); lse and the gradients
// of its float type.
func timeAttnCore(b backend.Backend, clock profile.Clock, rng *rand.Rand, s attnBenchShape, iters int) (fwd, bwd time.Duration, err error) {
	T, q, kd := s.Batch*s.Seq, s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
	ft, ot := b.FloatType(), b.OperandType()
	qTQ, kTK, vTK := randFillOf(b, ot, rng, T, q), randFillOf(b, ot, rng, T, kd), randFillOf(b, ot, rng, T, kd)
	daTQ := randFillOf(b, ot, rng, T, q)
	aTQ, lseBHS := b.New(ot, T, q), b.New(ft, s.Batch, s.Heads, s.Seq)
	dqTQ, dkTK, dvTK := b.New(ft, T, q), b.New(ft, T, kd), b.New(ft, T, kd)
	as := s.attn()
	fwd, err = medianOnClock(b, clock, iters, true, func() {
		b.AttentionForward(aTQ, lseBHS, qTQ, kTK, vTK, as)
	})
	if err != nil {
		return 0, 0, fmt.Errorf("forward: %w", err)
	}
	bwd, err = medianOnClock(b, clock, iters, true, func() {
		b.AttentionBackward(dqTQ, dkTK, dvTK, daTQ, qTQ, kTK, vTK, aTQ, lseBHS, as)
	})
	if err != nil {
		return 0, 0, fmt.Errorf("backward: %w", err)
	}
	return fwd, bwd, nil
}

// medianOnClock runs work twice untimed, then iters times, each between
// two marks of clock, and returns the median; a device failure (sticky,
// reported by Sync) is the error. Queued, the calls and marks are queued
// back to back and read at the end, as the peer times PyTorch (the device
// never waits for the host between calls); else each call's end is
// waited for before the next starts, as the ring's steps are timed.
func medianOnClock(b backend.Backend, clock profile.Clock, iters int, queued bool, work func()) (time.Duration, error) {
	for range 2 {
		work()
	}
	if err := b.Sync(); err != nil {
		return 0, err
	}
	times := make([]time.Duration, 0, iters)
	var marks []profile.Mark
	defer func() {
		for _, m := range marks {
			clock.Release(m)
		}
	}()
	// read turns the marks so far into times: one per consecutive pair
	// (each pair brackets one call), keeping the last mark as the next
	// call's start.
	read := func() error {
		for i := 1; i < len(marks); i++ {
			d, err := clock.Elapsed(marks[i-1], marks[i])
			if err != nil {
				return err
			}
			times = append(times, d)
		}
		for _, m := range marks[:len(marks)-1] {
			clock.Release(m)
		}
		marks = marks[len(marks)-1:]
		return nil
	}
	m, err := clock.Mark()
	if err != nil {
		return 0, err
	}
	marks = append(marks, m)
	for range iters {
		work()
		m, err := clock.Mark()
		if err != nil {
			return 0, err
		}
		marks = append(marks, m)
		if !queued {
			if err := read(); err != nil {
				return 0, err
			}
		}
	}
	if err := read(); err != nil {
		return 0, err
	}
	if err := b.Sync(); err != nil {
		return 0, err
	}
	slices.Sort(times)
	return times[iters/2], nil
}

// randFill is a new float tensor of the given shape with uniform values in
// [-1, 1).
func randFill(b backend.Backend, rng *rand.Rand, shape ...int) backend.Tensor {
	return randFillOf(b, b.FloatType(), rng, shape...)
}

// randFillOf is randFill in a tensor of dtype dt (values rounded to it).
func randFillOf(b backend.Backend, dt backend.DType, rng *rand.Rand, shape ...int) backend.Tensor {
	n := 1
	for _, d := range shape {
		n *= d
	}
	t := b.New(dt, shape...)
	backend.UploadSlice(b, t, randValues(rng, n))
	return t
}

// randValues is n uniform values in [-1, 1), two per draw of rng (the
// largest shapes hold 10^8 values).
func randValues(rng *rand.Rand, n int) []float32 {
	vals := make([]float32, n)
	const scale = 1.0 / (1 << 31)
	for i := 0; i < n; i += 2 {
		u := rng.Uint64()
		vals[i] = float32(float64(int32(u)) * scale)
		if i+1 < n {
			vals[i+1] = float32(float64(int32(u>>32)) * scale)
		}
	}
	return vals
}

// attnPeerArgs are the peer script's arguments for shapes.
func attnPeerArgs(shapes []attnBenchShape, iters int) []string {
	var args []string
	for _, s := range shapes {
		args = append(args, "--shape", fmt.Sprintf("%d,%d,%d,%d,%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim))
	}
	return append(args, "--iters", strconv.Itoa(iters), "--backends", strings.Join(attnPeerBackends(), ","))
}

// runAttnPeer runs the peer script under python on shapes and returns what
// it printed, checked: a row for every shape and backend. Its stderr (its
// progress) goes to ours; a failure's error ends with its last lines.
func runAttnPeer(ctx context.Context, python, script string, shapes []attnBenchShape, iters int, stderr io.Writer) (*attnPeerResult, error) {
	cmd := exec.CommandContext(ctx, python, append([]string{script}, attnPeerArgs(shapes, iters)...)...)
	var outBuf bytes.Buffer
	tail := &tailWriter{max: 2048}
	cmd.Stdout = &outBuf
	cmd.Stderr = io.MultiWriter(stderr, tail)
	if err := cmd.Run(); err != nil {
		if msg := strings.TrimSpace(tail.String()); msg != "" {
			return nil, fmt.Errorf("%s %s: %w: %s", python, script, err, lastLines(msg, 3))
		}
		return nil, fmt.Errorf("%s %s: %w", python, script, err)
	}
	var res attnPeerResult
	if err := json.Unmarshal(outBuf.Bytes(), &res); err != nil {
		return nil, fmt.Errorf("%s printed no JSON object: %w", script, err)
	}
	for _, s := range shapes {
		for _, be := range attnPeerBackends() {
			r := res.row(s, be)
			if r == nil {
				return nil, fmt.Errorf("%s printed no %s row for %s", script, be, s)
			}
			if !(r.FwdMS > 0) || !(r.BwdMS > 0) {
				return nil, fmt.Errorf("%s: %s at %s: times %v and %v ms are not positive", script, be, s, r.FwdMS, r.BwdMS)
			}
		}
	}
	return &res, nil
}

// row is the peer's row for shape s and backend be, or nil.
func (p *attnPeerResult) row(s attnBenchShape, be string) *attnPeerRow {
	if p == nil {
		return nil
	}
	for i, r := range p.Rows {
		if r.Backend == be && r.Batch == s.Batch && r.Seq == s.Seq && r.Heads == s.Heads && r.KVHeads == s.KVHeads && r.HeadDim == s.HeadDim {
			return &p.Rows[i]
		}
	}
	return nil
}

// tailWriter keeps the last max bytes written to it.
type tailWriter struct {
	max int
	buf []byte
}

func (w *tailWriter) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	if len(w.buf) > w.max {
		w.buf = w.buf[len(w.buf)-w.max:]
	}
	return len(p), nil
}

func (w *tailWriter) String() string { return string(w.buf) }

// lastLines is the last n lines of s, joined by " | ".
func lastLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// coreRow derives a shape's rates and, with the peer's figures, its
// ratios.
func coreRow(s attnBenchShape, fwd, bwd time.Duration, peer *attnPeerResult) attnCoreRow {
	flops := attnForwardFLOPs(s.Batch, s.Seq, s.Heads, s.HeadDim)
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	r := attnCoreRow{attnBenchShape: s, FwdMS: ms(fwd), BwdMS: ms(bwd)}
	r.FwdTF, r.BwdTF = tflops(flops, r.FwdMS), tflops(attnBackwardFactor*flops, r.BwdMS)
	ratio := func(core, peer float64) *float64 { v := core / peer; return &v }
	if c := peer.row(s, "cudnn"); c != nil {
		r.CuDNN, r.OverCuDNNFwd, r.OverCuDNNBwd = c, ratio(r.FwdTF, c.FwdTF), ratio(r.BwdTF, c.BwdTF)
	}
	if f := peer.row(s, "flash"); f != nil {
		r.Flash, r.OverFlashFwd, r.OverFlashBwd = f, ratio(r.FwdTF, f.FwdTF), ratio(r.BwdTF, f.BwdTF)
	}
	return r
}

// coreBarVerdict: held when every shape's core is at least coreGoal times
// cuDNN's rate, forward and backward.
func coreBarVerdict(rows []attnCoreRow, askedPeer bool, peerErr error) barVerdict {
	v := barVerdict{Bar: coreBar}
	switch {
	case !askedPeer:
		v.Verdict, v.Why = verdictNotMeasured, "no --peer: PyTorch was not run"
		return v
	case peerErr != nil:
		v.Verdict, v.Why = verdictNotMeasured, "the peer failed: "+peerErr.Error()
		return v
	}
	var missed []string
	for _, r := range rows {
		if r.OverCuDNNFwd == nil || r.OverCuDNNBwd == nil {
			v.Verdict, v.Why = verdictNotMeasured, "no cuDNN figure for "+r.Name
			return v
		}
		if *r.OverCuDNNFwd < coreGoal {
			missed = append(missed, fmt.Sprintf("%s forward %.2fx", r.Name, *r.OverCuDNNFwd))
		}
		if *r.OverCuDNNBwd < coreGoal {
			missed = append(missed, fmt.Sprintf("%s backward %.2fx", r.Name, *r.OverCuDNNBwd))
		}
	}
	if len(missed) > 0 {
		v.Verdict, v.Why = verdictNotHeld, strings.Join(missed, ", ")
		return v
	}
	v.Verdict = verdictHeld
	return v
}

func printAttnCore(w io.Writer, rows []attnCoreRow, peer string, peerRes *attnPeerResult, peerErr error) {
	fmt.Fprintln(w, "attention core: the backend's AttentionForward/AttentionBackward (q, k, v, out and dout in the operand type, bf16 on the GPU, as one rank's layers keep them; gradients float32), causal; TFLOP/s with forward 2*2*B*H*S*S*Dh/2, backward 2.5x")
	withPeer := peerRes != nil
	fmt.Fprintf(w, "%-10s %-24s | %9s %9s %8s %8s", "shape", "B S H KV Dh", "fwd ms", "bwd ms", "fwd TF", "bwd TF")
	if withPeer {
		fmt.Fprintf(w, " | %9s %8s | %9s %8s | %10s %9s | %10s %9s", "cuDNN fwd", "bwd", "flash fwd", "bwd", "/cuDNN fwd", "bwd", "/flash fwd", "bwd")
	}
	fmt.Fprintln(w)
	for _, r := range rows {
		fmt.Fprintf(w, "%-10s %-24s | %9.3f %9.3f %8.4g %8.4g", r.Name, r.attnBenchShape.String(), r.FwdMS, r.BwdMS, r.FwdTF, r.BwdTF)
		if withPeer {
			fmt.Fprintf(w, " | %9.4g %8.4g | %9.4g %8.4g | %10.3g %9.3g | %10.3g %9.3g", r.CuDNN.FwdTF, r.CuDNN.BwdTF, r.Flash.FwdTF, r.Flash.BwdTF,
				*r.OverCuDNNFwd, *r.OverCuDNNBwd, *r.OverFlashFwd, *r.OverFlashBwd)
		}
		fmt.Fprintln(w)
	}
	switch {
	case peer == "":
		fmt.Fprintln(w, "(no --peer: the PyTorch SDPA columns are absent and the bar against cuDNN is not measured)")
	case peerErr != nil:
		fmt.Fprintf(w, "(the peer failed, so the PyTorch SDPA columns are absent: %v)\n", peerErr)
	default:
		var gqa []string
		for _, r := range peerRes.Rows {
			if r.GQA == "repeated_kv" {
				gqa = append(gqa, fmt.Sprintf("%s at B%d S%d H%d KV%d Dh%d", r.Backend, r.Batch, r.Seq, r.Heads, r.KVHeads, r.HeadDim))
			}
		}
		note := "GQA through enable_gqa where KV < H"
		if len(gqa) > 0 {
			note = "k and v repeated to every query head (the backend refused enable_gqa) for " + strings.Join(gqa, ", ")
		}
		fmt.Fprintf(w, "(peer: PyTorch %s SDPA on %s, bf16, CUDA events; %s; /cuDNN and /flash: the core's TFLOP/s over the peer's)\n", peerRes.Torch, peerRes.Device, note)
	}
}

// printBars is the short table the command ends with.
func printBars(w io.Writer, bars []barVerdict) {
	fmt.Fprintln(w, "bars:")
	for _, v := range bars {
		line := fmt.Sprintf("  %-13s %s", v.Verdict, v.Bar)
		if v.Why != "" {
			line += " (" + v.Why + ")"
		}
		fmt.Fprintln(w, line)
	}
}

// The ring rows: context-parallel attention on virtual ranks of one device.

// ringKinds are the kinds of step a ring row times, by index:
// ringForward and ringForwardBackward.
var ringKinds = []string{"forward", "forward+backward"}

const (
	ringForward = iota
	ringForwardBackward
)

// ringNote is what the ring table and its JSON say about the setting.
const ringNote = "W virtual ranks share one GPU's memory and SMs (goroutines over in-process groups): the figures show the cost of splitting the work, not links between GPUs; NVLink figures come from the multi-GPU issue (#33)"

// ringGPUsNote is ringNote with one rank per GPU (--gpus).
const ringGPUsNote = "one rank per GPU (--gpus: W on GPUs 0..W-1, each rank's context group an NCCL communicator with peer access between its GPUs): the fused ring reads the peers' k and v over the links between the GPUs; the core runs on GPU 0 alone; each rank waits for its GPU before a step counts as finished"

// The ring's bars.
const (
	ringEfficiency        = 0.95
	ringEfficiencyMinSeq  = 4096 // S/W from which the efficiency bar applies
	ringEfficiencyBar     = "ring efficiency (core time / ring time) >= 0.95 forward and forward+backward at S/W >= 4096"
	ringFasterBar         = "ring faster than allgather, forward and forward+backward, at every W"
	ringModeAllGather     = attention.CPAllGather
	ringModeRing          = attention.CPRing
	ringHeads, ringKV     = 16, 4
	ringHeadDim, ringRope = 128, 1e6
)

// ringGeometry is the ring rows' shape for one sequence of seq tokens:
// B1 H16 KV4 Dh128.
func ringGeometry(seq int) attnBenchShape {
	return attnBenchShape{Name: "ring", Batch: 1, Seq: seq, Heads: ringHeads, KVHeads: ringKV, HeadDim: ringHeadDim}
}

// attnRingResult is the ring part of attention.json.
type attnRingResult struct {
	Geometry string `json:"geometry"` // B, H, KV, Dh (S per row)
	Ranks    string `json:"ranks"`    // "virtual ranks" of one device, or "GPUs" (--gpus)
	Note     string `json:"note"`
	// StepHoldMS is the shortest hold before a step's start mark
	// (stepHold, where the ranks share a device whose clock holds; else
	// 0); a path whose host took longer to queue its last step holds 1.5
	// times that, up to StepHoldMaxMS (stepHoldMax).
	StepHoldMS    float64       `json:"step_hold_ms"`
	StepHoldMaxMS float64       `json:"step_hold_max_ms"`
	Rows          []attnRingRow `json:"rows"`
}

// attnRingMode is one mode's figures at one row: medians of the time from
// before the first rank starts to after the last one ends; null when the
// mode could not be built (Error says why).
type attnRingMode struct {
	// Path is what ran the mode (attention.ContextCore.Path): on virtual
	// ranks mode ring is the fused ring.
	Path   string   `json:"path,omitempty"`
	FwdMS  *float64 `json:"fwd_ms"`
	StepMS *float64 `json:"fwd_bwd_ms"`
	FwdTF  *float64 `json:"fwd_tflops"`
	StepTF *float64 `json:"fwd_bwd_tflops"` // 3.5x the forward's FLOPs
	// FwdRangeMS and StepRangeMS are the fastest and slowest timed steps
	// (the medians' spread).
	FwdRangeMS  []float64 `json:"fwd_ms_range,omitempty"`
	StepRangeMS []float64 `json:"fwd_bwd_ms_range,omitempty"`
	// HostQueueMaxMS and UncoveredSteps are the row's (below) for this
	// mode alone.
	HostQueueMaxMS float64 `json:"host_queue_max_ms,omitempty"`
	UncoveredSteps int     `json:"uncovered_steps,omitempty"`
	Error          string  `json:"error,omitempty"`
}

// attnRingRow is one W and S/W: the core on the whole sequence (one
// rank), both modes on W ranks, and the ratios (null where a mode is
// missing).
type attnRingRow struct {
	World      int `json:"world"`
	SeqPerRank int `json:"seq_per_rank"`
	Seq        int `json:"seq"`

	CoreFwdMS  float64 `json:"core_fwd_ms"`
	CoreStepMS float64 `json:"core_fwd_bwd_ms"`
	CoreFwdTF  float64 `json:"core_fwd_tflops"`
	CoreStepTF float64 `json:"core_fwd_bwd_tflops"`
	// CoreFwdRangeMS and CoreStepRangeMS are the core's fastest and
	// slowest timed steps.
	CoreFwdRangeMS  []float64 `json:"core_fwd_ms_range"`
	CoreStepRangeMS []float64 `json:"core_fwd_bwd_ms_range"`

	AllGather attnRingMode `json:"allgather"`
	Ring      attnRingMode `json:"ring"`
	// RingPortable is mode ring on the same ranks with their groups'
	// peer access hidden: the portable ring (k and v chunks passed over
	// Send and Recv, the backend's attention ops on each block), the path
	// of ranks without peer access; for comparison, outside the bars.
	RingPortable attnRingMode `json:"ring_portable"`

	EfficiencyFwd      *float64 `json:"ring_efficiency_fwd"`     // core time / ring time
	EfficiencyStep     *float64 `json:"ring_efficiency_fwd_bwd"` // the same, forward+backward
	OverAllGatherFwd   *float64 `json:"ring_over_allgather_fwd"` // allgather time / ring time
	OverAllGatherStep  *float64 `json:"ring_over_allgather_fwd_bwd"`
	AllGatherEffFwd    *float64 `json:"allgather_efficiency_fwd"` // core time / allgather time
	AllGatherEffStep   *float64 `json:"allgather_efficiency_fwd_bwd"`
	PortableEffFwd     *float64 `json:"ring_portable_efficiency_fwd"` // core time / portable ring time
	PortableEffStep    *float64 `json:"ring_portable_efficiency_fwd_bwd"`
	EfficiencyBarApply bool     `json:"efficiency_bar_applies"` // S/W >= 4096
	// HostQueueMaxMS is the longest the host took to queue one timed
	// step of any path of the row, and UncoveredSteps how many timed
	// steps it queued for longer than their hold (their times count the
	// GPU's wait for the host); each mode has its own, and the core's are
	// CoreUncoveredSteps.
	HostQueueMaxMS     float64 `json:"host_queue_max_ms"`
	UncoveredSteps     int     `json:"uncovered_steps"`
	CoreUncoveredSteps int     `json:"core_uncovered_steps"`
	// Profile is one forward+backward step of the core and of the fused
	// ring op by op, on virtual ranks where the ring is fused (else null).
	Profile *attnRingProfile `json:"profile,omitempty"`
	// Timeline is every timed step of the row in the order it ran, to be
	// read against a log of the GPU's clocks and power over the same
	// stretch (scripts/gpu-test.sh's clocks.csv): under the power cap a
	// step's time follows the clock it ran at.
	Timeline []attnRingSample `json:"timeline"`
}

// attnRingSample is one timed step of a ring row: its path and kind, when
// the host began it (Unix time in ms, before the ranks' barrier and the
// hold) and its time.
type attnRingSample struct {
	Path        string  `json:"path"`
	Kind        string  `json:"kind"`
	StartUnixMS float64 `json:"start_unix_ms"`
	MS          float64 `json:"ms"`
}

// parseRingFlags reads --ring-world (numbers of ranks, 2 or more, or none)
// and --ring-seq (tokens per rank, positive and even: each rank holds two
// zigzag chunks of S/(2W)).
func parseRingFlags(worlds, seqs string) ([]int, []int, error) {
	if strings.TrimSpace(worlds) == "none" {
		return nil, nil, nil
	}
	ws, err := parseCounts("--ring-world", worlds, func(n int) bool { return n >= 2 }, "a number of ranks of 2 or more (or none)")
	if err != nil {
		return nil, nil, err
	}
	ss, err := parseCounts("--ring-seq", seqs, func(n int) bool { return n >= 2 && n%2 == 0 },
		"a positive even number of tokens per rank (two zigzag chunks each)")
	if err != nil {
		return nil, nil, err
	}
	return ws, ss, nil
}

// benchRingRow measures one row: W ranks of perRank tokens each, one
// sequence of S = W*perRank. The inputs are drawn once for the whole
// sequence; each rank gets its zigzag rows of them. Every path (the core
// and each mode) is built first and then timed by timeInterleaved.
func benchRingRow(b backend.Backend, place rankPlacer, ownDevices bool, clock profile.Clock, rng *rand.Rand, w, perRank, iters int) (row attnRingRow, err error) {
	seq := w * perRank
	g := ringGeometry(seq)
	qw, kd := g.Heads*g.HeadDim, g.KVHeads*g.HeadDim
	in := ringInputs{q: randValues(rng, seq*qw), k: randValues(rng, seq*kd), v: randValues(rng, seq*kd), da: randValues(rng, seq*qw)}
	row = attnRingRow{World: w, SeqPerRank: perRank, Seq: seq, EfficiencyBarApply: perRank >= ringEfficiencyMinSeq}

	paths := []*timedPath{{name: "core on the whole sequence", sample: ringCoreSampler(b, clock, g, in, !ownDevices)}}
	modes := []struct {
		mode     attention.CPMode
		portable bool
		fig      *attnRingMode
	}{{ringModeAllGather, false, &row.AllGather}, {ringModeRing, false, &row.Ring}, {ringModeRing, true, &row.RingPortable}}
	modePath := make([]*timedPath, len(modes))
	for i, m := range modes {
		name := fmt.Sprintf("mode %s", m.mode)
		if m.portable {
			name += ", portable"
		}
		sample, path, release, buildErr, err := contextSampler(b, place, ownDevices, clock, g, in, w, m.mode, m.portable)
		if err != nil {
			return row, fmt.Errorf("%s: %w", name, err)
		}
		m.fig.Path = path
		if buildErr != nil {
			m.fig.Error = buildErr.Error()
			continue
		}
		defer func() { err = errors.Join(err, release()) }()
		modePath[i] = &timedPath{name: name, sample: sample}
		paths = append(paths, modePath[i])
	}
	timeline, err := timeInterleaved(paths, ringKinds, iters)
	if err != nil {
		return row, err
	}

	flops := attnForwardFLOPs(1, seq, g.Heads, g.HeadDim)
	stepFLOPs := (1 + attnBackwardFactor) * flops
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	span := func(p *timedPath, k int) []float64 { return []float64{ms(p.spans[k][0]), ms(p.spans[k][1])} }
	row.CoreFwdMS, row.CoreStepMS = ms(paths[0].medians[0]), ms(paths[0].medians[1])
	row.CoreFwdRangeMS, row.CoreStepRangeMS = span(paths[0], 0), span(paths[0], 1)
	for _, p := range paths {
		row.HostQueueMaxMS = max(row.HostQueueMaxMS, ms(p.queue))
		row.UncoveredSteps += p.uncovered
	}
	row.CoreUncoveredSteps = paths[0].uncovered
	row.Timeline = make([]attnRingSample, len(timeline))
	for i, ts := range timeline {
		row.Timeline[i] = attnRingSample{Path: paths[ts.path].name, Kind: ringKinds[ts.kind],
			StartUnixMS: float64(ts.start.UnixMicro()) / 1e3, MS: ms(ts.d)}
	}
	row.CoreFwdTF, row.CoreStepTF = tflops(flops, row.CoreFwdMS), tflops(stepFLOPs, row.CoreStepMS)
	for i, m := range modes {
		if modePath[i] == nil {
			continue
		}
		f, s := ms(modePath[i].medians[0]), ms(modePath[i].medians[1])
		ftf, stf := tflops(flops, f), tflops(stepFLOPs, s)
		m.fig.FwdMS, m.fig.StepMS, m.fig.FwdTF, m.fig.StepTF = &f, &s, &ftf, &stf
		m.fig.FwdRangeMS, m.fig.StepRangeMS = span(modePath[i], 0), span(modePath[i], 1)
		m.fig.HostQueueMaxMS, m.fig.UncoveredSteps = ms(modePath[i].queue), modePath[i].uncovered
	}
	ratio := func(num float64, den *float64) *float64 {
		if den == nil {
			return nil
		}
		v := num / *den
		return &v
	}
	row.AllGatherEffFwd, row.AllGatherEffStep = ratio(row.CoreFwdMS, row.AllGather.FwdMS), ratio(row.CoreStepMS, row.AllGather.StepMS)
	row.EfficiencyFwd, row.EfficiencyStep = ratio(row.CoreFwdMS, row.Ring.FwdMS), ratio(row.CoreStepMS, row.Ring.StepMS)
	row.PortableEffFwd, row.PortableEffStep = ratio(row.CoreFwdMS, row.RingPortable.FwdMS), ratio(row.CoreStepMS, row.RingPortable.StepMS)
	if row.AllGather.FwdMS != nil {
		row.OverAllGatherFwd, row.OverAllGatherStep = ratio(*row.AllGather.FwdMS, row.Ring.FwdMS), ratio(*row.AllGather.StepMS, row.Ring.StepMS)
	}
	if !ownDevices && row.Ring.FwdMS != nil && strings.HasPrefix(row.Ring.Path, "fused ring") {
		if row.Profile, err = profileRingRow(b, clock, g, in, w); err != nil {
			return row, fmt.Errorf("profiled step: %w", err)
		}
	}
	return row, nil
}

// ringInputs are one sequence's q, k, v and output gradient, on the host:
// [S, H*Dh], [S, KV*Dh], [S, KV*Dh], [S, H*Dh].
type ringInputs struct{ q, k, v, da []float32 }

// upload is the rows at positions pos (all rows when pos is nil) of each
// input, as new tensors on b: q, k and v of type qkv, da of the float type.
func (in ringInputs) upload(b backend.Backend, qkv backend.DType, qw, kd int, pos []int32) (q, k, v, da backend.Tensor) {
	rows := func(dt backend.DType, src []float32, width int) backend.Tensor {
		vals := src
		if pos != nil {
			vals = make([]float32, 0, len(pos)*width)
			for _, p := range pos {
				vals = append(vals, src[int(p)*width:(int(p)+1)*width]...)
			}
		}
		t := b.New(dt, len(vals)/width, width)
		backend.UploadSlice(b, t, vals)
		return t
	}
	return rows(qkv, in.q, qw), rows(qkv, in.k, kd), rows(qkv, in.v, kd), rows(b.FloatType(), in.da, qw)
}

// ringCoreSampler is the core (the backend's attention ops) on the whole
// sequence, one step a sample, each waited for before the next and, with
// hold set on a clock that holds (profile.Holder), started after the
// hold, as oneRankStep times ranks that share the device (bench attention
// sets hold where the ring's ranks share it, so that both sides are
// timed alike); on q, k and v of the operand type, as a layer of one rank
// keeps them.
func ringCoreSampler(b backend.Backend, clock profile.Clock, g attnBenchShape, in ringInputs, hold bool) sampler {
	qw, kd, ft := g.Heads*g.HeadDim, g.KVHeads*g.HeadDim, b.FloatType()
	q, k, v, da := in.upload(b, b.OperandType(), qw, kd, nil)
	a, lse := b.New(ft, g.Seq, qw), b.New(ft, 1, g.Heads, g.Seq)
	dq, dk, dv := b.New(ft, g.Seq, qw), b.New(ft, g.Seq, kd), b.New(ft, g.Seq, kd)
	as := g.attn()
	holder, holds := clock.(profile.Holder)
	holds = holds && hold
	return func(kind int, holdFor time.Duration) (time.Duration, time.Duration, bool, error) {
		if holds {
			if err := holder.Hold(holdFor); err != nil {
				return 0, 0, false, err
			}
		}
		start, err := clock.Mark()
		if err != nil {
			return 0, 0, false, err
		}
		began := time.Now()
		b.AttentionForward(a, lse, q, k, v, as)
		if kind == ringForwardBackward {
			b.AttentionBackward(dq, dk, dv, da, q, k, v, a, lse, as)
		}
		queue := time.Since(began)
		d, err := elapsedSince(clock, start)
		if err != nil {
			return 0, 0, false, err
		}
		return d, queue, holds, b.Sync()
	}
}

// ringRank is one rank's core and tensors; device is its GPU when it has
// one of its own (--gpus).
type ringRank struct {
	core        *attention.ContextCore
	ranks       *comm.Ranks
	device      backend.Backend
	q, k, v, da backend.Tensor // this rank's zigzag rows of the inputs
	a, lse      backend.Tensor
	dq, dk, dv  backend.Tensor
}

// contextSampler builds mode on w ranks placed by place and returns its
// sampler: one step of every rank's Forward (and Backward), timed by
// oneRankStep from before the first rank starts to after the last one
// ends; on a device whose ranks share one stream, as here, that is the
// device's time from the first rank's first op to the last rank's last
// one (the ranks queue their ops behind a hold). release frees the
// world. buildErr is NewContextCore's refusal of the mode (nothing to
// time; the world is released); err a failure while building. With
// portable the cores' groups hide their peer access, so mode ring runs
// the portable ring.
func contextSampler(b backend.Backend, place rankPlacer, ownDevices bool, clock profile.Clock, g attnBenchShape, in ringInputs, w int, mode attention.CPMode, portable bool) (sample sampler, path string, release func() error, buildErr, err error) {
	world, bs, release, err := place(w)
	if err != nil {
		return nil, "", nil, nil, err
	}
	ranks, buildErr, err := buildRingRanks(world, bs, ownDevices, g, in, w, mode, portable)
	if buildErr != nil || err != nil {
		return nil, "", nil, buildErr, errors.Join(err, release())
	}
	return rankSampler(b, clock, ringSteps(ranks, false), ringSteps(ranks, true)), ranks[0].core.Path(), release, nil, nil
}

// buildRingRanks makes every rank's core for mode and uploads its zigzag
// rows of the inputs.
func buildRingRanks(world []*comm.Ranks, bs []backend.Backend, ownDevices bool, g attnBenchShape, in ringInputs, w int, mode attention.CPMode, portable bool) (ranks []*ringRank, buildErr, err error) {
	qw, kd := g.Heads*g.HeadDim, g.KVHeads*g.HeadDim
	shape := attention.Shape{Dim: qw, Heads: g.Heads, KVHeads: g.KVHeads, RopeTheta: ringRope}
	ranks = make([]*ringRank, w)
	for r := range ranks {
		b, ft := bs[r], bs[r].FloatType()
		var group comm.Group = world[r].Context
		if portable {
			group = struct{ comm.Group }{group} // no comm.PeerAccess
		}
		core, err := attention.NewContextCore(b, shape, 1, g.Seq, group, mode)
		if err != nil {
			return nil, err, nil
		}
		pos, err := attention.ZigzagPositions(g.Seq, w, group.Rank())
		if err != nil {
			return nil, nil, err
		}
		rk := &ringRank{core: core, ranks: world[r]}
		if ownDevices {
			rk.device = b
		}
		rk.q, rk.k, rk.v, rk.da = in.upload(b, core.QKVType(), qw, kd, pos)
		local := len(pos)
		rk.a, rk.lse = b.New(ft, local, qw), b.New(ft, 1, 2, g.Heads, local/2)
		rk.dq, rk.dk, rk.dv = b.New(ft, local, qw), b.New(ft, local, kd), b.New(ft, local, kd)
		ranks[r] = rk
	}
	return ranks, nil, nil
}

// ringSteps is every rank's Forward (and Backward) as a rankStep, the
// steps bracketed by the context group's barriers.
func ringSteps(ranks []*ringRank, backward bool) []rankStep {
	steps := make([]rankStep, len(ranks))
	for r, rk := range ranks {
		steps[r] = rankStep{group: rk.ranks.Context, ranks: rk.ranks, work: func() error {
			if err := rk.core.Forward(rk.a, rk.lse, rk.q, rk.k, rk.v); err != nil {
				return err
			}
			if backward {
				return rk.core.Backward(rk.dq, rk.dk, rk.dv, rk.da)
			}
			return nil
		}, device: rk.device}
	}
	return steps
}

// ringEfficiencyVerdict: held when every row at S/W >= 4096 has the ring's
// efficiency at least 0.95, forward and forward+backward.
func ringEfficiencyVerdict(rows []attnRingRow) barVerdict {
	v := barVerdict{Bar: ringEfficiencyBar}
	var missed []string
	applied := 0
	for _, r := range rows {
		if !r.EfficiencyBarApply {
			continue
		}
		if r.EfficiencyFwd == nil || r.EfficiencyStep == nil {
			v.Verdict, v.Why = verdictNotMeasured, fmt.Sprintf("mode ring at W %d: %s", r.World, r.Ring.Error)
			return v
		}
		applied++
		if *r.EfficiencyFwd < ringEfficiency {
			missed = append(missed, fmt.Sprintf("W %d S/W %d forward %.2f", r.World, r.SeqPerRank, *r.EfficiencyFwd))
		}
		if *r.EfficiencyStep < ringEfficiency {
			missed = append(missed, fmt.Sprintf("W %d S/W %d forward+backward %.2f", r.World, r.SeqPerRank, *r.EfficiencyStep))
		}
	}
	switch {
	case applied == 0:
		v.Verdict, v.Why = verdictNotMeasured, fmt.Sprintf("no row at S/W >= %d", ringEfficiencyMinSeq)
	case len(missed) > 0:
		v.Verdict, v.Why = verdictNotHeld, strings.Join(missed, ", ")
	default:
		v.Verdict = verdictHeld
	}
	return v
}

// ringFasterVerdict: held when the ring is faster than allgather at every
// row, forward and forward+backward.
func ringFasterVerdict(rows []attnRingRow) barVerdict {
	v := barVerdict{Bar: ringFasterBar}
	var missed []string
	for _, r := range rows {
		if r.OverAllGatherFwd == nil || r.OverAllGatherStep == nil {
			why := r.Ring.Error
			if why == "" {
				why = r.AllGather.Error
			}
			v.Verdict, v.Why = verdictNotMeasured, fmt.Sprintf("at W %d: %s", r.World, why)
			return v
		}
		if *r.OverAllGatherFwd <= 1 {
			missed = append(missed, fmt.Sprintf("W %d S/W %d forward %.2fx", r.World, r.SeqPerRank, *r.OverAllGatherFwd))
		}
		if *r.OverAllGatherStep <= 1 {
			missed = append(missed, fmt.Sprintf("W %d S/W %d forward+backward %.2fx", r.World, r.SeqPerRank, *r.OverAllGatherStep))
		}
	}
	if len(missed) > 0 {
		v.Verdict, v.Why = verdictNotHeld, strings.Join(missed, ", ")
		return v
	}
	v.Verdict = verdictHeld
	return v
}

func printAttnRing(w io.Writer, ring *attnRingResult) {
	fmt.Fprintf(w, "\nring: context-parallel attention on W %s, %s, one sequence of S = W * S/W tokens; ms from the first rank's start to the last rank's end\n", ring.Ranks, ring.Geometry)
	fmt.Fprintf(w, "%3s %6s %6s | %9s %9s | %9s %9s | %9s %9s | %8s %8s | %8s %8s | %9s %9s\n",
		"W", "S/W", "S", "core fwd", "f+b", "allg fwd", "f+b", "ring fwd", "f+b", "eff fwd", "f+b", "r/ag fwd", "f+b", "port fwd", "f+b")
	opt := func(p *float64, format string) string {
		if p == nil {
			return "-"
		}
		return fmt.Sprintf(format, *p)
	}
	var errs []string
	for _, r := range ring.Rows {
		fmt.Fprintf(w, "%3d %6d %6d | %9.3f %9.3f | %9s %9s | %9s %9s | %8s %8s | %8s %8s | %9s %9s\n",
			r.World, r.SeqPerRank, r.Seq, r.CoreFwdMS, r.CoreStepMS,
			opt(r.AllGather.FwdMS, "%.3f"), opt(r.AllGather.StepMS, "%.3f"), opt(r.Ring.FwdMS, "%.3f"), opt(r.Ring.StepMS, "%.3f"),
			opt(r.EfficiencyFwd, "%.2f"), opt(r.EfficiencyStep, "%.2f"), opt(r.OverAllGatherFwd, "%.2f"), opt(r.OverAllGatherStep, "%.2f"),
			opt(r.RingPortable.FwdMS, "%.3f"), opt(r.RingPortable.StepMS, "%.3f"))
		for _, m := range []attnRingMode{r.AllGather, r.Ring, r.RingPortable} {
			if m.Error != "" && !slices.Contains(errs, m.Error) {
				errs = append(errs, m.Error)
			}
		}
	}
	fmt.Fprintf(w, "(core: one rank on the whole sequence, the same work; eff: core time / ring time; r/ag: allgather time / ring time, above 1 the ring is faster; port: the portable ring on the same ranks, peer access hidden, outside the bars; %s)\n", ring.Note)
	if ring.StepHoldMS > 0 {
		var queue float64
		var over []string
		for _, r := range ring.Rows {
			queue = max(queue, r.HostQueueMaxMS)
			if r.UncoveredSteps > 0 {
				over = append(over, fmt.Sprintf("W %d S/W %d (%s)", r.World, r.SeqPerRank, uncoveredByPath(r)))
			}
		}
		fmt.Fprintf(w, "(every step of every path starts after a hold of the GPU, at least %g ms or 1.5 times the host's time queueing the path's last step, at most %g ms, behind which the host queues it, in at most %.3f ms here: the times are the GPU's, not the host's queueing)\n", ring.StepHoldMS, ring.StepHoldMaxMS, queue)
		if len(over) > 0 {
			fmt.Fprintf(w, "(the host took longer than the hold to queue some steps at %s: those steps count the GPU's wait for it)\n", strings.Join(over, ", "))
		}
	}
	printRingProfiles(w, ring.Rows)
	for _, e := range errs {
		fmt.Fprintf(w, "(not measured: %s)\n", e)
	}
}

// uncoveredByPath says how many of row r's timed steps each path queued
// for longer than their hold: "portable 11 steps, allgather 2 steps".
func uncoveredByPath(r attnRingRow) string {
	var parts []string
	for _, p := range []struct {
		name string
		n    int
	}{{"core", r.CoreUncoveredSteps}, {"allgather", r.AllGather.UncoveredSteps}, {"ring", r.Ring.UncoveredSteps}, {"portable", r.RingPortable.UncoveredSteps}} {
		if p.n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d steps", p.name, p.n))
		}
	}
	return strings.Join(parts, ", ")
}
