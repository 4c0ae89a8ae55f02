package cuda

// NCCLGroup: comm.Group over an NCCL communicator, one rank per GPU.
//
// # Where the work runs
//
// Every NCCL call of a rank runs on its Device's thread (Device.Do), where
// the GPU's context is current, and queues on the device's one stream,
// behind the ops the Backend queued before it. A tensor collective
// (AllReduceSum, ReduceScatterSum, AllGather, AllToAllRows) returns once
// NCCL has queued it: like any Backend op, its result is there for the ops
// queued after it, and the GPU finishes it only when every rank of the
// communicator has called it. The host-vector collectives (AllReduceFloat64,
// AllToAllInts), Barrier, Send and Recv wait for the GPU: they copy small
// values through a device scratch buffer and a page-locked host buffer and
// poll the stream until the copy back is done. AllReduceSumStart
// (nccl_async.go) is the exception: it queues its all-reduce on a
// communication stream of the group, to run beside the ops queued after it.
//
// # The watchdog
//
// Those waits are bounded. Between polls of the stream the rank asks NCCL
// for the communicator's asynchronous error (ncclCommGetAsyncError: a peer's
// connection broke, say) and checks whether the group was aborted. On an
// asynchronous error, or when the wait exceeds NCCLOptions.Timeout, the rank
// aborts the communicator (ncclCommAbort, which also stops the GPU work that
// waits for the missing peer) and returns an error naming the group; every
// later call returns it as the abort error. A tensor collective never waits,
// so a dead peer shows at the next wait: the next Barrier or host-vector
// collective, whose GPU work is queued behind it. Backend.Sync has no such
// bound: call Barrier first where a peer may have died.
//
// # Argument errors
//
// comm.NewLocal's groups check every collective's arguments on all ranks
// together, so that a bad call fails everywhere with the same error. Here
// that costs a small all-gather and a wait for the GPU per call, which would
// stall the pipeline of queued ops at every tensor collective; so the calls
// that wait anyway (AllReduceFloat64, AllToAllInts, Send and Recv) always
// agree on their arguments first, and the tensor collectives and Barrier do
// so only with NCCLOptions.CheckArgs (tests, debugging). Without it a rank
// whose own arguments are wrong returns the error (in local.go's words) and
// calls nothing, and its peers wait in the collective until the failing
// rank calls Abort, as a failing rank must, or the watchdog's timeout.
//
// # Abort
//
// Abort records the error (later calls return it), then aborts the
// communicator on the device thread, after the call in progress there. A
// rank blocked in a wait sees the abort at its next poll and returns. If the
// device thread is stuck inside a call that cannot return (a collective
// queued behind a dead peer, waited for by Backend.Sync), the communicator is
// aborted from another thread after abortGrace, which NCCL allows and which
// releases the stuck call. The groups NewNCCLGroups makes for one process
// share their abort: Abort on one aborts them all, as comm.NewLocal's do.
// Across processes each rank aborts its own communicator; peers see NCCL's
// remote error or the timeout, and the rendezvous (launch.Rendezvous) tells
// every node of a failure.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/comm"
)

// DefaultNCCLTimeout bounds a wait of NCCLGroup for the GPU when
// NCCLOptions.Timeout is 0. A wait covers every op queued on the device
// before it (a whole training step, say) and a peer's checkpoint write
// before a Barrier, so it is generous.
const DefaultNCCLTimeout = 10 * time.Minute

// abortGrace is how long Abort waits for the device thread to abort the
// communicator in turn before it aborts it from another thread (at most;
// see NCCLGroup.grace).
const abortGrace = 5 * time.Second

// NCCLOptions configures NewNCCLGroups and NewNCCLGroup. The zero value is
// a group named "nccl", DefaultNCCLTimeout, no argument agreement for the
// tensor collectives, and libnccl from the default places.
type NCCLOptions struct {
	// Name is the group's name in errors ("world", "expert", ...); "" is
	// "nccl".
	Name string
	// Timeout bounds every wait for the GPU (Barrier, the host-vector
	// collectives, Send, Recv): past it the group is aborted and the call
	// fails. 0 is DefaultNCCLTimeout.
	Timeout time.Duration
	// CheckArgs makes the tensor collectives and Barrier agree on their
	// arguments across ranks before they run, as comm.NewLocal's do, at
	// the cost of a wait for the GPU per call.
	CheckArgs bool
	// Search says where libnccl is looked for (see package driver).
	Search driver.Search
	// PeerAccess makes NewNCCLGroups enable peer access between the GPUs
	// (EnablePeerAccess) and NCCLRanks hand out NCCLPeerGroups, which
	// offer comm.PeerAccess: what the fused MoE dispatcher needs.
	PeerAccess bool
}

// NCCLGroup is one rank of an NCCL communicator, on one Backend (its
// Device's stream). It implements comm.Group for tensors of that Backend:
// AllReduceSum and ReduceScatterSum sum float32 tensors; AllGather,
// AllToAllRows, Send and Recv move float32 or int32 ones. Like every
// comm.Group, a rank calls it from one goroutine at a time; Abort may be
// called from any goroutine. Close it when done.
type NCCLGroup struct {
	lib        *NCCL
	b          *Backend
	dev        *Device
	rank, size int
	name       string
	timeout    time.Duration
	checkArgs  bool
	state      *ncclState

	commMu sync.Mutex
	comm   ncclComm // 0 once destroyed or aborted

	// Touched only by the rank's goroutine.
	dscratch *Buffer // device scratch, grown on demand
	hscratch []byte  // page-locked host scratch, grown on demand
	closed   bool

	// The communication stream of AllReduceSumStart (nccl_async.go); nil
	// before the first. Touched only on the device thread.
	async *ncclAsync
}

var _ comm.Group = (*NCCLGroup)(nil)

// ncclState is the abort state the groups of one communicator in this
// process share.
type ncclState struct {
	name    string
	aborted atomic.Bool
	mu      sync.Mutex
	err     error
	members []*NCCLGroup
	// exchange is PeerTensors' meeting (NCCLOptions.PeerAccess), nil
	// without peer access.
	exchange *comm.Exchange
}

// abort records err as the reason (the first one wins) and aborts every
// member's communicator. It reports whether err was the first.
func (s *ncclState) abort(err error) bool {
	if err == nil {
		err = errors.New("aborted without a reason")
	}
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return false
	}
	s.err = err
	s.aborted.Store(true)
	members := s.members
	s.mu.Unlock()
	if s.exchange != nil {
		s.exchange.Abort(err)
	}
	for _, g := range members {
		g.abortComm()
	}
	return true
}

// is reports whether err is the recorded reason itself (the watchdog
// returns the error it aborted with as it is).
func (s *ncclState) is(err error) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err == err
}

// abortErr is the error every call returns once the group is aborted.
func (s *ncclState) abortErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Errorf("comm: %s group aborted: %w", s.name, s.err)
}

func (o NCCLOptions) withDefaults() NCCLOptions {
	if o.Name == "" {
		o.Name = "nccl"
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultNCCLTimeout
	}
	return o
}

// NewNCCLGroups makes one communicator over the GPUs of backends, for one
// process that drives them all (ncclCommInitAll): group r is rank r, on
// backends[r]. Each backend must be on its own GPU (NCCL runs one rank per
// GPU). Then each rank's goroutine calls the collectives of its group: a
// call queues the rank's part on its GPU and returns, and the GPUs complete
// a collective once every rank has called it. Each rank's NCCL calls run on
// its own device thread, so plain calls from concurrent goroutines do not
// deadlock (NCCL needs ncclGroupStart/End only around calls for several
// GPUs issued from one thread). Calling the ranks' collectives one after
// another from a single goroutine works for the tensor collectives but
// deadlocks in the first call that waits (Barrier, the host-vector
// collectives), which waits for peers not yet called.
func NewNCCLGroups(backends []*Backend, opts NCCLOptions) ([]*NCCLGroup, error) {
	opts = opts.withDefaults()
	ordinals, err := checkNCCLBackends(backends)
	if err != nil {
		return nil, err
	}
	lib, err := LoadNCCL(opts.Search)
	if err != nil {
		return nil, err
	}
	state := &ncclState{name: opts.Name}
	if opts.PeerAccess {
		if err := EnablePeerAccess(backends); err != nil {
			return nil, fmt.Errorf("comm: %s group of %d GPUs %v: %w", opts.Name, len(ordinals), ordinals, err)
		}
		if state.exchange, err = comm.NewExchange(opts.Name, len(backends), opts.Timeout); err != nil {
			return nil, err
		}
	}
	d0 := backends[0].dev
	var comms []ncclComm
	err = d0.Do(func() error {
		var e error
		comms, e = lib.initAll(ordinals)
		// ncclCommInitAll switches the thread between devices while it
		// works; make sure the device's own context is current again.
		return errors.Join(e, d0.drv.CtxSetCurrent(d0.ctx))
	})
	if err != nil {
		return nil, fmt.Errorf("comm: %s group of %d GPUs %v: %w", opts.Name, len(ordinals), ordinals, err)
	}
	groups := make([]*NCCLGroup, len(backends))
	for r, b := range backends {
		groups[r] = newNCCLGroup(lib, b, comms[r], r, len(backends), opts, state)
	}
	state.members = groups
	return groups, nil
}

// checkNCCLBackends checks NewNCCLGroups' backends and returns their GPU
// ordinals.
func checkNCCLBackends(backends []*Backend) ([]int32, error) {
	if len(backends) == 0 {
		return nil, errors.New("cuda: NewNCCLGroups needs at least one backend")
	}
	ordinals := make([]int32, len(backends))
	seen := map[int]int{}
	for r, b := range backends {
		if b == nil || b.dev == nil {
			return nil, fmt.Errorf("cuda: NewNCCLGroups: backend %d is nil", r)
		}
		o := b.dev.info.Ordinal
		if q, dup := seen[o]; dup {
			return nil, fmt.Errorf("cuda: NewNCCLGroups: backends %d and %d are both on GPU %d; NCCL runs one rank per GPU (comm.NewLocal runs several ranks on one)", q, r, o)
		}
		seen[o] = r
		ordinals[r] = int32(o)
	}
	return ordinals, nil
}

// NewNCCLGroup joins, as rank of size, the communicator named by id (from
// NCCLUniqueID on one rank, handed to the others by the rendezvous:
// launch.Rendezvous.Blob), for one rank per process. It returns once every
// rank has joined; NCCL's own bootstrap bounds that wait only by its
// network timeouts, so call it after the rendezvous has seen every node.
func NewNCCLGroup(b *Backend, id [NCCLUniqueIDBytes]byte, rank, size int, opts NCCLOptions) (*NCCLGroup, error) {
	opts = opts.withDefaults()
	if err := checkNCCLRank(b, id, rank, size); err != nil {
		return nil, err
	}
	lib, err := LoadNCCL(opts.Search)
	if err != nil {
		return nil, err
	}
	var c ncclComm
	err = b.dev.Do(func() error {
		var e error
		c, e = lib.initRank(size, rank, id)
		return e
	})
	if err != nil {
		return nil, fmt.Errorf("comm: %s group, rank %d of %d: %w", opts.Name, rank, size, err)
	}
	state := &ncclState{name: opts.Name}
	g := newNCCLGroup(lib, b, c, rank, size, opts, state)
	state.members = []*NCCLGroup{g}
	return g, nil
}

// checkNCCLRank checks NewNCCLGroup's arguments.
func checkNCCLRank(b *Backend, id [NCCLUniqueIDBytes]byte, rank, size int) error {
	switch {
	case b == nil || b.dev == nil:
		return errors.New("cuda: NewNCCLGroup needs the backend of the rank's GPU, got nil")
	case size < 1 || rank < 0 || rank >= size:
		return fmt.Errorf("cuda: NewNCCLGroup: rank %d of a group of %d; need 0 <= rank < size", rank, size)
	case id == [NCCLUniqueIDBytes]byte{}:
		return errors.New("cuda: NewNCCLGroup: the NCCL unique id is all zeros; one rank makes it with NCCLUniqueID and the rendezvous hands it to every rank")
	}
	return nil
}

func newNCCLGroup(lib *NCCL, b *Backend, c ncclComm, rank, size int, opts NCCLOptions, state *ncclState) *NCCLGroup {
	return &NCCLGroup{
		lib: lib, b: b, dev: b.dev, comm: c,
		rank: rank, size: size, name: opts.Name,
		timeout: opts.Timeout, checkArgs: opts.CheckArgs, state: state,
	}
}

func (g *NCCLGroup) Rank() int { return g.rank }
func (g *NCCLGroup) Size() int { return g.size }

// Abort makes every pending and future call of the group fail with err
// (see the file comment for how the communicator is stopped).
func (g *NCCLGroup) Abort(err error) { g.state.abort(err) }

// Close destroys the communicator (or does nothing more to it when it was
// aborted) and frees the group's scratch memory. Every rank closes its
// group; later calls fail. Close runs on the device thread: after a call
// that failed because a peer is gone, Abort first, so that nothing there
// waits for the peer.
func (g *NCCLGroup) Close() error {
	if g.closed {
		return fmt.Errorf("comm: %s group, rank %d: closed twice", g.name, g.rank)
	}
	g.closed = true
	err := g.dev.Do(func() error {
		var err error
		if c := g.take(); c != 0 {
			err = g.lib.destroy(c)
		}
		return errors.Join(err, g.closeAsync())
	})
	if g.dscratch != nil {
		err = errors.Join(err, g.dev.Free(g.dscratch))
		g.dscratch = nil
	}
	if g.hscratch != nil {
		err = errors.Join(err, g.dev.FreeHost(g.hscratch))
		g.hscratch = nil
	}
	return err
}

// handle is the communicator, 0 once it is gone.
func (g *NCCLGroup) handle() ncclComm {
	g.commMu.Lock()
	defer g.commMu.Unlock()
	return g.comm
}

// take returns the communicator and forgets it, so that exactly one caller
// destroys or aborts it.
func (g *NCCLGroup) take() ncclComm {
	g.commMu.Lock()
	defer g.commMu.Unlock()
	c := g.comm
	g.comm = 0
	return c
}

// abortComm aborts the communicator on the device thread, after the work
// queued there, or from another thread when the device thread does not get
// to it within abortGrace (see the file comment).
func (g *NCCLGroup) abortComm() {
	ran := make(chan struct{})
	err := g.dev.Submit(func() error {
		defer close(ran)
		if c := g.take(); c != 0 {
			// An abort that fails has nothing left to undo; its error
			// would only surface in an unrelated Backend.Sync.
			g.lib.abort(c)
		}
		return nil
	})
	if err != nil {
		return // the device is closed, and the communicator with it
	}
	go func() {
		select {
		case <-ran:
		case <-time.After(g.grace()):
			// Locked, so that the context set here stays with the call;
			// the thread ends with the goroutine.
			runtime.LockOSThread()
			if c := g.take(); c != 0 {
				g.dev.drv.CtxSetCurrent(g.dev.ctx)
				g.lib.abort(c)
			}
		}
	}()
}

// usable fails once the group is closed or aborted.
func (g *NCCLGroup) usable() error {
	if g.closed {
		return fmt.Errorf("comm: %s group, rank %d: used after Close", g.name, g.rank)
	}
	if g.state.aborted.Load() {
		return g.state.abortErr()
	}
	return nil
}

// rankErr is a rank's argument error in local.go's words.
func (g *NCCLGroup) rankErr(op string, rank int, err error) error {
	return fmt.Errorf("comm: %s group %s, rank %d: %w", g.name, op, rank, err)
}

// call is the frame of every collective: the checks, the scratch memory,
// the argument agreement when agree is set, and body on the device thread
// with the live communicator. check, if not nil, checks the agreed
// descriptors of all ranks.
func (g *NCCLGroup) call(op string, argErr error, ints []int64, agree bool, scratch int, check func([]descriptor) error, body func(c ncclComm) error) error {
	if err := g.usable(); err != nil {
		return err
	}
	if !agree && argErr != nil {
		return g.rankErr(op, g.rank, argErr)
	}
	if agree {
		scratch = max(scratch, g.size*descLen(g.size))
	}
	if err := g.growScratch(scratch); err != nil {
		return err
	}
	// The watchdog in wait covers the GPU; this timer covers the host: an
	// NCCL call that blocks (a first call connecting to a peer that never
	// comes) is released by the abort it triggers.
	timer := time.AfterFunc(g.timeout+g.grace(), func() {
		g.state.abort(fmt.Errorf("comm: %s group %s on rank %d: the call is not done after %v (NCCLOptions.Timeout); a peer rank may have failed or stopped calling the group's collectives",
			g.name, op, g.rank, g.timeout+g.grace()))
	})
	err := g.dev.Do(func() error {
		c := g.handle()
		if c == 0 {
			return g.state.abortErr()
		}
		if agree {
			all, err := g.agree(c, op, argErr, ints)
			if err != nil {
				return err
			}
			if check != nil {
				if err := check(all); err != nil {
					return err
				}
			}
		}
		return body(c)
	})
	timer.Stop()
	if err != nil && g.state.aborted.Load() && !g.state.is(err) {
		// NCCL's own error for a call cut short by the abort says less
		// than the reason.
		return g.state.abortErr()
	}
	return err
}

// grace is how long an abort waits for the device thread before it aborts
// the communicator from another thread: abortGrace, or the timeout when
// that is shorter.
func (g *NCCLGroup) grace() time.Duration { return min(abortGrace, g.timeout) }

// growScratch makes both scratch buffers hold at least n bytes.
func (g *NCCLGroup) growScratch(n int) error {
	n = max(n, 512)
	if g.dscratch == nil || g.dscratch.Size() < int64(n) {
		if g.dscratch != nil {
			if err := g.dev.Free(g.dscratch); err != nil {
				return err
			}
			g.dscratch = nil
		}
		buf, err := g.dev.Alloc(int64(n))
		if err != nil {
			return fmt.Errorf("comm: %s group, rank %d: scratch memory: %w", g.name, g.rank, err)
		}
		g.dscratch = buf
	}
	if len(g.hscratch) < n {
		if g.hscratch != nil {
			if err := g.dev.FreeHost(g.hscratch); err != nil {
				return err
			}
			g.hscratch = nil
		}
		h, err := g.dev.AllocHost(n)
		if err != nil {
			return fmt.Errorf("comm: %s group, rank %d: page-locked scratch memory: %w", g.name, g.rank, err)
		}
		g.hscratch = h
	}
	return nil
}

// The helpers below run on the device thread.

// scratchAt is the device address off bytes into the scratch buffer.
func (g *NCCLGroup) scratchAt(off int) driver.DevicePtr {
	return g.dscratch.Ptr() + driver.DevicePtr(off)
}

// toScratch queues a copy of src to off bytes into the device scratch.
// From pageable memory the driver has staged src when the call returns, so
// src may be reused at once.
func (g *NCCLGroup) toScratch(off int, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return g.dev.drv.MemcpyHtoDAsync(g.scratchAt(off), unsafe.Pointer(&src[0]), len(src), g.dev.stream)
}

// fromScratch queues a copy of n bytes from off bytes into the device
// scratch to the start of the host scratch, waits for it under the
// watchdog, and returns those bytes (valid until the next call).
func (g *NCCLGroup) fromScratch(op string, c ncclComm, off, n int) ([]byte, error) {
	if n > 0 {
		if err := g.dev.drv.MemcpyDtoHAsync(unsafe.Pointer(&g.hscratch[0]), g.scratchAt(off), n, g.dev.stream); err != nil {
			return nil, err
		}
	}
	if err := g.wait(op, c); err != nil {
		return nil, err
	}
	return g.hscratch[:n], nil
}

// wait waits for all work queued on the stream, under the watchdog.
func (g *NCCLGroup) wait(op string, c ncclComm) error {
	st := g.dev.stream
	res, err := watch(g.timeout,
		func() (bool, error) { return g.dev.drv.StreamQuery(st) },
		func() error { return g.lib.asyncError(c) },
		g.state.aborted.Load)
	switch res {
	case watchDone:
		return nil
	case watchFailed:
		return fmt.Errorf("comm: %s group %s on rank %d: %w", g.name, op, g.rank, err)
	case watchAborted:
		return g.state.abortErr()
	case watchUnhealthy:
		err = fmt.Errorf("comm: %s group %s on rank %d: NCCL reports an asynchronous error; a peer rank or its connection may have failed: %w", g.name, op, g.rank, err)
	default: // watchTimeout
		err = fmt.Errorf("comm: %s group %s on rank %d: the GPU work it waits for is not done after %v (NCCLOptions.Timeout); a peer rank may have failed or stopped calling the group's collectives",
			g.name, op, g.rank, g.timeout)
	}
	// This thread is the device thread: abort the communicator now, which
	// also stops the GPU work stuck on the peer, then tell the others.
	if cc := g.take(); cc != 0 {
		err = errors.Join(err, g.lib.abort(cc))
	}
	g.state.abort(err)
	return err
}

// watchResult is how a watched wait ended.
type watchResult int

const (
	watchDone      watchResult = iota // the work is done
	watchFailed                       // polling failed (a driver error)
	watchAborted                      // the group was aborted meanwhile
	watchUnhealthy                    // the communicator has an asynchronous error
	watchTimeout                      // the timeout passed
)

// Poll intervals of watch: short at first, for the common wait of tens of
// microseconds, then longer so a long wait does not spin.
const (
	watchFirstPoll = 5 * time.Microsecond
	watchMaxPoll   = time.Millisecond
)

// watch polls done until it reports true, checking health and aborted
// between polls, for at most timeout.
func watch(timeout time.Duration, done func() (bool, error), health func() error, aborted func() bool) (watchResult, error) {
	deadline := time.Now().Add(timeout)
	pause := watchFirstPoll
	for {
		ok, err := done()
		switch {
		case err != nil:
			return watchFailed, err
		case ok:
			return watchDone, nil
		case aborted():
			return watchAborted, nil
		}
		if err := health(); err != nil {
			return watchUnhealthy, err
		}
		if time.Now().After(deadline) {
			return watchTimeout, nil
		}
		time.Sleep(pause)
		pause = min(2*pause, watchMaxPoll)
	}
}

// # Argument agreement
//
// Each rank encodes its call as a descriptor of descLen(size) bytes (the
// same length for every call of a group, so that ranks in different calls
// still gather the same amount): the collective, the rank's own argument
// error (its text, cut to descErrBytes) and up to descInts(size) integers.
// An all-gather gives every rank every descriptor, and all ranks check them
// the same way, so they all reach the same verdict.

// groupOps names the calls, indexed by their code in a descriptor (0 is
// none).
func groupOps() []string {
	return []string{"", "AllReduceSum", "AllReduceFloat64", "AllToAllInts", "AllToAllRows", "ReduceScatterSum", "AllGather", "Barrier"}
}

func opCode(op string) int64 {
	for i, o := range groupOps() {
		if o == op && i > 0 {
			return int64(i)
		}
	}
	return 0
}

func opName(code int64) string {
	if ops := groupOps(); code > 0 && code < int64(len(ops)) {
		return ops[code]
	}
	return fmt.Sprintf("an unknown collective (code %d)", code)
}

const descErrBytes = 192

// descInts is how many integers a descriptor holds: a dtype and a length
// or row width, plus the send and recv counts of AllToAllRows.
func descInts(size int) int { return 4 + 2*size }

// descLen is the encoded size: op code, error length, integers, error text.
func descLen(size int) int { return 16 + 8*descInts(size) + descErrBytes }

// descriptor is one rank's call, decoded.
type descriptor struct {
	op   string
	err  string
	ints []int64
}

func encodeDesc(size int, op string, argErr error, ints []int64) []byte {
	b := make([]byte, descLen(size))
	binary.LittleEndian.PutUint64(b[0:], uint64(opCode(op)))
	for i, v := range ints[:min(len(ints), descInts(size))] {
		binary.LittleEndian.PutUint64(b[16+8*i:], uint64(v))
	}
	if argErr != nil {
		text := b[16+8*descInts(size):]
		n := copy(text, argErr.Error())
		binary.LittleEndian.PutUint64(b[8:], uint64(max(n, 1)))
		if n == 0 {
			copy(text, "?")
		}
	}
	return b
}

func decodeDesc(size int, b []byte) descriptor {
	d := descriptor{op: opName(int64(binary.LittleEndian.Uint64(b[0:]))), ints: make([]int64, descInts(size))}
	for i := range d.ints {
		d.ints[i] = int64(binary.LittleEndian.Uint64(b[16+8*i:]))
	}
	if n := binary.LittleEndian.Uint64(b[8:]); n > 0 {
		text := b[16+8*descInts(size):]
		d.err = string(text[:min(int(n), len(text))])
	}
	return d
}

// checkAgreement is local.go's gather verdict over the descriptors of all
// ranks, as seen by rank: every rank in the same collective, and no rank
// with an argument error.
func checkAgreement(name string, rank int, all []descriptor) error {
	me := all[rank]
	for j, d := range all {
		if d.op != me.op {
			return fmt.Errorf("comm: %s group: rank %d called %s while rank %d called %s; every rank must call the same collectives in the same order",
				name, rank, me.op, j, d.op)
		}
	}
	for j, d := range all {
		if d.err != "" {
			return fmt.Errorf("comm: %s group %s, rank %d: %w", name, me.op, j, errors.New(d.err))
		}
	}
	return nil
}

// agree all-gathers this rank's descriptor, waits, and checks the
// agreement. The descriptor goes in place into this rank's slot of the
// gathered block at the start of the scratch.
func (g *NCCLGroup) agree(c ncclComm, op string, argErr error, ints []int64) ([]descriptor, error) {
	n := descLen(g.size)
	if err := g.toScratch(g.rank*n, encodeDesc(g.size, op, argErr, ints)); err != nil {
		return nil, err
	}
	if err := g.lib.allGather(g.scratchAt(g.rank*n), g.scratchAt(0), n, ncclUint8, c, g.dev.stream); err != nil {
		return nil, err
	}
	raw, err := g.fromScratch(op, c, 0, g.size*n)
	if err != nil {
		return nil, err
	}
	all := make([]descriptor, g.size)
	for j := range all {
		all[j] = decodeDesc(g.size, raw[j*n:(j+1)*n])
	}
	return all, checkAgreement(g.name, g.rank, all)
}

// # Tensors

// devArg is a tensor as NCCL takes it: device address, element type and
// size, and length.
type devArg struct {
	p    driver.DevicePtr
	dt   ncclDataType
	elem int // bytes
	n    int
}

// devTensor is t as NCCL takes it, or the reason it cannot be used (name
// says which argument it is).
func devTensor(name string, t backend.Tensor) (devArg, error) {
	if t == nil {
		return devArg{}, fmt.Errorf("%s is nil", name)
	}
	ct, ok := t.(*Tensor)
	if !ok {
		return devArg{}, fmt.Errorf("%s is a %T, not a tensor of the CUDA backend", name, t)
	}
	var dt ncclDataType
	switch ct.dt {
	case backend.Float32:
		dt = ncclFloat32
	case backend.Int32:
		dt = ncclInt32
	case backend.BFloat16:
		dt = ncclBfloat16
	default:
		return devArg{}, fmt.Errorf("%s has dtype %v, which NCCLGroup does not move", name, ct.dt)
	}
	p, ok := ct.ptr()
	if !ok {
		return devArg{}, fmt.Errorf("%s has no memory: its allocation failed (Backend.Sync says why)", name)
	}
	return devArg{p: p, dt: dt, elem: dtypeBytes(ct.dt), n: ct.Len()}, nil
}

// checkSum checks a tensor that a reduction sums, in local.go's words.
func (g *NCCLGroup) checkSum(name string, t backend.Tensor) error {
	switch {
	case t == nil:
		return fmt.Errorf("%s is nil", name)
	case t.DType() != g.b.FloatType():
		return fmt.Errorf("cannot sum a %v tensor (%s) on the %s backend, which computes in %v", t.DType(), name, g.b.Name(), g.b.FloatType())
	}
	_, err := devTensor(name, t)
	return err
}

// AllReduceSum sums t over the group in place (ncclAllReduce).
func (g *NCCLGroup) AllReduceSum(t backend.Tensor) error {
	const op = "AllReduceSum"
	var argErr error
	switch {
	case t == nil:
		argErr = errors.New("the tensor is nil")
	case t.DType() != g.b.FloatType():
		argErr = fmt.Errorf("cannot sum a %v tensor on the %s backend, which computes in %v", t.DType(), g.b.Name(), g.b.FloatType())
	default:
		_, argErr = devTensor("the tensor", t)
	}
	ints := []int64{0, 0}
	if argErr == nil {
		ints = []int64{int64(t.DType()), int64(t.Len())}
	}
	check := func(all []descriptor) error {
		a0 := all[0].ints
		for j, d := range all {
			if d.ints[0] != a0[0] || d.ints[1] != a0[1] {
				return fmt.Errorf("comm: %s group AllReduceSum: rank %d has %d elements of %v, rank 0 has %d of %v",
					g.name, j, d.ints[1], backend.DType(d.ints[0]), a0[1], backend.DType(a0[0]))
			}
		}
		return nil
	}
	err := g.call(op, argErr, ints, g.checkArgs, 0, check, func(c ncclComm) error {
		a, _ := devTensor("the tensor", t)
		if a.n == 0 {
			return nil
		}
		return g.lib.allReduce(a.p, a.p, a.n, a.dt, ncclSum, c, g.dev.stream)
	})
	runtime.KeepAlive(t)
	return err
}

// checkBlocks is local.go's check that every rank has the same block
// length and dtype.
func (g *NCCLGroup) checkBlocks(op string) func([]descriptor) error {
	return func(all []descriptor) error {
		a0 := all[0].ints
		for j, d := range all {
			if d.ints[0] != a0[0] || d.ints[1] != a0[1] {
				return fmt.Errorf("comm: %s group %s: rank %d has blocks of %d elements of %v, rank 0 of %d of %v",
					g.name, op, j, d.ints[1], backend.DType(d.ints[0]), a0[1], backend.DType(a0[0]))
			}
		}
		return nil
	}
}

// ReduceScatterSum sums send over the group and leaves block r of the sum
// in rank r's recv (ncclReduceScatter; recv may be this rank's block of
// send).
func (g *NCCLGroup) ReduceScatterSum(recv, send backend.Tensor) error {
	const op = "ReduceScatterSum"
	argErr := g.checkSum("recv", recv)
	if argErr == nil {
		argErr = g.checkSum("send", send)
	}
	if argErr == nil && (send.DType() != recv.DType() || send.Len() != recv.Len()*g.size) {
		argErr = fmt.Errorf("send has %d elements of %v but must hold %d (the group size %d times recv's %d) of %v",
			send.Len(), send.DType(), recv.Len()*g.size, g.size, recv.Len(), recv.DType())
	}
	ints := []int64{0, 0}
	if argErr == nil {
		ints = []int64{int64(send.DType()), int64(recv.Len())}
	}
	err := g.call(op, argErr, ints, g.checkArgs, 0, g.checkBlocks(op), func(c ncclComm) error {
		r, _ := devTensor("recv", recv)
		s, _ := devTensor("send", send)
		if r.n == 0 {
			return nil
		}
		return g.lib.reduceScatter(s.p, r.p, r.n, r.dt, ncclSum, c, g.dev.stream)
	})
	runtime.KeepAlive(recv)
	runtime.KeepAlive(send)
	return err
}

// AllGather concatenates every rank's send into recv, in rank order
// (ncclAllGather; send may be this rank's block of recv).
func (g *NCCLGroup) AllGather(recv, send backend.Tensor) error {
	const op = "AllGather"
	var argErr error
	switch {
	case recv == nil || send == nil:
		argErr = errors.New("recv or send is nil")
	case recv.DType() != send.DType() || recv.Len() != send.Len()*g.size:
		argErr = fmt.Errorf("recv has %d elements of %v but must hold %d (the group size %d times send's %d) of %v",
			recv.Len(), recv.DType(), send.Len()*g.size, g.size, send.Len(), send.DType())
	default:
		if _, argErr = devTensor("recv", recv); argErr == nil {
			_, argErr = devTensor("send", send)
		}
	}
	ints := []int64{0, 0}
	if argErr == nil {
		ints = []int64{int64(send.DType()), int64(send.Len())}
	}
	err := g.call(op, argErr, ints, g.checkArgs, 0, g.checkBlocks(op), func(c ncclComm) error {
		r, _ := devTensor("recv", recv)
		s, _ := devTensor("send", send)
		if s.n == 0 {
			return nil
		}
		return g.lib.allGather(s.p, r.p, s.n, s.dt, c, g.dev.stream)
	})
	runtime.KeepAlive(recv)
	runtime.KeepAlive(send)
	return err
}

// checkRows checks one rank's AllToAllRows arguments as comm's own groups
// do (comm.CheckRows), and that both tensors are this backend's.
func checkRows(recv, send backend.Tensor, recvCounts, sendCounts []int, size int) (int, error) {
	cols, err := comm.CheckRows(recv, send, recvCounts, sendCounts, size)
	if err != nil {
		return 0, err
	}
	if _, err := devTensor("recv", recv); err != nil {
		return 0, err
	}
	if _, err := devTensor("send", send); err != nil {
		return 0, err
	}
	return cols, nil
}

// rowOffsets returns where each rank's block starts, in rows: the prefix
// sums of counts.
func rowOffsets(counts []int) []int {
	off := make([]int, len(counts))
	at := 0
	for j, c := range counts {
		off[j] = at
		at += c
	}
	return off
}

// rowsTransfer is one transfer of an AllToAllRows, in rows: to peer from
// row from of send (a send), from peer into row to of recv (a receive), or,
// with the rank itself as peer, a copy between the two.
type rowsTransfer struct {
	peer     int
	kind     byte // 's' send, 'r' receive, 'c' local copy
	from, to int  // first row in send (s, c) and in recv (r, c)
	rows     int
}

// rowsTransfers plans rank's part of an AllToAllRows: its block for rank j
// starts at the prefix sum of sendCounts before j, and the rows from rank j
// land at the prefix sum of recvCounts before j. Empty blocks move nothing,
// on both sides, when the ranks' counts agree.
func rowsTransfers(rank int, recvCounts, sendCounts []int) []rowsTransfer {
	sendOff, recvOff := rowOffsets(sendCounts), rowOffsets(recvCounts)
	var ts []rowsTransfer
	for j := range sendCounts {
		if j == rank {
			if sendCounts[j] > 0 {
				ts = append(ts, rowsTransfer{peer: j, kind: 'c', from: sendOff[j], to: recvOff[j], rows: sendCounts[j]})
			}
			continue
		}
		if sendCounts[j] > 0 {
			ts = append(ts, rowsTransfer{peer: j, kind: 's', from: sendOff[j], rows: sendCounts[j]})
		}
		if recvCounts[j] > 0 {
			ts = append(ts, rowsTransfer{peer: j, kind: 'r', to: recvOff[j], rows: recvCounts[j]})
		}
	}
	return ts
}

// checkRowsPlan is local.go's check that the ranks agree: what i sends to
// j is what j expects from i, and all rows have one length and dtype. A
// descriptor holds dtype, row length, then the send and the recv counts.
func (g *NCCLGroup) checkRowsPlan(all []descriptor) error {
	a0 := all[0].ints
	for i, d := range all {
		a := d.ints
		if a[0] != a0[0] || a[1] != a0[1] {
			return fmt.Errorf("comm: %s group AllToAllRows: rank %d has rows of %d %v, rank 0 of %d %v",
				g.name, i, a[1], backend.DType(a[0]), a0[1], backend.DType(a0[0]))
		}
		for j, b := range all {
			if sent, want := a[2+j], b.ints[2+g.size+i]; sent != want {
				return fmt.Errorf("comm: %s group AllToAllRows: rank %d sends %d rows to rank %d, which expects %d",
					g.name, i, sent, j, want)
			}
		}
	}
	return nil
}

// AllToAllRows exchanges rows with uneven splits: the rank's sends and
// receives go between ncclGroupStart and ncclGroupEnd, so they progress
// together; its own block is a device copy.
func (g *NCCLGroup) AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error {
	const op = "AllToAllRows"
	cols, argErr := checkRows(recv, send, recvCounts, sendCounts, g.size)
	ints := make([]int64, descInts(g.size))
	if argErr == nil {
		ints[0], ints[1] = int64(send.DType()), int64(cols)
		for j := range g.size {
			ints[2+j], ints[2+g.size+j] = int64(sendCounts[j]), int64(recvCounts[j])
		}
	}
	err := g.call(op, argErr, ints, g.checkArgs, 0, g.checkRowsPlan, func(c ncclComm) error {
		s, _ := devTensor("send", send)
		r, _ := devTensor("recv", recv)
		sp, rp, dt, rowBytes := s.p, r.p, s.dt, s.elem*cols
		ts := rowsTransfers(g.rank, recvCounts, sendCounts)
		for _, t := range ts {
			if t.kind == 'c' {
				src, dst := sp+driver.DevicePtr(t.from*rowBytes), rp+driver.DevicePtr(t.to*rowBytes)
				if err := g.dev.drv.MemcpyDtoDAsync(dst, src, t.rows*rowBytes, g.dev.stream); err != nil {
					return err
				}
			}
		}
		if len(ts) == 0 || len(ts) == 1 && ts[0].kind == 'c' {
			return nil
		}
		return g.lib.grouped(func() error {
			for _, t := range ts {
				var err error
				switch t.kind {
				case 's':
					err = g.lib.send(sp+driver.DevicePtr(t.from*rowBytes), t.rows*cols, dt, t.peer, c, g.dev.stream)
				case 'r':
					err = g.lib.recv(rp+driver.DevicePtr(t.to*rowBytes), t.rows*cols, dt, t.peer, c, g.dev.stream)
				}
				if err != nil {
					return err
				}
			}
			return nil
		})
	})
	runtime.KeepAlive(recv)
	runtime.KeepAlive(send)
	return err
}

// # Host values and Barrier

// Barrier waits for every rank of the group: an all-reduce of one element,
// and a wait for it, which also covers every op queued on the device
// before it.
func (g *NCCLGroup) Barrier() error {
	const op = "Barrier"
	return g.call(op, nil, nil, g.checkArgs, 4, nil, func(c ncclComm) error {
		if err := g.lib.allReduce(g.scratchAt(0), g.scratchAt(0), 1, ncclInt32, ncclSum, c, g.dev.stream); err != nil {
			return err
		}
		return g.wait(op, c)
	})
}

// AllReduceFloat64 sums small host vectors in place: an all-reduce of
// float64 on the GPU, through the scratch buffers. The ranks first agree on
// the length.
func (g *NCCLGroup) AllReduceFloat64(vals []float64) error {
	const op = "AllReduceFloat64"
	check := func(all []descriptor) error {
		n0 := all[0].ints[0]
		for j, d := range all {
			if n := d.ints[0]; n != n0 {
				return fmt.Errorf("comm: %s group AllReduceFloat64: rank %d has %d values, rank 0 has %d", g.name, j, n, n0)
			}
		}
		return nil
	}
	n := len(vals)
	return g.call(op, nil, []int64{int64(n)}, true, 8*n, check, func(c ncclComm) error {
		if n == 0 {
			return nil
		}
		if err := g.toScratch(0, Bytes(vals)); err != nil {
			return err
		}
		if err := g.lib.allReduce(g.scratchAt(0), g.scratchAt(0), n, ncclFloat64, ncclSum, c, g.dev.stream); err != nil {
			return err
		}
		raw, err := g.fromScratch(op, c, 0, 8*n)
		if err != nil {
			return err
		}
		for i := range vals {
			vals[i] = math.Float64frombits(binary.LittleEndian.Uint64(raw[8*i:]))
		}
		return nil
	})
}

// AllToAllInts sends send[j] to rank j and returns what each rank sent to
// this one: every rank's send vector is all-gathered (size*size int64,
// small) and this rank takes its column.
func (g *NCCLGroup) AllToAllInts(send []int) ([]int, error) {
	const op = "AllToAllInts"
	var argErr error
	if len(send) != g.size {
		argErr = fmt.Errorf("send has %d entries for a group of %d", len(send), g.size)
	}
	row := 8 * g.size
	var recv []int
	err := g.call(op, argErr, nil, true, g.size*row, nil, func(c ncclComm) error {
		mine := make([]int64, g.size)
		for j, v := range send {
			mine[j] = int64(v)
		}
		if err := g.toScratch(g.rank*row, Bytes(mine)); err != nil {
			return err
		}
		if err := g.lib.allGather(g.scratchAt(g.rank*row), g.scratchAt(0), g.size, ncclInt64, c, g.dev.stream); err != nil {
			return err
		}
		raw, err := g.fromScratch(op, c, 0, g.size*row)
		if err != nil {
			return err
		}
		recv = make([]int, g.size)
		for j := range recv {
			recv[j] = int(int64(binary.LittleEndian.Uint64(raw[j*row+8*g.rank:])))
		}
		return nil
	})
	return recv, err
}

// # Send and Recv
//
// NCCL needs the sender's and the receiver's counts and types to match, and
// the comm.Group contract has both calls fail with the same error when they
// do not. So the sender first sends a header (the tensor's dtype and
// length), the receiver answers with its own, and both decide from the two
// headers with the same function (p2pVerdict) before the payload moves.
// Each side waits once, for the other's header. The payload is queued on
// the stream; the ops queued after Send or Recv on the device run after it,
// which is what lets the sender overwrite its tensor once Send returns.

// p2pHeader describes one side's tensor: dtype (or a p2pNil/p2pBad mark)
// and length.
type p2pHeader struct{ dt, n int64 }

const (
	p2pNil = -1 // the tensor is nil
	p2pBad = -2 // the tensor cannot be used (not a CUDA tensor, no memory)
)

func headerOf(t backend.Tensor) p2pHeader {
	if t == nil {
		return p2pHeader{dt: p2pNil}
	}
	if _, err := devTensor("t", t); err != nil {
		return p2pHeader{dt: p2pBad}
	}
	return p2pHeader{dt: int64(t.DType()), n: int64(t.Len())}
}

func (h p2pHeader) bytes() []byte {
	return Bytes([]int64{h.dt, h.n})
}

func headerFrom(b []byte) p2pHeader {
	return p2pHeader{dt: int64(binary.LittleEndian.Uint64(b)), n: int64(binary.LittleEndian.Uint64(b[8:]))}
}

// p2pVerdict is the outcome of a Send from src to dst, in local.go's words;
// both sides compute it from the same two headers.
func p2pVerdict(name string, src, dst int, sent, want p2pHeader) error {
	prefix := fmt.Sprintf("comm: %s group Send from rank %d to rank %d", name, src, dst)
	switch {
	case sent.dt == p2pNil:
		return fmt.Errorf("%s: the sent tensor is nil", prefix)
	case want.dt == p2pNil:
		return fmt.Errorf("%s: the receive buffer is nil", prefix)
	case sent.dt == p2pBad:
		return fmt.Errorf("%s: the sent tensor is not a usable tensor of the CUDA backend", prefix)
	case want.dt == p2pBad:
		return fmt.Errorf("%s: the receive buffer is not a usable tensor of the CUDA backend", prefix)
	case sent != want:
		return fmt.Errorf("%s: sent %d elements of %v, but the receive buffer holds %d of %v",
			prefix, sent.n, backend.DType(sent.dt), want.n, backend.DType(want.dt))
	}
	return nil
}

// checkPeer checks the peer rank of a Send or Recv, in local.go's words.
func (g *NCCLGroup) checkPeer(op string, peer int) error {
	if peer < 0 || peer >= g.size || peer == g.rank {
		return fmt.Errorf("comm: %s group %s on rank %d: peer rank %d is not another rank of this group of %d",
			g.name, op, g.rank, peer, g.size)
	}
	return nil
}

// Send hands t to group rank dst, which takes it with a matching Recv.
func (g *NCCLGroup) Send(t backend.Tensor, dst int) error {
	const op = "Send"
	if err := g.checkPeer(op, dst); err != nil {
		return err
	}
	mine := headerOf(t)
	err := g.call(op, nil, nil, false, 32, nil, func(c ncclComm) error {
		if err := g.toScratch(0, mine.bytes()); err != nil {
			return err
		}
		if err := g.lib.send(g.scratchAt(0), 2, ncclInt64, dst, c, g.dev.stream); err != nil {
			return err
		}
		if err := g.lib.recv(g.scratchAt(16), 2, ncclInt64, dst, c, g.dev.stream); err != nil {
			return err
		}
		raw, err := g.fromScratch(op, c, 16, 16)
		if err != nil {
			return err
		}
		if err := p2pVerdict(g.name, g.rank, dst, mine, headerFrom(raw)); err != nil || mine.n == 0 {
			return err
		}
		a, _ := devTensor("t", t)
		return g.lib.send(a.p, a.n, a.dt, dst, c, g.dev.stream)
	})
	runtime.KeepAlive(t)
	return err
}

// Recv fills t from group rank src.
func (g *NCCLGroup) Recv(t backend.Tensor, src int) error {
	const op = "Recv"
	if err := g.checkPeer(op, src); err != nil {
		return err
	}
	mine := headerOf(t)
	err := g.call(op, nil, nil, false, 32, nil, func(c ncclComm) error {
		if err := g.lib.recv(g.scratchAt(0), 2, ncclInt64, src, c, g.dev.stream); err != nil {
			return err
		}
		raw, err := g.fromScratch(op, c, 0, 16)
		if err != nil {
			return err
		}
		sent := headerFrom(raw)
		if err := g.toScratch(16, mine.bytes()); err != nil {
			return err
		}
		if err := g.lib.send(g.scratchAt(16), 2, ncclInt64, src, c, g.dev.stream); err != nil {
			return err
		}
		if err := p2pVerdict(g.name, src, g.rank, sent, mine); err != nil || mine.n == 0 {
			return err
		}
		a, _ := devTensor("t", t)
		return g.lib.recv(a.p, a.n, a.dt, src, c, g.dev.stream)
	})
	runtime.KeepAlive(t)
	return err
}
