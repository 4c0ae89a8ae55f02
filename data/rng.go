package data

// This file holds the package's randomness: a SplitMix64 generator whose
// whole state is one exported word, and the seeded permutation that orders
// windows in an epoch. Both are defined here, bit for bit, so that sampling
// never changes with the Go release (math/rand's algorithms are not
// promised to stay the same).

import "math/bits"

// SplitMix64 is Steele, Lea and Flood's SplitMix64 generator. The zero
// value is a valid generator; State may be saved and restored directly.
type SplitMix64 struct {
	State uint64
}

// Uint64 returns the next value.
func (r *SplitMix64) Uint64() uint64 {
	r.State += 0x9e3779b97f4a7c15
	return mix64(r.State)
}

// Intn returns a value in [0, n) by Lemire's multiply-high reduction (its
// bias, below n/2^64, does not matter here). n must be positive.
func (r *SplitMix64) Intn(n int) int {
	hi, _ := bits.Mul64(r.Uint64(), uint64(n))
	return int(hi)
}

// mix64 is SplitMix64's output function: a bijection of uint64 that
// scrambles every input bit into every output bit.
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

const feistelRounds = 6

// permutation is a seeded bijection of [0, n) with O(1) memory and random
// access: a balanced Feistel network over the smallest even number of bits
// that covers n, restricted to [0, n) by cycle walking (re-applying the
// network until the value lands in range; the domain is under 4n, so that
// takes fewer than four steps on average). An epoch of a billion windows
// thus needs no permutation table, and resuming at any index is free.
type permutation struct {
	n    uint64
	half uint   // bits in each Feistel half
	mask uint64 // (1<<half)-1
	keys [feistelRounds]uint64
}

func newPermutation(n, seed, epoch uint64) permutation {
	half := uint(bits.Len64(n-1)+1) / 2
	if n <= 1 || half == 0 {
		half = 1
	}
	p := permutation{n: n, half: half, mask: 1<<half - 1}
	// Keys come from a stream that depends on seed and epoch together, so
	// neighbouring seeds or epochs share no keys.
	r := SplitMix64{State: mix64(seed^0x6a09e667f3bcc909) ^ mix64(epoch+0xbb67ae8584caa73b)}
	for i := range p.keys {
		p.keys[i] = r.Uint64()
	}
	return p
}

// at is the i-th element of the permutation, for i < n.
func (p *permutation) at(i uint64) uint64 {
	if p.n <= 1 {
		return i
	}
	x := i
	for {
		l, r := x>>p.half, x&p.mask
		for _, k := range p.keys {
			l, r = r, l^(mix64(r^k)&p.mask)
		}
		x = l<<p.half | r
		if x < p.n {
			return x
		}
	}
}
