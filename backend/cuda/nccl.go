package cuda

// Bindings for the part of NCCL (libnccl.so.2) that the communicator in
// nccl_group.go needs, called through purego like the driver API: no cgo,
// one C call per method, every ncclResult_t turned into an *NCCLError that
// names the call and carries ncclGetErrorString's text.
//
// The enum values are those of nccl.h (src/nccl.h.in in NVIDIA's nccl
// repository; they have not changed since NCCL 2.0): ncclSum = 0;
// ncclUint8 = 1, ncclInt32 = 2, ncclInt64 = 4, ncclFloat32 = 7,
// ncclFloat64 = 8; ncclUniqueId is a struct of 128 chars.
//
// ncclCommInitRank takes the unique id by value. On linux/amd64 the System V
// ABI passes a 128-byte struct in memory, on the stack after the register
// arguments; purego.RegisterFunc lays out struct arguments that way (v0.11),
// and TestNCCLCommInitRankABI checks the layout it produces. Every other
// call goes through purego.SyscallN.
//
// Calls that touch a communicator or a stream run on the communicator's
// Device thread (Device.Do), where its context is current; NCCL forbids
// concurrent calls on one communicator, and the thread serializes them.

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// NCCLResult is an ncclResult_t.
type NCCLResult int32

// The results of nccl.h.
const (
	NCCLSuccess            NCCLResult = 0
	NCCLUnhandledCudaError NCCLResult = 1
	NCCLSystemError        NCCLResult = 2
	NCCLInternalError      NCCLResult = 3
	NCCLInvalidArgument    NCCLResult = 4
	NCCLInvalidUsage       NCCLResult = 5
	NCCLRemoteError        NCCLResult = 6
	NCCLInProgress         NCCLResult = 7
)

func (r NCCLResult) String() string {
	switch r {
	case NCCLSuccess:
		return "ncclSuccess"
	case NCCLUnhandledCudaError:
		return "ncclUnhandledCudaError"
	case NCCLSystemError:
		return "ncclSystemError"
	case NCCLInternalError:
		return "ncclInternalError"
	case NCCLInvalidArgument:
		return "ncclInvalidArgument"
	case NCCLInvalidUsage:
		return "ncclInvalidUsage"
	case NCCLRemoteError:
		return "ncclRemoteError"
	case NCCLInProgress:
		return "ncclInProgress"
	}
	return fmt.Sprintf("ncclResult_t %d", int32(r))
}

// NCCLError is a failed NCCL call: the C function with the arguments that
// matter, the result, ncclGetErrorString's text and, when the library has
// it, ncclGetLastError's message for the communicator, e.g.
//
//	ncclAllReduce(1024 x ncclFloat32): ncclSystemError: unhandled system error (...) (NCCL: socket closed by peer)
type NCCLError struct {
	Call string
	Code NCCLResult
	Text string // ncclGetErrorString
	Last string // ncclGetLastError, "" when there is none
}

func (e *NCCLError) Error() string {
	s := fmt.Sprintf("%s: %v: %s", e.Call, e.Code, e.Text)
	if e.Last != "" {
		s += " (NCCL: " + e.Last + ")"
	}
	return s
}

// ncclDataType is an ncclDataType_t; ncclRedOp an ncclRedOp_t.
type (
	ncclDataType int32
	ncclRedOp    int32
)

const (
	ncclUint8    ncclDataType = 1
	ncclInt32    ncclDataType = 2
	ncclInt64    ncclDataType = 4
	ncclFloat32  ncclDataType = 7
	ncclFloat64  ncclDataType = 8
	ncclBfloat16 ncclDataType = 9

	ncclSum ncclRedOp = 0
)

func (t ncclDataType) String() string {
	switch t {
	case ncclUint8:
		return "ncclUint8"
	case ncclInt32:
		return "ncclInt32"
	case ncclInt64:
		return "ncclInt64"
	case ncclFloat32:
		return "ncclFloat32"
	case ncclFloat64:
		return "ncclFloat64"
	case ncclBfloat16:
		return "ncclBfloat16"
	}
	return fmt.Sprintf("ncclDataType_t %d", int32(t))
}

// ncclComm is an ncclComm_t, an opaque C pointer.
type ncclComm uintptr

// NCCLUniqueIDBytes is the size of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES),
// the blob the rendezvous hands to every node (comm.BlobSize).
const NCCLUniqueIDBytes = 128

// ncclUniqueID is ncclUniqueId, passed by value to ncclCommInitRank.
type ncclUniqueID struct {
	internal [NCCLUniqueIDBytes]byte
}

// EnvNCCLNVLS is the NCCL variable that switches NVLink multicast (NVLS)
// on or off; LoadNCCL sets it to 0 unless it is set.
const EnvNCCLNVLS = "NCCL_NVLS_ENABLE"

// NCCL is libnccl's function table. Load it with LoadNCCL.
type NCCL struct {
	lib *driver.Library
	fn  struct {
		getVersion, getUniqueID, getErrorString, getLastError  uintptr
		commInitAll, commDestroy, commAbort, commGetAsyncError uintptr
		allReduce, reduceScatter, allGather, send, recv        uintptr
		groupStart, groupEnd                                   uintptr
	}
	// commInitRank is bound with purego.RegisterFunc, which passes the
	// 128-byte id by value as the C ABI wants.
	commInitRank func(comm *ncclComm, nranks int32, id ncclUniqueID, rank int32) NCCLResult
}

// LoadNCCL finds and opens libnccl with s (see package driver for where it
// looks and MKTRAIN_LIBNCCL) and resolves every symbol the communicator
// uses, so a library too old is reported before anything runs. Loading
// twice is cheap: the library stays loaded for the life of the process.
//
// NVLink multicast is turned off (NCCL_NVLS_ENABLE=0) unless the variable is
// already set: on some multi-GPU hosts multicast setup has taken the GPUs
// out of service, and the collectives mktrain runs gain little from it. A
// user who wants it sets NCCL_NVLS_ENABLE=1. NCCL reads its variables once,
// at its first call in the process, so this must happen before any.
func LoadNCCL(s driver.Search) (*NCCL, error) {
	if _, ok := os.LookupEnv(EnvNCCLNVLS); !ok {
		if err := os.Setenv(EnvNCCLNVLS, "0"); err != nil {
			return nil, fmt.Errorf("cuda: setting %s=0 for NCCL: %w", EnvNCCLNVLS, err)
		}
	}
	lib, err := s.Open(driver.LibNCCL)
	if err != nil {
		return nil, err
	}
	l := &NCCL{lib: lib}
	f := &l.fn
	for name, dst := range map[string]*uintptr{
		"ncclGetVersion":        &f.getVersion,
		"ncclGetUniqueId":       &f.getUniqueID,
		"ncclGetErrorString":    &f.getErrorString,
		"ncclCommInitAll":       &f.commInitAll,
		"ncclCommDestroy":       &f.commDestroy,
		"ncclCommAbort":         &f.commAbort,
		"ncclCommGetAsyncError": &f.commGetAsyncError,
		"ncclAllReduce":         &f.allReduce,
		"ncclReduceScatter":     &f.reduceScatter,
		"ncclAllGather":         &f.allGather,
		"ncclSend":              &f.send,
		"ncclRecv":              &f.recv,
		"ncclGroupStart":        &f.groupStart,
		"ncclGroupEnd":          &f.groupEnd,
	} {
		if *dst, err = lib.Symbol(name); err != nil {
			return nil, err
		}
	}
	initRank, err := lib.Symbol("ncclCommInitRank")
	if err != nil {
		return nil, err
	}
	l.commInitRank = bindCommInitRank(initRank)
	// ncclGetLastError came with NCCL 2.13; older libraries just give no
	// detail.
	f.getLastError, _ = lib.Symbol("ncclGetLastError")
	return l, nil
}

// bindCommInitRank makes a Go function of the C function at fn with
// ncclCommInitRank's signature.
func bindCommInitRank(fn uintptr) func(*ncclComm, int32, ncclUniqueID, int32) NCCLResult {
	var f func(*ncclComm, int32, ncclUniqueID, int32) NCCLResult
	purego.RegisterFunc(&f, fn)
	return f
}

// Path is the libnccl file that was loaded.
func (l *NCCL) Path() string { return l.lib.Path }

// ncclCall is go:uintptrescapes, like purego.SyscallN: a Go pointer
// converted to uintptr in the argument list stays alive and in place for
// the call.
//
//go:uintptrescapes
func ncclCall(fn uintptr, args ...uintptr) NCCLResult {
	r, _, _ := purego.SyscallN(fn, args...)
	return NCCLResult(int32(r))
}

// check turns r into an *NCCLError naming the call (formatted only on
// failure); comm, when not 0, is asked for its last error message.
func (l *NCCL) check(r NCCLResult, comm ncclComm, format string, args ...any) error {
	if r == NCCLSuccess {
		return nil
	}
	e := &NCCLError{Call: fmt.Sprintf(format, args...), Code: r, Text: l.ErrorString(r)}
	if comm != 0 && l.fn.getLastError != 0 {
		p, _, _ := purego.SyscallN(l.fn.getLastError, uintptr(comm))
		e.Last = goString(p)
	}
	return e
}

// ErrorString is ncclGetErrorString.
func (l *NCCL) ErrorString(r NCCLResult) string {
	p, _, _ := purego.SyscallN(l.fn.getErrorString, uintptr(r))
	if s := goString(p); s != "" {
		return s
	}
	return "unknown error"
}

// Version is ncclGetVersion: 10000*major + 100*minor + patch from NCCL 2.9
// on (e.g. 22803 for 2.28.3), 1000*major + 100*minor + patch before.
func (l *NCCL) Version() (int, error) {
	var v int32
	r := ncclCall(l.fn.getVersion, uintptr(unsafe.Pointer(&v)))
	return int(v), l.check(r, 0, "ncclGetVersion")
}

// UniqueID is ncclGetUniqueId: the id that every rank of a new
// communicator passes to NewNCCLGroup. One rank makes it and the
// rendezvous hands it to the others. It needs no GPU.
func (l *NCCL) UniqueID() ([NCCLUniqueIDBytes]byte, error) {
	var id ncclUniqueID
	r := ncclCall(l.fn.getUniqueID, uintptr(unsafe.Pointer(&id)))
	return id.internal, l.check(r, 0, "ncclGetUniqueId")
}

// NCCLUniqueID loads libnccl from the default places (driver.Search{}) and
// returns a fresh unique id (NCCL.UniqueID).
func NCCLUniqueID() ([NCCLUniqueIDBytes]byte, error) {
	l, err := LoadNCCL(driver.Search{})
	if err != nil {
		return [NCCLUniqueIDBytes]byte{}, err
	}
	return l.UniqueID()
}

// initRank is ncclCommInitRank. It returns once every rank of the
// communicator has called it, so each rank calls it from its own thread.
func (l *NCCL) initRank(nranks, rank int, id [NCCLUniqueIDBytes]byte) (ncclComm, error) {
	var c ncclComm
	r := l.commInitRank(&c, int32(nranks), ncclUniqueID{internal: id}, int32(rank))
	return c, l.check(r, 0, "ncclCommInitRank(rank %d of %d)", rank, nranks)
}

// initAll is ncclCommInitAll: one communicator per device ordinal, in
// order, made from one thread.
func (l *NCCL) initAll(ordinals []int32) ([]ncclComm, error) {
	comms := make([]ncclComm, len(ordinals))
	r := ncclCall(l.fn.commInitAll, uintptr(unsafe.Pointer(&comms[0])), uintptr(len(ordinals)), uintptr(unsafe.Pointer(&ordinals[0])))
	return comms, l.check(r, 0, "ncclCommInitAll(devices %v)", ordinals)
}

// destroy is ncclCommDestroy.
func (l *NCCL) destroy(c ncclComm) error {
	return l.check(ncclCall(l.fn.commDestroy, uintptr(c)), 0, "ncclCommDestroy")
}

// abort is ncclCommAbort: it stops the communicator's pending work and frees
// it.
func (l *NCCL) abort(c ncclComm) error {
	return l.check(ncclCall(l.fn.commAbort, uintptr(c)), 0, "ncclCommAbort")
}

// asyncError is ncclCommGetAsyncError: nil while the communicator is
// healthy (ncclSuccess, or ncclInProgress on a nonblocking one), else the
// asynchronous error, e.g. a peer's connection that broke.
func (l *NCCL) asyncError(c ncclComm) error {
	var res NCCLResult
	if err := l.check(ncclCall(l.fn.commGetAsyncError, uintptr(c), uintptr(unsafe.Pointer(&res))), c, "ncclCommGetAsyncError"); err != nil {
		return err
	}
	if res == NCCLSuccess || res == NCCLInProgress {
		return nil
	}
	return l.check(res, c, "asynchronous error of the communicator (ncclCommGetAsyncError)")
}

// allReduce is ncclAllReduce (in place when send == recv).
func (l *NCCL) allReduce(send, recv driver.DevicePtr, n int, dt ncclDataType, op ncclRedOp, c ncclComm, s driver.Stream) error {
	r := ncclCall(l.fn.allReduce, uintptr(send), uintptr(recv), uintptr(n), uintptr(dt), uintptr(op), uintptr(c), uintptr(s))
	return l.check(r, c, "ncclAllReduce(%d x %v)", n, dt)
}

// reduceScatter is ncclReduceScatter; n is the count each rank receives.
func (l *NCCL) reduceScatter(send, recv driver.DevicePtr, n int, dt ncclDataType, op ncclRedOp, c ncclComm, s driver.Stream) error {
	r := ncclCall(l.fn.reduceScatter, uintptr(send), uintptr(recv), uintptr(n), uintptr(dt), uintptr(op), uintptr(c), uintptr(s))
	return l.check(r, c, "ncclReduceScatter(%d x %v per rank)", n, dt)
}

// allGather is ncclAllGather; n is the count each rank sends.
func (l *NCCL) allGather(send, recv driver.DevicePtr, n int, dt ncclDataType, c ncclComm, s driver.Stream) error {
	r := ncclCall(l.fn.allGather, uintptr(send), uintptr(recv), uintptr(n), uintptr(dt), uintptr(c), uintptr(s))
	return l.check(r, c, "ncclAllGather(%d x %v per rank)", n, dt)
}

// send is ncclSend to peer.
func (l *NCCL) send(buf driver.DevicePtr, n int, dt ncclDataType, peer int, c ncclComm, s driver.Stream) error {
	r := ncclCall(l.fn.send, uintptr(buf), uintptr(n), uintptr(dt), uintptr(peer), uintptr(c), uintptr(s))
	return l.check(r, c, "ncclSend(%d x %v to rank %d)", n, dt, peer)
}

// recv is ncclRecv from peer.
func (l *NCCL) recv(buf driver.DevicePtr, n int, dt ncclDataType, peer int, c ncclComm, s driver.Stream) error {
	r := ncclCall(l.fn.recv, uintptr(buf), uintptr(n), uintptr(dt), uintptr(peer), uintptr(c), uintptr(s))
	return l.check(r, c, "ncclRecv(%d x %v from rank %d)", n, dt, peer)
}

// grouped runs calls between ncclGroupStart and ncclGroupEnd, so that the
// sends and receives they queue progress together. ncclGroupEnd runs even
// when a call fails, which leaves NCCL's per-thread group state clean.
func (l *NCCL) grouped(calls func() error) error {
	if err := l.check(ncclCall(l.fn.groupStart), 0, "ncclGroupStart"); err != nil {
		return err
	}
	err := calls()
	return errors.Join(err, l.check(ncclCall(l.fn.groupEnd), 0, "ncclGroupEnd"))
}

// goString copies a NUL-terminated C string (see driver's cString for the
// double conversion).
func goString(p uintptr) string {
	if p == 0 {
		return ""
	}
	ptr := *(*unsafe.Pointer)(unsafe.Pointer(&p))
	n := 0
	for *(*byte)(unsafe.Add(ptr, n)) != 0 {
		n++
	}
	return string(unsafe.Slice((*byte)(ptr), n))
}
