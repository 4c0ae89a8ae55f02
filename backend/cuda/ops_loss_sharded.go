package cuda

// The cross-entropy of logits split by vocabulary over tensor-parallel
// ranks (backend.Backend's CrossEntropyShard and CrossEntropyShardFinish;
// kernels/crossentropy.cu's cross_entropy_shard_f32 and
// cross_entropy_shard_finish_f32).

import "github.com/mktrain/mktrain/backend"

// CrossEntropyShard writes each row's log-sum-exp of this slice of the
// vocabulary and the target's logit where the slice holds it (else 0).
func (b *Backend) CrossEntropyShard(lseT, targetLogitT, logitsTV, targetsT backend.Tensor, vocabLo int) {
	const op = "CrossEntropyShard"
	logits, t, v := matrix(op, "logits", logitsTV)
	lse := vector(op, "lse", lseT, t)
	target := vector(op, "targetLogit", targetLogitT, t)
	targets := indices(op, "targets", targetsT, t)
	fitsInt32(op, t, v, vocabLo)
	if t == 0 {
		return
	}
	b.launch(b.k.crossEntropyShard, Grid1D(t, 256), lse, target, logits, targets, int32(t), int32(v), int32(vocabLo))
}

// CrossEntropyShardFinish joins the slices' log-sum-exps lseRT [R, T] into
// the loss and writes this slice's gradient.
func (b *Backend) CrossEntropyShardFinish(lossT, dlogitsTV, logitsTV, lseRT, targetLogitT, targetsT backend.Tensor, vocabLo int, gradScale float64) {
	const op = "CrossEntropyShardFinish"
	logits, t, v := matrix(op, "logits", logitsTV)
	loss := vector(op, "loss", lossT, t)
	dlogits := wantMatrix(op, "dlogits", dlogitsTV, t, v)
	_, r, _ := matrix(op, "lse", lseRT)
	lse := wantMatrix(op, "lse", lseRT, r, t)
	target := vector(op, "targetLogit", targetLogitT, t)
	targets := indices(op, "targets", targetsT, t)
	fitsInt32(op, t, v, r, vocabLo)
	if t == 0 {
		return
	}
	b.launch(b.k.crossEntropyShardFinish, Grid1D(t, 256), loss, dlogits, logits, lse, target, targets,
		int32(t), int32(v), int32(r), int32(vocabLo), float32(gradScale))
}
