package engine

// Runs that span several processes (nodes): RunDistributed. Each process
// trains only the ranks it hosts, with groups that reach the other
// processes over TCP (comm.NewTCPRanks); everything else is the
// single-process engine (runWorld, train.go):
//
//   - Data: a rank's part of the data is chosen by its data-group rank and
//     size (runWorld), which do not depend on where the rank runs, so the
//     processes read disjoint parts, the same parts as virtual ranks.
//   - Stopping: every rank reads its process's context and every rank of
//     every process stops at the same step (the loop's stop vote: a
//     cancel on any process stops them all); a stop is not a failure, so
//     it aborts nothing.
//   - Reports: only the process of world rank 0 calls the hooks and writes
//     metrics (the loop's lead); the others log their own lines.
//   - Checkpoints: every rank snapshots its share, and the ranks of the
//     other processes send theirs to world rank 0 (Send/Recv in the world
//     group), which writes the whole checkpoint, shards and manifest. The
//     run directory of node 0 thus holds complete checkpoints with no
//     shared filesystem; to resume, every node must find the same
//     checkpoint (a shared run directory, or a copy), which the ranks
//     check together before the first step.
//   - Failures: a rank's error aborts its groups, which over TCP fails the
//     run on every process; a failure the rendezvous reports (a node that
//     left) aborts the groups too, and a local failure is passed on to the
//     rendezvous. A snapshot share travels as Int32 words, so one rank's
//     share is limited to 8 GiB.
//
// On a backend whose driver spans processes itself (registry.MultiProcess:
// the CUDA backend) the groups are the driver's communicators (NCCL) that
// span the processes instead (runMultiProcess; placeOnNodeDevices in
// placement.go), one rank per GPU: node 0 puts the world's id (NCCL's
// unique id) in the rendezvous blob (RendezvousBlob), and every node hosts
// its block of world ranks on as many GPUs. The rendezvous then watches the nodes alone: a failure it
// reports aborts every NCCL group of this process, which returns the ranks
// waiting in a collective at once (ncclCommAbort also stops the GPU work
// that waits for the lost node), and a local failure is passed on to it.
// It is also what releases the nodes while the communicators are made, a
// wait that NCCL cannot bound: a node that fails then (too few GPUs, say)
// aborts the rendezvous, and the others give up waiting. Data, stopping,
// reports and checkpoints are as above (the checkpoint shares travel by
// NCCL Send and Recv).

import (
	"bytes"
	"context"
	"encoding/gob"
	"errors"
	"fmt"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/launch"
)

// Distributed is this process's part of a run spread over several
// processes.
type Distributed struct {
	// TCP says how to reach the other processes; Mesh and Backend are
	// filled in by the engine (the recipe's layout, the engine's backend).
	// On the CUDA backend only NodeRank is used (and Addrs' length, when
	// given, must be the node count); the Listener is closed unused.
	TCP comm.TCPConfig
	// Rendezvous, when not nil, is the run's rendezvous (launch.Join): a
	// failure it reports stops the training, and a failure of the training
	// is reported through it. The caller closes it. The CUDA backend needs
	// it: node 0's blob holds the NCCL unique id (RendezvousBlob), and the
	// node count is its table's length.
	Rendezvous *launch.Rendezvous
}

// RendezvousBlob is the blob this node offers the rendezvous
// (launch.RendezvousConfig.Blob; node 0's reaches every node): a fresh run id
// (comm.NewRunBlob) and, on node 0 of a run on a backend whose driver
// spans processes (registry.MultiProcess: CUDA), the id of the world that
// RunDistributed makes (the NCCL unique id). Making the id starts NCCL's
// bootstrap listener on node 0, which the other nodes reach on the
// interface NCCL picks (NCCL_SOCKET_IFNAME chooses).
func (e *Engine) RendezvousBlob(nodeRank int) ([comm.BlobSize]byte, error) {
	blob := comm.NewRunBlob()
	mp, ok := e.multiProcess()
	if nodeRank != 0 || !ok {
		return blob, nil
	}
	id, err := mp.NewWorldID()
	if err == nil {
		err = mp.PutWorldID(blob[:], id)
	}
	if err != nil {
		return blob, fmt.Errorf("node 0: %w", err)
	}
	return blob, nil
}

// multiProcess is the driver of the engine's backend when that driver
// spans processes itself (registry.MultiProcess): the driver the engine
// opened its backend with or, for a backend given by WithBackend, the
// driver of WithDrivers that has its name.
func (e *Engine) multiProcess() (registry.MultiProcess, bool) {
	d := e.driver
	if d == nil {
		for _, c := range e.drivers {
			if c.Name() == e.backend.Name() {
				d = c
				break
			}
		}
	}
	mp, ok := d.(registry.MultiProcess)
	return mp, ok
}

// RunDistributed is Run for a run spread over several processes: it
// connects to the other processes (d.TCP on the CPU backend, NCCL between
// the GPUs on the CUDA backend, whose driver is a registry.MultiProcess),
// trains the ranks this process hosts until the configured number of
// steps or until ctx is cancelled (then ErrStopped, as Run), and leaves
// the run. An error of any process fails
// the run on every process.
func (e *Engine) RunDistributed(ctx context.Context, d Distributed) (Result, error) {
	if err := e.checkDistributedPlan(d); err != nil {
		if d.Rendezvous != nil {
			d.Rendezvous.Abort(err) // the other nodes need not wait for this one
		}
		return Result{}, err
	}
	unlock, err := e.holdRunDir(d.TCP.NodeRank)
	if err != nil {
		if d.Rendezvous != nil {
			d.Rendezvous.Abort(err) // the other nodes need not wait for this one
		}
		return Result{}, err
	}
	defer unlock()
	if mp, ok := e.multiProcess(); ok {
		return e.runMultiProcess(ctx, d, mp)
	}
	world, closeWorld, err := e.openDistributed(ctx, d)
	if err != nil {
		return Result{}, err
	}
	res, err := e.runWorld(ctx, world, nil, true, nil)
	closeWorld(err)
	return res, err
}

// rendezvousGrace is how long a failure the rendezvous reports waits for
// the data connections to report it themselves.
const rendezvousGrace = 500 * time.Millisecond

// openDistributed connects this process's ranks to the others. closeWorld
// ends the world, first failing it on every process when the run failed.
func (e *Engine) openDistributed(ctx context.Context, d Distributed) (ranks []*comm.Ranks, closeWorld func(runErr error), err error) {
	cfg := d.TCP
	cfg.Mesh, cfg.Backend = e.cfg.mesh(), e.backend
	rdv := d.Rendezvous
	// A node that fails while the others connect to it stops the wait.
	connectCtx, stopConnect := context.WithCancelCause(ctx)
	if rdv != nil {
		go func() {
			if err, ok := <-rdv.Watch(connectCtx); ok {
				stopConnect(err)
			}
		}()
	}
	w, err := comm.NewTCPRanks(connectCtx, cfg)
	stopConnect(nil)
	if err != nil {
		return nil, nil, err
	}
	// The rendezvous and the data connections watch the same nodes; the
	// first to notice a failure tells the other.
	watchCtx, stopWatch := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		var rdvFailed <-chan error
		if rdv != nil {
			rdvFailed = rdv.Watch(watchCtx)
		}
		select {
		case err, ok := <-rdvFailed:
			if !ok || err == nil {
				return
			}
			// A dead node closes both its connections at once; the data
			// connection's error names the ranks lost, so give it a
			// moment to be first.
			t := time.NewTimer(rendezvousGrace)
			defer t.Stop()
			select {
			case <-w.Failed():
			case <-t.C:
				w.Abort(err)
			}
		case <-w.Failed():
			if rdv != nil {
				rdv.Abort(w.Err())
			}
		case <-watchCtx.Done():
		}
	}()
	e.log.Info().Int("node", cfg.NodeRank).Int("nodes", len(cfg.Addrs)).Int("ranks_here", len(w.Ranks())).
		Int("first_rank", w.Ranks()[0].Rank).Msg("connected to the other nodes")
	return w.Ranks(), func(runErr error) {
		if runErr != nil && !errors.Is(runErr, ErrStopped) {
			w.Abort(runErr)
			if rdv != nil {
				rdv.Abort(runErr)
			}
		}
		stopWatch()
		<-done
		w.Close()
	}, nil
}

// runMultiProcess is RunDistributed on a backend whose driver spans
// processes (CUDA): this node's ranks on its GPUs, the driver's
// communicators (NCCL) between every rank of every node, and the
// rendezvous watching the nodes (see the file comment).
func (e *Engine) runMultiProcess(ctx context.Context, d Distributed, mp registry.MultiProcess) (Result, error) {
	if d.TCP.Listener != nil {
		d.TCP.Listener.Close() // NCCL needs no data port of ours
	}
	caps, name := mp.Capabilities(), mp.Name()
	rdv := d.Rendezvous
	if rdv == nil {
		return Result{}, fmt.Errorf("a run over several processes on the %s backend needs the rendezvous (Distributed.Rendezvous): node 0's blob holds the %s unique id, and the rendezvous watches the nodes", name, caps.Collectives)
	}
	nnodes, node := len(rdv.Nodes()), d.TCP.NodeRank
	// Until the NCCL world is made the other nodes may wait for this one
	// in NCCL calls that cannot be cancelled; the rendezvous releases them.
	fail := func(err error) (Result, error) {
		rdv.Abort(err)
		return Result{}, err
	}
	if e.device == nil || e.driver == nil || e.driver.Name() != name {
		return fail(fmt.Errorf("node %d: a run over %d processes on the %s backend trains one rank per %s, with %s between them, on %ss the engine opens itself (train.backend: %s or auto), not on a backend given with WithBackend",
			node, nnodes, name, caps.Device, caps.Collectives, caps.Device, name))
	}
	if n := len(d.TCP.Addrs); n != 0 && n != nnodes {
		return fail(fmt.Errorf("node %d: %d data addresses for the %d nodes of the rendezvous", node, n, nnodes))
	}
	blob := rdv.Blob()
	id, err := mp.WorldIDFromBlob(blob[:])
	if err != nil {
		return fail(fmt.Errorf("node %d: %w", node, err))
	}

	// A node that fails while the communicators are made stops the wait.
	setupCtx, stopSetup := context.WithCancelCause(ctx)
	go func() {
		if err, ok := <-rdv.Watch(setupCtx); ok {
			stopSetup(err)
		}
	}()
	world, backends, release, err := e.placeOnNodeDevices(setupCtx, mp, node, nnodes, id)
	stopSetup(nil)
	if err != nil {
		return fail(err)
	}

	// From here the rendezvous watches the nodes: a failure it reports
	// aborts every group of this node's ranks.
	watchCtx, stopWatch := context.WithCancel(context.Background())
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		if err, ok := <-rdv.Watch(watchCtx); ok && err != nil {
			abortRanks(world, err)
		}
	}()
	res, err := e.runWorld(ctx, world, backends, true, rdv)
	if err != nil && !errors.Is(err, ErrStopped) {
		abortRanks(world, err)
		rdv.Abort(err)
	}
	stopWatch()
	<-watched
	if rerr := release(); rerr != nil {
		e.log.Warn().Err(rerr).Msg("closing the NCCL groups and the GPUs of the ranks")
	}
	return res, err
}

// abortRanks aborts every group of the ranks.
func abortRanks(world []*comm.Ranks, err error) {
	for _, r := range world {
		r.Abort(err)
	}
}

// checkResume makes sure every rank of a distributed run resumes from the
// same step (every node reads its own run directory): the ranks sum their
// resume step and its square, which match only when all agree.
func (s *session) checkResume(r *rank, worldRank int) error {
	step := 0.0
	if s.resume != nil {
		step = float64(s.resume.Step)
	}
	vals := []float64{step, step * step}
	if err := r.groups.World.AllReduceFloat64(vals); err != nil {
		return err
	}
	w := float64(r.groups.World.Size())
	if vals[0]*vals[0] != w*vals[1] {
		mine := "starts fresh"
		if s.resume != nil {
			mine = fmt.Sprintf("resumes from step %d", s.resume.Step)
		}
		return fmt.Errorf("the ranks disagree on the checkpoint to resume from (rank %d %s; the mean over ranks is step %.4g): every node must see the same run directory (a shared filesystem, or a copy of node 0's checkpoints)",
			worldRank, mine, vals[0]/w)
	}
	return nil
}

// hostsRank reports whether this process trains world rank q.
func (s *session) hostsRank(q int) bool {
	for _, g := range s.world {
		if g.Rank == q {
			return true
		}
	}
	return false
}

// gatherSnapshots brings the snapshots of the ranks other processes host
// to world rank 0 (the caller's rank when worldRank is 0) through the world
// group: each sends its length, then its bytes, as Int32 tensors.
func (s *session) gatherSnapshots(r *rank, worldRank int) error {
	world := r.groups.World
	b := r.b
	if worldRank != 0 {
		if s.hostsRank(0) {
			return nil // rank 0 reads it from s.snaps
		}
		payload, err := encodeSnapshot(s.snaps[worldRank])
		if err != nil {
			return fmt.Errorf("rank %d: encoding its checkpoint share: %w", worldRank, err)
		}
		words := bytesToWords(payload)
		n := b.New(backend.Int32, 2)
		backend.UploadSlice(b, n, []int32{int32(len(words)), int32(len(payload) % 4)})
		if err := world.Send(n, 0); err != nil {
			return err
		}
		t := b.New(backend.Int32, len(words))
		backend.UploadSlice(b, t, words)
		return world.Send(t, 0)
	}
	for q := 1; q < world.Size(); q++ {
		if s.hostsRank(q) {
			continue
		}
		n := b.New(backend.Int32, 2)
		if err := world.Recv(n, q); err != nil {
			return err
		}
		hdr := backend.DownloadInt32(b, n)
		t := b.New(backend.Int32, int(hdr[0]))
		if err := world.Recv(t, q); err != nil {
			return err
		}
		payload := wordsToBytes(backend.DownloadInt32(b, t), int(hdr[1]))
		snap, err := decodeSnapshot(payload)
		if err != nil {
			return fmt.Errorf("rank %d's checkpoint share: %w", q, err)
		}
		if snap.worldRank != q {
			return fmt.Errorf("rank %d sent the checkpoint share of rank %d", q, snap.worldRank)
		}
		s.snaps[q] = snap
	}
	return nil
}

// wireSnapshot is a rankSnapshot as it travels.
type wireSnapshot struct {
	WorldRank, DataRank int
	Cursor              data.Cursor
	Model, Optim        []checkpoint.NamedTensor
}

func encodeSnapshot(s rankSnapshot) ([]byte, error) {
	var buf bytes.Buffer
	err := gob.NewEncoder(&buf).Encode(wireSnapshot{s.worldRank, s.dataRank, s.cursor, s.model, s.optim})
	return buf.Bytes(), err
}

func decodeSnapshot(p []byte) (rankSnapshot, error) {
	var w wireSnapshot
	if err := gob.NewDecoder(bytes.NewReader(p)).Decode(&w); err != nil {
		return rankSnapshot{}, err
	}
	return rankSnapshot{worldRank: w.WorldRank, dataRank: w.DataRank, cursor: w.Cursor, model: w.Model, optim: w.Optim}, nil
}

// bytesToWords packs bytes into int32 words, little-endian, zero-padded.
func bytesToWords(p []byte) []int32 {
	out := make([]int32, (len(p)+3)/4)
	for i, c := range p {
		out[i/4] |= int32(uint32(c) << (8 * (i % 4)))
	}
	return out
}

// wordsToBytes undoes bytesToWords; tail is the length mod 4 (0: whole
// words).
func wordsToBytes(w []int32, tail int) []byte {
	out := make([]byte, 4*len(w))
	for i, v := range w {
		for k := range 4 {
			out[4*i+k] = byte(uint32(v) >> (8 * k))
		}
	}
	if tail > 0 && len(out) > 0 {
		out = out[:len(out)-4+tail]
	}
	return out
}
