package fault

import (
	"fmt"
	"slices"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/replay"
)

// V4.1 synthetic dumps: the reference's own V4.1 step (engine.V41Step) on
// seeded weights, state and inputs, written in the official V4.1 layout
// (replay.WriteV41Dir), optionally with one fault injected at its stage —
// the later stages and steps computed from the faulty value, as the GPU
// would. Two kinds apply to V4.1:
//
//	window-order     the window list in V4's order: the −1 of a filling ring
//	                 LAST (V4.1 puts them first; for a V4 model the same kind
//	                 injects V4.1's order); steps p < window−1; any layer
//	topk-off-by-one  the index source's k-th best row j replaced by j+1 (j−1
//	                 at the last row), the list re-sorted; index sources with
//	                 Tc > index_topk
//
// The other kinds are refused for V4.1.

// v41FaultStage is the stage each V4.1 fault kind shows at.
var v41FaultStage = map[Kind]string{WindowOrder: "topk_idxs", TopKOffByOne: "index_sel"}

// V41Synth is a synthetic V4.1 run ready to write.
type V41Synth struct {
	Cfg      *engine.Config
	Model    *engine.V41Model
	Pre      *engine.V41State
	Steps    map[int64][]map[string]engine.Tensor
	IndexKAt map[int64]int
	Fault    *Fault
	Seed     uint64
}

// V41FaultStage is the stage where a V4.1 fault first shows (the first
// divergence a local replay reports) and why.
func V41FaultStage(f Fault) (stage, why string) {
	switch f.Kind {
	case WindowOrder:
		return "topk_idxs", "window list in V4's order (−1 padding last), reproduced by hypothesis \"v4-window-order\""
	case TopKOffByOne:
		return "index_sel", "the top-k's k-th row off by one, reproduced by hypothesis \"topk-off-by-one\""
	}
	return "", ""
}

// checkV41Fault refuses a fault that does not apply to a V4.1 dump of
// steps first … last, one line each.
func checkV41Fault(cfg *engine.Config, f Fault, first, last int64) error {
	if _, ok := v41FaultStage[f.Kind]; !ok {
		return fmt.Errorf("fault %s: not implemented for DeepSeek-V4.1 dumps (window-order and topk-off-by-one are)", f)
	}
	if f.Step < first || f.Step > last {
		return fmt.Errorf("fault %s: step %d outside the dumped steps %d … %d", f, f.Step, first, last)
	}
	if f.Layer < 0 || f.Layer >= cfg.NLayers {
		return fmt.Errorf("fault %s: layer %d outside the %d layers", f, f.Layer, cfg.NLayers)
	}
	switch f.Kind {
	case WindowOrder:
		if f.Step >= int64(cfg.WindowSize-1) {
			return fmt.Errorf("fault %s: at p ≥ %d the window ring is full, both orders are the same list", f, cfg.WindowSize-1)
		}
	case TopKOffByOne:
		if !cfg.IsIndexSource(f.Layer) {
			return fmt.Errorf("fault %s: layer %d runs no indexer (index sources %v)", f, f.Layer, cfg.IndexSources())
		}
		if tc := attention.VisibleRows(f.Step, cfg.Ratio(f.Layer)); tc <= cfg.IndexTopK {
			return fmt.Errorf("fault %s: Tc = %d ≤ index_topk = %d, every row is selected", f, tc, cfg.IndexTopK)
		}
	}
	return nil
}

// V41OffByOne is the topk-off-by-one selection: the top k rows of scores
// with the k-th best row j replaced by j+1 (j−1 when j is the last row),
// sorted ascending, plus offset.
func V41OffByOne(scores []float32, k, offset int) []int64 {
	top, _ := indexer.TopK(scores, k)
	sel := slices.Clone(top)
	j := sel[k-1]
	if int(j)+1 < len(scores) {
		sel[k-1] = j + 1
	} else {
		sel[k-1] = j - 1
	}
	slices.Sort(sel)
	for i := range sel {
		sel[i] += int64(offset)
	}
	return sel
}

// SynthesizeV41 runs steps prefill … prefill+steps−1 of a V4.1 config (a
// preset or a validated config) from SyntheticV41State, with f injected
// when non-nil.
func SynthesizeV41(cfg *engine.Config, prefill, steps int, seed uint64, f *Fault) (*V41Synth, error) {
	if !cfg.IsV41() {
		return nil, fmt.Errorf("synth: not a V4.1 config")
	}
	if steps <= 0 || prefill < 1 {
		return nil, fmt.Errorf("synth: need steps >= 1 and prefill >= 1")
	}
	if cfg.Dim*cfg.NHeads*cfg.HeadDim*cfg.NLayers > 1<<28 {
		return nil, fmt.Errorf("synth: this V4.1 config would need several GB of synthetic weights; use v41-tiny")
	}
	first, last := int64(prefill), int64(prefill+steps-1)
	if last >= int64(cfg.MaxSeqLen) {
		return nil, fmt.Errorf("synth: %d positions exceed max_seq_len %d", last+1, cfg.MaxSeqLen)
	}
	if f != nil {
		if err := checkV41Fault(cfg, *f, first, last); err != nil {
			return nil, err
		}
	}
	m := engine.NewRandomV41Model(cfg, seed, int(last)+1)
	pre := engine.SyntheticV41State(m, first, seed)
	s := &V41Synth{Cfg: cfg, Model: m, Pre: pre, Steps: map[int64][]map[string]engine.Tensor{}, IndexKAt: map[int64]int{}, Fault: f, Seed: seed}
	st := pre
	for p := first; p <= last; p++ {
		xs := make([]engine.Tensor, cfg.NLayers)
		for l := range xs {
			xs[l] = engine.SyntheticV41Input(cfg, l, p, seed)
		}
		var hook engine.V41Hook
		if f != nil && f.Step == p {
			hook = func(l int, def engine.V41StageDef, in map[string]engine.Tensor, t engine.Tensor) (engine.Tensor, error) {
				if l != f.Layer || def.Name != v41FaultStage[f.Kind] {
					return t, nil
				}
				t = t.Clone()
				switch f.Kind {
				case WindowOrder:
					for i, v := range attention.WindowIdx(p, cfg.WindowSize) {
						t.I[i] = int64(v)
					}
				case TopKOffByOne:
					sc, ok := in["index_score_masked"]
					if !ok {
						sc = in["index_score"]
					}
					t.I = V41OffByOne(sc.F, len(t.I), cfg.WindowSize)
				}
				return t, nil
			}
		}
		s.IndexKAt[p] = st.IndexKAt
		res, err := engine.V41Step(m, st, xs, p, hook)
		if err != nil {
			return nil, err
		}
		for l := range res.Stages {
			res.Stages[l]["x"] = xs[l]
		}
		s.Steps[p] = res.Stages
		st = res.Next
	}
	return s, nil
}

// Write writes the run into dir in the official V4.1 layout.
func (s *V41Synth) Write(dir string) error {
	prod := map[string]string{"producer": "sparsemla synth", "seed": fmt.Sprint(s.Seed)}
	if s.Fault != nil {
		prod["injected_fault"] = s.Fault.String()
	}
	if err := replay.WriteV41Dir(dir, s.Model, s.Pre, s.Steps, s.IndexKAt, prod); err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	return nil
}
