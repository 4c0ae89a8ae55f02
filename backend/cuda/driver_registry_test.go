package cuda

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/comm"
)

// TestDriverDeclares: the driver's limits are the kernels' constants.
func TestDriverDeclares(t *testing.T) {
	d := NewDriver(Options{})
	c := d.Capabilities()
	if d.Name() != "cuda" || c.Device != "GPU" || c.Collectives != "NCCL" || c.VisibleEnv != "CUDA_VISIBLE_DEVICES" || !c.PeerAccess {
		t.Errorf("%s: %+v", d.Name(), c)
	}
	if want := (registry.Limits{RouterMaxExperts: RouterMaxExperts, RouterMaxTopK: RouterMaxTopK, AttnMaxHeadDim: MaxAttnHeadDim}); c.Limits != want {
		t.Errorf("limits %+v, want %+v", c.Limits, want)
	}
}

// TestDriverOpenWithoutGPU: where the libraries are missing (a search
// under an empty root), Open says so with a NoDeviceError whose reason is
// one line (auto's log) and whose text is the whole story.
func TestDriverOpenWithoutGPU(t *testing.T) {
	dir := t.TempDir()
	d := NewDriver(Options{Search: driver.Search{Root: dir, Getenv: func(string) string { return "" }}, NoKernelCache: true})
	dev, err := d.Open()
	var none *registry.NoDeviceError
	if !errors.As(err, &none) {
		t.Fatalf("Open with no libraries: %v, %v; want a NoDeviceError", dev, err)
	}
	if strings.Contains(none.Reason, "\n") || strings.HasSuffix(none.Reason, "; looked in:") || !strings.HasPrefix(err.Error(), none.Reason) || !strings.Contains(err.Error(), "looked in:") {
		t.Errorf("reason %q of %q", none.Reason, err)
	}
}

func TestDriverWorldID(t *testing.T) {
	d := NewDriver(Options{})
	blob := comm.NewRunBlob()
	if _, err := d.WorldIDFromBlob(blob[:]); err == nil || !strings.Contains(err.Error(), "holds no NCCL unique id") {
		t.Errorf("a blob without an id: %v", err)
	}
	id := bytes.Repeat([]byte{7}, NCCLUniqueIDBytes)
	runID := comm.RunIDFromBlob(blob)
	if err := d.PutWorldID(blob[:], id); err != nil {
		t.Fatal(err)
	}
	got, err := d.WorldIDFromBlob(blob[:])
	if err != nil || !bytes.Equal(got, id) || comm.RunIDFromBlob(blob) != runID {
		t.Errorf("round trip: %x, %v; run id kept: %v", got, err, comm.RunIDFromBlob(blob) == runID)
	}
	if err := d.PutWorldID(blob[:10], id); err == nil {
		t.Error("a short blob took an id")
	}
	if err := d.PutWorldID(blob[:], id[:5]); err == nil {
		t.Error("a short id was put")
	}
	if _, err := d.WorldIDFromBlob(blob[:10]); err == nil {
		t.Error("a short blob gave an id")
	}
	node := registry.Node{Mesh: comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, NNodes: 1, World: id[:5]}
	if _, _, err := d.NodeRanks(context.Background(), node); err == nil || !strings.Contains(err.Error(), "world id of 5 bytes") {
		t.Errorf("a short world id: %v", err)
	}
}

// cpuDevice is a device of another driver.
type cpuDevice struct{ *cpu.Backend }

func (cpuDevice) Describe() string { return "the CPU" }
func (cpuDevice) Close() error     { return nil }

// TestDriverRefusesOtherDevices: the placement methods take only GPUs
// this driver opened.
func TestDriverRefusesOtherDevices(t *testing.T) {
	d := NewDriver(Options{})
	other := cpuDevice{cpu.New(backend.Float32)}
	if _, _, err := d.OpenBeside(other, 2); err == nil || !strings.Contains(err.Error(), "not a GPU the cuda driver opened") {
		t.Errorf("OpenBeside: %v", err)
	}
	if _, _, err := d.MeshRanks(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, []registry.Device{other}, registry.MeshOptions{}); err == nil || !strings.Contains(err.Error(), "device 0") {
		t.Errorf("MeshRanks: %v", err)
	}
	if _, _, err := d.OpenBeside(nil, 2); err == nil {
		t.Error("OpenBeside of no device")
	}
}
