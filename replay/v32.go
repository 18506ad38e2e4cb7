package replay

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/moe"
)

// V3.2 (DSA) support of the replay: the tolerances of the V3.2 stage names
// (engine.V32Stages), the local-mode tolerance of the stages a V3.2 model
// shares a name with V4 but computes in another number format, and the
// shape check of a V3.2 dump's records.

// KindDenseMLP is the diagnosis kind of ffn_out on a V3.2 dense layer
// (layer < n_dense_layers: the MLP, not the MoE).
const KindDenseMLP = "dense MLP"

// v32AttentionHint is the hint of an attention-kernel divergence at o_latent,
// the V3.2 sparse MLA output (V4's hint names the attention sink and the
// split-K combine of o and lse, which V3.2 does not have).
const v32AttentionHint = "check the sparse MLA kernel (FlashMLA): its split-K combine (the LSE merge of the partial outputs; V3.2 has no attention sink), the scores bf16(q_absorbed·latent + q_pe·k_pe) × τ = qk_head_dim^-0.5 (× mscale² under YaRN) with −∞ outside the index_topk tokens, the bf16 softmax and P·latent (the output stays in the latent space); and the rows it gathers: the latent from the FP8 cache (FQ8, a scale per 128), k_pe in bf16"

func init() {
	hints[KindDenseMLP] = "check the dense MLP of the first layers: FP8 w1 (gate) and w3 (up) with act_quant per 128, bf16(silu(f32(w1·x)) · f32(w3·x)), FP8 w2"
}

// v32BlockKind is the diagnosis kind of a V3.2 FFN-side stage where it
// differs from V4's (blockKind): ffn_out of a dense layer (dense MLP), h_mid and
// h_out (the residual: V3.2 has no hyper-connections). "" otherwise.
func v32BlockKind(d DiagnoseInput) string {
	switch {
	case d.Model == nil || !d.Model.Cfg.V32():
		return ""
	case d.Result.Stage == "h_mid" || d.Result.Stage == "h_out":
		return KindResidual // V3.2 has no hyper-connections
	case d.Result.Stage == "ffn_out" && d.Result.Layer < d.Model.Cfg.NDenseLayers:
		return KindDenseMLP
	}
	return ""
}

// v32Tol are the default tolerances of the V3.2-only stage names (added to
// DefaultTolerance; a V4 model never has these stages).
func v32Tol() map[string]StageTol {
	exact := func(why string) StageTol { return StageTol{Mode: TolExact, Why: why} }
	ulp := func(n int, why string) StageTol { return StageTol{Mode: TolULP, MaxULP: n, Why: why} }
	rope := func(why string) StageTol { return StageTol{Mode: TolULP, MaxULP: 0, MaxULPNoTable: 1, Why: why} }
	return map[string]StageTol{
		"qr":            ulp(1, "V3.2: RMSNorm q_norm, mean(x²) order"),
		"q_pe":          rope("V3.2: RoPE of q_b's last 64 dims at p"),
		"q_absorbed":    ulp(1, "V3.2: bf16 einsum q_nope·wkv_b, fp32 accumulate (cuBLAS order)"),
		"kv_a":          ulp(1, "V3.2: FP8 linear wkv_a"),
		"kv_fq8":        exact("V3.2: act_quant of kv_normed and back (FQ8, blocks of 128)"),
		"k_pe":          rope("V3.2: RoPE of kv_a's last 64 dims at p"),
		"latent_cache":  exact("V3.2: latent rows are written, never recomputed"),
		"iq_fp8":        exact("V3.2: act_quant E4M3 codes of iq_had"),
		"iq_scale":      exact("V3.2: act_quant power-of-two scales"),
		"ik_raw":        ulp(1, "V3.2: FP8 linear indexer.wk"),
		"ik_normed":     ulp(1, "V3.2: LayerNorm fp32 (Welford order), bf16 out"),
		"ik_roped":      rope("V3.2: RoPE of the key's first 64 dims at p"),
		"ik_had":        ulp(1, "V3.2: Hadamard order"),
		"ik_fp8":        exact("V3.2: act_quant E4M3 codes of ik_had"),
		"ik_scale":      exact("V3.2: act_quant power-of-two scale"),
		"k_cache":       exact("V3.2: index key codes are written, never recomputed"),
		"k_scale_cache": exact("V3.2: index key scales are written, never recomputed"),
		"index_weights": {Mode: TolClose, Abs: 1e-7, Rel: 1e-5, Cos: 1e-9, Why: "V3.2: f32(f32(iw·iq_scale)·128^-0.5) of the fp32 iw"},
		"o_latent": {Mode: TolClose, Abs: flashMLAOutAbs, Rel: flashMLAOutRel, Cos: flashMLAOutCos,
			Why: "V3.2: masked softmax · latent, FlashMLA sparse-decode 'out' thresholds"},
		"o_v": ulp(1, "V3.2: bf16 einsum o_latent·wkv_b, fp32 accumulate"),
	}
}

// v32SharedTol are a V3.2 model's local-mode tolerances of stage names V4
// also has: index_score is an fp32 fp8_index output there (a bf16 head sum
// in V4), iw_raw and iw fp32 (bf16 in V4).
func v32SharedTol() map[string]StageTol {
	f32 := StageTol{Mode: TolClose, Abs: 1e-6, Rel: 1e-5, Cos: 1e-9, Why: "V3.2: fp32 GEMV / sum, summation order"}
	return map[string]StageTol{
		"index_score": {Mode: TolClose, Abs: 1e-6, Rel: 1e-5, Cos: 1e-9,
			Why: "V3.2: fp32 fp8_index, head-sum order of the kernel's reduce_sum"},
		"iw_raw": f32,
		"iw":     StageTol{Mode: TolClose, Abs: 1e-6, Rel: 1e-5, Cos: 1e-9, Why: "V3.2: f32(iw_raw·H_I^-0.5) of an fp32 GEMV"},
	}
}

// v32Tolerance adapts a local replay's tolerances to a V3.2 model: a shared
// stage whose tolerance is still V4's default takes V3.2's (v32SharedTol); a
// stage set by the caller keeps it.
func v32Tolerance(t *Tolerance, mode Mode, cfg *engine.Config) *Tolerance {
	if !cfg.V32() || mode != Local {
		return t
	}
	def := DefaultTolerance()
	out := t.Clone()
	for name, st := range v32SharedTol() {
		if t.For(name) == def.For(name) {
			out.Set(name, st)
		}
	}
	return out
}

// checkV32RecordShape checks one stage or state record of a V3.2 layer.
func checkV32RecordShape(cfg *engine.Config, e *dump.Entry) error {
	H, HI, DI := cfg.NHeads, cfg.IndexNHeads, cfg.IndexHeadDim
	c, r := cfg.KVLoraRank, cfg.QKRopeHeadDim
	T := e.Step + 1 // tokens cached after step s
	if e.Step < 0 {
		T = 0
	}
	var want []int
	switch s := e.Stage; s {
	case "x", "y":
		want = []int{cfg.Dim}
	case "q_a", "qr":
		want = []int{cfg.QLoraRank}
	case "q_b":
		want = []int{H, cfg.V32QKHeadDim()}
	case "q_pe":
		want = []int{H, r}
	case "q_absorbed", "o_latent":
		want = []int{H, c}
	case "kv_a":
		want = []int{cfg.V32KVDim()}
	case "kv_normed", "kv_fq8":
		want = []int{c}
	case "k_pe":
		want = []int{r}
	case "iq_b", "iq_roped", "iq_had", "iq_fp8":
		want = []int{HI, DI}
	case "iq_scale", "iw_raw", "iw", "index_weights":
		want = []int{HI}
	case "ik_raw", "ik_normed", "ik_roped", "ik_had", "ik_fp8":
		want = []int{DI}
	case "ik_scale":
		want = []int{1}
	case "o_v":
		want = []int{H, cfg.VHeadDim}
	case "latent_cache":
		want = []int{T, cfg.V32KVDim()}
	case "k_cache":
		want = []int{T, DI}
	case "k_scale_cache", "index_score":
		want = []int{T}
	case "index_topk":
		want = []int{min(cfg.IndexTopK, T)}
	default:
		if strings.HasPrefix(s, "cmp_") || strings.HasPrefix(s, "icmp_") || s == "kv_cache" || s == "icache" || s == "topk_idxs" {
			return fmt.Errorf("%s is a V4 stage; a V3.2 model (kv_lora_rank = %d, no compress_ratios) has none", s, c)
		}
		return nil
	}
	if !slices.Equal(e.Shape, want) {
		return fmt.Errorf("the V3.2 config needs %v at step %d (dim = %d, n_heads = %d, q_lora_rank = %d, kv_lora_rank = %d, qk_nope/rope/v = %d/%d/%d, index_n_heads = %d, index_topk = %d)",
			want, e.Step, cfg.Dim, H, cfg.QLoraRank, c, cfg.QKNopeHeadDim, r, cfg.VHeadDim, HI, cfg.IndexTopK)
	}
	return nil
}

// v32WholeSeeds makes a V3.2 layer's propagated step start from the
// Block.forward inputs when the weights hold the layer's FFN part and the
// dump holds them at step p (x_in, and res_in above layer 0): seeds then
// holds those instead of x and the step runs the whole layer
// (engine.V32BlockStages). A step without them runs the attention from the
// dumped x, as before (the FFN stages are not compared there).
func v32WholeSeeds(m *engine.Model, src Source, p int64, layer int, chained bool, seeds map[string]engine.Tensor) (bool, error) {
	w := m.Weights[layer]
	if chained || !m.Cfg.V32() || w == nil || w.V32 == nil || w.V32.FFN == nil {
		return false, nil
	}
	names := []string{"x_in"}
	if layer > 0 {
		names = append(names, "res_in")
	}
	got := map[string]engine.Tensor{}
	for _, n := range names {
		t, ok, err := src.Stage(p, layer, n)
		if err != nil {
			return false, err
		}
		if !ok {
			return false, nil
		}
		got[n] = t
	}
	delete(seeds, "x")
	for n, t := range got {
		seeds[n] = t
	}
	return true, nil
}

// v32LocalDefs are the stages a local replay checks at one V3.2 unit: the
// whole layer (defs, engine.V32BlockStages) when the dump holds the step's
// Block input x_in, else the attention alone from the dumped x
// (engine.V32Stages), as propagated mode runs such a step. FFN-side tensors
// dumped at such a step are then reported as not compared (coverage).
func v32LocalDefs(m *engine.Model, src Source, u unit, defs []engine.StageDef) ([]engine.StageDef, error) {
	if w := m.Weights[u.layer]; w == nil || w.V32 == nil || w.V32.FFN == nil {
		return defs, nil
	}
	ok, err := heldBy(src, u.step, u.layer, "x_in")
	if err != nil || ok {
		return defs, err
	}
	return engine.V32Stages(m.Cfg, u.layer, u.step), nil
}

// v32RouterNearTie is routerNearTie for a V3.2 layer (the grouped router,
// moe.Gate.GroupedRoute): sr (a failed moe_indices) becomes a tie when the
// GPU's experts differ from the reference's only among near-equal
// candidates — every expert chosen by one side only has a selection score
// s + bias within routerTieRel (relative) of the reference's k-th, and
// lies in a group the reference kept or in one whose group score is within
// routerTieRel of the lowest kept group's (which groups the limit keeps
// depends on the same last bits of the fp32 gate GEMV). The same set in
// another order, a far expert or a far group stays a divergence.
func v32RouterNearTie(sr *StageResult, m *engine.Model, layer int, in map[string]engine.Tensor, ref, gpu engine.Tensor) {
	w := m.Weights[layer]
	x, ok := in["ffn_in"]
	if w == nil || w.V32 == nil || w.V32.FFN == nil || w.V32.FFN.Gate == nil || !ok {
		return
	}
	g := w.V32.FFN.Gate
	if len(x.F) != g.Dim || len(ref.I) == 0 {
		return
	}
	for _, e := range append(slices.Clone(gpu.I), ref.I...) {
		if e < 0 || e >= int64(g.Experts) {
			return
		}
	}
	var onlyGPU, onlyRef []int64
	for _, e := range gpu.I {
		if !slices.Contains(ref.I, e) {
			onlyGPU = append(onlyGPU, e)
		}
	}
	for _, e := range ref.I {
		if !slices.Contains(gpu.I, e) {
			onlyRef = append(onlyRef, e)
		}
	}
	if len(onlyGPU) == 0 {
		return // the same experts in another order: the weights follow the order
	}
	sel := moe.V32Select(g, scoresOf(g, x.F))
	near := func(a, b float32) bool {
		return math.Abs(float64(a)-float64(b)) <= routerTieRel*max(math.Abs(float64(b)), 1e-30)
	}
	kth := sel[ref.I[len(ref.I)-1]]
	G, TG := m.Cfg.NExpertGroups, m.Cfg.NLimitedGroups
	groupOK := func(int64) bool { return true }
	if G > 1 && TG < G {
		n := g.Experts / G
		score := make([]float32, G)
		for gi := range score {
			top, _ := moe.TopK(sel[gi*n:(gi+1)*n], min(2, n))
			score[gi] = sel[gi*n+int(top[0])]
			if g.Bias != nil {
				score[gi] += sel[gi*n+int(top[1])]
			}
		}
		keep, _ := moe.TopK(score, TG)
		last := score[keep[len(keep)-1]]
		groupOK = func(e int64) bool {
			gi := int(e) / n
			return slices.Contains(keep, int32(gi)) || near(score[gi], last)
		}
	}
	for _, e := range append(onlyGPU, onlyRef...) {
		if !near(sel[e], kth) || !groupOK(e) {
			return
		}
	}
	sr.Status, sr.Severity = StatusTie, 0.5
	sr.Reason = fmt.Sprintf("experts %v chosen instead of %v: their score + bias are within %g (relative) of the k-th (%v), in groups the limit keeps or nearly keeps: a near tie the fp32 gate's summation order decides", onlyGPU, onlyRef, routerTieRel, kth)
}
