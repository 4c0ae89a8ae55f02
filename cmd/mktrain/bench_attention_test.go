package main

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
)

// attnResult is the part of attention.json the tests read.
type attnResult struct {
	Benchmark string `json:"benchmark"`
	Commit    string `json:"commit"`
	Command   string `json:"command"`
	Figures   struct {
		Core []attnCoreRow   `json:"core"`
		Bars []barVerdict    `json:"bars"`
		Peer map[string]any  `json:"peer"`
		Ring *attnRingResult `json:"ring"`
	} `json:"figures"`
}

// fakeAttnPeer writes a shell script that stands in for the PyTorch peer
// (run as `sh script ARGS`): it records its arguments in args.txt beside
// it and prints rows for the tiny shape at the given rates (TFLOP/s, the
// same for forward and backward), or, with fail set, an error and exit 1.
func fakeAttnPeer(t *testing.T, rate float64, fail bool) string {
	t.Helper()
	dir := t.TempDir()
	body := fmt.Sprintf("echo \"$@\" >%q\n", filepath.Join(dir, "args.txt"))
	if fail {
		body += "echo 'attention_peer: loading...' >&2\necho 'attention_peer: error: the cudnn backend of SDPA is not available for B2 S64 H4 KV2 Dh16' >&2\nexit 1\n"
	} else {
		// Times that give the rate at the tiny shape's FLOPs.
		flops := attnForwardFLOPs(2, 64, 4, 16)
		fwdMS, bwdMS := flops/rate/1e9, attnBackwardFactor*flops/rate/1e9
		var rows []string
		for _, be := range []string{"cudnn", "flash"} {
			rows = append(rows, fmt.Sprintf(`{"batch":2,"seq":64,"heads":4,"kv_heads":2,"head_dim":16,"backend":%q,"gqa":"enable_gqa","input_sets":8,"fwd_ms":%g,"bwd_ms":%g,"fwd_tflops":%g,"bwd_tflops":%g}`,
				be, fwdMS, bwdMS, rate, rate))
		}
		body += "echo 'attention_peer: timing...' >&2\ncat <<'EOF'\n" +
			`{"peer":"sdpa","torch":"2.11.0+fake","cuda":"13.0","cudnn":91000,"device":"Fake GPU","rows":[` + strings.Join(rows, ",") + "]}\nEOF\n"
	}
	return writeFile(t, filepath.Join(dir, "peer.sh"), body)
}

// TestBenchAttention runs bench attention on the CPU at the tiny shape
// without a peer: the core's times and rates are consistent, the peer
// columns absent (null), the bar not measured, and the table says so and
// ends with the bars.
func TestBenchAttention(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runCLI(t, "bench", "attention", "--shapes", "tiny", "--ring-world", "none", "--iters", "3", "--backend", "cpu", "--out", dir)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	var res attnResult
	readResult(t, dir, "attention.json", &res)
	if res.Benchmark != "attention" || res.Commit == "" || !strings.HasPrefix(res.Command, "mktrain bench attention ") {
		t.Errorf("benchmark %q, commit %q, command %q", res.Benchmark, res.Commit, res.Command)
	}
	rows := res.Figures.Core
	if len(rows) != 1 {
		t.Fatalf("core rows %+v, want one (tiny)", rows)
	}
	r := rows[0]
	if r.Name != "tiny" || r.Batch != 2 || r.Seq != 64 || r.Heads != 4 || r.KVHeads != 2 || r.HeadDim != 16 {
		t.Errorf("row shape %+v", r.attnBenchShape)
	}
	flops := 2 * 2 * 2.0 * 4 * 64 * 64 * 16 / 2
	if !(r.FwdMS > 0 && r.BwdMS > 0) || !near(r.FwdTF, flops/r.FwdMS/1e9) || !near(r.BwdTF, 2.5*flops/r.BwdMS/1e9) {
		t.Errorf("times and rates %+v", r)
	}
	if r.CuDNN != nil || r.Flash != nil || r.OverCuDNNFwd != nil || r.OverFlashBwd != nil {
		t.Errorf("peer figures without a peer: %+v", r)
	}
	if len(res.Figures.Bars) != 1 || res.Figures.Bars[0].Bar != coreBar || res.Figures.Bars[0].Verdict != verdictNotMeasured {
		t.Errorf("bars %+v, want the core bar not measured", res.Figures.Bars)
	}
	if res.Figures.Peer["command"] != nil {
		t.Errorf("peer %v without --peer", res.Figures.Peer)
	}
	if !strings.Contains(stdout, "no --peer: the PyTorch SDPA columns are absent") || strings.Contains(stdout, "cuDNN fwd") {
		t.Errorf("the table does not say the peer columns are absent:\n%s", stdout)
	}
	if !strings.HasSuffix(strings.TrimSpace(stdout), "not measured  "+coreBar+" (no --peer: PyTorch was not run)") {
		t.Errorf("stdout does not end with the bars:\n%s", stdout)
	}
}

// TestBenchAttentionPeer runs a stand-in peer: its arguments are the
// shapes and iterations, its rows fill the peer columns, the ratios are the
// core's rate over the peer's, and the bar follows them (a peer far faster
// than any core: not held; far slower: held).
func TestBenchAttentionPeer(t *testing.T) {
	for _, c := range []struct {
		rate    float64
		verdict string
	}{{1e9, verdictNotHeld}, {1e-12, verdictHeld}} {
		dir := t.TempDir()
		script := fakeAttnPeer(t, c.rate, false)
		code, stdout, stderr := runCLI(t, "bench", "attention", "--shapes", "tiny", "--ring-world", "none", "--iters", "3", "--backend", "cpu",
			"--peer", "sh", "--peer-script", script, "--out", dir)
		if code != exitOK {
			t.Fatalf("rate %g: exit %d\n%s", c.rate, code, stderr)
		}
		args, err := os.ReadFile(filepath.Join(filepath.Dir(script), "args.txt"))
		if err != nil || strings.TrimSpace(string(args)) != "--shape 2,64,4,2,16 --iters 3 --backends cudnn,flash" {
			t.Errorf("peer arguments %q (%v)", args, err)
		}
		if !strings.Contains(stderr, "attention_peer: timing...") {
			t.Errorf("the peer's stderr is not passed on:\n%s", stderr)
		}
		var res attnResult
		readResult(t, dir, "attention.json", &res)
		r := res.Figures.Core[0]
		if r.CuDNN == nil || r.Flash == nil || r.OverCuDNNFwd == nil || r.OverCuDNNBwd == nil || r.OverFlashFwd == nil || r.OverFlashBwd == nil {
			t.Fatalf("rate %g: peer figures missing: %+v", c.rate, r)
		}
		if !near(*r.OverCuDNNFwd, r.FwdTF/c.rate) || !near(*r.OverCuDNNBwd, r.BwdTF/c.rate) || !near(*r.OverFlashFwd, r.FwdTF/c.rate) || r.CuDNN.GQA != "enable_gqa" {
			t.Errorf("rate %g: ratios %v %v %v, rates %v %v", c.rate, *r.OverCuDNNFwd, *r.OverCuDNNBwd, *r.OverFlashFwd, r.FwdTF, r.BwdTF)
		}
		if v := res.Figures.Bars[0]; v.Verdict != c.verdict {
			t.Errorf("rate %g: bar %+v, want %s", c.rate, v, c.verdict)
		}
		if res.Figures.Peer["torch"] != "2.11.0+fake" || res.Figures.Peer["device"] != "Fake GPU" || !strings.Contains(fmt.Sprint(res.Figures.Peer["command"]), "--shape 2,64,4,2,16") {
			t.Errorf("peer record %v", res.Figures.Peer)
		}
		if !strings.Contains(stdout, "cuDNN fwd") || !strings.Contains(stdout, "Fake GPU") || !strings.Contains(stdout, c.verdict+" ") {
			t.Errorf("rate %g: table without the peer columns or the verdict:\n%s", c.rate, stdout)
		}
	}
}

// TestBenchAttentionPeerFails: a peer that exits non-zero makes the
// command exit 1 naming the peer's message, after writing the core's
// figures with the peer's error and the bar not measured.
func TestBenchAttentionPeerFails(t *testing.T) {
	dir := t.TempDir()
	script := fakeAttnPeer(t, 0, true)
	code, stdout, stderr := runCLI(t, "bench", "attention", "--shapes", "tiny", "--ring-world", "none", "--iters", "2", "--backend", "cpu",
		"--peer", "sh", "--peer-script", script, "--out", dir)
	if code != exitRunFailed || !strings.Contains(stderr, "cudnn backend of SDPA is not available") {
		t.Fatalf("exit %d, stderr:\n%s\nwant 1 and the peer's message", code, stderr)
	}
	var res attnResult
	readResult(t, dir, "attention.json", &res)
	if len(res.Figures.Core) != 1 || res.Figures.Core[0].FwdMS <= 0 || res.Figures.Core[0].CuDNN != nil {
		t.Errorf("core rows %+v", res.Figures.Core)
	}
	if e, _ := res.Figures.Peer["error"].(string); !strings.Contains(e, "not available") {
		t.Errorf("peer record %v, want its error", res.Figures.Peer)
	}
	if v := res.Figures.Bars[0]; v.Verdict != verdictNotMeasured || !strings.Contains(v.Why, "the peer failed") {
		t.Errorf("bar %+v", v)
	}
	if !strings.Contains(stdout, "the peer failed") {
		t.Errorf("the table does not say the peer failed:\n%s", stdout)
	}
}

// TestBenchAttentionRing runs the ring rows on the CPU at W 2 and 4 with
// 8 and 16 tokens per rank: the core on the whole sequence and each mode
// timed (mode ring twice: as the ranks' groups offer, and with their peer
// access hidden, the portable ring), the ratios from the times, and the bars (the efficiency bar has
// no row at S/W >= 4096 here). A mode NewContextCore refuses leaves its
// figures null, its reason in the row, and the ring-faster bar not
// measured.
func TestBenchAttentionRing(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runCLI(t, "bench", "attention", "--shapes", "tiny", "--ring-world", "2,4", "--ring-seq", "8,16", "--iters", "2",
		"--backend", "cpu", "--out", dir)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	var res attnResult
	readResult(t, dir, "attention.json", &res)
	ring := res.Figures.Ring
	if ring == nil || ring.Geometry != "B1 H16 KV4 Dh128" || !strings.Contains(ring.Note, "share one GPU's memory and SMs") || len(ring.Rows) != 4 {
		t.Fatalf("ring %+v", ring)
	}
	if ring.StepHoldMS != 0 {
		t.Errorf("step hold %g ms on the CPU, whose clock does not hold", ring.StepHoldMS)
	}
	ringMeasured := true
	for i, r := range ring.Rows {
		if r.HostQueueMaxMS <= 0 {
			t.Errorf("row %d: host queue %g ms, want the CPU's time in the ops", i, r.HostQueueMaxMS)
		}
		// Every median within its steps' range.
		inRange := func(med float64, rng []float64) bool { return len(rng) == 2 && rng[0] <= med && med <= rng[1] }
		if !inRange(r.CoreFwdMS, r.CoreFwdRangeMS) || !inRange(r.CoreStepMS, r.CoreStepRangeMS) {
			t.Errorf("row %d: core medians %g, %g outside %v, %v", i, r.CoreFwdMS, r.CoreStepMS, r.CoreFwdRangeMS, r.CoreStepRangeMS)
		}
		for _, m := range []attnRingMode{r.AllGather, r.Ring, r.RingPortable} {
			if m.FwdMS != nil && (!inRange(*m.FwdMS, m.FwdRangeMS) || !inRange(*m.StepMS, m.StepRangeMS)) {
				t.Errorf("row %d: %s medians %g, %g outside %v, %v", i, m.Path, *m.FwdMS, *m.StepMS, m.FwdRangeMS, m.StepRangeMS)
			}
		}
		// The timeline: every timed step of every path, in order; the
		// core's two steps of each kind give its median (the slower).
		modes := 1
		for _, m := range []attnRingMode{r.AllGather, r.Ring, r.RingPortable} {
			if m.FwdMS != nil {
				modes++
			}
		}
		if len(r.Timeline) != modes*2*2 {
			t.Errorf("row %d: %d timed steps in the timeline, want %d", i, len(r.Timeline), modes*2*2)
		}
		coreSteps := map[string][]float64{}
		for j, ts := range r.Timeline {
			if j > 0 && ts.StartUnixMS < r.Timeline[j-1].StartUnixMS || ts.StartUnixMS <= 0 || !slices.Contains(ringKinds, ts.Kind) {
				t.Errorf("row %d: timeline[%d] %+v out of order or unnamed", i, j, ts)
			}
			if ts.Path == "core on the whole sequence" {
				coreSteps[ts.Kind] = append(coreSteps[ts.Kind], ts.MS)
			}
		}
		if f, fb := coreSteps[ringKinds[0]], coreSteps[ringKinds[1]]; len(f) != 2 || len(fb) != 2 || slices.Max(f) != r.CoreFwdMS || slices.Max(fb) != r.CoreStepMS {
			t.Errorf("row %d: the core's timed steps %v / %v, medians %g / %g", i, f, fb, r.CoreFwdMS, r.CoreStepMS)
		}
		w, perRank := []int{2, 2, 4, 4}[i], []int{8, 16, 8, 16}[i]
		if r.World != w || r.SeqPerRank != perRank || r.Seq != w*perRank || r.EfficiencyBarApply {
			t.Errorf("row %d: %+v, want W %d S/W %d", i, r, w, perRank)
		}
		flops := 2 * 2 * 16 * float64(r.Seq) * float64(r.Seq) * 128 / 2
		if !near(r.CoreFwdTF, flops/r.CoreFwdMS/1e9) || !near(r.CoreStepTF, 3.5*flops/r.CoreStepMS/1e9) {
			t.Errorf("row %d: core %+v", i, r)
		}
		ag := r.AllGather
		if ag.Error != "" || ag.FwdMS == nil || ag.StepMS == nil || !near(*ag.FwdTF, flops / *ag.FwdMS / 1e9) || !near(*r.AllGatherEffStep, r.CoreStepMS / *ag.StepMS) {
			t.Fatalf("row %d: allgather %+v (%v)", i, ag, ag.Error)
		}
		if pr := r.RingPortable; pr.Error != "" || pr.Path != "portable ring" || pr.FwdMS == nil || pr.StepMS == nil ||
			!near(*r.PortableEffFwd, r.CoreFwdMS / *pr.FwdMS) || !near(*r.PortableEffStep, r.CoreStepMS / *pr.StepMS) {
			t.Errorf("row %d: portable ring %+v, efficiency %v %v", i, pr, r.PortableEffFwd, r.PortableEffStep)
		}
		if r.Ring.Error != "" {
			ringMeasured = false
			if r.Ring.FwdMS != nil || r.EfficiencyFwd != nil || r.OverAllGatherStep != nil {
				t.Errorf("row %d: figures of a mode that was not built: %+v", i, r)
			}
			continue
		}
		if r.Ring.FwdMS == nil || r.Ring.StepMS == nil || !near(*r.EfficiencyFwd, r.CoreFwdMS / *r.Ring.FwdMS) || !near(*r.EfficiencyStep, r.CoreStepMS / *r.Ring.StepMS) ||
			!near(*r.OverAllGatherFwd, *ag.FwdMS / *r.Ring.FwdMS) || !near(*r.OverAllGatherStep, *ag.StepMS / *r.Ring.StepMS) {
			t.Errorf("row %d: ring %+v", i, r)
		}
		checkRingProfile(t, i, r)
	}
	bars := res.Figures.Bars
	if len(bars) != 3 || bars[1].Bar != ringEfficiencyBar || bars[1].Verdict != verdictNotMeasured || bars[1].Why != "no row at S/W >= 4096" || bars[2].Bar != ringFasterBar {
		t.Fatalf("bars %+v", bars)
	}
	if want := ringFasterVerdict(ring.Rows); bars[2] != want || (bars[2].Verdict == verdictNotMeasured) == ringMeasured {
		t.Errorf("ring-faster bar %+v, want %+v (ring measured: %v)", bars[2], want, ringMeasured)
	}
	if !strings.Contains(stdout, "virtual ranks share one GPU's memory and SMs") || !strings.Contains(stdout, "#33") || !strings.Contains(stdout, "r/ag fwd") {
		t.Errorf("the ring table does not say what virtual ranks are:\n%s", stdout)
	}
}

// checkRingProfile checks row i's profiled steps: the core's two ops once
// each, every rank's forward in the ring's, the ops' times summed and
// within the step.
func checkRingProfile(t *testing.T, i int, r attnRingRow) {
	t.Helper()
	p := r.Profile
	if p == nil || p.Core.Path != "core on the whole sequence" || p.Ring.Path != r.Ring.Path {
		t.Errorf("row %d: profile %+v", i, p)
		return
	}
	calls := func(s attnStepProfile, op string) int {
		for _, o := range s.Ops {
			if o.Op == op {
				return o.Calls
			}
		}
		return 0
	}
	if calls(p.Core, "AttentionForward") != 1 || calls(p.Core, "AttentionBackward") != 1 || calls(p.Ring, "ZigzagAttentionForward") != r.World {
		t.Errorf("row %d: profiled ops: core %+v, ring %+v", i, p.Core.Ops, p.Ring.Ops)
	}
	for _, s := range []attnStepProfile{p.Core, p.Ring} {
		var sum float64
		for _, o := range s.Ops {
			sum += o.MS
		}
		if !near(sum, s.OpsMS) || s.OpsMS <= 0 || s.StepMS < s.OpsMS*0.999 {
			t.Errorf("row %d: %s: step %g ms, ops %g ms, op times summing to %g", i, s.Path, s.StepMS, s.OpsMS, sum)
		}
	}
}

// The bars' verdicts from rows: the efficiency bar applies only from
// S/W 4096 and needs 0.95 both ways; the ring must beat allgather in
// every row.
func TestRingVerdicts(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	row := func(perRank int, eff, effStep, over, overStep float64) attnRingRow {
		return attnRingRow{World: 2, SeqPerRank: perRank, EfficiencyBarApply: perRank >= 4096,
			EfficiencyFwd: f(eff), EfficiencyStep: f(effStep), OverAllGatherFwd: f(over), OverAllGatherStep: f(overStep)}
	}
	for _, c := range []struct {
		rows         []attnRingRow
		eff, faster  string
		effWhy, fWhy string
	}{
		{[]attnRingRow{row(4096, 0.96, 0.95, 1.2, 1.1), row(8192, 0.99, 0.97, 1.5, 1.01)}, verdictHeld, verdictHeld, "", ""},
		{[]attnRingRow{row(2048, 0.5, 0.5, 1.2, 1.1), row(8192, 0.99, 0.94, 1.5, 1.0)}, verdictNotHeld, verdictNotHeld,
			"W 2 S/W 8192 forward+backward 0.94", "W 2 S/W 8192 forward+backward 1.00x"},
		{[]attnRingRow{row(2048, 0.5, 0.5, 0.9, 1.1)}, verdictNotMeasured, verdictNotHeld, "no row at S/W >= 4096", "W 2 S/W 2048 forward 0.90x"},
	} {
		e, fa := ringEfficiencyVerdict(c.rows), ringFasterVerdict(c.rows)
		if e.Verdict != c.eff || e.Why != c.effWhy || fa.Verdict != c.faster || fa.Why != c.fWhy {
			t.Errorf("rows %+v: efficiency %+v, faster %+v; want %s (%s), %s (%s)", c.rows, e, fa, c.eff, c.effWhy, c.faster, c.fWhy)
		}
	}
	missing := attnRingRow{World: 4, SeqPerRank: 4096, EfficiencyBarApply: true, Ring: attnRingMode{Error: "mode ring is not built"}}
	if v := ringEfficiencyVerdict([]attnRingRow{missing}); v.Verdict != verdictNotMeasured || !strings.Contains(v.Why, "not built") {
		t.Errorf("a ring not built: efficiency %+v", v)
	}
	if v := ringFasterVerdict([]attnRingRow{missing}); v.Verdict != verdictNotMeasured || !strings.Contains(v.Why, "at W 4: mode ring is not built") {
		t.Errorf("a ring not built: faster %+v", v)
	}
}

func TestBenchAttentionErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--shapes", "huge"}, `unknown shape "huge"`},
		{[]string{"--backend", "tpu"}, `"tpu" is not auto, cpu or cuda`},
		{[]string{"--iters", "0"}, "--iters must be positive"},
		{[]string{"extra"}, "no positional arguments"},
		{[]string{"--peer", "sh", "--peer-script", "no/such/peer.py"}, "--peer-script: stat no/such/peer.py"},
		{[]string{"--ring-world", "1"}, `--ring-world: "1" is not a number of ranks of 2 or more`},
		{[]string{"--ring-world", "2", "--ring-seq", "4096,7"}, `--ring-seq: "7" is not a positive even number`},
		{[]string{"--ring-world", "2", "--ring-seq", "4", "--gpus"}, "--gpus needs the cuda backend; this one is cpu"},
		{[]string{"--ring-world", "none", "--gpus"}, "--gpus places the ring rows on GPUs, and --ring-world none leaves none"},
	} {
		code, _, stderr := runCLI(t, append([]string{"bench", "attention", "--shapes", "tiny", "--backend", "cpu"}, c.args...)...)
		if code != exitFailure || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q, want 2 and an error containing %q", c.args, code, stderr, c.want)
		}
	}
}

// near says whether a and b are positive and equal to 1e-9 relative.
func near(a, b float64) bool { return a > 0 && b > 0 && (a-b)/b < 1e-9 && (b-a)/b < 1e-9 }

// countingClock is a profile.Clock whose time is what the timed calls
// add; it counts marks taken and released.
type countingClock struct {
	now               time.Duration
	taken, released   int
	releasedTwice     bool
	live              map[profile.Mark]bool
	next              profile.Mark
	marksAt           map[profile.Mark]time.Duration
	outstandingAtRead []int
}

func (c *countingClock) Mark() (profile.Mark, error) {
	c.next++
	c.taken++
	c.live[c.next], c.marksAt[c.next] = true, c.now
	return c.next, nil
}

func (c *countingClock) Elapsed(a, b profile.Mark) (time.Duration, error) {
	c.outstandingAtRead = append(c.outstandingAtRead, len(c.live))
	return c.marksAt[b] - c.marksAt[a], nil
}

func (c *countingClock) Release(m profile.Mark) {
	if !c.live[m] {
		c.releasedTwice = true
	}
	delete(c.live, m)
	c.released++
}

// medianOnClock brackets each timed call by two marks (queued or
// waited for), takes the median of the calls after the two warm-up
// ones, and releases every mark once; queued, it reads the marks only
// after the last call.
func TestMedianOnClock(t *testing.T) {
	b := cpu.New(backend.Float32)
	for _, queued := range []bool{true, false} {
		c := &countingClock{live: map[profile.Mark]bool{}, marksAt: map[profile.Mark]time.Duration{}}
		durations := []time.Duration{100, 100, 7, 3, 9, 1, 5} // two warm-up calls first
		call := 0
		got, err := medianOnClock(b, c, 5, queued, func() { c.now += durations[call]; call++ })
		if err != nil || got != 5 || call != 7 {
			t.Errorf("queued %v: median %v after %d calls (%v), want 5 after 7", queued, got, call, err)
		}
		if c.taken != 6 || c.released != 6 || c.releasedTwice || len(c.live) != 0 {
			t.Errorf("queued %v: %d marks taken, %d released (twice: %v), %d live", queued, c.taken, c.released, c.releasedTwice, len(c.live))
		}
		if queued && c.outstandingAtRead[0] != 6 || !queued && c.outstandingAtRead[0] != 2 {
			t.Errorf("queued %v: %d marks were out at the first read", queued, c.outstandingAtRead[0])
		}
	}
}

// TestRingRowOwnDevices: the ring rows with each rank on a backend of its
// own, waited for at the end of every step (bench attention --gpus's way,
// here two CPU backends): every mode is measured.
func TestRingRowOwnDevices(t *testing.T) {
	b0, b1 := cpu.New(backend.Float32), cpu.New(backend.Float32)
	place := func(w int) ([]*comm.Ranks, []backend.Backend, func() error, error) {
		world, err := comm.NewLocal(contextMesh(w), b0)
		return world, []backend.Backend{b0, b1}, func() error { return nil }, err
	}
	row, err := benchRingRow(b0, place, true, profile.ClockFor(b0), rand.New(rand.NewPCG(7, 8)), 2, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	for name, m := range map[string]attnRingMode{"allgather": row.AllGather, "ring": row.Ring, "portable ring": row.RingPortable} {
		if m.Error != "" || m.FwdMS == nil || m.StepMS == nil {
			t.Errorf("%s: %+v, want measured", name, m)
		}
	}
}

// The table names the paths whose steps outlasted their hold.
func TestUncoveredByPath(t *testing.T) {
	r := attnRingRow{UncoveredSteps: 13, CoreUncoveredSteps: 0}
	r.AllGather.UncoveredSteps, r.RingPortable.UncoveredSteps = 2, 11
	if got, want := uncoveredByPath(r), "allgather 2 steps, portable 11 steps"; got != want {
		t.Errorf("uncoveredByPath = %q, want %q", got, want)
	}
}
