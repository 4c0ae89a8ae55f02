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

// launchAttribute is CUlaunchAttribute: the id, padding to 8 bytes and the
// 64-byte CUlaunchAttributeValue union, whose clusterDim member is three
// unsigned ints at its start.
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

// errNoClusterLaunch is the error of a cluster call on a driver without
// cuLaunchKernelEx or cuOccupancyMaxActiveClusters (before CUDA 12.0).
var errNoClusterLaunch = errors.New("cuda: this driver cannot launch thread-block clusters (cuLaunchKernelEx needs CUDA 12.0 or later)")

// clusterConfig builds the launch configuration for a cluster launch; the
// caller keeps attr alive (and pinned) across the call.
func clusterConfig(grid, block, cluster Dim3, sharedBytes int, s Stream, attr *launchAttribute) launchConfig {
	attr.id = launchAttrClusterDimension
	dims := (*[3]uint32)(unsafe.Pointer(&attr.value[0]))
	dims[0], dims[1], dims[2] = uint32(cluster.X), uint32(cluster.Y), uint32(cluster.Z)
	return launchConfig{
		gridX: uint32(grid.X), gridY: uint32(grid.Y), gridZ: uint32(grid.Z),
		blockX: uint32(block.X), blockY: uint32(block.Y), blockZ: uint32(block.Z),
		sharedBytes: uint32(sharedBytes), stream: s, attrs: attr, numAttrs: 1,
	}
}

// pinnedClusterConfig is clusterConfig on the heap, the configuration and
// its attribute pinned by pin (the driver reads both through pointers).
func pinnedClusterConfig(pin *runtime.Pinner, grid, block, cluster Dim3, sharedBytes int, s Stream) *launchConfig {
	attr := new(launchAttribute)
	pin.Pin(attr)
	cfg := new(launchConfig)
	*cfg = clusterConfig(grid, block, cluster, sharedBytes, s, attr)
	pin.Pin(cfg)
	return cfg
}

// LaunchKernelCluster is cuLaunchKernelEx with a cluster dimension: grid
// blocks in clusters of cluster (each grid dimension a multiple of the
// cluster's). params is as LaunchKernel's.
func (d *Driver) LaunchKernelCluster(f Function, grid, block, cluster Dim3, sharedBytes int, s Stream, params []unsafe.Pointer) error {
	if d.fn.launchKernelEx == 0 {
		return errNoClusterLaunch
	}
	var pin runtime.Pinner
	defer pin.Unpin()
	cfg := pinnedClusterConfig(&pin, grid, block, cluster, sharedBytes, s)
	r := d.call(d.fn.launchKernelEx, uintptr(unsafe.Pointer(cfg)), uintptr(f),
		uintptr(unsafe.Pointer(unsafe.SliceData(params))), 0)
	runtime.KeepAlive(params)
	if r != Success {
		return d.check(r, "cuLaunchKernelEx(grid %dx%dx%d in clusters of %dx%dx%d, block %dx%dx%d, %d shared bytes)",
			grid.X, grid.Y, grid.Z, cluster.X, cluster.Y, cluster.Z, block.X, block.Y, block.Z, sharedBytes)
	}
	return nil
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
	cfg := pinnedClusterConfig(&pin, grid, block, cluster, sharedBytes, 0)
	var n int32
	r := d.call(d.fn.occupancyMaxActiveClusters, uintptr(unsafe.Pointer(&n)), uintptr(f), uintptr(unsafe.Pointer(cfg)))
	return int(n), d.check(r, "cuOccupancyMaxActiveClusters(clusters of %dx%dx%d, block %dx%dx%d, %d shared bytes)",
		cluster.X, cluster.Y, cluster.Z, block.X, block.Y, block.Z, sharedBytes)
}
