package fault

import (
	"fmt"

	"sparsemla/engine"
	"sparsemla/replay"
)

// topKFirstStep is the first decode step at which layer l's indexer leaves
// a row unselected, so that a top-k off by one can slip to it: Tc =
// floor((p+1)/r) compressed rows > index_topk (V4, V4.1: p >= r·(k+1) − 1),
// or p+1 tokens > index_topk (V3.2, whose indexer ranks every token:
// p >= k). -1 when the layer runs no indexer (r = 0).
func topKFirstStep(cfg *engine.Config, l int) int64 {
	k := int64(cfg.IndexTopK)
	if cfg.V32() {
		return k
	}
	r := int64(cfg.Ratio(l))
	if r <= 0 {
		return -1
	}
	return r*(k+1) - 1
}

// topKWhere says which of the dumped steps can take a top-k off by one
// that needs step >= first.
func topKWhere(first int64, steps []int64) string {
	var ok []int64
	for _, p := range steps {
		if p >= first {
			ok = append(ok, p)
		}
	}
	if len(ok) == 0 {
		return fmt.Sprintf("this dump's decode steps (%s) all come before it, so no step of it can take the fault", replay.StepList(steps))
	}
	return "dumped steps that can: " + replay.StepList(ok)
}

// checkTopKDump refuses a top-k off by one where the indexer of f.Layer
// selects every row it has (Tc <= index_topk in V4, step+1 <= index_topk
// in V3.2: no unselected neighbour for the last entry to slip to), naming
// the first step where that layer can take it and which dumped steps can.
// The layer kind (no indexer) and the step range are Check's.
func checkTopKDump(f Fault, cfg *engine.Config, steps []int64) error {
	if f.Kind != TopKOffByOne || len(steps) == 0 || f.Layer < 0 || f.Layer >= cfg.NLayers {
		return nil
	}
	if !cfg.V32() && cfg.Ratio(f.Layer) != 4 {
		return nil // Check: no indexer
	}
	first := topKFirstStep(cfg, f.Layer)
	if f.Step >= first {
		return nil
	}
	where := topKWhere(first, steps)
	k := cfg.IndexTopK
	if f.Step < steps[0] || f.Step > steps[len(steps)-1] {
		return fmt.Errorf("fault %s: step outside the dumped steps %d..%d; layer %d's indexer leaves a row unselected (to be off by one to) from step %d on; %s",
			f, steps[0], steps[len(steps)-1], f.Layer, first, where)
	}
	if cfg.V32() {
		return fmt.Errorf("fault %s: at step %d the indexer selects every one of its %d tokens (top-%d): no unselected neighbour to be off by one to (needs step >= %d; %s)",
			f, f.Step, f.Step+1, k, first, where)
	}
	tc := (f.Step + 1) / 4
	return fmt.Errorf("fault %s: at step %d the indexer selects every one of its Tc = %d compressed rows (top-%d): no unselected neighbour to be off by one to (needs Tc > %d: step >= %d on layer %d; %s)",
		f, f.Step, tc, k, k, first, f.Layer, where)
}
