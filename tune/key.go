package tune

import (
	"cmp"
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/kernels"
	"github.com/mktrain/mktrain/moe"
)

// MachineName names the machine b computes on, for the dispatch table: the
// backend's name, followed by its device's where the backend tells it (an
// optional method DeviceName() string; a wrapper with Inner() is looked
// through). The CPU backend is "cpu".
func MachineName(b backend.Backend) string {
	if dn := lookThrough(b, func(d interface{ DeviceName() string }) string { return d.DeviceName() }); dn != "" {
		return b.Name() + "/" + dn
	}
	return b.Name()
}

// SoftwareName names the software under b's kernels, for the dispatch
// table: what the backend tells through an optional method
// SoftwareVersions() string (the CUDA backend: its driver's and NVRTC's
// versions), looked for as MachineName looks; "" when it tells nothing.
// A driver upgrade can change which dispatcher is faster, so it is part
// of the key.
func SoftwareName(b backend.Backend) string {
	return lookThrough(b, func(s interface{ SoftwareVersions() string }) string { return s.SoftwareVersions() })
}

// lookThrough returns get's answer for the first of b and the backends
// it wraps (Inner() backend.Backend) that implements T and answers
// something, or "".
func lookThrough[T any](b backend.Backend, get func(T) string) string {
	for b != nil {
		if t, ok := b.(T); ok {
			if v := get(t); v != "" {
				return v
			}
		}
		w, ok := b.(interface{ Inner() backend.Backend })
		if !ok {
			break
		}
		b = w.Inner()
	}
	return ""
}

// DispatchKey is what a measurement holds for: the machine, the software
// under the kernels (SoftwareName: a new driver is measured again), the
// build's kernels (kernels.Digest: new kernels are measured again) and the
// layer shape (tokens per rank, ep ranks).
type DispatchKey struct {
	Machine  string `json:"machine"`
	Software string `json:"software,omitempty"`
	Kernels  string `json:"kernels"`
	Dim      int    `json:"dim"`
	FFN      int    `json:"ffn"`
	Experts  int    `json:"experts"`
	TopK     int    `json:"top_k"`
	Tokens   int    `json:"tokens"`
	EP       int    `json:"ep"`
}

// NewDispatchKey is the key of layer cfg of width dim with tokens tokens
// per rank on ep expert-parallel ranks of b.
func NewDispatchKey(b backend.Backend, cfg moe.Config, dim, tokens, ep int) DispatchKey {
	return DispatchKey{Machine: MachineName(b), Software: SoftwareName(b), Kernels: kernelsDigest(), Dim: dim, FFN: cfg.FFN, Experts: cfg.Experts, TopK: cfg.TopK, Tokens: tokens, EP: ep}
}

// kernelsDigest is kernels.Digest, or "unknown" should the embedded
// sources not read (then the table is only consulted for that same
// answer, which costs a measurement at worst).
func kernelsDigest() string {
	d, err := kernels.Digest()
	if err != nil {
		return "unknown"
	}
	return d
}

func (k DispatchKey) String() string {
	sw := ""
	if k.Software != "" {
		sw = ", " + k.Software
	}
	return fmt.Sprintf("%s (kernels %s%s): dim %d, ffn %d, %d experts, top-%d, %d tokens per rank, ep %d", k.Machine, k.Kernels, sw, k.Dim, k.FFN, k.Experts, k.TopK, k.Tokens, k.EP)
}

func (k DispatchKey) compare(o DispatchKey) int {
	return cmp.Or(cmp.Compare(k.Machine, o.Machine), cmp.Compare(k.Software, o.Software), cmp.Compare(k.Kernels, o.Kernels), cmp.Compare(k.Dim, o.Dim), cmp.Compare(k.FFN, o.FFN),
		cmp.Compare(k.Experts, o.Experts), cmp.Compare(k.TopK, o.TopK), cmp.Compare(k.Tokens, o.Tokens), cmp.Compare(k.EP, o.EP))
}
