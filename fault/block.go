package fault

import (
	"fmt"
	"math"

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
	case ExpertNibble, ExpertScaleBlock, ExpertNoClamp, SharedGateUp:
		return corruptExperts(f, b.MoE, in)
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
	case RouterHashOff:
		g := &b.MoE.Gate
		tok, ok := in[engine.GlobalPrefix+"tok"]
		if !g.Hash() || !ok || len(tok.I) != 1 {
			return engine.Tensor{}, fmt.Errorf("fault %s: the layer's router has no tid2eid table or the step no token id", f)
		}
		k, vocab := int64(g.TopK), int64(len(g.TID2EID)/g.TopK)
		t := tok.I[0] + 1
		if t >= vocab {
			return engine.Tensor{}, fmt.Errorf("fault %s: the token fed is %d, the last id of tid2eid [%d][%d]: no row after it", f, tok.I[0], vocab, k)
		}
		bad := out.Clone()
		for i, e := range g.TID2EID[t*k : (t+1)*k] {
			bad.I[i] = int64(e)
		}
		return bad, nil
	case RouterUnnormalised:
		g := &b.MoE.Gate
		idx, err := routed(f, g, in["moe_indices"])
		if err != nil {
			return engine.Tensor{}, err
		}
		s := make([]float32, g.Experts)
		g.Scores(s, in["ffn_in"].F)
		// The softmax branch of the weight rule: no division by the sum.
		w := moe.RouteWeights(s, idx, moe.Softmax, g.RouteScale)
		return engine.FromF(engine.KindF32, w, len(w)), nil
	case HCPostTransposed:
		hc, dim := cfg.HCMult, cfg.Dim
		tr := mhc.Transpose(in["hc_attn_comb"].F, hc)
		h := make([]float32, hc*dim)
		mhc.Post(h, in["y"].F, in["h_in"].F, in["hc_attn_post"].F, tr)
		return engine.FromF(engine.KindBF16, h, hc, dim), nil
	case HCSplitNoSigmoid:
		hc := cfg.HCMult
		s, mixes := b.FFNSite, in["hc_ffn_mixes"].F
		post := make([]float32, hc)
		for j := range post {
			post[j] = 2 * (float32(mixes[hc+j]*s.Scale[1]) + s.Base[hc+j])
		}
		return engine.FromF(engine.KindF32, post, hc), nil
	case HeadNoNorm:
		if ctx.Head == nil || ctx.Head.Head == nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: the model has no head weights", f)
		}
		hd := ctx.Head.Head
		o := hd.Forward(in["h_out"].F)
		l := hd.Logits(o.X) // the hc_head collapse, not RMSNorm(·) ⊙ norm
		return engine.FromF(engine.KindF32, l, len(l)), nil
	}
	return engine.Tensor{}, fmt.Errorf("fault %s: not a fault of the whole layer", f)
}

// corruptExperts is ffn_out of the routed experts in moe_indices computed
// with the fault's decode bug.
func corruptExperts(f Fault, m *moe.MoE, in map[string]engine.Tensor) (engine.Tensor, error) {
	x, w := in["ffn_in"].F, in["moe_weights"].F
	idx, err := routed(f, &m.Gate, in["moe_indices"])
	if err != nil {
		return engine.Tensor{}, err
	}
	var bad *moe.MoE
	switch f.Kind {
	case ExpertNibble:
		bad, err = m.WithRouted(idx, func(e *moe.Expert) *moe.Expert { return e.Map((*moe.FP4Weight).NibbleSwapped) })
	case ExpertScaleBlock:
		bad, err = m.WithRouted(idx, func(e *moe.Expert) *moe.Expert { return e.Map((*moe.FP4Weight).ScalePer128) })
	case ExpertNoClamp:
		if err := clampActs(f, m, x, idx); err != nil {
			return engine.Tensor{}, err
		}
		c := *m
		c.SwigluLimit = 0
		bad = &c
	case SharedGateUp:
		if m.Shared == nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: the layer has no shared expert", f)
		}
		c := *m
		c.Shared = m.Shared.GateUpSwapped()
		bad = &c
	}
	if err != nil {
		return engine.Tensor{}, fmt.Errorf("fault %s: %w", f, err)
	}
	y, err := bad.Combine(x, idx, w)
	if err != nil {
		return engine.Tensor{}, fmt.Errorf("fault %s: %w", f, err)
	}
	return engine.FromF(engine.KindBF16, y, len(y)), nil
}

// clampActs refuses a missing clamp where it would not act: no routed
// expert's gate (w1) exceeds swiglu_limit and no up (w3) leaves ±limit.
func clampActs(f Fault, m *moe.MoE, x []float32, idx []int32) error {
	lim := m.SwigluLimit
	var gmax, umax float32
	for _, e := range idx {
		ex, err := m.WithRouted([]int32{e}, func(e *moe.Expert) *moe.Expert { return e })
		if err != nil {
			return fmt.Errorf("fault %s: %w", f, err)
		}
		w := ex.Experts[e]
		g, u := make([]float32, w.W1.Rows), make([]float32, w.W3.Rows)
		moe.FP4Linear(g, x, w.W1)
		moe.FP4Linear(u, x, w.W3)
		for i := range g {
			if g[i] > lim || math.Abs(float64(u[i])) > float64(lim) || g[i] != g[i] || u[i] != u[i] {
				return nil
			}
			gmax, umax = max(gmax, g[i]), max(umax, float32(math.Abs(float64(u[i]))))
		}
	}
	return fmt.Errorf("fault %s: the routed experts %v keep gate ≤ %g and |up| ≤ %g, inside swiglu_limit = %g: the clamp does not act, so leaving it out changes nothing: %w",
		f, idx, gmax, umax, lim, ErrInvisible)
}

// routed returns a dumped moe_indices as expert ids of gate g.
func routed(f Fault, g *moe.Gate, t engine.Tensor) ([]int32, error) {
	idx := make([]int32, len(t.I))
	for i, e := range t.I {
		if e < 0 || e >= int64(g.Experts) {
			return nil, fmt.Errorf("fault %s: moe_indices[%d] = %d is not an expert", f, i, e)
		}
		idx[i] = int32(e)
	}
	return idx, nil
}
