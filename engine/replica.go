package engine

// A trained model loaded back from a checkpoint onto one rank, running the
// forward pass without training: what package infer evaluates and samples
// with. Tensors are read by name, so a checkpoint written under any
// parallel layout loads; the model is the same code as training's, run
// with train=false.

import (
	"context"
	"fmt"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// Replica is a trained model loaded from a checkpoint onto one rank. It
// runs forward passes (Forward) and no training. It is not safe for
// concurrent use.
type Replica struct {
	cfg      Config
	dir      string
	step     int
	r        *rank
	forwards map[int]*Forward // by batch size; the rank's own model is train.micro_batch's

	engine *Engine // holds the backend LoadReplica opened, for Close
}

// LoadReplica loads the checkpoint dir stands for (see ResolveCheckpoint:
// a step directory, or a run directory or checkpoints root, whose newest
// verified checkpoint is taken) after verifying its checksums. The
// configuration is the one saved with the checkpoint, its parallel section
// reset to one rank. The model runs on the first GPU when there is one (and
// WithDrivers links its driver) and on the float32 CPU backend otherwise
// (whatever backend trained it), unless WithBackend names one; WithLogger
// receives warnings about skipped corrupt checkpoints and the backend
// chosen; other options are ignored. Close releases a GPU the replica
// opened.
func LoadReplica(dir string, opts ...Option) (_ *Replica, err error) {
	e := &Engine{log: zerolog.Nop()}
	for _, o := range opts {
		o(e)
	}
	ckDir, err := ResolveCheckpoint(dir, func(msg string) { e.log.Warn().Msg(msg) })
	if err != nil {
		return nil, err
	}
	ck, err := checkpoint.Open(ckDir)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	var st trainState
	if err := ck.ReadState(&st); err != nil {
		return nil, err
	}
	cfg := st.Config
	cfg.Parallel = ParallelConfig{DP: 1, EP: 1, CP: 1, TP: 1}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("checkpoint %s: the saved configuration does not validate: %w", ckDir, err)
	}
	if e.backend == nil {
		e.cfg = cfg
		e.cfg.Train.Backend = "auto"
		if e.backend, err = e.pickBackend(); err != nil {
			return nil, err
		}
		defer func() {
			if err != nil {
				e.Close()
			}
		}()
	}
	b := e.backend
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, b)
	if err != nil {
		return nil, err
	}
	r, err := newRank(context.Background(), servingConfig(cfg), b, world[0], nil, nil)
	if err != nil {
		return nil, err
	}
	if err := r.restore(context.Background(), ck, false); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", ckDir, err)
	}
	r.op.refresh(b) // the weights never change after this
	p := &Replica{cfg: cfg, dir: ckDir, step: st.Step, r: r, engine: e}
	p.forwards = map[int]*Forward{cfg.Train.MicroBatch: {m: r.model, biasE: r.biasE}}
	return p, nil
}

// Close releases the GPU LoadReplica opened, if any; the replica must not
// be used afterwards.
func (p *Replica) Close() error { return p.engine.Close() }

// Config is the model's configuration as saved with its checkpoint (one rank).
func (p *Replica) Config() Config { return p.cfg }

// Step is the training step of the checkpoint.
func (p *Replica) Step() int { return p.step }

// Dir is the checkpoint directory the replica was loaded from.
func (p *Replica) Dir() string { return p.dir }

// Forward returns the forward pass over micro-batches of batch sequences
// of train.seq tokens. It is built on first use, sharing the replica's
// weights, and kept: calls with the same batch return the same Forward,
// whose buffers (and last results) are one.
func (p *Replica) Forward(batch int) (*Forward, error) {
	if f, ok := p.forwards[batch]; ok {
		return f, nil
	}
	if batch <= 0 {
		return nil, fmt.Errorf("forward: batch %d; want a positive number of sequences", batch)
	}
	r := p.r
	m, err := newModel(context.Background(), r.b, r.cfg.Model, r.op.p, r.g, batch, p.cfg.Train.Seq,
		moe.Groups{Expert: r.groups.Expert, Data: r.groups.Data}, nil, "", nil, RecomputeNone, false, nil) // one context rank: no mode; no tensor parallelism; no backward to recompute for or gradients to write
	if err != nil {
		return nil, err
	}
	f := &Forward{m: m, biasE: r.biasE}
	p.forwards[batch] = f
	return f, nil
}

// Forward is the model's forward pass over one micro-batch of a fixed
// size, without training: Run it, then read the per-token losses or any
// row's logits.
type Forward struct {
	m     *model
	biasE []backend.Tensor
}

// Batch is the number of sequences of a micro-batch.
func (f *Forward) Batch() int { return f.m.batch }

// Seq is the number of tokens of a sequence (train.seq).
func (f *Forward) Seq() int { return f.m.seq }

// Run runs the model on one micro-batch: Batch() sequences of Seq() token
// ids, one after another, and their next-token targets (-1: score
// nothing). It returns the summed cross-entropy of the scored tokens.
func (f *Forward) Run(ids, targets []int32) (lossSum float64, err error) {
	n := f.m.batch * f.m.seq
	if len(ids) != n || len(targets) != n {
		return 0, fmt.Errorf("forward: %d ids and %d targets; a micro-batch of %d sequences of %d tokens has %d",
			len(ids), len(targets), f.m.batch, f.m.seq, n)
	}
	f.m.setBatch(ids, targets)
	st, err := f.m.forward(false, 0, 0, f.biasE)
	if err != nil {
		return 0, err
	}
	return st.lossSum, nil
}

// TokenLosses is the cross-entropy of every token of the last Run (0 where
// the target was -1).
func (f *Forward) TokenLosses() []float32 { return backend.DownloadFloat32(f.m.b, f.m.lossT) }

// Logits is the LM head's output at row t of the last Run (sequence
// t/Seq(), position t%Seq()): one logit per vocabulary entry.
func (f *Forward) Logits(t int) ([]float32, error) {
	if t < 0 || t >= f.m.tokens {
		return nil, fmt.Errorf("forward: row %d of a micro-batch of %d tokens", t, f.m.tokens)
	}
	return f.m.rowLogits(t), nil
}

// rowLogits computes the LM head's logits of row t of the last forward
// (whose loss may have left its gradient in the logits buffer).
func (m *model) rowLogits(t int) []float32 {
	b := m.b
	D, V := m.cfg.Dim, m.cfg.Vocab
	out := b.View(m.logitsCV, 0, 1, V)
	b.MatMul(out, b.View(m.finalTD, t*D, 1, D), m.w.lmHeadVD, false, true, 1, 0)
	return backend.DownloadFloat32(b, out)
}
