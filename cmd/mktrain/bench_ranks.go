package main

// Placing and timing work spread over ranks: virtual ranks of one device
// (bench attention's ring rows, bench kernels, bench tp) or, with --gpus,
// one rank per GPU (the same three). Every rank runs its part of
// a step from its own goroutine, and a step is timed on the first
// device's clock from before any rank starts to after every rank has
// finished.

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/comm"
)

// rankPlacer builds the world of w ranks a benchmark measures: the ranks,
// each one's backend, and a release for what it opened for them.
type rankPlacer func(w int) (world []*comm.Ranks, bs []backend.Backend, release func() error, err error)

// expertMesh and tensorMesh are the worlds bench kernels and bench tp
// place: w ranks of expert or of tensor parallelism.
func expertMesh(w int) comm.Mesh { return comm.Mesh{DP: 1, EP: w, CP: 1, TP: 1} }
func tensorMesh(w int) comm.Mesh { return comm.Mesh{DP: 1, EP: 1, CP: 1, TP: w} }

// contextMesh is the world of bench attention's ring rows: w ranks of
// context parallelism.
func contextMesh(w int) comm.Mesh { return comm.Mesh{DP: 1, EP: 1, CP: w, TP: 1} }

// virtualRanks places mesh(w) as w virtual ranks on b (in-process
// groups).
func virtualRanks(b backend.Backend, mesh func(w int) comm.Mesh) rankPlacer {
	return func(w int) ([]*comm.Ranks, []backend.Backend, func() error, error) {
		world, err := comm.NewLocal(mesh(w), b)
		if err != nil {
			return nil, nil, nil, err
		}
		bs := make([]backend.Backend, w)
		for r := range bs {
			bs[r] = b
		}
		return world, bs, func() error { return nil }, nil
	}
}

// gpuRanks places mesh(w) on GPUs 0..w-1, one rank each, for w up to
// most: b is GPU 0 (a CUDA backend, whose driver places one rank per
// device), and gpuRanks opens GPUs 1..most-1 (closeGPUs closes them). Each
// world's groups are NCCL communicators with peer access between their
// GPUs, closed by its release.
func gpuRanks(b backend.Backend, most int, mesh func(w int) comm.Mesh) (place rankPlacer, closeGPUs func() error, err error) {
	drivers, err := registry.NewSet(all.Drivers()...)
	if err != nil {
		return nil, nil, err
	}
	d, _ := drivers.Lookup(b.Name())
	placer, isPlacer := d.(registry.RankPerDevice)
	gpu0, isDevice := b.(registry.Device)
	if !isPlacer || !isDevice {
		return nil, nil, usageError{fmt.Sprintf("--gpus needs the cuda backend; this one is %s", b.Name())}
	}
	gpus, closeGPUs, err := placer.OpenBeside(gpu0, most)
	if err != nil {
		// A missing GPU reads "opening GPU 4: cuda: GPU 4 asked for, but
		// 2 are visible".
		return nil, nil, fmt.Errorf("--gpus: world %d: %w", most, err)
	}
	place = func(w int) ([]*comm.Ranks, []backend.Backend, func() error, error) {
		world, closeGroups, err := placer.MeshRanks(mesh(w), gpus[:w], registry.MeshOptions{PeerAccess: true})
		if err != nil {
			return nil, nil, nil, err
		}
		bs := make([]backend.Backend, w)
		for r := range bs {
			bs[r] = gpus[r]
		}
		return world, bs, closeGroups, nil
	}
	return place, closeGPUs, nil
}

// benchPlacer is a bench command's rankPlacer: virtual ranks of b, or
// with onGPUs one rank per GPU for worlds of up to most ranks; done
// closes what it opened, reporting a failure on stderr under cmd's name.
func benchPlacer(b backend.Backend, onGPUs bool, most int, mesh func(w int) comm.Mesh, cmd string, stderr io.Writer) (place rankPlacer, done func(), err error) {
	if !onGPUs {
		return virtualRanks(b, mesh), func() {}, nil
	}
	place, closeGPUs, err := gpuRanks(b, most, mesh)
	if err != nil {
		return nil, nil, err
	}
	return place, func() {
		if err := closeGPUs(); err != nil {
			fmt.Fprintf(stderr, "%s: closing the GPUs: %v\n", cmd, err)
		}
	}, nil
}

// rankStep is one rank's part of a timed step: the group whose barriers
// bracket the step (every rank's in it), the rank's groups (aborted when
// its work fails, so that the others stop waiting) and the work. device,
// when set, is the rank's own device (one rank per GPU), which the rank
// waits for before it counts as finished: the clock's stream sees only
// its own device's work.
type rankStep struct {
	group  comm.Group
	ranks  *comm.Ranks
	work   func() error
	device backend.Backend
}

// step is one step of the rank's work between its group's barriers. The
// first rank takes the marks, one before any rank starts (all ranks wait
// at a barrier until it is taken) and one after every rank has returned
// (a barrier first), and returns the time between them, the others 0;
// with hold > 0 it first holds the clock's device for hold
// (profile.Holder), so that the start mark and every rank's launches
// queue behind it. queue is the host's time in the work.
func (rk rankStep) step(clock profile.Clock, first bool, hold time.Duration) (d, queue time.Duration, err error) {
	if err := rk.group.Barrier(); err != nil {
		return 0, 0, err
	}
	var start profile.Mark
	if first {
		if hold > 0 {
			if err := clock.(profile.Holder).Hold(hold); err != nil {
				return 0, 0, err
			}
		}
		m, err := clock.Mark()
		if err != nil {
			return 0, 0, err
		}
		start = m
	}
	// release gives the start mark back on a failure before its end.
	release := func(err error) (time.Duration, time.Duration, error) {
		if first {
			clock.Release(start)
		}
		return 0, 0, err
	}
	if err := rk.group.Barrier(); err != nil {
		return release(err)
	}
	began := time.Now()
	if err := rk.work(); err != nil {
		return release(err)
	}
	queue = time.Since(began)
	if rk.device != nil {
		if err := rk.device.Sync(); err != nil {
			return release(err)
		}
	}
	if err := rk.group.Barrier(); err != nil {
		return release(err)
	}
	if !first {
		return 0, queue, nil
	}
	d, err = elapsedSince(clock, start)
	return d, queue, err
}

// stepHold is the shortest hold a timed step starts after (oneRankStep,
// bench attention's ring rows): longer than the host takes to queue most
// steps; timeInterleaved lengthens it for a path whose last step took the
// host longer, up to stepHoldMax.
const stepHold = 2 * time.Millisecond

// stepHoldMax is the longest hold timeInterleaved gives a step. A path
// whose host waits for the device in the middle of a step queues it for
// longer than any hold (its queueing counts the hold), so without a bound
// its hold would grow 1.5 times a round: at 8bde2a8 one path's holds at
// W 8 reached 15.7 s. Such steps stay uncovered, and the table says so.
const stepHoldMax = 25 * time.Millisecond

// oneRankStep runs one step of every rank's work, each rank from a
// goroutine of its own, and returns its time (rankStep.step's). On a
// device whose ranks share one stream, that is the device's time from the
// first rank's first op to the last rank's last one; with a device of its
// own each rank waits for it before the closing barrier, so the end mark
// follows every device's work. With hold > 0, where the ranks share b (no
// device of their own) and clock is a profile.Holder, rank 0 holds the
// device for hold before its start mark: the ranks' launches after the
// barrier queue behind the hold, and the time is the device's, from the
// step's first op to its last, not the host's queueing. queue is the longest any
// rank's work took to return on the host (the hold covers the queueing
// when it is shorter). A rank whose work fails aborts its groups, so that
// the others stop waiting. held says whether rank 0 held the device.
func oneRankStep(b backend.Backend, clock profile.Clock, ranks []rankStep, hold time.Duration) (d, queue time.Duration, held bool, err error) {
	if _, ok := clock.(profile.Holder); !ok || slices.ContainsFunc(ranks, func(rk rankStep) bool { return rk.device != nil }) {
		hold = 0
	}
	queues := make([]time.Duration, len(ranks))
	errs := make([]error, len(ranks))
	var wg sync.WaitGroup
	for r, rk := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t, q, err := rk.step(clock, r == 0, hold)
			if err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
				rk.ranks.Abort(errs[r])
				return
			}
			queues[r] = q
			if r == 0 {
				d = t
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, 0, false, err
	}
	return d, slices.Max(queues), hold > 0, b.Sync()
}

// elapsedSince takes an end mark and returns the time from start to it,
// releasing both marks.
func elapsedSince(clock profile.Clock, start profile.Mark) (time.Duration, error) {
	end, err := clock.Mark()
	if err != nil {
		clock.Release(start)
		return 0, err
	}
	d, err := clock.Elapsed(start, end)
	clock.Release(start)
	clock.Release(end)
	return d, err
}

// sampler runs one step of kind (an index into the kinds its row times)
// after a hold of hold where the device can hold (oneRankStep) and
// returns its time, the host's time queueing it and whether it held.
type sampler func(kind int, hold time.Duration) (d, queue time.Duration, held bool, err error)

// rankSampler samples one step of every rank with oneRankStep: kind k
// runs stepsByKind[k].
func rankSampler(b backend.Backend, clock profile.Clock, stepsByKind ...[]rankStep) sampler {
	return func(kind int, hold time.Duration) (time.Duration, time.Duration, bool, error) {
		return oneRankStep(b, clock, stepsByKind[kind], hold)
	}
}

// timedSample is one timed sample of timeInterleaved's: its path (an
// index into the paths) and kind, when the host began it (before the
// ranks' barrier and the hold) and the time it measured.
type timedSample struct {
	path, kind int
	start      time.Time
	d          time.Duration
}

// timedPath is one path of a benchmark row (one way of doing the row's
// work), built and ready to sample; medians are timeInterleaved's, one a
// kind of step, and spans each kind's fastest and slowest timed sample;
// queue is the longest the host took to queue a timed sample's work, and
// uncovered how many timed samples that held the device it queued for
// longer than their hold.
type timedPath struct {
	name      string
	sample    sampler
	medians   []time.Duration
	spans     [][2]time.Duration
	queue     time.Duration
	uncovered int
}

// timeInterleaved runs 2 warm-up rounds and iters timed ones; a round
// takes one sample of each kind of every path, the paths in the order of
// a row of balancedOrder's, the rows in turn, so that every path is
// sampled across the same stretch of time and, over a cycle of rows,
// follows every other path equally often. Both matter on a GPU under its
// power cap: its clocks drifted by 10% between the blocks of a run when
// each path ran its steps in a block of its own, and they depend on the
// step before (a dense path leaves them lower than one that waits on the
// host); an order rotated by one each round had each path follow the
// same other in all but one round of each cycle. Each path's medians
// are its timed samples' of each kind. A sample's hold is stepHold or,
// when longer, 1.5 times the host's time queueing the path's previous
// sample of the same kind, at most stepHoldMax. kinds name the kinds in
// errors. timeline is every timed sample in the order they ran.
func timeInterleaved(paths []*timedPath, kinds []string, iters int) (timeline []timedSample, err error) {
	lastQueue := make([][]time.Duration, len(paths))
	for i := range paths {
		lastQueue[i] = make([]time.Duration, len(kinds))
	}
	order := balancedOrder(len(paths))
	for round := -2; round < iters; round++ {
		for _, i := range order[(round+2)%len(order)] {
			p := paths[i]
			for k := range kinds {
				hold := min(stepHoldMax, max(stepHold, lastQueue[i][k]*3/2))
				start := time.Now()
				d, queue, held, err := p.sample(k, hold)
				if err != nil {
					if len(kinds) > 1 {
						return nil, fmt.Errorf("%s, %s: %w", p.name, kinds[k], err)
					}
					return nil, fmt.Errorf("%s: %w", p.name, err)
				}
				lastQueue[i][k] = queue
				if round < 0 {
					continue
				}
				p.queue = max(p.queue, queue)
				if held && queue > hold {
					p.uncovered++
				}
				timeline = append(timeline, timedSample{path: i, kind: k, start: start, d: d})
			}
		}
	}
	for i, p := range paths {
		p.medians, p.spans = make([]time.Duration, len(kinds)), make([][2]time.Duration, len(kinds))
		for k := range kinds {
			var ds []time.Duration
			for _, ts := range timeline {
				if ts.path == i && ts.kind == k {
					ds = append(ds, ts.d)
				}
			}
			slices.Sort(ds)
			p.medians[k], p.spans[k] = ds[len(ds)/2], [2]time.Duration{ds[0], ds[len(ds)-1]}
		}
	}
	return timeline, nil
}

// balancedOrder is a Williams design for n paths: rows, each an order of
// 0..n-1, such that across all rows every path comes first equally often
// and directly follows every other path equally often (n rows for an
// even n, 2n for an odd one: the rows of the even construction and their
// reverses). Row r is 0, 1, n-1, 2, n-2, ... plus r, mod n.
func balancedOrder(n int) [][]int {
	if n < 1 {
		return [][]int{{}}
	}
	first := make([]int, n)
	for j := 1; j < n; j++ {
		if j%2 == 1 {
			first[j] = (j + 1) / 2
		} else {
			first[j] = n - j/2
		}
	}
	rows := make([][]int, 0, 2*n)
	for r := range n {
		row := make([]int, n)
		for j, v := range first {
			row[j] = (v + r) % n
		}
		rows = append(rows, row)
	}
	if n%2 == 1 {
		for r := range n {
			rev := slices.Clone(rows[r])
			slices.Reverse(rev)
			rows = append(rows, rev)
		}
	}
	return rows
}
