package cuda

// Zigzag context-parallel attention read straight from the peers' tensors
// (the fused ring): the launch side of attention_tc.cu's attn_zz_*
// kernels. A rank's forward and dq blocks read every rank's k and v, its
// dk/dv blocks every rank's q, dout, lse and delta, through tables of
// device pointers (virtual ranks' buffers on this GPU, or peer GPUs'
// memory over NVLink); no chunk is copied and no partial output or
// log-sum-exp goes through memory between chunks. What orders the peers'
// writes of those tensors before the reads is the caller's meeting
// (comm.PeerAccess.PeerTensors), as for the MoE fused kernels.

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// zigzagMaxRanks is the most ranks the pointer tables hold.
const zigzagMaxRanks = 64

// zigzagTables is the device memory of the zigzag kernels' pointer tables:
// up to four lists of zigzagMaxRanks pointers. Staging a call's tables and
// queuing its kernel happen under mu, so the ranks of one device (which
// share its stream) never launch on each other's tables.
type zigzagTables struct {
	mu  sync.Mutex
	buf *Buffer
}

// stage uploads lists (each of W pointers) into consecutive blocks of
// zigzagMaxRanks entries and returns each block's address. The caller
// holds mu.
func (z *zigzagTables) stage(d *Device, lists ...[]driver.DevicePtr) ([]driver.DevicePtr, error) {
	if z.buf == nil {
		buf, err := d.Alloc(4 * 8 * zigzagMaxRanks)
		if err != nil {
			return nil, err
		}
		z.buf = buf
	}
	host := make([]byte, 8*zigzagMaxRanks*len(lists))
	addrs := make([]driver.DevicePtr, len(lists))
	for i, ps := range lists {
		at := 8 * zigzagMaxRanks * i
		for r, p := range ps {
			for k := range 8 {
				host[at+8*r+k] = byte(uint64(p) >> (8 * k))
			}
		}
		addrs[i] = z.buf.Ptr() + driver.DevicePtr(at)
	}
	return addrs, d.StageToDevice(z.buf, 0, host)
}

// ZigzagAttentionSupports says whether the zigzag kernels take s: head
// dims 64 and 128, a chunk that is a multiple of 64 rows, at most
// zigzagMaxRanks ranks, and sizes whose offsets fit the kernels' integers.
func (b *Backend) ZigzagAttentionSupports(s backend.ZigzagShape) error { return zigzagTakes(s) }

// zigzagTakes is ZigzagAttentionSupports, which asks nothing of the
// device (HopperZigzag answers it without one).
func zigzagTakes(s backend.ZigzagShape) error {
	if err := s.Check(); err != nil {
		return err
	}
	switch {
	case !tcHeadDim(s.HeadDim):
		return fmt.Errorf("the fused ring kernels take head dims 64 and 128, not %d", s.HeadDim)
	case s.Chunk%attnRows != 0:
		return fmt.Errorf("the fused ring kernels need chunks (seq/(2*cp) = %d) that are a multiple of %d", s.Chunk, attnRows)
	case s.Ranks > zigzagMaxRanks:
		return fmt.Errorf("the fused ring kernels take at most %d ranks, not %d", zigzagMaxRanks, s.Ranks)
	case 2*s.Chunk/attnRows > maxGridY:
		return fmt.Errorf("the fused ring kernels take at most %d rows per rank and sequence, not %d", maxGridY*attnRows, 2*s.Chunk)
	case int64(s.Batch)*int64(s.Heads) > 1<<31-1 || int64(s.Batch)*2*int64(s.Chunk)*int64(s.Ranks) > 1<<31-1:
		return fmt.Errorf("the zigzag attention shape %+v is too large for 32-bit row counts", s)
	}
	return nil
}

// zigzagCall checks a zigzag op's shape and tensors and returns the
// addresses of its single tensors and of each rank list; it fails (panics
// with the op's name) on a shape or tensor the ops do not take.
func (b *Backend) zigzagCall(op string, s backend.ZigzagShape, single []attnArg, lists [][]backend.Tensor, listHeads []int) ([]driver.DevicePtr, [][]driver.DevicePtr) {
	if err := b.ZigzagAttentionSupports(s); err != nil {
		fail(op, "%v", err)
	}
	rows := s.Batch * 2 * s.Chunk
	lseLen := s.Batch * 2 * s.Heads * s.Chunk
	size := func(heads int) int {
		if heads == 0 {
			return lseLen
		}
		return rows * heads * s.HeadDim
	}
	// The kernels read and write rows as 16-byte vectors (lse and delta
	// element by element).
	aligned := func(name string, p driver.DevicePtr, heads int) {
		if heads > 0 && p%16 != 0 {
			fail(op, "%s is not 16-byte aligned, which the fused ring kernels need", name)
		}
	}
	ts := make([]*Tensor, len(single))
	for i, a := range single {
		ts[i] = vector(op, a.name, a.t, size(a.heads))
	}
	ps, ok := devicePtrs(ts...)
	if !ok {
		fail(op, "a tensor was freed")
	}
	for i, a := range single {
		aligned(a.name, ps[i], a.heads)
	}
	out := make([][]driver.DevicePtr, len(lists))
	for i, l := range lists {
		if len(l) != s.Ranks {
			fail(op, "list %d has %d tensors for %d ranks", i, len(l), s.Ranks)
		}
		lt := make([]*Tensor, len(l))
		for r, t := range l {
			lt[r] = vector(op, fmt.Sprintf("rank %d's tensor of list %d", r, i), t, size(listHeads[i]))
		}
		if out[i], ok = devicePtrs(lt...); !ok {
			fail(op, "a tensor of list %d was freed", i)
		}
		for r, p := range out[i] {
			aligned(fmt.Sprintf("rank %d's tensor of list %d", r, i), p, listHeads[i])
		}
		runtime.KeepAlive(lt)
	}
	runtime.KeepAlive(ts)
	return ps, out
}

// zigzagLaunch stages the pointer tables of lists and launches kernel name
// over grid with args, the tables' addresses appended after the first
// fixed arguments as the kernel's parameter list orders them (see
// attention_tc.cu): place(tables) builds the full argument list.
func (b *Backend) zigzagLaunch(name string, grid Grid, lists [][]driver.DevicePtr, place func(tables []driver.DevicePtr) []any) {
	kern, err := sourceKernel(b.dev, "attention_tc.cu", name)
	if err != nil {
		b.fail(err)
		return
	}
	z := &b.zigzag
	z.mu.Lock()
	defer z.mu.Unlock()
	tables, err := z.stage(b.dev, lists...)
	if err != nil {
		b.fail(err)
		return
	}
	b.fail(b.dev.Launch(kern, grid, place(tables)...))
}

// ZigzagAttentionForward runs attn_zz_forward on float32 q, k and v, and
// on bf16 ones the one-pass kernel of attention_zigzag_hopper.go (see
// backend.Backend).
func (b *Backend) ZigzagAttentionForward(outTQ, lseBHS, qTQ backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape) {
	const op = "ZigzagAttentionForward"
	if qTQ != nil && qTQ.DType() == backend.BFloat16 {
		b.zigzagForwardHopper(outTQ, lseBHS, qTQ, kTK, vTK, s, 0)
		return
	}
	ps, lists := b.zigzagCall(op, s,
		[]attnArg{{"out", outTQ, s.Heads, false, false}, {"lse", lseBHS, 0, false, false}, {"q", qTQ, s.Heads, false, false}},
		[][]backend.Tensor{kTK, vTK}, []int{s.KVHeads, s.KVHeads})
	_, scaleLog2 := attnScales(s.HeadDim)
	r, W, C, H, KV := int32(s.Rank), int32(s.Ranks), int32(s.Chunk), int32(s.Heads), int32(s.KVHeads)
	b.zigzagLaunch(fmt.Sprintf("attn_zz_forward_d%d", s.HeadDim), tcGrid(s.Batch*s.Heads, 2*s.Chunk), lists,
		func(t []driver.DevicePtr) []any {
			return []any{ps[0], ps[1], ps[2], t[0], t[1], r, W, C, H, KV, scaleLog2}
		})
	runtime.KeepAlive(kTK)
	runtime.KeepAlive(vTK)
}

// ZigzagAttentionBackwardDQ runs attn_zz_backward_dq (see backend.Backend).
func (b *Backend) ZigzagAttentionBackwardDQ(dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape) {
	const op = "ZigzagAttentionBackwardDQ"
	ps, lists := b.zigzagCall(op, s,
		[]attnArg{{"dq", dqTQ, s.Heads, false, false}, {"delta", deltaBHS, 0, false, false}, {"dout", doutTQ, s.Heads, false, false},
			{"q", qTQ, s.Heads, false, false}, {"out", outTQ, s.Heads, false, false}, {"lse", lseBHS, 0, false, false}},
		[][]backend.Tensor{kTK, vTK}, []int{s.KVHeads, s.KVHeads})
	scale, scaleLog2 := attnScales(s.HeadDim)
	r, W, C, H, KV := int32(s.Rank), int32(s.Ranks), int32(s.Chunk), int32(s.Heads), int32(s.KVHeads)
	b.zigzagLaunch(fmt.Sprintf("attn_zz_backward_dq_d%d", s.HeadDim), tcGrid(s.Batch*s.Heads, 2*s.Chunk), lists,
		func(t []driver.DevicePtr) []any {
			return []any{ps[0], ps[1], ps[2], ps[3], ps[4], ps[5], t[0], t[1], r, W, C, H, KV, scaleLog2, scale}
		})
	runtime.KeepAlive(kTK)
	runtime.KeepAlive(vTK)
}

// ZigzagAttentionBackwardDKDV runs attn_zz_backward_dkdv (see
// backend.Backend): one block per query head and 64 keys. With GQA each
// head of a group writes its own partial dk, dv into a scratch of H/KV
// slices, which attn_zz_sum_heads adds up in head order into dk and dv
// (deterministic; the scratch is freed in stream order).
func (b *Backend) ZigzagAttentionBackwardDKDV(dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, s backend.ZigzagShape) {
	const op = "ZigzagAttentionBackwardDKDV"
	ps, lists := b.zigzagCall(op, s,
		[]attnArg{{"dk", dkTK, s.KVHeads, true, false}, {"dv", dvTK, s.KVHeads, true, false}, {"k", kTK, s.KVHeads, true, false}, {"v", vTK, s.KVHeads, true, false}},
		[][]backend.Tensor{qTQ, doutTQ, lseBHS, deltaBHS}, []int{s.Heads, s.Heads, 0, 0})
	scale, scaleLog2 := attnScales(s.HeadDim)
	r, W, C, H, KV := int32(s.Rank), int32(s.Ranks), int32(s.Chunk), int32(s.Heads), int32(s.KVHeads)
	group := s.Heads / s.KVHeads
	n := int64(s.Batch) * 2 * int64(s.Chunk) * int64(s.KVHeads) * int64(s.HeadDim)
	dk, dv := ps[0], ps[1]
	var part *Buffer
	if group > 1 {
		var err error
		if part, err = b.dev.Alloc(2 * 4 * int64(group) * n); err != nil {
			b.fail(err)
			return
		}
		dk, dv = part.Ptr(), part.Ptr()+driver.DevicePtr(4*int64(group)*n)
	}
	b.zigzagLaunch(fmt.Sprintf("attn_zz_backward_dkdv_d%d", s.HeadDim), tcGrid(s.Batch*s.Heads, 2*s.Chunk), lists,
		func(t []driver.DevicePtr) []any {
			return []any{dk, dv, ps[2], ps[3], t[0], t[1], t[2], t[3], r, W, C, H, KV, scaleLog2, scale}
		})
	if part != nil {
		if kern, err := sourceKernel(b.dev, "attention_tc.cu", "attn_zz_sum_heads"); err != nil {
			b.fail(err)
		} else {
			g := Grid{Grid: driver.Dim3{X: int(min((n/4+255)/256, 4096)), Y: 1, Z: 1}, Block: driver.Dim3{X: 256, Y: 1, Z: 1}}
			b.fail(b.dev.Launch(kern, g, ps[0], ps[1], dk, dv, n, int32(group)))
		}
		// Free is stream-ordered: the kernels queued before it still see part.
		b.fail(b.dev.Free(part))
	}
	runtime.KeepAlive(qTQ)
	runtime.KeepAlive(doutTQ)
	runtime.KeepAlive(lseBHS)
	runtime.KeepAlive(deltaBHS)
}
