package fault

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"

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
	if b, ok := v41BlockFaults[f.Kind]; ok {
		return b.stage, fmt.Sprintf("reproduced by hypothesis %q", b.hyp)
	}
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
	return checkV41FaultWhole(cfg, f, first, last, false)
}

// checkV41FaultWhole is checkV41Fault for a run that holds the whole model
// (whole) or the attention sub-layers only.
func checkV41FaultWhole(cfg *engine.Config, f Fault, first, last int64, whole bool) error {
	if err := checkV41BlockFault(cfg, f, whole); err != nil {
		return err
	}
	_, attn := v41FaultStage[f.Kind]
	if _, blk := v41BlockFaults[f.Kind]; !attn && !blk {
		return fmt.Errorf("fault %s: not implemented for DeepSeek-V4.1 dumps (window-order, topk-off-by-one and, with the whole model, %s are)", f, v41BlockKindList())
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
			fs := topKFirstStep(cfg, f.Layer)
			where := fmt.Sprintf("steps %d … %d can", fs, last)
			if fs > last {
				where = fmt.Sprintf("the dumped steps %d … %d all come before it", first, last)
			} else if fs < first {
				where = fmt.Sprintf("steps %d … %d can", first, last)
			}
			return fmt.Errorf("fault %s: Tc = %d ≤ index_topk = %d, every row is selected (Tc > %d from step %d on at layer %d's r = %d; %s)", f, tc, cfg.IndexTopK, cfg.IndexTopK, fs, f.Layer, cfg.Ratio(f.Layer), where)
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
	whole := engine.V41FFNSize(cfg)*int64(cfg.NLayers) <= 1<<28
	if f != nil {
		if err := checkV41FaultWhole(cfg, *f, first, last, whole); err != nil {
			return nil, err
		}
	}
	var m *engine.V41Model
	if whole {
		m = engine.NewRandomV41WholeModel(cfg, seed, int(last)+1)
	} else {
		m = engine.NewRandomV41Model(cfg, seed, int(last)+1)
	}
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
			seen := map[string]engine.Tensor{} // the fault layer's stages so far (head-no-norm reads head_in)
			hook = func(l int, def engine.V41StageDef, in map[string]engine.Tensor, t engine.Tensor) (engine.Tensor, error) {
				if b, ok := v41BlockFaults[f.Kind]; ok {
					if l != f.Layer {
						return t, nil
					}
					if def.Name != b.stage {
						seen[def.Name] = t
						return t, nil
					}
					all := map[string]engine.Tensor{}
					for n, v := range seen {
						all[n] = v
					}
					for n, v := range in {
						all[n] = v
					}
					c := &engine.V41Context{Cfg: cfg, Layer: l, Pos: p, W: m.Layers[l], Rope: m.Rope[l], Head: m.Head}
					return v41BlockInject(c, *f, all, t)
				}
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
		var res *engine.V41StepResult
		var err error
		if whole {
			tok := V41SynthToken(cfg, p, seed)
			if res, err = engine.V41WholeStep(m, st, tok, p, hook); err != nil {
				return nil, err
			}
			last := res.Stages[cfg.NLayers-1]
			last[engine.GlobalPrefix+"tok"] = engine.FromI(engine.KindI64, []int64{tok}, 1)
			for n, t := range res.Global {
				last[engine.GlobalPrefix+n] = t
			}
		} else {
			if res, err = engine.V41Step(m, st, xs, p, hook); err != nil {
				return nil, err
			}
			for l := range res.Stages {
				res.Stages[l]["x"] = xs[l]
			}
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

// V41SynthToken is the seeded token id fed at step p of a synthetic V4.1
// run: uniform in [0, vocab_size).
func V41SynthToken(cfg *engine.Config, p int64, seed uint64) int64 {
	r := rand.New(rand.NewPCG(seed^0x41700c, uint64(p)))
	return int64(r.IntN(cfg.VocabSize))
}

// v41BlockKindList names the block fault kinds of V4.1, in Kinds() order.
func v41BlockKindList() string {
	var n []string
	for _, k := range Kinds() {
		if _, ok := v41BlockFaults[k]; ok {
			n = append(n, string(k))
		}
	}
	return strings.Join(n, ", ")
}
