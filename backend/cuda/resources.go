package cuda

// What ptxas allots each kernel, read without a GPU: NVRTC compiles a
// source as Compile does, with ptxas's verbose report, and the report is
// parsed per kernel. Registers, local memory and ptxas's performance notes
// (C7512: wgmma serialized for want of registers; C7514 and C7515: for
// other instructions touching an accumulator in flight) are what decide a
// Hopper kernel's speed before it ever runs, and a kernel's count can
// change with code far from its loop (kernels/attention_hopper.md,
// "Registers and the trap").

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// KernelResources is ptxas's report on one kernel (entry function).
type KernelResources struct {
	Name      string
	Registers int // at entry; a kernel with setmaxnreg runs regions at other counts
	// StackBytes is the kernel's stack frame; SpillStores and SpillLoads
	// the bytes of spill code in it (local memory a thread).
	StackBytes, SpillStores, SpillLoads int
	// Notes are ptxas's numbered remarks on the kernel, e.g. "C7512:
	// Potential Performance Loss: wgmma.mma_async instructions are
	// serialized due to insufficient register resources".
	Notes []string
}

// Spills says whether ptxas put any of the kernel's values in local memory.
func (k KernelResources) Spills() bool { return k.SpillStores > 0 || k.SpillLoads > 0 }

// CompileResources compiles source for arch as Compile would (the same
// options, the given defines added, neither mktrain's cache nor NVRTC's)
// and returns ptxas's report for each of its kernels, by name, and the
// cubin (for cuobjdump -sass). It needs NVRTC only, no GPU.
func CompileResources(nv *driver.NVRTC, name, source, arch string, defines ...string) ([]KernelResources, []byte, error) {
	major, minor := nv.Version()
	cubin, log, err := nv.Compile(name, source, resourceOptions(arch, major, minor, defines...), driver.OutputCubin)
	if err != nil {
		return nil, nil, err
	}
	ks, err := parsePtxasReport(log)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", name, err)
	}
	return ks, cubin, nil
}

// resourceOptions are CompileResources' NVRTC options for NVRTC
// major.minor: Compile's, the defines, ptxas's report and, from 12.9 on,
// NVRTC's own compile cache off. A cubin served from that cache comes
// with no ptxas report: the GPU suite's second run on one machine (NVRTC
// 13.0) found none for every unchanged source.
func resourceOptions(arch string, major, minor int, defines ...string) []string {
	opts := append(compileOptions(arch, defines...), "--ptxas-options=--verbose")
	if major > 12 || major == 12 && minor >= 9 {
		opts = append(opts, "--no-cache")
	}
	return opts
}

var (
	ptxasEntry = regexp.MustCompile(`Compiling entry function '([^']+)'`)
	ptxasProps = regexp.MustCompile(`Function properties for (\S+)`)
	ptxasStack = regexp.MustCompile(`(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads`)
	ptxasUsed  = regexp.MustCompile(`Used (\d+) registers`)
	ptxasNote  = regexp.MustCompile(`\((C\d+)\) (.*?)\s*(?:in|for) the function '([^']+)'`)
)

// parsePtxasReport reads ptxas's --verbose output: per entry function a
// "Compiling entry function" line, "Function properties for" blocks (the
// entry's own and those of the functions it calls) and a "Used N
// registers" line; remarks name their function and may come first.
func parsePtxasReport(log string) ([]KernelResources, error) {
	byName := map[string]*KernelResources{}
	var order []string
	notes := map[string][]string{}
	cur, props := "", ""
	for _, line := range strings.Split(log, "\n") {
		if m := ptxasNote.FindStringSubmatch(line); m != nil {
			notes[m[3]] = append(notes[m[3]], m[1]+": "+strings.TrimSpace(m[2]))
			continue
		}
		if m := ptxasEntry.FindStringSubmatch(line); m != nil {
			cur, props = m[1], ""
			if byName[cur] == nil {
				byName[cur] = &KernelResources{Name: cur}
				order = append(order, cur)
			}
			continue
		}
		if m := ptxasProps.FindStringSubmatch(line); m != nil {
			props = m[1]
			continue
		}
		if cur == "" {
			continue
		}
		k := byName[cur]
		if m := ptxasStack.FindStringSubmatch(line); m != nil && props == cur {
			k.StackBytes, _ = strconv.Atoi(m[1])
			k.SpillStores, _ = strconv.Atoi(m[2])
			k.SpillLoads, _ = strconv.Atoi(m[3])
		} else if m := ptxasUsed.FindStringSubmatch(line); m != nil {
			k.Registers, _ = strconv.Atoi(m[1])
		}
	}
	if len(order) == 0 {
		return nil, fmt.Errorf("ptxas reported no entry function (was --ptxas-options=--verbose passed?)")
	}
	out := make([]KernelResources, 0, len(order))
	for _, name := range order {
		k := byName[name]
		if k.Registers == 0 {
			return nil, fmt.Errorf("ptxas reported no register count for %s", name)
		}
		k.Notes = notes[name]
		out = append(out, *k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}
