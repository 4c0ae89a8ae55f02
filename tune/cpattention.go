package tune

// parallel.cp_attention: auto. The measurement is package attention's
// (attention.MeasureContext); this file settles the mode and keeps the
// answers in cp_attention.json, beside the dispatch table.

import (
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
)

// CPAttentionAuto is parallel.cp_attention's "measure and pick".
const CPAttentionAuto = "auto"

// cpResolveIters is the passes of each mode ResolveCPAttention times: one
// layer's attention forward and backward, enough for a stable median.
const cpResolveIters = 5

// CPAttentionCase is what ResolveCPAttention settles the mode for: the
// recipe's value, the attention shape, the micro-batch, and the context
// group: its size, and whether all of its ranks share one device.
type CPAttentionCase struct {
	Mode       string // parallel.cp_attention: ring, allgather, auto ("" is auto)
	Shape      attention.Shape
	Batch, Seq int // sequences per micro-batch, positions per sequence
	CP         int
	// OneDevice says the ranks of each context group are virtual ranks
	// of one device (the backend's); false for one rank per GPU or ranks
	// in several processes.
	OneDevice bool
	// Deterministic is train.deterministic: the run must repeat bit for
	// bit, so a timing must not choose.
	Deterministic bool
}

// ResolveCPAttention settles parallel.cp_attention for c on b and returns
// "ring" or "allgather":
//
//   - "ring" and "allgather" pass through (said in the log only with
//     more than one context rank).
//   - "auto" (or "") with one context rank is "allgather", silently:
//     nothing moves between ranks, and the mode is never used.
//   - "auto" under train.deterministic is "allgather", unmeasured: a
//     timing could choose differently from run to run, and the two modes
//     round differently.
//   - "auto" with a rank per GPU or ranks in several processes is
//     "allgather", unmeasured: the measurement runs on virtual ranks of
//     one device, which says nothing of the links between GPUs or nodes
//     (and nodes measuring for themselves could disagree); the all-gather
//     is the transport's own collective (NCCL's, the TCP group's), while
//     the portable ring's Send and Recv wait on the compute stream over
//     NCCL. Ask for ring to use it there.
//   - "auto" on the CPU backend is "allgather", unmeasured: the virtual
//     ranks share the host's cores, so the ring's overlap of transfer and
//     compute buys nothing while its extra attention calls and merges cost
//     time; the all-gather path is the reference; and the host has the
//     memory the ring would save.
//   - otherwise "auto" is the table's entry for this machine and case
//     (DefaultCPAttentionCache), or, when there is none, the faster mode
//     in a measurement on c.CP virtual ranks of b
//     (attention.MeasureContext), which is then stored. A table that
//     cannot be read or written costs a measurement, not the run.
//
// log, when not nil, receives one sentence on the choice and why. All
// ranks of a run must use the same mode: resolve once, before the ranks
// build their layers.
func ResolveCPAttention(b backend.Backend, c CPAttentionCase, log func(string)) (string, error) {
	say := sayTo(log)
	ring, gather := string(attention.CPRing), string(attention.CPAllGather)
	switch c.Mode {
	case ring, gather:
		if c.CP > 1 {
			say("parallel.cp_attention: %s, as the recipe says", c.Mode)
		}
		return c.Mode, nil
	case CPAttentionAuto, "":
	default:
		return "", fmt.Errorf("attention: parallel.cp_attention is %q; want %q, %q or %q", c.Mode, CPAttentionAuto, ring, gather)
	}
	switch {
	case c.CP <= 1:
		return gather, nil
	case c.Deterministic:
		say("parallel.cp_attention auto: allgather, unmeasured, as train.deterministic asks")
		return gather, nil
	case !c.OneDevice:
		say("parallel.cp_attention auto: allgather, unmeasured: the context ranks are on separate GPUs or nodes, whose links a measurement on virtual ranks would not see")
		return gather, nil
	case b.Name() == "cpu":
		say("parallel.cp_attention auto: allgather, unmeasured: on the CPU the virtual ranks share the cores, so the ring's overlap buys nothing")
		return gather, nil
	}
	key := NewCPAttentionKey(b, c)
	cache, noTable := DefaultCPAttentionCache()
	return settling[CPAttentionEntry, attention.ContextTiming]{
		setting: "parallel.cp_attention auto", what: "both modes", key: key,
		path: cache.Path, noTable: noTable,
		lookup: func() (CPAttentionEntry, bool, error) { return cache.Lookup(key) },
		store:  func(t attention.ContextTiming) error { _, err := cache.Store(key, t); return err },
		measure: func() (attention.ContextTiming, error) {
			t, err := attention.MeasureContext(b, c.Shape, c.Batch, c.Seq, c.CP, cpResolveIters)
			if err != nil {
				err = fmt.Errorf("attention: measuring the modes for parallel.cp_attention auto (set it to %q or %q to skip): %w", ring, gather, err)
			}
			return t, err
		},
		entry: func(e CPAttentionEntry) (string, string) {
			return e.Choice, fmt.Sprintf("measured %s: %.3g ms ring, %.3g ms allgather per forward+backward",
				e.MeasuredAt.Format(time.DateOnly), e.RingMS, e.AllGatherMS)
		},
		timing: func(t attention.ContextTiming) (string, string) {
			return string(t.Faster()), fmt.Sprintf("%.3g ms ring, %.3g ms allgather per forward+backward on %d virtual ranks",
				float64(t.Ring)/1e6, float64(t.AllGather)/1e6, c.CP)
		},
	}.settle(say)
}

// CPAttentionKey is what a measurement of the modes holds for: the
// machine, the software under the kernels and the build's kernels (as
// DispatchKey), and the shape: heads, kv heads, head dim, the
// micro-batch's sequences and their length, and the context ranks.
type CPAttentionKey struct {
	Machine  string `json:"machine"`
	Software string `json:"software,omitempty"`
	Kernels  string `json:"kernels"`
	Heads    int    `json:"heads"`
	KVHeads  int    `json:"kv_heads"`
	HeadDim  int    `json:"head_dim"`
	Batch    int    `json:"batch"`
	Seq      int    `json:"seq"`
	CP       int    `json:"cp"`
}

// NewCPAttentionKey is c's key on b.
func NewCPAttentionKey(b backend.Backend, c CPAttentionCase) CPAttentionKey {
	return CPAttentionKey{Machine: MachineName(b), Software: SoftwareName(b), Kernels: kernelsDigest(),
		Heads: c.Shape.Heads, KVHeads: c.Shape.KVHeads, HeadDim: c.Shape.HeadDim(), Batch: c.Batch, Seq: c.Seq, CP: c.CP}
}

func (k CPAttentionKey) String() string {
	sw := ""
	if k.Software != "" {
		sw = ", " + k.Software
	}
	return fmt.Sprintf("%s (kernels %s%s): %d heads over %d kv heads of %d, %d sequences of %d, cp %d", k.Machine, k.Kernels, sw, k.Heads, k.KVHeads, k.HeadDim, k.Batch, k.Seq, k.CP)
}

// CPAttentionEntry is one row of the table: a key, the mode chosen and
// the times it was chosen on (milliseconds per forward+backward).
type CPAttentionEntry struct {
	CPAttentionKey
	Choice      string    `json:"choice"`
	RingMS      float64   `json:"ring_forward_backward_ms"`
	AllGatherMS float64   `json:"allgather_forward_backward_ms"`
	Iters       int       `json:"iters"`
	MeasuredAt  time.Time `json:"measured_at"`
}

// cpAttentionTableVersion is the file format; a file of another version
// is ignored (and replaced by the next Store).
const cpAttentionTableVersion = 1

// CPAttentionCache is the table file at Path.
type CPAttentionCache struct{ Path string }

// DefaultCPAttentionCache is cp_attention.json in the dispatch table's
// directory ($MKTRAIN_CACHE_DIR, else os.UserCacheDir()/mktrain).
func DefaultCPAttentionCache() (CPAttentionCache, error) {
	d, err := DefaultDispatchCache()
	if err != nil {
		return CPAttentionCache{}, err
	}
	return CPAttentionCache{Path: filepath.Join(filepath.Dir(d.Path), "cp_attention.json")}, nil
}

func (c CPAttentionCache) read() ([]CPAttentionEntry, error) {
	return readTable[CPAttentionEntry](c.Path, "attention: cp_attention table", cpAttentionTableVersion)
}

// Lookup returns the entry for k, and whether there is one.
func (c CPAttentionCache) Lookup(k CPAttentionKey) (CPAttentionEntry, bool, error) {
	entries, err := c.read()
	if err != nil {
		return CPAttentionEntry{}, false, err
	}
	for _, e := range entries {
		if e.CPAttentionKey == k && (e.Choice == string(attention.CPRing) || e.Choice == string(attention.CPAllGather)) {
			return e, true, nil
		}
	}
	return CPAttentionEntry{}, false, nil
}

// Store records t's choice for k, replacing any entry for k, as
// DispatchCache.Store does (the file replaced whole, its directory made).
func (c CPAttentionCache) Store(k CPAttentionKey, t attention.ContextTiming) (CPAttentionEntry, error) {
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	e := CPAttentionEntry{CPAttentionKey: k, Choice: string(t.Faster()), RingMS: ms(t.Ring), AllGatherMS: ms(t.AllGather),
		Iters: t.Iters, MeasuredAt: time.Now().UTC().Truncate(time.Second)}
	err := storeEntry(c.Path, "attention: cp_attention table", cpAttentionTableVersion, e,
		func(o CPAttentionEntry) bool { return o.CPAttentionKey == k },
		func(a, b CPAttentionEntry) int {
			return strings.Compare(a.CPAttentionKey.String(), b.CPAttentionKey.String())
		})
	if err != nil {
		return e, err
	}
	return e, nil
}
