package cuda

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// Downloads the host waits for later (Backend.StartDownload): the copy is
// queued on the stream into a page-locked slot with an event behind it,
// and the wait is for that event alone. A Download waits for the whole
// stream, so the GPU runs dry while the host reads the result and queues
// the next kernels; the MoE layers read their expert counts this way once
// per layer and pass.

// fetchSlotBytes is the most one queued download takes (the counts of up
// to 4096 experts); a larger one is a plain Download.
const fetchSlotBytes = 16 << 10

// fetchSlot is one queued download's page-locked memory and event.
type fetchSlot struct {
	host []byte
	ev   driver.Event
}

// fetchPool holds the slots, made on demand and reused; as many exist as
// downloads were ever in flight at once (one per MoE layer). It is touched
// only on the device thread.
type fetchPool struct {
	free, all []*fetchSlot
}

func (p *fetchPool) get(drv *driver.Driver) (*fetchSlot, error) {
	if n := len(p.free); n > 0 {
		s := p.free[n-1]
		p.free = p.free[:n-1]
		return s, nil
	}
	host, err := drv.MemAllocHost(fetchSlotBytes)
	if err != nil {
		return nil, err
	}
	ev, err := drv.EventCreate(eventDisableTiming)
	if err != nil {
		return nil, errors.Join(err, drv.MemFreeHost(host))
	}
	s := &fetchSlot{host: host, ev: ev}
	p.all = append(p.all, s)
	return s, nil
}

func (p *fetchPool) release(drv *driver.Driver) error {
	var errs []error
	for _, s := range p.all {
		errs = append(errs, drv.EventDestroy(s.ev), drv.MemFreeHost(s.host))
	}
	p.free, p.all = nil, nil
	return errors.Join(errs...)
}

// StartCopyFromDevice queues a copy of n bytes of src, from offset on,
// behind the work queued before it, and returns at once (n at most
// fetchSlotBytes). Calling wait, once, waits for that copy alone and
// writes the bytes into dst (n long).
func (d *Device) StartCopyFromDevice(src *Buffer, offset int64, n int) (wait func(dst []byte) error, err error) {
	if err := src.span("StartCopyFromDevice", offset, int64(n)); err != nil {
		return nil, err
	}
	if n > fetchSlotBytes {
		return nil, fmt.Errorf("cuda: StartCopyFromDevice of %d bytes, more than a slot's %d", n, fetchSlotBytes)
	}
	p := src.ptr + driver.DevicePtr(offset)
	type queued struct {
		slot *fetchSlot
		err  error
	}
	got := make(chan queued, 1)
	queue := func() error {
		s, err := d.fetch.get(d.drv)
		if err == nil && n > 0 {
			err = d.drv.MemcpyDtoHAsync(unsafe.Pointer(&s.host[0]), p, n, d.stream)
		}
		if err == nil {
			err = d.drv.EventRecord(s.ev, d.stream)
		}
		if err != nil && s != nil {
			d.fetch.free = append(d.fetch.free, s)
			s = nil
		}
		got <- queued{s, err}
		return nil // the wait reports it
	}
	if err := d.Submit(queue); err != nil {
		return nil, err
	}
	return func(dst []byte) error {
		q := <-got
		if q.err != nil {
			return fmt.Errorf("cuda: queueing a download: %w", q.err)
		}
		return d.Do(func() error {
			defer func() { d.fetch.free = append(d.fetch.free, q.slot) }()
			if err := d.drv.EventSynchronize(q.slot.ev); err != nil {
				return err
			}
			copy(dst, q.slot.host[:n])
			return nil
		})
	}, nil
}
