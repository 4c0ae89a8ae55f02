package moe

// Config is the sparse MoE block and its load balancing; it is the recipe's
// model.moe section.
type Config struct {
	Experts        int     `yaml:"experts"`          // routed experts E
	TopK           int     `yaml:"top_k"`            // experts per token K
	FFN            int     `yaml:"ffn"`              // expert hidden size F
	AuxLossCoef    float64 `yaml:"aux_loss_coef"`    // Switch load-balancing loss weight (0 = off)
	ZLossCoef      float64 `yaml:"z_loss_coef"`      // router z-loss weight (0 = off)
	BiasUpdateRate float64 `yaml:"bias_update_rate"` // aux-loss-free balancing step (0 = off)
	SharedExperts  int     `yaml:"shared_experts"`   // always-on experts of width FFN added for every token (0 = none)
	CapacityFactor float64 `yaml:"capacity_factor"`  // expert capacity = ceil(cf*T*K/E) per rank; 0 = dropless
	// Dispatcher is how token rows reach the experts and come back:
	// "unfused" (gather, all-to-all, permute; any comm.Group), "fused" (the
	// experts read their rows from the source ranks' tensors and write
	// their outputs straight back: the expert group must offer
	// comm.PeerAccess) or "auto" ("" means "auto": the engine picks one
	// from a measured table, tune.ResolveDispatcher; New takes only a resolved
	// value).
	Dispatcher string `yaml:"dispatcher"`
}

// The values of Config.Dispatcher.
const (
	DispatcherAuto    = "auto"
	DispatcherFused   = "fused"
	DispatcherUnfused = "unfused"
)
