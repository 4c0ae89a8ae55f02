package moe

// The dispatch plan: which rows go where. Dropless, the backend sorts the
// router's choices by expert (RouteByExpert) and the host plans from the
// per-expert counts alone (planCounts); with a capacity the host reads the
// choices and decides which to drop (planSource). The fused dispatcher
// addresses the same rows by (source rank, send position) (peerBlocks).
//
// Dropless on one expert rank the host needs no counts to queue the
// forward (planOneRank): every assignment is a row, in the order
// RouteByExpert sorts them, and the experts' products read the group
// offsets RouteByExpert leaves on the device. The counts come to the host
// by a queued download, waited for in the backward (plan.settle), long
// after the device wrote them, so the device's queue never runs dry.

import (
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend"
)

// plan is one micro-step's routing on one rank. Both halves are in terms of
// rows of D values: "send" rows are this rank's token copies, one per kept
// (token, expert) assignment; "recv" rows are what this rank's experts
// process.
type plan struct {
	// Source side. Rows are sorted by global expert, which is the same as
	// by destination rank and then local expert (experts are sharded in
	// contiguous blocks); within an expert, by token.
	sent       int     // S, the rows this rank sends
	sendTok    []int32 // [S] token each row copies (planSource only)
	sendSlot   []int32 // [S] its assignment t*K + k, an index into gatesTK (planSource only)
	sendCounts []int   // [EP] rows to each rank of the expert group
	countsE    []int   // [E] the router's assignments per expert, before capacity
	keptE      []int   // [E] rows sent to each expert, after capacity
	dropped    int     // assignments dropped by capacity

	// Destination side. Rows arrive in source-rank order, each source's
	// block sorted by local expert; perm regroups them by local expert
	// (all sources' rows for expert 0 first) so each expert runs one
	// MatMul over contiguous rows.
	rows       int     // R, the rows this rank's experts process
	recvCounts []int   // [EP] rows from each rank
	srcStart   []int   // [EP] where, in each source's send order, its rows for this rank begin
	expertRows []int   // [E_local] rows for each local expert, expert-major (nil until settle, planOneRank)
	countsSE   []int   // [EP][E_local] rows from each source rank for each local expert
	perm       []int32 // [R] expert-major row i is received row perm[i]
	invPerm    []int32 // [R] received row j is expert-major row invPerm[j]

	// planOneRank only: the expert groups' offsets on the device
	// (RouteByExpert's), and the queued download of them that settle
	// waits for; nil once settled.
	offsetsE1 backend.Tensor
	counts    backend.PendingDownload
}

// planOneRank is the whole plan of a dropless micro-step of n assignments
// on one expert rank, as far as the host needs it to queue the forward:
// every assignment is a row, sent and processed in RouteByExpert's order,
// and the products are sized on the device from offsetsE1. counts is the
// queued download of offsetsE1, for settle.
func planOneRank(n int, offsetsE1 backend.Tensor, counts backend.PendingDownload) *plan {
	return &plan{sent: n, rows: n, sendCounts: []int{n}, recvCounts: []int{n}, srcStart: []int{0}, offsetsE1: offsetsE1, counts: counts}
}

// settle fills in a planOneRank plan's per-expert counts from its queued
// download, waiting for it if it is not done yet (it is, by the backward).
// Other plans are settled already.
func (p *plan) settle() error {
	if p.counts == nil {
		return nil
	}
	offsets, _ := backend.HostData(p.counts()).([]int32)
	p.counts = nil
	rows, err := backend.OffsetRows(offsets, p.sent)
	if err != nil {
		return fmt.Errorf("moe: the router's expert offsets: %w", err)
	}
	p.setCounts(rows)
	return nil
}

// setCounts fills in a planOneRank plan's per-expert counts: on one rank,
// dropless, every count is the router's, kept and processed alike.
func (p *plan) setCounts(rows []int) {
	p.countsE, p.keptE, p.expertRows, p.countsSE = rows, rows, rows, rows
}

// groups is how the local experts' products split the expert-major rows:
// the counts once the host knows them, and on one expert rank dropless
// the offsets on the device too.
func (p *plan) groups() backend.Groups {
	return backend.Groups{Rows: p.expertRows, Offsets: p.offsetsE1}
}

// capacity is the most rows one expert takes from one source rank per
// micro-step, or 0 for dropless routing.
func capacity(cf float64, tokens, k, experts int) int {
	if cf <= 0 {
		return 0
	}
	return int(math.Ceil(cf * float64(tokens*k) / float64(experts)))
}

// planSource builds the source half of the plan from idxTK (T tokens, K
// choices each). With a positive capacity, an expert's assignments beyond it
// are dropped in token order (earlier tokens keep their place).
func planSource(idxTK []int32, T, K, E, ep, capacity int) *plan {
	p := &plan{countsE: make([]int, E), keptE: make([]int, E), sendCounts: make([]int, ep)}
	keep := make([]bool, T*K)
	for a, e := range idxTK {
		p.countsE[e]++
		if capacity > 0 && p.keptE[e] >= capacity {
			p.dropped++
			continue
		}
		p.keptE[e]++
		keep[a] = true
	}
	// Counting sort by expert: offsets, then place assignments in token
	// order.
	start := make([]int, E+1)
	for e := range E {
		start[e+1] = start[e] + p.keptE[e]
	}
	S := start[E]
	p.sendTok, p.sendSlot = make([]int32, S), make([]int32, S)
	next := append([]int(nil), start[:E]...)
	for a, e := range idxTK {
		if !keep[a] {
			continue
		}
		i := next[e]
		next[e]++
		p.sendTok[i], p.sendSlot[i] = int32(a/K), int32(a)
	}
	p.sent = S
	p.countSends(ep)
	return p
}

// sendPositions inverts a send order: for each of n assignments, its
// place in sendSlot (sendSlot[i] = a gives a's place i), -1 where it was
// dropped.
func sendPositions(sendSlot []int32, n int) []int32 {
	pos := make([]int32, n)
	for a := range pos {
		pos[a] = -1
	}
	for i, a := range sendSlot {
		pos[a] = int32(i)
	}
	return pos
}

// planCounts is the source half of a dropless plan from countsE, the
// router's assignments per expert (the rows themselves stay on the device,
// sorted by RouteByExpert in the order planSource would list them).
func planCounts(countsE []int, ep int) *plan {
	p := &plan{countsE: countsE, keptE: countsE, sendCounts: make([]int, ep)}
	for _, c := range countsE {
		p.sent += c
	}
	p.countSends(ep)
	return p
}

// countSends fills sendCounts from keptE: experts are sharded over the ep
// ranks in contiguous blocks.
func (p *plan) countSends(ep int) {
	local := len(p.keptE) / ep
	for e, n := range p.keptE {
		p.sendCounts[e/local] += n
	}
}

// planDest fills in the destination half from countsSE, the rows every
// source rank sends to every expert ([EP][E], row-major), for the rank that
// owns experts [first, first+local).
func (p *plan) planDest(countsSE []int, ep, E, first, local int) {
	at := func(src, le int) int { return countsSE[src*E+first+le] }
	p.recvCounts, p.expertRows, p.srcStart = make([]int, ep), make([]int, local), make([]int, ep)
	p.countsSE = make([]int, ep*local)
	recvStart := make([]int, ep*local) // first received row of (src, le)
	R := 0
	for src := range ep {
		// A source's send order is by global expert, so its rows for
		// this rank follow those for all lower experts.
		for e := range first {
			p.srcStart[src] += countsSE[src*E+e]
		}
		for le := range local {
			recvStart[src*local+le] = R
			p.countsSE[src*local+le] = at(src, le)
			R += at(src, le)
			p.recvCounts[src] += at(src, le)
			p.expertRows[le] += at(src, le)
		}
	}
	p.rows = R
	p.perm, p.invPerm = make([]int32, R), make([]int32, R)
	i := 0
	for le := range local {
		for src := range ep {
			for r := range at(src, le) {
				j := recvStart[src*local+le] + r
				p.perm[i], p.invPerm[j] = int32(j), int32(i)
				i++
			}
		}
	}
}

// peerBlocks describes the fused dispatcher's row references (the
// backend's PeerRowRefs table): expert-major rows come in blocks, one per
// (local expert, source rank) in that order, and a block's rows are
// consecutive send positions of its source, since each source sends its
// rows for this rank sorted by expert. So row i of block (le, s) refers to
// s's position srcStart[s] + (s's rows for experts below le) + i: where
// the all-to-all and perm would bring that row from.
func (p *plan) peerBlocks() []backend.RowBlock {
	ep, local := len(p.recvCounts), len(p.expertRows)
	blocks := make([]backend.RowBlock, 0, ep*local)
	next := append([]int(nil), p.srcStart...) // each source's next send position
	first := 0
	for le := range local {
		for s := range ep {
			n := p.countsSE[s*local+le]
			blocks = append(blocks, backend.RowBlock{First: first, Rank: s, Pos: next[s]})
			first += n
			next[s] += n
		}
	}
	return blocks
}

// release waits for the queued download of an unsettled plan whose
// counts are no longer wanted (a Forward without a Backward), which frees
// the backend's slot for it.
func (p *plan) release() {
	if p.counts != nil {
		p.counts()
		p.counts = nil
	}
}
