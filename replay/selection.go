package replay

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"sparsemla/attribute"
	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// Selection judged both ways. index_topk is judged against the GPU's own
// dumped index_score (a boundary tie there is legal). That alone passes a GPU
// whose scores are computed differently (no Hadamard, no FQ4, another
// scorer) and whose top-k is consistent with its own wrong scores. So when
// index_score is judged, the GPU's selection is also judged against the
// reference's scores: in a local replay recomputed by the reference from the
// indexer's dumped inputs — the query chain iq_b → iq_roped → iq_had → iq
// from the dumped cq, the head weights iw_raw → iw from the dumped x, the
// keys of the dumped icache — in a propagated one the chain's own scores.
// When those scores select other rows (beyond exact boundary ties, and
// beyond rows within the index_score tolerance of the k-th score, which a
// one-ulp sum-order difference can reorder) it is a divergence of
// index_score, naming the rows with both scores, and the query-path
// hypotheses (no Hadamard, no FQ4, FP8 in place of FQ4) are tried on the
// dumped iq_roped to name how the GPU's scores were made.

// queryChain are the reference stages recomputed from cq and x.
var queryChain = []string{"iq_b", "iq_roped", "iq_had", "iq", "iw_raw", "iw"}

// refScoresLocal recomputes the reference's index scores from the dumped cq,
// x and icache of (step, layer); ok is false when an input is not dumped.
func refScoresLocal(m *engine.Model, src Source, ctx *engine.StepContext, defs []engine.StageDef) (scores []float32, vals map[string]engine.Tensor, ok bool, err error) {
	vals = map[string]engine.Tensor{}
	for _, n := range []string{"cq", "x", "icache"} {
		t, has, err := src.Stage(ctx.Pos, ctx.Layer, n)
		if err != nil || !has {
			return nil, nil, false, err
		}
		vals[n] = t
	}
	byName := map[string]engine.StageDef{}
	for _, d := range defs {
		byName[d.Name] = d
	}
	for _, n := range append(slices.Clone(queryChain), "index_qk", "index_score") {
		d, has := byName[n]
		if !has {
			return nil, nil, false, nil
		}
		in := map[string]engine.Tensor{}
		for _, i := range d.Inputs {
			t, has := vals[i]
			if !has {
				return nil, nil, false, nil
			}
			in[i] = t
		}
		t, err := ComputeStage(d, ctx, in)
		if err != nil {
			return nil, nil, false, nil
		}
		vals[n] = t
	}
	return vals["index_score"].F, vals, true, nil
}

// selectionVsRef judges the GPU's selection against the reference's scores
// (r, from indexer.CheckSelectionRef or JudgeSelectionRef): "" when the
// reference's top-k is the same set, or differs only in exact ties or in
// rows whose reference score is within allow bf16 ulps of the k-th score;
// else a sentence naming the rows with their reference and GPU scores.
func selectionVsRef(r indexer.RefSelection, k, allow int) string {
	d := r.Diff
	if d.Verdict != indexer.Diverged {
		return ""
	}
	kth := d.Ties.KthScore
	near := len(r.Missing) > 0
	for _, x := range append(slices.Clone(r.Missing), r.Extra...) {
		if x.Ref != x.Ref || quant.BF16ULPDistance(x.Ref, kth) > int32(allow) {
			near = false
			break
		}
	}
	if near {
		return ""
	}
	rows := func(rs []indexer.RowScore) string {
		var p []string
		for i, x := range rs {
			if i == 6 {
				p = append(p, fmt.Sprintf("… (%d more)", len(rs)-6))
				break
			}
			switch {
			case x.Ref != x.Ref:
				p = append(p, fmt.Sprintf("row %d (outside the %d rows)", x.Row, len(r.Scores)))
			case x.GPU != x.GPU:
				p = append(p, fmt.Sprintf("row %d (reference score %g, GPU score not dumped)", x.Row, x.Ref))
			default:
				p = append(p, fmt.Sprintf("row %d (reference score %g, GPU score %g)", x.Row, x.Ref, x.GPU))
			}
		}
		return strings.Join(p, ", ")
	}
	s := fmt.Sprintf("the GPU's top-%d matches its own index scores, but with the reference's scores the top-%d is other rows (k-th reference score %g, not a boundary tie)", k, k, kth)
	if len(r.Missing) > 0 {
		s += "; the reference selects " + rows(r.Missing)
	}
	if len(r.Extra) > 0 {
		s += "; the GPU selected instead " + rows(r.Extra)
	}
	return s
}

// queryHypotheses tries the indexer query-path hypotheses from the dumped
// iq_roped (no Hadamard, no FQ4, FP8 in place of FQ4, and the two without
// Hadamard) and returns the verdict on the GPU's scores gpuScores: which
// hypothesis gives those scores bit for bit with the dumped icache and the
// reference's iw.
func queryHypotheses(ctx *engine.StepContext, vals map[string]engine.Tensor, roped, gpuScores engine.Tensor) *attribute.Verdict {
	ix := ctx.W.Indexer
	ic, iw := vals["icache"], vals["iw"]
	if ix == nil || len(roped.F) != ix.NHeads*ix.HeadDim || !ic.Kind.IsFloat() || len(ic.Shape) != 2 {
		return nil
	}
	score := func(iq []float32) engine.Tensor {
		tc := ic.Shape[0]
		qk := make([]float32, ix.NHeads*tc)
		indexer.IndexQK(qk, iq, ic.F, ix.NHeads, ix.HeadDim)
		s := make([]float32, tc)
		indexer.IndexScore(s, qk, iw.F)
		return engine.FromF(gpuScores.Kind, s, gpuScores.Shape...)
	}
	had := make([]float32, len(roped.F))
	ix.QueryHad(had, roped.F)
	variants := []struct {
		name, desc string
		iq         func() []float32
	}{
		{"no-hadamard", "the query FQ4-quantised without the Hadamard rotation (vLLM's indexer, spec §8.3)", func() []float32 {
			q := make([]float32, len(roped.F))
			ix.Query(q, roped.F)
			return q
		}},
		{"no-fq4", "the rotated query not FP4-quantised", func() []float32 { return slices.Clone(had) }},
		{"no-hadamard-no-fq4", "the roped query used as is (no rotation, no FP4)", func() []float32 { return slices.Clone(roped.F) }},
		{"fp8-instead-of-fq4", "the rotated query FP8-quantised per head (SGLang's act_quant, spec §8.3)", func() []float32 {
			q := make([]float32, len(had))
			ix.QueryFP8(q, had, quant.ScaleCeil2, quant.FP8AmaxFloor)
			return q
		}},
	}
	ref := make([]float32, len(had))
	ix.Query(ref, had)
	v := &attribute.Verdict{Stage: "index_score", Reference: matchOf("reference", "the reference's scores from the dumped inputs", score(ref), gpuScores), Exact: []string{}, Tried: []attribute.Match{}}
	for _, h := range variants {
		mt := matchOf(h.name, h.desc, score(h.iq()), gpuScores)
		v.Tried = append(v.Tried, mt)
		if mt.Exact {
			v.Exact = append(v.Exact, h.name)
		}
	}
	for i := range v.Tried {
		mt := &v.Tried[i]
		if mt.Exact {
			v.Best = mt
			break
		}
		if mt.Differ < v.Reference.Differ && (v.Best == nil || mt.Differ < v.Best.Differ) {
			v.Best = mt
		}
	}
	return v
}

// matchOf is attribute's distance of a to the GPU's b (bits, then bf16 ulps).
func matchOf(name, desc string, a, b engine.Tensor) attribute.Match {
	m := attribute.Match{Name: name, Desc: desc, N: len(b.F)}
	if len(a.F) != len(b.F) {
		m.Skip = "shape differs"
		return m
	}
	worst := -1
	for i := range a.F {
		if math.Float32bits(a.F[i]) == math.Float32bits(b.F[i]) {
			continue
		}
		m.Differ++
		if u := quant.BF16ULPDistance(a.F[i], b.F[i]); worst < 0 || u > m.MaxULP {
			m.MaxULP, worst = u, i
		}
	}
	if worst >= 0 {
		m.At = engine.Coord(b.Shape, worst)
	}
	m.Exact = m.Differ == 0
	return m
}

// selectionBothWays is the second judgement of index_score (see above): it
// returns the sentence of a divergence, "" when the GPU's selection is a
// valid top-k of the reference's scores (or when the dump lacks what is
// needed: index_topk, or in local mode cq, x and icache). ref are the
// reference's scores (nil in local mode: recomputed here).
func selectionBothWays(m *engine.Model, src Source, ctx *engine.StepContext, defs []engine.StageDef, ref []float32, gpuScores engine.Tensor, tol *Tolerance) (string, error) {
	if m.Cfg.V32() {
		return "", nil // the V4 indexer's score forms; V3.2 judges its fp32 scores directly
	}
	sel, ok, err := src.Stage(ctx.Pos, ctx.Layer, "index_topk")
	if err != nil || !ok || sel.Kind.IsFloat() {
		return "", err
	}
	var rs indexer.RefSelection
	var k int
	if !gpuScores.Kind.IsFloat() {
		return "", nil
	}
	if ref == nil {
		// The reference's scores from the dumped indexer inputs: its query
		// chain from cq, its head weights from x, the dumped keys.
		_, vals, ok, err := refScoresLocal(m, src, ctx, defs)
		if err != nil || !ok {
			return "", err
		}
		ix, ic := ctx.W.Indexer, vals["icache"]
		k = min(m.Cfg.IndexTopK, ic.Shape[0])
		if len(gpuScores.F) != ic.Shape[0] {
			return "", nil
		}
		rs = indexer.CheckSelectionRef(sel.I, gpuScores.F, vals["iq"].F, ic.F, vals["iw"].F, ix.NHeads, ix.HeadDim, k)
	} else {
		k = min(m.Cfg.IndexTopK, len(ref))
		if len(gpuScores.F) != len(ref) {
			return "", nil
		}
		rs = indexer.JudgeSelectionRef(sel.I, gpuScores.F, ref, k)
	}
	if indexer.CompareSelection(sel.I, gpuScores.F, k).Verdict == indexer.Diverged {
		// Not even a top-k of the GPU's own scores: index_topk's own
		// judgement names that, at its stage.
		return "", nil
	}
	return selectionVsRef(rs, k, tol.For("index_score").allowedULP(m.GPURope)), nil
}

// selectionWhyMark is the start of selectionVsRef's sentence, how Diagnose
// recognises a divergence of index_score found by the selection check.
const selectionWhyMark = "matches its own index scores, but with the reference's scores"

// markSelection turns the result of index_score into a failure for the
// selection sentence why (appended when the stage had failed already).
func markSelection(sr *StageResult, why string) {
	if sr.Status == StatusFail && sr.Reason != "" {
		sr.Reason += "; " + why
	} else {
		sr.Reason = why
	}
	sr.Status = StatusFail
	sr.Severity = max(sr.Severity, 1)
}

// diagnoseScoreSelection explains an index_score divergence found by the
// selection check, with the query-path hypotheses.
func diagnoseScoreSelection(d DiagnoseInput, div *Divergence) {
	div.Kind = KindIndexScore
	div.Why = d.Result.Reason
	ctx := &engine.StepContext{Cfg: d.Model.Cfg, Layer: d.Result.Layer, Pos: d.Result.Step, W: d.Model.Weights[d.Result.Layer], Rope: d.Model.Rope[d.Result.Layer]}
	_, vals, ok, err := refScoresLocal(d.Model, d.Src, ctx, engine.Stages(d.Model.Cfg, ctx.Layer, ctx.Pos))
	if err != nil || !ok {
		return
	}
	roped, has, _ := d.Src.Stage(ctx.Pos, ctx.Layer, "iq_roped")
	if !has {
		roped = vals["iq_roped"]
	}
	if v := queryHypotheses(ctx, vals, roped, d.GPU); v != nil {
		d.hyp, div.Hypothesis = v, v
		if t := v.Text(); t != "" {
			div.Why += "; " + t
		}
	}
}
