package profile

// The forwarded ops. Each timed op defers end(begin(), name): begin runs
// before the op, end after it returns (or panics).

import (
	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// Op names as recorded: the backend.Backend method names.
const (
	opUpload            = "Upload"
	opDownload          = "Download"
	opStartDownload     = "StartDownload"
	opSync              = "Sync"
	opZero              = "Zero"
	opCopy              = "Copy"
	opAxpy              = "Axpy"
	opScale             = "Scale"
	opSum               = "Sum"
	opSumSquares        = "SumSquares"
	opMatMul            = "MatMul"
	opGroupedMatMul     = "GroupedMatMul"
	opGroupedMatMulTN   = "GroupedMatMulTN"
	opEmbeddingForward  = "EmbeddingForward"
	opEmbeddingBackward = "EmbeddingBackward"
	opRMSNormForward    = "RMSNormForward"
	opRMSNormBackward   = "RMSNormBackward"
	opRoPE              = "RoPE"
	opAttentionForward  = "AttentionForward"
	opAttentionBackward = "AttentionBackward"
	opAttentionMerge    = "AttentionMerge"
	opZigzagForward     = "ZigzagAttentionForward"
	opZigzagDQ          = "ZigzagAttentionBackwardDQ"
	opZigzagDKDV        = "ZigzagAttentionBackwardDKDV"
	opZigzagPrepare     = "ZigzagAttentionPrepare"
	opZigzagBackward    = "ZigzagAttentionBackward"
	opSwiGLUForward     = "SwiGLUForward"
	opSwiGLUBackward    = "SwiGLUBackward"
	opCrossEntropy      = "CrossEntropy"
	opCrossEntropyShard = "CrossEntropyShard"
	opCrossEntropyJoin  = "CrossEntropyShardFinish"
	opRouterForward     = "RouterForward"
	opRouterBackward    = "RouterBackward"
	opGatherRows        = "GatherRows"
	opScatterAddRows    = "ScatterAddRows"
	opGatherSumRows     = "GatherSumRows"
	opRowDots           = "RowDots"
	opRouteByExpert     = "RouteByExpert"
	opGatherPeerRows    = "GatherPeerRows"
	opScatterPeerRows   = "ScatterPeerRows"
	opPeerRowRefs       = "PeerRowRefs"
	opMarkPeerRows      = "MarkPeerRows"
	opCombineRows       = "CombineRows"
	opDispatchSwiGLU    = "DispatchSwiGLU"
	opDownCombine       = "DownCombine"
	opDispatchDgrad     = "DispatchDgradSwiGLU"
	opDgradCombine      = "DgradCombine"
	opAdamWUpdate       = "AdamWUpdate"
	opAllGatherMatMul   = "AllGatherMatMul"
	opMatMulScatter     = "MatMulScatter"
)

func (p *Backend) Name() string             { return p.inner.Name() }
func (p *Backend) FloatType() backend.DType { return p.inner.FloatType() }

// OperandType queues no work: not timed.
func (p *Backend) OperandType() backend.DType { return p.inner.OperandType() }

// New and View queue no work: not timed.

func (p *Backend) New(dt backend.DType, shape ...int) backend.Tensor {
	return p.inner.New(dt, shape...)
}

func (p *Backend) View(t backend.Tensor, offset int, shape ...int) backend.Tensor {
	return p.inner.View(t, offset, shape...)
}

func (p *Backend) Upload(dst backend.Tensor, src *tensor.Dense) {
	defer p.end(p.begin(), opUpload)
	p.inner.Upload(dst, src)
}

func (p *Backend) Download(t backend.Tensor) *tensor.Dense {
	defer p.end(p.begin(), opDownload)
	return p.inner.Download(t)
}

// StartDownload times the queued copy; the wait, when the result is
// called, is the host's.
func (p *Backend) StartDownload(t backend.Tensor) backend.PendingDownload {
	defer p.end(p.begin(), opStartDownload)
	return p.inner.StartDownload(t)
}

// SumLater times the queued reduction as Sum, through the wrapped
// backend's queued form where it has one (backend.LaterReducer); the
// wait, when the result is called, is the host's.
func (p *Backend) SumLater(t backend.Tensor) func() float64 {
	defer p.end(p.begin(), opSum)
	return backend.SumLater(p.inner, t)
}

// SumSquaresLater times the queued reduction as SumSquares, through the
// wrapped backend's queued form where it has one (backend.LaterReducer),
// so a profiled step waits where the real one does; the wait, when the
// result is called, is the host's.
func (p *Backend) SumSquaresLater(t backend.Tensor) func() float64 {
	defer p.end(p.begin(), opSumSquares)
	return backend.SumSquaresLater(p.inner, t)
}

func (p *Backend) Sync() error {
	defer p.end(p.begin(), opSync)
	return p.inner.Sync()
}

func (p *Backend) Zero(t backend.Tensor) {
	defer p.end(p.begin(), opZero)
	p.inner.Zero(t)
}

func (p *Backend) Copy(dst, src backend.Tensor) {
	defer p.end(p.begin(), opCopy)
	p.inner.Copy(dst, src)
}

func (p *Backend) Axpy(dst backend.Tensor, alpha float64, x backend.Tensor) {
	defer p.end(p.begin(), opAxpy)
	p.inner.Axpy(dst, alpha, x)
}

func (p *Backend) Scale(t backend.Tensor, alpha float64) {
	defer p.end(p.begin(), opScale)
	p.inner.Scale(t, alpha)
}

func (p *Backend) Sum(t backend.Tensor) float64 {
	defer p.end(p.begin(), opSum)
	return p.inner.Sum(t)
}

func (p *Backend) SumSquares(t backend.Tensor) float64 {
	defer p.end(p.begin(), opSumSquares)
	return p.inner.SumSquares(t)
}

func (p *Backend) MatMul(out, a, b backend.Tensor, transA, transB bool, alpha, beta float64) {
	defer p.end(p.begin(), opMatMul)
	p.inner.MatMul(out, a, b, transA, transB, alpha, beta)
}

func (p *Backend) GroupedMatMul(outRN, aRK, bG backend.Tensor, groups backend.Groups, transB bool, alpha, beta float64) {
	defer p.end(p.begin(), opGroupedMatMul)
	p.inner.GroupedMatMul(outRN, aRK, bG, groups, transB, alpha, beta)
}

func (p *Backend) GroupedMatMulTN(outGMN, aRM, bRN backend.Tensor, groups backend.Groups, alpha, beta float64) {
	defer p.end(p.begin(), opGroupedMatMulTN)
	p.inner.GroupedMatMulTN(outGMN, aRM, bRN, groups, alpha, beta)
}

func (p *Backend) ReadsGroupOffsets(n, k, groups int) bool {
	return p.inner.ReadsGroupOffsets(n, k, groups)
}

func (p *Backend) EmbeddingForward(outTD, tableVD, idsT backend.Tensor) {
	defer p.end(p.begin(), opEmbeddingForward)
	p.inner.EmbeddingForward(outTD, tableVD, idsT)
}

func (p *Backend) EmbeddingBackward(dTableVD, dOutTD, idsT backend.Tensor) {
	defer p.end(p.begin(), opEmbeddingBackward)
	p.inner.EmbeddingBackward(dTableVD, dOutTD, idsT)
}

func (p *Backend) RMSNormForward(outTD, rstdT, copyTD, xTD, wD backend.Tensor, eps float64) {
	defer p.end(p.begin(), opRMSNormForward)
	p.inner.RMSNormForward(outTD, rstdT, copyTD, xTD, wD, eps)
}

func (p *Backend) RMSNormBackward(dxTD, dwD, doutTD, xTD, wD, rstdT backend.Tensor, beta float64) {
	defer p.end(p.begin(), opRMSNormBackward)
	p.inner.RMSNormBackward(dxTD, dwD, doutTD, xTD, wD, rstdT, beta)
}

func (p *Backend) RoPE(outTQ, xTQ, posT backend.Tensor, headDim int, theta float64, inverse bool) {
	defer p.end(p.begin(), opRoPE)
	p.inner.RoPE(outTQ, xTQ, posT, headDim, theta, inverse)
}

func (p *Backend) AttentionForward(outTQ, lseBHS, qTQ, kTK, vTK backend.Tensor, s backend.AttnShape) {
	defer p.end(p.begin(), opAttentionForward)
	p.inner.AttentionForward(outTQ, lseBHS, qTQ, kTK, vTK, s)
}

func (p *Backend) AttentionBackward(dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS backend.Tensor, s backend.AttnShape) {
	defer p.end(p.begin(), opAttentionBackward)
	p.inner.AttentionBackward(dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS, s)
}

func (p *Backend) AttentionMerge(outTQ, lseBHS, partTQ, partLseBHS backend.Tensor, s backend.AttnShape) {
	defer p.end(p.begin(), opAttentionMerge)
	p.inner.AttentionMerge(outTQ, lseBHS, partTQ, partLseBHS, s)
}

func (p *Backend) ZigzagAttentionSupports(s backend.ZigzagShape) error {
	return p.inner.ZigzagAttentionSupports(s)
}

func (p *Backend) ZigzagAttentionForward(outTQ, lseBHS, qTQ backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape) {
	defer p.end(p.begin(), opZigzagForward)
	p.inner.ZigzagAttentionForward(outTQ, lseBHS, qTQ, kTK, vTK, s)
}

func (p *Backend) ZigzagAttentionBackwardDQ(dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape) {
	defer p.end(p.begin(), opZigzagDQ)
	p.inner.ZigzagAttentionBackwardDQ(dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS, kTK, vTK, s)
}

func (p *Backend) ZigzagAttentionBackwardDKDV(dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, s backend.ZigzagShape) {
	defer p.end(p.begin(), opZigzagDKDV)
	p.inner.ZigzagAttentionBackwardDKDV(dkTK, dvTK, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, s)
}

func (p *Backend) ZigzagAttentionOnePass(s backend.ZigzagShape) error {
	return p.inner.ZigzagAttentionOnePass(s)
}

func (p *Backend) ZigzagAttentionPrepare(deltaBHS, doutBF16TQ, dqTQ, doutTQ, outTQ backend.Tensor, s backend.ZigzagShape) {
	defer p.end(p.begin(), opZigzagPrepare)
	p.inner.ZigzagAttentionPrepare(deltaBHS, doutBF16TQ, dqTQ, doutTQ, outTQ, s)
}

func (p *Backend) ZigzagAttentionBackward(dqTQ []backend.Tensor, dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, s backend.ZigzagShape) {
	defer p.end(p.begin(), opZigzagBackward)
	p.inner.ZigzagAttentionBackward(dqTQ, dkTK, dvTK, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, s)
}

func (p *Backend) SwiGLUForward(outNF, aNF, bNF backend.Tensor) {
	defer p.end(p.begin(), opSwiGLUForward)
	p.inner.SwiGLUForward(outNF, aNF, bNF)
}

func (p *Backend) SwiGLUBackward(daNF, dbNF, doutNF, aNF, bNF backend.Tensor) {
	defer p.end(p.begin(), opSwiGLUBackward)
	p.inner.SwiGLUBackward(daNF, dbNF, doutNF, aNF, bNF)
}

func (p *Backend) CrossEntropy(lossT, dlogitsTV, logitsTV, targetsT backend.Tensor, gradScale float64) {
	defer p.end(p.begin(), opCrossEntropy)
	p.inner.CrossEntropy(lossT, dlogitsTV, logitsTV, targetsT, gradScale)
}

func (p *Backend) CrossEntropyShard(lseT, targetLogitT, logitsTV, targetsT backend.Tensor, vocabLo int) {
	defer p.end(p.begin(), opCrossEntropyShard)
	p.inner.CrossEntropyShard(lseT, targetLogitT, logitsTV, targetsT, vocabLo)
}

func (p *Backend) CrossEntropyShardFinish(lossT, dlogitsTV, logitsTV, lseRT, targetLogitT, targetsT backend.Tensor, vocabLo int, gradScale float64) {
	defer p.end(p.begin(), opCrossEntropyJoin)
	p.inner.CrossEntropyShardFinish(lossT, dlogitsTV, logitsTV, lseRT, targetLogitT, targetsT, vocabLo, gradScale)
}

func (p *Backend) RouterForward(probsTE, lseT, idxTK, gatesTK, logitsTE, biasE backend.Tensor) {
	defer p.end(p.begin(), opRouterForward)
	p.inner.RouterForward(probsTE, lseT, idxTK, gatesTK, logitsTE, biasE)
}

func (p *Backend) RouterBackward(dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE backend.Tensor, zScale float64) {
	defer p.end(p.begin(), opRouterBackward)
	p.inner.RouterBackward(dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE, zScale)
}

func (p *Backend) GatherRows(outND, inTD, rowsN, scaleN backend.Tensor) {
	defer p.end(p.begin(), opGatherRows)
	p.inner.GatherRows(outND, inTD, rowsN, scaleN)
}

func (p *Backend) ScatterAddRows(outTD, inND, rowsN, scaleN backend.Tensor) {
	defer p.end(p.begin(), opScatterAddRows)
	p.inner.ScatterAddRows(outTD, inND, rowsN, scaleN)
}

func (p *Backend) GatherSumRows(outTD, inSD, posTK, scaleTK backend.Tensor) {
	defer p.end(p.begin(), opGatherSumRows)
	p.inner.GatherSumRows(outTD, inSD, posTK, scaleTK)
}

func (p *Backend) RowDots(outN, aTD, rowsN, bND backend.Tensor) {
	defer p.end(p.begin(), opRowDots)
	p.inner.RowDots(outN, aTD, rowsN, bND)
}

func (p *Backend) RouteByExpert(countsE, offsetsE1, sendTokS, sendSlotS, sendPosTK, idxTK backend.Tensor) {
	defer p.end(p.begin(), opRouteByExpert)
	p.inner.RouteByExpert(countsE, offsetsE1, sendTokS, sendSlotS, sendPosTK, idxTK)
}

func (p *Backend) AdamWUpdate(param, grad, m, v backend.Tensor, h backend.AdamW) {
	defer p.end(p.begin(), opAdamWUpdate)
	p.inner.AdamWUpdate(param, grad, m, v, h)
}

func (p *Backend) AdamWUpdateSplit(hi, lo, grad, m, v backend.Tensor, h backend.AdamW) {
	defer p.end(p.begin(), opAdamWUpdate)
	p.inner.AdamWUpdateSplit(hi, lo, grad, m, v, h)
}

// AdamWUpdateSquares times the update with its squares as one AdamW op
// where the wrapped backend sums them in the same pass
// (backend.SquaringOptimizer), else as the SumSquares and the AdamWUpdate
// it runs instead.
func (p *Backend) AdamWUpdateSquares(param, grad, m, v backend.Tensor, h backend.AdamW) func() float64 {
	if o, ok := p.inner.(backend.SquaringOptimizer); ok {
		defer p.end(p.begin(), opAdamWUpdate)
		return o.AdamWUpdateSquares(param, grad, m, v, h)
	}
	sq := p.SumSquaresLater(grad)
	p.AdamWUpdate(param, grad, m, v, h)
	return sq
}

// AdamWUpdateSplitSquares is AdamWUpdateSquares for AdamWUpdateSplit.
func (p *Backend) AdamWUpdateSplitSquares(hi, lo, grad, m, v backend.Tensor, h backend.AdamW) func() float64 {
	if o, ok := p.inner.(backend.SquaringOptimizer); ok {
		defer p.end(p.begin(), opAdamWUpdate)
		return o.AdamWUpdateSplitSquares(hi, lo, grad, m, v, h)
	}
	sq := p.SumSquaresLater(grad)
	p.AdamWUpdateSplit(hi, lo, grad, m, v, h)
	return sq
}

func (p *Backend) GatherPeerRows(outRD backend.Tensor, srcTD, tokS, scaleS []backend.Tensor, refsR2 backend.Tensor) {
	defer p.end(p.begin(), opGatherPeerRows)
	p.inner.GatherPeerRows(outRD, srcTD, tokS, scaleS, refsR2)
}

func (p *Backend) PeerRowRefs(refsR2 backend.Tensor, blocks []backend.RowBlock) {
	defer p.end(p.begin(), opPeerRowRefs)
	p.inner.PeerRowRefs(refsR2, blocks)
}

func (p *Backend) ScatterPeerRows(outSD []backend.Tensor, inRD, refsR2 backend.Tensor) {
	defer p.end(p.begin(), opScatterPeerRows)
	p.inner.ScatterPeerRows(outSD, inRD, refsR2)
}

func (p *Backend) DispatchSwiGLU(xRD, h1RF, h3RF, actRF backend.Tensor, srcTD, tokS []backend.Tensor, refsR2, w1GFD, w3GFD backend.Tensor, groups backend.Groups) {
	defer p.end(p.begin(), opDispatchSwiGLU)
	p.inner.DispatchSwiGLU(xRD, h1RF, h3RF, actRF, srcTD, tokS, refsR2, w1GFD, w3GFD, groups)
}

func (p *Backend) MarkPeerRows(doneS []backend.Tensor, refsR2 backend.Tensor) {
	defer p.end(p.begin(), opMarkPeerRows)
	p.inner.MarkPeerRows(doneS, refsR2)
}

func (p *Backend) CombineRows(outTD, inSD, rowsS, scaleS, doneS backend.Tensor, sendCounts []int) {
	defer p.end(p.begin(), opCombineRows)
	p.inner.CombineRows(outTD, inSD, rowsS, scaleS, doneS, sendCounts)
}

func (p *Backend) DownCombine(outSD, doneS []backend.Tensor, refsR2, actRF, w2GDF backend.Tensor, groups backend.Groups) {
	defer p.end(p.begin(), opDownCombine)
	p.inner.DownCombine(outSD, doneS, refsR2, actRF, w2GDF, groups)
}

func (p *Backend) DispatchDgradSwiGLU(dyRD, dh1RF, dh3RF backend.Tensor, srcTD, tokS, scaleS []backend.Tensor, refsR2, h1RF, h3RF, w2GDF backend.Tensor, groups backend.Groups) {
	defer p.end(p.begin(), opDispatchDgrad)
	p.inner.DispatchDgradSwiGLU(dyRD, dh1RF, dh3RF, srcTD, tokS, scaleS, refsR2, h1RF, h3RF, w2GDF, groups)
}

func (p *Backend) DgradCombine(outSD, doneS []backend.Tensor, refsR2, dh1RF, dh3RF, w1GFD, w3GFD backend.Tensor, groups backend.Groups) {
	defer p.end(p.begin(), opDgradCombine)
	p.inner.DgradCombine(outSD, doneS, refsR2, dh1RF, dh3RF, w1GFD, w3GFD, groups)
}

func (p *Backend) AllGatherMatMul(fullRK backend.Tensor, outs, shardsBK, ws []backend.Tensor, transW bool, rank int) {
	defer p.end(p.begin(), opAllGatherMatMul)
	p.inner.AllGatherMatMul(fullRK, outs, shardsBK, ws, transW, rank)
}

func (p *Backend) MatMulScatter(dstsS []backend.Tensor, row0 int, a, w backend.Tensor, transW bool, landing backend.ScatterLanding, rank int) {
	defer p.end(p.begin(), opMatMulScatter)
	p.inner.MatMulScatter(dstsS, row0, a, w, transW, landing, rank)
}
