package cuda

// The MoE experts' fused kernels (kernels/moe_fused.cu):
// DispatchSwiGLU and DownCombine of backend.Backend on the Hopper grouped
// GEMM's mainloop.
//
//   - moe_dispatch_swiglu pulls every expert-major row from its source
//     rank's token rows (float32, plain device pointers: the virtual ranks
//     of this backend) into xRD as bf16, on a spare warp of the producer
//     warpgroup, publishing per m-tile ready counts; the TMA thread waits
//     for a tile's count before loading it, so the gate/up product of a
//     tile starts as soon as its rows have landed. W1 and W3 are multiplied
//     in one 256-column tile (128 columns of each), so SwiGLU runs in the
//     epilogue: the consumers stage h1 and h3, and two more spare warps
//     store them and compute and store act while the consumers go on to
//     the next tile.
//   - moe_down_combine is the down product whose epilogue writes each row
//     straight to its source rank's output rows (float32, or bf16 by
//     moe_down_combine_bf16) and, when the call has flags, raises the
//     row's flag in the source's list once the row is whole (CombineRows,
//     peer.go, waits for them on the source's side).
//
// Calls the kernels do not take (operands not bf16, a GPU other than
// Hopper, sizes the kernel refuses) run the unfused sequence
// (backend.DispatchSwiGLUBySteps, DownCombineBySteps), which is also the
// reference the tests compare the kernels with.
//
// Where the host still needs a count: the row count R of the call (the
// plan's, which sizes the buffers the layer passes) and the group sizes,
// which go up as offsets with the call. The kernels themselves take their
// tile schedule from the offsets on the device.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// fusedMaxRanks is the most ranks a fused call's pointer tables hold.
const fusedMaxRanks = 256

// fusedTables is the device memory a fused call needs besides its
// operands: per-rank pointer tables and group offsets (staged up with the
// call), the per m-tile chunk sets and the fault record of the tile
// waits. Calls are queued on one stream, so a call's uploads land after
// the previous call's kernel has read them.
type fusedTables struct {
	mu     sync.Mutex
	tables *Buffer // [fusedMaxRanks]u64 ptrs, toks, scales and done flags, [ggMaxExperts+1]int32 offsets
	host   []byte
	flags  *Buffer
	flagsN int // ints in flags
	// fault is the record of the first bounded wait that timed out ([4]
	// int32: the tile waits' (gg_wait_tile) or CombineRows' flag waits'),
	// zeroed when allocated and after a report; armed says a kernel that
	// writes it was queued since the last check, with bound timeout (tile
	// waits) or combineWait (flag waits).
	fault                *Buffer
	armed                bool
	timeout, combineWait time.Duration
	// combineTimeout, when set, replaces combineRowsTimeout for
	// CombineRows' flag waits (tests of the report).
	combineTimeout time.Duration
}

const (
	fusedPtrsOff   = 0
	fusedToksOff   = 8 * fusedMaxRanks
	fusedScalesOff = 16 * fusedMaxRanks
	fusedDoneOff   = 24 * fusedMaxRanks
	fusedOffsOff   = 32 * fusedMaxRanks
	fusedTablesB   = fusedOffsOff + 4*(ggMaxExperts+1)
)

// fusedTimeout bounds a fused kernel's wait for one m-tile's rows (unless
// GroupedGemm.fusedTimeout says otherwise): far past any real delivery (a
// tile is microseconds of copying), short enough that a lost peer is
// reported rather than mistaken for a hang. It must stay well under the
// bound at which the kernels' mbarrier waits trap (GG_TIMEOUT_NS in
// hopper.cuh, 10 s): the consumers wait on the stage that the TMA thread
// fills once its tile wait gives up, and a consumer that trapped first
// would turn the named report (checkFault) into a bare launch error.
const fusedTimeout = 4 * time.Second

// combineRowsTimeout bounds CombineRows' wait for a row another rank's
// kernel sends (combine_rows_f32 has no mbarrier, so no trap to stay
// under): long enough for one GPU's queue to fall seconds behind a
// peer's.
const combineRowsTimeout = 10 * time.Second

// stage uploads the pointer tables (toks, scales and done may be nil) and
// puts the group offsets after them: groups' device offsets copied on the
// device, or Rows' prefix sums uploaded with the tables.
func (f *fusedTables) stage(d *Device, ptrs, toks, scales, done []driver.DevicePtr, groups backend.Groups) error {
	if f.tables == nil {
		var err error
		if f.tables, err = d.Alloc(fusedTablesB); err != nil {
			f.tables = nil
			return err
		}
	}
	if cap(f.host) < fusedTablesB {
		f.host = make([]byte, fusedTablesB)
	}
	h := f.host[:fusedTablesB]
	put64 := func(at int, v driver.DevicePtr) {
		for i := range 8 {
			h[at+i] = byte(uint64(v) >> (8 * i))
		}
	}
	for i, p := range ptrs {
		put64(fusedPtrsOff+8*i, p)
	}
	for i, p := range toks {
		put64(fusedToksOff+8*i, p)
	}
	for i, p := range scales {
		put64(fusedScalesOff+8*i, p)
	}
	for i, p := range done {
		put64(fusedDoneOff+8*i, p)
	}
	if o := groups.Offsets; o != nil {
		if err := d.StageToDevice(f.tables, 0, h[:fusedOffsOff]); err != nil {
			return err
		}
		ot := tensorOf("fused MoE op", "offsets", o)
		if ot.st.buf == nil {
			return errors.New("cuda: fused MoE op: the group offsets have no device memory")
		}
		return d.CopyDevice(f.tables, fusedOffsOff, ot.st.buf, 4*int64(ot.off), 4*int64(o.Len()))
	}
	rows := 0
	put32 := func(at int, v int) {
		for i := range 4 {
			h[at+i] = byte(uint32(v) >> (8 * i))
		}
	}
	put32(fusedOffsOff, 0)
	for g, r := range groups.Rows {
		rows += r
		put32(fusedOffsOff+4*(g+1), rows)
	}
	// The offsets end the used part; a partial upload keeps it small.
	return d.StageToDevice(f.tables, 0, h[:fusedOffsOff+4*(len(groups.Rows)+1)])
}

// armFault returns the fault record's address for a launch whose waits
// are bounded by timeout (flag waits when combine is set, else tile
// waits), allocating (zeroed) the record on first use.
func (f *fusedTables) armFault(d *Device, timeout time.Duration, combine bool) (driver.DevicePtr, error) {
	if f.fault == nil {
		b, err := d.Alloc(16)
		if err != nil {
			return 0, err
		}
		if err := d.Memset32(b, 0, 4, 0); err != nil {
			return 0, errors.Join(err, d.Free(b))
		}
		f.fault = b
	}
	f.armed = true
	if combine {
		f.combineWait = timeout
	} else {
		f.timeout = timeout
	}
	return f.fault.Ptr(), nil
}

// checkFault reads the fault record once the stream is idle (after a
// Sync) and, when a tile wait timed out, returns the error naming the
// tile and the rank whose rows did not arrive, and re-arms the record.
func (f *fusedTables) checkFault(d *Device) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.armed {
		return nil
	}
	f.armed = false
	var rec [16]byte
	if err := d.CopyFromDevice(rec[:], f.fault, 0); err != nil {
		return err
	}
	w := func(i int) int32 { return int32(binary.LittleEndian.Uint32(rec[4*i:])) }
	if w(0) == 0 {
		return nil
	}
	if err := d.Memset32(f.fault, 0, 4, 0); err != nil {
		return err
	}
	if w(0) == 5 {
		return fmt.Errorf("cuda: combine_rows_f32: send row %d never arrived from rank %d within %v (its flag was %d); the results of this step are wrong",
			w(1), w(2), f.combineWait, w(3))
	}
	kernel := map[int32]string{1: "moe_dispatch_swiglu", 3: "moe_dispatch_dgrad", 6: "tp_gather (AllGatherMatMul)"}[w(0)]
	return fusedFaultError(kernel, f.timeout, int(w(1)), uint32(w(2)), int(w(3)))
}

// fusedFaultError describes a tile wait that timed out: m-tile tile had
// the chunks of landed (bit c: rows [128*tile + 16c, +16) of the tile's
// expert) and the first missing chunk's rows come from rank.
func fusedFaultError(kernel string, timeout time.Duration, tile int, landed uint32, rank int) error {
	var missing []int
	for c := range ggChunks {
		if landed&(1<<c) == 0 {
			missing = append(missing, c)
		}
	}
	from := fmt.Sprintf("rank %d", rank)
	if rank < 0 {
		from = "no rank (the chunk holds no rows)"
	}
	return fmt.Errorf("cuda: %s: the rows of m-tile %d never all arrived within %v: row chunks %v of %d missing, the first from %s; the results of this step are wrong",
		kernel, tile, timeout, missing, ggChunks, from)
}

// armWaits prepares a launch whose tile waits read n chunk sets and are
// bounded by timeout: the sets zeroed, the fault record armed.
func (f *fusedTables) armWaits(d *Device, n int, timeout time.Duration) (flags, fault driver.DevicePtr, err error) {
	if err := f.zeroFlags(d, n); err != nil {
		return 0, 0, err
	}
	if fault, err = f.armFault(d, timeout, false); err != nil {
		return 0, 0, err
	}
	return f.flags.Ptr(), fault, nil
}

// gatherSourcesOK checks what the communication warps of a gather need of
// each rank's source rows [*, k]: 16-byte vectors of rows, 4-byte token
// indices (and scales, when a has them).
func gatherSourcesOK(srcTD []backend.Tensor, a fusedArgs, k int) bool {
	for i, s := range srcTD {
		if ss := s.Shape(); len(ss) != 2 || ss[1] != k || a.ranks[i]%16 != 0 || a.toks[i]%4 != 0 ||
			(a.scales != nil && a.scales[i]%4 != 0) {
			return false
		}
	}
	return true
}

// combineOutputsOK checks each rank's output rows [*, n] for a combine
// epilogue, which stores column pairs (8 bytes), and, when doneS is not
// nil, sets a.done to the ranks' row flags, one int32 per output row.
func combineOutputsOK(outSD, doneS []backend.Tensor, a *fusedArgs, n int) bool {
	for i, o := range outSD {
		if s := o.Shape(); len(s) != 2 || s[1] != n || a.ranks[i]%8 != 0 {
			return false
		}
	}
	if doneS == nil {
		return true
	}
	if len(doneS) != len(outSD) {
		return false
	}
	for i, t := range doneS {
		if t.Len() != outSD[i].Shape()[0] {
			return false
		}
	}
	var ok bool
	a.done, ok = peerPtrs(doneS, backend.Int32)
	return ok
}

// combineFlags returns the done table's and the block tile counts'
// addresses for a combine kernel over rows rows of groups groups (two
// counts per m-tile, zeroed in stream order), or zeros when the call has
// no flags.
func (f *fusedTables) combineFlags(d *Device, a fusedArgs, rows, groups int) (done, rowTiles driver.DevicePtr, err error) {
	if a.done == nil {
		return 0, 0, nil
	}
	if err := f.zeroFlags(d, 2*(rows/ggBM+groups)); err != nil {
		return 0, 0, err
	}
	return f.tables.Ptr() + fusedDoneOff, f.flags.Ptr(), nil
}

// zeroFlags makes n ready counts, zeroed in stream order.
func (f *fusedTables) zeroFlags(d *Device, n int) error {
	if n > f.flagsN {
		if f.flags != nil {
			if err := d.Free(f.flags); err != nil {
				return err
			}
			f.flags, f.flagsN = nil, 0
		}
		grown := max(n, 2*f.flagsN, 1024)
		b, err := d.Alloc(4 * int64(grown))
		if err != nil {
			return err
		}
		f.flags, f.flagsN = b, grown
	}
	return d.Memset32(f.flags, 0, int64(n), 0)
}

func (f *fusedTables) close(d *Device) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	var err error
	for _, b := range []**Buffer{&f.tables, &f.flags, &f.fault} {
		if *b != nil {
			if e := d.Free(*b); e != nil && err == nil {
				err = e
			}
			*b = nil
		}
	}
	f.flagsN, f.armed = 0, false
	return err
}

// peerPtrs returns the device addresses of a rank list's tensors, checking
// each is a CUDA tensor of dtype dt; ok is false when one is not.
func peerPtrs(ts []backend.Tensor, dt backend.DType) ([]driver.DevicePtr, bool) {
	ps := make([]driver.DevicePtr, len(ts))
	for i, t := range ts {
		ct, ok := t.(*Tensor)
		if !ok || ct.dt != dt {
			return nil, false
		}
		if ps[i], ok = ct.ptr(); !ok {
			return nil, false
		}
	}
	return ps, true
}

// DispatchSwiGLU runs moe_dispatch_swiglu when the call is one it takes
// (bf16 rows and weights, float32 sources, Hopper), else the unfused
// sequence.
func (b *Backend) DispatchSwiGLU(xRD, h1RF, h3RF, actRF backend.Tensor, srcTD, tokS []backend.Tensor, refsR2, w1GFD, w3GFD backend.Tensor, groups backend.Groups) {
	if !b.dispatchSwiGLUKernel(xRD, h1RF, h3RF, actRF, srcTD, tokS, refsR2, w1GFD, w3GFD, groups) {
		backend.DispatchSwiGLUBySteps(b, xRD, h1RF, h3RF, actRF, srcTD, tokS, refsR2, w1GFD, w3GFD, groups)
	}
}

// fusedArgs are a fused call's device addresses: its bf16 operands, one
// tensor (and for a gather one token list) per rank, and the references.
type fusedArgs struct {
	ops, ranks, toks, scales []driver.DevicePtr
	done                     []driver.DevicePtr // a combine's per-rank row flags; nil: none
	refs                     driver.DevicePtr
}

// fusedPtrs checks the dtypes of a fused call's tensors and returns their
// addresses; ok is false when the kernel does not take them (toks nil: a
// call with no token lists).
func fusedPtrs(ops, ranks []backend.Tensor, rankDT backend.DType, toks []backend.Tensor, refsR2 backend.Tensor, groups int) (a fusedArgs, ok bool) {
	if len(ranks) == 0 || len(ranks) > fusedMaxRanks || groups == 0 || groups > ggMaxExperts ||
		(toks != nil && len(toks) != len(ranks)) {
		return a, false
	}
	if a.ops, ok = peerPtrs(ops, backend.BFloat16); !ok {
		return a, false
	}
	if a.ranks, ok = peerPtrs(ranks, rankDT); !ok {
		return a, false
	}
	if toks != nil {
		if a.toks, ok = peerPtrs(toks, backend.Int32); !ok {
			return a, false
		}
	}
	refs, ok := peerPtrs([]backend.Tensor{refsR2}, backend.Int32)
	if !ok {
		return a, false
	}
	a.refs = refs[0]
	return a, true
}

// runFused stages a's pointer tables and the group offsets and, unless
// the groups hold no rows, runs launch with the tables and the rows the
// groups hold (rows, the op's, when they are device offsets). It reports
// whether the kernel took the call: false only when the groups do not fit
// rows (the unfused sequence then reports the error); launch and staging
// errors go to b.fail.
func (b *Backend) runFused(a fusedArgs, groups backend.Groups, rows int, launch func(f *fusedTables, sum int) error) bool {
	if backend.CheckGroups(groups, rows) != nil {
		return false
	}
	sum := groups.Held(rows)
	f := &b.fused
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.stage(b.dev, a.ranks, a.toks, a.scales, a.done, groups); err != nil {
		b.fail(err)
		return true
	}
	if sum > 0 {
		b.fail(launch(f, sum))
	}
	runtime.KeepAlive(groups.Offsets)
	return true
}

func (b *Backend) dispatchSwiGLUKernel(xRD, h1RF, h3RF, actRF backend.Tensor, srcTD, tokS []backend.Tensor, refsR2, w1GFD, w3GFD backend.Tensor, groups backend.Groups) bool {
	g := groups.Len()
	bf := []backend.Tensor{xRD, h1RF, h3RF, actRF, w1GFD, w3GFD}
	// Sources of the float type or, half the bytes to gather, the operand
	// type (moe_dispatch_swiglu_bf16).
	srcDT := backend.Float32
	if len(srcTD) > 0 {
		srcDT = srcTD[0].DType() // fusedPtrs takes no other
	}
	srcBF16 := srcDT == backend.BFloat16
	a, ok := fusedPtrs(bf, srcTD, srcDT, tokS, refsR2, g)
	if !ok {
		return false
	}
	xs, hs, ws := xRD.Shape(), h1RF.Shape(), w1GFD.Shape()
	if len(xs) != 2 || len(hs) != 2 || len(ws) != 2 {
		return false
	}
	rows, k, n := xs[0], xs[1], hs[1]
	if hs[0] != rows || ws[0] != g*n || ws[1] != k || !sameShape(h1RF, h3RF, actRF) || !sameShape(w1GFD, w3GFD) ||
		refsR2.Len() != 2*rows {
		return false
	}
	if !gatherSourcesOK(srcTD, a, k) {
		return false
	}
	x, ok := b.expertKernels()
	ps := a.ops
	if !ok || checkGroupedGemm(ps[1], ps[0], ps[4], 16, rows, n, k, g, 256) != nil {
		return false
	}
	taken := b.runFused(a, groups, rows, func(f *fusedTables, sum int) error {
		gg := x.bf16Out
		flags, fault, err := f.armWaits(b.dev, sum/ggBM+g, gg.waitTimeout())
		if err != nil {
			return err
		}
		tp := f.tables.Ptr()
		return gg.runDispatchSwiGLU(fusedDispatch{
			x: ps[0], h1: ps[1], h3: ps[2], act: ps[3], w1: ps[4], w3: ps[5], refs: a.refs,
			ptrs: tp + fusedPtrsOff, toks: tp + fusedToksOff, offsets: tp + fusedOffsOff, flags: flags,
			fault: fault, rows: sum, n: n, k: k, experts: g, srcBF16: srcBF16,
		})
	})
	runtime.KeepAlive(bf)
	runtime.KeepAlive(srcTD)
	runtime.KeepAlive(tokS)
	runtime.KeepAlive(refsR2)
	return taken
}

// DownCombine runs moe_down_combine when the call is one it takes (bf16
// act and weights, float32 or bf16 outputs, Hopper), else the unfused
// sequence through a scratch of the outputs' type.
func (b *Backend) DownCombine(outSD, doneS []backend.Tensor, refsR2, actRF, w2GDF backend.Tensor, groups backend.Groups) {
	const op = "DownCombine"
	if b.downCombineKernel(outSD, doneS, refsR2, actRF, w2GDF, groups) {
		return
	}
	if len(outSD) == 0 {
		fail(op, "no output tensors")
	}
	_, r, _ := operandMatrix(op, "act", actRF)
	out, _, d := operandMatrix(op, "out", outSD[0])
	backend.DownCombineBySteps(b, b.New(out.dt, r, d), outSD, doneS, refsR2, actRF, w2GDF, groups)
}

func (b *Backend) downCombineKernel(outSD, doneS []backend.Tensor, refsR2, actRF, w2GDF backend.Tensor, groups backend.Groups) bool {
	g := groups.Len()
	if len(outSD) == 0 || outSD[0] == nil {
		return false // the unfused sequence reports it
	}
	outDT := outSD[0].DType() // every rank's must be it (fusedPtrs)
	if outDT != backend.Float32 && outDT != backend.BFloat16 {
		return false
	}
	a, ok := fusedPtrs([]backend.Tensor{actRF, w2GDF}, outSD, outDT, nil, refsR2, g)
	if !ok {
		return false
	}
	as, ws, os := actRF.Shape(), w2GDF.Shape(), outSD[0].Shape()
	if len(as) != 2 || len(ws) != 2 || len(os) != 2 {
		return false
	}
	rows, k, n := as[0], as[1], os[1]
	if ws[0] != g*n || ws[1] != k || refsR2.Len() != 2*rows {
		return false
	}
	if !combineOutputsOK(outSD, doneS, &a, n) {
		return false
	}
	x, ok := b.expertKernels()
	ps := a.ops
	// The output check uses act's address: the rows go to the peers'.
	if !ok || checkGroupedGemm(ps[0], ps[0], ps[1], 16, rows, n, k, g, 256) != nil {
		return false
	}
	taken := b.runFused(a, groups, rows, func(f *fusedTables, sum int) error {
		done, rowTiles, err := f.combineFlags(b.dev, a, sum, g)
		if err != nil {
			return err
		}
		tp := f.tables.Ptr()
		return x.bf16Out.runDownCombine(fusedCombine{
			act: ps[0], w2: ps[1], refs: a.refs, ptrs: tp + fusedPtrsOff, done: done, rowTiles: rowTiles,
			offsets: tp + fusedOffsOff, rows: sum, n: n, k: k, experts: g, rowsBF16: outDT == backend.BFloat16,
		})
	})
	runtime.KeepAlive(actRF)
	runtime.KeepAlive(w2GDF)
	runtime.KeepAlive(outSD)
	runtime.KeepAlive(doneS)
	runtime.KeepAlive(refsR2)
	return taken
}

// sameShape reports whether the tensors all have the first one's shape.
func sameShape(ts ...backend.Tensor) bool {
	for _, t := range ts[1:] {
		a, c := ts[0].Shape(), t.Shape()
		if len(a) != len(c) {
			return false
		}
		for i := range a {
			if a[i] != c[i] {
				return false
			}
		}
	}
	return true
}

// fusedDispatch is one moe_dispatch_swiglu call: device addresses and
// sizes (n = F, k = D).
type fusedDispatch struct {
	x, h1, h3, act, w1, w3, refs, ptrs, toks, offsets, flags, fault driver.DevicePtr
	rows, n, k, experts                                             int
	srcBF16                                                         bool // the sources are bf16 rows (moe_dispatch_swiglu_bf16)
}

// fusedCombine is one moe_down_combine call (n = D, k = F).
type fusedCombine struct {
	act, w2, refs, ptrs, done, rowTiles, offsets driver.DevicePtr
	rows, n, k, experts                          int
	rowsBF16                                     bool // moe_down_combine_bf16: bf16 output rows
}

// moeKernels are the fused kernels of one build of moe_fused.cu, opted in
// to the shared memory of ggMaxExperts: the training build
// (GroupedGemm.moe), or a build of the tests' own swapped in for a test.
type moeKernels struct {
	// dispatchSwiGLU and downCombine, bn256 cooperative like bn256;
	// dispatchSwiGLUBF16 is dispatchSwiGLU for bf16 sources,
	// downCombineBF16 downCombine into bf16 rows.
	dispatchSwiGLU, dispatchSwiGLUBF16, downCombine, downCombineBF16 *Kernel
	// dispatchDgrad and dgradCombine are their backward twins, which read
	// the weights as stored (MN-major); dispatchDgradFirst is
	// dispatchDgrad's build that gathers first, chosen per shape by
	// GroupedGemm.dgrad (dgrad_choice.go).
	dispatchDgrad, dispatchDgradFirst, dgradCombine *Kernel
	// tpGatherNT/NN and tpScatterNT/NN are tensor parallelism's
	// AllGather+GEMM and GEMM+ReduceScatter (tp_fused.go), for weights
	// read transposed (NT) or as stored (NN), launched on clusters of two
	// blocks: tpClusters is the most such clusters the GPU holds at once
	// (0 when the driver cannot launch clusters, which leaves tensor
	// parallelism its unfused path).
	tpGatherNT, tpGatherNN, tpScatterNT, tpScatterNN *Kernel
	tpClusters                                       int
	// optInGather and optInCombine are the dynamic shared memory the
	// gathering kernels (fusedGatherSmem) and the combines
	// (fusedCombineSmem) opted in to; optInTP the tensor-parallel
	// kernels' (tpSmem).
	optInGather, optInCombine, optInTP int
}

// loadMoEKernels resolves m's fused kernels (m is a build of
// moe_fused.cu) and opts them in to their shared memory.
func (g *GroupedGemm) loadMoEKernels(m *Module) (moeKernels, error) {
	x := moeKernels{optInGather: fusedGatherSmem(ggMaxExperts), optInCombine: fusedCombineSmem(ggMaxExperts),
		optInTP: tpSmem()}
	for _, f := range []struct {
		name  string
		k     **Kernel
		optIn int
	}{
		{"moe_dispatch_swiglu", &x.dispatchSwiGLU, x.optInGather},
		{"moe_dispatch_swiglu_bf16", &x.dispatchSwiGLUBF16, x.optInGather},
		{"moe_down_combine", &x.downCombine, x.optInCombine},
		{"moe_down_combine_bf16", &x.downCombineBF16, x.optInCombine},
		{"moe_dispatch_dgrad", &x.dispatchDgrad, x.optInGather},
		{"moe_dispatch_dgrad_first", &x.dispatchDgradFirst, x.optInGather},
		{"moe_dgrad_combine", &x.dgradCombine, x.optInCombine},
		{"tp_gather_nt", &x.tpGatherNT, x.optInTP},
		{"tp_gather_nn", &x.tpGatherNN, x.optInTP},
		{"tp_scatter_nt", &x.tpScatterNT, x.optInTP},
		{"tp_scatter_nn", &x.tpScatterNN, x.optInTP},
	} {
		var err error
		if *f.k, err = g.optIn(m, f.name, f.optIn); err != nil {
			return moeKernels{}, err
		}
	}
	// A driver without cluster launches (before CUDA 12.0) answers with an
	// error: tpClusters stays 0 and tensor parallelism keeps its unfused
	// path.
	if err := g.d.Do(func() error {
		n, err := g.d.drv.MaxActiveClusters(x.tpGatherNT.fn, driver.Dim3{X: 2 * g.d.info.SMs, Y: 1, Z: 1},
			driver.Dim3{X: ggThreads, Y: 1, Z: 1}, driver.Dim3{X: 2, Y: 1, Z: 1}, x.optInTP)
		x.tpClusters = n
		return err
	}); err != nil {
		x.tpClusters = 0
	}
	return x, nil
}

// fusedGatherSmem is the dynamic shared memory of the two gathering
// kernels, moe_dispatch_swiglu and moe_dispatch_dgrad (one layout), for e
// experts: as ggSmemBytes for 3 stages of the BN 256 tile plus two 16 KiB
// staging buffers per consumer warpgroup (its TMA-store epilogue) and
// four more barriers (GG_DISPATCH_SWIGLU: staged and freed per
// warpgroup; GG_DISPATCH_DGRAD: one per staging slot); the expert tables
// hold one more word (the gather's pacing front).
func fusedGatherSmem(e int) int {
	const stages = 3
	return 1024 + stages*(ggBM*ggBK*2+256*ggBK*2) + 4*16384 + 16*stages + 4*8 + 4*(3*e+2)
}

// fusedCombineSmem is the dynamic shared memory of the two combining
// kernels, moe_down_combine and moe_dgrad_combine, for e experts: bn256's
// layout (4 stages of the BN 256 tile, the register epilogue).
func fusedCombineSmem(e int) int { return ggSmemBytes(ggNT256, e) }

// boxesMap is the {n, rows} bf16 map of a [rows, n] operand that an
// epilogue moves through shared memory: 64x64 boxes, 128-byte swizzle.
func boxesMap(addr driver.DevicePtr, rows, n int) driver.TiledMap {
	return driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: addr,
		Dims: []uint64{uint64(n), uint64(rows)}, Strides: []uint64{2 * uint64(n)},
		Box: []uint32{64, 64}, Swizzle: driver.Swizzle128B, L2: driver.L2PromotionNone,
	}
}

// runDispatchSwiGLU queues moe_dispatch_swiglu. Its grid must be resident
// at once (TMA threads wait on other blocks' gathering warps): one
// block per SM at most, which its shared memory enforces.
func (g *GroupedGemm) runDispatchSwiGLU(a fusedDispatch) error {
	mapX := rowsMap(a.x, a.rows, a.k)
	wMap := func(addr driver.DevicePtr) driver.TiledMap { return expertsMap(addr, a.experts, a.n, a.k, 128) }
	maps := []driver.TiledMap{mapX, wMap(a.w1), wMap(a.w3), boxesMap(a.h1, a.rows, a.n), boxesMap(a.h3, a.rows, a.n),
		boxesMap(a.act, a.rows, a.n)}
	slots := []uint64{uint64(a.h1), uint64(a.h3), uint64(a.act), uint64(a.x), uint64(a.refs), uint64(a.ptrs),
		uint64(a.toks), uint64(a.flags), uint64(a.fault), uint64(g.waitTimeout().Nanoseconds()), uint64(a.offsets),
		uint64(uint32(a.rows)), uint64(uint32(a.n)), uint64(uint32(a.k)), uint64(uint32(a.experts))}
	grid := Grid1D(ggGrid(g.d.info.SMs, a.rows, a.n, a.experts, 128), ggThreads)
	grid.Shared = fusedGatherSmem(a.experts)
	k := g.moe.dispatchSwiGLU
	if a.srcBF16 {
		k = g.moe.dispatchSwiGLUBF16
	}
	return g.launchFused(k, grid, maps, slots, g.moe.optInGather)
}

// runDownCombine queues moe_down_combine.
func (g *GroupedGemm) runDownCombine(a fusedCombine) error {
	mapA, mapW := rowsMap(a.act, a.rows, a.k), expertsMap(a.w2, a.experts, a.n, a.k, 256)
	slots := []uint64{uint64(a.refs), uint64(a.ptrs), uint64(a.done), uint64(a.rowTiles), uint64(a.offsets),
		uint64(uint32(a.rows)), uint64(uint32(a.n)), uint64(uint32(a.k)), uint64(uint32(a.experts))}
	grid := Grid1D(ggGrid(g.d.info.SMs, a.rows, a.n, a.experts, 256), ggThreads)
	grid.Shared = fusedCombineSmem(a.experts)
	k := g.moe.downCombine
	if a.rowsBF16 {
		k = g.moe.downCombineBF16
	}
	return g.launchFused(k, grid, []driver.TiledMap{mapA, mapW}, slots, g.moe.optInCombine)
}

// launchFused encodes maps (passed first, by value) and launches k with
// the 64-bit slots after them (each slot holds one argument, pointer or
// 32-bit integer, little-endian).
func (g *GroupedGemm) launchFused(k *Kernel, grid Grid, maps []driver.TiledMap, slots []uint64, optIn int) error {
	return g.launchFusedChosen(k, grid, maps, slots, optIn, func(launch func(*Kernel) error) error { return launch(k) })
}

// launchFusedChosen is launchFused where choose, on the device thread,
// picks the kernel (k or one with the same arguments and shared memory)
// and calls launch with it; k names the call in errors.
func (g *GroupedGemm) launchFusedChosen(k *Kernel, grid Grid, maps []driver.TiledMap, slots []uint64, optIn int,
	choose func(launch func(*Kernel) error) error) error {
	for i, m := range maps {
		if err := m.Check(); err != nil {
			return fmt.Errorf("cuda: %s: tensor map %d: %w", k.Desc.Name, i, err)
		}
	}
	if grid.Shared > optIn {
		return fmt.Errorf("cuda: %s: needs %d bytes of shared memory, opted in to %d", k.Desc.Name, grid.Shared, optIn)
	}
	d := g.d
	return d.Submit(func() error {
		var pin runtime.Pinner
		defer pin.Unpin()
		params, err := mappedParams(g.enc, maps, slots, &pin, func(i int) string {
			return fmt.Sprintf("cuda: %s: tensor map %d", k.Desc.Name, i)
		})
		if err != nil {
			return err
		}
		return choose(func(k *Kernel) error { return d.launchParams(k, grid, params) })
	})
}

// DispatchDgradSwiGLU runs moe_dispatch_dgrad when the call is one it
// takes (bf16 rows and weights, float32 sources and scales, Hopper), else
// the unfused sequence.
func (b *Backend) DispatchDgradSwiGLU(dyRD, dh1RF, dh3RF backend.Tensor, srcTD, tokS, scaleS []backend.Tensor, refsR2, h1RF, h3RF, w2GDF backend.Tensor, groups backend.Groups) {
	const op = "DispatchDgradSwiGLU"
	if b.dispatchDgradKernel(dyRD, dh1RF, dh3RF, srcTD, tokS, scaleS, refsR2, h1RF, h3RF, w2GDF, groups) {
		return
	}
	_, r, f := operandMatrix(op, "dh1", dh1RF)
	backend.DispatchDgradSwiGLUBySteps(b, b.New(b.FloatType(), r, f), dyRD, dh1RF, dh3RF, srcTD, tokS, scaleS, refsR2, h1RF, h3RF, w2GDF, groups)
}

func (b *Backend) dispatchDgradKernel(dyRD, dh1RF, dh3RF backend.Tensor, srcTD, tokS, scaleS []backend.Tensor, refsR2, h1RF, h3RF, w2GDF backend.Tensor, groups backend.Groups) bool {
	g := groups.Len()
	bf := []backend.Tensor{dyRD, dh1RF, dh3RF, h1RF, h3RF, w2GDF}
	if scaleS == nil || len(scaleS) != len(srcTD) {
		return false
	}
	a, ok := fusedPtrs(bf, srcTD, backend.Float32, tokS, refsR2, g)
	if !ok {
		return false
	}
	if a.scales, ok = peerPtrs(scaleS, backend.Float32); !ok {
		return false
	}
	ys, hs, ws := dyRD.Shape(), dh1RF.Shape(), w2GDF.Shape()
	if len(ys) != 2 || len(hs) != 2 || len(ws) != 2 {
		return false
	}
	rows, d, f := ys[0], ys[1], hs[1]
	if hs[0] != rows || ws[0] != g*d || ws[1] != f || !sameShape(dh1RF, dh3RF, h1RF, h3RF) || refsR2.Len() != 2*rows {
		return false
	}
	if !gatherSourcesOK(srcTD, a, d) {
		return false
	}
	for i := range scaleS {
		if scaleS[i].Len() != tokS[i].Len() {
			return false
		}
	}
	x, ok := b.expertKernels()
	ps := a.ops
	if !ok || checkGroupedGemm(ps[1], ps[0], ps[5], 16, rows, f, d, g, 256) != nil {
		return false
	}
	taken := b.runFused(a, groups, rows, func(tb *fusedTables, sum int) error {
		gg := x.bf16Out
		flags, fault, err := tb.armWaits(b.dev, sum/ggBM+g, gg.waitTimeout())
		if err != nil {
			return err
		}
		tp := tb.tables.Ptr()
		return gg.runDispatchDgrad(fusedDgrad{
			dy: ps[0], dh1: ps[1], dh3: ps[2], h1: ps[3], h3: ps[4], w2: ps[5], refs: a.refs,
			ptrs: tp + fusedPtrsOff, toks: tp + fusedToksOff, scales: tp + fusedScalesOff, offsets: tp + fusedOffsOff,
			flags: flags, fault: fault, rows: sum, n: f, k: d, experts: g,
		})
	})
	runtime.KeepAlive(bf)
	runtime.KeepAlive(srcTD)
	runtime.KeepAlive(tokS)
	runtime.KeepAlive(scaleS)
	runtime.KeepAlive(refsR2)
	return taken
}

// DgradCombine runs moe_dgrad_combine when the call is one it takes (bf16
// gradients and weights, float32 outputs, Hopper), else the unfused
// sequence.
func (b *Backend) DgradCombine(outSD, doneS []backend.Tensor, refsR2, dh1RF, dh3RF, w1GFD, w3GFD backend.Tensor, groups backend.Groups) {
	const op = "DgradCombine"
	if b.dgradCombineKernel(outSD, doneS, refsR2, dh1RF, dh3RF, w1GFD, w3GFD, groups) {
		return
	}
	if len(outSD) == 0 {
		fail(op, "no output tensors")
	}
	_, r, _ := operandMatrix(op, "dh1", dh1RF)
	_, _, d := operandMatrix(op, "out", outSD[0])
	backend.DgradCombineBySteps(b, b.New(b.FloatType(), r, d), outSD, doneS, refsR2, dh1RF, dh3RF, w1GFD, w3GFD, groups)
}

func (b *Backend) dgradCombineKernel(outSD, doneS []backend.Tensor, refsR2, dh1RF, dh3RF, w1GFD, w3GFD backend.Tensor, groups backend.Groups) bool {
	g := groups.Len()
	bf := []backend.Tensor{dh1RF, dh3RF, w1GFD, w3GFD}
	a, ok := fusedPtrs(bf, outSD, backend.Float32, nil, refsR2, g)
	if !ok {
		return false
	}
	hs, ws, os := dh1RF.Shape(), w1GFD.Shape(), outSD[0].Shape()
	if len(hs) != 2 || len(ws) != 2 || len(os) != 2 {
		return false
	}
	rows, f, d := hs[0], hs[1], os[1]
	if ws[0] != g*f || ws[1] != d || !sameShape(dh1RF, dh3RF) || !sameShape(w1GFD, w3GFD) || refsR2.Len() != 2*rows {
		return false
	}
	if !combineOutputsOK(outSD, doneS, &a, d) {
		return false
	}
	x, ok := b.expertKernels()
	ps := a.ops
	if !ok || checkGroupedGemm(ps[0], ps[0], ps[2], 16, rows, d, f, g, 256) != nil {
		return false
	}
	taken := b.runFused(a, groups, rows, func(tb *fusedTables, sum int) error {
		gg := x.bf16Out
		done, rowTiles, err := tb.combineFlags(b.dev, a, sum, g)
		if err != nil {
			return err
		}
		tp := tb.tables.Ptr()
		return gg.runDgradCombine(fusedDgradCombine{
			dh1: ps[0], dh3: ps[1], w1: ps[2], w3: ps[3], refs: a.refs, ptrs: tp + fusedPtrsOff,
			done: done, rowTiles: rowTiles, offsets: tp + fusedOffsOff, rows: sum, n: d, k: f, experts: g,
		})
	})
	runtime.KeepAlive(bf)
	runtime.KeepAlive(outSD)
	runtime.KeepAlive(doneS)
	runtime.KeepAlive(refsR2)
	return taken
}

// fusedDgrad is one moe_dispatch_dgrad call (n = F, k = D); w2 is W2 as
// stored, [E, D, F], which the kernel reads MN-major.
type fusedDgrad struct {
	dy, dh1, dh3, h1, h3, w2, refs, ptrs, toks, scales, offsets, flags, fault driver.DevicePtr
	rows, n, k, experts                                                       int
}

// fusedDgradCombine is one moe_dgrad_combine call (n = D, k = F); w1 and
// w3 are W1 and W3 as stored, [E, F, D], read MN-major.
type fusedDgradCombine struct {
	dh1, dh3, w1, w3, refs, ptrs, done, rowTiles, offsets driver.DevicePtr
	rows, n, k, experts                                   int
}

// waitTimeout is the fused kernels' bound on one tile wait.
func (g *GroupedGemm) waitTimeout() time.Duration {
	if g.fusedTimeout > 0 {
		return g.fusedTimeout
	}
	return fusedTimeout
}

// rowsMap is the {k, rows} bf16 map of a [rows, k] operand, 64x128 boxes.
func rowsMap(addr driver.DevicePtr, rows, k int) driver.TiledMap {
	return driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: addr,
		Dims: []uint64{uint64(k), uint64(rows)}, Strides: []uint64{2 * uint64(k)},
		Box: []uint32{ggBK, ggBM}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
}

// expertsMap is the {k, n, experts} bf16 map of stacked [n, k] matrices,
// boxes of 64 x boxRows x 1.
func expertsMap(addr driver.DevicePtr, experts, n, k int, boxRows uint32) driver.TiledMap {
	return driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: addr,
		Dims:    []uint64{uint64(k), uint64(n), uint64(experts)},
		Strides: []uint64{2 * uint64(k), 2 * uint64(k) * uint64(n)},
		Box:     []uint32{ggBK, boxRows, 1}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
}

// expertsMNMap is the {n, k, experts} bf16 map of weights stored [experts,
// k, n] (n contiguous) that a product reads as its MN-major B [n, k]:
// boxes of 64 columns x 64 rows of k, the 128-byte swizzle.
func expertsMNMap(addr driver.DevicePtr, experts, n, k int) driver.TiledMap {
	return driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: addr,
		Dims:    []uint64{uint64(n), uint64(k), uint64(experts)},
		Strides: []uint64{2 * uint64(n), 2 * uint64(n) * uint64(k)},
		Box:     []uint32{64, ggBK, 1}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
}

// runDispatchDgrad queues moe_dispatch_dgrad or moe_dispatch_dgrad_first,
// as g.dgrad chooses for the shape. Its grid must be resident at once, as
// runDispatchSwiGLU's: one block per SM, which its shared memory enforces.
func (g *GroupedGemm) runDispatchDgrad(a fusedDgrad) error {
	maps := []driver.TiledMap{rowsMap(a.dy, a.rows, a.k), expertsMNMap(a.w2, a.experts, a.n, a.k),
		boxesMap(a.dh1, a.rows, a.n), boxesMap(a.dh3, a.rows, a.n), boxesMap(a.h1, a.rows, a.n),
		boxesMap(a.h3, a.rows, a.n)}
	slots := []uint64{uint64(a.dh1), uint64(a.dh3), uint64(a.h1), uint64(a.h3), uint64(a.dy), uint64(a.refs),
		uint64(a.ptrs), uint64(a.toks), uint64(a.scales), uint64(a.flags), uint64(a.fault),
		uint64(g.waitTimeout().Nanoseconds()), uint64(a.offsets), uint64(uint32(a.rows)), uint64(uint32(a.n)),
		uint64(uint32(a.k)), uint64(uint32(a.experts))}
	grid := Grid1D(ggGrid(g.d.info.SMs, a.rows, a.n, a.experts, 256), ggThreads)
	grid.Shared = fusedGatherSmem(a.experts)
	builds := [2]*Kernel{dgradBeside: g.moe.dispatchDgrad, dgradFirst: g.moe.dispatchDgradFirst}
	shape := newDgradShape(a.rows, a.n, a.k, a.experts)
	return g.launchFusedChosen(builds[dgradBeside], grid, maps, slots, g.moe.optInGather, func(launch func(*Kernel) error) error {
		return g.dgrad.launch(g.d.drv, g.d.stream, shape, func(build int) error { return launch(builds[build]) })
	})
}

// runDgradCombine queues moe_dgrad_combine.
func (g *GroupedGemm) runDgradCombine(a fusedDgradCombine) error {
	maps := []driver.TiledMap{rowsMap(a.dh1, a.rows, a.k), rowsMap(a.dh3, a.rows, a.k),
		expertsMNMap(a.w1, a.experts, a.n, a.k), expertsMNMap(a.w3, a.experts, a.n, a.k)}
	slots := []uint64{uint64(a.refs), uint64(a.ptrs), uint64(a.done), uint64(a.rowTiles), uint64(a.offsets),
		uint64(uint32(a.rows)), uint64(uint32(a.n)), uint64(uint32(a.k)), uint64(uint32(a.experts))}
	grid := Grid1D(ggGrid(g.d.info.SMs, a.rows, a.n, a.experts, 256), ggThreads)
	grid.Shared = fusedCombineSmem(a.experts)
	return g.launchFused(g.moe.dgradCombine, grid, maps, slots, g.moe.optInCombine)
}
