package fault

import (
	"fmt"

	"sparsemla/engine"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// corruptBlock applies a fault of the whole layer (NeedsBlock) to the
// value out of its stage, from the stage's inputs in.
func corruptBlock(ctx *engine.StepContext, f Fault, out engine.Tensor, in map[string]engine.Tensor) (engine.Tensor, error) {
	if ctx.W == nil || ctx.W.Block == nil {
		return engine.Tensor{}, fmt.Errorf("fault %s: the layer has no block weights", f)
	}
	b := ctx.W.Block
	cfg := ctx.Cfg
	switch f.Kind {
	case ExpertNibble:
		x, idxT, w := in["ffn_in"], in["moe_indices"], in["moe_weights"]
		m := *b.MoE
		m.Experts = make([]*moe.Expert, m.Gate.Experts)
		m.Source = nil
		idx := make([]int32, len(idxT.I))
		for t, e := range idxT.I {
			if e < 0 || e >= int64(m.Gate.Experts) {
				return engine.Tensor{}, fmt.Errorf("fault %s: moe_indices[%d] = %d is not an expert", f, t, e)
			}
			idx[t] = int32(e)
			ex := b.MoE.Experts[e]
			if ex == nil && b.MoE.Source != nil {
				var err error
				if ex, err = b.MoE.Source.Expert(int(e)); err != nil {
					return engine.Tensor{}, err
				}
			}
			if ex == nil {
				return engine.Tensor{}, fmt.Errorf("fault %s: expert %d has no weights", f, e)
			}
			m.Experts[e] = &moe.Expert{W1: swapped(ex.W1), W2: swapped(ex.W2), W3: swapped(ex.W3)}
		}
		y, err := m.Combine(x.F, idx, w.F)
		if err != nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: %w", f, err)
		}
		return engine.FromF(engine.KindBF16, y, len(y)), nil
	case RouterBias:
		g := &b.MoE.Gate
		s := make([]float32, g.Experts)
		g.Scores(s, in["ffn_in"].F)
		sel, _ := moe.TopK(s, g.TopK)
		bad := out.Clone()
		for t, e := range sel {
			bad.I[t] = int64(e)
		}
		return bad, nil
	case HCPostTransposed:
		hc, dim := cfg.HCMult, cfg.Dim
		comb := in["hc_attn_comb"].F
		tr := make([]float32, len(comb))
		for j := 0; j < hc; j++ {
			for k := 0; k < hc; k++ {
				tr[k*hc+j] = comb[j*hc+k]
			}
		}
		h := make([]float32, hc*dim)
		mhc.Post(h, in["y"].F, in["h_in"].F, in["hc_attn_post"].F, tr)
		return engine.FromF(engine.KindBF16, h, hc, dim), nil
	}
	return engine.Tensor{}, fmt.Errorf("fault %s: not a fault of the whole layer", f)
}

// swapped returns w with the two E2M1 codes of every byte exchanged.
func swapped(w *moe.FP4Weight) *moe.FP4Weight {
	p := make([]uint8, len(w.Packed))
	for i, c := range w.Packed {
		p[i] = c<<4 | c>>4
	}
	return &moe.FP4Weight{Rows: w.Rows, Cols: w.Cols, Packed: p, Scale: w.Scale}
}
