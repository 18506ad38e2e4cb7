package engine

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// V32Stages lists a V3.2 (DSA) layer's attention stages at decode position p,
// in the order of the official MLA.forward decode branch with the
// Indexer.forward (deepseek-ai/DeepSeek-V3.2-Exp inference/model.py at
// 8631a81 "fix indexer rope", the current official code). T = p + 1 tokens, H heads,
// nope = qk_nope_head_dim, c = kv_lora_rank, v = v_head_dim:
//
//	q_a → qr → q_b → q_pe, q_absorbed              query: LoRA, q_norm, RoPE of the last 64 dims, wkv_b absorbed
//	kv_a → kv_normed → kv_fq8, k_pe → latent_cache  this token's latent row (FP8-rounded latent, bf16 k_pe)
//	iq_b → iq_roped → iq_had → iq_fp8, iq_scale     indexer query (non-interleaved RoPE of the first 64 dims, Hadamard, FP8)
//	ik_raw → ik_normed → ik_roped → ik_had → ik_fp8, ik_scale → k_cache, k_scale_cache
//	iw_raw → iw → index_weights → index_score → index_topk     fp8_index over every token, top-min(K, T)
//	o_latent → o_v → y                              sparse MLA over the selected rows, value up-projection, wo
//
// Input "x" is the bf16 attention input (attn_norm's output); "prev:<state>"
// the state before the step (latent_cache, k_cache, k_scale_cache).
func V32Stages(cfg *Config, layer int, pos int64) []StageDef {
	var defs []StageDef
	add := func(name, eq string, compute func(*StepContext, map[string]Tensor) (Tensor, error), inputs ...string) {
		defs = append(defs, StageDef{Name: name, Inputs: inputs, Equation: eq, Compute: compute})
	}
	add("q_a", "q_a = FP8Lin(wq_a, x)", v32Linear("x", func(v *V32Weights) *attention.FP8Weight { return v.WqA }), "x")
	add("qr", "qr = RMSNorm(q_a) ⊙ q_norm", v32QR, "q_a")
	add("q_b", "q_b = FP8Lin(wq_b, qr) viewed [H][nope+64]", v32QB, "qr")
	add("q_pe", "q_pe = RoPE(q_b[:, nope:], p)", v32QPe, "q_b")
	add("q_absorbed", "q_absorbed[h] = bf16(q_b[h, :nope] · wkv_b[h, :nope, :])  (bf16 wkv_b, fp32 sum)", v32QAbsorbed, "q_b")
	add("kv_a", "kv_a = FP8Lin(wkv_a, x)", v32Linear("x", func(v *V32Weights) *attention.FP8Weight { return v.WkvA }), "x")
	add("kv_normed", "kv_normed = RMSNorm(kv_a[:kv_lora_rank]) ⊙ kv_norm", v32KVNormed, "kv_a")
	add("kv_fq8", "kv_fq8 = FQ8(kv_normed, 128)  (act_quant and back: the deployed FP8 latent cache)", v32KVFQ8, "kv_normed")
	add("k_pe", "k_pe = RoPE(kv_a[kv_lora_rank:], p)", v32KPe, "kv_a")
	add("latent_cache", "latent_cache = prev:latent_cache ++ [kv_fq8 | k_pe]", v32LatentCache, PrevPrefix+"latent_cache", "kv_fq8", "k_pe")
	add("iq_b", "iq_b = FP8Lin(indexer.wq_b, qr) viewed [H_I][128]", v32IqB, "qr")
	add("iq_roped", "iq_roped = iq_b with RoPE(dims 0..63 as pairs (i, i+32), p)", v32RopedFirst("iq_b"), "iq_b")
	add("iq_had", "iq_had = Had(iq_roped) per head  (bf16, scale 128^-0.5)", v32Had("iq_roped"), "iq_roped")
	add("iq_fp8", "iq_fp8 = E4M3(iq_had / iq_scale)  (act_quant, one block per head)", v32Codes("iq_had"), "iq_had")
	add("iq_scale", "iq_scale[h] = 2^ceil(log2(max(amax(iq_had[h]), 1e-4)/448))", v32Scales("iq_had"), "iq_had")
	add("ik_raw", "ik_raw = FP8Lin(indexer.wk, x)", v32Linear("x", func(v *V32Weights) *attention.FP8Weight { return v.IWk }), "x")
	add("ik_normed", "ik_normed = bf16(LayerNorm(ik_raw) ⊙ k_norm.weight + k_norm.bias)  (fp32)", v32IkNormed, "ik_raw")
	add("ik_roped", "ik_roped = ik_normed with RoPE(dims 0..63 as pairs (i, i+32), p)", v32RopedFirst("ik_normed"), "ik_normed")
	add("ik_had", "ik_had = Had(ik_roped)", v32Had("ik_roped"), "ik_roped")
	add("ik_fp8", "ik_fp8 = E4M3(ik_had / ik_scale)", v32Codes("ik_had"), "ik_had")
	add("ik_scale", "ik_scale = 2^ceil(log2(max(amax(ik_had), 1e-4)/448))", v32Scales("ik_had"), "ik_had")
	add("k_cache", "k_cache = prev:k_cache ++ ik_fp8", v32Append("k_cache", "ik_fp8"), PrevPrefix+"k_cache", "ik_fp8")
	add("k_scale_cache", "k_scale_cache = prev:k_scale_cache ++ ik_scale", v32Append("k_scale_cache", "ik_scale"), PrevPrefix+"k_scale_cache", "ik_scale")
	add("iw_raw", "iw_raw = weights_proj · f32(x)  (fp32)", v32IwRaw, "x")
	add("iw", "iw = f32(iw_raw · f32(H_I^-0.5))", v32Iw, "iw_raw")
	add("index_weights", "index_weights[h] = f32(f32(iw[h] · iq_scale[h]) · f32(128^-0.5))", v32IndexWeights, "iw", "iq_scale")
	add("index_score", "index_score[t] = f32(Σ_h f32(ReLU(iq_fp8[h]·k_cache[t]) · index_weights[h])) · k_scale_cache[t]",
		v32IndexScore, "iq_fp8", "index_weights", "k_cache", "k_scale_cache")
	add("index_topk", "index_topk = top-min(index_topk, p+1) tokens of index_score (larger score, then lower position)", v32IndexTopK, "index_score")
	add("o_latent", "o_latent[h] = bf16(Σ_t softmax_t(bf16(τ·bf16(q_absorbed[h]·latent[t] + q_pe[h]·k_pe[t])) | index_topk) · latent[t])  (bf16 scores and P)",
		v32OLatent, "q_absorbed", "q_pe", "latent_cache", "index_topk")
	add("o_v", "o_v[h] = bf16(o_latent[h] · wkv_b[h, nope:, :]ᵀ)", v32OV, "o_latent")
	add("y", "y = FP8Lin(wo, o_v)", v32Linear("o_v", func(v *V32Weights) *attention.FP8Weight { return v.Wo }), "o_v")
	return defs
}

// v32W returns the layer's V3.2 weights or an error.
func v32W(ctx *StepContext) (*V32Weights, error) {
	if ctx.W == nil || ctx.W.V32 == nil {
		return nil, fmt.Errorf("engine: layer %d: the weights are not a V3.2 layer's", ctx.Layer)
	}
	return ctx.W.V32, nil
}

func v32Linear(from string, pick func(*V32Weights) *attention.FP8Weight) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		v, err := v32W(ctx)
		if err != nil {
			return Tensor{}, err
		}
		w := pick(v)
		x, err := inF(in, from, w.Cols)
		if err != nil {
			return Tensor{}, err
		}
		y := make([]float32, w.Rows)
		v32Lin(ctx.fast(), y, x, w)
		return bf16T(y, w.Rows), nil
	}
}

func v32QR(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, err := inF(in, "q_a", ctx.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(x))
	attention.RMSNorm(y, x, v.QNorm, float32(ctx.Cfg.NormEps))
	return bf16T(y, len(y)), nil
}

func v32QB(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, err := inF(in, "qr", ctx.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, v.WqB.Rows)
	v32Lin(ctx.fast(), y, x, v.WqB)
	return bf16T(y, ctx.Cfg.NHeads, ctx.Cfg.V32QKHeadDim()), nil
}

func v32QPe(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	cfg := ctx.Cfg
	H, d, nope := cfg.NHeads, cfg.V32QKHeadDim(), cfg.QKNopeHeadDim
	q, err := inF(in, "q_b", H*d)
	if err != nil {
		return Tensor{}, err
	}
	pe := make([]float32, H*attention.RopeDims)
	for h := 0; h < H; h++ {
		copy(pe[h*attention.RopeDims:], q[h*d+nope:(h+1)*d])
		ctx.Rope.Apply(pe[h*attention.RopeDims:(h+1)*attention.RopeDims], ctx.Pos)
	}
	return bf16T(pe, H, attention.RopeDims), nil
}

func v32QAbsorbed(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	cfg := ctx.Cfg
	H, c := cfg.NHeads, cfg.KVLoraRank
	q, err := inF(in, "q_b", H*cfg.V32QKHeadDim())
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, H*c)
	if ctx.fast() != nil {
		v32AbsorbFast(out, q, v32WkvB(v), H, cfg.QKNopeHeadDim, cfg.QKRopeHeadDim, cfg.VHeadDim, c)
	} else {
		attention.V32Absorb(out, q, v32WkvB(v), H, cfg.QKNopeHeadDim, cfg.QKRopeHeadDim, cfg.VHeadDim, c)
	}
	return bf16T(out, H, c), nil
}

// v32WkvB is weight_dequant(wkv_b): the FP8 codes times their power-of-two
// block scales, exact in bf16 (FP8Weight.W, dequantised row by row for a
// compact weight).
func v32WkvB(v *V32Weights) []float32 {
	w := v.WkvB
	if w.W != nil {
		return w.W
	}
	out := make([]float32, w.Rows*w.Cols)
	for n := 0; n < w.Rows; n++ {
		copy(out[n*w.Cols:], w.Row(n, nil))
	}
	return out
}

func v32KVNormed(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	c := ctx.Cfg.KVLoraRank
	kv, err := inF(in, "kv_a", ctx.Cfg.V32KVDim())
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c)
	attention.RMSNorm(y, kv[:c], v.KVNorm, float32(ctx.Cfg.NormEps))
	return bf16T(y, c), nil
}

func v32KVFQ8(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	kv, err := inF(in, "kv_normed", ctx.Cfg.KVLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), kv...)
	quant.FQ8(y, 128)
	return bf16T(y, len(y)), nil
}

func v32KPe(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	kv, err := inF(in, "kv_a", ctx.Cfg.V32KVDim())
	if err != nil {
		return Tensor{}, err
	}
	pe := append([]float32(nil), kv[ctx.Cfg.KVLoraRank:]...)
	ctx.Rope.Apply(pe, ctx.Pos)
	return bf16T(pe, len(pe)), nil
}

// v32Prev reads a prev: cache of p rows (the tokens before p) of cols
// columns (cols 0: a vector of p entries).
func v32Prev(ctx *StepContext, in map[string]Tensor, name string, cols int) ([]float32, error) {
	t, ok := in[PrevPrefix+name]
	if !ok {
		return nil, fmt.Errorf("missing input %s%s", PrevPrefix, name)
	}
	w := max(cols, 1)
	if !t.Kind.IsFloat() || len(t.F) != int(ctx.Pos)*w {
		return nil, fmt.Errorf("input %s%s has shape %v (%s), want %d tokens × %d before position %d", PrevPrefix, name, t.Shape, t.Kind, ctx.Pos, w, ctx.Pos)
	}
	return t.F, nil
}

func v32LatentCache(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	cfg := ctx.Cfg
	D := cfg.V32KVDim()
	prev, err := v32Prev(ctx, in, "latent_cache", D)
	if err != nil {
		return Tensor{}, err
	}
	kv, err := inF(in, "kv_fq8", cfg.KVLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	pe, err := inF(in, "k_pe", cfg.QKRopeHeadDim)
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, 0, len(prev)+D)
	out = append(append(append(out, prev...), kv...), pe...)
	return bf16T(out, int(ctx.Pos)+1, D), nil
}

func v32IqB(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, err := inF(in, "qr", ctx.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, v.IWqB.Rows)
	v32Lin(ctx.fast(), y, x, v.IWqB)
	return bf16T(y, ctx.Cfg.IndexNHeads, ctx.Cfg.IndexHeadDim), nil
}

// v32Vecs reads from, a query [H_I][128] (names iq_*) or a key [128] (ik_*).
func v32Vecs(ctx *StepContext, in map[string]Tensor, from string) ([]float32, []int, error) {
	shape := []int{ctx.Cfg.IndexHeadDim}
	if from[1] == 'q' {
		shape = []int{ctx.Cfg.IndexNHeads, ctx.Cfg.IndexHeadDim}
	}
	n := 1
	for _, s := range shape {
		n *= s
	}
	x, err := inF(in, from, n)
	if err != nil {
		return nil, nil, err
	}
	return append([]float32(nil), x...), shape, nil
}

func v32RopedFirst(from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		x, shape, err := v32Vecs(ctx, in, from)
		if err != nil {
			return Tensor{}, err
		}
		indexer.V32RopeFirst(x, ctx.Pos, ctx.Rope)
		return bf16T(x, shape...), nil
	}
}

func v32Had(from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		x, shape, err := v32Vecs(ctx, in, from)
		if err != nil {
			return Tensor{}, err
		}
		for h := 0; h < len(x); h += 128 {
			quant.Hadamard(x[h : h+128])
		}
		return bf16T(x, shape...), nil
	}
}

func v32Codes(from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		x, shape, err := v32Vecs(ctx, in, from)
		if err != nil {
			return Tensor{}, err
		}
		codes := make([]float32, len(x))
		for h := 0; h < len(x); h += 128 {
			indexer.V32Quant(codes[h:h+128], x[h:h+128])
		}
		return FromF(KindF32, codes, shape...), nil
	}
}

func v32Scales(from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		x, _, err := v32Vecs(ctx, in, from)
		if err != nil {
			return Tensor{}, err
		}
		codes := make([]float32, 128)
		s := make([]float32, len(x)/128)
		for h := range s {
			s[h] = indexer.V32Quant(codes, x[h*128:(h+1)*128])
		}
		return FromF(KindF32, s, len(s)), nil
	}
}

func v32Append(state, from string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		cols := 0
		if state == "k_cache" {
			cols = ctx.Cfg.IndexHeadDim
		}
		prev, err := v32Prev(ctx, in, state, cols)
		if err != nil {
			return Tensor{}, err
		}
		row, err := inF(in, from, max(cols, 1))
		if err != nil {
			return Tensor{}, err
		}
		out := append(append(make([]float32, 0, len(prev)+len(row)), prev...), row...)
		if cols == 0 {
			return FromF(KindF32, out, len(out)), nil
		}
		return FromF(KindF32, out, int(ctx.Pos)+1, cols), nil
	}
}

func v32IkNormed(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, _, err := v32Vecs(ctx, in, "ik_raw")
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(x))
	indexer.V32LayerNorm(y, x, v.IKNormW, v.IKNormB, float32(ctx.Cfg.NormEps))
	return bf16T(y, len(y)), nil
}

func v32IwRaw(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	x, err := inF(in, "x", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, ctx.Cfg.IndexNHeads)
	v32F32Lin(ctx.fast(), y, x, v.IWeightsProj, len(y), ctx.Cfg.Dim)
	return FromF(KindF32, y, len(y)), nil
}

func v32Iw(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "iw_raw", ctx.Cfg.IndexNHeads)
	if err != nil {
		return Tensor{}, err
	}
	s := ctx.Cfg.V32IndexHeadScale()
	y := make([]float32, len(x))
	for h, w := range x {
		y[h] = w * s
	}
	return FromF(KindF32, y, len(y)), nil
}

func v32IndexWeights(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	HI := ctx.Cfg.IndexNHeads
	iw, err := inF(in, "iw", HI)
	if err != nil {
		return Tensor{}, err
	}
	qs, err := inF(in, "iq_scale", HI)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, HI)
	indexer.V32IndexWeights(y, iw, qs, ctx.Cfg.V32IndexSoftmaxScale())
	return FromF(KindF32, y, HI), nil
}

func v32IndexScore(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	cfg := ctx.Cfg
	T := int(ctx.Pos) + 1
	q, err := inF(in, "iq_fp8", cfg.IndexNHeads*cfg.IndexHeadDim)
	if err != nil {
		return Tensor{}, err
	}
	w, err := inF(in, "index_weights", cfg.IndexNHeads)
	if err != nil {
		return Tensor{}, err
	}
	k, err := inF(in, "k_cache", T*cfg.IndexHeadDim)
	if err != nil {
		return Tensor{}, err
	}
	ks, err := inF(in, "k_scale_cache", T)
	if err != nil {
		return Tensor{}, err
	}
	score := make([]float32, T)
	if err := indexer.V32Score(score, q, w, k, ks); err != nil {
		return Tensor{}, err
	}
	return FromF(KindF32, score, T), nil
}

func v32IndexTopK(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	T := int(ctx.Pos) + 1
	s, err := inF(in, "index_score", T)
	if err != nil {
		return Tensor{}, err
	}
	k := min(ctx.Cfg.IndexTopK, T)
	idx, _ := indexer.TopK(s, k)
	return FromI(KindI64, idx, len(idx)), nil
}

func v32OLatent(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	cfg := ctx.Cfg
	H, c, r := cfg.NHeads, cfg.KVLoraRank, cfg.QKRopeHeadDim
	T := int(ctx.Pos) + 1
	qa, err := inF(in, "q_absorbed", H*c)
	if err != nil {
		return Tensor{}, err
	}
	qp, err := inF(in, "q_pe", H*r)
	if err != nil {
		return Tensor{}, err
	}
	kv, err := inF(in, "latent_cache", T*(c+r))
	if err != nil {
		return Tensor{}, err
	}
	sel, err := inI(in, "index_topk")
	if err != nil {
		return Tensor{}, err
	}
	o := make([]float32, H*c)
	if err := attention.V32SparseMLA(o, qa, qp, kv, H, c, r, T, sel, cfg.V32SoftmaxScale()); err != nil {
		return Tensor{}, err
	}
	return bf16T(o, H, c), nil
}

func v32OV(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	v, err := v32W(ctx)
	if err != nil {
		return Tensor{}, err
	}
	cfg := ctx.Cfg
	H, c := cfg.NHeads, cfg.KVLoraRank
	o, err := inF(in, "o_latent", H*c)
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, H*cfg.VHeadDim)
	if ctx.fast() != nil {
		v32ValueUpFast(out, o, v32WkvB(v), H, cfg.QKNopeHeadDim, cfg.VHeadDim, c)
	} else {
		attention.V32ValueUp(out, o, v32WkvB(v), H, cfg.QKNopeHeadDim, cfg.VHeadDim, c)
	}
	return bf16T(out, H, cfg.VHeadDim), nil
}
