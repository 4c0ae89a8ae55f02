package plan

// Byte arithmetic that cannot wrap, size classes, and byte counts as
// people write them.

import (
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"strings"
	"unicode"
)

// Saturated is the value a count takes once it no longer fits in an
// int64: every product and sum here stops at it instead of wrapping, so
// a recipe of absurd sizes gives a plan that says "more than 8 EiB" and
// is refused, never a negative or small number.
const Saturated = int64(math.MaxInt64)

// mul is the product of non-negative xs, Saturated when it overflows.
func mul(xs ...int64) int64 {
	p := int64(1)
	for _, x := range xs {
		if x <= 0 {
			return 0
		}
		hi, lo := bits.Mul64(uint64(p), uint64(x))
		if hi != 0 || lo > uint64(math.MaxInt64) {
			return Saturated
		}
		p = int64(lo)
	}
	return p
}

// add is the sum of non-negative xs, Saturated when it overflows.
func add(xs ...int64) int64 {
	s := int64(0)
	for _, x := range xs {
		if x >= Saturated-s {
			return Saturated
		}
		s += x
	}
	return s
}

// roundUp is n rounded up to a multiple of m (m > 0).
func roundUp(n, m int64) int64 {
	if n >= Saturated-m {
		return Saturated
	}
	return (n + m - 1) / m * m
}

// ceilDiv is a/b rounded up, for a >= 0 and b > 0.
func ceilDiv(a, b int64) int64 {
	if a == Saturated {
		return Saturated
	}
	return (a + b - 1) / b
}

// cudaMinClass, CUDAFineClassesAbove and cudaSizeClass mirror
// backend/cuda/memory.go's minClass, fineAbove and sizeClass: the caching
// allocator reserves every block rounded up to at least 512 bytes, else to
// one of four steps per power of two (n in (2^(k-1), 2^k] rounds up to a
// multiple of 2^(k-3)), above 1 GiB to one of 32 (a multiple of 2^(k-6)),
// and its peak counts the reserved bytes. One flat store of 2.6 GB
// reserves 2.7 GB; one of 18.6 GB (17.3 GiB) 18.8 GB (17.5 GiB).
const (
	cudaMinClass         = 512
	CUDAFineClassesAbove = 1 << 30
)

func cudaSizeClass(n int64) int64 { return sizeClass(n, CUDAFineClassesAbove) }

// sizeClass is cudaSizeClass with the finer classes above fineAbove (0:
// none, every block in quarter steps).
func sizeClass(n, fineAbove int64) int64 {
	if n <= cudaMinClass {
		return cudaMinClass
	}
	if n == Saturated {
		return Saturated
	}
	k := bits.Len64(uint64(n - 1))
	shift := 3
	if fineAbove > 0 && n > fineAbove {
		shift = 6
	}
	return roundUp(n, int64(1)<<(k-shift))
}

// FormatBytes writes n in binary units, "22.7 GiB"; Saturated reads
// "more than 8 EiB".
func FormatBytes(n int64) string {
	if n == Saturated {
		return "more than 8 EiB"
	}
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v := float64(n)
	for _, u := range []string{"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"} {
		v /= unit
		if v < unit || u == "EiB" {
			return fmt.Sprintf("%.1f %s", v, u)
		}
	}
	return fmt.Sprintf("%d B", n)
}

// ParseBytes reads a byte count as people write one: "141GiB", "80 GB",
// "512MiB", "1.5TiB" or a plain number of bytes. The binary units (KiB,
// MiB, GiB, TiB) are powers of 1024, the decimal ones (kB, MB, GB, TB)
// powers of 1000; "141G" is read as GiB.
func ParseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := strings.IndexFunc(t, func(r rune) bool { return !unicode.IsDigit(r) && r != '.' })
	num, unit := t, ""
	if i >= 0 {
		num, unit = t[:i], strings.TrimSpace(t[i:])
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || num == "" {
		return 0, fmt.Errorf("%q is not a size: write a number and a unit, such as 141GiB or 80GB", s)
	}
	scale, ok := map[string]float64{
		"": 1, "b": 1,
		"k": 1 << 10, "kib": 1 << 10, "kb": 1e3,
		"m": 1 << 20, "mib": 1 << 20, "mb": 1e6,
		"g": 1 << 30, "gib": 1 << 30, "gb": 1e9,
		"t": 1 << 40, "tib": 1 << 40, "tb": 1e12,
	}[strings.ToLower(unit)]
	if !ok {
		return 0, fmt.Errorf("%q is not a size: the unit %q is none of B, KiB, MiB, GiB, TiB, kB, MB, GB, TB", s, unit)
	}
	bytes := v * scale
	if bytes <= 0 || bytes >= math.MaxInt64 {
		return 0, fmt.Errorf("%q is not a size: it must be positive and below 8 EiB", s)
	}
	return int64(bytes), nil
}
