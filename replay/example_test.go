package replay_test

import (
	"context"
	"fmt"

	"sparsemla/fault"
	"sparsemla/replay"
)

// A synthetic dump with a corrupted FP8 scale byte in the cache page of an
// older window row, replayed teacher-forced: the first divergence names the
// step, layer and stage where the GPU made the error, and why.
func ExampleRun() {
	f := fault.Fault{Kind: fault.ScaleByte, Step: 8, Layer: 0}
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 4, Seed: 1, Fault: &f})
	if err != nil {
		panic(err)
	}
	rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{})
	if err != nil {
		panic(err)
	}
	fmt.Println(rep.Verdict)
	fmt.Println(rep.First.Step, rep.First.Layer, rep.First.Stage, rep.First.Kind)
	// Output:
	// diverged
	// 8 0 kv_cache FP8 cache
}
