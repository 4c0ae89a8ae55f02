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

// TestExConfig checks that a launch's configuration carries the grid,
// block, shared bytes, stream and the attributes asked for: a cluster
// dimension, programmatic stream serialization, both or none.
func TestExConfig(t *testing.T) {
	for _, o := range []LaunchOptions{{}, {Cluster: Dim3{2, 1, 1}}, {Overlap: true}, {Cluster: Dim3{2, 1, 1}, Overlap: true}} {
		var attrs [2]launchAttribute
		cfg := exConfig(Dim3{132, 1, 1}, Dim3{384, 1, 1}, 197632, Stream(0x1234), o, &attrs)
		if cfg.gridX != 132 || cfg.gridY != 1 || cfg.blockX != 384 || cfg.sharedBytes != 197632 || cfg.stream != 0x1234 {
			t.Errorf("%+v: config %+v", o, cfg)
		}
		var want []uint32
		if o.Cluster.X > 0 {
			want = append(want, launchAttrClusterDimension)
		}
		if o.Overlap {
			want = append(want, launchAttrProgrammaticStreamSerialization)
		}
		if int(cfg.numAttrs) != len(want) || (len(want) == 0) != (cfg.attrs == nil) {
			t.Fatalf("%+v: %d attributes at %p, want %d", o, cfg.numAttrs, cfg.attrs, len(want))
		}
		for i, id := range want {
			a := attrs[i]
			if a.id != id {
				t.Errorf("%+v: attribute %d has id %d, want %d", o, i, a.id, id)
			}
			switch id {
			case launchAttrClusterDimension:
				if dims := *(*[3]uint32)(unsafe.Pointer(&a.value[0])); dims != [3]uint32{2, 1, 1} {
					t.Errorf("cluster dims %v, want [2 1 1]", dims)
				}
			case launchAttrProgrammaticStreamSerialization:
				if v := *(*int32)(unsafe.Pointer(&a.value[0])); v != 1 {
					t.Errorf("programmatic stream serialization %d, want 1", v)
				}
			}
		}
	}
}
