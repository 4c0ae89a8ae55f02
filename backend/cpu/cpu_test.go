package cpu_test

import (
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
)

// TestConformance runs the suite with the float32 backend against the
// float64 one.
func TestConformance(t *testing.T) {
	backendtest.RunAll(t, cpu.New(backend.Float32), cpu.New(backend.Float64))
}

// TestGradCheck proves the float64 backend against finite differences and
// naive references.
func TestGradCheck(t *testing.T) {
	backendtest.GradCheck(t, cpu.New(backend.Float64))
}

// TestAdamWSplitFloat32: split masters are float32, which GradCheck's
// float64 backend refuses; the float32 backend updates them bit for bit
// as its AdamWUpdate updates float32 masters.
func TestAdamWSplitFloat32(t *testing.T) {
	backendtest.CheckAdamWSplit(t, cpu.New(backend.Float32))
}
