package cuda

// Memory is the GPU's total bytes and those a run may use: what the
// driver reports free, plus what this device's caching allocator holds
// (live buffers, such as cuBLASLt's workspace, which the memory plan
// counts itself, and cached ones). It is registry.MemoryReporter.
func (b *Backend) Memory() (total, usable int64, err error) {
	var free int64
	err = b.dev.Do(func() error {
		var err error
		free, total, err = b.dev.drv.MemGetInfo()
		return err
	})
	if err != nil {
		return 0, 0, err
	}
	st := b.dev.AllocStats()
	return total, free + st.InUse + st.Cached + st.Pending, nil
}
