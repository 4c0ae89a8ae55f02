package plan

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
)

func TestArithmeticSaturates(t *testing.T) {
	if got := mul(1<<40, 1<<30); got != Saturated {
		t.Errorf("mul(2^40, 2^30) = %d, want Saturated", got)
	}
	if got := mul(3, 5, 7); got != 105 {
		t.Errorf("mul(3, 5, 7) = %d", got)
	}
	if got := add(math.MaxInt64-1, 2); got != Saturated {
		t.Errorf("add overflowing = %d, want Saturated", got)
	}
	if got := roundUp(Saturated-3, 64); got != Saturated {
		t.Errorf("roundUp near the top = %d, want Saturated", got)
	}
	if FormatBytes(Saturated) != "more than 8 EiB" || FormatBytes(1536) != "1.5 KiB" || FormatBytes(100) != "100 B" {
		t.Errorf("FormatBytes: %q %q %q", FormatBytes(Saturated), FormatBytes(1536), FormatBytes(100))
	}
}

// TestCUDASizeClass checks the mirror of backend/cuda/memory.go's
// sizeClass on the rule it states: at least 512 bytes, else n rounded up
// to a multiple of an eighth of the next power of two, above 1 GiB of a
// 64th.
func TestCUDASizeClass(t *testing.T) {
	for n, want := range map[int64]int64{
		1: 512, 512: 512, 513: 640, 1000: 1024, 1025: 1280,
		1 << 30:     1 << 30,
		1<<30 + 1:   1<<30 + 1<<25,
		2684354560:  2684354560,  // moe-small's flat stores: 5 x 2^29 exactly
		2567245824:  2617245696,  // 641.8M fp32 parameters: 39 x 2^26
		18593488896: 18790481920, // moe-fine's 4.65B fp32 parameters: 17.5 GiB
		9296744448:  9395240960,  // and their bf16 copy: 8.75 GiB
		1 << 40:     1 << 40, Saturated: Saturated,
	} {
		if got := cudaSizeClass(n); got != want {
			t.Errorf("cudaSizeClass(%d) = %d, want %d", n, got, want)
		}
	}
}

func TestParseBytes(t *testing.T) {
	for s, want := range map[string]int64{
		"141GiB": 141 << 30, "80 GB": 80e9, "512MiB": 512 << 20, "1.5TiB": 3 << 39, "4096": 4096, "141G": 141 << 30,
	} {
		if got, err := ParseBytes(s); err != nil || got != want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "lots", "12 parsecs", "-1GiB", "0", "1e30TB"} {
		if _, err := ParseBytes(s); err == nil {
			t.Errorf("ParseBytes(%q) succeeded", s)
		}
	}
}

func TestParseMeminfo(t *testing.T) {
	total, avail, err := parseMeminfo([]byte("MemTotal:       24683748 kB\nMemFree: 1 kB\nMemAvailable:   24167492 kB\n"))
	if err != nil || total != 24683748*1024 || avail != 24167492*1024 {
		t.Errorf("parseMeminfo: %d %d %v", total, avail, err)
	}
	if _, _, err := parseMeminfo([]byte("nothing\n")); err == nil {
		t.Error("parseMeminfo without MemTotal succeeded")
	}
}

// small is a model in the engine's defaults, as a validated recipe.
func small() Config {
	return Config{Vocab: 256, Dim: 64, Layers: 2, Heads: 4, KVHeads: 2, Experts: 4, TopK: 2, FFN: 128,
		GlobalBatch: 8, MicroBatch: 8, Seq: 64, DP: 1, EP: 1, CP: 1, TP: 1}
}

func TestCheck(t *testing.T) {
	gpu := CUDADevice("test GPU", 1<<30, 0)
	p, err := New(small(), gpu)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Check(); err != nil {
		t.Errorf("the small model on 1 GiB: %v", err)
	}
	big := small()
	big.GlobalBatch, big.MicroBatch = 8192, 8192
	p, _ = New(big, gpu)
	var r *Refusal
	if err := p.Check(); !errors.As(err, &r) || r.Fields[0] != "train.micro_batch" || !strings.Contains(r.Msg, "lower train.micro_batch (8192) to ") {
		t.Errorf("micro-batch 8192 on 1 GiB: %v", err)
	}
	many := small()
	many.GlobalBatch, many.MicroBatch = 8<<20, 1
	p, _ = New(many, gpu)
	if err := p.Check(); !errors.As(err, &r) || !strings.Contains(r.Msg, "8388608 micro-batches") {
		t.Errorf("8M micro-batches per step: %v", err)
	}
	huge := small()
	huge.Vocab = 2_000_000_000
	p, _ = New(huge, gpu)
	if err := p.Check(); !errors.As(err, &r) || !strings.Contains(r.Msg, "model.vocab (2000000000)") {
		t.Errorf("vocab 2e9 on 1 GiB: %v", err)
	}
	unknown := gpu
	unknown.Memory = 0
	p, _ = New(huge, unknown)
	if err := p.Check(); err != nil {
		t.Errorf("a device of unknown memory gives no verdict on fitting: %v", err)
	}
}

// TestRoutingBound: with several expert ranks the routed rows' bound is
// above the balanced figure, by at most the whole group's rows (with the
// buffers' growth); with one expert rank the two are the same.
func TestRoutingBound(t *testing.T) {
	c := small()
	p, _ := New(c, CUDADevice("gpu", 0, 0))
	if p.Peak != p.Worst {
		t.Errorf("one expert rank: peak %d, bound %d", p.Peak, p.Worst)
	}
	c.EP, c.GlobalBatch = 2, 16
	p, _ = New(c, CUDADevice("gpu", 0, 0))
	if p.Worst <= p.Peak || p.Worst > 4*p.Peak {
		t.Errorf("two expert ranks: peak %d, bound %d", p.Peak, p.Worst)
	}
}

func TestNamedDevices(t *testing.T) {
	d, err := NamedDevice("H200")
	if err != nil || d.Backend != BackendCUDA || d.Memory != 143771<<20-CUDAContextReserve || d.OperandBytes != 2 {
		t.Errorf("h200: %+v, %v", d, err)
	}
	if _, err := NamedDevice("tpu"); err == nil || !strings.Contains(err.Error(), "h200") {
		t.Errorf("an unknown device: %v", err)
	}
}

// TestTensorParallelPlan: under tp a rank holds its share of the split
// matrices and of the experts, so its weights and its peak shrink; and
// the experts, folded over ep x tp, make the suggested parallel.ep one
// with ep x tp dividing them (12 experts at tp 2: ep 6, never ep 4).
func TestTensorParallelPlan(t *testing.T) {
	gpu := CUDADevice("gpu", 0, 0)
	one, tp := small(), small()
	tp.TP, tp.SequenceParallel = 2, true
	one.DeviceRanks, tp.DeviceRanks = 1, 1 // a rank per device: the peak is a rank's
	p1, _ := New(one, gpu)
	p2, _ := New(tp, gpu)
	if !(p2.Params.Rank < p1.Params.Rank) || !(p2.Peak < p1.Peak) {
		t.Errorf("tp 2: %d parameters and peak %d on a rank; tp 1: %d and %d", p2.Params.Rank, p2.Peak, p1.Params.Rank, p1.Peak)
	}

	c := small()
	c.Experts, c.FFN, c.TP, c.SequenceParallel, c.DeviceRanks = 12, 16384, 2, true, 1
	c.GlobalBatch, c.MicroBatch = 12, 1
	peak := func(ep int) int64 {
		next := c
		next.EP = ep
		next.ProcessRanks, next.DeviceRanks = 0, 1
		q, err := New(next, gpu)
		if err != nil {
			t.Fatal(err)
		}
		return q.need()
	}
	if !(peak(6) < peak(3)) {
		t.Fatalf("ep 6 needs %d, ep 3 %d", peak(6), peak(3))
	}
	dev := gpu
	dev.Memory = (peak(6) + peak(3)) / 2
	p, err := New(c, dev)
	if err != nil {
		t.Fatal(err)
	}
	if got := p.fittingEP(); got != 6 {
		t.Errorf("12 experts at tp 2: parallel.ep %d suggested, want 6", got)
	}
}

// parallel.tp_overlap fused on the GPU adds the fused ops' bf16 operand
// scratch to what the ranks of a device share ([T, D] under sequence
// parallelism), and under train.deterministic a rank's float32 slots
// [T, D]; auto plans for fused, the larger; unfused and tp 1 add nothing.
func TestTensorParallelFusedPlan(t *testing.T) {
	gpu := CUDADevice("gpu", 0, 0)
	terms := func(overlap string, tp int, deterministic bool) (shared, rank map[string]int64) {
		c := small()
		c.TP, c.SequenceParallel, c.TPOverlap, c.Deterministic = tp, true, overlap, deterministic
		p, err := New(c, gpu)
		if err != nil {
			t.Fatal(err)
		}
		shared, rank = map[string]int64{}, map[string]int64{}
		for _, x := range p.Shared {
			shared[x.What] += x.Bytes
		}
		for _, x := range p.Rank {
			rank[x.What] += x.Bytes
		}
		return shared, rank
	}
	const scratch, slots = "tensor-parallel fused operand scratch", "tensor-parallel fused reduce-scatter slots"
	T, D := int64(8*64), int64(64)
	for _, x := range []struct {
		overlap       string
		tp            int
		deterministic bool
		scratch       int64
		slots         int64
	}{
		{"fused", 2, false, cudaSizeClass(T * D * 2), 0},
		{"auto", 2, false, cudaSizeClass(T * D * 2), 0},
		{"", 2, true, cudaSizeClass(T * D * 2), cudaSizeClass(T * D * 4)},
		{"unfused", 2, true, 0, 0},
		{"fused", 1, true, 0, 0},
	} {
		shared, rank := terms(x.overlap, x.tp, x.deterministic)
		if shared[scratch] != x.scratch || rank[slots] != x.slots {
			t.Errorf("tp_overlap %q, tp %d, deterministic %v: scratch %d, slots %d; want %d and %d",
				x.overlap, x.tp, x.deterministic, shared[scratch], rank[slots], x.scratch, x.slots)
		}
	}
}

// TestSelectiveRecomputePlan: train.recompute: selective counts the
// attention core's output and log-sum-exp and the experts' hidden
// activations once per rank instead of once per layer, and nothing else
// changes; a device between the two peaks gets a refusal that offers it;
// a setting the plan does not know is an error.
func TestSelectiveRecomputePlan(t *testing.T) {
	host := Device{Name: "host memory", Backend: BackendCPU, FloatBytes: 4, OperandBytes: 4}
	none := small()
	none.Layers = 3
	sel := none
	sel.Recompute = RecomputeSelective
	pn, err := New(none, host)
	if err != nil {
		t.Fatal(err)
	}
	ps, err := New(sel, host)
	if err != nil {
		t.Fatal(err)
	}
	// Per layer: a [T, H*Dh] and lse [B, H, S] in float32, h1, h3 and
	// silu(h1)*h3 [T*K, F] in the operand type (float32 on the CPU).
	T, K := int64(none.MicroBatch*none.Seq), int64(none.TopK)
	perLayer := 4*(T*int64(none.Dim)+int64(none.MicroBatch*none.Heads*none.Seq)) + 3*4*T*K*int64(none.FFN)
	if saved := pn.Total(Activations) - ps.Total(Activations); saved != int64(none.Layers-1)*perLayer {
		t.Errorf("selective saves %d activation bytes; want (layers-1) x %d = %d", saved, perLayer, int64(none.Layers-1)*perLayer)
	}
	for _, k := range []Kind{Weights, Gradients, Optimizer, Workspace} {
		if pn.Total(k) != ps.Total(k) {
			t.Errorf("%s: %d bytes under none, %d under selective", k, pn.Total(k), ps.Total(k))
		}
	}
	between := host
	between.Memory = (pn.HostPeak + ps.HostPeak) / 2
	pn, _ = New(none, between)
	var r *Refusal
	if err := pn.Check(); !errors.As(err, &r) || !strings.Contains(r.Msg, "set train.recompute: selective") || r.Fields[len(r.Fields)-1] != "train.recompute" {
		t.Errorf("none between the two peaks: %v", err)
	}
	ps, _ = New(sel, between)
	if err := ps.Check(); err != nil {
		t.Errorf("selective between the two peaks: %v", err)
	}
	bad := none
	bad.Recompute = "some"
	if _, err := New(bad, host); err == nil || !strings.Contains(err.Error(), "train.recompute") {
		t.Errorf("recompute some: error %v", err)
	}
}

// TestFullRecomputePlan: train.recompute: full counts every layer
// activation once per rank instead of once per layer (the residual stream
// and the norms' inverse RMS, the MoE statistics' vectors and, under the
// fused dispatcher, the rows its peers read stay per layer), so it saves
// (layers-1) x one layer's; it changes no other kind; a device that fits
// full but not selective gets a refusal that offers full.
func TestFullRecomputePlan(t *testing.T) {
	host := Device{Name: "host memory", Backend: BackendCPU, FloatBytes: 4, OperandBytes: 4}
	none := small()
	none.Layers, none.Dispatcher = 3, DispatcherUnfused // the fused one keeps its exchanged rows per layer
	full, sel := none, none
	full.Recompute, sel.Recompute = RecomputeFull, RecomputeSelective
	pn, err := New(none, host)
	if err != nil {
		t.Fatal(err)
	}
	pf, err := New(full, host)
	if err != nil {
		t.Fatal(err)
	}
	ps, _ := New(sel, host)
	// One layer's, on the CPU (float32 everywhere, one expert rank,
	// dropless: S = R = T*K rows): h1, h2 [T, D]; q, a [T, H*Dh]; k, v
	// [T, KV*Dh]; lse [B, H, S]; logits, probs, dlogits [T, E]; lse [T];
	// idx, sendPos, gates, dgates [T, K]; offsets [E+1]; sendTok, sendSlot
	// [T*K]; gate, dgate [S]; x, y [S, D]; h1, h3, silu(h1)*h3 [S, F].
	B, S, D, H, KV, E, K, F := int64(none.MicroBatch), int64(none.Seq), int64(none.Dim), int64(none.Heads), int64(none.KVHeads), int64(none.Experts), int64(none.TopK), int64(none.FFN)
	T, kd := B*S, D/H*KV
	perLayer := 4 * (2*T*D + 2*T*D + 2*T*kd + B*H*S + 3*T*E + T + 4*T*K + (E + 1) + 2*T*K + 2*T*K + 2*T*K*D + 3*T*K*F)
	if saved := pn.Total(Activations) - pf.Total(Activations); saved != int64(none.Layers-1)*perLayer {
		t.Errorf("full saves %d activation bytes; want (layers-1) x %d = %d", saved, perLayer, int64(none.Layers-1)*perLayer)
	}
	for _, k := range []Kind{Weights, Gradients, Optimizer, Workspace} {
		if pn.Total(k) != pf.Total(k) {
			t.Errorf("%s: %d bytes under none, %d under full", k, pn.Total(k), pf.Total(k))
		}
	}
	if pf.HostPeak >= ps.HostPeak {
		t.Fatalf("full's peak %d is not below selective's %d", pf.HostPeak, ps.HostPeak)
	}
	between := host
	between.Memory = (ps.HostPeak + pf.HostPeak) / 2
	pn, _ = New(none, between)
	var r *Refusal
	if err := pn.Check(); !errors.As(err, &r) || !strings.Contains(r.Msg, "set train.recompute: full") || r.Fields[len(r.Fields)-1] != "train.recompute" {
		t.Errorf("none between selective's and full's peaks: %v", err)
	}
	pf, _ = New(full, between)
	if err := pf.Check(); err != nil {
		t.Errorf("full between selective's and full's peaks: %v", err)
	}
}

// TestSplitMastersPlan: with split masters the weights are the float32
// norms and embedding, the others' bf16 halves and their low halves (half
// as many int32 words), in the allocator's classes; no bf16 copy. On the
// CPU, which multiplies in float32, nothing is split.
func TestSplitMastersPlan(t *testing.T) {
	c := Config{Vocab: 32768, Dim: 2048, Layers: 8, Heads: 16, KVHeads: 4, Experts: 64, TopK: 6, FFN: 1408,
		GlobalBatch: 4, MicroBatch: 4, Seq: 2048, DP: 1, EP: 1, CP: 1, TP: 1, Dispatcher: DispatcherFused}
	h200, err := NamedDevice("h200")
	if err != nil {
		t.Fatal(err)
	}
	terms := func(c Config, d Device) map[string]int64 {
		p, err := New(c, d)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int64{}
		for _, term := range p.Rank {
			if term.Kind == Weights {
				out[term.What] = term.Bytes
			}
		}
		return out
	}
	whole := terms(c, h200)
	c.SplitMasters = true
	split := terms(c, h200)
	const prefix = 17*2048 + 32768*2048 // 17 norms, the embedding
	total := int64(4648372224)          // every tensor a multiple of 64 elements here
	want := map[string]int64{
		"fp32 master weights (norms and embedding)":        cudaSizeClass(4 * prefix),
		"split masters: the bf16 halves the products read": cudaSizeClass(2 * (total - prefix)),
		"split masters: the low halves":                    cudaSizeClass(4 * ((total - prefix) / 2)),
	}
	if !reflect.DeepEqual(split, want) {
		t.Errorf("split weights %v, want %v", split, want)
	}
	if w := whole["fp32 master weights"] + whole["bf16 copy for the products"]; w != cudaSizeClass(4*total)+cudaSizeClass(2*total) {
		t.Errorf("float32 masters and copy: %v", whole)
	}
	cpuDev := Device{Name: "host", Backend: BackendCPU, FloatBytes: 4, OperandBytes: 4}
	if got := terms(c, cpuDev); len(got) != 1 || got["fp32 master weights"] != 4*total {
		t.Errorf("split masters on the CPU: %v", got)
	}
}

// TestAdviceOffersNoClipping: where clipping alone keeps the experts'
// update out of the backward and the run fits with it there, the refusal
// offers train.grad_clip: 0; where the update is already in the backward,
// or something else keeps it out, it does not.
func TestAdviceOffersNoClipping(t *testing.T) {
	c := Config{Vocab: 32768, Dim: 2048, Layers: 8, Heads: 16, KVHeads: 4, Experts: 64, TopK: 6, FFN: 1408,
		GlobalBatch: 4, MicroBatch: 4, Seq: 2048, DP: 1, EP: 1, CP: 1, TP: 1, Dispatcher: DispatcherFused, SplitMasters: true}
	h100, err := NamedDevice("h100")
	if err != nil {
		t.Fatal(err)
	}
	check := func(c Config) error {
		p, err := New(c, h100)
		if err != nil {
			t.Fatal(err)
		}
		return p.Check()
	}
	c.ExpertsInBackwardUnclipped = true
	if err := check(c); err == nil || !strings.Contains(err.Error(), "train.grad_clip: 0") {
		t.Errorf("clipping in the way: %v; want the advice to offer train.grad_clip: 0", err)
	}
	c.ExpertsInBackwardUnclipped = false
	if err := check(c); err == nil || strings.Contains(err.Error(), "train.grad_clip") {
		t.Errorf("something else in the way: %v; want a refusal without train.grad_clip", err)
	}
	c.ExpertsInBackward = true
	if err := check(c); err != nil {
		t.Errorf("experts updated in the backward: %v", err)
	}
}

// TestFusedRingPlan: the fused ring's scratch on CUDA is one delta for
// the rank's layers, and in one pass a bf16 copy of da where the two-pass
// ring's dk/dv pass writes a partial dk, dv per query head of a GQA group;
// in one pass the layers keep q, k and v in bf16, not float32.
func TestFusedRingPlan(t *testing.T) {
	gpu := CUDADevice("gpu", 0, 0)
	ring := func(onePass bool) (scratch, qkv int64) {
		c := small()
		c.CP, c.Seq, c.CPAttention, c.CPRingFused, c.CPRingOnePass = 2, 512, CPRing, true, onePass
		p, err := New(c, gpu)
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range append(p.Rank, p.Shared...) {
			switch x.What {
			case "attention ring":
				scratch += x.Bytes
			case "attention":
				qkv += x.Bytes
			}
		}
		return scratch, qkv
	}
	// Per rank: 8 sequences of 256 local rows, 4 heads of 16 over 2 kv
	// heads, 2 layers.
	const T, Q, KD, lse, L = 8 * 256, 4 * 16, 2 * 16, 8 * 4 * 256, 2
	delta := cudaSizeClass(lse * 4)
	twoPass, qkv2 := ring(false)
	if want := delta + cudaSizeClass(2*2*T*KD*4); twoPass != want {
		t.Errorf("two passes: the ring's terms are %d bytes, want %d (delta and the dk, dv partials)", twoPass, want)
	}
	onePass, qkv1 := ring(true)
	if want := delta + cudaSizeClass(T*Q*2); onePass != want {
		t.Errorf("one pass: the ring's terms are %d bytes, want %d (delta and da's bf16 copy)", onePass, want)
	}
	qkvBytes := func(size int64) int64 { return L * (cudaSizeClass(T*Q*size) + 2*cudaSizeClass(T*KD*size)) }
	if got, want := qkv2-qkv1, qkvBytes(4)-qkvBytes(2); got != want {
		t.Errorf("one pass keeps %d bytes fewer of q, k and v than two passes, want %d (bf16 instead of float32)", got, want)
	}
}
