package registry

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// CPU is the name of the CPU backend, which every Set has; Auto is the
// name that picks the first usable driver, else the CPU.
const (
	CPU  = "cpu"
	Auto = "auto"
)

// Driver opens one kind of accelerator backend.
type Driver interface {
	// Name is what train.backend calls the backend ("cuda"); it is the
	// Name() of the backends Open returns.
	Name() string
	// Capabilities describes the devices and the kernels' limits.
	Capabilities() Capabilities
	// Open opens the first device. Where the machine has no device of
	// the driver's kind at all (no driver library, no device) the error is
	// a *NoDeviceError, so that auto falls back to the CPU quietly; any
	// other error is a device that is there and failed.
	Open() (Device, error)
}

// Device is a backend on one device, as a Driver opens it. Close releases
// the device; its tensors must not be used afterwards.
type Device interface {
	backend.Backend
	io.Closer
	// Describe names the device in log lines: "NVIDIA H200 (GPU 0)".
	Describe() string
}

// Capabilities is what a driver declares about its devices and kernels.
type Capabilities struct {
	// Device is what one device is called in messages ("GPU").
	Device string
	// Collectives is what the library of the driver's groups is called in
	// messages ("NCCL"), when the driver implements RankPerDevice.
	Collectives string
	// VisibleEnv is the environment variable that limits the devices a
	// process sees ("CUDA_VISIBLE_DEVICES"), named in errors about too few
	// devices; "" if none.
	VisibleEnv string
	// PeerAccess says that the driver's groups over the devices of one
	// process can let each rank reach its peers' tensors (comm.PeerAccess)
	// when asked (MeshOptions.PeerAccess), which the fused MoE dispatcher
	// needs.
	PeerAccess bool
	// Limits are the model sizes the kernels handle.
	Limits Limits
}

// Limits bound the model sizes a driver's kernels handle; 0 is no limit.
type Limits struct {
	// RouterMaxExperts and RouterMaxTopK bound the router kernels: at most
	// that many experts, each token choosing at most top-k of them.
	RouterMaxExperts, RouterMaxTopK int
	// AttnMaxHeadDim bounds the attention kernels' head dim.
	AttnMaxHeadDim int
}

// NoDeviceError is a driver's answer that this machine has no device of
// its kind (no driver library, no device), as opposed to a device that
// failed. Its text is Err's.
type NoDeviceError struct {
	// Reason is a one-line cause for auto's log line ("cuda: no libcuda
	// found (libcuda.so.1)"); Err, with every detail, is for an explicit
	// choice of the driver to report.
	Reason string
	Err    error
}

func (e *NoDeviceError) Error() string { return e.Err.Error() }
func (e *NoDeviceError) Unwrap() error { return e.Err }

// Set is the drivers a program links, looked up by name. The zero Set has
// none: only the CPU backend.
type Set struct {
	drivers []Driver // in order of preference for auto
}

// NewSet is the set of drivers, auto trying them in the order given. Names
// must be distinct and may not be "cpu" or "auto".
func NewSet(drivers ...Driver) (Set, error) {
	var s Set
	for _, d := range drivers {
		if d == nil {
			return Set{}, errors.New("registry: a nil driver")
		}
		switch name := d.Name(); {
		case name == "" || name == CPU || name == Auto:
			return Set{}, fmt.Errorf("registry: a driver may not be called %q", name)
		case s.has(name):
			return Set{}, fmt.Errorf("registry: two drivers called %q", name)
		}
		s.drivers = append(s.drivers, d)
	}
	return s, nil
}

func (s Set) has(name string) bool {
	_, ok := s.Lookup(name)
	return ok
}

// Lookup returns the driver called name.
func (s Set) Lookup(name string) (Driver, bool) {
	for _, d := range s.drivers {
		if d.Name() == name {
			return d, true
		}
	}
	return nil, false
}

// Drivers are the set's drivers in auto's order.
func (s Set) Drivers() []Driver { return slices.Clone(s.drivers) }

// Names are the backends the set can open: "cpu", then the drivers'.
func (s Set) Names() []string {
	names := []string{CPU}
	for _, d := range s.drivers {
		names = append(names, d.Name())
	}
	return names
}

// NotLinkedError is Open's error for a name no driver of the set has.
type NotLinkedError struct {
	Name   string
	Linked []string // the names the set has
}

func (e *NotLinkedError) Error() string {
	return fmt.Sprintf("no %s backend is linked into this program (it has %s)", e.Name, strings.Join(e.Linked, ", "))
}

// Opened is the backend Open chose.
type Opened struct {
	// Backend is the backend to compute on.
	Backend backend.Backend
	// Driver and Device are the driver that opened Backend and the device
	// it is on; both nil for the CPU.
	Driver Driver
	Device Device
	// Notes are the lines to log about the choice, in order.
	Notes []Note
}

// Note is one line about Open's choice; Warning marks a device that is
// there but failed, which auto passed over.
type Note struct {
	Text    string
	Warning bool
}

// Close closes the device, if Open opened one.
func (o Opened) Close() error {
	if o.Device == nil {
		return nil
	}
	return o.Device.Close()
}

// Open opens the backend name names: "cpu"; a driver's name, which fails
// with the reason when the driver's limits or device do not serve
// (unsupported's error, or Open's); or "auto": each driver in turn whose
// limits fit and whose device opens, else the CPU, with the reasons in the
// notes. unsupported says why the model cannot run within a driver's
// limits, or returns nil; it may be nil itself (everything fits).
func (s Set) Open(name string, unsupported func(Driver) error) (Opened, error) {
	if unsupported == nil {
		unsupported = func(Driver) error { return nil }
	}
	switch name {
	case CPU:
		return onCPU(), nil
	case Auto:
		return s.auto(unsupported), nil
	}
	d, ok := s.Lookup(name)
	if !ok {
		return Opened{}, &NotLinkedError{Name: name, Linked: s.Names()}
	}
	if err := unsupported(d); err != nil {
		return Opened{}, err
	}
	dev, err := d.Open()
	if err != nil {
		return Opened{}, err
	}
	return Opened{Backend: dev, Driver: d, Device: dev, Notes: []Note{{
		Text: fmt.Sprintf("backend %s: using %s", d.Name(), dev.Describe()),
	}}}, nil
}

func onCPU() Opened { return Opened{Backend: cpu.New(backend.Float32)} }

// auto is Open("auto").
func (s Set) auto(unsupported func(Driver) error) Opened {
	if len(s.drivers) == 0 {
		o := onCPU()
		o.Notes = []Note{{Text: "backend auto: no backend but the CPU's is linked into this program, training on the CPU"}}
		return o
	}
	var notes []Note
	for i, d := range s.drivers {
		// What auto does next, for the note on why d was passed over.
		next := "training on the CPU"
		if i+1 < len(s.drivers) {
			next = "trying " + s.drivers[i+1].Name()
		}
		if err := unsupported(d); err != nil {
			notes = append(notes, Note{Text: fmt.Sprintf("backend auto: %s, since %v", next, err)})
			continue
		}
		dev, err := d.Open()
		var none *NoDeviceError
		switch {
		case err == nil:
			return Opened{Backend: dev, Driver: d, Device: dev, Notes: append(notes, Note{
				Text: fmt.Sprintf("backend auto: using %s", dev.Describe()),
			})}
		case errors.As(err, &none):
			notes = append(notes, Note{Text: fmt.Sprintf("backend auto: no %s (%s), %s", d.Capabilities().Device, none.Reason, next)})
		default:
			notes = append(notes, Note{Warning: true, Text: fmt.Sprintf("backend auto: the %s cannot be used (%v), %s; set train.backend: %s to make this an error",
				d.Capabilities().Device, err, next, d.Name())})
		}
	}
	o := onCPU()
	o.Notes = notes
	return o
}
