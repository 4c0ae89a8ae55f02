// Package tune settles, by measurement on the machine at hand, the choices
// that no rule of thumb gets right everywhere, and remembers the answers
// on disk so that each machine measures each case once. Today that is the
// MoE dispatcher of model.moe.dispatcher: auto, and the context-parallel
// attention of parallel.cp_attention: auto (ResolveCPAttention: ring or
// allgather, measured by attention.MeasureContext on virtual ranks and kept
// in cp_attention.json beside the dispatch table, under a CPAttentionKey
// of the same machine, software and kernels; by rule on the CPU, across
// processes and under train.deterministic), and tensor parallelism's
// overlap of parallel.tp_overlap: auto (ResolveTPOverlap: fused or
// unfused, measured by MeasureTPOverlap, one layer's column- and
// row-parallel forward products with tensorpar's fused ops and with its
// collectives on virtual ranks, and kept in tp_overlap.json under a
// TPOverlapKey; by rule on the CPU, where the fused ops are the unfused
// sequences, with a rank per GPU or node, under train.deterministic, and
// with tp 1).
//
// The engine calls ResolveDispatcher once per run, before the ranks build
// their layers:
//
//	d, err := tune.ResolveDispatcher(b, cfg.Model.MoE, dim, tokens, ep, canPeer, logLine)
//	// d is "fused" or "unfused"; cfg.Model.MoE.Dispatcher = d
//
// An explicit "fused" or "unfused" passes through; auto is the table's
// answer for this machine and layer shape (DispatchKey), or, when the
// table has none, the faster dispatcher in a measurement of the layer
// (moe.MeasureDispatch), which is then stored. `mktrain bench kernels`
// measures a list of shapes and stores its answers in the same table.
//
// The table is dispatch.json in $MKTRAIN_CACHE_DIR when that is set, else
// in os.UserCacheDir()/mktrain (DefaultDispatchCache). A key names the
// machine and its device (MachineName), the driver and compiler under the
// kernels (SoftwareName) and the build's kernels (kernels.Digest), so new
// hardware, a driver upgrade or new kernels are measured again. Deleting
// the file makes the next run measure again; a file that cannot be read
// or written costs a measurement, never the run.
//
// The measurement itself is the model's business and stays in package moe
// (and attention); this package holds what is about one machine's disk,
// and the tensor-parallel measurement, which is of tensorpar's patterns
// alone.
package tune
