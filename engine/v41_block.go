package engine

import (
	"fmt"
	"math/rand/v2"

	"sparsemla/attention"
	"sparsemla/mhc"
	"sparsemla/quant"
)

// V41BlockWeights are the hyper-connection and norm weights of one V4.1
// block (Block.__init__ of V41-M): the attention and FFN sites hc_attn_* /
// hc_ffn_* (fn [(2+hc)·hc][hc·dim], base [(2+hc)·hc], scale [3], fp32) and
// attn_norm / ffn_norm [dim] (bf16 values). The shapes are V4's; what
// differs is which pre-mix collapses which sub-layer (V41BlockStages).
type V41BlockWeights struct {
	AttnSite, FFNSite *mhc.Site
	AttnNorm, FFNNorm []float32
}

// V41HeadWeights are the weights after the last block: norm [dim] (bf16
// values) and head [vocab][dim] (bf16 in the checkpoint, held as fp32 by
// ParallelHead). V4.1 has no hc_head_fn / hc_head_base / hc_head_scale: the
// streams are collapsed with the last FFN's pre-mix.
type V41HeadWeights struct {
	Norm  []float32
	Head  []float32
	Vocab int
	// Embed is embed.weight [vocab][dim] (bf16 values): the whole step's
	// h_in of layer 0. nil in a head-only use (V41Head).
	Embed []float32
}

// V41BlockStageDef is one stage of the V4.1 hyper-connections around a
// sub-layer: its name (the dump's L<l>.<name>), the stages and external
// values it reads, the equation, and the reference computation.
type V41BlockStageDef struct {
	Name     string
	Inputs   []string
	Equation string
	Compute  func(cfg *Config, w *V41BlockWeights, in map[string]Tensor) (Tensor, error)
}

// V41IdentityPreMix is make_identity_pre_mix: the pre-mix layer 0's
// attention collapses its streams with, one-hot on copy 0, [hc] fp32.
func V41IdentityPreMix(hc int) []float32 {
	p := make([]float32, hc)
	p[0] = 1
	return p
}

// V41BlockStages lists the stages of one V4.1 block around its two
// sub-layers, in Block.forward's order (V41-M). The mHC is pipelined: each
// site's hc_mixes is computed from the site's own input streams, but the
// collapse in front of a sub-layer uses the pre-mix the PREVIOUS site
// produced — the attention takes pre_mix_in (the previous block's hc_ffn_pre,
// one-hot [1,0,…] at layer 0), the FFN takes hc_attn_pre, and the block hands
// hc_ffn_pre to the next block (pre_mix_out). Both sites' hc_mixes use
// norm_eps (1e-20 in V4.1) in the rsqrt and hc_eps in the Sinkhorn split.
//
//	hc_attn_mixes = (hc_attn_fn · hf) · rsqrt(mean(hf²) + norm_eps)   hf = f32(flatten(h_in))  [(2+hc)·hc] fp32
//	hc_attn_pre/post/comb = hc_split_sinkhorn(hc_attn_mixes)          [hc], [hc], [hc][hc] fp32
//	attn_norm_in  = bf16(Σ_j pre_mix_in[j] · h_in[j])                 [dim] bf16   (rounding: hc_pre's .to(bf16))
//	x             = bf16(attn_norm ⊙ f32(attn_norm_in)·rsqrt(mean(·²) + norm_eps))   [dim] bf16
//	… attention sub-layer (V41Stages): x → y …
//	h_mid[k]      = bf16(post_k · y + Σ_j comb[j][k] · h_in[j])       [hc][dim] bf16  (hc_post's type_as)
//	hc_ffn_mixes / pre / post / comb   the same on h_mid with hc_ffn_*
//	ffn_norm_in   = bf16(Σ_j hc_attn_pre[j] · h_mid[j])               [dim] bf16
//	ffn_in        = RMSNorm(ffn_norm_in) ⊙ ffn_norm                   [dim] bf16
//	… MoE: ffn_in → ffn_out …
//	h_out[k]      = bf16(ffn_post_k · ffn_out + Σ_j ffn_comb[j][k] · h_mid[j])   [hc][dim] bf16
//	pre_mix_out   = hc_ffn_pre                                          [hc] fp32
//
// The first list holds the stages before the attention (up to x), the
// second those between y and ffn_in, the third those after ffn_out.
// "pre_mix_in", "h_in", "y" and "ffn_out" are inputs from outside.
func V41BlockStages(cfg *Config) (attnSide, mid, ffnSide []V41BlockStageDef) {
	type list = []V41BlockStageDef
	site := func(side, in string) list {
		s := "hc_" + side + "_"
		return list{
			{s + "mixes", []string{in}, s + "mixes = (hc_" + side + "_fn · f32(flatten(" + in + "))) · rsqrt(mean(" + in + "²) + norm_eps)  (norm_eps = " + fmt.Sprint(cfg.NormEps) + ")", v41HCMixes(side, in)},
			{s + "pre", []string{s + "mixes"}, s + "pre = sigmoid(mixes[:hc]·scale[0] + base[:hc]) + hc_eps", v41HCSplit(side, "pre")},
			{s + "post", []string{s + "mixes"}, s + "post = 2·sigmoid(mixes[hc:2hc]·scale[1] + base[hc:2hc])", v41HCSplit(side, "post")},
			{s + "comb", []string{s + "mixes"}, s + "comb = Sinkhorn(softmax-rows(mixes[2hc:]·scale[2] + base[2hc:]), hc_sinkhorn_iters, hc_eps)", v41HCSplit(side, "comb")},
		}
	}
	attnSide = append(site("attn", "h_in"),
		V41BlockStageDef{"attn_norm_in", []string{"h_in", "pre_mix_in"}, "attn_norm_in = bf16(Σ_j pre_mix_in[j] · h_in[j])  (pre_mix_in: the previous block's hc_ffn_pre; one-hot [1,0,…] at layer 0)", v41Collapse("h_in", "pre_mix_in")},
		V41BlockStageDef{"x", []string{"attn_norm_in"}, "x = RMSNorm(attn_norm_in) ⊙ attn_norm", v41Norm("attn_norm_in", false)})
	mid = list{{"h_mid", []string{"y", "h_in", "hc_attn_post", "hc_attn_comb"}, "h_mid[k] = bf16(hc_attn_post[k] · y + Σ_j hc_attn_comb[j][k] · h_in[j])", v41Post("attn", "h_in", "y")}}
	mid = append(mid, site("ffn", "h_mid")...)
	mid = append(mid,
		V41BlockStageDef{"ffn_norm_in", []string{"h_mid", "hc_attn_pre"}, "ffn_norm_in = bf16(Σ_j hc_attn_pre[j] · h_mid[j])  (pipelined: the attention site's pre-mix, not hc_ffn_pre)", v41Collapse("h_mid", "hc_attn_pre")},
		V41BlockStageDef{"ffn_in", []string{"ffn_norm_in"}, "ffn_in = RMSNorm(ffn_norm_in) ⊙ ffn_norm", v41Norm("ffn_norm_in", true)})
	ffnSide = list{
		{"h_out", []string{"ffn_out", "h_mid", "hc_ffn_post", "hc_ffn_comb"}, "h_out[k] = bf16(hc_ffn_post[k] · ffn_out + Σ_j hc_ffn_comb[j][k] · h_mid[j])", v41Post("ffn", "h_mid", "ffn_out")},
		{"pre_mix_out", []string{"hc_ffn_pre"}, "pre_mix_out = hc_ffn_pre  (the next block's pre_mix_in; after the last block it collapses the streams for the head)", v41Copy("hc_ffn_pre")},
	}
	return attnSide, mid, ffnSide
}

// V41HeadStages lists the stages after the last block (Transformer.forward
// of V41-M): the last block's hc_pre with its pre_mix_out, the final norm
// and the fp32 head. No hc_head_fn (V4's ParallelHead.hc_head) exists.
//
//	head_in = bf16(Σ_j pre_mix_out[j] · h_out[j])      [dim] bf16
//	head_x  = RMSNorm(head_in) ⊙ norm                 [dim] bf16
//	logits  = head · f32(head_x)                      [vocab] fp32 (F.linear on fp32)
func V41HeadStages() []V41HeadStageDef {
	return []V41HeadStageDef{
		{"head_in", []string{"h_out", "pre_mix_out"}, "head_in = bf16(Σ_j pre_mix_out[j] · h_out[j])  (the last block's hc_pre with the last hc_ffn_pre; no hc_head_fn in V4.1)", v41HeadIn},
		{"head_x", []string{"head_in"}, "head_x = RMSNorm(head_in) ⊙ norm", v41HeadX},
		{"logits", []string{"head_x"}, "logits = head · f32(head_x)  (fp32 weights and sums, j ascending)", v41Logits},
	}
}

// V41HeadStageDef is one stage after the last block.
type V41HeadStageDef struct {
	Name     string
	Inputs   []string
	Equation string
	Compute  func(cfg *Config, w *V41HeadWeights, in map[string]Tensor) (Tensor, error)
}

func v41BlockCheck(w *V41BlockWeights) error {
	if w == nil || w.AttnSite == nil || w.FFNSite == nil {
		return fmt.Errorf("no V4.1 block weights (hc_attn_*, hc_ffn_*)")
	}
	return nil
}

func v41SiteOf(w *V41BlockWeights, side string) *mhc.Site {
	if side == "attn" {
		return w.AttnSite
	}
	return w.FFNSite
}

func v41HCMixes(side, from string) func(*Config, *V41BlockWeights, map[string]Tensor) (Tensor, error) {
	return func(cfg *Config, w *V41BlockWeights, in map[string]Tensor) (Tensor, error) {
		if err := v41BlockCheck(w); err != nil {
			return Tensor{}, err
		}
		h, err := inF(in, from, cfg.HCMult*cfg.Dim)
		if err != nil {
			return Tensor{}, err
		}
		mixes := make([]float32, mhc.NMixes(cfg.HCMult))
		v41SiteOf(w, side).Mixes(mixes, h, float32(cfg.NormEps))
		return FromF(KindF32, mixes, len(mixes)), nil
	}
}

func v41HCSplit(side, part string) func(*Config, *V41BlockWeights, map[string]Tensor) (Tensor, error) {
	return func(cfg *Config, w *V41BlockWeights, in map[string]Tensor) (Tensor, error) {
		if err := v41BlockCheck(w); err != nil {
			return Tensor{}, err
		}
		hc := cfg.HCMult
		mixes, err := inF(in, "hc_"+side+"_mixes", mhc.NMixes(hc))
		if err != nil {
			return Tensor{}, err
		}
		s := v41SiteOf(w, side)
		pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
		mhc.SplitSinkhorn(pre, post, comb, mixes, s.Scale, s.Base, hc, cfg.HCSinkhornIters, float32(cfg.HCEps))
		switch part {
		case "pre":
			return FromF(KindF32, pre, hc), nil
		case "post":
			return FromF(KindF32, post, hc), nil
		}
		return FromF(KindF32, comb, hc, hc), nil
	}
}

// v41Collapse is hc_pre: bf16(Σ_j f32(mix[j]·h[j])), j ascending (mhc.Collapse).
func v41Collapse(from, mix string) func(*Config, *V41BlockWeights, map[string]Tensor) (Tensor, error) {
	return func(cfg *Config, _ *V41BlockWeights, in map[string]Tensor) (Tensor, error) {
		hc, dim := cfg.HCMult, cfg.Dim
		h, err := inF(in, from, hc*dim)
		if err != nil {
			return Tensor{}, err
		}
		pre, err := inF(in, mix, hc)
		if err != nil {
			return Tensor{}, err
		}
		x := make([]float32, dim)
		mhc.Collapse(x, h, pre)
		return bf16T(x, dim), nil
	}
}

func v41Norm(from string, ffn bool) func(*Config, *V41BlockWeights, map[string]Tensor) (Tensor, error) {
	return func(cfg *Config, w *V41BlockWeights, in map[string]Tensor) (Tensor, error) {
		if w == nil {
			return Tensor{}, fmt.Errorf("no V4.1 block weights (attn_norm, ffn_norm)")
		}
		nw := w.AttnNorm
		if ffn {
			nw = w.FFNNorm
		}
		if len(nw) != cfg.Dim {
			return Tensor{}, fmt.Errorf("norm weight has %d values, want dim %d", len(nw), cfg.Dim)
		}
		v, err := inF(in, from, cfg.Dim)
		if err != nil {
			return Tensor{}, err
		}
		y := make([]float32, cfg.Dim)
		attention.RMSNorm(y, v, nw, float32(cfg.NormEps))
		return bf16T(y, cfg.Dim), nil
	}
}

func v41Post(side, residual, sub string) func(*Config, *V41BlockWeights, map[string]Tensor) (Tensor, error) {
	return func(cfg *Config, _ *V41BlockWeights, in map[string]Tensor) (Tensor, error) {
		return hcPost(cfg, side, residual, sub, in)
	}
}

func v41Copy(from string) func(*Config, *V41BlockWeights, map[string]Tensor) (Tensor, error) {
	return func(cfg *Config, _ *V41BlockWeights, in map[string]Tensor) (Tensor, error) {
		v, err := inF(in, from, cfg.HCMult)
		if err != nil {
			return Tensor{}, err
		}
		return FromF(KindF32, append([]float32(nil), v...), cfg.HCMult), nil
	}
}

func v41HeadIn(cfg *Config, _ *V41HeadWeights, in map[string]Tensor) (Tensor, error) {
	return v41Collapse("h_out", "pre_mix_out")(cfg, nil, in)
}

func v41HeadX(cfg *Config, w *V41HeadWeights, in map[string]Tensor) (Tensor, error) {
	if w == nil || len(w.Norm) != cfg.Dim {
		return Tensor{}, fmt.Errorf("no V4.1 final norm weight of dim %d", cfg.Dim)
	}
	v, err := inF(in, "head_in", cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, cfg.Dim)
	attention.RMSNorm(y, v, w.Norm, float32(cfg.NormEps))
	return bf16T(y, cfg.Dim), nil
}

func v41Logits(cfg *Config, w *V41HeadWeights, in map[string]Tensor) (Tensor, error) {
	if w == nil || w.Vocab <= 0 || len(w.Head) != w.Vocab*cfg.Dim {
		return Tensor{}, fmt.Errorf("no V4.1 head weight [vocab][%d]", cfg.Dim)
	}
	x, err := inF(in, "head_x", cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	out := make([]float32, w.Vocab)
	for v := range out {
		row := w.Head[v*cfg.Dim : (v+1)*cfg.Dim]
		var s float32
		for j, xv := range x {
			s += float32(row[j] * xv)
		}
		out[v] = s
	}
	return FromF(KindF32, out, w.Vocab), nil
}

// V41SubLayer is a sub-layer between two hc sites: x [dim] bf16 in, [dim]
// bf16 out (the attention sub-layer, or the MoE).
type V41SubLayer func(x Tensor) (Tensor, error)

// V41Block runs one V4.1 block's stages (V41BlockStages) on the streams
// h_in [hc][dim] (bf16) with the incoming pre-mix [hc] (fp32), calling attn
// on x and ffn on ffn_in. It returns every stage by name (with "y" and
// "ffn_out" from the sub-layers); pre_mix_out is the next block's pre-mix.
func V41Block(cfg *Config, w *V41BlockWeights, hIn Tensor, preMixIn []float32, attn, ffn V41SubLayer) (map[string]Tensor, error) {
	if len(preMixIn) != cfg.HCMult {
		return nil, fmt.Errorf("pre_mix_in has %d values, want hc_mult %d", len(preMixIn), cfg.HCMult)
	}
	out := map[string]Tensor{"h_in": hIn, "pre_mix_in": FromF(KindF32, append([]float32(nil), preMixIn...), cfg.HCMult)}
	run := func(defs []V41BlockStageDef) error {
		for _, d := range defs {
			t, err := d.Compute(cfg, w, out)
			if err != nil {
				return fmt.Errorf("stage %s: %w", d.Name, err)
			}
			out[d.Name] = t
		}
		return nil
	}
	a, m, f := V41BlockStages(cfg)
	if err := run(a); err != nil {
		return nil, err
	}
	y, err := attn(out["x"])
	if err != nil {
		return nil, fmt.Errorf("attention: %w", err)
	}
	out["y"] = y
	if err := run(m); err != nil {
		return nil, err
	}
	fo, err := ffn(out["ffn_in"])
	if err != nil {
		return nil, fmt.Errorf("ffn: %w", err)
	}
	out["ffn_out"] = fo
	if err := run(f); err != nil {
		return nil, err
	}
	return out, nil
}

// V41Head runs V41HeadStages on the last block's h_out and pre_mix_out.
func V41Head(cfg *Config, w *V41HeadWeights, hOut Tensor, preMixOut []float32) (map[string]Tensor, error) {
	out := map[string]Tensor{"h_out": hOut, "pre_mix_out": FromF(KindF32, append([]float32(nil), preMixOut...), len(preMixOut))}
	for _, d := range V41HeadStages() {
		t, err := d.Compute(cfg, w, out)
		if err != nil {
			return nil, fmt.Errorf("stage %s: %w", d.Name, err)
		}
		out[d.Name] = t
	}
	return out, nil
}

// RandomV41BlockWeights draws one block's hc and norm weights from seed, for
// tests: fn ~ N(0, 1)/(hc·dim), base ~ N(0, 0.1²), scale ~ 0.5 + N(0, 0.1²),
// norms bf16(1 + N(0, 0.1²)) (not a checkpoint's magnitudes).
func RandomV41BlockWeights(cfg *Config, l int, seed uint64) *V41BlockWeights {
	r := rand.New(rand.NewPCG(seed^0x41b10c, uint64(l)<<32|0xb10c))
	hc, dim := cfg.HCMult, cfg.Dim
	mk := func() *mhc.Site {
		m := mhc.NMixes(hc)
		s := &mhc.Site{Mult: hc, Dim: dim, Fn: make([]float32, m*hc*dim), Base: make([]float32, m), Scale: make([]float32, 3)}
		for i := range s.Fn {
			s.Fn[i] = float32(r.NormFloat64() / float64(hc*dim))
		}
		for i := range s.Base {
			s.Base[i] = float32(0.1 * r.NormFloat64())
		}
		for i := range s.Scale {
			s.Scale[i] = float32(0.5 + 0.1*r.NormFloat64())
		}
		return s
	}
	norm := func() []float32 {
		v := make([]float32, dim)
		for i := range v {
			v[i] = quant.BF16Round(float32(1 + 0.1*r.NormFloat64()))
		}
		return v
	}
	return &V41BlockWeights{AttnSite: mk(), FFNSite: mk(), AttnNorm: norm(), FFNNorm: norm()}
}
