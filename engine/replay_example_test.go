package engine_test

import (
	"context"
	"fmt"

	"sparsemla/engine"
)

// A synthetic dump with a corrupted FP8 scale byte in the cache page of an
// older window row, replayed teacher-forced: the first divergence names the
// step, layer and stage where the GPU made the error, and why.
func ExampleReplay() {
	f := engine.Fault{Kind: engine.FaultScaleByte, Step: 8, Layer: 0}
	s, err := engine.Synthesize(engine.SynthOptions{Prefill: 6, Steps: 4, Seed: 1, Fault: &f})
	if err != nil {
		panic(err)
	}
	rep, err := engine.Replay(context.Background(), s.Model(), s.Src, engine.ReplayOptions{})
	if err != nil {
		panic(err)
	}
	fmt.Println(rep.Verdict)
	fmt.Println(rep.First.Step, rep.First.Layer, rep.First.Stage, rep.First.Kind)
	// Output:
	// diverged
	// 8 0 kv_cache FP8 cache
}
