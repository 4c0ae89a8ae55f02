package cuda

import (
	"fmt"
	"math"
	"runtime"
	"unsafe"

	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// Module is one kernels source compiled for and loaded on a Device.
type Module struct {
	Info    CompileInfo
	src     kernels.Source
	mod     driver.Module
	kernels map[string]*Kernel
}

// Kernel is one entry point of a loaded module.
type Kernel struct {
	Desc kernels.Kernel
	fn   driver.Function
	// Registers per thread, from the cubin.
	Registers int
	// LocalBytes is the local memory per thread (registers the compiler
	// spilled, and stack), from the cubin.
	LocalBytes int
	// sharedOptIn is the dynamic shared memory the kernel is opted in to
	// (launchWithMaps); touched only on the device thread.
	sharedOptIn int
}

// CheckRegisterSplit returns an error unless k, a kernel of threads
// threads whose warpgroups trade registers with setmaxnreg, starts with
// the even split of the register file (65536/threads in steps of 8: 168 at
// 384 threads, 128 at 512), which its setmaxnreg counts assume: from any
// other count a warpgroup's setmaxnreg.inc would wait for registers
// forever. The (threads, 1) launch bound makes ptxas give that count.
func (k *Kernel) CheckRegisterSplit(threads int) error {
	if want := 65536 / threads &^ 7; k.Registers != want {
		return fmt.Errorf("cuda: %s has %d registers a thread, not the %d its setmaxnreg counts assume", k.Desc.Name, k.Registers, want)
	}
	return nil
}

// Load compiles (or reads from the cache) and loads a kernels source, and
// resolves all its kernels. It returns the same Module on later calls.
// Compiling runs on the calling goroutine, so sources may be loaded in
// parallel; only loading the cubin runs on the device thread.
func (d *Device) Load(src kernels.Source) (*Module, error) {
	return d.load(src, src.File, src.Text)
}

// load returns the module called key, compiled on first use from text
// (with a -D option for each of defines) and holding src's kernels: a
// source as Load takes it (key src.File), or a build of the tests' own (a
// fault-injection build, an experiment of kernels/dev) under a key of its
// own.
func (d *Device) load(src kernels.Source, key string, text func() (string, error), defines ...string) (*Module, error) {
	d.modMu.Lock()
	m, ok := d.modules[key]
	d.modMu.Unlock()
	if ok {
		return m, nil
	}
	source, err := text()
	if err != nil {
		return nil, err
	}
	img, info, err := d.rt.compile(key, source, d.info.Arch, false, defines...)
	if err != nil {
		return nil, err
	}
	m = &Module{Info: info, src: src, kernels: map[string]*Kernel{}}
	err = d.Do(func() error { return d.loadModule(m, img) })
	if err != nil && info.CacheHit {
		// A cached cubin the driver rejects (a damaged file, say): compile
		// afresh, which also rewrites the cache entry.
		img, info, err = d.rt.compile(key, source, d.info.Arch, true, defines...)
		if err != nil {
			return nil, err
		}
		m.Info = info
		err = d.Do(func() error { return d.loadModule(m, img) })
	}
	if err != nil {
		return nil, fmt.Errorf("cuda: loading %s: %w", key, err)
	}
	d.modMu.Lock()
	defer d.modMu.Unlock()
	if prev, ok := d.modules[key]; ok {
		// Another goroutine loaded it meanwhile; keep one.
		d.Submit(func() error { return d.drv.ModuleUnload(m.mod) })
		return prev, nil
	}
	d.modules[key] = m
	return m, nil
}

// loadModule runs on the device thread.
func (d *Device) loadModule(m *Module, img []byte) error {
	mod, err := d.drv.ModuleLoadData(img)
	if err != nil {
		return err
	}
	for _, k := range m.src.Kernels {
		fn, err := d.drv.ModuleGetFunction(mod, k.Name)
		if err != nil {
			d.drv.ModuleUnload(mod)
			return err
		}
		regs, err := d.drv.FuncAttribute(fn, driver.FuncNumRegs)
		if err != nil {
			d.drv.ModuleUnload(mod)
			return err
		}
		local, err := d.drv.FuncAttribute(fn, driver.FuncLocalSizeBytes)
		if err != nil {
			d.drv.ModuleUnload(mod)
			return err
		}
		m.kernels[k.Name] = &Kernel{Desc: k, fn: fn, Registers: regs, LocalBytes: local}
	}
	m.mod = mod
	return nil
}

// Kernel returns the kernel called name.
func (m *Module) Kernel(name string) (*Kernel, error) {
	k, ok := m.kernels[name]
	if !ok {
		return nil, fmt.Errorf("cuda: %s has no kernel %s", m.src.File, name)
	}
	return k, nil
}

// Grid is a launch shape.
type Grid struct {
	Grid, Block driver.Dim3
	Shared      int // bytes of dynamic shared memory
	// Cluster, when X is not 0, launches the grid in thread-block
	// clusters of this shape (cuLaunchKernelEx; each grid dimension a
	// multiple of the cluster's).
	Cluster driver.Dim3
}

// Grid1D is a grid of blocks x 1 x 1 with threads x 1 x 1.
func Grid1D(blocks, threads int) Grid {
	return Grid{Grid: driver.Dim3{X: blocks, Y: 1, Z: 1}, Block: driver.Dim3{X: threads, Y: 1, Z: 1}}
}

// StrideGrid sizes a grid-stride launch over n elements: enough blocks of
// threads to cover n, at most blocksPerSM per SM.
func (d *Device) StrideGrid(n int64, threads, blocksPerSM int) Grid {
	blocks := (n + int64(threads) - 1) / int64(threads)
	blocks = min(blocks, int64(blocksPerSM*d.info.SMs))
	return Grid1D(int(max(blocks, 1)), threads)
}

// Launch queues k on the device's stream with args, which must match the
// kernel's C parameters one for one: *Buffer or driver.DevicePtr for a
// pointer (a nil *Buffer is a null pointer), int32/uint32 for int/unsigned,
// int64/uint64 for long long, float32 for float, float64 for double.
// Plain int is refused, since its C width would be a guess. Argument errors
// return at once; launch errors return from the next Sync.
func (d *Device) Launch(k *Kernel, g Grid, args ...any) error {
	slots := make([]uint64, len(args))
	for i, a := range args {
		v, err := argBits(a)
		if err != nil {
			return fmt.Errorf("cuda: %s argument %d: %w", k.Desc.Name, i, err)
		}
		slots[i] = v
	}
	return d.Submit(func() error { return d.launchNow(k, g, slots) })
}

// LaunchSync is Launch that waits for the launch call (not the kernel) and
// returns its error.
func (d *Device) LaunchSync(k *Kernel, g Grid, args ...any) error {
	slots := make([]uint64, len(args))
	for i, a := range args {
		v, err := argBits(a)
		if err != nil {
			return fmt.Errorf("cuda: %s argument %d: %w", k.Desc.Name, i, err)
		}
		slots[i] = v
	}
	return d.Do(func() error { return d.launchNow(k, g, slots) })
}

// launchNow runs on the device thread. Each argument sits in its own
// 8-byte slot (little-endian, so a 4-byte parameter reads the low half);
// the pointer array and the slots stay pinned while the driver reads them.
func (d *Device) launchNow(k *Kernel, g Grid, slots []uint64) error {
	var pin runtime.Pinner
	defer pin.Unpin()
	var params []unsafe.Pointer
	if len(slots) > 0 {
		pin.Pin(&slots[0])
		params = make([]unsafe.Pointer, len(slots))
		for i := range slots {
			params[i] = unsafe.Pointer(&slots[i])
		}
		pin.Pin(&params[0])
	}
	return d.launchParams(k, g, params)
}

// launchParams runs on the device thread: k on grid g with the
// parameter list params (cuLaunchKernel, or cuLaunchKernelEx for a grid
// of clusters).
func (d *Device) launchParams(k *Kernel, g Grid, params []unsafe.Pointer) error {
	var err error
	if g.Cluster.X > 0 {
		err = d.drv.LaunchKernelCluster(k.fn, g.Grid, g.Block, g.Cluster, g.Shared, d.stream, params)
	} else {
		err = d.drv.LaunchKernel(k.fn, g.Grid, g.Block, g.Shared, d.stream, params)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", k.Desc.Name, err)
	}
	return nil
}

func argBits(a any) (uint64, error) {
	switch v := a.(type) {
	case *Buffer:
		if v == nil {
			return 0, nil
		}
		if v.ptr == 0 {
			return 0, fmt.Errorf("buffer was freed")
		}
		return uint64(v.ptr), nil
	case driver.DevicePtr:
		return uint64(v), nil
	case int32:
		return uint64(uint32(v)), nil
	case uint32:
		return uint64(v), nil
	case int64:
		return uint64(v), nil
	case uint64:
		return v, nil
	case float32:
		return uint64(math.Float32bits(v)), nil
	case float64:
		return math.Float64bits(v), nil
	case int:
		return 0, fmt.Errorf("plain int %d: pass int32 or int64 to match the C parameter", v)
	}
	return 0, fmt.Errorf("unsupported type %T", a)
}

// mappedParams encodes the tensor maps (on the device thread: encoding
// needs no context, and the maps were checked by the caller) and returns
// a kernel's parameter list: the maps by value first, then the 8-byte
// argument slots. pin holds all of it until the launch has read them.
// name(i) names map i in errors.
func mappedParams(enc *driver.TensorMapEncoder, maps []driver.TiledMap, slots []uint64, pin *runtime.Pinner, name func(int) string) ([]unsafe.Pointer, error) {
	tms := make([]driver.TensorMap, len(maps))
	for i, m := range maps {
		if err := enc.EncodeTiled(&tms[i], m); err != nil {
			return nil, fmt.Errorf("%s: %w", name(i), err)
		}
	}
	params := make([]unsafe.Pointer, 0, len(tms)+len(slots))
	for i := range tms {
		params = append(params, unsafe.Pointer(&tms[i]))
	}
	for i := range slots {
		params = append(params, unsafe.Pointer(&slots[i]))
	}
	if len(tms) > 0 {
		pin.Pin(&tms[0])
	}
	if len(slots) > 0 {
		pin.Pin(&slots[0])
	}
	if len(params) > 0 {
		pin.Pin(&params[0])
	}
	return params, nil
}
