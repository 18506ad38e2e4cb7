package engine_test

import (
	"fmt"

	"sparsemla/engine"
)

// One decode step of the tiny config's CSA layer at p = 7, which completes
// compressed row 1: the stages in spec order and the state after the step.
func ExampleRunStep() {
	cfg, _ := engine.Preset("tiny")
	const layer, p = 1, 7
	w := engine.RandomLayerWeights(cfg, layer, 1)
	rope := engine.LayerRope(cfg, layer, 16)
	st := engine.SyntheticState(cfg, w, rope, p, 1)
	ctx := &engine.StepContext{Cfg: cfg, Layer: layer, Pos: p, W: w, Rope: rope}
	out, next, err := engine.RunStep(ctx, engine.SyntheticInput(cfg, p, 1), st)
	if err != nil {
		panic(err)
	}
	for _, def := range engine.Stages(cfg, layer, p)[:5] {
		fmt.Printf("%-13s %v  %s\n", def.Name, out[def.Name].Shape, def.Equation)
	}
	fmt.Println("index list:", out["topk_idxs"].I[:10], "…", out["topk_idxs"].I[128:])
	fmt.Println("compressed rows before/after:", st.Rows(), next.Rows(), "next position:", next.Next)
	// Output:
	// q_a           [128]  q_a = FP8Lin(wq_a, x)
	// cq            [128]  cq = RMSNorm(q_a) ⊙ q_norm
	// q_b           [4 512]  q_b = FP8Lin(wq_b, cq) viewed [H][head_dim]
	// q_pe_prerope  [4 64]  q_pe_prerope = HeadRMS(q_b)[:, nope:]  (every op rounds to bf16)
	// q             [4 512]  q = [HeadRMS(q_b)[:, :nope] | RoPE(q_pe_prerope, p)]
	// index list: [0 1 2 3 4 5 6 7 -1 -1] … [129 128]
	// compressed rows before/after: 1 2 next position: 8
}
