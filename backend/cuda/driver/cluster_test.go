package driver

import (
	"testing"
	"unsafe"
)

// TestLaunchConfigLayout checks the Go mirrors of CUlaunchConfig and
// CUlaunchAttribute against cuda.h's layout on 64-bit Linux, which the
// driver reads through the pointer cuLaunchKernelEx takes.
func TestLaunchConfigLayout(t *testing.T) {
	var c launchConfig
	var a launchAttribute
	for _, f := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(CUlaunchConfig)", unsafe.Sizeof(c), 56},
		{"CUlaunchConfig.sharedMemBytes", unsafe.Offsetof(c.sharedBytes), 24},
		{"CUlaunchConfig.hStream", unsafe.Offsetof(c.stream), 32},
		{"CUlaunchConfig.attrs", unsafe.Offsetof(c.attrs), 40},
		{"CUlaunchConfig.numAttrs", unsafe.Offsetof(c.numAttrs), 48},
		{"sizeof(CUlaunchAttribute)", unsafe.Sizeof(a), 72},
		{"CUlaunchAttribute.value", unsafe.Offsetof(a.value), 8},
	} {
		if f.got != f.want {
			t.Errorf("%s = %d, want %d", f.name, f.got, f.want)
		}
	}
}

// TestClusterConfig checks that a cluster launch's configuration carries
// the grid, block, shared bytes, stream and one cluster-dimension
// attribute.
func TestClusterConfig(t *testing.T) {
	var attr launchAttribute
	cfg := clusterConfig(Dim3{132, 1, 1}, Dim3{384, 1, 1}, Dim3{2, 1, 1}, 197632, Stream(0x1234), &attr)
	if cfg.gridX != 132 || cfg.gridY != 1 || cfg.blockX != 384 || cfg.sharedBytes != 197632 || cfg.stream != 0x1234 {
		t.Errorf("config %+v", cfg)
	}
	if cfg.attrs != &attr || cfg.numAttrs != 1 || attr.id != launchAttrClusterDimension {
		t.Errorf("attribute: %d of id %d", cfg.numAttrs, attr.id)
	}
	dims := *(*[3]uint32)(unsafe.Pointer(&attr.value[0]))
	if dims != [3]uint32{2, 1, 1} {
		t.Errorf("cluster dims %v, want [2 1 1]", dims)
	}
}
