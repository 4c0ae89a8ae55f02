package cuda

// The kernels the Backend's ops launch, resolved once per Backend.
// Device.Load already caches each module per Device (keyed by source file),
// so code outside the Backend (Gemm, attention) loads its sources with
// Device.Load directly and pays the compile once.

import (
	"fmt"
	"sync"

	"github.com/mktrain/mktrain/kernels"
)

// kernelSet holds every kernel of the Backend's ops.
type kernelSet struct {
	fill, axpy, scale, sumPartial *Kernel

	embedFwd, embedBwd *Kernel

	rmsFwd, rmsFwdBF16, rmsBwd, rmsBwdDx, rmsBwdDw, rmsDwReduce *Kernel
	// The warp-per-row RMSNorm kernels, for rows of D <= rmsWarpMaxD
	// columns, D a multiple of 128.
	rmsFwdWarps, rmsFwdWarpsBF16, rmsBwdWarps *Kernel

	swigluFwd, swigluBwd     *Kernel
	swigluFwdX4, swigluBwdX4 *Kernel // 16-byte accesses, for aligned tensors
	// bf16 variants, by [inputs bf16][outputs bf16] ([0][0] unused: the
	// f32 kernels above).
	swigluFwdBF16, swigluBwdBF16 [2][2]*Kernel

	crossEntropy, crossEntropyReg              *Kernel
	crossEntropyBF16, crossEntropyBF16Reg      *Kernel // bf16 dlogits
	crossEntropyShard, crossEntropyShardFinish *Kernel

	gatherRows, scatterAddRows, rowDots *Kernel
	rowDotsBF16                         *Kernel // b in bf16
	// narrow rows (narrowRows): one thread per element, not a block per row
	gatherRowsNarrow, scatterAddRowsNarrow *Kernel
	// train.deterministic's scatter-add: a stable sort of the rows, then
	// each run of equal rows added by one block (Backend.scatterOrdered).
	stableRank, stablePlace, scatterAddRowsOrdered *Kernel
	gatherRowsBF16                                 *Kernel // into a bf16 out
	gatherRowsFromBF16, gatherRowsBF16BF16         *Kernel // from a bf16 in, into float32 or bf16
	gatherSumRows, gatherSumRowsFromBF16           *Kernel // the combine as a gather, from a float32 or bf16 in

	routerFwd, routerBwd *Kernel
	route                *Kernel

	adamw, adamwX4, adamwSplit *Kernel
}

// loadKernelSet compiles (or reads from the cache) and loads the sources,
// in parallel, and resolves every kernel.
func loadKernelSet(d *Device) (*kernelSet, error) {
	ks := &kernelSet{}
	want := []struct {
		file string
		refs map[string]**Kernel
	}{
		{"elementwise.cu", map[string]**Kernel{"fill_f32": &ks.fill, "axpy_f32": &ks.axpy, "scale_f32": &ks.scale, "sum_partial_f32": &ks.sumPartial}},
		{"embedding.cu", map[string]**Kernel{"embedding_forward_f32": &ks.embedFwd, "embedding_backward_f32": &ks.embedBwd}},
		{"rmsnorm.cu", map[string]**Kernel{"rmsnorm_forward_f32": &ks.rmsFwd, "rmsnorm_forward_f32_bf16": &ks.rmsFwdBF16, "rmsnorm_backward_f32": &ks.rmsBwd, "rmsnorm_backward_dx_f32": &ks.rmsBwdDx, "rmsnorm_backward_dw_f32": &ks.rmsBwdDw,
			"rmsnorm_dw_reduce_f32": &ks.rmsDwReduce, "rmsnorm_forward_warps_f32": &ks.rmsFwdWarps, "rmsnorm_forward_warps_f32_bf16": &ks.rmsFwdWarpsBF16,
			"rmsnorm_backward_warps_f32": &ks.rmsBwdWarps}},
		{"swiglu.cu", map[string]**Kernel{"swiglu_forward_f32": &ks.swigluFwd, "swiglu_backward_f32": &ks.swigluBwd,
			"swiglu_forward_f32_x4": &ks.swigluFwdX4, "swiglu_backward_f32_x4": &ks.swigluBwdX4,
			"swiglu_forward_bf16_f32": &ks.swigluFwdBF16[1][0], "swiglu_forward_f32_bf16": &ks.swigluFwdBF16[0][1],
			"swiglu_forward_bf16_bf16": &ks.swigluFwdBF16[1][1], "swiglu_backward_bf16_f32": &ks.swigluBwdBF16[1][0],
			"swiglu_backward_f32_bf16": &ks.swigluBwdBF16[0][1], "swiglu_backward_bf16_bf16": &ks.swigluBwdBF16[1][1]}},
		{"crossentropy.cu", map[string]**Kernel{"cross_entropy_f32": &ks.crossEntropy, "cross_entropy_f32_reg": &ks.crossEntropyReg,
			"cross_entropy_f32_bf16": &ks.crossEntropyBF16, "cross_entropy_f32_bf16_reg": &ks.crossEntropyBF16Reg,
			"cross_entropy_shard_f32": &ks.crossEntropyShard, "cross_entropy_shard_finish_f32": &ks.crossEntropyShardFinish}},
		{"rows.cu", map[string]**Kernel{"gather_rows_f32": &ks.gatherRows, "gather_rows_f32_bf16": &ks.gatherRowsBF16,
			"gather_rows_bf16": &ks.gatherRowsFromBF16, "gather_rows_bf16_bf16": &ks.gatherRowsBF16BF16,
			"scatter_add_rows_f32": &ks.scatterAddRows, "row_dots_f32": &ks.rowDots, "row_dots_f32_bf16": &ks.rowDotsBF16,
			"gather_sum_rows_f32": &ks.gatherSumRows, "gather_sum_rows_bf16": &ks.gatherSumRowsFromBF16,
			"gather_rows_narrow_f32": &ks.gatherRowsNarrow, "scatter_add_rows_narrow_f32": &ks.scatterAddRowsNarrow,
			"stable_rank_i32": &ks.stableRank, "stable_place_i32": &ks.stablePlace,
			"scatter_add_rows_ordered_f32": &ks.scatterAddRowsOrdered}},
		{"route.cu", map[string]**Kernel{"route_by_expert": &ks.route}},
		{"router.cu", map[string]**Kernel{"router_forward_f32": &ks.routerFwd, "router_backward_f32": &ks.routerBwd}},
		{"adamw.cu", map[string]**Kernel{"adamw_f32": &ks.adamw, "adamw_f32_x4": &ks.adamwX4, "adamw_split": &ks.adamwSplit}},
	}
	mods := make([]*Module, len(want))
	errs := make([]error, len(want))
	var wg sync.WaitGroup
	for i, w := range want {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src, err := kernels.Lookup(w.file)
			if err == nil {
				mods[i], err = d.Load(src)
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for i, w := range want {
		if errs[i] != nil {
			return nil, fmt.Errorf("cuda: backend kernels: %w", errs[i])
		}
		for name, ref := range w.refs {
			k, err := mods[i].Kernel(name)
			if err != nil {
				return nil, err
			}
			*ref = k
		}
	}
	return ks, nil
}
