package attribute

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/head"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// The hypotheses of the stages around the attention sub-layer: the router
// (moe_indices, moe_weights), the experts (ffn_out), the hyper-connection
// split/Sinkhorn (hc_*_pre/post/comb), the residual hc_post (h_mid, h_out)
// and the head (logits). Each recomputes the stage from its own inputs with
// one known bug; the FP4/FP8 decode variants are package moe's
// (variants.go), so the buggy weights go through the reference loops.
func init() {
	add("moe_indices",
		Hypothesis{Name: "hash-row-next", Desc: "tid2eid[tok+1]: the hash table row of the token id one past the token fed",
			run: func(c *Call) (engine.Tensor, error) { return hashRow(c, +1) }},
		Hypothesis{Name: "hash-row-prev", Desc: "tid2eid[tok-1]: the hash table row of the token id one before the token fed",
			run: func(c *Call) (engine.Tensor, error) { return hashRow(c, -1) }},
		Hypothesis{Name: "topk-on-hash-layer", Desc: "top-k of the scores on a hash layer (tid2eid not used)", run: topKOnHash},
		Hypothesis{Name: "no-selection-bias", Desc: "top-k of the scores without the selection bias (gate.bias)", run: topKNoBias})
	add("moe_weights",
		Hypothesis{Name: "weights-unnormalised", Desc: "the chosen scores × route_scale, not divided by their sum",
			run: func(c *Call) (engine.Tensor, error) { return routeWeights(c, true, 0, false) }},
		Hypothesis{Name: "weights-no-route-scale", Desc: "the chosen scores divided by their sum, without × route_scale",
			run: func(c *Call) (engine.Tensor, error) { return routeWeights(c, false, 1, false) }},
		Hypothesis{Name: "weights-with-bias", Desc: "the weights taken from score + bias (the bias is for the choice only)",
			run: func(c *Call) (engine.Tensor, error) { return routeWeights(c, false, 0, true) }})
	add("ffn_out",
		routedVariant("fp4-nibble-swap", "the routed experts' FP4 codes read with the even column from the HIGH nibble (float4_e2m1fn_x2 keeps it in the low one)",
			func(e *moe.Expert) *moe.Expert { return e.Map((*moe.FP4Weight).NibbleSwapped) }, false),
		routedVariant("fp4-scale-per-128", "the routed experts' UE8M0 scales indexed per 128 columns (the FP8 block, k/128) instead of per 32",
			func(e *moe.Expert) *moe.Expert { return e.Map((*moe.FP4Weight).ScalePer128) }, false),
		routedVariant("no-swiglu-clamp", "the routed experts without the swiglu_limit clamp (up to ±limit, gate ≤ limit)", nil, true),
		sharedVariant("shared-swiglu-clamp", "the shared expert clamped with swiglu_limit like the routed ones (spec §12.1: the release-day model.py does not)",
			func(m *moe.MoE) func(out, x []float32) {
				return func(out, x []float32) { m.Shared.ForwardClamped(out, x, m.SwigluLimit) }
			}),
		sharedVariant("shared-gate-up-swapped", "the shared expert with w1 (gate) and w3 (up) exchanged",
			func(m *moe.MoE) func(out, x []float32) { return m.Shared.GateUpSwapped().Forward }),
		sharedVariant("shared-act-per-token", "the shared expert's FP8 GEMMs with one activation scale per token instead of per 128 columns",
			func(m *moe.MoE) func(out, x []float32) { return m.Shared.ForwardActPerToken }),
		sharedVariant("no-shared-expert", "the routed experts only, the shared expert left out",
			func(m *moe.MoE) func(out, x []float32) { return nil }))
	for _, side := range []string{"attn", "ffn"} {
		s := "hc_" + side + "_"
		add(s+"comb",
			splitVariant(side, "comb", "sinkhorn-one-fewer", "one Sinkhorn iteration fewer than hc_sinkhorn_iters", -1, 1, false),
			splitVariant(side, "comb", "sinkhorn-one-more", "one Sinkhorn iteration more than hc_sinkhorn_iters", +1, 1, false),
			splitVariant(side, "comb", "sinkhorn-no-eps", "hc_split_sinkhorn without hc_eps (after the row softmax and in the row/column denominators)", 0, 0, false))
		add(s+"pre",
			splitVariant(side, "pre", "pre-no-eps", "pre = sigmoid(·) without the + hc_eps", 0, 0, false),
			splitVariant(side, "pre", "pre-no-sigmoid", "pre = mixes·scale + base + hc_eps, the sigmoid left out", 0, 1, true))
		add(s+"post",
			splitVariant(side, "post", "post-no-factor-2", "post = sigmoid(·) without the factor 2", 0, 1, false),
			splitVariant(side, "post", "post-no-sigmoid", "post = 2·(mixes·scale + base), the sigmoid left out", 0, 1, true))
	}
	for _, st := range []string{"h_mid", "h_out"} {
		add(st, postVariant(st, "hc-post-comb-transposed", "hc_post with comb transposed (out_j = post_j·a + Σ_k comb[j][k]·h_k)"),
			postVariant(st, "hc-post-no-post-weights", "hc_post adding the sub-layer output to every stream without the post weights"),
			postVariant(st, "hc-post-unmixed", "hc_post keeping each residual stream unmixed (comb ignored: out_j = post_j·a + h_j)"))
	}
	add("logits",
		headVariant("head-no-final-norm", "the logits of the hc_head collapse without the final RMSNorm (norm.weight)"),
		headVariant("head-norm-no-weight", "the final RMSNorm without its weight norm.weight"),
		headVariant("hc-head-mean", "hc_head collapsing the streams with equal weights 1/hc_mult (sigmoid weights not used)"),
		headVariant("hc-head-stream-0", "the head reading stream 0 of h_out alone (no hc_head collapse)"))
}

func blockOf(c *Call) (*engine.BlockWeights, error) {
	if c.Ctx.W == nil || c.Ctx.W.Block == nil {
		return nil, fmt.Errorf("the layer has no block weights")
	}
	return c.Ctx.W.Block, nil
}

// routeIn returns the gate, its scores of ffn_in and the dumped
// moe_indices (checked expert ids; nil when the stage does not read them).
func routeIn(c *Call, needIdx bool) (*moe.Gate, []float32, []int32, error) {
	b, err := blockOf(c)
	if err != nil {
		return nil, nil, nil, err
	}
	g := &b.MoE.Gate
	x, err := inF(c, "ffn_in")
	if err != nil {
		return nil, nil, nil, err
	}
	if len(x) != g.Dim {
		return nil, nil, nil, fmt.Errorf("ffn_in has %d values, the gate %d", len(x), g.Dim)
	}
	s := make([]float32, g.Experts)
	g.Scores(s, x)
	if !needIdx {
		return g, s, nil, nil
	}
	t, ok := c.get("moe_indices")
	if !ok || t.Kind.IsFloat() {
		return nil, nil, nil, fmt.Errorf("needs moe_indices, which is not available")
	}
	idx := make([]int32, len(t.I))
	for i, e := range t.I {
		if e < 0 || e >= int64(g.Experts) {
			return nil, nil, nil, fmt.Errorf("moe_indices[%d] = %d is not an expert", i, e)
		}
		idx[i] = int32(e)
	}
	return g, s, idx, nil
}

func idsLike(c *Call, ids []int32) (engine.Tensor, error) {
	v := make([]int64, len(ids))
	for i, e := range ids {
		v[i] = int64(e)
	}
	if len(v) != c.Ref.Len() {
		return engine.Tensor{}, fmt.Errorf("gives %d experts, the stage has %d", len(v), c.Ref.Len())
	}
	return engine.FromI(c.Ref.Kind, v, c.Ref.Shape...), nil
}

func hashRow(c *Call, off int64) (engine.Tensor, error) {
	b, err := blockOf(c)
	if err != nil {
		return engine.Tensor{}, err
	}
	g := &b.MoE.Gate
	if !g.Hash() {
		return engine.Tensor{}, fmt.Errorf("not a hash layer")
	}
	tok, ok := c.get(engine.GlobalPrefix + "tok")
	if !ok || len(tok.I) != 1 {
		return engine.Tensor{}, fmt.Errorf("needs the token id, which is not available")
	}
	k, vocab := int64(g.TopK), int64(len(g.TID2EID)/g.TopK)
	t := tok.I[0] + off
	if t < 0 || t >= vocab {
		return engine.Tensor{}, fmt.Errorf("token id %d outside tid2eid", t)
	}
	return idsLike(c, g.TID2EID[t*k:(t+1)*k])
}

func topKOnHash(c *Call) (engine.Tensor, error) {
	g, s, _, err := routeIn(c, false)
	if err != nil {
		return engine.Tensor{}, err
	}
	if !g.Hash() {
		return engine.Tensor{}, fmt.Errorf("not a hash layer")
	}
	sel, _ := moe.TopK(s, g.TopK)
	return idsLike(c, sel)
}

func topKNoBias(c *Call) (engine.Tensor, error) {
	g, s, _, err := routeIn(c, false)
	if err != nil {
		return engine.Tensor{}, err
	}
	if g.Hash() || g.Bias == nil {
		return engine.Tensor{}, fmt.Errorf("the gate has no selection bias")
	}
	sel, _ := moe.TopK(s, g.TopK)
	return idsLike(c, sel)
}

// routeWeights is the weight rule with one change: unnormalised (no
// division by the sum), a route scale (0: the gate's), or the bias added.
func routeWeights(c *Call, unnormalised bool, scale float32, bias bool) (engine.Tensor, error) {
	g, s, idx, err := routeIn(c, true)
	if err != nil {
		return engine.Tensor{}, err
	}
	f, rs := g.Func, g.RouteScale
	switch {
	case unnormalised:
		if f == moe.Softmax {
			return engine.Tensor{}, fmt.Errorf("softmax gates do not normalise")
		}
		f = moe.Softmax // the branch of the rule without the division
	case scale != 0:
		if rs == scale {
			return engine.Tensor{}, fmt.Errorf("route_scale is %g already", rs)
		}
		rs = scale
	case bias:
		if g.Bias == nil {
			return engine.Tensor{}, fmt.Errorf("the gate has no bias")
		}
		for e := range s {
			s[e] += g.Bias[e]
		}
	}
	return like(c, moe.RouteWeights(s, idx, f, rs))
}

// expertsIn returns the layer's MoE and the stage's dumped inputs.
func expertsIn(c *Call) (*moe.MoE, []float32, []int32, []float32, error) {
	b, err := blockOf(c)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	_, _, idx, err := routeIn(c, true)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	x, err := inF(c, "ffn_in")
	if err != nil {
		return nil, nil, nil, nil, err
	}
	w, err := inF(c, "moe_weights")
	if err != nil {
		return nil, nil, nil, nil, err
	}
	if len(w) != len(idx) {
		return nil, nil, nil, nil, fmt.Errorf("%d weights for %d experts", len(w), len(idx))
	}
	return b.MoE, x, idx, w, nil
}

// RoutedVariant returns the layer's MoE with decode variant f applied to
// the routed experts ids (noClamp: the swiglu_limit clamp left out
// instead), for the hypothesis of that name; ok is false when name is not
// a routed-expert hypothesis. Package replay uses it to say which expert a
// variant changes.
func RoutedVariant(name string, m *moe.MoE, ids []int32) (*moe.MoE, bool, error) {
	v, ok := routedVariants[name]
	if !ok {
		return nil, false, nil
	}
	if v.noClamp {
		if m.SwigluLimit <= 0 {
			return nil, true, fmt.Errorf("the model has no swiglu_limit clamp")
		}
		c := *m
		c.SwigluLimit = 0
		return &c, true, nil
	}
	mm, err := m.WithRouted(ids, v.f)
	return mm, true, err
}

type routedVar struct {
	f       func(*moe.Expert) *moe.Expert
	noClamp bool
}

var routedVariants = map[string]routedVar{}

func routedVariant(name, desc string, f func(*moe.Expert) *moe.Expert, noClamp bool) Hypothesis {
	routedVariants[name] = routedVar{f, noClamp}
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		m, x, idx, w, err := expertsIn(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		mm, _, err := RoutedVariant(name, m, idx)
		if err != nil {
			return engine.Tensor{}, err
		}
		out, err := mm.Combine(x, idx, w)
		if err != nil {
			return engine.Tensor{}, err
		}
		return like(c, out)
	}}
}

func sharedVariant(name, desc string, shared func(m *moe.MoE) func(out, x []float32)) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		m, x, idx, w, err := expertsIn(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		if m.Shared == nil {
			return engine.Tensor{}, fmt.Errorf("the layer has no shared expert")
		}
		if name == "shared-swiglu-clamp" && m.SwigluLimit <= 0 {
			return engine.Tensor{}, fmt.Errorf("the model has no swiglu_limit")
		}
		out, err := m.CombineWith(x, idx, w, shared(m))
		if err != nil {
			return engine.Tensor{}, err
		}
		return like(c, out)
	}}
}

// splitVariant is one part of hc_split_sinkhorn with another iteration
// count (iters + dIters), eps scaled by epsF (0: no hc_eps), or the
// sigmoid of pre/post left out; post without its factor 2 is "post-no-factor-2".
func splitVariant(side, part, name, desc string, dIters int, epsF float32, noSigmoid bool) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		b, err := blockOf(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		s := b.AttnSite
		if side == "ffn" {
			s = b.FFNSite
		}
		cfg := c.Ctx.Cfg
		hc := cfg.HCMult
		mixes, err := inF(c, "hc_"+side+"_mixes")
		if err != nil {
			return engine.Tensor{}, err
		}
		if len(mixes) != mhc.NMixes(hc) {
			return engine.Tensor{}, fmt.Errorf("hc_%s_mixes has %d values", side, len(mixes))
		}
		iters, eps := cfg.HCSinkhornIters+dIters, float32(cfg.HCEps)*epsF
		if iters < 1 {
			return engine.Tensor{}, fmt.Errorf("%d Sinkhorn iterations", iters)
		}
		pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
		mhc.SplitSinkhorn(pre, post, comb, mixes, s.Scale, s.Base, hc, iters, eps)
		switch part {
		case "pre":
			if noSigmoid {
				for j := range pre {
					pre[j] = float32(mixes[j]*s.Scale[0]) + s.Base[j] + eps
				}
			}
			return like(c, pre)
		case "post":
			for j := range post {
				if noSigmoid {
					post[j] = 2 * (float32(mixes[hc+j]*s.Scale[1]) + s.Base[hc+j])
				} else {
					post[j] /= 2
				}
			}
			return like(c, post)
		}
		return like(c, comb)
	}}
}

func postVariant(stage, name, desc string) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		cfg := c.Ctx.Cfg
		hc, dim := cfg.HCMult, cfg.Dim
		side, res, sub := "attn", "h_in", "y"
		if stage == "h_out" {
			side, res, sub = "ffn", "h_mid", "ffn_out"
		}
		a, err1 := inF(c, sub)
		h, err2 := inF(c, res)
		post, err3 := inF(c, "hc_"+side+"_post")
		comb, err4 := inF(c, "hc_"+side+"_comb")
		for _, err := range []error{err1, err2, err3, err4} {
			if err != nil {
				return engine.Tensor{}, err
			}
		}
		if len(a) != dim || len(h) != hc*dim || len(post) != hc || len(comb) != hc*hc {
			return engine.Tensor{}, fmt.Errorf("hc_post inputs of the wrong size")
		}
		p, cm := post, comb
		switch name {
		case "hc-post-comb-transposed":
			cm = mhc.Transpose(comb, hc)
		case "hc-post-no-post-weights":
			p = make([]float32, hc)
			for j := range p {
				p[j] = 1
			}
		case "hc-post-unmixed":
			cm = make([]float32, hc*hc)
			for j := 0; j < hc; j++ {
				cm[j*hc+j] = 1
			}
		}
		out := make([]float32, hc*dim)
		mhc.Post(out, a, h, p, cm)
		return like(c, out)
	}}
}

func headVariant(name, desc string) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		if c.Ctx.Head == nil || c.Ctx.Head.Head == nil {
			return engine.Tensor{}, fmt.Errorf("no head weights")
		}
		hd := c.Ctx.Head.Head
		h, err := inF(c, "h_out")
		if err != nil {
			return engine.Tensor{}, err
		}
		if len(h) != hd.Mult*hd.Dim {
			return engine.Tensor{}, fmt.Errorf("h_out has %d values", len(h))
		}
		o := hd.Forward(h)
		x := o.X
		switch name {
		case "head-no-final-norm":
			return like(c, hd.Logits(x))
		case "head-norm-no-weight":
			ones := make([]float32, hd.Dim)
			for i := range ones {
				ones[i] = 1
			}
			n := *hd
			n.Norm = ones
			return like(c, n.Forward(h).Logits)
		case "hc-head-mean":
			pre := make([]float32, hd.Mult)
			for j := range pre {
				pre[j] = 1 / float32(hd.Mult)
			}
			x = make([]float32, hd.Dim)
			mhc.Collapse(x, h, pre)
		case "hc-head-stream-0":
			x = append([]float32(nil), h[:hd.Dim]...)
		}
		return like(c, headNormLogits(hd, x))
	}}
}

// headNormLogits is the head after its collapse: RMSNorm(x) ⊙ norm, then
// the fp32 head GEMV (head.Head.Forward from x on).
func headNormLogits(hd *head.Head, x []float32) []float32 {
	n := make([]float32, hd.Dim)
	attention.RMSNorm(n, x, hd.Norm, hd.NormEps)
	return hd.Logits(n)
}
