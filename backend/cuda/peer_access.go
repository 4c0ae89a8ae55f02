package cuda

// Peer access between the GPUs of one process: with it, a kernel on one GPU
// reads and writes another's allocations through their ordinary device
// addresses (unified addressing), over NVLink where the GPUs have it. The
// fused MoE ops take their peers' tensors that way, so the in-process NCCL
// groups offer comm.PeerAccess when asked (NCCLOptions.PeerAccess).

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/comm"
)

// EnablePeerAccess lets every backend's GPU address every other's memory.
// It fails, naming both GPUs, when a pair cannot map each other's memory,
// and does nothing for a pair that already can. Backends on one GPU (the
// same ordinal twice) are an error: they need no peer access.
func EnablePeerAccess(backends []*Backend) error {
	for i, b := range backends {
		if b == nil || b.dev == nil {
			return fmt.Errorf("cuda: EnablePeerAccess: backend %d is nil", i)
		}
		for j := range i {
			if backends[j].dev.info.Ordinal == b.dev.info.Ordinal {
				return fmt.Errorf("cuda: EnablePeerAccess: backends %d and %d are both on GPU %d", j, i, b.dev.info.Ordinal)
			}
		}
	}
	for _, b := range backends {
		d := b.dev
		err := d.Do(func() error {
			for _, p := range backends {
				if p == b {
					continue
				}
				can, err := d.drv.DeviceCanAccessPeer(d.dev, p.dev.dev)
				if err != nil {
					return err
				}
				if !can {
					return fmt.Errorf("GPU %d cannot map GPU %d's memory (cuDeviceCanAccessPeer: no NVLink or PCIe peer path)",
						d.info.Ordinal, p.dev.info.Ordinal)
				}
				if err := d.drv.CtxEnablePeerAccess(p.dev.ctx); err != nil && driver.Code(err) != driver.ErrorPeerAccessAlreadyEnabled {
					return fmt.Errorf("GPU %d to GPU %d: %w", d.info.Ordinal, p.dev.info.Ordinal, err)
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("cuda: peer access: %w", err)
		}
	}
	return nil
}

// NCCLPeerGroup is an NCCLGroup of one process whose ranks reach each
// other's tensors (comm.PeerAccess): NCCLRanks hands these out under
// NCCLOptions.PeerAccess, over groups NewNCCLGroups made with it. Its
// collectives are the NCCLGroup's. (Groups across processes,
// NCCLNodeRanks, never offer peer access.)
type NCCLPeerGroup struct {
	*NCCLGroup
}

var _ comm.PeerAccess = NCCLPeerGroup{}

// PeerTensors hands every rank every rank's tensors ([group rank][i], its
// own included) through the group's in-process exchange, then meets the
// peers on the GPUs (Barrier): every op a rank queued before the call is
// done before the call returns on any rank, so the peers' kernels queued
// after it read what the owner wrote. As comm.PeerAccess says, it orders
// nothing afterwards: a rank that writes a peer's tensor meets the peers
// again (Barrier) before the owner uses it. The tensors stay their
// owners' (on their GPUs); peer access lets this rank's kernels address
// them.
func (g NCCLPeerGroup) PeerTensors(ts ...backend.Tensor) ([][]backend.Tensor, error) {
	if err := g.usable(); err != nil {
		return nil, err
	}
	if g.state.exchange == nil {
		return nil, fmt.Errorf("comm: %s group PeerTensors: the group was made without NCCLOptions.PeerAccess", g.name)
	}
	for i, t := range ts {
		if _, ok := t.(*Tensor); t != nil && !ok {
			// The exchange fails every rank alike on a nil tensor; a
			// tensor of another backend kind is this rank's error only,
			// so it aborts the group rather than leave the peers waiting.
			err := fmt.Errorf("comm: %s group PeerTensors: rank %d's tensor %d is a %T, not a CUDA tensor", g.name, g.rank, i, t)
			g.Abort(err)
			return nil, err
		}
	}
	all, err := g.state.exchange.Tensors(g.rank, ts)
	if err != nil {
		return nil, err
	}
	if err := g.Barrier(); err != nil {
		return nil, err
	}
	return all, nil
}
