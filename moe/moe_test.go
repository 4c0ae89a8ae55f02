package moe_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// problem is one MoE block's global inputs and weights, on the host.
type problem struct {
	cfg           moe.Config
	D, T          int           // model width, global tokens
	x, dout       []float64     // [T, D]
	gate          []float64     // [E, D]
	w1, w3        []float64     // [E, F, D]
	w2            []float64     // [E, D, F]
	sw1, sw3, sw2 []float64     // shared: [Fs, D], [Fs, D], [D, Fs]
	bias          []float64     // [E] or nil
	dt            backend.DType // the backend's float type; Float64 when 0
	bf16Operands  bool          // run on a CPU backend whose OperandType is BFloat16
	bf16Input     bool          // pass x as a BFloat16 tensor (with bf16Operands)
	// updateExperts builds the layers with moe.UpdateExpertsInBackward
	// and a poisoningUpdater, which adds each product into the gradients
	// as Backward would and then overwrites the tensor's weights with NaN.
	updateExperts bool
}

// poisoningUpdater is a moe.ExpertUpdater for the tests: it adds each
// tensor's weight-gradient product into g (beta 1, as Backward adds), then
// fills the tensor's weights in p with NaN, so that a read of them later
// in Backward shows in dx; calls lists the tensors in the order handed.
type poisoningUpdater struct {
	b     backend.Backend
	p, g  *moe.Params
	calls []moe.ExpertWeight
}

func (u *poisoningUpdater) UpdateExperts(w moe.ExpertWeight, dyRN, xRM backend.Tensor, groups backend.Groups) error {
	u.calls = append(u.calls, w)
	wt, gt := u.p.W1EFD, u.g.W1EFD
	switch w {
	case moe.ExpertW3:
		wt, gt = u.p.W3EFD, u.g.W3EFD
	case moe.ExpertW2:
		wt, gt = u.p.W2EDF, u.g.W2EDF
	}
	if dyRN != nil {
		s := gt.Shape()
		u.b.GroupedMatMulTN(u.b.View(gt, 0, s[0]*s[1], s[2]), dyRN, xRM, groups, 1, 1)
	}
	u.b.Upload(wt, tensor.New(tensor.WithShape(wt.Len()), tensor.WithBacking(constant(wt.Len(), math.NaN()))))
	return nil
}

func gauss(rng *rand.Rand, n int, std float64) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = rng.NormFloat64() * std
	}
	return v
}

func newProblem(seed uint64, cfg moe.Config, D, T int, withBias bool) *problem {
	rng := rand.New(rand.NewPCG(seed, 99))
	E, F, fs := cfg.Experts, cfg.FFN, cfg.SharedExperts*cfg.FFN
	pr := &problem{
		cfg: cfg, D: D, T: T,
		x: gauss(rng, T*D, 1), dout: gauss(rng, T*D, 1),
		gate: gauss(rng, E*D, 0.8),
		w1:   gauss(rng, E*F*D, 0.5), w3: gauss(rng, E*F*D, 0.5), w2: gauss(rng, E*D*F, 0.5),
		sw1: gauss(rng, fs*D, 0.5), sw3: gauss(rng, fs*D, 0.5), sw2: gauss(rng, D*fs, 0.5),
	}
	if withBias {
		pr.bias = gauss(rng, E, 0.2)
	}
	return pr
}

// ---------------------------------------------------------------------------
// The reference: Hugging Face's MixtralSparseMoeBlock written out in plain
// Go (softmax, top-k, renormalise, loop over experts), plus the options.

func silu(v float64) float64 { return v / (1 + math.Exp(-v)) }

// swiglu computes w2·(silu(w1·x) * w3·x) for one row; w1, w3 are [F, D] and
// w2 is [D, F].
func swiglu(x, w1, w3, w2 []float64, D, F int) []float64 {
	a := make([]float64, F)
	for f := range F {
		var h1, h3 float64
		for d := range D {
			h1 += w1[f*D+d] * x[d]
			h3 += w3[f*D+d] * x[d]
		}
		a[f] = silu(h1) * h3
	}
	y := make([]float64, D)
	for d := range D {
		for f := range F {
			y[d] += w2[d*F+f] * a[f]
		}
	}
	return y
}

// route returns token t's probs, lse, top-k experts (by probs+bias, lower
// index first on ties), renormalised gates, and the gap between the k-th and
// (k+1)-th score.
func (pr *problem) route(t int) (probs []float64, lse float64, top []int, gates []float64, margin float64) {
	E, D, K := pr.cfg.Experts, pr.D, pr.cfg.TopK
	logits := make([]float64, E)
	for e := range E {
		for d := range D {
			logits[e] += pr.gate[e*D+d] * pr.x[t*D+d]
		}
	}
	var s float64
	for _, z := range logits {
		s += math.Exp(z)
	}
	probs = make([]float64, E)
	for e, z := range logits {
		probs[e] = math.Exp(z) / s
	}
	score := func(e int) float64 {
		if pr.bias == nil {
			return probs[e]
		}
		return probs[e] + pr.bias[e]
	}
	order := []int{}
	for e := range E {
		order = append(order, e)
	}
	sort.SliceStable(order, func(i, j int) bool { return score(order[i]) > score(order[j]) })
	top = order[:K]
	var sum float64
	for _, e := range top {
		sum += probs[e]
	}
	for _, e := range top {
		gates = append(gates, probs[e]/sum)
	}
	margin = math.Inf(1)
	if K < E {
		margin = score(order[K-1]) - score(order[K])
	}
	return probs, math.Log(s), top, gates, margin
}

// refResult is the reference for one source rank's tokens [lo, hi).
type refResult struct {
	out            []float64 // [(hi-lo), D]
	countsE        []float64 // assignments per expert before capacity
	dropped        int
	probSumE       []float64
	lseSq, margin  float64
	tokens         int
	auxLoss, zLoss float64 // filled by finishStats over all ranks
}

func (pr *problem) reference(lo, hi int) refResult {
	cfg, D, F, E, K := pr.cfg, pr.D, pr.cfg.FFN, pr.cfg.Experts, pr.cfg.TopK
	T := hi - lo
	r := refResult{out: make([]float64, T*D), countsE: make([]float64, E), probSumE: make([]float64, E), tokens: T, margin: math.Inf(1)}
	capacity := 0
	if cfg.CapacityFactor > 0 {
		capacity = int(math.Ceil(cfg.CapacityFactor * float64(T*K) / float64(E)))
	}
	// Routing weights per (token, expert), zero where not chosen or dropped.
	weight := make([][]float64, T)
	kept := make([]int, E)
	for i := range T {
		probs, lse, top, gates, margin := pr.route(lo + i)
		r.lseSq += lse * lse
		r.margin = min(r.margin, margin)
		weight[i] = make([]float64, E)
		for e, p := range probs {
			r.probSumE[e] += p
		}
		for k, e := range top {
			r.countsE[e]++
			if capacity > 0 && kept[e] >= capacity {
				r.dropped++
				continue
			}
			kept[e]++
			weight[i][e] = gates[k]
		}
	}
	// The expert loop, as in HF: each expert processes its tokens and adds
	// weight * expert(x) into the output.
	for e := range E {
		w1, w3, w2 := pr.w1[e*F*D:(e+1)*F*D], pr.w3[e*F*D:(e+1)*F*D], pr.w2[e*D*F:(e+1)*D*F]
		for i := range T {
			if weight[i][e] == 0 {
				continue
			}
			y := swiglu(pr.x[(lo+i)*D:(lo+i+1)*D], w1, w3, w2, D, F)
			for d := range D {
				r.out[i*D+d] += weight[i][e] * y[d]
			}
		}
	}
	if fs := cfg.SharedExperts * F; fs > 0 {
		for i := range T {
			y := swiglu(pr.x[(lo+i)*D:(lo+i+1)*D], pr.sw1, pr.sw3, pr.sw2, D, fs)
			for d := range D {
				r.out[i*D+d] += y[d]
			}
		}
	}
	return r
}

// globalReference runs the reference on each of W source ranks' token
// slices and computes the global statistics and losses.
func (pr *problem) globalReference(W int) (out []float64, st refResult) {
	E, K := pr.cfg.Experts, float64(pr.cfg.TopK)
	st = refResult{countsE: make([]float64, E), probSumE: make([]float64, E), margin: math.Inf(1)}
	for w := range W {
		r := pr.reference(w*pr.T/W, (w+1)*pr.T/W)
		out = append(out, r.out...)
		for e := range E {
			st.countsE[e] += r.countsE[e]
			st.probSumE[e] += r.probSumE[e]
		}
		st.dropped += r.dropped
		st.lseSq += r.lseSq
		st.tokens += r.tokens
		st.margin = min(st.margin, r.margin)
	}
	T := float64(st.tokens)
	for e := range E {
		st.auxLoss += float64(E) * st.countsE[e] / (T * K) * st.probSumE[e] / T
	}
	st.zLoss = st.lseSq / T
	return out, st
}

// ---------------------------------------------------------------------------
// Running the layer on a mesh of virtual ranks.

// result is a layer run assembled over all ranks: activations concatenated
// in token order, replicated weights' gradients summed over ranks, expert
// gradients summed over replicas and placed at their global experts.
type result struct {
	out, dx              []float64
	gGate, gW1, gW3, gW2 []float64
	gSW1, gSW3, gSW2     []float64
	stats                []moe.Stats // per rank
}

func upload(b backend.Backend, vals []float64, shape ...int) backend.Tensor {
	t := b.New(b.FloatType(), shape...)
	b.Upload(t, tensor.New(tensor.WithShape(len(vals)), tensor.WithBacking(append([]float64(nil), vals...))))
	return t
}

// gradInit is where gradients start in run; downloadGrad takes it off.
const gradInit = 0.25

func downloadGrad(b backend.Backend, t backend.Tensor) []float64 {
	v := backend.DownloadFloat64(b, t)
	for i := range v {
		v[i] -= gradInit
	}
	return v
}

func constant(n int, v float64) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = v
	}
	return out
}

func addInto(dst []float64, off int, src []float64) {
	for i, v := range src {
		dst[off+i] += v
	}
}

// run runs Forward (and Backward with dout when backward is set) of the
// problem on mesh, each rank holding its contiguous slice of the tokens and
// its shard of the experts.
func (pr *problem) run(t *testing.T, mesh comm.Mesh, lossScale float64, backward bool) result {
	t.Helper()
	dt := pr.dt
	if dt == 0 {
		dt = backend.Float64
	}
	var b backend.Backend = cpu.New(dt)
	if pr.bf16Operands {
		b = backendtest.BF16Operands(cpu.New(dt))
	}
	ranks, err := comm.NewLocal(mesh, b)
	if err != nil {
		t.Fatal(err)
	}
	cfg, D, F, E := pr.cfg, pr.D, pr.cfg.FFN, pr.cfg.Experts
	W, local, fs := len(ranks), E/mesh.EP, cfg.SharedExperts*cfg.FFN
	Tl := pr.T / W
	type rankOut struct {
		out, dx                 []float64
		gGate, gW1, gW3, gW2    []float64
		gSW1, gSW3, gSW2        []float64
		stats                   moe.Stats
		forwardErr, backErr     error
		firstExpert, firstToken int
	}
	outs := make([]rankOut, W)
	var wg sync.WaitGroup
	for i, rk := range ranks {
		wg.Go(func() {
			o := &outs[i]
			o.firstExpert, o.firstToken = rk.Expert.Rank()*local, rk.Data.Rank()*Tl
			e0, t0 := o.firstExpert, o.firstToken
			p := moe.NewParams(b, cfg, D, local)
			b.Upload(p.GateED, tensor.New(tensor.WithShape(E*D), tensor.WithBacking(append([]float64(nil), pr.gate...))))
			p.W1EFD = upload(b, pr.w1[e0*F*D:(e0+local)*F*D], local, F, D)
			p.W3EFD = upload(b, pr.w3[e0*F*D:(e0+local)*F*D], local, F, D)
			p.W2EDF = upload(b, pr.w2[e0*D*F:(e0+local)*D*F], local, D, F)
			if fs > 0 {
				p.SharedW1FD, p.SharedW3FD, p.SharedW2DF = upload(b, pr.sw1, fs, D), upload(b, pr.sw3, fs, D), upload(b, pr.sw2, D, fs)
			}
			updater := &poisoningUpdater{b: b, p: p}
			var opts []moe.Option
			if pr.updateExperts {
				opts = append(opts, moe.UpdateExpertsInBackward(updater))
			}
			layer, err := moe.New(b, cfg, D, Tl, moe.Groups{Expert: rk.Expert, Data: rk.Data}, opts...)
			if err != nil {
				o.forwardErr = err
				rk.Abort(err)
				return
			}
			var bias backend.Tensor
			if pr.bias != nil {
				bias = upload(b, pr.bias, E)
			}
			x, out := upload(b, pr.x[t0*D:(t0+Tl)*D], Tl, D), b.New(dt, Tl, D)
			if pr.bf16Input {
				x = backendtest.UploadBF16(b, pr.x[t0*D:(t0+Tl)*D], Tl, D)
			}
			o.stats, o.forwardErr = layer.Forward(out, x, p, bias, lossScale)
			if o.forwardErr == nil {
				o.forwardErr = layer.ReadStats(&o.stats)
			}
			if o.forwardErr != nil {
				rk.Abort(o.forwardErr)
				return
			}
			o.out = backend.DownloadFloat64(b, out)
			if !backward {
				return
			}
			// Gradients start at gradInit, so the test sees whether
			// Backward accumulates rather than overwrites.
			g := moe.NewParams(b, cfg, D, local)
			for _, gt := range []backend.Tensor{g.GateED, g.W1EFD, g.W3EFD, g.W2EDF, g.SharedW1FD, g.SharedW3FD, g.SharedW2DF} {
				if gt != nil {
					b.Upload(gt, tensor.New(tensor.WithShape(gt.Len()), tensor.WithBacking(constant(gt.Len(), gradInit))))
				}
			}
			dx := b.New(dt, Tl, D)
			updater.g = g
			if o.backErr = layer.Backward(dx, upload(b, pr.dout[t0*D:(t0+Tl)*D], Tl, D), p, g); o.backErr != nil {
				rk.Abort(o.backErr)
				return
			}
			if want := []moe.ExpertWeight{moe.ExpertW2, moe.ExpertW1, moe.ExpertW3}; pr.updateExperts && !slices.Equal(updater.calls, want) {
				o.backErr = fmt.Errorf("the updater was handed %v, want %v", updater.calls, want)
				return
			}
			o.dx = backend.DownloadFloat64(b, dx)
			o.gGate, o.gW1, o.gW3, o.gW2 = downloadGrad(b, g.GateED), downloadGrad(b, g.W1EFD), downloadGrad(b, g.W3EFD), downloadGrad(b, g.W2EDF)
			if fs > 0 {
				o.gSW1, o.gSW3, o.gSW2 = downloadGrad(b, g.SharedW1FD), downloadGrad(b, g.SharedW3FD), downloadGrad(b, g.SharedW2DF)
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("ranks did not finish")
	}
	res := result{
		out: make([]float64, pr.T*D), dx: make([]float64, pr.T*D),
		gGate: make([]float64, E*D), gW1: make([]float64, E*F*D), gW3: make([]float64, E*F*D), gW2: make([]float64, E*D*F),
		gSW1: make([]float64, fs*D), gSW3: make([]float64, fs*D), gSW2: make([]float64, D*fs),
	}
	for i, o := range outs {
		if o.forwardErr != nil || o.backErr != nil {
			t.Fatalf("rank %d: forward %v, backward %v", i, o.forwardErr, o.backErr)
		}
		res.stats = append(res.stats, o.stats)
		copy(res.out[o.firstToken*D:], o.out)
		if !backward {
			continue
		}
		copy(res.dx[o.firstToken*D:], o.dx)
		addInto(res.gGate, 0, o.gGate)
		addInto(res.gW1, o.firstExpert*F*D, o.gW1)
		addInto(res.gW3, o.firstExpert*F*D, o.gW3)
		addInto(res.gW2, o.firstExpert*D*F, o.gW2)
		if fs > 0 {
			addInto(res.gSW1, 0, o.gSW1)
			addInto(res.gSW3, 0, o.gSW3)
			addInto(res.gSW2, 0, o.gSW2)
		}
	}
	return res
}

func oneRank() comm.Mesh { return comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1} }

func assertClose(t *testing.T, what string, got, want []float64, tol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	for i := range got {
		if d := math.Abs(got[i] - want[i]); !(d <= tol*(1+math.Abs(want[i]))) {
			t.Fatalf("%s[%d] = %.15g, want %.15g (diff %.3g)", what, i, got[i], want[i], d)
		}
	}
}

func assertStats(t *testing.T, st moe.Stats, ref refResult) {
	t.Helper()
	assertClose(t, "TokensPerExpert", st.TokensPerExpert, ref.countsE, 0)
	if st.Tokens != ref.tokens || st.Dropped != ref.dropped {
		t.Fatalf("stats tokens %d dropped %d, want %d and %d", st.Tokens, st.Dropped, ref.tokens, ref.dropped)
	}
	assertClose(t, "AuxLoss", []float64{st.AuxLoss}, []float64{ref.auxLoss}, 1e-13)
	assertClose(t, "ZLoss", []float64{st.ZLoss}, []float64{ref.zLoss}, 1e-13)
}

// ---------------------------------------------------------------------------
// Tests.

var baseCfg = moe.Config{Experts: 4, TopK: 2, FFN: 5, AuxLossCoef: 0.1, ZLossCoef: 0.01, Dispatcher: moe.DispatcherUnfused}

// (a) Forward agrees with the HF reference, with and without bias, shared
// experts and top-1, and the statistics agree too.
func TestForwardMatchesReference(t *testing.T) {
	shared := baseCfg
	shared.SharedExperts = 2
	top1 := baseCfg
	top1.TopK, top1.Experts = 1, 3
	allK := baseCfg
	allK.TopK = allK.Experts
	for i, c := range []struct {
		cfg  moe.Config
		bias bool
	}{{baseCfg, false}, {baseCfg, true}, {shared, true}, {top1, false}, {allK, false}} {
		pr := newProblem(uint64(10+i), c.cfg, 6, 12, c.bias)
		res := pr.run(t, oneRank(), 1, false)
		want, st := pr.globalReference(1)
		assertClose(t, fmt.Sprintf("case %d out", i), res.out, want, 1e-12)
		assertStats(t, res.stats[0], st)
	}
}

// gradParams lists the problem's differentiable arrays by name.
func (pr *problem) gradParams() []struct {
	name string
	v    []float64
} {
	return []struct {
		name string
		v    []float64
	}{{"x", pr.x}, {"gate", pr.gate}, {"w1", pr.w1}, {"w3", pr.w3}, {"w2", pr.w2}, {"shared w1", pr.sw1}, {"shared w3", pr.sw3}, {"shared w2", pr.sw2}}
}

func (r result) grads() [][]float64 {
	return [][]float64{r.dx, r.gGate, r.gW1, r.gW3, r.gW2, r.gSW1, r.gSW3, r.gSW2}
}

// (b) The whole block's gradients equal central finite differences of
//
//	L = Σ dout ⊙ out + lossScale * (AuxLossCoef*aux + ZLossCoef*z)
//
// (the engine's dout carries its own scale; lossScale applies to the
// router's losses only), for dx, the gate, the experts and the shared
// experts, dropless and with capacity drops.
func TestGradientsMatchFiniteDifferences(t *testing.T) {
	withShared := baseCfg
	withShared.SharedExperts = 1
	withCap := withShared
	withCap.CapacityFactor = 0.5
	withCap.FFN = 3
	for i, c := range []struct {
		cfg  moe.Config
		bias bool
	}{{withShared, false}, {withCap, true}} {
		pr := newProblem(uint64(20+i), c.cfg, 4, 8, c.bias)
		const lossScale = 0.5
		if _, st := pr.globalReference(1); st.margin < 1e-3 {
			t.Fatalf("case %d: routing margin %g too small for finite differences; pick another seed", i, st.margin)
		} else if c.cfg.CapacityFactor > 0 && st.dropped == 0 {
			t.Fatalf("case %d: no assignment dropped; the capacity case tests nothing", i)
		}
		loss := func() float64 {
			res := pr.run(t, oneRank(), lossScale, false)
			var l float64
			for j, o := range res.out {
				l += pr.dout[j] * o
			}
			st := res.stats[0]
			return l + lossScale*(c.cfg.AuxLossCoef*st.AuxLoss+c.cfg.ZLossCoef*st.ZLoss)
		}
		got := pr.run(t, oneRank(), lossScale, true).grads()
		const h = 1e-5
		for j, p := range pr.gradParams() {
			want := make([]float64, len(p.v))
			for k := range p.v {
				v := p.v[k]
				p.v[k] = v + h
				lp := loss()
				p.v[k] = v - h
				lm := loss()
				p.v[k] = v
				want[k] = (lp - lm) / (2 * h)
			}
			assertClose(t, fmt.Sprintf("case %d d%s", i, p.name), got[j], want, 1e-7)
		}
	}
}

// (c) The same global tokens on 1, 2 and 4 virtual ranks (expert parallel,
// and expert x data parallel) give the same outputs, gradients and losses.
func TestExpertParallelEquivalence(t *testing.T) {
	cfg := baseCfg
	cfg.Experts, cfg.SharedExperts = 8, 1
	pr := newProblem(30, cfg, 6, 16, true)
	want := pr.run(t, oneRank(), 0.7, true)
	for _, m := range []comm.Mesh{
		{DP: 1, EP: 2, CP: 1, TP: 1},
		{DP: 1, EP: 4, CP: 1, TP: 1},
		{DP: 2, EP: 2, CP: 1, TP: 1},
		{DP: 4, EP: 1, CP: 1, TP: 1},
	} {
		got := pr.run(t, m, 0.7, true)
		assertClose(t, fmt.Sprintf("%+v out", m), got.out, want.out, 1e-10)
		for j, g := range got.grads() {
			assertClose(t, fmt.Sprintf("%+v d%s", m, pr.gradParams()[j].name), g, want.grads()[j], 1e-10)
		}
		for r, st := range got.stats {
			assertClose(t, "TokensPerExpert", st.TokensPerExpert, want.stats[0].TokensPerExpert, 0)
			assertClose(t, fmt.Sprintf("%+v rank %d losses", m, r), []float64{st.AuxLoss, st.ZLoss},
				[]float64{want.stats[0].AuxLoss, want.stats[0].ZLoss}, 1e-12)
			if st.Tokens != pr.T {
				t.Fatalf("%+v rank %d: tokens %d, want %d", m, r, st.Tokens, pr.T)
			}
		}
	}
}

// The float32 backend (the training default) computes the same block to
// float32 precision.
func TestFloat32MatchesFloat64(t *testing.T) {
	cfg := baseCfg
	cfg.SharedExperts = 1
	pr := newProblem(35, cfg, 6, 16, true)
	want := pr.run(t, comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, 1, true)
	pr.dt = backend.Float32
	got := pr.run(t, comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, 1, true)
	assertClose(t, "float32 out", got.out, want.out, 1e-5)
	for j, g := range got.grads() {
		assertClose(t, "float32 d"+pr.gradParams()[j].name, g, want.grads()[j], 1e-4)
	}
}

// (d) Capacity: assignments beyond ceil(cf*T*K/E) per expert are dropped in
// token order, counted, and contribute nothing; on several ranks each source
// rank applies its own capacity.
func TestCapacityDropping(t *testing.T) {
	cfg := baseCfg
	cfg.CapacityFactor = 1
	// A large bias on experts 0 and 1 makes every token choose them, so
	// with T=8, K=2, E=4 (capacity 4) the last 4 tokens lose both.
	pr := newProblem(40, cfg, 5, 8, false)
	pr.bias = []float64{10, 5, 0, 0}
	res := pr.run(t, oneRank(), 1, false)
	st := res.stats[0]
	if st.Dropped != 8 || st.TokensPerExpert[0] != 8 || st.TokensPerExpert[1] != 8 {
		t.Fatalf("dropped %d, load %v; want 8 dropped of loads [8 8 0 0]", st.Dropped, st.TokensPerExpert)
	}
	for i, v := range res.out[4*pr.D:] {
		if v != 0 {
			t.Fatalf("dropped token %d has output %v", 4+i/pr.D, v)
		}
	}
	want, ref := pr.globalReference(1)
	assertClose(t, "out", res.out, want, 1e-12)
	assertStats(t, st, ref)

	// Random routing with a tight capacity, on 2 ranks.
	cfg.CapacityFactor = 0.6
	pr = newProblem(41, cfg, 5, 16, true)
	res = pr.run(t, comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, 1, false)
	want, ref = pr.globalReference(2)
	if ref.dropped == 0 {
		t.Fatal("nothing dropped; the test needs a tighter capacity")
	}
	assertClose(t, "out on 2 ranks", res.out, want, 1e-12)
	for _, st := range res.stats {
		assertStats(t, st, ref)
	}
}

// (e) The bias changes which experts are chosen but not the gate values:
// the output equals the reference that selects by probs+bias and weights by
// the unbiased renormalised probs, and differs from the unbiased output.
func TestBiasSteersSelectionOnly(t *testing.T) {
	pr := newProblem(50, baseCfg, 6, 12, false)
	plain := pr.run(t, oneRank(), 1, false)
	pr.bias = []float64{0.3, -0.3, 0.2, 0}
	biased := pr.run(t, oneRank(), 1, false)
	want, _ := pr.globalReference(1)
	assertClose(t, "biased out", biased.out, want, 1e-12)
	if fmt.Sprint(biased.stats[0].TokensPerExpert) == fmt.Sprint(plain.stats[0].TokensPerExpert) {
		t.Fatal("the bias did not change the selection; the test needs a larger bias")
	}
}

// (f) UpdateBias moves under-loaded experts up and over-loaded ones down;
// the values it returns are what the tensor holds, so that the next call
// needs no download, on a float32 backend too.
func TestUpdateBias(t *testing.T) {
	b := cpu.New(backend.Float64)
	bias := upload(b, []float64{0.5, 0, -1, 2, 0}, 5)
	host := moe.UpdateBias(b, bias, nil, []float64{10, 2, 4, 5, 4}, 0.25) // mean 5
	assertClose(t, "bias", backend.DownloadFloat64(b, bias), []float64{0.25, 0.25, -0.75, 2, 0.25}, 0)
	host = moe.UpdateBias(b, bias, host, []float64{3, 3, 3, 3, 3}, 0.25)
	assertClose(t, "bias at balance", backend.DownloadFloat64(b, bias), []float64{0.25, 0.25, -0.75, 2, 0.25}, 0)
	assertClose(t, "bias on the host", host, []float64{0.25, 0.25, -0.75, 2, 0.25}, 0)

	// In float32, a rate that float32 cannot hold: the host's values are
	// the tensor's after every step, as a download each step would give.
	b32 := cpu.New(backend.Float32)
	withHost, fresh := b32.New(backend.Float32, 3), b32.New(backend.Float32, 3)
	var kept []float64
	for step := range 50 {
		load := []float64{float64(step % 3), 1, 2}
		kept = moe.UpdateBias(b32, withHost, kept, load, 1e-3)
		moe.UpdateBias(b32, fresh, nil, load, 1e-3)
		got, want := backend.DownloadFloat64(b32, withHost), backend.DownloadFloat64(b32, fresh)
		for e := range want {
			if got[e] != want[e] || kept[e] != want[e] {
				t.Fatalf("step %d, expert %d: bias %v with the host's values (%v on the host), %v downloading each step", step, e, got[e], kept[e], want[e])
			}
		}
	}
}

// Argument errors are returned, not panicked, and name what is wrong.
func TestErrors(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 3, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	g := moe.Groups{Expert: ranks[0].Expert, Data: ranks[0].Data}
	for _, c := range []struct {
		cfg  moe.Config
		g    moe.Groups
		want string
	}{
		{baseCfg, g, "divisible by the expert group size (3)"},
		{moe.Config{Experts: 3, TopK: 4, FFN: 2}, g, "top_k is 4"},
		{moe.Config{Experts: 3, TopK: 1, FFN: 0}, g, "ffn is 0"},
		{moe.Config{Experts: 3, TopK: 1, FFN: 2, CapacityFactor: -1}, g, "cannot be negative"},
		{moe.Config{Experts: 3, TopK: 1, FFN: 2}, moe.Groups{Expert: g.Expert}, "data group"},
	} {
		if _, err := moe.New(b, c.cfg, 4, 4, c.g); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%+v) error %v, want %q", c.cfg, err, c.want)
		}
	}
	solo, _ := comm.NewLocal(oneRank(), b)
	layer, err := moe.New(b, baseCfg, 4, 3, moe.Groups{Expert: solo[0].Expert, Data: solo[0].Data})
	if err != nil {
		t.Fatal(err)
	}
	p := moe.NewParams(b, baseCfg, 4, baseCfg.Experts)
	if err := layer.Backward(b.New(backend.Float64, 3, 4), b.New(backend.Float64, 3, 4), p, p); err == nil {
		t.Error("Backward before Forward succeeded")
	}
	if _, err := layer.Forward(b.New(backend.Float64, 3, 4), b.New(backend.Float64, 2, 4), p, nil, 1); err == nil || !strings.Contains(err.Error(), "x has shape [2 4]") {
		t.Errorf("Forward with a wrong x: %v", err)
	}
	if _, err := layer.Forward(b.New(backend.Float64, 3, 4), b.New(backend.Float64, 3, 4), moe.NewParams(b, baseCfg, 4, 2), nil, 1); err == nil || !strings.Contains(err.Error(), "w1 has shape") {
		t.Errorf("Forward with 2 local experts of 4 on one rank: %v", err)
	}
}

// TestSharedScratch runs two layers that share one Scratch in the order a
// model does (forward 1, forward 2, backward 2, backward 1) and checks that
// their outputs and gradients are bitwise those of layers with their own,
// with either dispatcher, with the experts' hidden activations
// recomputed in Backward (RecomputeExperts), and with every activation in
// the Scratch and the Forward rerun (Reforward) before each Backward
// (RecomputeLayer), whose statistics and losses must stay the first
// Forward's; and that a Scratch of another width is refused.
func TestSharedScratch(t *testing.T) {
	b := cpu.New(backend.Float64)
	cfg := moe.Config{Experts: 4, TopK: 2, FFN: 6, AuxLossCoef: 0.01, ZLossCoef: 0.001, Dispatcher: moe.DispatcherUnfused}
	const D, T = 5, 12
	solo, err := comm.NewLocal(oneRank(), b)
	if err != nil {
		t.Fatal(err)
	}
	g := moe.Groups{Expert: solo[0].Expert, Data: solo[0].Data}
	probs := []*problem{newProblem(1, cfg, D, T, false), newProblem(2, cfg, D, T, false)}
	run := func(shared *moe.Scratch, recompute string) (outs [][]float64) {
		var layers []*moe.Layer
		var ps, gs []*moe.Params
		var xs, ys []backend.Tensor
		for _, pr := range probs {
			var opts []moe.Option
			if shared != nil {
				opts = append(opts, moe.WithScratch(shared))
			}
			switch recompute {
			case "selective":
				opts = append(opts, moe.RecomputeExperts())
			case "full":
				opts = append(opts, moe.RecomputeLayer())
			}
			l, err := moe.New(b, cfg, D, T, g, opts...)
			if err != nil {
				t.Fatal(err)
			}
			p := moe.NewParams(b, cfg, D, cfg.Experts)
			p.GateED, p.W1EFD, p.W3EFD, p.W2EDF = upload(b, pr.gate, cfg.Experts, D), upload(b, pr.w1, cfg.Experts, cfg.FFN, D),
				upload(b, pr.w3, cfg.Experts, cfg.FFN, D), upload(b, pr.w2, cfg.Experts, D, cfg.FFN)
			layers, ps, gs = append(layers, l), append(ps, p), append(gs, moe.NewParams(b, cfg, D, cfg.Experts))
			xs, ys = append(xs, upload(b, pr.x, T, D)), append(ys, b.New(backend.Float64, T, D))
		}
		stats := make([]moe.Stats, len(layers))
		for i, l := range layers {
			if stats[i], err = l.Forward(ys[i], xs[i], ps[i], nil, 0.5); err != nil {
				t.Fatal(err)
			}
		}
		for i := len(layers) - 1; i >= 0; i-- {
			if recompute == "full" {
				// Into a buffer of its own: the kept output ys[i] is compared.
				if err := layers[i].Reforward(b.New(backend.Float64, T, D), xs[i], ps[i], nil); err != nil {
					t.Fatal(err)
				}
			}
			dx := b.New(backend.Float64, T, D)
			if err := layers[i].Backward(dx, upload(b, probs[i].dout, T, D), ps[i], gs[i]); err != nil {
				t.Fatal(err)
			}
			outs = append(outs, backend.DownloadFloat64(b, ys[i]), backend.DownloadFloat64(b, dx),
				backend.DownloadFloat64(b, gs[i].W1EFD), backend.DownloadFloat64(b, gs[i].W2EDF), backend.DownloadFloat64(b, gs[i].W3EFD),
				backend.DownloadFloat64(b, gs[i].GateED))
			if err := layers[i].ReadStats(&stats[i]); err != nil {
				t.Fatal(err)
			}
			outs = append(outs, append(slices.Clone(stats[i].TokensPerExpert), stats[i].AuxLoss, stats[i].ZLoss))
		}
		return outs
	}
	for _, dispatcher := range []string{moe.DispatcherUnfused, moe.DispatcherFused} {
		cfg.Dispatcher = dispatcher
		own, shared := run(nil, ""), run(moe.NewScratch(b, D, cfg.FFN), "")
		recomputed, full := run(moe.NewScratch(b, D, cfg.FFN), "selective"), run(moe.NewScratch(b, D, cfg.FFN), "full")
		for i := range own {
			assertClose(t, fmt.Sprintf("%s: tensor %d", dispatcher, i), shared[i], own[i], 0)
			assertClose(t, fmt.Sprintf("%s, recomputed: tensor %d", dispatcher, i), recomputed[i], own[i], 0)
			assertClose(t, fmt.Sprintf("%s, full: tensor %d", dispatcher, i), full[i], own[i], 0)
		}
	}
	cfg.Dispatcher = moe.DispatcherUnfused
	if _, err := moe.New(b, cfg, D, T, g, moe.WithScratch(moe.NewScratch(b, D+1, cfg.FFN))); err == nil || !strings.Contains(err.Error(), "shared scratch") {
		t.Errorf("a scratch of another width: error %v", err)
	}
}

// TestBF16Operands runs the layer with bf16 expert activations (as on the
// GPU), on one rank and on two expert ranks (where the rows travel in float
// and are rounded on arrival), and compares with the float run: every
// output and gradient within bf16's relative error, as a whole tensor.
func TestBF16Operands(t *testing.T) {
	for _, mesh := range []comm.Mesh{oneRank(), {DP: 1, EP: 2, CP: 1, TP: 1}} {
		pr := newProblem(77, baseCfg, 16, 24, false)
		want := pr.run(t, mesh, 1, true)
		pr.bf16Operands = true
		got := pr.run(t, mesh, 1, true)
		for i, g := range append([][]float64{got.out}, got.grads()...) {
			w := append([][]float64{want.out}, want.grads()...)[i]
			var d2, w2 float64
			for j := range w {
				d2 += (g[j] - w[j]) * (g[j] - w[j])
				w2 += w[j] * w[j]
			}
			if w2 == 0 {
				continue
			}
			if rel := math.Sqrt(d2 / w2); !(rel <= 2e-2) || rel == 0 {
				t.Errorf("ep %d, tensor %d: relative L2 difference %.3g from the float run, want (0, 2e-2]", mesh.EP, i, rel)
			}
		}
	}
}

// TestBF16Input gives the layer its input as a bf16 tensor (the engine's
// norm writes it so on the GPU) on a bf16-operand backend: the same bits
// as the float input holding the same values, which the layer rounds into
// its operand copy, with both dispatchers, shared experts, and on one and
// two expert ranks (where the float rows exchanged are the bf16 ones
// widened).
func TestBF16Input(t *testing.T) {
	for _, dispatcher := range []string{moe.DispatcherUnfused, moe.DispatcherFused} {
		for _, mesh := range []comm.Mesh{oneRank(), {DP: 1, EP: 2, CP: 1, TP: 1}} {
			cfg := baseCfg
			cfg.Dispatcher, cfg.SharedExperts = dispatcher, 1
			pr := newProblem(78, cfg, 16, 24, false)
			pr.bf16Operands, pr.dt = true, backend.Float32
			for i, v := range pr.x {
				pr.x[i] = backendtest.RoundBF16(v)
			}
			want := pr.run(t, mesh, 1, true)
			pr.bf16Input = true
			got := pr.run(t, mesh, 1, true)
			for i, g := range append([][]float64{got.out}, got.grads()...) {
				w := append([][]float64{want.out}, want.grads()...)[i]
				if !slices.Equal(g, w) {
					t.Errorf("%s, ep %d: tensor %d differs from the float input's", dispatcher, mesh.EP, i)
				}
			}
		}
	}
}

// TestFinishStats checks that layers sharing one statistics buffer and
// finished together with one read get the losses each would get alone,
// and that FinishStats refuses sums of the wrong length or a layer without
// a Forward.
func TestFinishStats(t *testing.T) {
	b := cpu.New(backend.Float64)
	cfg := moe.Config{Experts: 4, TopK: 2, FFN: 6, AuxLossCoef: 0.01, ZLossCoef: 0.001, Dispatcher: moe.DispatcherUnfused}
	const D, T, L = 5, 12, 3
	solo, err := comm.NewLocal(oneRank(), b)
	if err != nil {
		t.Fatal(err)
	}
	g := moe.Groups{Expert: solo[0].Expert, Data: solo[0].Data}
	n := moe.StatsLen(cfg.Experts)
	buf := b.New(backend.Float64, L*n)
	var layers []*moe.Layer
	var stats, alone []moe.Stats
	for i := range L {
		pr := newProblem(uint64(40+i), cfg, D, T, false)
		l, err := moe.New(b, cfg, D, T, g, moe.WithStats(b.View(buf, i*n, n)))
		if err != nil {
			t.Fatal(err)
		}
		p := moe.NewParams(b, cfg, D, cfg.Experts)
		p.GateED, p.W1EFD, p.W3EFD, p.W2EDF = upload(b, pr.gate, cfg.Experts, D), upload(b, pr.w1, cfg.Experts, cfg.FFN, D),
			upload(b, pr.w3, cfg.Experts, cfg.FFN, D), upload(b, pr.w2, cfg.Experts, D, cfg.FFN)
		st, err := l.Forward(b.New(backend.Float64, T, D), upload(b, pr.x, T, D), p, nil, 1)
		if err != nil {
			t.Fatal(err)
		}
		one := st
		if err := l.ReadStats(&one); err != nil {
			t.Fatal(err)
		}
		layers, stats, alone = append(layers, l), append(stats, st), append(alone, one)
	}
	if err := moe.FinishStats(layers, stats, backend.DownloadFloat64(b, buf)); err != nil {
		t.Fatal(err)
	}
	for i := range L {
		if stats[i].AuxLoss != alone[i].AuxLoss || stats[i].ZLoss != alone[i].ZLoss || stats[i].AuxLoss == 0 || stats[i].ZLoss == 0 {
			t.Errorf("layer %d: FinishStats gives aux %v z %v, ReadStats aux %v z %v", i, stats[i].AuxLoss, stats[i].ZLoss, alone[i].AuxLoss, alone[i].ZLoss)
		}
		if !slices.Equal(stats[i].TokensPerExpert, alone[i].TokensPerExpert) || stats[i].Tokens != T || stats[i].Dropped != 0 {
			t.Errorf("layer %d: FinishStats gives load %v, %d tokens, %d dropped; ReadStats load %v; want %d tokens, none dropped",
				i, stats[i].TokensPerExpert, stats[i].Tokens, stats[i].Dropped, alone[i].TokensPerExpert, T)
		}
	}
	if err := moe.FinishStats(layers, stats, make([]float64, 3)); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("want %d", L*n)) {
		t.Errorf("sums of the wrong length: error %v", err)
	}
	fresh, _ := moe.New(b, cfg, D, T, g)
	if err := moe.FinishStats([]*moe.Layer{fresh}, make([]moe.Stats, 1), make([]float64, n)); err == nil || !strings.Contains(err.Error(), "no Forward") {
		t.Errorf("a layer without a Forward: error %v", err)
	}
}

// TestAddToOutput checks that a layer built with AddToOutput adds exactly
// what a plain layer writes onto what out held.
func TestAddToOutput(t *testing.T) {
	b := cpu.New(backend.Float64)
	cfg := baseCfg
	cfg.SharedExperts = 1
	const D, T = 6, 12
	solo, err := comm.NewLocal(oneRank(), b)
	if err != nil {
		t.Fatal(err)
	}
	g := moe.Groups{Expert: solo[0].Expert, Data: solo[0].Data}
	pr := newProblem(91, cfg, D, T, false)
	outs := make([][]float64, 2)
	prior := gauss(rand.New(rand.NewPCG(1, 2)), T*D, 1)
	for i, opts := range [][]moe.Option{nil, {moe.AddToOutput()}} {
		l, err := moe.New(b, cfg, D, T, g, opts...)
		if err != nil {
			t.Fatal(err)
		}
		p := moe.NewParams(b, cfg, D, cfg.Experts)
		p.GateED, p.W1EFD, p.W3EFD, p.W2EDF = upload(b, pr.gate, cfg.Experts, D), upload(b, pr.w1, cfg.Experts, cfg.FFN, D),
			upload(b, pr.w3, cfg.Experts, cfg.FFN, D), upload(b, pr.w2, cfg.Experts, D, cfg.FFN)
		fs := cfg.SharedExperts * cfg.FFN
		p.SharedW1FD, p.SharedW3FD, p.SharedW2DF = upload(b, pr.sw1, fs, D), upload(b, pr.sw3, fs, D), upload(b, pr.sw2, D, fs)
		out := upload(b, prior, T, D)
		if _, err := l.Forward(out, upload(b, pr.x, T, D), p, nil, 1); err != nil {
			t.Fatal(err)
		}
		outs[i] = backend.DownloadFloat64(b, out)
	}
	for j := range prior {
		if d := math.Abs(outs[1][j] - (prior[j] + outs[0][j])); d > 1e-12 {
			t.Fatalf("element %d: added %v, want %v + %v", j, outs[1][j], prior[j], outs[0][j])
		}
	}
}
