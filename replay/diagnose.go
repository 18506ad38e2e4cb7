package replay

import (
	"fmt"
	"strings"

	"sparsemla/attribute"
	"sparsemla/engine"
)

// DiagnoseInput is what Diagnose looks at: the failing stage, the reference and
// GPU values, and the inputs the reference computed it from.
type DiagnoseInput struct {
	Model  *engine.Model
	Src    Source
	Def    engine.StageDef
	Result StageResult
	Ref    engine.Tensor
	GPU    engine.Tensor
	In     map[string]engine.Tensor // the stage's inputs (dumped values in local mode)
	Own    map[string]engine.Tensor // the reference's own stage values at this step
	Mode   Mode
	Tol    *Tolerance // the policy in force (nil: the mode's default)

	hyp *attribute.Verdict // the hypotheses' verdict on the stage (set by Diagnose)
}

// Diagnose names the kind of a divergence and why, from the stage that failed
// and what its inputs looked like:
//
//   - upstream: an input of the stage had already diverged (propagated mode,
//     or an input that was itself out of tolerance);
//   - attention kernel: o (or lse) differs while q, the cache and the index
//     list matched; per head, and whether each bad head is a rescaling of the
//     reference (a normalisation / LSE error) or not (a split-K merge or
//     wrong-keys error);
//   - indexer selection: the scores matched but the top-k set did not (and not
//     inside a boundary tie); indexer scores: the scores themselves differ;
//   - FP8 cache: the FQ8 value of the window K differs (which 64-blocks, and
//     whether the GPU's block scale is the reference's ×2^k), or a cache row
//     not written at this step differs only in one block by a power of two
//     (a corrupted scale byte);
//   - compressor: a compressed row or compressor state differs, or the row due
//     at this emission step is missing from the cache (emitted late);
//   - prefix cache: cache rows not written at this step (positions before the
//     token) differ from this request's own rows of the previous step, and
//     equal another request's rows when the dump names a prefix hit;
//   - projection: a linear/norm/RoPE stage is out of tolerance.
func Diagnose(d DiagnoseInput) *Divergence {
	sr := d.Result
	div := &Divergence{Step: sr.Step, Layer: sr.Layer, Stage: sr.Stage, Mode: string(d.Mode), Inputs: sr.Inputs}
	defer func() {
		div.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", div.Step, div.Layer, div.Stage, div.Kind, div.Why)
		div.Hint = hints[div.Kind]
		if div.Kind == KindAttention && div.Stage == "o_latent" {
			div.Hint = v32AttentionHint
		}
	}()
	if up := upstreamInput(d); up != "" {
		div.Kind, div.Why = KindUpstream, up
		return div
	}
	if sr.Metrics != nil && (sr.Metrics.GPUNaN != sr.Metrics.RefNaN || sr.Metrics.GPUInf != sr.Metrics.RefInf || len(sr.Metrics.NonFiniteRows) > 0) {
		div.Kind = stageKind(sr.Stage)
		div.Rows = sr.Metrics.NonFiniteRows
		div.Why = fmt.Sprintf("the GPU output has %d NaN and %d inf where the reference has %d and %d (leading-axis rows %v)",
			sr.Metrics.GPUNaN, sr.Metrics.GPUInf, sr.Metrics.RefNaN, sr.Metrics.RefInf, sr.Metrics.NonFiniteRows)
		if bad := nonFiniteInputs(d); bad != "" {
			div.Why += "; the reference inherits non-finite values from its input " + bad
		} else {
			div.Why += "; its inputs are finite and matched, so this stage made them"
		}
		return div
	}
	if sr.Reason != "" && (strings.HasPrefix(sr.Reason, "shape") || strings.HasPrefix(sr.Reason, "dtype")) && sr.Stage != "kv_cache" && sr.Stage != "topk_idxs" {
		div.Kind, div.Why = stageKind(sr.Stage), "GPU tensor has "+sr.Reason
		return div
	}
	if sr.Stage == "index_score" && strings.Contains(sr.Reason, selectionWhyMark) {
		diagnoseScoreSelection(d, div)
		return div
	}
	d.hyp = attributeStage(d)
	div.Hypothesis = d.hyp
	defer func() {
		// Every diagnosis names the hypothesis that reproduces the GPU (or
		// the closest one) unless its own sentence already does.
		if t := d.hyp.Text(); t != "" && !strings.Contains(div.Why, t) {
			div.Why += "; " + t
		}
	}()
	switch sr.Stage {
	case "o", "lse":
		diagnoseAttention(d, div)
	case "index_topk", "index_sel":
		diagnoseSelection(d, div)
	case "kv", "cmp_row":
		diagnoseFQ8(d, div)
	case "kv_cache":
		diagnoseCache(d, div)
	case "topk_idxs":
		diagnoseIndexList(d, div)
	default:
		if blockKind(sr.Stage, sr.Layer) != "" {
			diagnoseBlock(d, div) // hyper-connections, router, experts, head
			return div
		}
		div.Kind = stageKind(sr.Stage)
		div.Why = fmt.Sprintf("%s; %s, so %s itself differs (%s)", sr.Reason, inputsPhrase(sr.Inputs), sr.Stage, orEq(sr.Equation))
	}
	return div
}

// inputsPhrase says how a stage's inputs compared: "its inputs (a, b)
// matched the reference", or which of them were not checked.
func inputsPhrase(ins []InputInfo) string {
	var names, unchecked []string
	for _, in := range ins {
		names = append(names, in.Name)
		if in.Status != "matched" {
			unchecked = append(unchecked, fmt.Sprintf("%s from %s %s", in.Name, in.From, in.Status))
		}
	}
	if len(unchecked) == 0 {
		return fmt.Sprintf("its inputs (%s) matched the reference", strings.Join(names, ", "))
	}
	return fmt.Sprintf("its inputs (%s) matched the reference or were not checked (%s)", strings.Join(names, ", "), strings.Join(unchecked, "; "))
}

func orEq(eq string) string {
	if eq == "" {
		return "see the stage's equation"
	}
	return eq
}

// stageKind is the diagnosis kind a stage belongs to by default.
func stageKind(stage string) string {
	if k := blockKind(stage, 0); k != "" {
		return k
	}
	switch {
	case stage == "o" || stage == "lse" || stage == "o_latent":
		return KindAttention
	case stage == "index_topk" || stage == "index_sel":
		return KindIndexer
	case stage == "index_score" || stage == "index_qk" || strings.HasPrefix(stage, "iq") || strings.HasPrefix(stage, "iw") ||
		strings.HasPrefix(stage, "ik_") || stage == "index_weights": // ik_*, index_weights: V3.2
		return KindIndexScore
	case stage == "kv":
		return KindFP8Cache
	case strings.HasPrefix(stage, "cmp_") || strings.HasPrefix(stage, "icmp_") || stage == "icache":
		return KindCompressor
	case stage == "kv_cache" || stage == "latent_cache" || stage == "k_cache" || stage == "k_scale_cache":
		return KindCache
	case stage == "topk_idxs":
		return KindIndexList
	}
	return KindProjection
}

// upstreamInput returns why the stage's inputs already differed, or "".
func upstreamInput(d DiagnoseInput) string {
	for _, in := range d.Result.Inputs {
		if in.Status == "diverged" {
			return fmt.Sprintf("its input %s (%s) was already out of tolerance", in.Name, in.From)
		}
	}
	if d.Mode == Local {
		return ""
	}
	// Propagated, chained: compare the reference's own inputs with the dumped ones.
	tol := d.Tol
	if tol == nil {
		tol = PropagatedTolerance()
	}
	for _, name := range d.Def.Inputs {
		if strings.HasPrefix(name, "prev:") {
			continue
		}
		own, ok := d.Own[name]
		if !ok {
			continue
		}
		gpu, ok, err := d.Src.Stage(d.Result.Step, d.Result.Layer, name)
		if err != nil || !ok {
			continue
		}
		var sr StageResult
		sr.Stage = name
		JudgeStage(&sr, own, gpu, map[string]engine.Tensor{}, tol.For(name), JudgeContext{d.Model.GPURope, d.Model.Cfg.WindowSize})
		if sr.Status == StatusFail {
			return fmt.Sprintf("its input %s already differs between the reference chain and the dump (%s)", name, sr.Reason)
		}
	}
	return ""
}

// nonFiniteInputs names the first input of the stage holding NaN or inf, with
// where it came from, or "".
func nonFiniteInputs(d DiagnoseInput) string {
	for _, info := range d.Result.Inputs {
		t, ok := d.In[info.Name]
		if !ok || !t.Kind.IsFloat() {
			continue
		}
		nan, inf := 0, 0
		for _, v := range t.F {
			switch {
			case v != v:
				nan++
			case !finite(v):
				inf++
			}
		}
		// score_state holds −∞ by design (empty entries); only NaN counts there.
		if strings.HasSuffix(info.Name, "score_state") {
			inf = 0
		}
		if nan+inf > 0 {
			return fmt.Sprintf("%s (%s, %s: %d NaN, %d inf)", info.Name, info.From, info.Status, nan, inf)
		}
	}
	return ""
}
