package profile

// Scopes the model code passes to Scope. Any other name, "" included, is
// "elsewhere".
const (
	ScopeAttention = "attention" // attention layers: projections, RoPE, the attention kernels
	ScopeMoE       = "moe"       // MoE layers: router gate, dispatch, experts, combine
	ScopeHead      = "head"      // the LM head fused with the cross-entropy
	ScopeOptimizer = "optimizer" // gradient norm, clipping, AdamW
	// ScopeComm is the scope of the collectives timed by Collective (the
	// model code does not set it).
	ScopeComm = "comm"
)

// Kinds of work a Report sums time into.
const (
	KindAttention   = "attention"             // AttentionForward/Backward/Merge
	KindExpertGEMM  = "expert GEMM"           // grouped products, and MatMul in MoE layers (the router gate)
	KindDenseGEMM   = "dense GEMM"            // other MatMul: attention projections, LM head
	KindDispatch    = "dispatch/permute"      // moving routed rows to and from experts
	KindRouter      = "router"                // RouterForward/Backward (softmax, top-k)
	KindElementwise = "norms and elementwise" // RMSNorm, RoPE, SwiGLU, embedding, residual adds, ...
	KindLoss        = "loss"                  // CrossEntropy and its sum
	KindOptimizer   = "optimizer"             // everything in the optimizer scope, and AdamWUpdate anywhere
	KindTransfers   = "host transfers"        // Upload, Download, Sync
	KindComm        = "communication"         // collectives timed by Collective (NCCL calls)
	KindHostGaps    = "host gaps"             // wall time no op covers (Report.WithWall)
)

// KindOf is the kind of work of op (a backend.Backend method name) called
// in scope. The table, first match wins:
//
//	scope       op                                          kind
//	comm        any                                         communication
//	optimizer   any                                         optimizer
//	moe         MatMul                                      expert GEMM
//	moe         Copy, Zero                                  dispatch/permute
//	head        Sum                                         loss
//	any         Upload, Download, Sync                      host transfers
//	any         GroupedMatMul, GroupedMatMulTN              expert GEMM
//	any         AttentionForward, AttentionBackward,        attention
//	            AttentionMerge
//	any         MatMul                                      dense GEMM
//	any         GatherRows, ScatterAddRows, RowDots,        dispatch/permute
//	            the peer-row ops (GatherPeerRows ... CombineRows)
//	any         RouterForward, RouterBackward, RouteByExpert router
//	any         CrossEntropy                                loss
//	any         AdamWUpdate                                 optimizer
//	any         anything else                               norms and elementwise
//
// In the MoE scope the router's gate GEMM ([T, D] x [D, E]) is counted as
// an expert GEMM: it is one small MatMul beside the experts' three; Copy and
// Zero there are the routing buffers and the exchange between ranks, and a
// Download there is the routing plan going to the host (host transfers).
func KindOf(scope, op string) string {
	switch scope {
	case ScopeComm:
		return KindComm
	case ScopeOptimizer:
		return KindOptimizer
	case ScopeMoE:
		switch op {
		case opMatMul:
			return KindExpertGEMM
		case opCopy, opZero:
			return KindDispatch
		}
	case ScopeHead:
		if op == opSum {
			return KindLoss
		}
	}
	switch op {
	case opUpload, opDownload, opStartDownload, opSync:
		return KindTransfers
	case opGroupedMatMul, opGroupedMatMulTN, opDispatchSwiGLU, opDownCombine, opDispatchDgrad, opDgradCombine:
		return KindExpertGEMM
	case opAttentionForward, opAttentionBackward, opAttentionMerge, opZigzagForward, opZigzagDQ, opZigzagDKDV, opZigzagPrepare, opZigzagBackward:
		return KindAttention
	case opMatMul:
		return KindDenseGEMM
	case opGatherRows, opScatterAddRows, opGatherSumRows, opRowDots, opGatherPeerRows, opScatterPeerRows, opPeerRowRefs, opMarkPeerRows, opCombineRows:
		return KindDispatch
	case opRouterForward, opRouterBackward, opRouteByExpert:
		return KindRouter
	case opCrossEntropy, opCrossEntropyShard, opCrossEntropyJoin:
		return KindLoss
	case opAdamWUpdate:
		return KindOptimizer
	}
	return KindElementwise
}
