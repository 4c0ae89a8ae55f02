// Package dev holds the experiments on the kernels of package kernels:
// lab copies of a production source with compile-time switches, each
// build worth measuring listed as a Variant. The backend never loads
// them; backend/cuda's tests do, on request (MKTRAIN_GG_VARIANTS), to
// check the exact variants against the CPU and to time every variant
// against the production kernels (README.md says how).
//
// A lab source includes the production headers (kernels.Header) and,
// built with no define, compiles to its production source's PTX
// (dev_test.go checks it with clang-19), so a variant's figure is read
// against what trains. This follows llm.c's dev/cuda: experiments beside
// their harness, the winner copied into the library by hand.
package dev

import (
	"embed"
	"fmt"
	"strings"

	"github.com/mktrain/mktrain/kernels"
)

//go:embed *.cu
var files embed.FS

// Source is one lab source and its builds.
type Source struct {
	File string // in this folder
	// Production is the kernels source it copies: the same kernels, and
	// with no define the same code.
	Production string
	Variants   []Variant
}

// Variant is a build of a lab source with preprocessor definitions that
// change some of its kernels. Its kernels keep their names, arguments
// and launch shapes, so the backend's tests run them in place of the
// production ones; a variant may also add kernels of its own, which a
// test of its own launches (backend/cuda's TestAttentionLabOwnLaunch).
type Variant struct {
	Name    string
	Defines []string // NVRTC and clang -D arguments, NAME=VALUE
	// Exact is set when the variant computes what the production kernels
	// do (only faster or slower): the same bits, or for an attention
	// variant run in place, the same results to the conformance tests'
	// tolerance (which it is then checked against); otherwise its results
	// are for timing only.
	Exact   bool
	Purpose string
}

// Sources lists the lab sources. A test checks it against the files.
func Sources() []Source {
	return []Source{
		{File: "attention_hopper_lab.cu", Production: "attention_hopper.cu"},
		{File: "moe_fused_lab.cu", Production: "moe_fused.cu", Variants: []Variant{
			// The gather of moe_dispatch_swiglu and moe_dispatch_dgrad.
			{Name: "bf16-sources", Defines: []string{"GG_EXPERIMENT=1"},
				Purpose: "the gather reads its float32 sources as bf16 rows: half the bytes loaded"},
			{Name: "no-gather-stores", Defines: []string{"GG_EXPERIMENT=2"},
				Purpose: "the gather loads its rows and stores none"},
			{Name: "streaming-loads", Defines: []string{"GG_EXPERIMENT=4"}, Exact: true,
				Purpose: "the gather's loads cache-streaming (ld.global.cs: evicted first)"},
			{Name: "no-gather-fences", Defines: []string{"GG_EXPERIMENT=16"},
				Purpose: "no fences before a chunk's flag is raised"},
			// What each part of the kernels costs (GG_MODE bits; the
			// names are the figures').
			{Name: "mode1", Defines: []string{"GG_MODE=1"}, Purpose: "no gather and no tile waits"},
			{Name: "mode2", Defines: []string{"GG_MODE=2"}, Purpose: "moe_dispatch_swiglu without act"},
			{Name: "mode3", Defines: []string{"GG_MODE=3"}, Purpose: "no gather, no waits, no act"},
			{Name: "mode4", Defines: []string{"GG_MODE=4"}, Purpose: "moe_dispatch_swiglu's act without silu"},
			{Name: "mode5", Defines: []string{"GG_MODE=5"}, Purpose: "no gather, no waits, act without silu"},
			{Name: "mode7", Defines: []string{"GG_MODE=7"}, Purpose: "no gather, no waits, no act (as mode3)"},
			{Name: "mode16", Defines: []string{"GG_MODE=16"}, Purpose: "moe_dispatch_swiglu's gather without the tile waits"},
			{Name: "mode32", Defines: []string{"GG_MODE=32"}, Purpose: "moe_dispatch_dgrad without dh1/dh3 stores"},
			{Name: "mode64", Defines: []string{"GG_MODE=64"}, Purpose: "moe_dispatch_dgrad without loads of h1/h3 boxes 2 and 3"},
			{Name: "mode96", Defines: []string{"GG_MODE=96"}, Purpose: "mode32 and mode64"},
			{Name: "mode128", Defines: []string{"GG_MODE=128"}, Exact: true, Purpose: "moe_dispatch_dgrad's gather unpaced"},
			{Name: "mode256", Defines: []string{"GG_MODE=256"}, Exact: true, Purpose: "moe_dispatch_dgrad's gather copy one step deep"},
		}},
	}
}

// Lookup returns the lab source named file.
func Lookup(file string) (Source, error) {
	for _, s := range Sources() {
		if s.File == file {
			return s, nil
		}
	}
	return Source{}, fmt.Errorf("kernels/dev: no source %q", file)
}

// Variant returns s's variant called name.
func (s Source) Variant(name string) (Variant, error) {
	for _, v := range s.Variants {
		if v.Name == name {
			return v, nil
		}
	}
	return Variant{}, fmt.Errorf("kernels/dev: %s has no variant %q", s.File, name)
}

// Kernels is the production source s copies, whose kernels s defines.
func (s Source) Kernels() (kernels.Source, error) {
	return kernels.Lookup(s.Production)
}

// Text is the compilable source: the prelude, then the file with the
// production headers it includes pasted in (kernels.Assemble).
func (s Source) Text() (string, error) {
	return kernels.Assemble(s.File, func(name string) ([]byte, error) {
		if strings.HasSuffix(name, ".cuh") {
			return kernels.Header(name)
		}
		return files.ReadFile(name)
	})
}

// Files lists the embedded lab sources, for the consistency test.
func Files() ([]string, error) {
	entries, err := files.ReadDir(".")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out, nil
}
