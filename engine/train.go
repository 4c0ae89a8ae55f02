package engine

// The training loop. Every rank runs loop in its own goroutine; rank 0 also
// reports and writes checkpoints. Read top to bottom: decide whether to
// stop, train one step, evaluate when due, report, save when due.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/launch"
)

// session is one Run's shared state across the ranks this process trains
// (all of them, unless the run is distributed).
type session struct {
	e      *Engine
	ranks  []*rank
	world  []*comm.Ranks // ranks[i]'s groups; world[i].Rank is its world rank
	start  time.Time
	resume *trainState    // nil for a fresh run
	saver  *saver         // nil without a run directory
	snaps  []rankSnapshot // by world rank: filled by every rank at a save, handed over by rank 0
	// distributed: other processes train the ranks not in world (see
	// distributed.go).
	distributed bool
	// votes[i] is where ranks[i] votes to stop, always on the host
	// (stopVotes). On GPUs the world group's collectives sit on the
	// device's queue, so a vote there would wait, every step, for the
	// optimizer the last step left running (rank.trainStep does not wait
	// for it).
	votes []stopVoter
	// pace fills in the machine's figures of each step (perf.go).
	pace *pace
}

// runWorld trains the ranks of world, which this process hosts: every rank
// of the mesh (virtual ranks), or its share of a distributed run.
//
// backends[i] is world[i]'s backend (one GPU each, with NCCL groups); nil
// puts every rank on e.backend (virtual ranks, or a process's ranks of a
// distributed run).
func (e *Engine) runWorld(ctx context.Context, world []*comm.Ranks, backends []backend.Backend, distributed bool, rdv *launch.Rendezvous) (res Result, err error) {
	if e.runDir == "" {
		// Embedders forget WithRunDir more easily than a command-line user
		// forgets --run-dir: say it before hours of training, not after.
		e.log.Warn().Msg("no run directory (engine.WithRunDir): no checkpoint will be saved, and a stopped run cannot be resumed")
		defer func() { res.Unsaved = true }()
	}
	if err := e.verifyData(ctx); err != nil {
		return Result{}, inputError(err)
	}
	// Every rank builds its layers with the one dispatcher settled here
	// (e.cfg, which checkpoints keep, stays as the recipe says).
	cfg, err := e.resolveDispatcher(e.cfg, world)
	if err != nil {
		return Result{}, err
	}
	if cfg, err = e.resolveCPAttention(cfg, !distributed && backends == nil); err != nil {
		return Result{}, err
	}
	if cfg, err = e.resolveTPOverlap(cfg, !distributed && backends == nil); err != nil {
		return Result{}, err
	}
	ranks := make([]*rank, len(world))
	// A large model takes a while to draw (moe-large's 9 billion weights):
	// say so before, and how long it took after.
	initStart := time.Now()
	e.log.Info().Int("ranks", len(world)).Int("params", ParamCount(cfg.Model)).Msg("initialising the model")
	for i, g := range world {
		// A rank's data part is its data group's: the data group holds one
		// rank per data replica (dp*ep), so the context-parallel ranks of a
		// replica read the same sequences, and each keeps its share of
		// every sequence (model.setBatch). It depends on the rank alone,
		// not on the process that trains it.
		train, val, err := e.openData(g.Data.Rank(), g.Data.Size())
		if err != nil {
			return Result{}, inputError(err)
		}
		b := e.backend
		if backends != nil {
			b = backends[i]
		}
		if ranks[i], err = newRank(ctx, cfg, b, g, train, val); errors.Is(err, ErrStopped) {
			return Result{}, ErrStopped
		} else if err != nil {
			return Result{}, fmt.Errorf("rank %d: %w", g.Rank, err)
		}
		if i == 0 && cfg.Parallel.CP > 1 && len(ranks[0].model.attn) > 0 {
			e.log.Info().Msgf("parallel: context-parallel attention runs the %s", ranks[0].model.attn[0].ContextPath())
		}
	}
	e.log.Info().Str("took", time.Since(initStart).Round(time.Millisecond).String()).Msg("model initialised")
	e.logTPPaths(cfg, ranks)
	s := &session{e: e, ranks: ranks, world: world, snaps: make([]rankSnapshot, cfg.mesh().World()), distributed: distributed}
	voteOn := e.backend // the votes' host group holds no tensors, but its ranks name a backend
	if backends != nil {
		voteOn = backends[0]
	}
	if s.votes, err = stopVotes(world, distributed, rdv, voteOn); err != nil {
		return Result{}, err
	}
	if e.runDir != "" {
		root := filepath.Join(e.runDir, "checkpoints")
		s.saver = &saver{e: e, root: root}
		dir, st, err := e.resumePoint(ctx, root)
		if err != nil && ctx.Err() != nil {
			return Result{}, ErrStopped // while verifying the checkpoints
		}
		if err != nil {
			return Result{}, inputError(err)
		}
		if dir != "" {
			if err := restoreAll(ctx, dir, st, ranks); errors.Is(err, ErrStopped) {
				return Result{}, ErrStopped
			} else if err != nil {
				return Result{}, inputError(fmt.Errorf("resuming from %s: %w", dir, err))
			}
			s.resume, s.saver.lastDir = st, dir
			e.log.Info().Str("checkpoint", dir).Int("step", st.Step).Msg("resuming")
		}
	}
	// After the resume check, which refuses a run under another
	// tokenizer: a refused run leaves the directory's tokenizer as it was.
	if err := e.copyTokenizer(world); err != nil {
		return Result{}, err
	}
	startStep := 0
	if s.resume != nil {
		startStep = s.resume.Step
	}
	closeMetrics, err := e.openMetricsFile(world, startStep)
	if err != nil {
		return Result{}, err
	}
	defer closeMetrics()
	if s.resume == nil && cfg.Checkpoint.InitFrom != "" {
		if err := e.loadHF(cfg.Checkpoint.InitFrom, ranks); err != nil {
			return Result{}, inputError(err)
		}
	}
	e.log.Info().Int("ranks", len(ranks)).Str("backend", e.backend.Name()).
		Int("params", ParamCount(cfg.Model)).Int("steps", cfg.Train.Steps).Msg("training starts")
	e.logOptimizerMemory(ranks)
	finish, err := s.begin(backends, startStep)
	if err != nil {
		return Result{}, err
	}
	defer finish()
	res, err = s.run(ctx)
	res.Dispatcher = cfg.Model.MoE.Dispatcher
	return res, err
}

// verifyData reads the recipe's shards in full before anything is built,
// so that a bad token id, header or size fails the run before step 1,
// naming the file and position, not at the step that reads it (after the
// steps before it were spent, and again on every resume).
func (e *Engine) verifyData(ctx context.Context) error {
	c := e.cfg
	for _, d := range []struct{ field, glob string }{{"data.train", c.Data.Train}, {"data.val", c.Data.Val}} {
		if d.glob == "" {
			continue // the embedded corpus, or openData's error
		}
		start := time.Now()
		paths, err := data.Glob(d.glob)
		if err != nil {
			return fmt.Errorf("%s: %w", d.field, err)
		}
		sum, err := data.Verify(ctx, paths, c.Model.Vocab)
		if ctx.Err() != nil {
			return ErrStopped
		}
		if bad := (*data.TokenError)(nil); errors.As(err, &bad) {
			return fmt.Errorf("%s: %w (model.vocab)", d.field, err)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", d.field, err)
		}
		e.log.Info().Str("data", d.field).Int("shards", len(sum.Shards)).Int64("tokens", sum.Tokens).
			Str("took", time.Since(start).Round(time.Millisecond).String()).Msg("data verified")
	}
	return nil
}

func (s *session) run(ctx context.Context) (Result, error) {
	var (
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
		result  Result
	)
	fail := func(err error) {
		errOnce.Do(func() {
			first = err
			// Wake every rank blocked in a collective so none waits for
			// the one that failed. A distributed run's stop is not a
			// failure: every rank of every process stops at the same
			// step by itself, and an abort would reach the other
			// processes as one.
			if s.distributed && errors.Is(err, ErrStopped) {
				return
			}
			for _, g := range s.world {
				g.Abort(err)
			}
			for _, v := range s.votes {
				v.Abort(err)
			}
		})
	}
	s.start = time.Now()
	for i, r := range s.ranks {
		worldRank := s.world[i].Rank
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if p := recover(); p != nil {
					fail(fmt.Errorf("rank %d: internal error: %v\n%s", worldRank, p, debug.Stack()))
				}
			}()
			res, err := s.loop(ctx, r, worldRank, s.votes[i])
			if i == 0 { // every rank's result is the same
				result = res
			}
			switch {
			case err == nil:
			case errors.Is(err, ErrStopped):
				if i == 0 {
					fail(err)
				}
			default:
				fail(fmt.Errorf("rank %d: %w", worldRank, err))
			}
		}()
	}
	wg.Wait()
	if s.saver != nil {
		if err := s.saver.wait(); err != nil && (first == nil || errors.Is(first, ErrStopped)) {
			first = err
		}
		result.Checkpoint = s.saver.lastDir
	}
	result.Elapsed = time.Since(s.start)
	// The first error is the cause; ranks woken by the abort report later
	// and are ignored.
	return result, first
}

// stopVoter is where a rank votes to stop: every rank of the run brings
// its vote and all get the same sum (comm.Group's AllReduceFloat64);
// Abort wakes the ranks waiting in it.
type stopVoter interface {
	AllReduceFloat64(vals []float64) error
	Abort(err error)
}

// stopVotes returns where each of world's ranks votes to stop, always on
// the host: in a run of one process, a group of its ranks (comm.NewLocal's,
// whose float64 sums never touch b); in a distributed run whose world
// group meets on the host (TCP), that group; in one over several processes
// whose groups are the devices' (NCCL: rdv is the run's rendezvous), the
// process's ranks meet on the host and its first rank adds the processes'
// sums over the rendezvous (nodeVote).
func stopVotes(world []*comm.Ranks, distributed bool, rdv *launch.Rendezvous, b backend.Backend) ([]stopVoter, error) {
	votes := make([]stopVoter, len(world))
	if distributed && rdv == nil {
		for i, g := range world {
			votes[i] = g.World
		}
		return votes, nil
	}
	local, err := comm.NewLocal(comm.Mesh{DP: len(world), EP: 1, CP: 1, TP: 1}, b)
	if err != nil {
		return nil, err
	}
	for i := range world {
		votes[i] = local[i].World
		if distributed {
			v := nodeVote{local: local[i].World}
			if i == 0 {
				v.rdv = rdv
			}
			votes[i] = v
		}
	}
	return votes, nil
}

// nodeVote is a rank's stop vote in a run over several processes whose
// groups are the devices': the process's ranks add their votes on the host
// (local), the process's first rank adds the processes' sums over the
// rendezvous (rdv, nil on the others), and the total reaches every rank of
// the process by a second sum on the host, to which only the first rank
// brings it.
type nodeVote struct {
	local comm.Group
	rdv   *launch.Rendezvous
}

func (v nodeVote) AllReduceFloat64(vals []float64) error {
	if err := v.local.AllReduceFloat64(vals); err != nil {
		return err
	}
	total := make([]float64, len(vals))
	if v.rdv != nil {
		copy(total, vals)
		if err := v.rdv.AllReduceFloat64(total); err != nil {
			v.local.Abort(err) // the process's other ranks wait for the total
			return err
		}
	}
	if err := v.local.AllReduceFloat64(total); err != nil {
		return err
	}
	copy(vals, total)
	return nil
}

func (v nodeVote) Abort(err error) { v.local.Abort(err) }

// loop is one rank's training loop; vote is where it votes to stop
// (session.votes).
func (s *session) loop(ctx context.Context, r *rank, worldRank int, vote stopVoter) (Result, error) {
	cfg := s.e.cfg
	lead := worldRank == 0
	res := Result{Loss: math.NaN(), ValLoss: math.NaN()}
	if s.resume != nil {
		res.StartStep, res.Steps, res.Tokens = s.resume.Step, s.resume.Step, s.resume.Tokens
	}
	firstStep := res.Steps + 1
	lastSaved := res.Steps
	if s.distributed {
		if err := s.checkResume(r, worldRank); err != nil {
			return res, err
		}
	}
	tokensPerStep := int64(cfg.Train.GlobalBatch * cfg.Train.Seq)
	for step := firstStep; step <= cfg.Train.Steps; step++ {
		// Every rank stops at the same step: each reads its context (in a
		// distributed run, its process's: Ctrl-C on any node stops them
		// all) and the world group sums the votes.
		stop := []float64{0}
		if ctx.Err() != nil {
			stop[0] = 1
		}
		if err := vote.AllReduceFloat64(stop); err != nil {
			return res, err
		}
		if stop[0] > 0 {
			if res.Steps > lastSaved {
				if err := s.checkpoint(r, worldRank, res); err != nil {
					return res, err
				}
			}
			return res, ErrStopped
		}

		t0 := time.Now()
		sr, err := r.trainStep(step)
		if err != nil {
			return res, err
		}
		stepTime := time.Since(t0)
		res.Steps, res.Loss = step, sr.loss
		res.Tokens += tokensPerStep

		ev := StepEvent{
			Step: step, Steps: cfg.Train.Steps, Loss: sr.loss, AuxLoss: sr.auxLoss, ZLoss: sr.zLoss,
			LR: sr.lr, GradNorm: sr.gradNorm, Tokens: res.Tokens,
			TokensPerSec: float64(tokensPerStep) / stepTime.Seconds(),
			Elapsed:      time.Since(s.start), ValLoss: math.NaN(),
			Experts: expertLoads(sr),
		}
		stopped := false // during the validation: the step is logged and saved without it
		if (cfg.Train.EvalEvery > 0 && step%cfg.Train.EvalEvery == 0) || step == cfg.Train.Steps {
			v, err := r.evaluate(ctx, vote)
			switch {
			case errors.Is(err, ErrStopped):
				stopped = true
			case err != nil:
				return res, err
			default:
				res.ValLoss, ev.ValLoss = v, v
				ev.ValBatches = cfg.Train.EvalBatches * r.groups.Data.Size()
			}
		}
		if lead {
			s.pace.fill(&ev)
			if err := s.e.report(ev); err != nil {
				return res, err
			}
		}
		if stopped {
			if err := s.checkpoint(r, worldRank, res); err != nil {
				return res, err
			}
			return res, ErrStopped
		}
		if every := cfg.Checkpoint.Every; (every > 0 && step%every == 0) || step == cfg.Train.Steps {
			if err := s.checkpoint(r, worldRank, res); err != nil {
				return res, err
			}
			lastSaved = step
		}
	}
	// A step does not wait for its optimizer (rank.trainStep): the last
	// one's errors surface here.
	return res, r.b.Sync()
}

// checkpoint saves the state after res.Steps. Every rank snapshots its
// share; rank 0 hands them to the saver (in a distributed run, once the
// other processes' ranks have sent theirs). Without a run directory it does
// nothing.
func (s *session) checkpoint(r *rank, worldRank int, res Result) error {
	if s.saver == nil {
		return nil
	}
	// The step's optimizer may still be running (rank.trainStep): the
	// snapshot's downloads wait for it, and a failure in it must not reach
	// a checkpoint.
	if err := r.b.Sync(); err != nil {
		return fmt.Errorf("checkpoint of step %d: %w", res.Steps, err)
	}
	s.snaps[worldRank] = r.snapshot(worldRank)
	if s.distributed {
		if err := s.gatherSnapshots(r, worldRank); err != nil {
			return fmt.Errorf("checkpoint of step %d: %w", res.Steps, err)
		}
	}
	if err := r.groups.World.Barrier(); err != nil {
		return err
	}
	if worldRank == 0 {
		cfg := s.e.cfg
		st := trainState{
			Step: res.Steps, Tokens: res.Tokens, LR: learningRate(cfg.Train, res.Steps),
			Config: cfg, Recipe: string(s.e.recipe), RecipeHash: s.e.recipeHash,
			Mesh:    comm.Mesh{DP: cfg.Parallel.DP, EP: cfg.Parallel.EP, CP: cfg.Parallel.CP, TP: cfg.Parallel.TP},
			Backend: s.e.backend.Name(), Version: Version,
		}
		if err := s.saver.save(slices.Clone(s.snaps), st); err != nil {
			return fmt.Errorf("checkpoint of step %d: %w", res.Steps, err)
		}
	}
	// Nobody refills the snapshots before rank 0 has handed them over.
	return r.groups.World.Barrier()
}

// report hands a step to the hooks, the metrics file and the log. Its
// error is a hook's panic (a *HookPanicError).
func (e *Engine) report(ev StepEvent) error {
	for i, h := range e.hooks {
		if err := callHook(i, h, ev); err != nil {
			return err
		}
	}
	every := e.cfg.Log.Every
	logged := ev.Step == 1 || ev.Step == ev.Steps || (every > 0 && ev.Step%every == 0) || !math.IsNaN(ev.ValLoss)
	e.tensorboard.write(ev, logged)
	if !logged {
		return nil
	}
	if e.metrics != nil {
		if err := writeMetrics(e.metrics, ev); err != nil {
			e.log.Warn().Err(err).Msg("cannot write metrics")
		}
	}
	e.logStep(ev)
	return nil
}

// callHook calls the index-th hook with ev, turning a panic into a
// *HookPanicError: the hook is the embedding program's code, and its bug
// must reach that program as Run's error, not as an engine failure.
func callHook(index int, h func(StepEvent), ev StepEvent) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &HookPanicError{Hook: index, Step: ev.Step, Value: p, Stack: debug.Stack()}
		}
	}()
	h(ev)
	return nil
}

func round4(x float64) float64 { return math.Round(x*1e4) / 1e4 }
