package engine

// train.backend resolved through the drivers of WithDrivers, with drivers
// made of CPU backends: the engine picks and closes their devices, falls
// back as auto should, and places one rank per device through
// registry.RankPerDevice.

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// fakeDevice is a CPU backend posing as a GPU of the fake "cuda" driver.
type fakeDevice struct {
	*cpu.Backend
	ordinal int
	drv     *fakeDriver
}

func (fakeDevice) Name() string       { return "cuda" }
func (d fakeDevice) Describe() string { return "Fake GPU (GPU " + string(rune('0'+d.ordinal)) + ")" }
func (d fakeDevice) Close() error     { d.drv.closed++; return nil }

// fakeDriver opens fakeDevices, or fails with err; limits are its kernels'.
type fakeDriver struct {
	err            error
	limits         registry.Limits
	opened, closed int
}

func (d *fakeDriver) Name() string { return "cuda" }
func (d *fakeDriver) Capabilities() registry.Capabilities {
	return registry.Capabilities{Device: "GPU", Collectives: "FAKE", PeerAccess: true, Limits: d.limits}
}
func (d *fakeDriver) Open() (registry.Device, error) { return d.open(0) }
func (d *fakeDriver) open(ordinal int) (registry.Device, error) {
	if d.err != nil {
		return nil, d.err
	}
	d.opened++
	return fakeDevice{cpu.New(backend.Float32), ordinal, d}, nil
}

// fakePlacer is a fakeDriver whose devices, visible of them, each take a
// rank; its groups are in-process ones (the CPU backends' tensors are
// interchangeable), which offer peer access.
type fakePlacer struct {
	*fakeDriver
	visible int
	peers   []bool // MeshOptions.PeerAccess of each MeshRanks
}

func (p *fakePlacer) Devices() (int, error) { return p.visible, nil }
func (p *fakePlacer) OpenBeside(first registry.Device, n int) ([]registry.Device, func() error, error) {
	devs := []registry.Device{first}
	for r := 1; r < n; r++ {
		d, err := p.open(r)
		if err != nil {
			return nil, nil, err
		}
		devs = append(devs, d)
	}
	return devs, func() error {
		for _, d := range devs[1:] {
			d.Close()
		}
		return nil
	}, nil
}
func (p *fakePlacer) MeshRanks(mesh comm.Mesh, devices []registry.Device, opts registry.MeshOptions) ([]*comm.Ranks, func() error, error) {
	p.peers = append(p.peers, opts.PeerAccess)
	world, err := comm.NewLocal(mesh, devices[0])
	return world, func() error { return nil }, err
}

// newLogged is New with its log lines in the returned buffer.
func newLogged(t *testing.T, cfg Config, opts ...Option) (*Engine, *bytes.Buffer, error) {
	t.Helper()
	var log bytes.Buffer
	eng, err := New(cfg, append(opts, WithLogger(zerolog.New(zerolog.SyncWriter(&log))))...)
	return eng, &log, err
}

// TestBackendNeedsItsDriver: without WithDrivers the engine has only the
// CPU: auto trains there saying so, and train.backend: cuda fails naming
// the option.
func TestBackendNeedsItsDriver(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Train.Backend = "auto"
	eng, log, err := newLogged(t, cfg)
	if err != nil || eng.BackendName() != "cpu" || !strings.Contains(log.String(), "no backend but the CPU's is linked") {
		t.Errorf("auto without drivers: %v; log:\n%s", err, log)
	}
	cfg.Train.Backend = "cuda"
	_, err = New(cfg)
	if err == nil || !strings.HasPrefix(err.Error(), "train.backend: cuda: no cuda backend is linked into this program") ||
		!strings.Contains(err.Error(), "engine.WithDrivers") {
		t.Errorf("cuda without drivers: %v", err)
	}
	if _, err := New(cfg, WithDrivers(&fakeDriver{}, &fakeDriver{})); err == nil || !strings.Contains(err.Error(), `two drivers called "cuda"`) {
		t.Errorf("two drivers of one name: %v", err)
	}
}

// TestPickDriver: auto and cuda take the driver's device, logged as
// before, and Close closes it; a model beyond the driver's limits, a
// machine without its device and a device that fails send auto to the
// CPU and fail cuda, each with its reason.
func TestPickDriver(t *testing.T) {
	cfg := equivalenceConfig()
	for _, name := range []string{"auto", "cuda"} {
		d := &fakeDriver{}
		cfg.Train.Backend = name
		eng, log, err := newLogged(t, cfg, WithDrivers(d))
		if err != nil || eng.BackendName() != "cuda" || !strings.Contains(log.String(), "backend "+name+": using Fake GPU (GPU 0)") {
			t.Fatalf("%s: %v; log:\n%s", name, err, log)
		}
		if err := eng.Close(); err != nil || d.opened != 1 || d.closed != 1 {
			t.Errorf("%s: Close: %v; %d opened, %d closed", name, err, d.opened, d.closed)
		}
	}

	small := registry.Limits{RouterMaxExperts: 2, RouterMaxTopK: 8, AttnMaxHeadDim: 128}
	noGPU := &registry.NoDeviceError{Reason: "cuda: no libcuda found", Err: errors.New("cuda: no libcuda found; looked in:\n\t/x")}
	for _, c := range []struct {
		name      string
		d         *fakeDriver
		autoLog   string
		cudaError string
	}{
		{"limits", &fakeDriver{limits: small}, "backend auto: training on the CPU, since model.moe.experts is 4 and model.moe.top_k 2: the CUDA router handles at most 2 experts and top-8",
			"train.backend: cuda: model.moe.experts is 4 and model.moe.top_k 2: the CUDA router handles at most 2 experts and top-8"},
		{"head dim", &fakeDriver{limits: registry.Limits{AttnMaxHeadDim: 4}}, "the head dim (model.dim / model.heads) is 8: the CUDA attention kernels take at most 4",
			"train.backend: cuda: the head dim"},
		{"no GPU", &fakeDriver{err: noGPU}, "backend auto: no GPU (cuda: no libcuda found), training on the CPU", "train.backend: cuda: cuda: no libcuda found; looked in:\n\t/x"},
		{"failed", &fakeDriver{err: errors.New("out of memory")},
			`"level":"warn","message":"backend auto: the GPU cannot be used (out of memory), training on the CPU; set train.backend: cuda to make this an error"`,
			"train.backend: cuda: out of memory"},
	} {
		cfg.Train.Backend = "auto"
		eng, log, err := newLogged(t, cfg, WithDrivers(c.d))
		if err != nil || eng.BackendName() != "cpu" || !strings.Contains(log.String(), c.autoLog) {
			t.Errorf("%s: auto: %v; log:\n%s", c.name, err, log)
		}
		cfg.Train.Backend = "cuda"
		if _, err := New(cfg, WithDrivers(c.d)); err == nil || !strings.HasPrefix(err.Error(), c.cudaError) {
			t.Errorf("%s: cuda: %v, want %q", c.name, err, c.cudaError)
		}
		if c.d.opened != 0 {
			t.Errorf("%s: %d devices opened", c.name, c.d.opened)
		}
	}
}

// TestRankPerDevice: a driver that places one rank per device takes a
// layout's ranks onto as many devices, when it has them, and trains the
// same steps as virtual ranks do; with fewer devices the ranks are
// virtual ranks of device 0. Under fused the groups are asked for peer
// access, under unfused not.
func TestRankPerDevice(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch = 2, 2, 2
	cfg.Train.Steps = 3
	cfg.Model.MoE.Dispatcher = moe.DispatcherFused
	want := trainLosses(t, cfg)

	cfg.Train.Backend = "cuda"
	for _, visible := range []int{4, 2} {
		p := &fakePlacer{fakeDriver: &fakeDriver{}, visible: visible}
		var got []float64
		eng, log, err := newLogged(t, cfg, WithDrivers(p), WithHook(func(ev StepEvent) { got = append(got, ev.Loss) }))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := eng.Run(context.Background()); err != nil {
			t.Fatalf("%d devices: %v", visible, err)
		}
		if err := eng.Close(); err != nil {
			t.Fatal(err)
		}
		placed := visible >= 4
		wantLog := "parallel: 4 ranks on 4 GPUs, one each, FAKE between them (peer access: true)"
		if !placed {
			wantLog = "parallel: 4 ranks as virtual ranks on GPU 0 (2 GPUs visible; one rank per GPU needs 4)"
		}
		if !strings.Contains(log.String(), wantLog) {
			t.Errorf("%d devices: log:\n%s\nwant %q", visible, log, wantLog)
		}
		if wantOpened := map[bool]int{true: 4, false: 1}[placed]; p.opened != wantOpened || p.closed != p.opened {
			t.Errorf("%d devices: %d opened, %d closed; want %d both", visible, p.opened, p.closed, wantOpened)
		}
		if placed && (len(p.peers) != 1 || !p.peers[0]) {
			t.Errorf("%d devices: peer access asked %v, want once", visible, p.peers)
		}
		if len(got) != len(want) {
			t.Fatalf("%d devices: %d losses, want %d", visible, len(got), len(want))
		}
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("%d devices: step %d: loss %.9g, %.9g on virtual ranks of the CPU", visible, i+1, got[i], want[i])
			}
		}
	}

	cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
	p := &fakePlacer{fakeDriver: &fakeDriver{}, visible: 4}
	eng, err := New(cfg, WithDrivers(p))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	_, _, release, err := eng.placeRanks()
	if err != nil {
		t.Fatal(err)
	}
	if err := release(); err != nil || len(p.peers) != 1 || p.peers[0] {
		t.Errorf("unfused: release %v, peer access asked %v; want once, not", err, p.peers)
	}
}
