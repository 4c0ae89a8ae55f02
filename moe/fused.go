package moe

// The fused dispatcher: the experts read their input rows from the source
// ranks' tensors and write their outputs straight into the source ranks'
// buffers (the backend's peer-row ops), so no row is gathered into send
// order, exchanged and permuted. The expert-major rows, and so every
// product, are the unfused path's (plan.peerBlocks), which is why the two
// agree to the bit on the CPU.
//
// Who touches whose memory, per expert-group rank r:
//
//	forward:  after PeerTensors, r reads every source's x and sendTok and
//	          writes the rows its experts computed into every source's ySD,
//	          raising each row's flag in the source's doneS once the row is
//	          whole; after the Barrier, r's combine (CombineRows) adds each
//	          row of its own ySD once its flag is up, and clears the flag.
//	backward: after PeerTensors, r reads every source's dout, sendTok and
//	          gate rows (DispatchDgradSwiGLU) and writes its experts' dx
//	          rows into every source's dxSD (scratch rowsSD, DgradCombine),
//	          flagged as in the forward; after the Barrier, r combines its
//	          own dxSD the same way.
//
// Between the two meetings no rank writes a tensor a peer reads, and no
// rank uses its own ySD, rowsSD or doneS: the only writes to them are the
// peers'. The row flags are what orders a peer's writes before the
// combine's reads on the device, with ranks on separate GPUs too. The
// Barrier stays because the virtual ranks of one GPU share one stream: a
// combine queued before a peer's kernel would wait for flags that only
// the kernel behind it can raise (until its bounded wait reports them).
// A rank's flags are all clear again when its combine is done, so one
// buffer serves every layer and both passes. A rank alone in its expert
// group combines without flags: its stream (or the CPU's call order)
// already puts its own writes first.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// fusedForward runs the routed experts of one Forward through the peer-row
// ops and leaves their outputs in st.ySD, in send order, as
// dispatchForward does.
func (l *Layer) fusedForward(st *step, p *Params) error {
	b, pl := l.b, st.plan
	S, R := pl.sent, pl.rows
	l.phase(PhaseDispatchExperts)
	st.xRD, st.ySD = l.xRD.view(b, R), l.ySD.view(b, S)
	st.h1RF, st.h3RF, st.actRF = l.hidden(R)
	st.refsR2 = l.writeRefs(pl)
	shared := []backend.Tensor{st.xoTD, st.sendTokS, st.ySD}
	if l.flagged() {
		st.doneS = l.scratch.doneS.vec(b, S)
		shared = append(shared, st.doneS)
	}
	peers, err := l.peers.PeerTensors(shared...)
	if err != nil {
		return fmt.Errorf("moe: fused dispatch: %w", err)
	}
	if R > 0 {
		w1, w3, w2 := l.stacked(p)
		b.DispatchSwiGLU(st.xRD, st.h1RF, st.h3RF, st.actRF, peerColumn(peers, 0), peerColumn(peers, 1), st.refsR2, w1, w3, pl.groups())
		b.DownCombine(peerColumn(peers, 2), peerColumn(peers, 3), st.refsR2, st.actRF, w2, pl.groups())
	}
	l.phase(PhaseCombine)
	// Every peer's writes into this rank's ySD are issued before it
	// reaches the barrier (see the file comment for separate GPUs).
	if err := l.g.Expert.Barrier(); err != nil {
		return fmt.Errorf("moe: fused combine: %w", err)
	}
	return nil
}

// fusedBackward is dispatchBackward through the fused backward ops: the
// output gradients are gathered, scaled by the gates, from the source
// ranks straight into expert-major order and multiplied through W2 and
// SwiGLU's backward in one op (DispatchDgradSwiGLU); the weight gradients
// follow; then the experts' dx rows are computed and written into the
// source ranks' send-order scratch in one op (DgradCombine), and each
// rank adds its flagged scratch rows into dxTD (CombineRows).
func (l *Layer) fusedBackward(dxTD, doutTD backend.Tensor, st *step, p, g *Params) error {
	b, pl, sc := l.b, st.plan, l.scratch
	S, R := pl.sent, pl.rows
	groups := pl.groups()
	l.phase(PhaseDispatchBackward)
	if l.recompute {
		// Before the exchange: DispatchDgradSwiGLU reads h1 and h3.
		l.recomputeHidden(st, p)
	}
	// Peers write dxSD between the exchange and the barrier; this rank
	// uses neither rowsSD nor anything aliasing it in between (dy is in
	// dyRD, the hidden gradients in the F-wide scratch).
	dyRD, dxSD := sc.dyRD.view(b, R), sc.rowsSD.view(b, S)
	dh1RF, dh3RF := sc.dh1RF.view(b, R), sc.dh3RF.view(b, R)
	shared := []backend.Tensor{doutTD, st.sendTokS, st.gateS, dxSD}
	var doneS backend.Tensor
	if l.flagged() {
		doneS = sc.doneS.vec(b, S)
		shared = append(shared, doneS)
	}
	peers, err := l.peers.PeerTensors(shared...)
	if err != nil {
		return fmt.Errorf("moe: fused backward dispatch: %w", err)
	}
	w1, w3, w2 := l.stacked(p)
	if R > 0 {
		b.DispatchDgradSwiGLU(dyRD, dh1RF, dh3RF, peerColumn(peers, 0), peerColumn(peers, 1), peerColumn(peers, 2),
			st.refsR2, st.h1RF, st.h3RF, w2, groups)
	}
	l.phase(PhaseExpertsBackward)
	dw1, dw3, dw2 := l.stacked(g)
	if R > 0 {
		// DispatchDgradSwiGLU, the last read of w2, is queued.
		if err := l.weightGrad(ExpertW2, dw2, dyRD, st.actRF, groups); err != nil {
			return err
		}
		if l.updater == nil {
			if err := l.gateUpGrads(dw1, dw3, dh1RF, dh3RF, st.xRD, groups); err != nil {
				return err
			}
		}
	} else if err := l.noExpertRows(g); err != nil {
		return err
	}
	l.phase(PhaseCombineBackward)
	if R > 0 {
		// One rank: the references are (0, r), so dxSD is the experts'
		// dx rows in send order.
		b.DgradCombine(peerColumn(peers, 3), peerColumn(peers, 4), st.refsR2, dh1RF, dh3RF, w1, w3, groups)
		if l.updater != nil {
			// After DgradCombine, the last read of w1 and w3.
			if err := l.gateUpGrads(dw1, dw3, dh1RF, dh3RF, st.xRD, groups); err != nil {
				return err
			}
		}
	}
	if l.g.Expert.Size() > 1 {
		if err := l.g.Expert.Barrier(); err != nil {
			return fmt.Errorf("moe: fused backward combine: %w", err)
		}
	}
	switch {
	case S == 0:
	case doneS != nil:
		b.CombineRows(dxTD, dxSD, st.sendTokS, nil, doneS, pl.sendCounts)
	default:
		b.GatherSumRows(dxTD, dxSD, st.sendPosTK, nil)
	}
	return nil
}

// flagged says whether the fused combines go through row flags: with
// peers to wait for. A rank alone in its expert group writes its own rows
// on its own stream (or at the call, on the CPU), which orders them
// before its combine already.
func (l *Layer) flagged() bool { return l.g.Expert.Size() > 1 }

// writeRefs writes the plan's row references into the Int32 [R, 2]
// tensor the peer-row ops take, on the device: only the table of
// (expert, source) blocks crosses from the host (PeerRowRefs).
func (l *Layer) writeRefs(pl *plan) backend.Tensor {
	R := pl.rows
	if l.g.Expert.Size() == 1 {
		// One rank: row i is (0, i) every step, so the references are
		// written once for the buffer's whole capacity, not per step.
		if R > l.refsIdentity || l.refsR2.t == nil {
			l.refsR2.grow(l.b, R)
			l.b.PeerRowRefs(l.refsR2.view(l.b, l.refsR2.rows), []backend.RowBlock{{First: 0, Rank: 0, Pos: 0}})
			l.refsIdentity = l.refsR2.rows
		}
		return l.refsR2.view(l.b, R)
	}
	v := l.refsR2.view(l.b, R)
	l.b.PeerRowRefs(v, pl.peerBlocks())
	return v
}

// peerColumn returns tensor i of every rank, in rank order, from
// PeerTensors' [rank][i] answer, or nil when the ranks shared fewer.
func peerColumn(peers [][]backend.Tensor, i int) []backend.Tensor {
	if len(peers) == 0 || i >= len(peers[0]) {
		return nil
	}
	col := make([]backend.Tensor, len(peers))
	for r, ts := range peers {
		col[r] = ts[i]
	}
	return col
}
