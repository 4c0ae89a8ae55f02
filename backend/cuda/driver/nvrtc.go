package driver

// NVRTC, the run-time CUDA C++ compiler (libnvrtc.so.13 or .12). It needs no
// context and no GPU, so its calls may run on any goroutine.

import (
	"fmt"
	"runtime"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// NVRTC is libnvrtc's function table.
type NVRTC struct {
	lib *Library
	fn  struct {
		version, getErrorString                    uintptr
		createProgram, destroyProgram, compile     uintptr
		getLogSize, getLog, getCubinSize, getCubin uintptr
		getPTXSize, getPTX                         uintptr
	}
	major, minor int
}

// CompileError is a compilation that NVRTC rejected; Log is its full
// diagnostic output.
type CompileError struct {
	Name    string // the program name given to NVRTC, e.g. "rmsnorm.cu"
	Options []string
	Log     string
	Code    int // the nvrtcResult
}

func (e *CompileError) Error() string {
	return fmt.Sprintf("nvrtc: compiling %s (%s) failed:\n%s", e.Name, strings.Join(e.Options, " "), strings.TrimSpace(e.Log))
}

// LoadNVRTC finds and opens libnvrtc and reads its version.
func (s Search) LoadNVRTC() (*NVRTC, error) {
	lib, err := s.Open(LibNVRTC)
	if err != nil {
		return nil, err
	}
	n := &NVRTC{lib: lib}
	f := &n.fn
	err = lib.symbols(map[string]*uintptr{
		"nvrtcVersion":           &f.version,
		"nvrtcGetErrorString":    &f.getErrorString,
		"nvrtcCreateProgram":     &f.createProgram,
		"nvrtcDestroyProgram":    &f.destroyProgram,
		"nvrtcCompileProgram":    &f.compile,
		"nvrtcGetProgramLogSize": &f.getLogSize,
		"nvrtcGetProgramLog":     &f.getLog,
		"nvrtcGetCUBINSize":      &f.getCubinSize,
		"nvrtcGetCUBIN":          &f.getCubin,
		"nvrtcGetPTXSize":        &f.getPTXSize,
		"nvrtcGetPTX":            &f.getPTX,
	})
	if err != nil {
		return nil, err
	}
	var major, minor int32
	if err := n.check(n.call(f.version, uintptr(unsafe.Pointer(&major)), uintptr(unsafe.Pointer(&minor))), "nvrtcVersion"); err != nil {
		return nil, err
	}
	n.major, n.minor = int(major), int(minor)
	return n, nil
}

// Path is the libnvrtc file that was loaded.
func (n *NVRTC) Path() string { return n.lib.Path }

// Library is the loaded libnvrtc and where it was found.
func (n *NVRTC) Library() *Library { return n.lib }

// Version is NVRTC's major and minor version, e.g. 13, 0.
func (n *NVRTC) Version() (major, minor int) { return n.major, n.minor }

// call: see Driver.call.
//
//go:uintptrescapes
func (n *NVRTC) call(fn uintptr, args ...uintptr) int {
	r, _, _ := purego.SyscallN(fn, args...)
	return int(int32(r))
}

func (n *NVRTC) check(r int, call string) error {
	if r == 0 {
		return nil
	}
	p, _, _ := purego.SyscallN(n.fn.getErrorString, uintptr(r))
	return fmt.Errorf("%s: %s (nvrtcResult %d)", call, cString(p), r)
}

// Output selects what Compile returns.
type Output int

const (
	OutputCubin Output = iota + 1 // machine code for one architecture (options name sm_XY)
	OutputPTX                     // PTX, for the driver to compile at load time
)

// Compile compiles one CUDA C++ source with the given options (e.g.
// "--gpu-architecture=sm_90a") and returns the cubin or PTX. A rejected
// source returns a *CompileError holding NVRTC's log; warnings of a
// successful compile are returned as log.
func (n *NVRTC) Compile(name, source string, options []string, out Output) (image []byte, log string, err error) {
	csrc, cname := cBytes(source), cBytes(name)
	var prog uintptr
	r := n.call(n.fn.createProgram, uintptr(unsafe.Pointer(&prog)),
		uintptr(unsafe.Pointer(&csrc[0])), uintptr(unsafe.Pointer(&cname[0])), 0, 0, 0)
	runtime.KeepAlive(csrc)
	runtime.KeepAlive(cname)
	if err := n.check(r, "nvrtcCreateProgram("+name+")"); err != nil {
		return nil, "", err
	}
	defer n.call(n.fn.destroyProgram, uintptr(unsafe.Pointer(&prog)))

	// The option strings and the array of pointers to them must stay put
	// while NVRTC reads them: pin both.
	var pin runtime.Pinner
	defer pin.Unpin()
	copts := make([][]byte, len(options))
	ptrs := make([]unsafe.Pointer, len(options)+1)
	for i, o := range options {
		copts[i] = cBytes(o)
		pin.Pin(&copts[i][0])
		ptrs[i] = unsafe.Pointer(&copts[i][0])
	}
	pin.Pin(&ptrs[0])
	rc := n.call(n.fn.compile, prog, uintptr(len(options)), uintptr(unsafe.Pointer(&ptrs[0])))
	runtime.KeepAlive(copts)
	log, logErr := n.programLog(prog)
	if rc != 0 {
		if logErr != nil {
			log = logErr.Error()
		}
		return nil, log, &CompileError{Name: name, Options: options, Log: log, Code: rc}
	}
	sizeFn, getFn, what := n.fn.getCubinSize, n.fn.getCubin, "nvrtcGetCUBIN"
	if out == OutputPTX {
		sizeFn, getFn, what = n.fn.getPTXSize, n.fn.getPTX, "nvrtcGetPTX"
	}
	var size uint64
	if err := n.check(n.call(sizeFn, prog, uintptr(unsafe.Pointer(&size))), what+"Size"); err != nil {
		return nil, log, err
	}
	if size == 0 {
		return nil, log, fmt.Errorf("%s: empty output for %s (does %v name a real sm_ architecture?)", what, name, options)
	}
	image = make([]byte, size)
	if err := n.check(n.call(getFn, prog, uintptr(unsafe.Pointer(&image[0]))), what); err != nil {
		return nil, log, err
	}
	if out == OutputPTX && image[len(image)-1] == 0 {
		image = image[:len(image)-1]
	}
	return image, log, nil
}

func (n *NVRTC) programLog(prog uintptr) (string, error) {
	var size uint64
	if err := n.check(n.call(n.fn.getLogSize, prog, uintptr(unsafe.Pointer(&size))), "nvrtcGetProgramLogSize"); err != nil {
		return "", err
	}
	if size <= 1 {
		return "", nil
	}
	buf := make([]byte, size)
	if err := n.check(n.call(n.fn.getLog, prog, uintptr(unsafe.Pointer(&buf[0]))), "nvrtcGetProgramLog"); err != nil {
		return "", err
	}
	return strings.TrimRight(string(buf), "\x00"), nil
}
