package driver

import (
	"errors"
	"runtime"
	"unsafe"
)

// Thread-block clusters (sm_90): a launch whose blocks come in groups of
// cluster.X x cluster.Y x cluster.Z, each group scheduled together on one
// GPC, so its blocks can read and write each other's shared memory, arrive
// on each other's mbarriers and receive one TMA load multicast to all of
// them. cuLaunchKernel cannot ask for that; cuLaunchKernelEx takes it as a
// launch attribute.

// launchAttrClusterDimension is CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION.
const launchAttrClusterDimension = 4

// launchAttrProgrammaticStreamSerialization is
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (programmatic
// dependent launch, sm_90): with its value's first int 1, the kernel may
// start before the previous kernel on the stream has ended, once every
// block of that one has run griddepcontrol.launch_dependents or ended; the
// kernel's griddepcontrol.wait waits for the previous one to end and its
// writes to be visible.
const launchAttrProgrammaticStreamSerialization = 6

// launchAttribute is CUlaunchAttribute: the id, padding to 8 bytes and the
// 64-byte CUlaunchAttributeValue union, whose clusterDim member is three
// unsigned ints at its start and programmaticStreamSerializationAllowed
// one int.
type launchAttribute struct {
	id    uint32
	_     uint32
	value [64]byte
}

// launchConfig is CUlaunchConfig: the grid and block sizes and the shared
// bytes (seven unsigned ints, padded to 8), the stream, the attribute
// array and its length (padded to 8).
type launchConfig struct {
	gridX, gridY, gridZ    uint32
	blockX, blockY, blockZ uint32
	sharedBytes            uint32
	_                      uint32
	stream                 Stream
	attrs                  *launchAttribute
	numAttrs               uint32
	_                      uint32
}

// LaunchOptions are the cuLaunchKernelEx attributes a launch asks for.
type LaunchOptions struct {
	// Cluster, when X is not 0, launches the grid in thread-block clusters
	// of this shape (each grid dimension a multiple of the cluster's).
	Cluster Dim3
	// Overlap lets the kernel start while the previous kernel on the
	// stream still runs (launchAttrProgrammaticStreamSerialization).
	Overlap bool
}

// errNoClusterLaunch is the error of a cluster call on a driver without
// cuLaunchKernelEx or cuOccupancyMaxActiveClusters (before CUDA 12.0).
var errNoClusterLaunch = errors.New("cuda: this driver cannot launch thread-block clusters (cuLaunchKernelEx needs CUDA 12.0 or later)")

// exConfig builds the launch configuration with o's attributes in attrs;
// the caller keeps attrs alive (and pinned) across the call.
func exConfig(grid, block Dim3, sharedBytes int, s Stream, o LaunchOptions, attrs *[2]launchAttribute) launchConfig {
	n := 0
	if o.Cluster.X > 0 {
		attrs[n].id = launchAttrClusterDimension
		dims := (*[3]uint32)(unsafe.Pointer(&attrs[n].value[0]))
		dims[0], dims[1], dims[2] = uint32(o.Cluster.X), uint32(o.Cluster.Y), uint32(o.Cluster.Z)
		n++
	}
	if o.Overlap {
		attrs[n].id = launchAttrProgrammaticStreamSerialization
		*(*int32)(unsafe.Pointer(&attrs[n].value[0])) = 1
		n++
	}
	cfg := launchConfig{
		gridX: uint32(grid.X), gridY: uint32(grid.Y), gridZ: uint32(grid.Z),
		blockX: uint32(block.X), blockY: uint32(block.Y), blockZ: uint32(block.Z),
		sharedBytes: uint32(sharedBytes), stream: s, numAttrs: uint32(n),
	}
	if n > 0 {
		cfg.attrs = &attrs[0]
	}
	return cfg
}

// pinnedExConfig is exConfig on the heap, the configuration and its
// attributes pinned by pin (the driver reads both through pointers).
func pinnedExConfig(pin *runtime.Pinner, grid, block Dim3, sharedBytes int, s Stream, o LaunchOptions) *launchConfig {
	attrs := new([2]launchAttribute)
	pin.Pin(attrs)
	cfg := new(launchConfig)
	*cfg = exConfig(grid, block, sharedBytes, s, o, attrs)
	pin.Pin(cfg)
	return cfg
}

// CanLaunchEx says whether the driver has cuLaunchKernelEx (CUDA 12.0 on),
// which LaunchKernelEx needs.
func (d *Driver) CanLaunchEx() bool { return d.fn.launchKernelEx != 0 }

// LaunchKernelEx is cuLaunchKernelEx: LaunchKernel with o's attributes.
// params is as LaunchKernel's.
func (d *Driver) LaunchKernelEx(f Function, grid, block Dim3, sharedBytes int, s Stream, params []unsafe.Pointer, o LaunchOptions) error {
	if !d.CanLaunchEx() {
		return errNoClusterLaunch
	}
	var pin runtime.Pinner
	defer pin.Unpin()
	cfg := pinnedExConfig(&pin, grid, block, sharedBytes, s, o)
	r := d.call(d.fn.launchKernelEx, uintptr(unsafe.Pointer(cfg)), uintptr(f),
		uintptr(unsafe.Pointer(unsafe.SliceData(params))), 0)
	runtime.KeepAlive(params)
	if r != Success {
		return d.check(r, "cuLaunchKernelEx(grid %dx%dx%d, clusters of %dx%dx%d, block %dx%dx%d, %d shared bytes, overlap %v)",
			grid.X, grid.Y, grid.Z, o.Cluster.X, o.Cluster.Y, o.Cluster.Z, block.X, block.Y, block.Z, sharedBytes, o.Overlap)
	}
	return nil
}

// LaunchKernelCluster is LaunchKernelEx with a cluster dimension alone.
func (d *Driver) LaunchKernelCluster(f Function, grid, block, cluster Dim3, sharedBytes int, s Stream, params []unsafe.Pointer) error {
	return d.LaunchKernelEx(f, grid, block, sharedBytes, s, params, LaunchOptions{Cluster: cluster})
}

// MaxActiveClusters is cuOccupancyMaxActiveClusters: how many clusters of
// cluster blocks (block threads, sharedBytes each) the device can hold at
// once, the size of a persistent cluster grid. grid must be a multiple of
// cluster; it does not change the answer.
func (d *Driver) MaxActiveClusters(f Function, grid, block, cluster Dim3, sharedBytes int) (int, error) {
	if d.fn.occupancyMaxActiveClusters == 0 {
		return 0, errNoClusterLaunch
	}
	var pin runtime.Pinner
	defer pin.Unpin()
	cfg := pinnedExConfig(&pin, grid, block, sharedBytes, 0, LaunchOptions{Cluster: cluster})
	var n int32
	r := d.call(d.fn.occupancyMaxActiveClusters, uintptr(unsafe.Pointer(&n)), uintptr(f), uintptr(unsafe.Pointer(cfg)))
	return int(n), d.check(r, "cuOccupancyMaxActiveClusters(clusters of %dx%dx%d, block %dx%dx%d, %d shared bytes)",
		cluster.X, cluster.Y, cluster.Z, block.X, block.Y, block.Z, sharedBytes)
}
