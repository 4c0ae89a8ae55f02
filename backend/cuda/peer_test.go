package cuda

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestPeerTableMatchesKernel: the words per rank that peer.go uploads are
// those peer_rows.cu reads.
func TestPeerTableMatchesKernel(t *testing.T) {
	_, text := kernelSource(t, "peer_rows.cu")
	for name, want := range map[string]int{"PR_GATHER_WORDS": peerGatherWords, "PR_SCATTER_WORDS": peerScatterWords} {
		m := regexp.MustCompile(`#define ` + name + ` (\d+)`).FindStringSubmatch(text)
		if m == nil || m[1] != fmt.Sprint(want) {
			t.Errorf("peer_rows.cu defines %s as %v, peer.go uploads %d words", name, m, want)
		}
	}
}

// TestPeerOpsBadArguments checks, without a GPU, that bad calls of the
// peer-row ops panic naming the op and the problem before anything touches
// the device, and that calls with no rows return without touching it.
func TestPeerOpsBadArguments(t *testing.T) {
	b := &Backend{} // no device: any use of it would crash
	tensor := func(dt backend.DType, shape ...int) *Tensor { return &Tensor{st: &storage{}, shape: shape, dt: dt} }
	f := func(shape ...int) backend.Tensor { return tensor(backend.Float32, shape...) }
	i32 := func(shape ...int) backend.Tensor { return tensor(backend.Int32, shape...) }
	ts := func(x ...backend.Tensor) []backend.Tensor { return x }
	src, tok := ts(f(3, 4), f(2, 4)), ts(i32(2), i32(1))
	for _, c := range []struct {
		name, want string
		call       func()
	}{
		{"lists", "cuda.GatherPeerRows: 2 sources, 1 token lists and 0 scale lists", func() { b.GatherPeerRows(f(1, 4), src, tok[:1], nil, i32(1, 2)) }},
		{"nil tokens", "cuda.GatherPeerRows: token list of rank 1 is nil", func() { b.GatherPeerRows(f(1, 4), src, ts(tok[0], nil), nil, i32(1, 2)) }},
		{"source width", "cuda.GatherPeerRows: source 1 has shape [2 5], want [2 4]", func() { b.GatherPeerRows(f(1, 4), ts(src[0], f(2, 5)), tok, nil, i32(1, 2)) }},
		{"source dtypes", "cuda.GatherPeerRows: source 1 is float32 and source 0 bfloat16; the sources must be of one dtype", func() {
			b.GatherPeerRows(f(1, 4), ts(tensor(backend.BFloat16, 3, 4), src[1]), tok, nil, i32(1, 2))
		}},
		{"bf16 sources into float32", "cuda.GatherPeerRows: the sources are bfloat16, which needs a bfloat16 out and no scales", func() {
			b.GatherPeerRows(f(1, 4), ts(tensor(backend.BFloat16, 3, 4), tensor(backend.BFloat16, 2, 4)), tok, nil, i32(1, 2))
		}},
		{"source dtype", "cuda.GatherPeerRows: source 0 is int32", func() {
			b.GatherPeerRows(f(1, 4), ts(tensor(backend.Int32, 3, 4), src[1]), tok, nil, i32(1, 2))
		}},
		{"token dtype", "cuda.GatherPeerRows: tokens 0 is float32, want int32", func() { b.GatherPeerRows(f(1, 4), src, ts(f(2), tok[1]), nil, i32(1, 2)) }},
		{"scale length", "cuda.GatherPeerRows: scale 1 has shape [2] (2 elements), want 1 elements", func() { b.GatherPeerRows(f(1, 4), src, tok, ts(f(2), f(2)), i32(1, 2)) }},
		{"out dtype", "cuda.GatherPeerRows: out is int32, want float32 or bfloat16", func() { b.GatherPeerRows(i32(1, 4), src, tok, nil, i32(1, 2)) }},
		{"refs nil", "cuda.GatherPeerRows: refs is nil", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, nil) }},
		{"refs shape", "cuda.GatherPeerRows: refs is int32 [2], want int32 [R 2]", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, i32(2)) }},
		{"refs rows", "cuda.GatherPeerRows: refs has 3 rows, out 2", func() { b.GatherPeerRows(f(2, 4), src, tok, nil, i32(3, 2)) }},
		{"no ranks", "cuda.GatherPeerRows: 1 rows refer to ranks, but no rank's tensors were given", func() { b.GatherPeerRows(f(1, 4), nil, nil, nil, i32(1, 2)) }},
		{"other backend", "cuda.GatherPeerRows: refs is a", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, fake{}) }},
		{"scatter out width", "cuda.ScatterPeerRows: out 1 has shape [1 3], want [1 4]", func() { b.ScatterPeerRows(ts(f(2, 4), f(1, 3)), f(1, 4), i32(1, 2)) }},
		{"scatter in", "cuda.ScatterPeerRows: in has shape [4], want a 2-D tensor", func() { b.ScatterPeerRows(ts(f(2, 4)), f(4), i32(1, 2)) }},
		{"scatter bf16 into float", "cuda.ScatterPeerRows: out 0 is float32, want bfloat16", func() { b.ScatterPeerRows(ts(f(2, 4)), tensor(backend.BFloat16, 1, 4), i32(1, 2)) }},
		{"scatter int32 in", "cuda.ScatterPeerRows: in is int32", func() { b.ScatterPeerRows(ts(f(2, 4)), tensor(backend.Int32, 1, 4), i32(1, 2)) }},
		{"scatter refs rows", "cuda.ScatterPeerRows: refs has 2 rows, in 1", func() { b.ScatterPeerRows(ts(f(2, 4), f(1, 4)), f(1, 4), i32(2, 2)) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				r := recover()
				if r == nil {
					t.Fatalf("no panic, want %q", c.want)
				}
				if msg := fmt.Sprint(r); !strings.Contains(msg, c.want) {
					t.Fatalf("panic %q, want it to contain %q", msg, c.want)
				}
			}()
			c.call()
		})
	}
	// No rows: nothing to launch, so nothing touches the (missing) device.
	b.GatherPeerRows(f(0, 4), src, tok, ts(f(2), f(1)), i32(0, 2))
	b.GatherPeerRows(tensor(backend.BFloat16, 0, 4), nil, nil, nil, i32(0, 2))
	b.ScatterPeerRows(ts(f(2, 4), f(1, 4)), f(0, 4), i32(0, 2))
}

// fake is a tensor of no backend.
type fake struct{}

func (fake) Shape() []int         { return []int{1, 2} }
func (fake) DType() backend.DType { return backend.Int32 }
func (fake) Len() int             { return 2 }
