package engine

// Checkpoints: what a rank saves, how a run resumes, and how a recipe change
// is judged on resume. The on-disk format is package checkpoint's; here is
// only what the engine puts in it.
//
// Model tensors keep their Hugging Face names, one tensor per expert, so a
// checkpoint written under one parallel layout loads under any other: a
// rank reads the tensors it holds by name. World rank 0 writes the
// replicated tensors; the ranks of the first data-parallel replica at
// context-parallel position 0 write their experts (the other cp ranks hold
// the same ones). The cp ranks of one data replica read the same data, so
// the data cursors are kept by data rank. Optimizer moments are "<name>.exp_avg" and
// "<name>.exp_avg_sq"; expert biases "model.layers.<l>.block_sparse_moe.expert_bias".
//
// Under tensor parallelism the tp ranks of world rank 0's tensor group
// hand in their blocks of the split tensors (and moments) as flat pieces of
// the whole tensors, which the saver joins (joinMoments) before writing,
// and a rank reads a split tensor whole and keeps its block: the
// checkpoint holds whole tensors under every tp.
//
// With ZeRO-1 (parallel.zero: 1) every rank holds a part of the replicated
// moments; the saver joins the parts into the whole tensors world rank 0
// writes without ZeRO, so the checkpoint does not depend on the setting
// (zero.go).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/data"
)

// trainState is the engine's part of a checkpoint's state.json.
type trainState struct {
	Step        int           `json:"step"`
	Tokens      int64         `json:"tokens"`
	DataCursors []data.Cursor `json:"data_cursors"` // train loader position, by data rank
	LR          float64       `json:"lr"`           // schedule position: the rate of Step
	Config      Config        `json:"config"`
	Recipe      string        `json:"recipe,omitempty"` // the recipe's YAML snapshot
	RecipeHash  string        `json:"recipe_hash,omitempty"`
	// Tokenizer is the SHA-256 of the run's tokenizer.json, which the
	// checkpoint holds; "" for byte-level (tokenizer.go).
	Tokenizer string    `json:"tokenizer_sha256,omitempty"`
	Mesh      comm.Mesh `json:"mesh"`
	Backend   string    `json:"backend"`
	Version   string    `json:"mktrain_version"`
	SavedAt   time.Time `json:"saved_at"`
}

func biasName(l int) string { return layerName(l, "block_sparse_moe.expert_bias") }

// rankSnapshot is one rank's share of a checkpoint, copied to host memory
// so training can go on while it is written.
type rankSnapshot struct {
	worldRank    int
	model, optim []checkpoint.NamedTensor
	cursor       data.Cursor
	dataRank     int
}

// snapshot copies this rank's share of the model and optimizer state.
func (r *rank) snapshot(worldRank int) rankSnapshot {
	s := rankSnapshot{worldRank: worldRank, dataRank: r.groups.Data.Rank()}
	if src, ok := r.train.(cursorSource); ok {
		s.cursor = src.Cursor()
	}
	writesReplicated := worldRank == 0
	writesExperts := r.groups.ExpertReplica.Rank() == 0 && r.groups.Context.Rank() == 0
	// The blocks of tensors split over tp come from the tensor group of
	// world rank 0, to be joined into whole tensors (joinMoments).
	writesBlocks := r.groups.Data.Rank() == 0 && r.groups.Context.Rank() == 0
	for _, p := range r.params {
		switch {
		case p.slot.role == roleExpert && !writesExperts,
			p.slot.role != roleExpert && p.split.n > 1 && !writesBlocks,
			p.slot.role != roleExpert && p.split.n == 1 && !writesReplicated:
			continue
		}
		// p.m is nil for a replicated tensor under ZeRO-1: its moments
		// come in pieces, below.
		w := p.download(r.b)
		var m, v []float32
		if p.m != nil {
			m, v = backend.DownloadFloat32(r.b, p.m), backend.DownloadFloat32(r.b, p.v)
		}
		if p.split.n > 1 {
			s.model = append(s.model, p.blocks(p.slot.name, w, 0, len(w))...)
			if m != nil {
				s.optim = append(s.optim, p.blocks(p.slot.name+suffixAvg, m, 0, len(m))...)
				s.optim = append(s.optim, p.blocks(p.slot.name+suffixAvgSq, v, 0, len(v))...)
			}
			continue
		}
		for _, piece := range p.pieces() {
			at := func(x []float32) []float32 { return x[piece.offset : piece.offset+piece.size] }
			s.model = append(s.model, checkpoint.NamedTensor{Name: piece.name, Shape: piece.shape, Data: at(w)})
			if m != nil {
				s.optim = append(s.optim,
					checkpoint.NamedTensor{Name: piece.name + suffixAvg, Shape: piece.shape, Data: at(m)},
					checkpoint.NamedTensor{Name: piece.name + suffixAvgSq, Shape: piece.shape, Data: at(v)})
			}
		}
	}
	if r.zero {
		s.optim = append(s.optim, r.momentPieces()...)
	}
	if writesReplicated {
		for l, bias := range r.biasE {
			s.model = append(s.model, checkpoint.NamedTensor{Name: biasName(l), Shape: bias.Shape(), Data: backend.DownloadFloat32(r.b, bias)})
		}
	}
	return s
}

// tensorPiece is one named tensor inside a parameter: the whole parameter,
// or one expert of a stacked expert parameter.
type tensorPiece struct {
	name         string
	shape        []int
	offset, size int
}

func (p *param) pieces() []tensorPiece {
	shape := p.w.Shape()
	if p.slot.role != roleExpert {
		return []tensorPiece{{name: p.slot.name, shape: shape, size: p.w.Len()}}
	}
	per := p.w.Len() / shape[0]
	out := make([]tensorPiece, shape[0])
	for j := range out {
		out[j] = tensorPiece{name: fmt.Sprintf(p.slot.name, p.firstExpert+j), shape: shape[1:], offset: j * per, size: per}
	}
	return out
}

// blocks returns the elements [lo, hi) of p's tp block, held in local
// (their first at local[0]), as blocks of the flattened whole tensor named
// name: one per run contiguous in it (tpSplit.segments).
func (p *param) blocks(name string, local []float32, lo, hi int) []checkpoint.NamedTensor {
	n := shapeLen(p.global)
	var out []checkpoint.NamedTensor
	for _, sg := range p.split.segments(p.global) {
		a, b := max(lo, sg.local), min(hi, sg.local+sg.n)
		if a >= b {
			continue
		}
		out = append(out, checkpoint.NamedTensor{Name: name, Shape: []int{b - a}, Data: local[a-lo : b-lo],
			Slice: &checkpoint.Slice{Offset: []int{sg.global + a - sg.local}, GlobalShape: []int{n}}})
	}
	return out
}

// readBlock reads the tensor name from set whole and keeps p's tp block
// of it, into dst (of the block's length).
func (p *param) readBlock(set *checkpoint.TensorSet, name string, dst []float32) error {
	whole := make([]float32, shapeLen(p.global))
	if err := set.ReadInto(name, whole); err != nil {
		return err
	}
	copy(dst, p.split.block(whole, p.global))
	return nil
}

// cursorSource is a batch source whose position a checkpoint can keep.
type cursorSource interface {
	Cursor() data.Cursor
	Seek(data.Cursor) error
}

// restore loads this rank's tensors from ck by name. withOptimizer is false
// when initialising from weights alone.
func (r *rank) restore(ctx context.Context, ck *checkpoint.Checkpoint, withOptimizer bool) error {
	type source struct {
		set    *checkpoint.TensorSet
		t      backend.Tensor
		suffix string
	}
	for i := range r.params {
		// A large model takes seconds to read: a stop between two
		// tensors leaves the rank half restored, which is fine, as the
		// run ends without training.
		if ctx.Err() != nil {
			return ErrStopped
		}
		p := &r.params[i]
		targets := []source{{ck.Model(), p.w, ""}}
		if withOptimizer && p.m != nil { // nil: a replicated tensor under ZeRO-1, read below
			targets = append(targets, source{ck.Optim(), p.m, suffixAvg}, source{ck.Optim(), p.v, suffixAvgSq})
		}
		for j, tg := range targets {
			host := make([]float32, tg.t.Len())
			if p.split.n > 1 {
				if err := p.readBlock(tg.set, p.slot.name+tg.suffix, host); err != nil {
					return err
				}
			} else {
				for _, piece := range p.pieces() {
					if err := tg.set.ReadInto(piece.name+tg.suffix, host[piece.offset:piece.offset+piece.size]); err != nil {
						return err
					}
				}
			}
			if j == 0 {
				p.upload(r.b, host) // the weight: split where its master is
			} else {
				backend.UploadSlice(r.b, tg.t, host)
			}
		}
	}
	if withOptimizer && r.zero {
		if err := r.restoreMomentPieces(ck); err != nil {
			return err
		}
	}
	for l, bias := range r.biasE {
		host := make([]float32, bias.Len())
		if err := ck.Model().ReadInto(biasName(l), host); err != nil {
			if !withOptimizer {
				continue // weights from elsewhere start with zero biases
			}
			return err
		}
		backend.UploadSlice(r.b, bias, host)
	}
	clear(r.biasHost) // the restored biases are read again at the next update
	return nil
}

// saver writes checkpoints of one run, in the background when
// checkpoint.async is set. A save waits for the previous one.
type saver struct {
	e       *Engine
	root    string
	pending chan error // result of the save in flight; nil when none
	last    int        // step of the newest save started
	// lastDir is the newest checkpoint: the one resumed from, then each
	// one committed (read after wait, which orders it after an
	// asynchronous write).
	lastDir string
}

// save writes the snapshots of every rank as the checkpoint of step.
func (s *saver) save(snaps []rankSnapshot, st trainState) error {
	if err := s.wait(); err != nil {
		return err
	}
	s.last = st.Step
	if !s.e.cfg.Checkpoint.Async {
		return s.write(snaps, st)
	}
	done := make(chan error, 1)
	s.pending = done
	go func() { done <- s.write(snaps, st) }()
	return nil
}

// wait returns the result of the save in flight, if any.
func (s *saver) wait() error {
	if s.pending == nil {
		return nil
	}
	err := <-s.pending
	s.pending = nil
	return err
}

func (s *saver) write(snaps []rankSnapshot, st trainState) error {
	cfg := s.e.cfg.Checkpoint
	start := time.Now()
	sv, err := checkpoint.BeginSave(s.root, st.Step)
	if err != nil {
		return err
	}
	defer sv.Abort()
	if snaps, err = joinMoments(snaps, s.e.cfg.Model); err != nil {
		return err
	}
	st.DataCursors = make([]data.Cursor, 0, len(snaps))
	for _, snap := range snaps {
		if snap.dataRank == len(st.DataCursors) {
			st.DataCursors = append(st.DataCursors, snap.cursor)
		}
		if len(snap.model) > 0 {
			if err := sv.WriteTensors(checkpoint.ModelFile(snap.worldRank), snap.model, checkpoint.TensorOptions{DType: safetensors.F32}); err != nil {
				return err
			}
		}
		if len(snap.optim) > 0 {
			opts := checkpoint.TensorOptions{DType: safetensors.F32, Compress: cfg.Compress == "zstd"}
			if err := sv.WriteTensors(checkpoint.OptimFile(snap.worldRank), snap.optim, opts); err != nil {
				return err
			}
		}
	}
	if tok := s.e.tokenizer; tok != nil {
		if err := tok.writeCheckpoint(sv); err != nil {
			return err
		}
	}
	st.Tokenizer = s.e.tokenizer.hash()
	st.SavedAt = time.Now().UTC()
	if err := sv.WriteState(st); err != nil {
		return err
	}
	if err := sv.Commit(); err != nil {
		return err
	}
	s.lastDir = sv.Dir()
	if err := checkpoint.Prune(s.root, cfg.KeepLast); err != nil {
		s.e.log.Warn().Err(err).Msg("cannot prune old checkpoints")
	}
	var bytes int64
	if ck, err := checkpoint.ReadManifest(sv.Dir()); err == nil {
		for _, f := range ck.Files {
			bytes += f.Size
		}
	}
	took := time.Since(start)
	s.e.log.Info().Int("step", st.Step).Str("dir", sv.Dir()).Int64("bytes", bytes).
		Str("took", took.Round(time.Millisecond).String()).Msg("checkpoint saved")
	return s.e.reportSave(SaveEvent{Step: st.Step, Dir: sv.Dir(), Bytes: bytes, Duration: took, Async: cfg.Async})
}

// resumePoint finds the checkpoint a run continues from: none for a fresh
// run, else the directory and its state. The recipe may change fields that
// do not touch the model's shape; those changes are logged.
func (e *Engine) resumePoint(ctx context.Context, root string) (string, *trainState, error) {
	mode := e.cfg.Checkpoint.Resume
	var dir string
	switch mode {
	case "never":
		if infos, err := checkpoint.List(root); err == nil && len(infos) > 0 {
			return "", nil, fmt.Errorf("checkpoint.resume is never, but %s already holds checkpoints; choose another --run-dir or set checkpoint.resume: auto", root)
		}
		return "", nil, nil
	case "auto":
		d, err := checkpoint.FindResumableContext(ctx, root, func(msg string) { e.log.Warn().Msg(msg) })
		if errors.Is(err, checkpoint.ErrNoCheckpoint) || errors.Is(err, os.ErrNotExist) {
			return "", nil, nil
		}
		if err != nil {
			return "", nil, err
		}
		// The pointer may lag behind d after a crash mid-save (or name
		// a checkpoint that failed to verify): it names what the run
		// continues from.
		if err := checkpoint.SetLatest(root, d); err != nil {
			e.log.Warn().Err(err).Msg("could not point latest at the checkpoint resumed from")
		}
		dir = d
	default:
		// A checkpoint, or a run directory or checkpoints root standing
		// for its newest checkpoint that verifies.
		d, err := ResolveCheckpointContext(ctx, mode, func(msg string) { e.log.Warn().Msg(msg) })
		if err != nil {
			return "", nil, fmt.Errorf("checkpoint.resume: %w", err)
		}
		dir = d
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return "", nil, err
	}
	defer ck.Close()
	var st trainState
	if err := ck.ReadState(&st); err != nil {
		return "", nil, err
	}
	changes := diffFields(reflect.ValueOf(st.Config), reflect.ValueOf(e.cfg), "")
	var refused []string
	for _, c := range changes {
		switch {
		case strings.HasPrefix(c, "model.moe.dispatcher:"):
			// How rows reach the experts, not the model: any value resumes.
			e.log.Info().Str("change", c).Msg("resuming with a changed recipe field")
		case strings.HasPrefix(c, "model."):
			refused = append(refused, c)
		case strings.HasPrefix(c, "checkpoint.resume"):
		default:
			e.log.Info().Str("change", c).Msg("resuming with a changed recipe field")
		}
	}
	if len(refused) > 0 {
		return "", nil, fmt.Errorf("cannot resume from %s: the model changed (%s); a checkpoint only resumes the model it was trained with; start a new --run-dir or set checkpoint.resume: never",
			dir, strings.Join(refused, "; "))
	}
	// Token ids mean what the tokenizer says: another one would train the
	// same embeddings on other meanings.
	if now := e.tokenizer.hash(); st.Tokenizer != now {
		return "", nil, fmt.Errorf("cannot resume from %s: it was trained with %s, and this run has %s; resume with the tokenizer it was trained with (its copy is in the checkpoint), or start a new --run-dir",
			dir, describeTokenizer(st.Tokenizer), describeTokenizer(now))
	}
	return dir, &st, nil
}

// diffFields lists the fields of two configs that differ, as
// "path: old -> new", with recipe (yaml) paths.
func diffFields(a, b reflect.Value, prefix string) []string {
	var out []string
	t := a.Type()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name := strings.Split(f.Tag.Get("yaml"), ",")[0]
		path := prefix + name
		av, bv := a.Field(i), b.Field(i)
		if f.Type.Kind() == reflect.Struct {
			out = append(out, diffFields(av, bv, path+".")...)
			continue
		}
		if !reflect.DeepEqual(av.Interface(), bv.Interface()) {
			out = append(out, fmt.Sprintf("%s: %v -> %v", path, av.Interface(), bv.Interface()))
		}
	}
	return out
}

// restoreAll loads the checkpoint at dir into every rank and positions the
// data loaders.
func restoreAll(ctx context.Context, dir string, st *trainState, ranks []*rank) error {
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return err
	}
	defer ck.Close()
	for i, r := range ranks {
		if err := r.restore(ctx, ck, true); errors.Is(err, ErrStopped) {
			return err
		} else if err != nil {
			return fmt.Errorf("rank %d: %w", i, err)
		}
		src, ok := r.train.(cursorSource)
		if !ok || len(st.DataCursors) == 0 {
			continue
		}
		// Loader cursors count windows of the whole data order, so one
		// saved under any number of ranks positions every rank.
		if err := src.Seek(st.DataCursors[0]); err != nil {
			return fmt.Errorf("rank %d: %w", i, err)
		}
	}
	return nil
}
