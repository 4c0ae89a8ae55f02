package driver

// The CUDA driver API (libcuda.so.1), called through purego.SyscallN: no
// cgo, and about 0.1 us a call. SyscallN is go:uintptrescapes, so a Go
// pointer converted to uintptr in its argument list stays alive and in place
// for the call; arrays of pointers handed to C are pinned by the callers.

import (
	"fmt"
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Handles the driver returns. They are opaque C pointers (or, for Device,
// an ordinal-like int) and mean nothing outside the context that made them.
type (
	Device    int32
	Context   uintptr
	Stream    uintptr
	Event     uintptr
	Module    uintptr
	Function  uintptr
	DevicePtr uint64
)

// DeviceAttribute is a CUdevice_attribute.
type DeviceAttribute int32

const (
	AttrMaxThreadsPerBlock        DeviceAttribute = 1
	AttrWarpSize                  DeviceAttribute = 10
	AttrClockRateKHz              DeviceAttribute = 13
	AttrMultiprocessorCount       DeviceAttribute = 16
	AttrMemoryClockRateKHz        DeviceAttribute = 36
	AttrGlobalMemoryBusWidth      DeviceAttribute = 37
	AttrL2CacheSize               DeviceAttribute = 38
	AttrComputeCapabilityMajor    DeviceAttribute = 75
	AttrComputeCapabilityMinor    DeviceAttribute = 76
	AttrMaxSharedMemoryPerBlockIn DeviceAttribute = 97 // opt-in limit
)

// FunctionAttribute is a CUfunction_attribute.
type FunctionAttribute int32

const (
	FuncMaxThreadsPerBlock      FunctionAttribute = 0
	FuncSharedSizeBytes         FunctionAttribute = 1
	FuncLocalSizeBytes          FunctionAttribute = 3
	FuncNumRegs                 FunctionAttribute = 4
	FuncMaxDynamicSharedSizeOpt FunctionAttribute = 8
)

// StreamNonBlocking makes a stream that does not synchronize with the
// legacy default stream (CU_STREAM_NON_BLOCKING).
const StreamNonBlocking = 1

// Driver is libcuda's function table. Its methods are thin: one C call
// each, its CUresult turned into an *Error that names the call. Calls that
// need a context must run on the OS thread where that context is current.
type Driver struct {
	lib *Library
	fn  struct {
		init, driverGetVersion                                       uintptr
		deviceGetCount, deviceGet, deviceGetName, deviceGetAttribute uintptr
		deviceTotalMem                                               uintptr
		primaryCtxRetain, primaryCtxRelease                          uintptr
		ctxSetCurrent, ctxSynchronize                                uintptr
		deviceCanAccessPeer, ctxEnablePeerAccess                     uintptr
		streamCreate, streamDestroy, streamSynchronize, streamQuery  uintptr
		eventCreate, eventDestroy, eventRecord, eventSynchronize     uintptr
		streamWaitEvent                                              uintptr
		eventElapsedTime                                             uintptr
		memAlloc, memFree, memAllocHost, memFreeHost, memGetInfo     uintptr
		memcpyHtoD, memcpyDtoH                                       uintptr
		memcpyHtoDAsync, memcpyDtoHAsync, memcpyDtoDAsync            uintptr
		memsetD32Async, memsetD8Async                                uintptr
		moduleLoadData, moduleUnload, moduleGetFunction              uintptr
		funcGetAttribute, funcSetAttribute, launchKernel             uintptr
		getErrorName, getErrorString                                 uintptr
		// Cluster launches (CUDA 12.0 on): zero where the driver lacks
		// them, which LaunchKernelCluster reports.
		launchKernelEx, occupancyMaxActiveClusters uintptr
	}
}

// LoadDriver finds and opens libcuda, resolves every symbol the backend
// uses and calls cuInit(0).
func (s Search) LoadDriver() (*Driver, error) {
	lib, err := s.Open(LibCUDA)
	if err != nil {
		return nil, err
	}
	d := &Driver{lib: lib}
	f := &d.fn
	err = lib.symbols(map[string]*uintptr{
		"cuInit":                       &f.init,
		"cuDriverGetVersion":           &f.driverGetVersion,
		"cuDeviceGetCount":             &f.deviceGetCount,
		"cuDeviceGet":                  &f.deviceGet,
		"cuDeviceGetName":              &f.deviceGetName,
		"cuDeviceGetAttribute":         &f.deviceGetAttribute,
		"cuDeviceTotalMem_v2":          &f.deviceTotalMem,
		"cuDevicePrimaryCtxRetain":     &f.primaryCtxRetain,
		"cuDevicePrimaryCtxRelease_v2": &f.primaryCtxRelease,
		"cuCtxSetCurrent":              &f.ctxSetCurrent,
		"cuCtxSynchronize":             &f.ctxSynchronize,
		"cuDeviceCanAccessPeer":        &f.deviceCanAccessPeer,
		"cuCtxEnablePeerAccess":        &f.ctxEnablePeerAccess,
		"cuStreamCreate":               &f.streamCreate,
		"cuStreamDestroy_v2":           &f.streamDestroy,
		"cuStreamSynchronize":          &f.streamSynchronize,
		"cuStreamQuery":                &f.streamQuery,
		"cuEventCreate":                &f.eventCreate,
		"cuEventDestroy_v2":            &f.eventDestroy,
		"cuEventRecord":                &f.eventRecord,
		"cuEventSynchronize":           &f.eventSynchronize,
		"cuStreamWaitEvent":            &f.streamWaitEvent,
		"cuMemAlloc_v2":                &f.memAlloc,
		"cuMemFree_v2":                 &f.memFree,
		"cuMemAllocHost_v2":            &f.memAllocHost,
		"cuMemFreeHost":                &f.memFreeHost,
		"cuMemGetInfo_v2":              &f.memGetInfo,
		"cuMemcpyHtoD_v2":              &f.memcpyHtoD,
		"cuMemcpyDtoH_v2":              &f.memcpyDtoH,
		"cuMemcpyHtoDAsync_v2":         &f.memcpyHtoDAsync,
		"cuMemcpyDtoHAsync_v2":         &f.memcpyDtoHAsync,
		"cuMemcpyDtoDAsync_v2":         &f.memcpyDtoDAsync,
		"cuMemsetD32Async":             &f.memsetD32Async,
		"cuMemsetD8Async":              &f.memsetD8Async,
		"cuModuleLoadData":             &f.moduleLoadData,
		"cuModuleUnload":               &f.moduleUnload,
		"cuModuleGetFunction":          &f.moduleGetFunction,
		"cuFuncGetAttribute":           &f.funcGetAttribute,
		"cuFuncSetAttribute":           &f.funcSetAttribute,
		"cuLaunchKernel":               &f.launchKernel,
		"cuGetErrorName":               &f.getErrorName,
		"cuGetErrorString":             &f.getErrorString,
	})
	if err != nil {
		return nil, err
	}
	// CUDA 12.8 added cuEventElapsedTime_v2 (same signature); CUDA 13
	// headers map the plain name to it. Take whichever the driver has.
	if f.eventElapsedTime, err = lib.Symbol("cuEventElapsedTime_v2"); err != nil {
		if f.eventElapsedTime, err = lib.Symbol("cuEventElapsedTime"); err != nil {
			return nil, err
		}
	}
	// Optional: only the cluster launches need them.
	f.launchKernelEx, _ = lib.Symbol("cuLaunchKernelEx")
	f.occupancyMaxActiveClusters, _ = lib.Symbol("cuOccupancyMaxActiveClusters")
	if err := d.check(d.call(f.init, 0), "cuInit(0)"); err != nil {
		return nil, fmt.Errorf("%w (library %s)", err, lib.Path)
	}
	return d, nil
}

// Path is the libcuda file that was loaded.
func (d *Driver) Path() string { return d.lib.Path }

// Library is the loaded libcuda and where it was found.
func (d *Driver) Library() *Library { return d.lib }

// call is go:uintptrescapes like SyscallN itself: a pointer converted to
// uintptr in the argument list of a call to it is moved to the heap and kept
// alive until it returns, so stack copying cannot move what C is writing to.
//
//go:uintptrescapes
func (d *Driver) call(fn uintptr, args ...uintptr) Result {
	r, _, _ := purego.SyscallN(fn, args...)
	return Result(int32(r))
}

// check turns a CUresult into an *Error naming the call; the call text is
// formatted only on failure.
func (d *Driver) check(r Result, format string, args ...any) error {
	if r == Success {
		return nil
	}
	return &Error{Call: fmt.Sprintf(format, args...), Code: r, Name: d.ErrorName(r), Text: d.ErrorString(r)}
}

// ErrorName is cuGetErrorName, e.g. "CUDA_ERROR_OUT_OF_MEMORY".
func (d *Driver) ErrorName(r Result) string {
	var p uintptr
	if d.call(d.fn.getErrorName, uintptr(r), uintptr(unsafe.Pointer(&p))) != Success || p == 0 {
		return fmt.Sprintf("CUresult %d", int32(r))
	}
	return cString(p)
}

// ErrorString is cuGetErrorString, e.g. "out of memory".
func (d *Driver) ErrorString(r Result) string {
	var p uintptr
	if d.call(d.fn.getErrorString, uintptr(r), uintptr(unsafe.Pointer(&p))) != Success || p == 0 {
		return "unknown error"
	}
	return cString(p)
}

// Version is cuDriverGetVersion: 1000*major + 10*minor, e.g. 13000.
func (d *Driver) Version() (int, error) {
	var v int32
	r := d.call(d.fn.driverGetVersion, uintptr(unsafe.Pointer(&v)))
	return int(v), d.check(r, "cuDriverGetVersion")
}

// DeviceCount is cuDeviceGetCount.
func (d *Driver) DeviceCount() (int, error) {
	var n int32
	r := d.call(d.fn.deviceGetCount, uintptr(unsafe.Pointer(&n)))
	return int(n), d.check(r, "cuDeviceGetCount")
}

// DeviceGet is cuDeviceGet.
func (d *Driver) DeviceGet(ordinal int) (Device, error) {
	var dev int32
	r := d.call(d.fn.deviceGet, uintptr(unsafe.Pointer(&dev)), uintptr(ordinal))
	return Device(dev), d.check(r, "cuDeviceGet(%d)", ordinal)
}

// DeviceName is cuDeviceGetName.
func (d *Driver) DeviceName(dev Device) (string, error) {
	buf := make([]byte, 256)
	r := d.call(d.fn.deviceGetName, uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), uintptr(dev))
	if err := d.check(r, "cuDeviceGetName(device %d)", dev); err != nil {
		return "", err
	}
	n := 0
	for n < len(buf) && buf[n] != 0 {
		n++
	}
	return string(buf[:n]), nil
}

// DeviceAttribute is cuDeviceGetAttribute.
func (d *Driver) DeviceAttribute(dev Device, a DeviceAttribute) (int, error) {
	var v int32
	r := d.call(d.fn.deviceGetAttribute, uintptr(unsafe.Pointer(&v)), uintptr(a), uintptr(dev))
	return int(v), d.check(r, "cuDeviceGetAttribute(attribute %d, device %d)", a, dev)
}

// DeviceTotalMem is cuDeviceTotalMem_v2, in bytes.
func (d *Driver) DeviceTotalMem(dev Device) (int64, error) {
	var n uint64
	r := d.call(d.fn.deviceTotalMem, uintptr(unsafe.Pointer(&n)), uintptr(dev))
	return int64(n), d.check(r, "cuDeviceTotalMem_v2(device %d)", dev)
}

// PrimaryCtxRetain is cuDevicePrimaryCtxRetain.
func (d *Driver) PrimaryCtxRetain(dev Device) (Context, error) {
	var c uintptr
	r := d.call(d.fn.primaryCtxRetain, uintptr(unsafe.Pointer(&c)), uintptr(dev))
	return Context(c), d.check(r, "cuDevicePrimaryCtxRetain(device %d)", dev)
}

// PrimaryCtxRelease is cuDevicePrimaryCtxRelease_v2.
func (d *Driver) PrimaryCtxRelease(dev Device) error {
	return d.check(d.call(d.fn.primaryCtxRelease, uintptr(dev)), "cuDevicePrimaryCtxRelease_v2(device %d)", dev)
}

// CtxSetCurrent is cuCtxSetCurrent: binds c to the calling OS thread.
func (d *Driver) CtxSetCurrent(c Context) error {
	return d.check(d.call(d.fn.ctxSetCurrent, uintptr(c)), "cuCtxSetCurrent")
}

// CtxSynchronize is cuCtxSynchronize.
func (d *Driver) CtxSynchronize() error {
	return d.check(d.call(d.fn.ctxSynchronize), "cuCtxSynchronize")
}

// DeviceCanAccessPeer is cuDeviceCanAccessPeer: whether dev can map
// peer's memory (over NVLink or PCIe).
func (d *Driver) DeviceCanAccessPeer(dev, peer Device) (bool, error) {
	var can int32
	r := d.call(d.fn.deviceCanAccessPeer, uintptr(unsafe.Pointer(&can)), uintptr(dev), uintptr(peer))
	return can != 0, d.check(r, "cuDeviceCanAccessPeer(device %d, peer %d)", dev, peer)
}

// CtxEnablePeerAccess is cuCtxEnablePeerAccess: the current context's
// kernels may then address peer's allocations. Enabling it twice is
// ErrorPeerAccessAlreadyEnabled.
func (d *Driver) CtxEnablePeerAccess(peer Context) error {
	return d.check(d.call(d.fn.ctxEnablePeerAccess, uintptr(peer), 0), "cuCtxEnablePeerAccess")
}

// StreamCreate is cuStreamCreate.
func (d *Driver) StreamCreate(flags uint32) (Stream, error) {
	var s uintptr
	r := d.call(d.fn.streamCreate, uintptr(unsafe.Pointer(&s)), uintptr(flags))
	return Stream(s), d.check(r, "cuStreamCreate(flags %#x)", flags)
}

// StreamDestroy is cuStreamDestroy_v2.
func (d *Driver) StreamDestroy(s Stream) error {
	return d.check(d.call(d.fn.streamDestroy, uintptr(s)), "cuStreamDestroy_v2")
}

// StreamSynchronize is cuStreamSynchronize. It also reports errors of work
// queued earlier on the stream (a faulting kernel, say).
func (d *Driver) StreamSynchronize(s Stream) error {
	return d.check(d.call(d.fn.streamSynchronize, uintptr(s)), "cuStreamSynchronize")
}

// StreamQuery is cuStreamQuery: true when all work on s is done.
func (d *Driver) StreamQuery(s Stream) (bool, error) {
	r := d.call(d.fn.streamQuery, uintptr(s))
	if r == ErrorNotReady {
		return false, nil
	}
	return r == Success, d.check(r, "cuStreamQuery")
}

// EventCreate is cuEventCreate (flags 0: with timing).
func (d *Driver) EventCreate(flags uint32) (Event, error) {
	var e uintptr
	r := d.call(d.fn.eventCreate, uintptr(unsafe.Pointer(&e)), uintptr(flags))
	return Event(e), d.check(r, "cuEventCreate(flags %#x)", flags)
}

// EventDestroy is cuEventDestroy_v2.
func (d *Driver) EventDestroy(e Event) error {
	return d.check(d.call(d.fn.eventDestroy, uintptr(e)), "cuEventDestroy_v2")
}

// EventRecord is cuEventRecord.
func (d *Driver) EventRecord(e Event, s Stream) error {
	return d.check(d.call(d.fn.eventRecord, uintptr(e), uintptr(s)), "cuEventRecord")
}

// EventSynchronize is cuEventSynchronize.
func (d *Driver) EventSynchronize(e Event) error {
	return d.check(d.call(d.fn.eventSynchronize, uintptr(e)), "cuEventSynchronize")
}

// StreamWaitEvent is cuStreamWaitEvent: the work queued on s after it waits
// for the work before e's most recent record (as of this call) to finish,
// without blocking the host.
func (d *Driver) StreamWaitEvent(s Stream, e Event) error {
	return d.check(d.call(d.fn.streamWaitEvent, uintptr(s), uintptr(e), 0), "cuStreamWaitEvent")
}

// EventElapsed is cuEventElapsedTime, in milliseconds.
func (d *Driver) EventElapsed(start, end Event) (float32, error) {
	var ms float32
	r := d.call(d.fn.eventElapsedTime, uintptr(unsafe.Pointer(&ms)), uintptr(start), uintptr(end))
	return ms, d.check(r, "cuEventElapsedTime")
}

// MemAlloc is cuMemAlloc_v2.
func (d *Driver) MemAlloc(bytes int64) (DevicePtr, error) {
	var p uint64
	r := d.call(d.fn.memAlloc, uintptr(unsafe.Pointer(&p)), uintptr(bytes))
	return DevicePtr(p), d.check(r, "cuMemAlloc_v2(%d bytes)", bytes)
}

// MemFree is cuMemFree_v2.
func (d *Driver) MemFree(p DevicePtr) error {
	return d.check(d.call(d.fn.memFree, uintptr(p)), "cuMemFree_v2(%#x)", uint64(p))
}

// MemAllocHost is cuMemAllocHost_v2: page-locked host memory, which copies
// at the full bus rate and can be copied asynchronously.
func (d *Driver) MemAllocHost(bytes int) ([]byte, error) {
	var p uintptr
	r := d.call(d.fn.memAllocHost, uintptr(unsafe.Pointer(&p)), uintptr(bytes))
	if err := d.check(r, "cuMemAllocHost_v2(%d bytes)", bytes); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), bytes), nil
}

// MemFreeHost is cuMemFreeHost for memory from MemAllocHost.
func (d *Driver) MemFreeHost(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	return d.check(d.call(d.fn.memFreeHost, uintptr(unsafe.Pointer(&b[0]))), "cuMemFreeHost")
}

// MemGetInfo is cuMemGetInfo_v2: free and total bytes of the current
// context's device.
func (d *Driver) MemGetInfo() (free, total int64, err error) {
	var f, t uint64
	r := d.call(d.fn.memGetInfo, uintptr(unsafe.Pointer(&f)), uintptr(unsafe.Pointer(&t)))
	return int64(f), int64(t), d.check(r, "cuMemGetInfo_v2")
}

// MemcpyHtoD is cuMemcpyHtoD_v2 (synchronous).
func (d *Driver) MemcpyHtoD(dst DevicePtr, src unsafe.Pointer, bytes int) error {
	r := d.call(d.fn.memcpyHtoD, uintptr(dst), uintptr(src), uintptr(bytes))
	return d.check(r, "cuMemcpyHtoD_v2(%d bytes)", bytes)
}

// MemcpyDtoH is cuMemcpyDtoH_v2 (synchronous).
func (d *Driver) MemcpyDtoH(dst unsafe.Pointer, src DevicePtr, bytes int) error {
	r := d.call(d.fn.memcpyDtoH, uintptr(dst), uintptr(src), uintptr(bytes))
	return d.check(r, "cuMemcpyDtoH_v2(%d bytes)", bytes)
}

// MemcpyHtoDAsync is cuMemcpyHtoDAsync_v2. From pageable memory the call
// returns once src has been staged, so src may be reused at once; only
// page-locked src overlaps with the host.
func (d *Driver) MemcpyHtoDAsync(dst DevicePtr, src unsafe.Pointer, bytes int, s Stream) error {
	r := d.call(d.fn.memcpyHtoDAsync, uintptr(dst), uintptr(src), uintptr(bytes), uintptr(s))
	return d.check(r, "cuMemcpyHtoDAsync_v2(%d bytes)", bytes)
}

// MemcpyDtoHAsync is cuMemcpyDtoHAsync_v2. Into pageable memory it returns
// when the copy is done; into page-locked memory the caller must
// synchronize the stream before reading dst.
func (d *Driver) MemcpyDtoHAsync(dst unsafe.Pointer, src DevicePtr, bytes int, s Stream) error {
	r := d.call(d.fn.memcpyDtoHAsync, uintptr(dst), uintptr(src), uintptr(bytes), uintptr(s))
	return d.check(r, "cuMemcpyDtoHAsync_v2(%d bytes)", bytes)
}

// MemcpyDtoDAsync is cuMemcpyDtoDAsync_v2.
func (d *Driver) MemcpyDtoDAsync(dst, src DevicePtr, bytes int, s Stream) error {
	r := d.call(d.fn.memcpyDtoDAsync, uintptr(dst), uintptr(src), uintptr(bytes), uintptr(s))
	return d.check(r, "cuMemcpyDtoDAsync_v2(%d bytes)", bytes)
}

// MemsetD32Async is cuMemsetD32Async: n 32-bit words set to v.
func (d *Driver) MemsetD32Async(dst DevicePtr, v uint32, n int, s Stream) error {
	r := d.call(d.fn.memsetD32Async, uintptr(dst), uintptr(v), uintptr(n), uintptr(s))
	return d.check(r, "cuMemsetD32Async(%d words)", n)
}

// MemsetD8Async is cuMemsetD8Async: n bytes set to v.
func (d *Driver) MemsetD8Async(dst DevicePtr, v uint8, n int, s Stream) error {
	r := d.call(d.fn.memsetD8Async, uintptr(dst), uintptr(v), uintptr(n), uintptr(s))
	return d.check(r, "cuMemsetD8Async(%d bytes)", n)
}

// ModuleLoadData is cuModuleLoadData on a cubin (or PTX) image.
func (d *Driver) ModuleLoadData(image []byte) (Module, error) {
	if len(image) == 0 {
		return 0, fmt.Errorf("cuModuleLoadData: empty image")
	}
	var m uintptr
	r := d.call(d.fn.moduleLoadData, uintptr(unsafe.Pointer(&m)), uintptr(unsafe.Pointer(&image[0])))
	runtime.KeepAlive(image)
	return Module(m), d.check(r, "cuModuleLoadData(%d bytes)", len(image))
}

// ModuleUnload is cuModuleUnload.
func (d *Driver) ModuleUnload(m Module) error {
	return d.check(d.call(d.fn.moduleUnload, uintptr(m)), "cuModuleUnload")
}

// ModuleGetFunction is cuModuleGetFunction. Kernels are declared extern "C",
// so name is the source name.
func (d *Driver) ModuleGetFunction(m Module, name string) (Function, error) {
	var f uintptr
	cname := cBytes(name)
	r := d.call(d.fn.moduleGetFunction, uintptr(unsafe.Pointer(&f)), uintptr(m), uintptr(unsafe.Pointer(&cname[0])))
	runtime.KeepAlive(cname)
	return Function(f), d.check(r, "cuModuleGetFunction(%q)", name)
}

// FuncAttribute is cuFuncGetAttribute.
func (d *Driver) FuncAttribute(f Function, a FunctionAttribute) (int, error) {
	var v int32
	r := d.call(d.fn.funcGetAttribute, uintptr(unsafe.Pointer(&v)), uintptr(a), uintptr(f))
	return int(v), d.check(r, "cuFuncGetAttribute(attribute %d)", a)
}

// FuncSetAttribute is cuFuncSetAttribute (e.g. to allow more than 48 KiB of
// dynamic shared memory).
func (d *Driver) FuncSetAttribute(f Function, a FunctionAttribute, v int) error {
	return d.check(d.call(d.fn.funcSetAttribute, uintptr(f), uintptr(a), uintptr(v)), "cuFuncSetAttribute(attribute %d, %d)", a, v)
}

// Dim3 is a grid or block size.
type Dim3 struct{ X, Y, Z int }

// LaunchKernel is cuLaunchKernel. params holds one pointer per kernel
// argument, each to memory holding the argument's value; the caller keeps
// that memory pinned (runtime.Pinner) until the call returns, after which
// the driver has copied the values.
func (d *Driver) LaunchKernel(f Function, grid, block Dim3, sharedBytes int, s Stream, params []unsafe.Pointer) error {
	r := d.call(d.fn.launchKernel, uintptr(f),
		uintptr(grid.X), uintptr(grid.Y), uintptr(grid.Z),
		uintptr(block.X), uintptr(block.Y), uintptr(block.Z),
		uintptr(sharedBytes), uintptr(s), uintptr(unsafe.Pointer(unsafe.SliceData(params))), 0)
	runtime.KeepAlive(params)
	if r != Success {
		return d.check(r, "cuLaunchKernel(grid %dx%dx%d, block %dx%dx%d, %d shared bytes)",
			grid.X, grid.Y, grid.Z, block.X, block.Y, block.Z, sharedBytes)
	}
	return nil
}
