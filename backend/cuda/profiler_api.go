package cuda

// The CUDA profiler API on a device: `mktrain bench train` brackets its
// measured steps with StartProfiler and StopProfiler, so that
// `nsys profile --capture-range=cudaProfilerApi mktrain bench train ...`
// records those steps and not the model's building or the warmup.

// StartProfiler calls cuProfilerStart on the GPU's context, after the work
// queued so far has been handed to the driver.
func (b *Backend) StartProfiler() error {
	return b.dev.Do(func() error { return b.dev.drv.ProfilerStart() })
}

// StopProfiler calls cuProfilerStop, once the work queued so far has
// finished (so that it falls inside the recorded range).
func (b *Backend) StopProfiler() error {
	return b.dev.Do(func() error {
		if err := b.dev.drv.StreamSynchronize(b.dev.stream); err != nil {
			return err
		}
		return b.dev.drv.ProfilerStop()
	})
}
