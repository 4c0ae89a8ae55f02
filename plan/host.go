package plan

// Host memory: what a process needs besides a CPU run's tensors, and
// what the machine has.

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// hostTerms are the process's host transients, each at its own time
// (initialisation before the first step, a snapshot at a save), so the
// peak counts the larger:
//
//   - engine/params.go's initParam fills one parameter tensor at a time
//     from a []float64 on the host, which the CUDA backend's Upload
//     rounds into a []float32 first (backend/cuda/backend_tensor.go): 8
//     (CPU) or 12 (GPU) bytes per element of the largest tensor (the
//     embedding or LM head [V, D], or a layer's stacked experts).
//   - engine/checkpointing.go's snapshot downloads the weights and both
//     moments of every tensor the process writes as []float32 and keeps
//     them until the save is written (in the background with
//     checkpoint.async): 12 bytes per parameter; world rank 0 receives
//     the other processes' shares, so its process holds the whole model.
func hostTerms(s shape, p Params, checkpoints bool) []Term {
	largest := max(mul(s.V, s.D), mul(s.El, s.F, s.D), mul(s.Q, s.D), mul(s.Fs, s.D))
	perElem := int64(8)
	if s.cuda {
		perElem = 12
	}
	terms := []Term{{Kind: Host, What: "initialisation (transient)", Bytes: mul(largest, perElem)}}
	if checkpoints {
		terms = append(terms, Term{Kind: Host, What: "checkpoint snapshot (transient)", Bytes: mul(p.Total, 12)})
	}
	for i := range terms {
		terms[i].Worst = terms[i].Bytes
	}
	return terms
}

// hostPeak is the largest of the transients, which never coincide.
func hostPeak(terms []Term) int64 {
	peak := int64(0)
	for _, t := range terms {
		peak = max(peak, t.Bytes)
	}
	return peak
}

// HostMemory is the memory this process may use: /proc/meminfo's
// MemTotal, or the cgroup's limit (memory.max) when that is lower, and
// MemAvailable, what is free now without swapping. It fails where
// /proc/meminfo cannot be read (not Linux).
func HostMemory() (total, available int64, err error) {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, fmt.Errorf("host memory: %w", err)
	}
	total, available, err = parseMeminfo(data)
	if err != nil {
		return 0, 0, err
	}
	if limit, ok := cgroupLimit(); ok && limit < total {
		total = limit
		available = min(available, limit)
	}
	return total, available, nil
}

// parseMeminfo reads MemTotal and MemAvailable (kB) from /proc/meminfo's
// text; MemAvailable is MemTotal where the kernel does not give it.
func parseMeminfo(data []byte) (total, available int64, err error) {
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		key, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		kb, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			continue
		}
		switch key {
		case "MemTotal":
			total = mul(kb, 1024)
		case "MemAvailable":
			available = mul(kb, 1024)
		}
	}
	if total <= 0 {
		return 0, 0, fmt.Errorf("host memory: /proc/meminfo has no MemTotal")
	}
	if available <= 0 {
		available = total
	}
	return total, available, nil
}

// cgroupLimit is the cgroup v2 memory limit of this process, where one is
// set ("max" is none).
func cgroupLimit() (int64, bool) {
	data, err := os.ReadFile("/sys/fs/cgroup/memory.max")
	if err != nil {
		return 0, false
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil || v <= 0 {
		return 0, false
	}
	return v, true
}
