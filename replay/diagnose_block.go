package replay

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"sparsemla/attribute"
	"sparsemla/engine"
	"sparsemla/moe"
)

// Diagnosis kinds of the stages around the attention sub-layer.
const (
	KindEmbedding = "embedding"         // h_in of layer 0
	KindLayerLink = "layer link"        // h_in of layer l > 0 against h_out of layer l-1
	KindHyperConn = "hyper-connections" // hc_pre (mixes, split/Sinkhorn, collapse) and hc_post
	KindRouter    = "MoE router"        // moe_indices, moe_weights
	KindExperts   = "MoE experts"       // ffn_out: routed FP4 experts and the shared FP8 expert
	KindHead      = "head"              // logits
	KindResidual  = "residual"          // V3.2's h_mid: the fused add-RMSNorm's residual sum (no hyper-connections)
)

func init() {
	hints[KindEmbedding] = "check the embedding lookup: row tok of embed.weight, copied unchanged into every one of the hc_mult streams"
	hints[KindLayerLink] = "check what runs between two layers: the layer's input streams must be the previous layer's hc_post output, unchanged"
	hints[KindHyperConn] = "check hc_pre / hc_post: mixes = (hc_fn · f32(flatten(h))) · rsqrt(mean(h²) + norm_eps); pre = sigmoid(·)+eps, post = 2·sigmoid(·), comb = row softmax + eps then hc_sinkhorn_iters column/row normalisations; collapse Σ_j pre_j h_j; out_j = post_j·a + Σ_k comb[k][j]·h_k"
	hints[KindRouter] = "check the gate: fp32 scores W_g·x through score_func, the bias added for the choice only, top-k descending (tid2eid[token] on the first n_hash_layers), weights = chosen scores / their sum · route_scale"
	hints[KindExperts] = "check the expert GEMMs: FP8 activations per 128, FP4 weights with the even column in the LOW nibble and a UE8M0 scale per 32, up clamped to ±swiglu_limit and gate from above on routed experts only, weight before w2, fp32 sum in expert-id order plus the shared expert"
	hints[KindHead] = "check the head: hc_head (sigmoid weights, no Sinkhorn), the final norm and the fp32 head GEMV"
	hints[KindResidual] = "check the residual add around the FFN (V3.2's fused add-RMSNorm): h_mid = bf16(f32(y) + f32(h_in)), h_in the layer's input (the embedding row on layer 0, else the previous layer's output), summed in fp32 and rounded once"
}

// blockKind is the diagnosis kind of a block, MoE or head stage ("" for the
// attention sub-layer's).
func blockKind(stage string, layer int) string {
	switch {
	case stage == "h_in" && layer == 0:
		return KindEmbedding
	case stage == "h_in":
		return KindLayerLink
	case strings.HasPrefix(stage, "hc_attn_") || strings.HasPrefix(stage, "hc_ffn_") ||
		stage == "attn_norm_in" || stage == "ffn_norm_in" || stage == "h_mid" || stage == "h_out":
		return KindHyperConn
	case stage == "moe_indices" || stage == "moe_weights":
		return KindRouter
	case stage == "ffn_out":
		return KindExperts
	case stage == "logits":
		return KindHead
	}
	return ""
}

// diagnoseBlock names what went wrong in a block, MoE or head stage whose
// inputs matched: it recomputes the stage under the bugs a GPU kernel
// plausibly has and says which one reproduces the GPU's value (within the
// stage's tolerance), else that the stage itself differs.
func diagnoseBlock(d DiagnoseInput, div *Divergence) {
	sr := d.Result
	div.Kind = blockKind(sr.Stage, sr.Layer)
	if k := v32BlockKind(d); k != "" {
		div.Kind = k
	}
	base := fmt.Sprintf("%s; %s, so %s itself differs (%s)", sr.Reason, inputsPhrase(sr.Inputs), sr.Stage, orEq(sr.Equation))
	var why string
	switch {
	case sr.Stage == "h_in" && sr.Layer > 0:
		why = fmt.Sprintf("the dumped input streams of layer %d are not layer %d's dumped output h_out (%s)", sr.Layer, sr.Layer-1, sr.Reason)
	case strings.HasSuffix(sr.Stage, "_comb") || strings.HasSuffix(sr.Stage, "_pre") || strings.HasSuffix(sr.Stage, "_post"):
		why = hcSplitHypotheses(d)
	case sr.Stage == "h_mid" || sr.Stage == "h_out":
		why = hcPostHypotheses(d)
	case sr.Stage == "moe_indices":
		why = routerIndicesHypotheses(d)
	case sr.Stage == "moe_weights":
		why = routerWeightsHypotheses(d)
	case sr.Stage == "ffn_out":
		why = expertHypotheses(d)
	}
	exact := exactHypothesis(d.hyp)
	if why == "" && exact != "" {
		why = sr.Reason // the hypothesis sentence Diagnose appends says the rest
	}
	if sr.Stage == "ffn_out" {
		if ev := routedEvidence(d, exact); ev != "" {
			if why == "" {
				why = sr.Reason
			}
			why += ev
		}
	}
	if why == "" {
		why = base
	}
	if part := blockPart(d, exact, why); part != "" {
		why = part + ": " + why
	}
	div.Why = why
}

// blockPart names the part of the layer a block diagnosis blames (the
// prefix of its sentence): from the hypothesis that reproduces the GPU bit
// for bit when one does, else from the stage and what the diagnosis found.
func blockPart(d DiagnoseInput, exact, why string) string {
	stage := d.Result.Stage
	exact = strings.TrimPrefix(exact, "v32-") // V3.2's names of the same bugs (attribute/hypotheses_v32ffn.go)
	switch {
	case strings.HasPrefix(exact, "hash-row-") || exact == "topk-on-hash-layer":
		return "hash lookup"
	case exact == "no-selection-bias":
		return "selection"
	case strings.HasPrefix(exact, "weights-"):
		return "weights, selection correct"
	case strings.HasPrefix(exact, "shared-") || exact == "no-shared-expert":
		return "shared expert"
	case strings.HasPrefix(exact, "dense-gate-up"):
		return "gate and up (w1, w3)"
	case v32BlockKind(d) != "":
		return "" // the kind names the part
	case exact != "" && stage == "ffn_out":
		return "routed experts"
	case exact == "head-no-final-norm" || exact == "head-norm-no-weight":
		return "final norm"
	case strings.HasPrefix(exact, "hc-head-"):
		return "hc_head collapse"
	}
	switch {
	case stage == "moe_indices":
		if b := blockWeights(d); b != nil && b.MoE.Gate.Hash() {
			return "hash lookup"
		}
		return "selection"
	case stage == "moe_weights":
		return "weights, selection correct"
	case stage == "ffn_out" && strings.Contains(why, "shared expert"):
		return "shared expert"
	case stage == "ffn_out" && strings.Contains(why, "routed expert"):
		return "routed experts"
	case strings.HasPrefix(stage, "hc_") && !strings.HasSuffix(stage, "_mixes"):
		return "split/Sinkhorn"
	case stage == "h_mid" || stage == "h_out":
		return "residual hc_post"
	}
	return ""
}

// routedEvidence says, for a decode variant of the routed experts that
// reproduces the GPU's ffn_out bit for bit (exact), what it changes in each
// routed expert's own output (by expert id, slot and weight); when no
// hypothesis reproduces ffn_out, it tries every routed-expert variant on
// each routed expert alone and names the one expert and variant that
// reproduce it bit for bit. "" when neither applies.
func routedEvidence(d DiagnoseInput, exact string) string {
	b := blockWeights(d)
	x, okX := d.In["ffn_in"]
	idxT, okI := d.In["moe_indices"]
	wT, okW := d.In["moe_weights"]
	if b == nil || !okX || !okI || !okW || len(idxT.I) != len(wT.F) {
		return ""
	}
	m := b.MoE
	idx := make([]int32, len(idxT.I))
	for i, e := range idxT.I {
		if e < 0 || e >= int64(m.Gate.Experts) {
			return ""
		}
		idx[i] = int32(e)
	}
	if exact != "" {
		bad, ok, err := attribute.RoutedVariant(exact, m, idx)
		if !ok || err != nil {
			return ""
		}
		var parts []string
		for t, e := range idx {
			ref, err1 := expertOut(m, e, x.F, wT.F[t])
			got, err2 := expertOut(bad, e, x.F, wT.F[t])
			if err1 != nil || err2 != nil {
				return ""
			}
			n := 0
			for i := range ref {
				if math.Float32bits(ref[i]) != math.Float32bits(got[i]) {
					n++
				}
			}
			parts = append(parts, fmt.Sprintf("expert %d (slot %d, weight %g): %d of %d outputs", e, t, wT.F[t], n, len(ref)))
		}
		return fmt.Sprintf("; what %q changes in each routed expert's own output: %s", exact, strings.Join(parts, ", "))
	}
	for _, name := range []string{"fp4-nibble-swap", "fp4-scale-per-128"} {
		for t, e := range idx {
			one, ok, err := attribute.RoutedVariant(name, m, []int32{e})
			if !ok || err != nil {
				continue
			}
			// The other routed experts as the reference reads them.
			for _, o := range idx {
				if o != e {
					if one.Experts[o], err = expertOf(m, int(o)); err != nil {
						return ""
					}
				}
			}
			out, err := one.Combine(x.F, idx, wT.F)
			if err == nil && bitsEqual(engine.FromF(engine.KindBF16, out, len(out)), d.GPU) {
				desc := name
				for _, h := range attribute.Hypotheses("ffn_out") {
					if h.Name == name {
						desc = h.Desc
					}
				}
				return fmt.Sprintf("; routed expert %d (slot %d, weight %g) ALONE reproduces the GPU's ffn_out bit for bit under %q (%s); the other routed experts %v as the reference reads them",
					e, t, wT.F[t], name, desc, slices.DeleteFunc(slices.Clone(idx), func(v int32) bool { return v == e }))
			}
		}
	}
	return ""
}

// expertOut is routed expert e's own output for x with routing weight w.
func expertOut(m *moe.MoE, e int32, x []float32, w float32) ([]float32, error) {
	ex, err := expertOf(m, int(e))
	if err != nil {
		return nil, err
	}
	out := make([]float32, len(x))
	ex.Forward(out, x, w, m.SwigluLimit)
	return out, nil
}

// bitsEqual reports whether a and b hold the same values bit for bit.
func bitsEqual(a, b engine.Tensor) bool {
	if len(a.F) != len(b.F) || len(a.I) != len(b.I) {
		return false
	}
	for i := range a.F {
		if math.Float32bits(a.F[i]) != math.Float32bits(b.F[i]) {
			return false
		}
	}
	return slices.Equal(a.I, b.I)
}

// matches reports whether t is within the stage's tolerance of the GPU's
// value.
func matches(d DiagnoseInput, t engine.Tensor) bool {
	tol := d.Tol
	if tol == nil {
		tol = DefaultTolerance()
	}
	var sr StageResult
	JudgeStage(&sr, t, d.GPU, d.In, tol.For(d.Result.Stage), JudgeContext{d.Model.GPURope, d.Model.Cfg.WindowSize})
	return sr.Status == StatusPass
}

func blockWeights(d DiagnoseInput) *engine.BlockWeights {
	if w := d.Model.Weights[d.Result.Layer]; w != nil {
		return w.Block
	}
	return nil
}
