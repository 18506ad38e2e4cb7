package engine

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/head"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// GlobalPrefix marks a stage input that belongs to no layer: the step's
// dumped global value ("global:tok", the token id fed at the step).
const GlobalPrefix = "global:"

// BlockStages lists one layer's whole decode step in replay order: the
// attention-side hc_pre (with the embedding on layer 0), the attention
// sub-layer (Stages), the attention hc_post, the FFN-side hc_pre, the MoE and
// the FFN hc_post, and on the last layer the head (logits, a global stage).
// Without block weights (w.Block nil: a checkpoint or synthetic model of the
// attention path only) it is Stages.
//
//	h_in            = Expand(embed[tok])                           layer 0 only
//	hc_attn_mixes   = (hc_attn_fn · hf) · rsqrt(mean(hf²) + eps)    hf = f32(flatten(h_in))
//	hc_attn_pre/post/comb = hc_split_sinkhorn(hc_attn_mixes)
//	attn_norm_in    = bf16(Σ_j pre_j · h_in[j])
//	x               = RMSNorm(attn_norm_in) ⊙ attn_norm
//	… attention (Stages) … y
//	h_mid[j]        = bf16(post_j · y + Σ_k comb[k][j] · h_in[k])
//	hc_ffn_*, ffn_norm_in, ffn_in   the same with hc_ffn_*, ffn_norm
//	moe_indices     = topk(score(W_g·ffn_in) + bias) | tid2eid[tok]
//	moe_weights     = score[indices] / Σ · route_scale
//	ffn_out         = bf16(Σ_{e ascending} Expert_e(ffn_in, w_e) + Shared(ffn_in))
//	h_out[j]        = bf16(post_j · ffn_out + Σ_k comb[k][j] · h_mid[k])
//	logits          = head · RMSNorm(hc_head(h_out)) ⊙ norm       last layer, fp32
func BlockStages(cfg *Config, layer int, pos int64, w *LayerWeights, hw *HeadWeights) []StageDef {
	if cfg.V32() {
		return V32BlockStages(cfg, layer, pos, w)
	}
	attn := Stages(cfg, layer, pos)
	if w == nil || w.Block == nil {
		return attn
	}
	var defs []StageDef
	add := func(name, eq string, compute func(*StepContext, map[string]Tensor) (Tensor, error), inputs ...string) {
		defs = append(defs, StageDef{Name: name, Inputs: inputs, Equation: eq, Compute: compute})
	}
	if layer == 0 && hw != nil && hw.Embed != nil {
		add("h_in", "h_in = (e, …, e), e = embed.weight[tok]  (hc_mult copies)", stageHIn, GlobalPrefix+"tok")
	}
	addSite := func(side, in, normIn, normOut, sub, out string) (pre, post []StageDef) {
		n := len(defs)
		s := "hc_" + side + "_"
		add(s+"mixes", s+"mixes = (hc_"+side+"_fn · f32(flatten("+in+"))) · rsqrt(mean("+in+"²) + norm_eps)", hcMixesStage(side, in), in)
		add(s+"pre", s+"pre = sigmoid(mixes[:hc]·scale[0] + base[:hc]) + hc_eps", hcSplitStage(side, "pre"), s+"mixes")
		add(s+"post", s+"post = 2·sigmoid(mixes[hc:2hc]·scale[1] + base[hc:2hc])", hcSplitStage(side, "post"), s+"mixes")
		add(s+"comb", s+"comb = Sinkhorn(exp-rows(mixes[2hc:]·scale[2] + base[2hc:]), hc_sinkhorn_iters, hc_eps)", hcSplitStage(side, "comb"), s+"mixes")
		add(normIn, normIn+" = bf16(Σ_j "+s+"pre[j] · "+in+"[j])", hcCollapseStage(side, in), in, s+"pre")
		add(normOut, normOut+" = RMSNorm("+normIn+") ⊙ "+side+"_norm", hcNormStage(side, normIn), normIn)
		pre = append([]StageDef(nil), defs[n:]...)
		defs = defs[:n]
		add(out, out+"[j] = bf16("+s+"post[j] · "+sub+" + Σ_k "+s+"comb[k][j] · "+in+"[k])", hcPostStage(side, in, sub), sub, in, s+"post", s+"comb")
		post = append([]StageDef(nil), defs[n:]...)
		defs = defs[:n]
		return pre, post
	}
	attnPre, attnPost := addSite("attn", "h_in", "attn_norm_in", "x", "y", "h_mid")
	ffnPre, ffnPost := addSite("ffn", "h_mid", "ffn_norm_in", "ffn_in", "ffn_out", "h_out")
	defs = append(defs, attnPre...)
	defs = append(defs, attn...)
	defs = append(defs, attnPost...)
	defs = append(defs, ffnPre...)
	idxIn := []string{"ffn_in"}
	idxEq := "moe_indices = topk(score(W_g · f32(ffn_in)) + bias, k)  (descending; lower id first among ties)"
	if cfg.HashLayer(layer) {
		idxIn = append(idxIn, GlobalPrefix+"tok")
		idxEq = "moe_indices = tid2eid[tok]  (hash layer)"
	}
	add("moe_indices", idxEq, stageMoEIndices, idxIn...)
	add("moe_weights", "moe_weights = score[moe_indices] / Σ score[moe_indices] · route_scale  (score = "+cfg.ScoreFunc+"(W_g · f32(ffn_in)))", stageMoEWeights, "ffn_in", "moe_indices")
	add("ffn_out", "ffn_out = bf16(Σ_{e in moe_indices, ascending} Expert_e(ffn_in, w_e) + Shared(ffn_in))", stageFFNOut, "ffn_in", "moe_indices", "moe_weights")
	defs = append(defs, ffnPost...)
	if layer == cfg.NLayers-1 && hw != nil && hw.Head != nil {
		defs = append(defs, StageDef{Name: "logits", Inputs: []string{"h_out"}, Global: true,
			Equation: "logits = head · f32(RMSNorm(hc_head(h_out)) ⊙ norm)  (fp32; hc_head = bf16(Σ_j (sigmoid(mixes_j·s + b_j) + eps) · h_out[j]))",
			Compute:  stageLogits})
	}
	return defs
}

func blockOf(ctx *StepContext) (*BlockWeights, error) {
	if ctx.W == nil || ctx.W.Block == nil {
		return nil, fmt.Errorf("layer %d has no block weights (hc_*, norms, MoE)", ctx.Layer)
	}
	return ctx.W.Block, nil
}

func site(b *BlockWeights, side string) *mhc.Site {
	if side == "attn" {
		return b.AttnSite
	}
	return b.FFNSite
}

// inTok returns the step's token id (input global:tok).
func inTok(in map[string]Tensor) (int64, error) {
	t, err := inI(in, GlobalPrefix+"tok")
	if err != nil {
		return 0, err
	}
	if len(t) != 1 {
		return 0, fmt.Errorf("input tok has %d values, want 1", len(t))
	}
	return t[0], nil
}

func stageHIn(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	if ctx.Head == nil || ctx.Head.Embed == nil {
		return Tensor{}, fmt.Errorf("no embedding weights (embed.weight)")
	}
	tok, err := inTok(in)
	if err != nil {
		return Tensor{}, err
	}
	e := make([]float32, ctx.Cfg.Dim)
	if err := ctx.Head.Embed.Row(e, tok); err != nil {
		return Tensor{}, err
	}
	h := make([]float32, ctx.Cfg.HCMult*ctx.Cfg.Dim)
	mhc.Expand(h, e, ctx.Cfg.HCMult)
	return bf16T(h, ctx.Cfg.HCMult, ctx.Cfg.Dim), nil
}

func hcMixesStage(side, from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		b, err := blockOf(ctx)
		if err != nil {
			return Tensor{}, err
		}
		hc, dim := ctx.Cfg.HCMult, ctx.Cfg.Dim
		h, err := inF(in, from, hc*dim)
		if err != nil {
			return Tensor{}, err
		}
		mixes := make([]float32, mhc.NMixes(hc))
		site(b, side).Mixes(mixes, h, float32(ctx.Cfg.NormEps))
		return FromF(KindF32, mixes, len(mixes)), nil
	}
}

func hcSplitStage(side, part string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		b, err := blockOf(ctx)
		if err != nil {
			return Tensor{}, err
		}
		hc := ctx.Cfg.HCMult
		mixes, err := inF(in, "hc_"+side+"_mixes", mhc.NMixes(hc))
		if err != nil {
			return Tensor{}, err
		}
		s := site(b, side)
		pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
		mhc.SplitSinkhorn(pre, post, comb, mixes, s.Scale, s.Base, hc, ctx.Cfg.HCSinkhornIters, float32(ctx.Cfg.HCEps))
		switch part {
		case "pre":
			return FromF(KindF32, pre, hc), nil
		case "post":
			return FromF(KindF32, post, hc), nil
		}
		return FromF(KindF32, comb, hc, hc), nil
	}
}

func hcCollapseStage(side, from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		hc, dim := ctx.Cfg.HCMult, ctx.Cfg.Dim
		h, err := inF(in, from, hc*dim)
		if err != nil {
			return Tensor{}, err
		}
		pre, err := inF(in, "hc_"+side+"_pre", hc)
		if err != nil {
			return Tensor{}, err
		}
		x := make([]float32, dim)
		mhc.Collapse(x, h, pre)
		return bf16T(x, dim), nil
	}
}

func hcNormStage(side, from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		b, err := blockOf(ctx)
		if err != nil {
			return Tensor{}, err
		}
		v, err := inF(in, from, ctx.Cfg.Dim)
		if err != nil {
			return Tensor{}, err
		}
		w := b.AttnNorm
		if side == "ffn" {
			w = b.FFNNorm
		}
		y := make([]float32, len(v))
		attention.RMSNorm(y, v, w, float32(ctx.Cfg.NormEps))
		return bf16T(y, len(y)), nil
	}
}

func hcPostStage(side, residual, sub string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		return hcPost(ctx.Cfg, side, residual, sub, in)
	}
}

// hcPost is the hc_post of one side: the sub-layer output sub [dim] mixed
// back into the residual streams [hc, dim] with hc_<side>_post and
// hc_<side>_comb (mhc.Post), rounded to bf16. V4's and V4.1's stages share it.
func hcPost(cfg *Config, side, residual, sub string, in map[string]Tensor) (Tensor, error) {
	hc, dim := cfg.HCMult, cfg.Dim
	a, err := inF(in, sub, dim)
	if err != nil {
		return Tensor{}, err
	}
	h, err := inF(in, residual, hc*dim)
	if err != nil {
		return Tensor{}, err
	}
	post, err := inF(in, "hc_"+side+"_post", hc)
	if err != nil {
		return Tensor{}, err
	}
	comb, err := inF(in, "hc_"+side+"_comb", hc*hc)
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, hc*dim)
	mhc.Post(out, a, h, post, comb)
	return bf16T(out, hc, dim), nil
}

func stageMoEIndices(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	b, err := blockOf(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, err := inF(in, "ffn_in", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	var tok int64
	kind := KindI64
	if b.MoE.Gate.Hash() {
		if tok, err = inTok(in); err != nil {
			return Tensor{}, err
		}
		kind = KindI32 // tid2eid is int32
	}
	r, err := b.MoE.Gate.Route(x, tok)
	if err != nil {
		return Tensor{}, err
	}
	idx := make([]int64, len(r.Indices))
	for i, e := range r.Indices {
		idx[i] = int64(e)
	}
	return FromI(kind, idx, len(idx)), nil
}

// routeIndices returns the input moe_indices as expert ids, checked against
// the layer's expert count (they may come from a dump).
func routeIndices(in map[string]Tensor, g *moe.Gate) ([]int32, error) {
	v, err := inI(in, "moe_indices")
	if err != nil {
		return nil, err
	}
	if len(v) != g.TopK {
		return nil, fmt.Errorf("input moe_indices has %d entries, want n_activated_experts = %d", len(v), g.TopK)
	}
	idx := make([]int32, len(v))
	for i, e := range v {
		if e < 0 || e >= int64(g.Experts) {
			return nil, fmt.Errorf("input moe_indices[%d] = %d is not an expert id (0 … %d)", i, e, g.Experts-1)
		}
		idx[i] = int32(e)
	}
	return idx, nil
}

func stageMoEWeights(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	b, err := blockOf(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, err := inF(in, "ffn_in", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	g := &b.MoE.Gate
	idx, err := routeIndices(in, g)
	if err != nil {
		return Tensor{}, err
	}
	s := make([]float32, g.Experts)
	g.Scores(s, x)
	w := moe.RouteWeights(s, idx, g.Func, g.RouteScale)
	return FromF(KindF32, w, len(w)), nil
}

func stageFFNOut(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	b, err := blockOf(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, err := inF(in, "ffn_in", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	idx, err := routeIndices(in, &b.MoE.Gate)
	if err != nil {
		return Tensor{}, err
	}
	w, err := inF(in, "moe_weights", len(idx))
	if err != nil {
		return Tensor{}, err
	}
	m := *b.MoE
	m.Fast = ctx.W.Fast != nil
	out, err := m.Combine(x, idx, w)
	if err != nil {
		return Tensor{}, err
	}
	return bf16T(out, len(out)), nil
}

func stageLogits(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	if ctx.Head == nil || ctx.Head.Head == nil {
		return Tensor{}, fmt.Errorf("no head weights (hc_head_*, norm, head)")
	}
	h, err := inF(in, "h_out", ctx.Cfg.HCMult*ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	o := ctx.Head.Head.Forward(h)
	return FromF(KindF32, o.Logits, len(o.Logits)), nil
}

// WholeStageNames lists the stage names of a whole layer in replay order
// (BlockStages with every weight present: h_in on layer 0, logits on the last
// layer), for tools that compare two dumps stage by stage without a model.
func WholeStageNames(cfg *Config, layer int, pos int64) []string {
	w := &LayerWeights{Block: &BlockWeights{}}
	hw := &HeadWeights{Embed: RandomEmbedding(cfg, 0), Head: &head.Head{}}
	var names []string
	for _, d := range BlockStages(cfg, layer, pos, w, hw) {
		names = append(names, d.Name)
	}
	return names
}
