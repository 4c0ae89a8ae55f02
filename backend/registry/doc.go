// Package registry is how a program says which backends it can train on,
// and how the engine finds them without importing any of them.
//
// A backend other than the CPU reference is reached through its Driver:
// a value with a name ("cuda"), the capabilities and size limits of its
// kernels (Capabilities), and an Open that returns the backend on the
// first device of the machine. Drivers are not registered by init
// functions: a program builds a Set of the drivers it links and hands it
// to the engine, which then resolves train.backend by name:
//
//	drivers, err := registry.NewSet(all.Drivers()...) // package backend/all
//	opened, err := drivers.Open("auto", fits)          // a driver, else the CPU
//	defer opened.Close()
//
// or, through the engine, engine.New(cfg, engine.WithDrivers(all.Drivers()...)).
// The CPU backend (backend/cpu) is always there and is no driver: "cpu"
// names it, and "auto" falls back to it, saying why (Opened.Notes), when
// no driver's device can be used. A driver tells "there is no device of my
// kind on this machine" (no library, no device) from a device that failed
// by returning a *NoDeviceError from Open.
//
// Optional capabilities are discovered by type assertion, as
// database/sql/driver does: a Driver that also implements RankPerDevice
// lets a process train one rank per device, with the driver's own groups
// (NCCL for cuda) between them; one that implements MultiProcess lets
// processes on several machines form one world of devices, whose id
// travels in the rendezvous blob.
//
// The package imports only package backend, the CPU backend and comm, so
// that the engine, moe and attention depend on no concrete accelerator.
package registry
