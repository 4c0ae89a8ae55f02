package attention

// Timing the context-parallel modes on the machine at hand, for
// parallel.cp_attention: auto (package tune keeps the answers on disk).

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/internal/ranktime"
)

// ContextTiming is a measurement of the two modes: the median over Iters
// passes of one ContextCore's Forward and Backward on rank 0, the ranks
// meeting before and after each pass.
type ContextTiming struct {
	AllGather, Ring time.Duration
	Iters           int
}

// Faster is the mode of the shorter median; a tie goes to the all-gather
// path, the reference.
func (t ContextTiming) Faster() CPMode {
	if t.Ring < t.AllGather {
		return CPRing
	}
	return CPAllGather
}

// measureWarmup passes of each mode run before the timed ones (kernel
// loading, the allocator's first sizes).
const measureWarmup = 1

// MeasureContext times the cores of both modes for micro-batches of batch
// sequences of seq positions split over w virtual ranks of b (comm.NewLocal:
// goroutines of this process sharing b), iters passes each, the modes
// alternating. The inputs are random; the tensors are garbage once it
// returns.
func MeasureContext(b backend.Backend, s Shape, batch, seq, w, iters int) (ContextTiming, error) {
	if w < 2 || iters < 1 {
		return ContextTiming{}, fmt.Errorf("attention: MeasureContext: %d ranks and %d passes; want at least 2 and 1", w, iters)
	}
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: w, TP: 1}, b)
	if err != nil {
		return ContextTiming{}, err
	}
	modes := []CPMode{CPAllGather, CPRing}
	type rankState struct {
		cores                  []*ContextCore
		qkv                    [][3]backend.Tensor // q, k, v per mode, of its core's QKVType
		a, lse, da, dq, dk, dv backend.Tensor
	}
	rows, qw, kd := batch*seq/w, s.Heads*s.HeadDim(), s.KVHeads*s.HeadDim()
	rng := rand.New(rand.NewPCG(uint64(w), uint64(seq)))
	random := func(n ...int) backend.Tensor {
		t := b.New(b.FloatType(), n...)
		host := make([]float32, t.Len())
		for i := range host {
			host[i] = float32(rng.NormFloat64())
		}
		backend.UploadSlice(b, t, host)
		return t
	}
	// as is x in type dt: x itself, or a copy (the one-pass ring's cores
	// take q, k and v in bf16, as the layers keep them).
	as := func(dt backend.DType, x backend.Tensor) backend.Tensor {
		if x.DType() == dt {
			return x
		}
		y := b.New(dt, x.Shape()...)
		b.Copy(y, x)
		return y
	}
	states := make([]rankState, w)
	for r, rk := range world {
		st := &states[r]
		q, k, v := random(rows, qw), random(rows, kd), random(rows, kd)
		for _, m := range modes {
			c, err := NewContextCore(b, s, batch, seq, rk.Context, m)
			if err != nil {
				return ContextTiming{}, err
			}
			st.cores = append(st.cores, c)
			st.qkv = append(st.qkv, [3]backend.Tensor{as(c.QKVType(), q), as(c.QKVType(), k), as(c.QKVType(), v)})
		}
		st.da = random(rows, qw)
		st.a, st.dq = b.New(b.FloatType(), rows, qw), b.New(b.FloatType(), rows, qw)
		st.dk, st.dv = b.New(b.FloatType(), rows, kd), b.New(b.FloatType(), rows, kd)
		st.lse = b.New(b.FloatType(), batch*s.Heads*seq/w)
	}
	ts, err := ranktime.Medians(world, func(rk *comm.Ranks) comm.Group { return rk.Context }, len(modes), measureWarmup, iters,
		b.Sync, func(r, mode int) error {
			st := &states[r]
			c := st.cores[mode]
			qkv := st.qkv[mode]
			if err := c.Forward(st.a, st.lse, qkv[0], qkv[1], qkv[2]); err != nil {
				return err
			}
			return c.Backward(st.dq, st.dk, st.dv, st.da)
		})
	if err != nil {
		return ContextTiming{}, fmt.Errorf("attention: MeasureContext: %w", err)
	}
	return ContextTiming{AllGather: ts[0], Ring: ts[1], Iters: iters}, nil
}
