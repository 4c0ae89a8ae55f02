package registry

// MemoryReporter is an optional capability of a Device: its memory, for
// the engine's memory plan (package plan), which refuses a run that
// cannot fit before anything large is allocated.
type MemoryReporter interface {
	// Memory is the device's total bytes and those a run may use: what
	// the driver reports free now, plus what the backend's own allocator
	// holds (its live buffers, counted in the plan, and its cache).
	Memory() (total, usable int64, err error)
}
