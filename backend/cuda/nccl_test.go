package cuda

// Tests of the NCCL communicator that need no GPU: the C ABI of the call
// that takes the unique id by value, error texts, the all-to-all plan, the
// watchdog's loop, and the argument checks, whose messages must be those
// of comm.NewLocal's groups (compared with a live in-process world).

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// TestNCCLCommInitRankABI checks what C receives from the binding of
// ncclCommInitRank(ncclComm_t*, int, ncclUniqueId, int): under the System V
// AMD64 ABI the pointer, nranks and rank take the first three integer
// registers and the 128-byte id goes by value on the stack, as 16 words in
// memory order. A purego callback with 22 word arguments sees the six
// integer registers and then the stack words.
func TestNCCLCommInitRankABI(t *testing.T) {
	var got [22]uintptr
	cb := purego.NewCallback(func(a1, a2, a3, a4, a5, a6, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 uintptr) uintptr {
		got = [22]uintptr{a1, a2, a3, a4, a5, a6, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15}
		return uintptr(NCCLInvalidUsage)
	})
	initRank := bindCommInitRank(cb)
	var id ncclUniqueID
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range id.internal {
		id.internal[i] = byte(rng.Uint32())
	}
	var c ncclComm
	if r := initRank(&c, 3, id, 2); r != NCCLInvalidUsage {
		t.Fatalf("result %v, want the callback's %v", r, NCCLInvalidUsage)
	}
	if got[0] != uintptr(unsafe.Pointer(&c)) || got[1] != 3 || got[2] != 2 {
		t.Errorf("register arguments %#x, %d, %d; want the comm pointer %p, nranks 3, rank 2", got[0], got[1], got[2], &c)
	}
	for w := range 16 {
		want := uintptr(binary.LittleEndian.Uint64(id.internal[8*w:]))
		if got[6+w] != want {
			t.Errorf("stack word %d of the id = %#x, want %#x", w, got[6+w], want)
		}
	}
}

func TestNCCLErrorText(t *testing.T) {
	e := &NCCLError{Call: "ncclAllReduce(1024 x ncclFloat32)", Code: NCCLSystemError, Text: "unhandled system error"}
	if got, want := e.Error(), "ncclAllReduce(1024 x ncclFloat32): ncclSystemError: unhandled system error"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	e.Last = "socket closed"
	if got := e.Error(); !strings.HasSuffix(got, "unhandled system error (NCCL: socket closed)") {
		t.Errorf("with the last error: %q", got)
	}
	if got := NCCLResult(42).String(); got != "ncclResult_t 42" {
		t.Errorf("unknown result: %q", got)
	}
	if got := fmt.Sprint(ncclFloat32, ncclInt64, ncclDataType(99)); got != "ncclFloat32 ncclInt64 ncclDataType_t 99" {
		t.Errorf("data types: %q", got)
	}
}

// TestRowsTransfers runs every rank's plan of an uneven all-to-all on host
// rows, pairing each send with the receive the peer planned, and compares
// with the blocks cut out by a direct reading of the contract.
func TestRowsTransfers(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, size := range []int{1, 2, 3, 5} {
		for trial := range 20 {
			// counts[i][j]: rows rank i sends to rank j (zeros included).
			counts := make([][]int, size)
			for i := range counts {
				counts[i] = make([]int, size)
				for j := range counts[i] {
					if rng.IntN(3) > 0 {
						counts[i][j] = rng.IntN(4)
					}
				}
			}
			// Row k of rank i's send holds the value 1000*i + k.
			send := make([][]int, size)
			recvCounts := make([][]int, size)
			for i := range size {
				for j := range size {
					for range counts[i][j] {
						send[i] = append(send[i], 1000*i+len(send[i]))
					}
				}
				recvCounts[i] = make([]int, size)
				for j := range size {
					recvCounts[i][j] = counts[j][i]
				}
			}
			recv := make([][]int, size)
			for r := range size {
				recv[r] = slices.Repeat([]int{-1}, sum(recvCounts[r]))
			}
			inbox := map[[2]int][]int{} // (src, dst) -> rows in flight
			for r := range size {
				for _, tr := range rowsTransfers(r, recvCounts[r], counts[r]) {
					switch tr.kind {
					case 'c':
						copy(recv[r][tr.to:tr.to+tr.rows], send[r][tr.from:tr.from+tr.rows])
					case 's':
						inbox[[2]int{r, tr.peer}] = send[r][tr.from : tr.from+tr.rows]
					}
				}
			}
			for r := range size {
				for _, tr := range rowsTransfers(r, recvCounts[r], counts[r]) {
					if tr.kind == 'r' {
						rows, ok := inbox[[2]int{tr.peer, r}]
						if !ok || len(rows) != tr.rows {
							t.Fatalf("size %d trial %d: rank %d receives %d rows from %d, which sent %v", size, trial, r, tr.rows, tr.peer, rows)
						}
						copy(recv[r][tr.to:], rows)
						delete(inbox, [2]int{tr.peer, r})
					}
				}
			}
			if len(inbox) != 0 {
				t.Fatalf("size %d trial %d: sends nobody receives: %v", size, trial, inbox)
			}
			for r := range size {
				var want []int
				for i := range size {
					start := 0 // rank i's block for r starts after its blocks for 0..r-1
					for j := 0; j < r; j++ {
						start += counts[i][j]
					}
					want = append(want, send[i][start:start+counts[i][r]]...)
				}
				if !slices.Equal(recv[r], want) && !(len(want) == 0 && len(recv[r]) == 0) {
					t.Fatalf("size %d trial %d counts %v: rank %d received %v, want %v", size, trial, counts, r, recv[r], want)
				}
			}
		}
	}
	if got := rowOffsets([]int{3, 0, 2, 1}); !slices.Equal(got, []int{0, 3, 3, 5}) {
		t.Errorf("rowOffsets = %v", got)
	}
}

func sum(xs []int) int {
	s := 0
	for _, x := range xs {
		s += x
	}
	return s
}

func TestWatch(t *testing.T) {
	never := func() (bool, error) { return false, nil }
	healthy := func() error { return nil }
	no := func() bool { return false }

	polls := 0
	afterThree := func() (bool, error) { polls++; return polls > 3, nil }
	if res, err := watch(time.Second, afterThree, healthy, no); res != watchDone || err != nil || polls != 4 {
		t.Errorf("done after 4 polls: %v, %v, %d polls", res, err, polls)
	}
	boom := errors.New("invalid context")
	if res, err := watch(time.Second, func() (bool, error) { return false, boom }, healthy, no); res != watchFailed || err != boom {
		t.Errorf("failing query: %v, %v", res, err)
	}
	abortAfter := time.Now().Add(5 * time.Millisecond)
	if res, _ := watch(time.Second, never, healthy, func() bool { return time.Now().After(abortAfter) }); res != watchAborted {
		t.Errorf("aborted: %v", res)
	}
	remote := &NCCLError{Call: "x", Code: NCCLRemoteError}
	sick := time.Now().Add(5 * time.Millisecond)
	res, err := watch(time.Second, never, func() error {
		if time.Now().After(sick) {
			return remote
		}
		return nil
	}, no)
	if res != watchUnhealthy || err != remote {
		t.Errorf("asynchronous error: %v, %v", res, err)
	}
	start := time.Now()
	if res, _ := watch(20*time.Millisecond, never, healthy, no); res != watchTimeout {
		t.Errorf("timeout: %v", res)
	}
	if d := time.Since(start); d < 20*time.Millisecond || d > time.Second {
		t.Errorf("timeout of 20ms took %v", d)
	}
}

// fakeTensor is a CUDA tensor with a made-up address, for argument checks
// that never reach the GPU.
func fakeTensor(dt backend.DType, shape ...int) *Tensor {
	return &Tensor{st: &storage{buf: &Buffer{ptr: 1 << 20, size: 1 << 20}}, shape: shape, dt: dt}
}

// fakeGroup is rank of a group of size whose calls fail before they reach
// the GPU.
func fakeGroup(rank, size int) *NCCLGroup {
	return &NCCLGroup{b: &Backend{}, rank: rank, size: size, name: "world", timeout: time.Second, state: &ncclState{name: "world"}}
}

// localErrs runs call on every rank of an in-process world of size on the
// float32 CPU backend and returns each rank's error text.
func localErrs(t *testing.T, size int, call func(g comm.Group, b backend.Backend) error) []string {
	t.Helper()
	b := cpu.New(backend.Float32)
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: size, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, size)
	var wg sync.WaitGroup
	for r, rk := range ranks {
		wg.Go(func() {
			if err := call(rk.World, b); err != nil {
				out[r] = err.Error()
			}
		})
	}
	wg.Wait()
	return out
}

// TestNCCLArgErrorsMatchLocal: a rank whose own arguments are wrong gets
// the error that comm.NewLocal's rank 0 reports for the same arguments.
func TestNCCLArgErrorsMatchLocal(t *testing.T) {
	// Each case makes its tensors on a backend (the CPU, or fake CUDA
	// tensors of the same shapes) and calls the group; rank 1 of the
	// local world makes a valid call of the same collective.
	cases := []struct {
		name string
		call func(g comm.Group, mk func(dt backend.DType, shape ...int) backend.Tensor, rank int) error
	}{
		{"AllReduceSum nil", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllReduceSum(nil)
			}
			return g.AllReduceSum(mk(backend.Float32, 3))
		}},
		{"AllReduceSum int32", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllReduceSum(mk(backend.Int32, 3))
			}
			return g.AllReduceSum(mk(backend.Float32, 3))
		}},
		{"ReduceScatterSum lengths", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.ReduceScatterSum(mk(backend.Float32, 3), mk(backend.Float32, 5))
			}
			return g.ReduceScatterSum(mk(backend.Float32, 3), mk(backend.Float32, 6))
		}},
		{"ReduceScatterSum nil send", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.ReduceScatterSum(mk(backend.Float32, 3), nil)
			}
			return g.ReduceScatterSum(mk(backend.Float32, 3), mk(backend.Float32, 6))
		}},
		{"AllGather lengths", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllGather(mk(backend.Float32, 7), mk(backend.Float32, 3))
			}
			return g.AllGather(mk(backend.Float32, 6), mk(backend.Float32, 3))
		}},
		{"AllToAllRows sums", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllToAllRows(mk(backend.Float32, 3, 4), mk(backend.Float32, 2, 4), []int{1, 1}, []int{1, 1})
			}
			return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 4), []int{1, 1}, []int{1, 1})
		}},
		{"AllToAllRows negative", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 4), []int{3, -1}, []int{1, 1})
			}
			return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 4), []int{1, 1}, []int{1, 1})
		}},
		{"AllToAllRows widths", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 5), []int{1, 1}, []int{1, 1})
			}
			return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 4), []int{1, 1}, []int{1, 1})
		}},
		{"AllToAllRows dtypes", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllToAllRows(mk(backend.Int32, 2, 4), mk(backend.Float32, 2, 4), []int{1, 1}, []int{1, 1})
			}
			return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 4), []int{1, 1}, []int{1, 1})
		}},
		{"AllToAllRows counts", func(g comm.Group, mk func(backend.DType, ...int) backend.Tensor, rank int) error {
			if rank == 0 {
				return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 4), []int{2}, []int{1, 1})
			}
			return g.AllToAllRows(mk(backend.Float32, 2, 4), mk(backend.Float32, 2, 4), []int{1, 1}, []int{1, 1})
		}},
	}
	for _, c := range cases {
		want := localErrs(t, 2, func(g comm.Group, b backend.Backend) error {
			return c.call(g, func(dt backend.DType, shape ...int) backend.Tensor { return b.New(dt, shape...) }, g.Rank())
		})
		if want[0] == "" {
			t.Fatalf("%s: the local group accepts the call", c.name)
		}
		// The messages name the backend.
		want[0] = strings.ReplaceAll(want[0], "on the cpu backend", "on the cuda backend")
		err := c.call(fakeGroup(0, 2), func(dt backend.DType, shape ...int) backend.Tensor { return fakeTensor(dt, shape...) }, 0)
		if err == nil || err.Error() != want[0] {
			t.Errorf("%s:\n got %v\nwant %s", c.name, err, want[0])
		}
	}

	g := fakeGroup(1, 3)
	for _, peer := range []int{-1, 1, 3} {
		want := localErrs(t, 3, func(lg comm.Group, b backend.Backend) error {
			if lg.Rank() != 1 {
				return nil
			}
			return lg.Send(b.New(backend.Float32, 2), peer)
		})[1]
		if err := g.Send(fakeTensor(backend.Float32, 2), peer); err == nil || err.Error() != want {
			t.Errorf("Send to %d: got %v, want %s", peer, err, want)
		}
		want = strings.Replace(want, "Send", "Recv", 1)
		if err := g.Recv(fakeTensor(backend.Float32, 2), peer); err == nil || err.Error() != want {
			t.Errorf("Recv from %d: got %v, want %s", peer, err, want)
		}
	}

	// A tensor of another backend, or one whose allocation failed, is an
	// argument error too, not a panic.
	if err := g.AllReduceSum(cpu.New(backend.Float32).New(backend.Float32, 2)); err == nil || !strings.Contains(err.Error(), "not a tensor of the CUDA backend") {
		t.Errorf("CPU tensor: %v", err)
	}
	empty := &Tensor{st: &storage{}, shape: []int{2}, dt: backend.Float32}
	if err := g.AllReduceSum(empty); err == nil || !strings.Contains(err.Error(), "allocation failed") {
		t.Errorf("tensor without memory: %v", err)
	}
}

// TestAgreementMatchesLocal: the verdicts the ranks reach from the gathered
// descriptors are local.go's, rank by rank.
func TestAgreementMatchesLocal(t *testing.T) {
	const size = 3
	roundTrip := func(op string, argErr error, ints []int64) descriptor {
		return decodeDesc(size, encodeDesc(size, op, argErr, ints))
	}
	d := roundTrip("AllToAllRows", errors.New(strings.Repeat("x", 500)), []int64{1, -2, 3, 4, 5, 6, 7, 8, 9, 10})
	if d.op != "AllToAllRows" || len(d.err) != descErrBytes || !slices.Equal(d.ints, []int64{1, -2, 3, 4, 5, 6, 7, 8, 9, 10}) {
		t.Errorf("round trip: %+v", d)
	}

	// Ranks in different collectives.
	want := localErrs(t, size, func(g comm.Group, b backend.Backend) error {
		if g.Rank() == 2 {
			return g.AllReduceFloat64([]float64{1})
		}
		return g.Barrier()
	})
	all := []descriptor{roundTrip("Barrier", nil, nil), roundTrip("Barrier", nil, nil), roundTrip("AllReduceFloat64", nil, []int64{1})}
	for r := range size {
		if err := checkAgreement("world", r, all); err == nil || err.Error() != want[r] {
			t.Errorf("rank %d, mixed calls: got %v, want %s", r, err, want[r])
		}
	}

	// One rank's argument error reaches every rank.
	want = localErrs(t, size, func(g comm.Group, b backend.Backend) error {
		n := size
		if g.Rank() == 1 {
			n = 2
		}
		_, err := g.AllToAllInts(make([]int, n))
		return err
	})
	all = nil
	for r := range size {
		var argErr error
		if r == 1 {
			argErr = fmt.Errorf("send has %d entries for a group of %d", 2, size)
		}
		all = append(all, roundTrip("AllToAllInts", argErr, nil))
	}
	for r := range size {
		if err := checkAgreement("world", r, all); err == nil || err.Error() != want[r] {
			t.Errorf("rank %d, argument error: got %v, want %s", r, err, want[r])
		}
	}

	// Blocks of different lengths.
	g := fakeGroup(0, size)
	want = localErrs(t, size, func(lg comm.Group, b backend.Backend) error {
		n := 3
		if lg.Rank() == 2 {
			n = 2
		}
		return lg.AllGather(b.New(backend.Float32, size*n), b.New(backend.Float32, n))
	})
	all = []descriptor{
		roundTrip("AllGather", nil, []int64{int64(backend.Float32), 3}),
		roundTrip("AllGather", nil, []int64{int64(backend.Float32), 3}),
		roundTrip("AllGather", nil, []int64{int64(backend.Float32), 2}),
	}
	if err := g.checkBlocks("AllGather")(all); err == nil || err.Error() != want[0] {
		t.Errorf("blocks: got %v, want %s", err, want[0])
	}

	// Rows that one rank sends and its peer does not expect.
	sendCounts := [][]int{{1, 2, 0}, {0, 1, 1}, {1, 1, 1}}
	recvCounts := [][]int{{1, 0, 1}, {1, 1, 1}, {0, 1, 1}} // rank 1 expects 1 row from rank 0, which sends 2
	want = localErrs(t, size, func(lg comm.Group, b backend.Backend) error {
		r := lg.Rank()
		return lg.AllToAllRows(b.New(backend.Float32, sum(recvCounts[r]), 2), b.New(backend.Float32, sum(sendCounts[r]), 2), recvCounts[r], sendCounts[r])
	})
	all = nil
	for r := range size {
		ints := []int64{int64(backend.Float32), 2}
		for j := range size {
			ints = append(ints, int64(sendCounts[r][j]))
		}
		for j := range size {
			ints = append(ints, int64(recvCounts[r][j]))
		}
		all = append(all, roundTrip("AllToAllRows", nil, ints))
	}
	if err := g.checkRowsPlan(all); err == nil || err.Error() != want[0] {
		t.Errorf("rows plan: got %v, want %s", err, want[0])
	}
}

// TestP2PVerdictMatchesLocal: sender and receiver reach local.go's verdict
// from the two headers.
func TestP2PVerdictMatchesLocal(t *testing.T) {
	cases := []struct {
		name       string
		sent, want p2pHeader
		mk         func(b backend.Backend) (s, r backend.Tensor)
	}{
		{"lengths", p2pHeader{int64(backend.Float32), 4}, p2pHeader{int64(backend.Float32), 3},
			func(b backend.Backend) (backend.Tensor, backend.Tensor) {
				return b.New(backend.Float32, 4), b.New(backend.Float32, 3)
			}},
		{"dtypes", p2pHeader{int64(backend.Int32), 3}, p2pHeader{int64(backend.Float32), 3},
			func(b backend.Backend) (backend.Tensor, backend.Tensor) {
				return b.New(backend.Int32, 3), b.New(backend.Float32, 3)
			}},
		{"nil sent", p2pHeader{p2pNil, 0}, p2pHeader{int64(backend.Float32), 3},
			func(b backend.Backend) (backend.Tensor, backend.Tensor) { return nil, b.New(backend.Float32, 3) }},
		{"nil buffer", p2pHeader{int64(backend.Float32), 3}, p2pHeader{p2pNil, 0},
			func(b backend.Backend) (backend.Tensor, backend.Tensor) { return b.New(backend.Float32, 3), nil }},
	}
	for _, c := range cases {
		want := localErrs(t, 2, func(g comm.Group, b backend.Backend) error {
			s, r := c.mk(b)
			if g.Rank() == 0 {
				return g.Send(s, 1)
			}
			return g.Recv(r, 0)
		})
		if want[0] == "" || want[0] != want[1] {
			t.Fatalf("%s: local errors %q", c.name, want)
		}
		if err := p2pVerdict("world", 0, 1, c.sent, c.want); err == nil || err.Error() != want[0] {
			t.Errorf("%s: got %v, want %s", c.name, err, want[0])
		}
	}
	if err := p2pVerdict("world", 0, 1, p2pHeader{int64(backend.Float32), 3}, p2pHeader{int64(backend.Float32), 3}); err != nil {
		t.Errorf("matching headers: %v", err)
	}
	h := p2pHeader{int64(backend.Int32), 1 << 40}
	if got := headerFrom(h.bytes()); got != h {
		t.Errorf("header round trip: %v", got)
	}
	if got := headerOf(fakeTensor(backend.Float32, 2, 3)); got != (p2pHeader{int64(backend.Float32), 6}) {
		t.Errorf("headerOf: %v", got)
	}
	if got := headerOf(cpu.New(backend.Float32).New(backend.Float32, 2)); got.dt != p2pBad {
		t.Errorf("headerOf a CPU tensor: %v", got)
	}
}

// TestNCCLConstructorChecks: bad arguments fail before libnccl is loaded.
func TestNCCLConstructorChecks(t *testing.T) {
	on := func(ordinal int) *Backend { return &Backend{dev: &Device{info: Info{Ordinal: ordinal}}} }
	for _, c := range []struct {
		bs   []*Backend
		want string
	}{
		{nil, "at least one backend"},
		{[]*Backend{on(0), nil}, "backend 1 is nil"},
		{[]*Backend{on(0), on(1), on(0)}, "backends 0 and 2 are both on GPU 0"},
	} {
		if _, err := NewNCCLGroups(c.bs, NCCLOptions{}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewNCCLGroups: got %v, want %q", err, c.want)
		}
	}
	if o, err := checkNCCLBackends([]*Backend{on(2), on(0)}); err != nil || !slices.Equal(o, []int32{2, 0}) {
		t.Errorf("ordinals %v, %v", o, err)
	}
	id := [NCCLUniqueIDBytes]byte{1}
	for _, c := range []struct {
		b          *Backend
		id         [NCCLUniqueIDBytes]byte
		rank, size int
		want       string
	}{
		{nil, id, 0, 1, "got nil"},
		{on(0), id, 2, 2, "rank 2 of a group of 2"},
		{on(0), id, -1, 2, "rank -1 of a group of 2"},
		{on(0), id, 0, 0, "rank 0 of a group of 0"},
		{on(0), [NCCLUniqueIDBytes]byte{}, 0, 2, "all zeros"},
	} {
		if _, err := NewNCCLGroup(c.b, c.id, c.rank, c.size, NCCLOptions{}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewNCCLGroup(rank %d, size %d): got %v, want %q", c.rank, c.size, err, c.want)
		}
	}
	if o := (NCCLOptions{}).withDefaults(); o.Name != "nccl" || o.Timeout != DefaultNCCLTimeout {
		t.Errorf("defaults: %+v", o)
	}
}

// TestNCCLAbortState: the first reason wins, and every later call of the
// group returns it in local.go's words.
func TestNCCLAbortState(t *testing.T) {
	g := fakeGroup(0, 2)
	g.state.members = nil // nothing on a GPU to abort
	first := errors.New("rank 1 ran out of memory")
	if !g.state.abort(first) || g.state.abort(errors.New("second")) {
		t.Error("abort must report only the first reason as first")
	}
	want := "comm: world group aborted: rank 1 ran out of memory"
	for name, err := range map[string]error{
		"Barrier":          g.Barrier(),
		"AllReduceSum":     g.AllReduceSum(fakeTensor(backend.Float32, 2)),
		"AllReduceFloat64": g.AllReduceFloat64([]float64{1}),
		"Send":             g.Send(fakeTensor(backend.Float32, 2), 1),
	} {
		if err == nil || err.Error() != want || !errors.Is(err, first) {
			t.Errorf("%s after Abort: %v", name, err)
		}
	}
	s := &ncclState{name: "expert"}
	s.abort(nil)
	if got := s.abortErr().Error(); got != "comm: expert group aborted: aborted without a reason" {
		t.Errorf("nil reason: %q", got)
	}
}
