package moe

import "github.com/mktrain/mktrain/backend"

// Params are one MoE block's weights on one rank, or their gradients (the
// same shapes). Tensor layouts are Hugging Face Mixtral's, so export is a
// copy: expert j's w1 is W1EFD[j] of shape [F, D], like
// block_sparse_moe.experts.j.w1.weight.
type Params struct {
	GateED       backend.Tensor // router weight [E, D] (block_sparse_moe.gate.weight), replicated on every rank
	W1EFD, W3EFD backend.Tensor // this rank's experts only, [E_local, F, D] (experts.j.w1 / w3)
	W2EDF        backend.Tensor // [E_local, D, F] (experts.j.w2)

	// Shared experts, as one dense SwiGLU of width Fs = SharedExperts*FFN:
	// W1, W3 [Fs, D] and W2 [D, Fs]. Nil when SharedExperts is 0.
	SharedW1FD, SharedW3FD, SharedW2DF backend.Tensor
}

// NewParams allocates zeroed weights (or gradients) for a block of width dim
// whose rank holds localExperts experts.
func NewParams(b backend.Backend, cfg Config, dim, localExperts int) *Params {
	ft, E, F := b.FloatType(), cfg.Experts, cfg.FFN
	p := &Params{
		GateED: b.New(ft, E, dim),
		W1EFD:  b.New(ft, localExperts, F, dim),
		W3EFD:  b.New(ft, localExperts, F, dim),
		W2EDF:  b.New(ft, localExperts, dim, F),
	}
	if cfg.SharedExperts > 0 {
		fs := cfg.SharedExperts * F
		p.SharedW1FD = b.New(ft, fs, dim)
		p.SharedW3FD = b.New(ft, fs, dim)
		p.SharedW2DF = b.New(ft, dim, fs)
	}
	return p
}
