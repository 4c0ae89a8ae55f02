package comm_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// peerAccess returns g's PeerAccess, or an error if it has none (the rank
// goroutines of runRanks return errors rather than calling t.Fatal).
func peerAccess(g comm.Group) (comm.PeerAccess, error) {
	pa, ok := g.(comm.PeerAccess)
	if !ok {
		return nil, fmt.Errorf("the local group %T does not offer PeerAccess", g)
	}
	return pa, nil
}

// PeerTensors hands every rank every rank's tensors, indexed [rank][i], and
// orders the ranks' ops as the fused MoE dispatcher needs: what a rank
// wrote before the call is what its peers read after it, and what peers
// write into a rank's tensor between the call and a Barrier is what the
// rank reads after the Barrier. Several rounds with every tensor rewritten
// (run with -race).
func TestPeerTensors(t *testing.T) {
	for _, b := range backends(backend.Float64) {
		for _, ranks := range worlds(t, b) {
			W := len(ranks)
			runRanks(t, ranks, func(r *comm.Ranks) error {
				pa, err := peerAccess(r.Expert)
				if err != nil {
					return err
				}
				own := put(b, backend.Float64, nil, 3)
				inbox := put(b, backend.Float64, nil, W, 2) // row s: written by rank s
				for round := range 4 {
					mark := float64(100*round + r.Rank)
					set(b, own, []float64{mark, mark + 0.5, -mark})
					all, err := pa.PeerTensors(own, inbox)
					if err != nil {
						return err
					}
					if len(all) != W {
						return fmt.Errorf("round %d: %d ranks' tensors, want %d", round, len(all), W)
					}
					for s, ts := range all {
						if len(ts) != 2 {
							return fmt.Errorf("round %d: rank %d has %d tensors, want 2", round, s, len(ts))
						}
						want := float64(100*round + s)
						if got := get(b, ts[0]); got[0] != want || got[1] != want+0.5 || got[2] != -want {
							return fmt.Errorf("round %d: rank %d's tensor reads %v, want its mark %v", round, s, got, want)
						}
						// Write this rank's mark into row r of rank s's inbox.
						b.Copy(b.View(ts[1], 2*r.Rank, 1, 2), b.View(all[r.Rank][0], 0, 1, 2))
					}
					if err := r.Expert.Barrier(); err != nil {
						return err
					}
					got := get(b, inbox)
					for s := range W {
						if want := float64(100*round + s); got[2*s] != want || got[2*s+1] != want+0.5 {
							return fmt.Errorf("round %d: inbox row %d holds %v, want rank %d's mark %v", round, s, got[2*s:2*s+2], s, want)
						}
					}
				}
				if all, err := pa.PeerTensors(); err != nil || len(all) != W || len(all[0]) != 0 {
					return fmt.Errorf("PeerTensors of nothing: %v, %v", all, err)
				}
				return nil
			})
		}
	}
}

// Every local group of a mesh offers PeerAccess, not only the expert group.
func TestLocalGroupsOfferPeerAccess(t *testing.T) {
	ranks := newLocal(t, comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, cpu.New(backend.Float32))
	for _, g := range []comm.Group{ranks[0].World, ranks[0].Data, ranks[0].Expert, ranks[0].ExpertReplica} {
		if _, err := peerAccess(g); err != nil {
			t.Error(err)
		}
	}
}

// Ranks that pass different numbers of tensors, or a nil one, all fail with
// the same error naming the rank at fault.
func TestPeerTensorsArgumentErrors(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 3, CP: 1, TP: 1}, b)
	for _, c := range []struct {
		name string
		args func(rank int) []backend.Tensor
		want string
	}{
		{"counts", func(rank int) []backend.Tensor {
			if rank == 2 {
				return []backend.Tensor{b.New(backend.Float64, 1)}
			}
			return []backend.Tensor{b.New(backend.Float64, 1), b.New(backend.Float64, 1)}
		}, "rank 2 passes 1 tensors, rank 0 passes 2"},
		{"nil", func(rank int) []backend.Tensor {
			if rank == 1 {
				return []backend.Tensor{b.New(backend.Float64, 1), nil}
			}
			return []backend.Tensor{b.New(backend.Float64, 1), b.New(backend.Float64, 1)}
		}, "rank 1: tensor 1 is nil"},
	} {
		errs := make([]error, len(ranks))
		runRanks(t, ranks, func(r *comm.Ranks) error {
			pa, err := peerAccess(r.Expert)
			if err != nil {
				return err
			}
			_, errs[r.Rank] = pa.PeerTensors(c.args(r.Rank)...)
			return nil
		})
		for i, err := range errs {
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%s: rank %d: error %v, want %q", c.name, i, err, c.want)
			}
		}
		// The group is still usable after an argument error.
		runRanks(t, ranks, func(r *comm.Ranks) error { return r.Expert.Barrier() })
	}
}

// Abort releases ranks blocked in PeerTensors, and later calls fail with
// the abort's cause.
func TestAbortReleasesPeerTensors(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 3, CP: 1, TP: 1}, b)
	cause := errors.New("rank 2 failed its forward")
	pas := make([]comm.PeerAccess, len(ranks))
	for i, r := range ranks {
		pa, err := peerAccess(r.Expert)
		if err != nil {
			t.Fatal(err)
		}
		pas[i] = pa
	}
	blocked := make(chan error, 2)
	for _, pa := range pas[:2] {
		go func() {
			_, err := pa.PeerTensors(b.New(backend.Float64, 2))
			blocked <- err
		}()
	}
	time.Sleep(20 * time.Millisecond) // let both block (the test passes either way)
	ranks[2].Abort(cause)
	for range 2 {
		select {
		case err := <-blocked:
			if !errors.Is(err, cause) {
				t.Fatalf("blocked rank returned %v, want the abort cause", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Abort did not release a rank blocked in PeerTensors")
		}
	}
	if _, err := pas[0].PeerTensors(b.New(backend.Float64, 2)); !errors.Is(err, cause) {
		t.Fatalf("PeerTensors after Abort returned %v", err)
	}
}

// Exchange hands every member every member's tensors, indexed [rank][i],
// round after round, and fails every member alike on a nil tensor or a
// different count.
func TestExchangeTensors(t *testing.T) {
	const W = 3
	b := cpu.New(backend.Float32)
	x, err := comm.NewExchange("expert", W, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	own := make([]backend.Tensor, W)
	for r := range own {
		own[r] = b.New(backend.Float32, r+1)
	}
	run := func(pass func(rank int) []backend.Tensor) ([][][]backend.Tensor, []error) {
		outs, errs := make([][][]backend.Tensor, W), make([]error, W)
		done := make(chan struct{})
		for r := range W {
			go func() {
				defer func() { done <- struct{}{} }()
				outs[r], errs[r] = x.Tensors(r, pass(r))
			}()
		}
		for range W {
			<-done
		}
		return outs, errs
	}
	for round := range 3 {
		outs, errs := run(func(r int) []backend.Tensor { return []backend.Tensor{own[r], own[(r+round)%W]} })
		for r := range W {
			if errs[r] != nil {
				t.Fatalf("round %d, rank %d: %v", round, r, errs[r])
			}
			for s := range W {
				if outs[r][s][0] != own[s] || outs[r][s][1] != own[(s+round)%W] {
					t.Fatalf("round %d: rank %d got rank %d's tensors wrong", round, r, s)
				}
			}
		}
	}
	_, errs := run(func(r int) []backend.Tensor { return own[:1+r%2] })
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "rank 1 passes 2 tensors, rank 0 passes 1") {
			t.Fatalf("rank %d: different counts gave %v", r, err)
		}
	}
	_, errs = run(func(r int) []backend.Tensor {
		if r == 2 {
			return []backend.Tensor{nil}
		}
		return own[:1]
	})
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "rank 2: tensor 0 is nil") {
			t.Fatalf("rank %d: a nil tensor gave %v", r, err)
		}
	}
	if _, err := x.Tensors(W, nil); err == nil || !strings.Contains(err.Error(), "rank 3 of a group of 3") {
		t.Fatalf("rank out of range: %v", err)
	}
	if _, err := comm.NewExchange("expert", 0, 0); err == nil {
		t.Fatal("an exchange of 0 members was accepted")
	}
}

// A member that never arrives fails the others after the bound, naming
// it, and Abort fails the waiting members with the abort's reason.
func TestExchangeNeverHangs(t *testing.T) {
	b := cpu.New(backend.Float32)
	one := []backend.Tensor{b.New(backend.Float32, 1)}
	x, err := comm.NewExchange("expert", 3, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	for r := range 2 {
		go func() { _, err := x.Tensors(r, one); errs <- err }()
	}
	for range 2 {
		if err := <-errs; err == nil || !strings.Contains(err.Error(), "for ranks [2], which never arrived") {
			t.Fatalf("a missing member gave %v", err)
		}
	}
	// The exchange stays failed: the late member is told too.
	if _, err := x.Tensors(2, one); err == nil || !strings.Contains(err.Error(), "never arrived") {
		t.Fatalf("the late member got %v", err)
	}

	y, err := comm.NewExchange("expert", 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(20 * time.Millisecond)
		y.Abort(errors.New("rank 1's GPU failed"))
	}()
	if _, err := y.Tensors(0, one); err == nil || !strings.Contains(err.Error(), "rank 1's GPU failed") {
		t.Fatalf("Abort gave %v", err)
	}
}
