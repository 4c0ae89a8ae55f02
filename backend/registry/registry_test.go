package registry_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/registry"
)

// device is a CPU backend posing as a device of driver name.
type device struct {
	*cpu.Backend
	name   string
	closed *int
}

func (d device) Name() string     { return d.name }
func (d device) Describe() string { return "Fake 9 (GPU 0)" }
func (d device) Close() error     { *d.closed++; return nil }

// driver opens devices, or fails with err.
type driver struct {
	name   string
	err    error
	opened int
	closed int
}

func (d *driver) Name() string { return d.name }
func (d *driver) Capabilities() registry.Capabilities {
	return registry.Capabilities{Device: "GPU", Limits: registry.Limits{RouterMaxExperts: 8}}
}
func (d *driver) Open() (registry.Device, error) {
	if d.err != nil {
		return nil, d.err
	}
	d.opened++
	return device{Backend: cpu.New(backend.Float32), name: d.name, closed: &d.closed}, nil
}

func texts(notes []registry.Note) string {
	var s []string
	for _, n := range notes {
		w := ""
		if n.Warning {
			w = "warning: "
		}
		s = append(s, w+n.Text)
	}
	return strings.Join(s, "\n")
}

func TestNewSet(t *testing.T) {
	a, b := &driver{name: "a"}, &driver{name: "b"}
	s, err := registry.NewSet(a, b)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(s.Names(), ","); got != "cpu,a,b" {
		t.Errorf("Names %q", got)
	}
	if d, ok := s.Lookup("b"); !ok || d != b {
		t.Errorf("Lookup b: %v, %v", d, ok)
	}
	if _, ok := s.Lookup("cpu"); ok {
		t.Error("the CPU is a driver")
	}
	if ds := s.Drivers(); len(ds) != 2 || ds[0] != a {
		t.Errorf("Drivers %v", ds)
	}
	for _, c := range []struct {
		drivers []registry.Driver
		want    string
	}{
		{[]registry.Driver{a, &driver{name: "a"}}, `two drivers called "a"`},
		{[]registry.Driver{&driver{name: "cpu"}}, `may not be called "cpu"`},
		{[]registry.Driver{&driver{name: "auto"}}, `may not be called "auto"`},
		{[]registry.Driver{&driver{}}, `may not be called ""`},
		{[]registry.Driver{nil}, "nil driver"},
	} {
		if _, err := registry.NewSet(c.drivers...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want %q", c.drivers, err, c.want)
		}
	}
}

// TestOpenByName: "cpu" is always there; a driver's name opens its device
// or fails with its reason; a name no driver has says what is linked.
func TestOpenByName(t *testing.T) {
	d := &driver{name: "fake"}
	s, _ := registry.NewSet(d)
	o, err := s.Open("cpu", nil)
	if err != nil || o.Backend.Name() != "cpu" || o.Driver != nil || o.Device != nil || len(o.Notes) != 0 || o.Close() != nil {
		t.Errorf("cpu: %+v, %v", o, err)
	}
	o, err = s.Open("fake", nil)
	if err != nil || o.Backend.Name() != "fake" || o.Driver != d || texts(o.Notes) != "backend fake: using Fake 9 (GPU 0)" {
		t.Fatalf("fake: %+v, %v", o, err)
	}
	if err := o.Close(); err != nil || d.closed != 1 {
		t.Errorf("Close: %v, %d closed", err, d.closed)
	}
	tooBig := errors.New("too big")
	if _, err := s.Open("fake", func(registry.Driver) error { return tooBig }); err != tooBig {
		t.Errorf("fake, unsupported: %v", err)
	}
	d.err = &registry.NoDeviceError{Reason: "no libfake", Err: errors.New("no libfake; looked in: /x")}
	if _, err := s.Open("fake", nil); err == nil || err.Error() != "no libfake; looked in: /x" {
		t.Errorf("fake without a device: %v, want the whole error", err)
	}
	_, err = s.Open("cuda", nil)
	var nl *registry.NotLinkedError
	if !errors.As(err, &nl) || err.Error() != "no cuda backend is linked into this program (it has cpu, fake)" {
		t.Errorf("cuda: %v", err)
	}
	if _, err := (registry.Set{}).Open("fake", nil); err == nil || !strings.Contains(err.Error(), "it has cpu)") {
		t.Errorf("the zero Set: %v", err)
	}
}

// TestOpenAuto: auto takes the first driver that fits and opens, and
// falls back to the CPU saying why each was passed over.
func TestOpenAuto(t *testing.T) {
	o, err := registry.Set{}.Open("auto", nil)
	if err != nil || o.Backend.Name() != "cpu" || texts(o.Notes) != "backend auto: no backend but the CPU's is linked into this program, training on the CPU" {
		t.Errorf("no drivers: %+v, %v", o, err)
	}

	a, b := &driver{name: "a"}, &driver{name: "b"}
	s, _ := registry.NewSet(a, b)
	o, _ = s.Open("auto", nil)
	if o.Driver != a || texts(o.Notes) != "backend auto: using Fake 9 (GPU 0)" {
		t.Errorf("both usable: %v, %q", o.Driver, texts(o.Notes))
	}

	a.err = &registry.NoDeviceError{Reason: "cuda: no libcuda found", Err: errors.New("cuda: no libcuda found; looked in:\n/x")}
	notA := func(d registry.Driver) error {
		if d == registry.Driver(b) {
			return errors.New("b is too small")
		}
		return nil
	}
	for _, c := range []struct {
		name        string
		unsupported func(registry.Driver) error
		driverErr   error
		want        string
	}{
		{"a has no device, b is used", nil, nil, "backend auto: no GPU (cuda: no libcuda found), trying b\nbackend auto: using Fake 9 (GPU 0)"},
		{"a has no device, b does not fit", notA, nil,
			"backend auto: no GPU (cuda: no libcuda found), trying b\nbackend auto: training on the CPU, since b is too small"},
		{"a has no device, b fails", nil, errors.New("out of memory"),
			"backend auto: no GPU (cuda: no libcuda found), trying b\nwarning: backend auto: the GPU cannot be used (out of memory), training on the CPU; set train.backend: b to make this an error"},
	} {
		b.err = c.driverErr
		o, err := s.Open("auto", c.unsupported)
		if err != nil || texts(o.Notes) != c.want {
			t.Errorf("%s: %v, notes:\n%s\nwant:\n%s", c.name, err, texts(o.Notes), c.want)
		}
		if wantB := c.driverErr == nil && c.unsupported == nil; (o.Driver == registry.Driver(b)) != wantB || (o.Backend.Name() == "cpu") == wantB {
			t.Errorf("%s: opened %s (driver %v)", c.name, o.Backend.Name(), o.Driver)
		}
	}
}
