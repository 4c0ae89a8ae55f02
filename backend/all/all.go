// Package all links every backend driver mktrain has, for programs that
// should train on whatever the machine offers:
//
//	eng, err := engine.New(cfg, engine.WithDrivers(all.Drivers()...))
//
// Importing it is what puts the CUDA backend (and its purego loader) into
// a binary; a program that trains only on the CPU leaves it out.
package all

import (
	"github.com/mktrain/mktrain/backend/cuda"
	"github.com/mktrain/mktrain/backend/registry"
)

// Drivers are the drivers of every accelerator backend, in the order
// train.backend: auto tries them, each with its default options (for
// cuda: the libraries from the process environment, the default kernel
// cache).
func Drivers() []registry.Driver {
	return []registry.Driver{cuda.NewDriver(cuda.Options{})}
}
