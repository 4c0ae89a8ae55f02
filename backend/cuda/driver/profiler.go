package driver

// The CUDA profiler API (cudaProfiler.h): cuProfilerStart and cuProfilerStop
// mark the stretch a profiler records when it is started with a capture
// range (`nsys profile --capture-range=cudaProfilerApi`); without a
// profiler attached they do nothing. They are looked up when called, not
// in LoadDriver, so that a driver without them still trains.

import "fmt"

// ProfilerStart is cuProfilerStart: a profiler attached with a capture
// range starts recording the current context's work. It needs a current
// context.
func (d *Driver) ProfilerStart() error { return d.profilerCall("cuProfilerStart") }

// ProfilerStop is cuProfilerStop: the capture range ends.
func (d *Driver) ProfilerStop() error { return d.profilerCall("cuProfilerStop") }

func (d *Driver) profilerCall(name string) error {
	fn, err := d.lib.Symbol(name)
	if err != nil {
		return fmt.Errorf("cuda: the profiler API: %w", err)
	}
	return d.check(d.call(fn), "%s", name)
}
