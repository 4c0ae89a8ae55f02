package plan

// Devices by name, for planning a run on a machine other than this one
// (`mktrain plan --device h200`).

import (
	"fmt"
	"slices"
	"strings"
)

// CUDAContextReserve is the memory of a GPU a run cannot have for its
// tensors: the CUDA context, the loaded kernel modules and cuBLASLt's
// handle, which the driver holds before the first allocation (about 1.1
// GiB on an H200 with driver 580 once mktrain's backend is open: 139.3
// GiB of its 140.4 GiB were free or held by mktrain's allocator). A named
// device offers its total less this; a GPU the engine opened offers what
// the driver reports free plus what mktrain's allocator holds.
const CUDAContextReserve = 1280 << 20

// namedGPU is a GPU the plan knows by name: its memory as the driver
// reports it (nvidia-smi's memory.total) and its dense bf16 peak.
type namedGPU struct {
	name   string
	full   string
	memory int64
	flops  float64
}

var namedGPUs = []namedGPU{
	{"h200", "NVIDIA H200", 143771 << 20, 989e12},
	{"h100", "NVIDIA H100 80GB HBM3", 81559 << 20, 989e12},
}

// DeviceNames lists the names NamedDevice takes.
func DeviceNames() []string {
	names := []string{"cpu"}
	for _, g := range namedGPUs {
		names = append(names, g.name)
	}
	return names
}

// NamedDevice is the device called name: "cpu" (this machine's host
// memory, HostMemory) or a GPU of DeviceNames ("h200"), whose memory is
// its total less CUDAContextReserve.
func NamedDevice(name string) (Device, error) {
	n := strings.ToLower(strings.TrimSpace(name))
	if n == "cpu" {
		return CPUDevice(4)
	}
	for _, g := range namedGPUs {
		if g.name == n {
			return CUDADevice(g.full, g.memory-CUDAContextReserve, g.flops), nil
		}
	}
	return Device{}, fmt.Errorf("unknown device %q; the plan knows %s (or give --memory SIZE)", name, strings.Join(DeviceNames(), ", "))
}

// CUDADevice is a GPU of the CUDA backend that offers memory bytes to a
// run (0: unknown).
func CUDADevice(name string, memory int64, peakFLOPs float64) Device {
	return Device{Name: name, Backend: BackendCUDA, Memory: memory, FloatBytes: 4, OperandBytes: 2, PeakFLOPs: peakFLOPs,
		FineClassesAbove: CUDAFineClassesAbove}
}

// CPUDevice is the CPU backend in float type of floatBytes bytes (4 or
// 8), on this machine's host memory (HostMemory's total).
func CPUDevice(floatBytes int) (Device, error) {
	d := Device{Name: "host", Backend: BackendCPU, FloatBytes: floatBytes, OperandBytes: floatBytes}
	total, _, err := HostMemory()
	if err != nil {
		return d, err
	}
	d.Memory = total
	return d, nil
}

// IsNamedDevice reports whether name is one of DeviceNames.
func IsNamedDevice(name string) bool {
	return slices.Contains(DeviceNames(), strings.ToLower(strings.TrimSpace(name)))
}
