package cuda

// The peer-row ops (backend.Backend's GatherPeerRows and ScatterPeerRows):
// the MoE dispatch and combine of ranks that reach each other's tensors
// directly, on kernels/peer_rows.cu. With virtual ranks every rank's
// tensors are tensors of this Backend, so plain device addresses.
//
// The ranks' tensors are separate allocations, so each call uploads a table
// of their addresses and row counts (a few 64-bit words per rank) through
// the staging slots, into a scratch buffer from the caching allocator that
// is freed, stream-ordered, right after the launch: no wait for the GPU, no
// state kept between calls. The counts let the kernels check the
// references on the GPU, where the host cannot read them: a gather row with
// a bad reference comes out NaN, a scatter row with one is skipped (the CPU
// backend panics on both, and is the place to debug them).

import (
	"cmp"
	"fmt"
	"runtime"

	"github.com/mktrain/mktrain/backend"
)

// The table's words per rank; PR_GATHER_WORDS and PR_SCATTER_WORDS in
// kernels/peer_rows.cu.
const (
	peerGatherWords  = 5 // source address, tokens, scales (0: none), send count, source rows
	peerScatterWords = 2 // out address, its rows
)

// peerSources are GatherPeerRows' per-rank arguments, checked.
type peerSources struct {
	src, tok, scale []*Tensor // scale[s] nil without scales
}

// checkPeerSources checks the per-rank lists of a gather of rows d wide
// (sources of one dtype, float32 or bfloat16):
// one source [T_s, d], one int32 token list and (when scaleS is not nil)
// one scale per token for each rank.
func checkPeerSources(op string, srcTD, tokS, scaleS []backend.Tensor, d int) peerSources {
	if len(tokS) != len(srcTD) || (scaleS != nil && len(scaleS) != len(srcTD)) {
		fail(op, "%d sources, %d token lists and %d scale lists; want one of each per rank", len(srcTD), len(tokS), len(scaleS))
	}
	ps := peerSources{src: make([]*Tensor, len(srcTD)), tok: make([]*Tensor, len(srcTD)), scale: make([]*Tensor, len(srcTD))}
	for s := range srcTD {
		name := fmt.Sprintf("source %d", s)
		src, rows, _ := operandMatrix(op, name, srcTD[s])
		wantOperandMatrix(op, name, srcTD[s], rows, d)
		if s > 0 && src.dt != ps.src[0].dt {
			fail(op, "%s is %v and source 0 %v; the sources must be of one dtype", name, src.dt, ps.src[0].dt)
		}
		if tokS[s] == nil {
			fail(op, "token list of rank %d is nil", s)
		}
		n := tokS[s].Len()
		ps.src[s], ps.tok[s] = src, indices(op, fmt.Sprintf("tokens %d", s), tokS[s], n)
		if scaleS != nil {
			ps.scale[s] = vector(op, fmt.Sprintf("scale %d", s), scaleS[s], n)
		}
		fitsInt32(op, rows, n)
	}
	return ps
}

// table is the gather kernels' rank table; ok is false when a tensor's
// allocation failed (the error waits for Sync).
func (ps peerSources) table() (table []uint64, ok bool) {
	table = make([]uint64, 0, peerGatherWords*len(ps.src))
	for s := range ps.src {
		ptrs, ok := devicePtrs(ps.src[s], ps.tok[s], ps.scale[s])
		if !ok {
			return nil, false
		}
		table = append(table, uint64(ptrs[0]), uint64(ptrs[1]), uint64(ptrs[2]), uint64(ps.tok[s].Len()), uint64(ps.src[s].shape[0]))
	}
	return table, true
}

// checkPeerOuts checks the per-rank outputs of a scatter of rows d wide:
// one float tensor [P_s, d] per rank.
func checkPeerOuts(op string, outSD []backend.Tensor, d int, dt backend.DType) []*Tensor {
	outs := make([]*Tensor, len(outSD))
	for s := range outSD {
		name := fmt.Sprintf("out %d", s)
		out, rows, _ := operandMatrix(op, name, outSD[s])
		wantOperandMatrix(op, name, outSD[s], rows, d)
		if out.dt != dt {
			fail(op, "%s is %v, want %v", name, out.dt, dt)
		}
		fitsInt32(op, rows)
		outs[s] = out
	}
	return outs
}

// checkPeerRefs checks refsR2: an int32 [rows, 2] tensor (rows being those
// of the expert-side tensor called side) over ranks ranks. Its values are
// checked by the kernels.
func checkPeerRefs(op, side string, refsR2 backend.Tensor, rows, ranks int) *Tensor {
	if refsR2 == nil {
		fail(op, "refs is nil")
	}
	refs := tensorOf(op, "refs", refsR2)
	if refs.dt != backend.Int32 || len(refs.shape) != 2 || refs.shape[1] != 2 {
		fail(op, "refs is %v %v, want int32 [R 2]", refs.dt, refs.shape)
	}
	if refs.shape[0] != rows {
		fail(op, "refs has %d rows, %s %d", refs.shape[0], side, rows)
	}
	if rows > 0 && ranks == 0 {
		fail(op, "%d rows refer to ranks, but no rank's tensors were given", rows)
	}
	return refs
}

// GatherPeerRows: outRD[r] = scaleS[s][p] * srcTD[s][tokS[s][p]] for
// (s, p) = refsR2[r]; scaleS may be nil (1). outRD may be bfloat16
// (rounded to nearest even).
func (b *Backend) GatherPeerRows(outRD backend.Tensor, srcTD, tokS, scaleS []backend.Tensor, refsR2 backend.Tensor) {
	const op = "GatherPeerRows"
	out, r, d := operandMatrix(op, "out", outRD)
	ps := checkPeerSources(op, srcTD, tokS, scaleS, d)
	refs := checkPeerRefs(op, "out", refsR2, r, len(ps.src))
	fitsInt32(op, r, d, len(ps.src))
	name := "gather_peer_rows_f32"
	switch {
	case len(ps.src) > 0 && ps.src[0].dt == backend.BFloat16:
		if out.dt != backend.BFloat16 || scaleS != nil {
			fail(op, "the sources are bfloat16, which needs a bfloat16 out and no scales (out %v, scales given: %v)", out.dt, scaleS != nil)
		}
		name = "gather_peer_rows_bf16"
	case out.dt == backend.BFloat16:
		name = "gather_peer_rows_f32_bf16"
	}
	if r == 0 || d == 0 {
		return
	}
	// Four at a time when every row starts aligned: d a multiple of 4 and
	// every base address aligned.
	vec := d%4 == 0 && aligned4(out) && aligned4(ps.src...)
	table, ok := ps.table()
	if !ok {
		return
	}
	b.launchPeer(name, table, r, out, refs, int32(len(ps.src)), int32(r), int32(d), int32(bit(vec)))
	runtime.KeepAlive(ps)
}

// ScatterPeerRows: outSD[s][p] = inRD[r] for (s, p) = refsR2[r], float32
// or bf16 rows (copied as they are). The references must be distinct; two
// rows written to one place race.
func (b *Backend) ScatterPeerRows(outSD []backend.Tensor, inRD, refsR2 backend.Tensor) {
	const op = "ScatterPeerRows"
	in, r, d := operandMatrix(op, "in", inRD)
	outs := checkPeerOuts(op, outSD, d, in.dt)
	refs := checkPeerRefs(op, "in", refsR2, r, len(outs))
	fitsInt32(op, r, d, len(outs))
	if r == 0 || d == 0 {
		return
	}
	vec := d%4 == 0 && aligned4(in) && aligned4(outs...)
	table := make([]uint64, 0, peerScatterWords*len(outs))
	for _, o := range outs {
		p, ok := o.ptr()
		if !ok {
			return
		}
		table = append(table, uint64(p), uint64(o.shape[0]))
	}
	name := "scatter_peer_rows_f32"
	if in.dt == backend.BFloat16 {
		name = "scatter_peer_rows_bf16"
	}
	b.launchPeer(name, table, r, in, refs, int32(len(outs)), int32(r), int32(d), int32(bit(vec)))
	runtime.KeepAlive(outs)
}

// PeerRowRefs expands blocks into refsR2 on the GPU (see backend.Backend):
// the table is checked here and staged (3 words a block), and the
// references are written by peer_row_refs.
func (b *Backend) PeerRowRefs(refsR2 backend.Tensor, blocks []backend.RowBlock) {
	const op = "PeerRowRefs"
	if refsR2 == nil {
		fail(op, "refs is nil")
	}
	refs := tensorOf(op, "refs", refsR2)
	if refs.dt != backend.Int32 || len(refs.shape) != 2 || refs.shape[1] != 2 {
		fail(op, "refs is %v %v, want int32 [R 2]", refs.dt, refs.shape)
	}
	R := refs.shape[0]
	if err := backend.CheckRowBlocks(blocks, R); err != nil {
		fail(op, "%v", err)
	}
	fitsInt32(op, R, len(blocks))
	if R == 0 {
		return
	}
	table := make([]uint64, 0, 3*len(blocks))
	for _, bl := range blocks {
		table = append(table, uint64(bl.First), uint64(bl.Rank), uint64(bl.Pos))
	}
	b.launchTable("peer_row_refs", table, b.dev.StrideGrid(int64(R), 256, strideBlocksPerSM), refs, int32(len(blocks)), int32(R))
}

// MarkPeerRows: doneS[s][p] = 1 for (s, p) = refsR2[r], after the work
// queued before it (mark_peer_rows, which skips references past a rank's
// flags, as the scatter skips them).
func (b *Backend) MarkPeerRows(doneS []backend.Tensor, refsR2 backend.Tensor) {
	const op = "MarkPeerRows"
	if refsR2 == nil {
		fail(op, "refs is nil")
	}
	refs := checkPeerRefs(op, "refs", refsR2, refsR2.Len()/2, len(doneS))
	r := refs.shape[0]
	fitsInt32(op, r, len(doneS))
	if r == 0 {
		return
	}
	table := make([]uint64, 0, 2*len(doneS))
	for s, d := range doneS {
		if d == nil {
			fail(op, "flags of rank %d are nil", s)
		}
		t := indices(op, fmt.Sprintf("flags %d", s), d, d.Len())
		p, ok := t.ptr()
		if !ok {
			return
		}
		table = append(table, uint64(p), uint64(t.Len()))
	}
	b.launchTable("mark_peer_rows", table, b.dev.StrideGrid(int64(r), 256, strideBlocksPerSM), refs, int32(len(doneS)), int32(r))
	runtime.KeepAlive(doneS)
}

// CombineRows: outTD[rowsS[i]] += scaleS[i] * inSD[i] once doneS[i] is 1,
// then doneS[i] = 0 (combine_rows_f32). The flag waits are bounded
// (combineRowsTimeout) and report through the fused kernels' record
// (fusedTables.checkFault).
func (b *Backend) CombineRows(outTD, inSD, rowsS, scaleS, doneS backend.Tensor, sendCounts []int) {
	const op = "CombineRows"
	out, t, d := matrix(op, "out", outTD)
	in, n, _ := matrix(op, "in", inSD)
	wantMatrix(op, "in", inSD, n, d)
	rows := indices(op, "rows", rowsS, n)
	scale := optFloat(op, "scale", scaleS, n)
	done := indices(op, "flags", doneS, n)
	fitsInt32(op, t, n, d, len(sendCounts))
	if n == 0 {
		return
	}
	table := make([]uint64, len(sendCounts))
	end := uint64(0)
	for r, c := range sendCounts {
		end += uint64(c)
		table[r] = end
	}
	if len(table) == 0 {
		table = []uint64{0}
	}
	f := &b.fused
	f.mu.Lock()
	timeout := cmp.Or(f.combineTimeout, combineRowsTimeout)
	fault, err := f.armFault(b.dev, timeout, true)
	f.mu.Unlock()
	if err != nil {
		b.fail(err)
		return
	}
	// Under SetDeterministic the kernel only waits for the rows (the adds
	// as rows land would follow their arrival order); the ordered
	// scatter-add then sums them in send order.
	det := b.deterministic.Load()
	b.launchTable("combine_rows_f32", table, Grid1D(n, 256), out, in, rows, scale, done, int32(len(sendCounts)),
		fault, uint64(timeout.Nanoseconds()), int32(n), int32(d), int32(bit(!det)))
	if det {
		b.scatterOrdered(out, in, rows, scale, n, d, t)
	}
}

// launchPeer uploads table and launches kernel name of peer_rows.cu over
// rows rows (a warp each) with arguments (first, table, rest...), the
// order every kernel there takes. The caller keeps the tensors the table
// points to alive until launchPeer returns.
func (b *Backend) launchPeer(name string, table []uint64, rows int, first *Tensor, rest ...any) {
	b.launchTable(name, table, b.dev.StrideGrid(int64(rows)*32, 256, strideBlocksPerSM), first, rest...)
}

// launchTable is launchPeer on grid g.
func (b *Backend) launchTable(name string, table []uint64, g Grid, first *Tensor, rest ...any) {
	k, err := sourceKernel(b.dev, "peer_rows.cu", name)
	if err != nil {
		b.fail(err)
		return
	}
	buf, err := b.dev.Alloc(int64(8 * len(table)))
	if err != nil {
		b.fail(err)
		return
	}
	// Staged in stream order; Free is stream-ordered too, so the block is
	// reused only by work queued after this kernel.
	defer func() { b.fail(b.dev.Free(buf)) }()
	if err := b.dev.StageToDevice(buf, 0, Bytes(table)); err != nil {
		b.fail(err)
		return
	}
	b.launch(k, g, append([]any{first, buf}, rest...)...)
}
