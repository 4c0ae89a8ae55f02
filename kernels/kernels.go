// Package kernels holds mktrain's CUDA C sources and describes them. The
// sources are embedded in the binary (go:embed) and compiled at run time by
// NVRTC for the GPU at hand (package backend/cuda), so building mktrain
// needs no CUDA toolkit.
//
// The files:
//   - prelude.cuh: reductions, warp shuffles, bf16 conversion; Source.Text
//     prepends it to every source.
//   - one .cu a family of kernels (elementwise.cu, rmsnorm.cu, ...), each
//     compiled by itself into one module; Sources lists them.
//   - the grouped GEMM family of the MoE experts (sm_90a only):
//     hopper.cuh (wgmma, TMA and mbarrier wrappers), grouped_gemm.cuh (the
//     pipeline every grouped kernel runs), grouped_gemm.cu (the experts'
//     products) and moe_fused.cu (the products fused with the dispatch,
//     SwiGLU and the combine, and tensor parallelism's products fused with
//     the all-gather of their input or the reduce-scatter of their
//     output: the same gather and row-sending epilogues). grouped_gemm.md
//     holds their design notes and measurements.
//
// Rules every source follows:
//   - It includes only this package's headers (#include "name.cuh"), which
//     Source.Text pastes in: NVRTC is given no include path, and a user may
//     have only the driver and a pip-installed NVRTC.
//   - Every kernel is extern "C", so its name in the cubin is its source
//     name, and is listed in Sources with its launch shape.
//   - Sizes are run-time arguments; element counts and offsets are 64-bit.
//   - Each kernel has a CPU twin in backend/cpu; backend/cuda's tests compare
//     the two on fresh random inputs. (clock.cu's hold computes nothing: the
//     profile clock's wait, tested by its length on the GPU.)
//   - It holds only what training runs: no experiment switches, run-time
//     or compile-time. Experiments are copies with their switches in
//     kernels/dev, measured against these sources and never loaded by the
//     backend. The one preprocessor switch, MOE_TEST_LOST_ROWS in
//     moe_fused.cu, is defined only by backend/cuda's tests (a fault
//     injection, off in every build the backend makes).
//
// kernels_test.go compiles every source to sm_90a PTX with clang-19 when it
// is installed (Debian/Ubuntu: apt-get install -y clang-19), a check that
// needs no GPU and no CUDA toolkit.
package kernels

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
)

//go:embed *.cuh *.cu
var files embed.FS

// PreludeFile is the file prepended to every source.
const PreludeFile = "prelude.cuh"

// Kernel describes one entry point of a source.
type Kernel struct {
	Name string
	// Block is the number of threads per block the kernel is written for.
	// Kernels with __launch_bounds__ or fixed shared arrays need exactly
	// this; grid-stride kernels accept any multiple of 32.
	Block int
	// Grid says how the grid is sized, in words.
	Grid string
}

// Source is one .cu file and the kernels it defines.
type Source struct {
	File    string
	Kernels []Kernel
}

// Sources lists every source and kernel. A test checks that it matches the
// files: every .cu is listed and every listed kernel is defined.
func Sources() []Source {
	const gridStride = "any; grid-stride over n (about 4 blocks per SM for large n)"
	const attnQueryGrid = "(B*H, ceil(S/64)) blocks: one per head and 64 queries"
	const hopperAttnGrid = "(B*H, ceil(S/128)) blocks: one per head and 128 queries (2 consumer warpgroups), run a band of (sequence, head) pairs at a time (the band argument); sm_90a only; dynamic shared memory per backend/cuda/attention_hopper.go"
	const hopperAttnWalkGrid = "1-D over items (B*H*ceil(S/192): a head and 192 queries, 3 consumer warpgroups), walked a band of (sequence, head) pairs at a time (the band and pairs arguments): one block an item where a band applies, else min(SMs, items) persistent blocks; sm_90a only; dynamic shared memory per backend/cuda/attention_hopper.go"
	const hopperAttnKeyGrid = "(B*KV, ceil(KVSeq/128)) blocks: one per kv head and 128 keys, run a band of (sequence, kv head) pairs at a time (the band argument); sm_90a only; dynamic shared memory per backend/cuda/attention_hopper.go"
	const hopperZZGrid = "(B*H, 2C/128) blocks: one per head and 128 of a rank's local queries (C a multiple of 128), run a band of (sequence, head) pairs at a time (the band argument); sm_90a only"
	const hopperZZKeyGrid = "(B*KV, 2C/128) blocks: one per kv head and 128 of a rank's local keys (C a multiple of 128); sm_90a only"
	const attnKeyGrid = "(B*KV, ceil(KVSeq/64)) blocks: one per kv head and 64 keys"
	const zigzagGrid = "(B*H, 2C/64) blocks: one per head and 64 of a rank's local queries (C a multiple of 64)"
	const zigzagKeyGrid = "(B*H, 2C/64) blocks: one per query head and 64 of a rank's local keys"
	const peerGrid = "any; grid-stride over R rows, one warp per row (8 blocks per SM for large R)"
	const groupedGrid = "persistent: min(SMs, most tiles) blocks; sm_90a only; dynamic shared memory per backend/cuda/grouped_gemm.go"
	const gatherGrid = groupedGrid + "; blocks must all be resident (the TMA threads wait on the gathering warps of other blocks)"
	const clusterGrid = "persistent clusters of two blocks (cuLaunchKernelEx): 2*min(active clusters, ceil(m-tiles/2)*n-tiles) blocks; sm_90a only; dynamic shared memory per backend/cuda/tp_fused.go"
	const clusterGatherGrid = clusterGrid + "; blocks must all be resident (the TMA threads wait on the gathering warps of other blocks)"
	return []Source{
		{File: "elementwise.cu", Kernels: []Kernel{
			{Name: "fill_f32", Block: 256, Grid: gridStride},
			{Name: "axpy_f32", Block: 256, Grid: gridStride},
			{Name: "scale_f32", Block: 256, Grid: gridStride},
			{Name: "sum_partial_f32", Block: 256, Grid: "any; one float64 partial per block, added on the host"},
		}},
		{File: "clock.cu", Kernels: []Kernel{
			{Name: "clock_hold", Block: 32, Grid: "1 block"},
		}},
		{File: "convert.cu", Kernels: []Kernel{
			{Name: "f32_to_bf16", Block: 256, Grid: gridStride},
			{Name: "bf16_to_f32", Block: 256, Grid: gridStride},
		}},
		{File: "convert_vec.cu", Kernels: []Kernel{
			{Name: "f32_to_bf16_x4", Block: 256, Grid: "any; grid-stride over ceil(n/4) groups of four (up to 8 blocks per SM); x 16-byte and out 8-byte aligned"},
		}},
		{File: "embedding.cu", Kernels: []Kernel{
			{Name: "embedding_forward_f32", Block: 256, Grid: "T blocks"},
			{Name: "embedding_backward_f32", Block: 256, Grid: "T blocks"},
		}},
		{File: "rmsnorm.cu", Kernels: []Kernel{
			{Name: "rmsnorm_forward_f32", Block: 256, Grid: "T blocks"},
			{Name: "rmsnorm_forward_f32_bf16", Block: 256, Grid: "T blocks"},
			{Name: "rmsnorm_forward_warps_f32", Block: 256, Grid: "ceil(T/8) blocks: a warp per row; D a multiple of 128, at most 1024"},
			{Name: "rmsnorm_forward_warps_f32_bf16", Block: 256, Grid: "ceil(T/8) blocks: a warp per row; D a multiple of 128, at most 1024"},
			{Name: "rmsnorm_backward_f32", Block: 1024, Grid: "ceil(T/rows_per_block) blocks of a multiple of 32 threads, at most 1024, with D <= 8 x threads"},
			{Name: "rmsnorm_backward_warps_f32", Block: 256, Grid: "ceil(T/rows_per_block) blocks of 8 warps; D a multiple of 128, at most 1024"},
			{Name: "rmsnorm_backward_dx_f32", Block: 256, Grid: "T blocks"},
			{Name: "rmsnorm_backward_dw_f32", Block: 256, Grid: "(ceil(D/32), ceil(T/rows_per_block)) blocks of 32x8"},
			{Name: "rmsnorm_dw_reduce_f32", Block: 256, Grid: gridStride},
		}},
		{File: "swiglu.cu", Kernels: []Kernel{
			{Name: "swiglu_forward_f32", Block: 256, Grid: gridStride},
			{Name: "swiglu_backward_f32", Block: 256, Grid: gridStride},
			{Name: "swiglu_forward_f32_x4", Block: 256, Grid: gridStride},
			{Name: "swiglu_backward_f32_x4", Block: 256, Grid: gridStride},
			{Name: "swiglu_forward_bf16_f32", Block: 256, Grid: gridStride},
			{Name: "swiglu_forward_f32_bf16", Block: 256, Grid: gridStride},
			{Name: "swiglu_forward_bf16_bf16", Block: 256, Grid: gridStride},
			{Name: "swiglu_backward_bf16_f32", Block: 256, Grid: gridStride},
			{Name: "swiglu_backward_f32_bf16", Block: 256, Grid: gridStride},
			{Name: "swiglu_backward_bf16_bf16", Block: 256, Grid: gridStride},
		}},
		{File: "adamw.cu", Kernels: []Kernel{
			{Name: "adamw_f32", Block: 256, Grid: gridStride},
			{Name: "adamw_f32_x4", Block: 256, Grid: gridStride},
			{Name: "adamw_split", Block: 256, Grid: gridStride},
		}},
		{File: "crossentropy.cu", Kernels: []Kernel{
			{Name: "cross_entropy_f32", Block: 256, Grid: "T blocks"},
			{Name: "cross_entropy_f32_bf16", Block: 256, Grid: "T blocks"},
			{Name: "cross_entropy_f32_reg", Block: 1024, Grid: "T blocks"},
			{Name: "cross_entropy_f32_bf16_reg", Block: 1024, Grid: "T blocks"},
			{Name: "cross_entropy_shard_f32", Block: 256, Grid: "T blocks"},
			{Name: "cross_entropy_shard_finish_f32", Block: 256, Grid: "T blocks"},
		}},
		{File: "route.cu", Kernels: []Kernel{
			{Name: "route_by_expert", Block: 1024, Grid: "E blocks"},
		}},
		{File: "rows.cu", Kernels: []Kernel{
			{Name: "gather_rows_f32", Block: 256, Grid: "N blocks"},
			{Name: "gather_rows_f32_bf16", Block: 256, Grid: "N blocks"},
			{Name: "gather_rows_bf16", Block: 256, Grid: "N blocks"},
			{Name: "gather_rows_bf16_bf16", Block: 256, Grid: "N blocks"},
			{Name: "scatter_add_rows_f32", Block: 256, Grid: "N blocks"},
			{Name: "gather_rows_narrow_f32", Block: 256, Grid: gridStride},
			{Name: "scatter_add_rows_narrow_f32", Block: 256, Grid: gridStride},
			{Name: "row_dots_f32", Block: 256, Grid: "grid-stride, one warp per row"},
			{Name: "row_dots_f32_bf16", Block: 256, Grid: "grid-stride, one warp per row"},
			{Name: "gather_sum_rows_f32", Block: 256, Grid: "T blocks"},
			{Name: "gather_sum_rows_bf16", Block: 256, Grid: "T blocks"},
			{Name: "stable_rank_i32", Block: 256, Grid: "(ceil(N/1024), ceil(N/4096)) blocks"},
			{Name: "stable_place_i32", Block: 256, Grid: gridStride},
			{Name: "scatter_add_rows_ordered_f32", Block: 256, Grid: "N blocks"},
		}},
		{File: "peer_rows.cu", Kernels: []Kernel{
			{Name: "gather_peer_rows_f32", Block: 256, Grid: peerGrid},
			{Name: "gather_peer_rows_f32_bf16", Block: 256, Grid: peerGrid},
			{Name: "gather_peer_rows_bf16", Block: 256, Grid: peerGrid},
			{Name: "scatter_peer_rows_f32", Block: 256, Grid: peerGrid},
			{Name: "scatter_peer_rows_bf16", Block: 256, Grid: peerGrid},
			{Name: "peer_row_refs", Block: 256, Grid: "grid-stride, one thread per row"},
			{Name: "mark_peer_rows", Block: 256, Grid: "grid-stride, one thread per row"},
			{Name: "combine_rows_f32", Block: 256, Grid: "N blocks: one per send row"},
		}},
		{File: "attention.cu", Kernels: []Kernel{
			{Name: "attn_forward_d32_f32", Block: 64, Grid: attnQueryGrid},
			{Name: "attn_forward_d64_f32", Block: 128, Grid: attnQueryGrid},
			{Name: "attn_forward_d128_f32", Block: 256, Grid: attnQueryGrid},
			{Name: "attn_backward_dq_d32_f32", Block: 64, Grid: attnQueryGrid},
			{Name: "attn_backward_dq_d64_f32", Block: 128, Grid: attnQueryGrid},
			{Name: "attn_backward_dq_d128_f32", Block: 256, Grid: attnQueryGrid},
			{Name: "attn_backward_dkdv_d32_f32", Block: 64, Grid: attnKeyGrid},
			{Name: "attn_backward_dkdv_d64_f32", Block: 128, Grid: attnKeyGrid},
			{Name: "attn_backward_dkdv_d128_f32", Block: 256, Grid: attnKeyGrid},
		}},
		{File: "attention_merge.cu", Kernels: []Kernel{
			{Name: "attn_merge_f32", Block: 256, Grid: "grid-stride over rows*H (row, head) pairs, one warp per pair"},
		}},
		{File: "attention_tc.cu", Kernels: []Kernel{
			{Name: "attn_tc_forward_d64", Block: 128, Grid: attnQueryGrid},
			{Name: "attn_tc_forward_d128", Block: 128, Grid: attnQueryGrid},
			{Name: "attn_tc_backward_dq_d64", Block: 128, Grid: attnQueryGrid},
			{Name: "attn_tc_backward_dq_d128", Block: 128, Grid: attnQueryGrid},
			{Name: "attn_tc_backward_dkdv_d64", Block: 128, Grid: attnKeyGrid},
			{Name: "attn_tc_backward_dkdv_d128", Block: 128, Grid: attnKeyGrid},
			{Name: "attn_zz_forward_d64", Block: 128, Grid: zigzagGrid},
			{Name: "attn_zz_forward_d128", Block: 128, Grid: zigzagGrid},
			{Name: "attn_zz_backward_dq_d64", Block: 128, Grid: zigzagGrid},
			{Name: "attn_zz_backward_dq_d128", Block: 128, Grid: zigzagGrid},
			{Name: "attn_zz_backward_dkdv_d64", Block: 128, Grid: zigzagKeyGrid},
			{Name: "attn_zz_backward_dkdv_d128", Block: 128, Grid: zigzagKeyGrid},
			{Name: "attn_zz_sum_heads", Block: 256, Grid: "grid-stride over float4s of dk"},
		}},
		{File: "attention_hopper.cu", Kernels: []Kernel{
			{Name: "attn_h_forward_d64", Block: 512, Grid: hopperAttnWalkGrid},
			{Name: "attn_h_forward_d128", Block: 384, Grid: hopperAttnGrid},
			{Name: "attn_h_forward_d64_bf16", Block: 512, Grid: hopperAttnWalkGrid},
			{Name: "attn_h_forward_d128_bf16", Block: 384, Grid: hopperAttnGrid},
			{Name: "attn_h_backward_d64", Block: 384, Grid: hopperAttnKeyGrid},
			{Name: "attn_h_backward_d128", Block: 384, Grid: hopperAttnKeyGrid},
			{Name: "attn_h_zz_forward_d64", Block: 384, Grid: hopperZZGrid},
			{Name: "attn_h_zz_forward_d128", Block: 384, Grid: hopperZZGrid},
			{Name: "attn_h_zz_backward_d64", Block: 384, Grid: hopperZZKeyGrid},
			{Name: "attn_h_zz_backward_d128", Block: 384, Grid: hopperZZKeyGrid},
			{Name: "attn_h_delta", Block: 256, Grid: "grid-stride, one warp per (query row, head)"},
			{Name: "attn_h_delta_bf16", Block: 256, Grid: "grid-stride, one warp per (query row, head)"},
			{Name: "attn_h_delta_bf16_bf16", Block: 256, Grid: "grid-stride, one warp per (query row, head)"},
		}},
		{File: "rope.cu", Kernels: []Kernel{
			{Name: "rope_table", Block: 256, Grid: gridStride},
			{Name: "rope_f32", Block: 256, Grid: gridStride},
			{Name: "rope_f32_bf16", Block: 256, Grid: gridStride},
			{Name: "rope_f32_x4", Block: 256, Grid: gridStride},
			{Name: "rope_f32_bf16_x4", Block: 256, Grid: gridStride},
		}},
		{File: "grouped_gemm.cu", Kernels: []Kernel{
			{Name: "grouped_gemm_nt_bn128_f32", Block: 384, Grid: groupedGrid},
			{Name: "grouped_gemm_nt_bn256_f32", Block: 384, Grid: groupedGrid},
			{Name: "grouped_gemm_nt_bn256s_bf16", Block: 384, Grid: groupedGrid},
			{Name: "grouped_gemm_tn", Block: 384, Grid: "persistent: min(SMs, E*ceil(M/128)*ceil(N/256)) blocks; sm_90a only; dynamic shared memory per backend/cuda/grouped_gemm.go"},
		}},
		{File: "moe_fused.cu", Kernels: []Kernel{
			{Name: "moe_dispatch_swiglu", Block: 384, Grid: gatherGrid},
			{Name: "moe_dispatch_swiglu_bf16", Block: 384, Grid: gatherGrid},
			{Name: "moe_down_combine", Block: 384, Grid: groupedGrid},
			{Name: "moe_down_combine_bf16", Block: 384, Grid: groupedGrid},
			{Name: "moe_dispatch_dgrad", Block: 384, Grid: gatherGrid},
			{Name: "moe_dispatch_dgrad_first", Block: 384, Grid: gatherGrid},
			{Name: "moe_dgrad_combine", Block: 384, Grid: groupedGrid},
			{Name: "tp_gather_nt", Block: 384, Grid: clusterGatherGrid},
			{Name: "tp_gather_nn", Block: 384, Grid: clusterGatherGrid},
			{Name: "tp_scatter_nt", Block: 384, Grid: clusterGrid},
			{Name: "tp_scatter_nn", Block: 384, Grid: clusterGrid},
		}},
		{File: "router.cu", Kernels: []Kernel{
			{Name: "router_forward_f32", Block: 256, Grid: "ceil(T/8) blocks: one warp per row; E <= 256, K <= 8"},
			{Name: "router_backward_f32", Block: 256, Grid: "ceil(T/8) blocks: one warp per row; E <= 256, K <= 8"},
		}},
	}
}

// Lookup returns the source named file (e.g. "rmsnorm.cu").
func Lookup(file string) (Source, error) {
	for _, s := range Sources() {
		if s.File == file {
			return s, nil
		}
	}
	return Source{}, fmt.Errorf("kernels: no source %q", file)
}

// Text is the compilable source: the prelude, then the file with its
// headers pasted in (Assemble).
func (s Source) Text() (string, error) {
	return Assemble(s.File, files.ReadFile)
}

// Header returns one of this package's headers (a .cuh file), for sources
// kept elsewhere (kernels/dev) that include it.
func Header(name string) ([]byte, error) {
	if !strings.HasSuffix(name, ".cuh") || name == PreludeFile {
		return nil, fmt.Errorf("kernels: %q is not a header a source includes", name)
	}
	b, err := files.ReadFile(name)
	if err != nil {
		return nil, fmt.Errorf("kernels: %w", err)
	}
	return b, nil
}

// includeLine matches a line that includes a header: #include "name";
// anyInclude any #include line.
var (
	includeLine = regexp.MustCompile(`^\s*#\s*include\s*"([^"]+)"\s*$`)
	anyInclude  = regexp.MustCompile(`^\s*#\s*include\b`)
)

// Assemble is the compilable text of file: this package's prelude, then
// the file, whose #include "name.cuh" lines are replaced by the headers
// (each once: a second include of the same header is left out; headers
// may include headers), with #line directives so compiler messages name
// the file and line they come from. read returns a file by name: the
// source's, and the headers' it includes. A file with no include comes
// out as the prelude, a #line directive and the file itself.
func Assemble(file string, read func(name string) ([]byte, error)) (string, error) {
	prelude, err := files.ReadFile(PreludeFile)
	if err != nil {
		return "", fmt.Errorf("kernels: %w", err)
	}
	body, err := read(file)
	if err != nil {
		return "", fmt.Errorf("kernels: %w", err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n#line 1 %q\n", prelude, file)
	if err := paste(&b, file, body, read, map[string]bool{}); err != nil {
		return "", err
	}
	return b.String(), nil
}

// paste writes body, the text of file, to b with its includes expanded;
// seen holds the headers already pasted.
func paste(b *strings.Builder, file string, body []byte, read func(string) ([]byte, error), seen map[string]bool) error {
	for i, line := range strings.SplitAfter(string(body), "\n") {
		if !anyInclude.MatchString(line) {
			b.WriteString(line)
			continue
		}
		m := includeLine.FindStringSubmatch(strings.TrimRight(line, "\r\n"))
		if m == nil || !strings.HasSuffix(m[1], ".cuh") || m[1] == PreludeFile {
			return fmt.Errorf("kernels: %s:%d: %s: a source includes only headers of kernels (#include \"name.cuh\")",
				file, i+1, strings.TrimSpace(line))
		}
		if header := m[1]; !seen[header] {
			seen[header] = true
			text, err := read(header)
			if err != nil {
				return fmt.Errorf("kernels: %s:%d: %w", file, i+1, err)
			}
			fmt.Fprintf(b, "#line 1 %q\n", header)
			if err := paste(b, header, text, read, seen); err != nil {
				return err
			}
			if !strings.HasSuffix(string(text), "\n") {
				b.WriteString("\n")
			}
		}
		fmt.Fprintf(b, "#line %d %q\n", i+2, file)
	}
	return nil
}

// Kernel returns the description of the kernel called name.
func (s Source) Kernel(name string) (Kernel, bool) {
	for _, k := range s.Kernels {
		if k.Name == name {
			return k, true
		}
	}
	return Kernel{}, false
}

// Digest identifies this build's kernels: the first 12 hex digits of the
// SHA-256 of the prelude and every source, in name order. Results measured
// on the kernels (the MoE dispatcher table) keep it, so that a build with
// other kernels measures again.
func Digest() (string, error) {
	entries, err := files.ReadDir(".")
	if err != nil {
		return "", fmt.Errorf("kernels: %w", err)
	}
	h := sha256.New()
	for _, e := range entries { // ReadDir sorts by name
		b, err := files.ReadFile(e.Name())
		if err != nil {
			return "", fmt.Errorf("kernels: %w", err)
		}
		fmt.Fprintf(h, "%s %d\n", e.Name(), len(b))
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))[:12], nil
}

// Files lists the embedded .cu files, for the consistency test.
func Files() ([]string, error) {
	entries, err := files.ReadDir(".")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".cu") {
			out = append(out, e.Name())
		}
	}
	return out, nil
}
