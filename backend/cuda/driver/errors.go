package driver

import (
	"errors"
	"fmt"
	"unsafe"
)

// Result is a CUresult, the status every driver API call returns.
type Result int32

// The results callers act on; every other code is reported as it comes.
const (
	Success             Result = 0
	ErrorInvalidValue   Result = 1
	ErrorOutOfMemory    Result = 2
	ErrorNotInitialized Result = 3
	ErrorNoDevice       Result = 100
	ErrorInvalidContext Result = 201
	ErrorNotReady       Result = 600

	ErrorPeerAccessAlreadyEnabled Result = 704
)

// Error is a failed driver call. Call names the C function and the
// arguments that matter, e.g. "cuMemAlloc_v2(1073741824 bytes)"; Name and
// Text come from cuGetErrorName and cuGetErrorString.
type Error struct {
	Call string
	Code Result
	Name string
	Text string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s (%s)", e.Call, e.Name, e.Text)
}

// Code returns the CUresult inside err, or Success when err is not a driver
// error.
func Code(err error) Result {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return Success
}

// cString copies a NUL-terminated C string. The address comes from C as an
// integer; the double conversion keeps go vet's unsafe.Pointer check quiet
// about memory the Go heap does not own.
func cString(p uintptr) string {
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

// cBytes returns s as a NUL-terminated byte slice for C.
func cBytes(s string) []byte {
	b := make([]byte, len(s)+1)
	copy(b, s)
	return b
}
