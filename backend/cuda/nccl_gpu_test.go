package cuda

// NCCLGroup on GPUs: every collective against comm.NewLocal's groups on the
// float32 CPU backend, with the same inputs, in worlds of 1 GPU and, where
// the machine has them, 2 and 4; Abort; the argument agreement
// (CheckArgs); and the watchdog's release of a rank whose peer never comes.
// They skip, with one line, where there is no GPU (see gpu_test.go).

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/comm"
)

// ncclWorld opens GPUs 0..n-1 afresh (devices of their own, so that an
// aborted communicator cannot disturb the device the other tests share),
// makes a Backend on each and one group over them. It skips when the
// machine has fewer than n GPUs.
func ncclWorld(t *testing.T, n int, opts NCCLOptions) ([]*NCCLGroup, []*Backend) {
	t.Helper()
	testDevice(t)
	count, err := gpu.rt.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	if count < n {
		t.Skipf("an NCCL world of %d needs %d GPUs; the driver sees %d", n, n, count)
	}
	var bs []*Backend
	for i := range n {
		d, err := gpu.rt.Open(i)
		if err != nil {
			t.Fatal(err)
		}
		b, err := NewBackend(d)
		if err != nil {
			d.Close()
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := errors.Join(b.Close(), d.Close()); err != nil {
				t.Errorf("closing GPU %d: %v", i, err)
			}
		})
		bs = append(bs, b)
	}
	if opts.Name == "" {
		opts.Name = "world"
	}
	gs, err := NewNCCLGroups(bs, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		errs := make([]error, len(gs))
		var wg sync.WaitGroup
		for r, g := range gs {
			wg.Go(func() { errs[r] = g.Close() })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Errorf("closing the groups: %v", err)
		}
	})
	return gs, bs
}

// runEach runs fn for every rank concurrently; a rank that fails aborts
// its group, as the engine's ranks do. It returns every rank's error, and
// fails the test if the ranks do not return within a minute.
func runEach(t *testing.T, n int, abort func(r int, err error), fn func(r int) error) []error {
	t.Helper()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Go(func() {
			if errs[r] = fn(r); errs[r] != nil && abort != nil {
				abort(r, errs[r])
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("ranks did not finish within a minute: a collective hangs")
	}
	return errs
}

// ncclScenario calls every collective of g once or more (in place and
// not, uneven all-to-all splits, float32 and int32) with inputs made from
// seed and the rank, on b, and returns every result read back, in order.
// The ranks agree on the splits because they are drawn from seed alone.
func ncclScenario(g comm.Group, b backend.Backend, seed uint64) ([]float64, error) {
	r, n := g.Rank(), g.Size()
	shared := rand.New(rand.NewPCG(seed, 0))
	mine := rand.New(rand.NewPCG(seed, uint64(r)+1))
	var out []float64
	vals := func(k int) []float32 {
		v := make([]float32, k)
		for i := range v {
			v[i] = float32(mine.NormFloat64())
		}
		return v
	}
	ints := func(k int) []int32 {
		v := make([]int32, k)
		for i := range v {
			v[i] = int32(mine.IntN(1000)) - 500
		}
		return v
	}
	f32 := func(v []float32, shape ...int) backend.Tensor {
		t := b.New(backend.Float32, shape...)
		if len(v) > 0 {
			backend.UploadSlice(b, t, v)
		}
		return t
	}
	i32 := func(v []int32, shape ...int) backend.Tensor {
		t := b.New(backend.Int32, shape...)
		if len(v) > 0 {
			backend.UploadSlice(b, t, v)
		}
		return t
	}
	read := func(ts ...backend.Tensor) {
		for _, t := range ts {
			if t.Len() == 0 {
				continue
			}
			if t.DType() == backend.Int32 {
				for _, v := range backend.DownloadInt32(b, t) {
					out = append(out, float64(v))
				}
				continue
			}
			out = append(out, backend.DownloadFloat64(b, t)...)
		}
	}

	// AllReduceSum: a whole tensor, and a view inside a larger one whose
	// other elements must stay as they are.
	x := f32(vals(37), 37)
	if err := g.AllReduceSum(x); err != nil {
		return nil, err
	}
	big := f32(vals(40), 4, 10)
	if err := g.AllReduceSum(b.View(big, 13, 11)); err != nil {
		return nil, err
	}
	read(x, big)

	// ReduceScatterSum, out of place and in place (recv is the rank's
	// block of send).
	const blk = 6
	send := f32(vals(n*blk), n*blk)
	recv := b.New(backend.Float32, blk)
	if err := g.ReduceScatterSum(recv, send); err != nil {
		return nil, err
	}
	send2 := f32(vals(n*blk), n*blk)
	if err := g.ReduceScatterSum(b.View(send2, r*blk, blk), send2); err != nil {
		return nil, err
	}
	read(recv, b.View(send2, r*blk, blk))

	// AllGather, float32 out of place and int32 in place.
	gsend := f32(vals(5), 5)
	grecv := b.New(backend.Float32, n*5)
	if err := g.AllGather(grecv, gsend); err != nil {
		return nil, err
	}
	gi := b.New(backend.Int32, n*3)
	backend.UploadSlice(b, b.View(gi, r*3, 3), ints(3))
	if err := g.AllGather(gi, b.View(gi, r*3, 3)); err != nil {
		return nil, err
	}
	read(grecv, gi)

	// AllToAllRows with uneven splits, some empty, float32 and int32.
	for _, dt := range []backend.DType{backend.Float32, backend.Int32} {
		const cols = 3
		counts := make([][]int, n) // counts[i][j]: rows i sends to j
		for i := range counts {
			counts[i] = make([]int, n)
			for j := range counts[i] {
				counts[i][j] = shared.IntN(4)
			}
		}
		sendCounts, recvCounts := counts[r], make([]int, n)
		rowsOut, rowsIn := 0, 0
		for j := range n {
			recvCounts[j] = counts[j][r]
			rowsOut += sendCounts[j]
			rowsIn += recvCounts[j]
		}
		var s backend.Tensor
		if dt == backend.Float32 {
			s = f32(vals(rowsOut*cols), rowsOut, cols)
		} else {
			s = i32(ints(rowsOut*cols), rowsOut, cols)
		}
		rv := b.New(dt, rowsIn, cols)
		if err := g.AllToAllRows(rv, s, recvCounts, sendCounts); err != nil {
			return nil, err
		}
		read(rv)
	}

	// Host vectors.
	h := []float64{mine.NormFloat64(), float64(r), 1e10, -3}
	if err := g.AllReduceFloat64(h); err != nil {
		return nil, err
	}
	out = append(out, h...)
	counts := make([]int, n)
	for j := range counts {
		counts[j] = 10*r + j + mine.IntN(5)
	}
	got, err := g.AllToAllInts(counts)
	if err != nil {
		return nil, err
	}
	for _, v := range got {
		out = append(out, float64(v))
	}

	// Send and Recv around a ring: rank 0 sends first, the others
	// receive first, so every Send meets a Recv.
	if n > 1 {
		to, from := (r+1)%n, (r+n-1)%n
		st, rt := f32(vals(9), 9), b.New(backend.Float32, 9)
		if r == 0 {
			if err := g.Send(st, to); err != nil {
				return nil, err
			}
			if err := g.Recv(rt, from); err != nil {
				return nil, err
			}
		} else {
			if err := g.Recv(rt, from); err != nil {
				return nil, err
			}
			if err := g.Send(st, to); err != nil {
				return nil, err
			}
		}
		read(rt)
	}
	if err := g.Barrier(); err != nil {
		return nil, err
	}
	return out, b.Sync()
}

// compareWithLocal runs the scenario on the NCCL groups and on an
// in-process world of the same size on the float32 CPU backend, and
// compares every rank's results: sums may differ in their last bits (NCCL
// adds in another order), everything else must be equal.
func compareWithLocal(t *testing.T, gs []*NCCLGroup, bs []*Backend, seed uint64) {
	t.Helper()
	n := len(gs)
	gotAll := make([][]float64, n)
	errs := runEach(t, n, func(r int, err error) { gs[r].Abort(err) }, func(r int) error {
		var err error
		gotAll[r], err = ncclScenario(gs[r], bs[r], seed)
		return err
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	cb := cpu.New(backend.Float32)
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: n, CP: 1, TP: 1}, cb)
	if err != nil {
		t.Fatal(err)
	}
	wantAll := make([][]float64, n)
	errs = runEach(t, n, func(r int, err error) { ranks[r].Abort(err) }, func(r int) error {
		var err error
		wantAll[r], err = ncclScenario(ranks[r].World, cb, seed)
		return err
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for r := range n {
		got, want := gotAll[r], wantAll[r]
		if len(got) != len(want) {
			t.Fatalf("rank %d: %d results, the local world has %d", r, len(got), len(want))
		}
		bad := 0
		for i := range want {
			if d := math.Abs(got[i] - want[i]); d > 1e-5*(1+math.Abs(want[i])) || math.IsNaN(got[i]) {
				if bad++; bad <= 5 {
					t.Errorf("rank %d, result %d: %v, the local world has %v", r, i, got[i], want[i])
				}
			}
		}
		if bad > 5 {
			t.Errorf("rank %d: %d results differ", r, bad)
		}
	}
}

func TestNCCLVersion(t *testing.T) {
	testDevice(t)
	l, err := LoadNCCL(driver.Search{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := l.Version()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: NCCL version code %d", l.Path(), v)
	if v < 21000 {
		t.Errorf("NCCL version code %d: need 2.10 or later (bfloat16)", v)
	}
	id, err := l.UniqueID()
	if err != nil {
		t.Fatal(err)
	}
	if id == [NCCLUniqueIDBytes]byte{} {
		t.Error("ncclGetUniqueId returned zeros")
	}
}

// TestNCCLWorld1: every collective on one GPU, compared with a local world
// of one; then Abort makes every later call fail with its reason.
func TestNCCLWorld1(t *testing.T) {
	gs, bs := ncclWorld(t, 1, NCCLOptions{})
	compareWithLocal(t, gs, bs, 11)
	g, b := gs[0], bs[0]
	if err := g.Send(b.New(backend.Float32, 2), 0); err == nil || !strings.Contains(err.Error(), "is not another rank of this group of 1") {
		t.Errorf("Send to itself: %v", err)
	}
	reason := errors.New("rank 0 gave up")
	g.Abort(reason)
	want := "comm: world group aborted: rank 0 gave up"
	x := b.New(backend.Float32, 4)
	for name, err := range map[string]error{
		"AllReduceSum":     g.AllReduceSum(x),
		"AllGather":        g.AllGather(b.New(backend.Float32, 4), x),
		"AllReduceFloat64": g.AllReduceFloat64([]float64{1}),
		"Barrier":          g.Barrier(),
	} {
		if err == nil || err.Error() != want || !errors.Is(err, reason) {
			t.Errorf("%s after Abort: %v, want %q", name, err, want)
		}
	}
	if err := b.Sync(); err != nil {
		t.Errorf("the device after the abort: %v", err)
	}
}

func TestNCCLWorlds(t *testing.T) {
	for _, n := range []int{2, 4} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			gs, bs := ncclWorld(t, n, NCCLOptions{})
			compareWithLocal(t, gs, bs, uint64(20+n))
			compareWithLocal(t, gs, bs, uint64(30+n)) // connections made, scratch reused
		})
	}
}

// TestNCCLCheckArgs: with CheckArgs, a tensor collective whose ranks
// disagree fails on every rank with local.go's error, and the group stays
// usable.
func TestNCCLCheckArgs(t *testing.T) {
	gs, bs := ncclWorld(t, 2, NCCLOptions{CheckArgs: true})
	errs := runEach(t, 2, nil, func(r int) error {
		return gs[r].AllReduceSum(bs[r].New(backend.Float32, 4+r))
	})
	want := "comm: world group AllReduceSum: rank 1 has 5 elements of float32, rank 0 has 4 of float32"
	for r, err := range errs {
		if err == nil || err.Error() != want {
			t.Errorf("rank %d: %v, want %q", r, err, want)
		}
	}
	errs = runEach(t, 2, nil, func(r int) error {
		if r == 0 {
			return gs[r].AllReduceSum(nil)
		}
		return gs[r].AllReduceSum(bs[r].New(backend.Float32, 4))
	})
	for r, err := range errs {
		if err == nil || err.Error() != "comm: world group AllReduceSum, rank 0: the tensor is nil" {
			t.Errorf("rank %d, nil on rank 0: %v", r, err)
		}
	}
	errs = runEach(t, 2, nil, func(r int) error { return gs[r].Barrier() })
	if err := errors.Join(errs...); err != nil {
		t.Errorf("Barrier after the failed calls: %v", err)
	}
}

// TestNCCLWatchdog: a rank alone in a Barrier returns, naming the group,
// once the timeout passes, and its peer's group is aborted with it; and a
// peer's Abort releases a waiting rank at once.
func TestNCCLWatchdog(t *testing.T) {
	t.Run("timeout", func(t *testing.T) {
		gs, _ := ncclWorld(t, 2, NCCLOptions{Timeout: time.Second})
		// One Barrier together first, so that the lone one below finds its
		// connections made and waits on the GPU.
		if err := errors.Join(runEach(t, 2, nil, func(r int) error { return gs[r].Barrier() })...); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err := gs[0].Barrier()
		if err == nil || !strings.Contains(err.Error(), "world group Barrier on rank 0") || !strings.Contains(err.Error(), "not done after") {
			t.Fatalf("lone Barrier: %v", err)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("the lone Barrier returned after %v, with a timeout of 1s", d)
		}
		if err := gs[1].AllReduceFloat64([]float64{1}); err == nil || !strings.Contains(err.Error(), "world group aborted") {
			t.Errorf("the peer after the timeout: %v", err)
		}
	})
	t.Run("abort", func(t *testing.T) {
		gs, _ := ncclWorld(t, 2, NCCLOptions{})
		if err := errors.Join(runEach(t, 2, nil, func(r int) error { return gs[r].Barrier() })...); err != nil {
			t.Fatal(err)
		}
		reason := errors.New("rank 1 failed")
		go func() { time.Sleep(200 * time.Millisecond); gs[1].Abort(reason) }()
		start := time.Now()
		if err := gs[0].Barrier(); !errors.Is(err, reason) {
			t.Fatalf("Barrier while the peer aborts: %v", err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("released after %v", d)
		}
	})
}
