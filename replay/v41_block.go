package replay

import (
	"fmt"
	"slices"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// The whole V4.1 step in a dump: when weights.safetensors holds the block
// weights under the official names (Block.__init__, MoE, Transformer of
// V41-M), the replay runs engine.V41WholeStep and compares the block stages
// too. Names, per layer L:
//
//	layers.L.hc_attn_fn [(2+hc)·hc, hc·dim] F32, hc_attn_base [(2+hc)·hc], hc_attn_scale [3]   (and hc_ffn_*)
//	layers.L.attn_norm.weight, layers.L.ffn_norm.weight [dim]
//	layers.L.ffn.gate.weight [E, dim] (bf16), layers.L.ffn.gate.bias [E] F32
//	layers.L.ffn.experts.E.w1|w2|w3.weight U8 [out, in/2] (float4_e2m1fn_x2), .scale U8 [out, in/32] (UE8M0)
//	layers.L.ffn.shared_experts.w1|w2|w3.weight U8 [out, in] (E4M3), .scale U8 [out/32, in/32] (UE8M0)
//	embed.weight [vocab, dim], norm.weight [dim], head.weight [vocab, dim]
//
// and each step file the token fed, global "tok" I64 [1]. A dump without
// layers.0.hc_attn_fn is a dump of the attention sub-layers (as
// testdata/v41-tiny): the replay compares those only and says so
// (Coverage.Scope).

// v41HasBlock reports whether a V4.1 weights file holds the whole model.
func v41HasBlock(ws *dump.Safetensors) bool { return ws.Has("layers.0.hc_attn_fn") }

// loadV41Block reads the block, MoE and head weights into m.
func loadV41Block(cfg *engine.Config, ws *dump.Safetensors, m *engine.V41Model) error {
	path := ws.Path
	var errs []error
	f32 := func(name string, shape ...int) []float32 { return readF32(ws, &errs, name, shape...) }
	u8 := func(name string, shape ...int) []uint8 {
		r, err := ws.Read(name)
		if err == nil && (r.DType != dump.U8 || !slices.Equal(r.Shape, shape)) {
			err = fmt.Errorf("%s: %s is %s %v, want U8 %v", path, name, r.DType, r.Shape, shape)
		}
		if err != nil {
			errs = append(errs, err)
			return make([]uint8, prod(shape))
		}
		return r.Data
	}
	fp4 := func(name string, rows, cols int) *moe.FP4Weight {
		w, err := moe.NewV41FP4Weight(u8(name+".weight", rows, cols/2), u8(name+".scale", rows, cols/moe.FP4Block), rows, cols)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %s: %w", path, name, err))
			return &moe.FP4Weight{Rows: rows, Cols: cols, Packed: make([]uint8, rows*cols/2), Scale: make([]uint8, rows*cols/moe.FP4Block)}
		}
		return w
	}
	fp8 := func(name string, rows, cols int) *attention.V41FP8Weight {
		return attention.NewV41FP8Weight(u8(name+".weight", rows, cols), u8(name+".scale", (rows+31)/32, (cols+31)/32), rows, cols)
	}
	hc, dim, E, inter := cfg.HCMult, cfg.Dim, cfg.NRoutedExperts, cfg.MoEInterDim
	if dim%32 != 0 || inter%32 != 0 || E <= 0 || cfg.NActivatedExperts <= 0 || cfg.VocabSize <= 0 {
		return fmt.Errorf("%s: the config's MoE (dim %d, moe_inter_dim %d, %d experts top-%d, vocab %d) cannot be read", path, dim, inter, E, cfg.NActivatedExperts, cfg.VocabSize)
	}
	nm := mhc.NMixes(hc)
	site := func(p, side string) *mhc.Site {
		return &mhc.Site{Mult: hc, Dim: dim, Fn: f32(p+"hc_"+side+"_fn", nm, hc*dim), Base: f32(p+"hc_"+side+"_base", nm), Scale: f32(p+"hc_"+side+"_scale", 3)}
	}
	for l, w := range m.Layers {
		p := fmt.Sprintf("layers.%d.", l)
		w.Block = &engine.V41BlockWeights{AttnSite: site(p, "attn"), FFNSite: site(p, "ffn"),
			AttnNorm: f32(p+"attn_norm.weight", dim), FFNNorm: f32(p+"ffn_norm.weight", dim)}
		mo, err := engine.V41MoEFromConfig(cfg)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		mo.Gate.Weight, mo.Gate.Bias = f32(p+"ffn.gate.weight", E, dim), f32(p+"ffn.gate.bias", E)
		for e := 0; e < E; e++ {
			q := fmt.Sprintf("%sffn.experts.%d.", p, e)
			mo.Experts = append(mo.Experts, &moe.V41Expert{W1: fp4(q+"w1", inter, dim), W2: fp4(q+"w2", dim, inter), W3: fp4(q+"w3", inter, dim)})
		}
		q := p + "ffn.shared_experts."
		mo.Shared = &moe.V41Shared{W1: fp8(q+"w1", inter, dim), W2: fp8(q+"w2", dim, inter), W3: fp8(q+"w3", inter, dim)}
		w.MoE = mo
		if len(errs) > 0 {
			return errs[0]
		}
	}
	V := cfg.VocabSize
	m.Head = &engine.V41HeadWeights{Vocab: V, Embed: f32("embed.weight", V, dim), Norm: f32("norm.weight", dim), Head: f32("head.weight", V, dim)}
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// v41BlockRecords are the block, MoE and head weights of a whole model under
// the official names (what loadV41Block reads): bf16 tensors in bf, fp32 in
// f32, U8 codes and scales as records.
func v41BlockRecords(m *engine.V41Model, bf, f32 func(string, []float32, ...int), u8 func(string, []uint8, ...int)) {
	cfg := m.Cfg
	hc, dim := cfg.HCMult, cfg.Dim
	nm := mhc.NMixes(hc)
	for l, w := range m.Layers {
		p := fmt.Sprintf("layers.%d.", l)
		for side, s := range map[string]*mhc.Site{"attn": w.Block.AttnSite, "ffn": w.Block.FFNSite} {
			f32(p+"hc_"+side+"_fn", s.Fn, nm, hc*dim)
			f32(p+"hc_"+side+"_base", s.Base, nm)
			f32(p+"hc_"+side+"_scale", s.Scale, 3)
		}
		bf(p+"attn_norm.weight", w.Block.AttnNorm, dim)
		bf(p+"ffn_norm.weight", w.Block.FFNNorm, dim)
		g := &w.MoE.Gate
		bf(p+"ffn.gate.weight", g.Weight, g.Experts, dim)
		f32(p+"ffn.gate.bias", g.Bias, g.Experts)
		fp4 := func(name string, fw *moe.FP4Weight) {
			u8(name+".weight", fw.Packed, fw.Rows, fw.Cols/2)
			u8(name+".scale", fw.Scale, fw.Rows, fw.Cols/moe.FP4Block)
		}
		for e, ex := range w.MoE.Experts {
			q := fmt.Sprintf("%sffn.experts.%d.", p, e)
			fp4(q+"w1", ex.W1)
			fp4(q+"w2", ex.W2)
			fp4(q+"w3", ex.W3)
		}
		fp8 := func(name string, fw *attention.V41FP8Weight) {
			u8(name+".weight", fw.Codes, fw.Rows, fw.Cols)
			u8(name+".scale", fw.Scale, (fw.Rows+31)/32, (fw.Cols+31)/32)
		}
		q := p + "ffn.shared_experts."
		fp8(q+"w1", w.MoE.Shared.W1)
		fp8(q+"w2", w.MoE.Shared.W2)
		fp8(q+"w3", w.MoE.Shared.W3)
	}
	hw := m.Head
	bf("embed.weight", hw.Embed, hw.Vocab, dim)
	bf("norm.weight", hw.Norm, dim)
	bf("head.weight", hw.Head, hw.Vocab, dim)
}

// Token is the token id fed at step p (the step file's global "tok").
func (d *V41Dump) Token(p int64) (int64, error) {
	t, ok := d.step[p]["tok"]
	if !ok {
		t, ok = d.step[p]["token"] // the name of testdata/v41-tiny-whole
	}
	if !ok || len(t.I) != 1 {
		return 0, fmt.Errorf("step_%d.safetensors: the whole-model dump has no tok (I64 [1], the token fed)", p)
	}
	return t.I[0], nil
}

// v41LayerName reports whether a step tensor's name is L<l>.<stage>.
func v41LayerName(n string) bool {
	var l int
	var rest string
	k, err := fmt.Sscanf(n, "L%d.%s", &l, &rest)
	return err == nil && k == 2
}

// v41Scope is Coverage.Scope of a V4.1 replay: what the reference ran.
func v41Scope(m *engine.V41Model) string {
	if m.Whole() {
		return "whole decode step: embedding, each layer's pipelined mHC, attention with the shared runtime and MoE, the head (logits, greedy token)"
	}
	return "attention sub-layers only: the dump has no block weights (layers.L.hc_attn_fn, ffn.*, embed/norm/head), so the mHC, MoE and head are not compared"
}

// v41BlockTolerance is the local tolerance of the whole step's block stages:
// V4's bounds for the same operations (DefaultTolerance, measured on the
// official V4 GPU dump), since the V4.1 mHC, gate and head use the same fp32
// GEMVs, hc_split_sinkhorn and roundings; exact where only a copy or an
// in-order fp32 sum is involved.
func v41BlockTolerance() map[string]StageTol {
	v4 := DefaultTolerance()
	t := map[string]StageTol{}
	for _, n := range []string{"hc_attn_mixes", "hc_ffn_mixes", "hc_attn_pre", "hc_attn_post", "hc_attn_comb", "hc_ffn_pre", "hc_ffn_post", "hc_ffn_comb",
		"moe_weights", "logits"} {
		st := v4.For(n)
		st.Why = "V4.1: V4's bound for the same fp32 operation (" + st.Why + ")"
		t[n] = st
	}
	for _, n := range []string{"x", "ffn_in", "head_x", "ffn_out", "moe_expert_out", "moe_shared_out"} {
		t[n] = StageTol{Mode: TolULP, MaxULP: 1, Why: "V4.1: bf16 out of an fp32 reduction whose order the GPU may change (RMSNorm mean(x²), GEMM): one bf16 ulp"}
	}
	for _, n := range []string{"embed", "h_in", "pre_mix_in", "attn_norm_in", "h_mid", "ffn_norm_in", "h_out", "pre_mix_out", "head_pre_mix", "head_in", "moe_indices", "next_token"} {
		t[n] = StageTol{Mode: TolExact, Why: "V4.1: a copy, a top-k, or an in-order fp32 sum over the hc copies then one bf16 rounding"}
	}
	return t
}

// V41WholePropagatedTolerance is the default tolerance of a propagated
// replay of a whole V4.1 dump: the chain runs from the token through every
// layer on the reference's own values, so summation-order noise of one
// layer reaches all later ones, and the FP8 / FP4 activation quantisation of
// every linear turns last-bit drift into flipped codes (as V4's
// ChainedTolerance): every float stage is judged by cos_diff ≤ 5e-3 (and
// NaN/inf patterns) — measured on the GPU golden testdata/v41-tiny-whole:
// max 1.4e-3 (moe_expert_out of layer 7 at step 14; y 1.2e-3), growing
// with depth; the index lists, the candidate mask, the experts chosen and
// the greedy token stay exact; index_sel stays a set.
func V41WholePropagatedTolerance() *Tolerance {
	t := V41Tolerance(Local)
	ints := map[string]bool{"topk_idxs": true, "cand_mask": true, "moe_indices": true, "next_token": true}
	for name, st := range t.Stages {
		if st.Mode == TolSet || ints[name] {
			continue
		}
		t.Stages[name] = StageTol{Mode: TolClose, Abs: 1e30, Cos: 5e-3, Why: "V4.1 propagated through the whole step: cos_diff only, drift through FP8/FP4 codes over the layers (golden max 1.4e-3; " + st.Why + ")"}
	}
	t.Fallback = StageTol{Mode: TolClose, Abs: 1e30, Cos: 5e-3, Why: "V4.1 propagated through the whole step: cos_diff only"}
	return t
}

// V41DefaultTolerance is the default tolerance of a replay of d in mode:
// V41WholePropagatedTolerance for a propagated replay of a whole dump, else
// (d nil too) V41Tolerance(mode).
func V41DefaultTolerance(d *V41Dump, mode Mode) *Tolerance {
	if mode == Propagated && d != nil && d.Model.Whole() {
		return V41WholePropagatedTolerance()
	}
	return V41Tolerance(mode)
}
