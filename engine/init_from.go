package engine

// checkpoint.init_from: a fresh run starts from the weights of a Hugging
// Face Mixtral directory (package hf reads it). The parameters already
// have Mixtral's names (params.go), so every rank reads the tensors it
// holds by name, experts by global index.

import (
	"fmt"

	"github.com/mktrain/mktrain/hf"
)

// HFModel is cfg's model as a Hugging Face Mixtral config.json describes it;
// max_position_embeddings is train.seq. A model with shared experts has no
// Mixtral form: its HFModel leaves them out.
func HFModel(cfg Config) hf.Model {
	m := cfg.Model
	return hf.Model{
		Vocab: m.Vocab, Dim: m.Dim, Layers: m.Layers, Heads: m.Heads, KVHeads: m.KVHeads, HeadDim: m.HeadDim(),
		FFN: m.MoE.FFN, Experts: m.MoE.Experts, TopK: m.MoE.TopK,
		RopeTheta: m.RopeTheta, NormEps: m.NormEps,
		MaxPositions: cfg.Train.Seq, AuxLossCoef: m.MoE.AuxLossCoef, InitStd: m.InitStd,
	}
}

// loadHF initialises every rank from the Hugging Face Mixtral directory
// named by checkpoint.init_from: config.json must describe the recipe's
// model, and every parameter is read by name (experts by global index), in
// whatever dtype the files hold. Optimizer moments and expert biases keep
// their zero start.
func (e *Engine) loadHF(dir string, ranks []*rank) error {
	m := e.cfg.Model
	if m.MoE.SharedExperts > 0 {
		return fmt.Errorf("checkpoint.init_from: model.moe.shared_experts is %d, but a Mixtral directory has no shared experts to load",
			m.MoE.SharedExperts)
	}
	w, err := hf.Open(dir, HFModel(e.cfg))
	if err != nil {
		return fmt.Errorf("checkpoint.init_from: %w", err)
	}
	defer w.Close()
	for i, r := range ranks {
		if err := r.loadHF(w); err != nil {
			return fmt.Errorf("checkpoint.init_from: rank %d: %w", i, err)
		}
	}
	e.log.Info().Str("init_from", dir).Int("files", w.Files()).Msg("initialised from Hugging Face weights")
	return nil
}

// loadHF reads every parameter of r from w.
func (r *rank) loadHF(w *hf.Weights) error {
	for _, p := range r.params {
		host := make([]float32, p.w.Len())
		if p.split.n > 1 {
			// Tensor parallelism: the whole tensor, of which the rank
			// keeps its block.
			whole := make([]float32, shapeLen(p.global))
			if err := w.Read(p.slot.name, p.global, whole); err != nil {
				return err
			}
			p.upload(r.b, p.split.block(whole, p.global))
			continue
		}
		for _, piece := range p.pieces() {
			if err := w.Read(piece.name, piece.shape, host[piece.offset:piece.offset+piece.size]); err != nil {
				return err
			}
		}
		p.upload(r.b, host)
	}
	return nil
}
