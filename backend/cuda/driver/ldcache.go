package driver

// A reader for glibc's loader cache (/etc/ld.so.cache), so the search can
// name the file the dynamic loader would pick without running ldconfig. The
// layout follows glibc's sysdeps/generic/dl-cache.h: an optional old-format
// table ("ld.so-1.7.0"), then the new format ("glibc-ld.so.cache1.1") whose
// string offsets count from the start of its own header.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
)

const (
	ldCacheOldMagic = "ld.so-1.7.0"
	ldCacheNewMagic = "glibc-ld.so.cache1.1"

	ldOldHeader   = 16 // magic[11], pad, uint32 nlibs
	ldOldEntry    = 12 // int32 flags, uint32 key, uint32 value
	ldNewHeader   = 48 // magic+version[20], nlibs, len_strings, flags, pad[3], ext offset, unused[3]
	ldNewEntry    = 24 // int32 flags, uint32 key, uint32 value, uint32 osversion, uint64 hwcap
	ldFlagELFLibc = 0x0003
)

// ldCacheFlags is the entry flag word of 64-bit libc6 libraries for this
// machine: FLAG_ELF_LIBC6 plus the architecture bits ldconfig prints as
// "(libc6,x86-64)" or "(libc6,AArch64)".
func ldCacheFlags() int32 {
	if runtime.GOARCH == "arm64" {
		return 0x0a00 | ldFlagELFLibc
	}
	return 0x0300 | ldFlagELFLibc
}

// parseLdCache returns soname -> path for the entries whose flags equal
// flags. The first entry of a name wins, as in the loader.
func parseLdCache(data []byte, flags int32) (map[string]string, error) {
	base := 0
	if bytes.HasPrefix(data, []byte(ldCacheOldMagic)) {
		if len(data) < ldOldHeader {
			return nil, errors.New("truncated old-format header")
		}
		n := int(binary.LittleEndian.Uint32(data[12:16]))
		base = ldOldHeader + n*ldOldEntry
		base = (base + 7) &^ 7
	}
	if base+ldNewHeader > len(data) || !bytes.HasPrefix(data[base:], []byte(ldCacheNewMagic)) {
		return nil, errors.New("not a glibc 1.1 loader cache")
	}
	h := data[base:]
	n := int(binary.LittleEndian.Uint32(h[20:24]))
	if n < 0 || ldNewHeader+n*ldNewEntry > len(h) {
		return nil, fmt.Errorf("header claims %d entries, file holds fewer", n)
	}
	str := func(off uint32) (string, error) {
		if int(off) >= len(h) {
			return "", fmt.Errorf("string offset %d past the end", off)
		}
		s := h[off:]
		end := bytes.IndexByte(s, 0)
		if end < 0 {
			return "", fmt.Errorf("string at %d not terminated", off)
		}
		return string(s[:end]), nil
	}
	out := make(map[string]string, n)
	for i := range n {
		e := h[ldNewHeader+i*ldNewEntry:]
		if int32(binary.LittleEndian.Uint32(e[0:4])) != flags {
			continue
		}
		key, err := str(binary.LittleEndian.Uint32(e[4:8]))
		if err != nil {
			return nil, err
		}
		val, err := str(binary.LittleEndian.Uint32(e[8:12]))
		if err != nil {
			return nil, err
		}
		if _, dup := out[key]; !dup {
			out[key] = val
		}
	}
	return out, nil
}
