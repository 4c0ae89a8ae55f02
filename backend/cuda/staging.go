package cuda

import (
	"errors"
	"unsafe"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// Small uploads (the MoE layers' per-step vectors, a batch's token ids)
// pass through a ring of page-locked slots: a copy from page-locked
// memory is a plain DMA in stream order, while one from pageable memory
// goes through the driver's staging path, which measured about 0.19 ms a
// copy on the stream inside a training step. A slot is reused only after
// the event recorded behind its last copy has completed.
const (
	stagingSlotBytes = 64 << 10
	stagingSlots     = 16
	// eventDisableTiming is CU_EVENT_DISABLE_TIMING: the cheapest event,
	// for ordering only.
	eventDisableTiming = 2
)

// stagingRing is the device's page-locked upload slots. It is touched only
// on the device thread.
type stagingRing struct {
	host   []byte // stagingSlots * stagingSlotBytes, from MemAllocHost; nil until first use
	events []driver.Event
	used   []bool // events[i] has been recorded
	next   int
}

// stage copies src (at most stagingSlotBytes) into the next slot and
// queues its copy to p on the stream; it runs on the device thread.
func (d *Device) stage(p driver.DevicePtr, src []byte) error {
	r := &d.staging
	if r.host == nil {
		host, err := d.drv.MemAllocHost(stagingSlots * stagingSlotBytes)
		if err != nil {
			return err
		}
		r.host = host
		r.events = make([]driver.Event, stagingSlots)
		r.used = make([]bool, stagingSlots)
		for i := range r.events {
			if r.events[i], err = d.drv.EventCreate(eventDisableTiming); err != nil {
				return err
			}
		}
	}
	i := r.next
	r.next = (r.next + 1) % stagingSlots
	if r.used[i] {
		if err := d.drv.EventSynchronize(r.events[i]); err != nil {
			return err
		}
	}
	slot := r.host[i*stagingSlotBytes : i*stagingSlotBytes+len(src)]
	copy(slot, src)
	if err := d.drv.MemcpyHtoDAsync(p, unsafe.Pointer(&slot[0]), len(slot), d.stream); err != nil {
		return err
	}
	if err := d.drv.EventRecord(r.events[i], d.stream); err != nil {
		return err
	}
	r.used[i] = true
	return nil
}

// release frees the ring; it runs on the device thread after the stream
// has drained.
func (r *stagingRing) release(drv *driver.Driver) error {
	var errs []error
	for _, e := range r.events {
		if e != 0 {
			errs = append(errs, drv.EventDestroy(e))
		}
	}
	if r.host != nil {
		errs = append(errs, drv.MemFreeHost(r.host))
	}
	*r = stagingRing{}
	return errors.Join(errs...)
}
