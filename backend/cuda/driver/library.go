package driver

import (
	"fmt"

	"github.com/ebitengine/purego"
)

// Library is one dlopened shared library.
type Library struct {
	Found
	handle uintptr
}

// Open finds lib with s and dlopens it. Libraries stay loaded for the life
// of the process: dlopen counts references, so opening one twice is cheap
// and returns the same code.
func (s Search) Open(lib Lib) (*Library, error) {
	f, err := s.Find(lib)
	if err != nil {
		return nil, err
	}
	// RTLD_GLOBAL lets libraries loaded later (cuBLASLt, NCCL) bind to the
	// same libcuda this process already holds.
	h, err := purego.Dlopen(f.Path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("cuda: dlopen %s (found via %s): %w", f.Path, f.Via, err)
	}
	return &Library{Found: f, handle: h}, nil
}

// Symbol returns the address of a C function in the library.
func (l *Library) Symbol(name string) (uintptr, error) {
	p, err := purego.Dlsym(l.handle, name)
	if err != nil || p == 0 {
		return 0, fmt.Errorf("cuda: %s has no symbol %s (is it too old?)", l.Path, name)
	}
	return p, nil
}

// symbols resolves a table of name -> destination in one pass, so a missing
// symbol is reported with the library's path before anything is called.
func (l *Library) symbols(table map[string]*uintptr) error {
	for name, dst := range table {
		p, err := l.Symbol(name)
		if err != nil {
			return err
		}
		*dst = p
	}
	return nil
}
