package engine_test

import (
	"context"
	"fmt"
	"log"

	"github.com/mktrain/mktrain/engine"
)

// A service embeds the engine: it builds a config (here the tiny defaults,
// shortened), watches each step through a hook and can cancel the context to
// stop training between two steps.
func Example() {
	cfg := engine.DefaultConfig()
	cfg.Train.Steps = 3
	cfg.Train.Seq = 16
	cfg.Train.GlobalBatch, cfg.Train.MicroBatch = 2, 2
	cfg.Train.WarmupSteps = 1
	cfg.Train.Backend = "cpu"

	steps := 0
	eng, err := engine.New(cfg, engine.WithHook(func(ev engine.StepEvent) { steps = ev.Step }))
	if err != nil {
		log.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("steps:", steps, res.Steps)
	// Output: steps: 3 3
}
