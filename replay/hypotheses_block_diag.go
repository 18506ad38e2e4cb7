// The diagnosis hypotheses of the stages around the attention sub-layer (split/Sinkhorn, hc_post, router, experts), tried by diagnoseBlock.

package replay

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"sparsemla/engine"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// hcSplitHypotheses tries hc_split_sinkhorn with another number of Sinkhorn
// iterations, pre without its eps and post without its factor 2.
func hcSplitHypotheses(d DiagnoseInput) string {
	b := blockWeights(d)
	stage := d.Result.Stage
	side := "attn"
	if strings.HasPrefix(stage, "hc_ffn_") {
		side = "ffn"
	}
	mixes, ok := d.In["hc_"+side+"_mixes"]
	if b == nil || !ok {
		return ""
	}
	s := b.AttnSite
	if side == "ffn" {
		s = b.FFNSite
	}
	cfg := d.Model.Cfg
	hc := cfg.HCMult
	part := stage[strings.LastIndex(stage, "_")+1:]
	split := func(iters int, eps float32) (pre, post, comb []float32) {
		pre, post, comb = make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
		mhc.SplitSinkhorn(pre, post, comb, mixes.F, s.Scale, s.Base, hc, iters, eps)
		return
	}
	eps := float32(cfg.HCEps)
	switch part {
	case "comb":
		for _, it := range []int{1, 2, 3, 5, 10, 19, 21, 30, 40} {
			if it == cfg.HCSinkhornIters {
				continue
			}
			_, _, comb := split(it, eps)
			if matches(d, engine.FromF(engine.KindF32, comb, hc, hc)) {
				return fmt.Sprintf("%s: the GPU's comb is the reference's after %d Sinkhorn iterations (the config's hc_sinkhorn_iters is %d)", d.Result.Reason, it, cfg.HCSinkhornIters)
			}
		}
		_, _, comb := split(cfg.HCSinkhornIters, eps)
		tr := mhc.Transpose(comb, hc)
		if matches(d, engine.FromF(engine.KindF32, tr, hc, hc)) {
			return d.Result.Reason + ": the GPU's comb is the reference's transposed (rows and columns swapped: the last normalisation ran over the other axis)"
		}
	case "pre":
		pre, _, _ := split(cfg.HCSinkhornIters, 0)
		if matches(d, engine.FromF(engine.KindF32, pre, hc)) {
			return d.Result.Reason + ": the GPU's pre is sigmoid(·) without the + hc_eps"
		}
	case "post":
		_, post, _ := split(cfg.HCSinkhornIters, eps)
		for i := range post {
			post[i] /= 2
		}
		if matches(d, engine.FromF(engine.KindF32, post, hc)) {
			return d.Result.Reason + ": the GPU's post is sigmoid(·) without the factor 2"
		}
	}
	return ""
}

// hcPostHypotheses tries hc_post with comb transposed, without post, and
// with the residual unmixed (h_j + post_j·a).
func hcPostHypotheses(d DiagnoseInput) string {
	cfg := d.Model.Cfg
	hc, dim := cfg.HCMult, cfg.Dim
	side, res, sub := "attn", "h_in", "y"
	if d.Result.Stage == "h_out" {
		side, res, sub = "ffn", "h_mid", "ffn_out"
	}
	a, h, post, comb := d.In[sub], d.In[res], d.In["hc_"+side+"_post"], d.In["hc_"+side+"_comb"]
	if hc == 0 || len(a.F) != dim || len(h.F) != hc*dim || len(post.F) != hc || len(comb.F) != hc*hc {
		return "" // hc == 0: no hyper-connections (V3.2's h_mid = y + x_in on layer 0)
	}
	try := func(post, comb []float32) bool {
		out := make([]float32, hc*dim)
		mhc.Post(out, a.F, h.F, post, comb)
		return matches(d, engine.FromF(engine.KindBF16, out, hc, dim))
	}
	if try(post.F, mhc.Transpose(comb.F, hc)) {
		return fmt.Sprintf("%s: the GPU mixed the residual streams with comb transposed (out_j = post_j·%s + Σ_k comb[j][k]·h_k instead of comb[k][j])", d.Result.Reason, sub)
	}
	ones := make([]float32, hc)
	for i := range ones {
		ones[i] = 1
	}
	if try(ones, comb.F) {
		return fmt.Sprintf("%s: the GPU added %s to every stream without the post weights", d.Result.Reason, sub)
	}
	eye := make([]float32, hc*hc)
	for j := 0; j < hc; j++ {
		eye[j*hc+j] = 1
	}
	if try(post.F, eye) {
		return d.Result.Reason + ": the GPU kept each residual stream unmixed (comb ignored: out_j = post_j·a + h_j)"
	}
	return ""
}

// routerIndicesHypotheses names a wrong routing: the hash table lookup, the
// bias left out of (or kept in) the selection, the right experts in another
// order, or a tie at the k-th place.
func routerIndicesHypotheses(d DiagnoseInput) string {
	b := blockWeights(d)
	x, ok := d.In["ffn_in"]
	if b == nil || !ok || d.GPU.Kind.IsFloat() {
		return ""
	}
	g := &b.MoE.Gate
	gpu := d.GPU.I
	for _, e := range gpu {
		if e < 0 || e >= int64(g.Experts) {
			return fmt.Sprintf("the GPU's experts %v name %d, which is not an expert id (0 … %d)", gpu, e, g.Experts-1)
		}
	}
	if g.Hash() {
		tok, err := inTokOf(d)
		if err != nil {
			return ""
		}
		k := int64(g.TopK)
		vocab := int64(len(g.TID2EID)) / k
		if tok < 0 || tok >= vocab {
			return ""
		}
		want := g.TID2EID[tok*k : (tok+1)*k]
		row := func(t int64) bool { return t >= 0 && t < vocab && t != tok && sameIDs(g.TID2EID[t*k:(t+1)*k], gpu) }
		var rows []int64
		for t := int64(0); t < vocab; t++ {
			if row(t) {
				rows = append(rows, t)
			}
		}
		for _, off := range []int64{+1, -1} {
			if row(tok + off) {
				also := ""
				if len(rows) > 1 {
					also = fmt.Sprintf("; %d other rows of tid2eid hold the same experts (the neighbour row is the likely read)", len(rows)-1)
				}
				return fmt.Sprintf("the GPU's experts %v are tid2eid[%d], the row of token id %d%+d, not tid2eid[%d] = %v of the token fed (layer < n_hash_layers routes by tid2eid[tok])%s", gpu, tok+off, tok, off, tok, want, also)
			}
		}
		if len(rows) > 0 {
			return fmt.Sprintf("the GPU's experts %v are tid2eid[%d] (and %d other rows), not tid2eid[%d] = %v of the token fed (a token id off or another request's)", gpu, rows[0], len(rows)-1, tok, want)
		}
		sel, _ := moe.TopK(scoresOf(g, x.F), g.TopK)
		if sameIDs(sel, gpu) {
			return fmt.Sprintf("layer < n_hash_layers routes by tid2eid[tok], but the GPU chose the top-%d of the scores %v instead of tid2eid[%d] = %v", g.TopK, gpu, tok, want)
		}
		return fmt.Sprintf("the GPU's experts %v are not tid2eid[%d] = %v (layer < n_hash_layers routes by tid2eid[tok]); no other row of tid2eid holds them", gpu, tok, want)
	}
	s := scoresOf(g, x.F)
	sel := make([]float32, len(s))
	for e, v := range s {
		sel[e] = v + g.Bias[e]
	}
	ref, tie := moe.TopK(sel, g.TopK)
	if sameSet(ref, gpu) {
		return fmt.Sprintf("the GPU chose the same experts %v in another order than descending score (the reference's %v): the weights follow the order", gpu, ref)
	}
	if noBias, _ := moe.TopK(s, g.TopK); sameSet(noBias, gpu) {
		return fmt.Sprintf("the GPU's experts %v are the top-%d of the scores WITHOUT the selection bias (the reference's, with it: %v)", gpu, g.TopK, ref)
	}
	// Near ties were judged before (routerNearTie: not a divergence); what
	// reaches here chose at least one expert clearly outside the boundary.
	kth := sel[ref[len(ref)-1]]
	var far []string
	for _, e := range gpu {
		if !slices.Contains(ref, int32(e)) {
			far = append(far, fmt.Sprintf("%d (score + bias %v)", e, sel[e]))
		}
	}
	tieNote := ""
	if tie {
		tieNote = " (the k-th place ties, but not with these)"
	}
	return fmt.Sprintf("the GPU's experts %v are not the top-%d of score + bias (the reference's %v): it chose %s below the k-th %v by more than the tie margin %g (relative), not a boundary tie%s; score + bias %v",
		gpu, g.TopK, ref, strings.Join(far, ", "), kth, routerTieRel, tieNote, sel)
}

// routerWeightsHypotheses tries the weight rule without its normalisation,
// without route_scale, and with the bias added.
func routerWeightsHypotheses(d DiagnoseInput) string {
	b := blockWeights(d)
	x, okX := d.In["ffn_in"]
	idxT, okI := d.In["moe_indices"]
	if b == nil || !okX || !okI {
		return ""
	}
	g := &b.MoE.Gate
	idx := make([]int32, len(idxT.I))
	for i, e := range idxT.I {
		if e < 0 || e >= int64(g.Experts) {
			return ""
		}
		idx[i] = int32(e)
	}
	s := scoresOf(g, x.F)
	try := func(w []float32) bool { return matches(d, engine.FromF(engine.KindF32, w, len(w))) }
	if try(moe.RouteWeights(s, idx, moe.Softmax, g.RouteScale)) && g.Func != moe.Softmax {
		return fmt.Sprintf("%s: the GPU's weights are the chosen scores × route_scale without dividing by their sum (%s gates normalise)", d.Result.Reason, g.Func)
	}
	if try(moe.RouteWeights(s, idx, g.Func, 1)) && g.RouteScale != 1 {
		return fmt.Sprintf("%s: the GPU's weights lack the factor route_scale = %g", d.Result.Reason, g.RouteScale)
	}
	if g.Bias != nil {
		sb := make([]float32, len(s))
		for e, v := range s {
			sb[e] = v + g.Bias[e]
		}
		if try(moe.RouteWeights(sb, idx, g.Func, g.RouteScale)) {
			return d.Result.Reason + ": the GPU weighted the experts by score + bias (the bias is for the choice only)"
		}
	}
	return ""
}

// expertHypotheses recomputes ffn_out under the expert bugs a GPU kernel
// plausibly has: nibble order, a missing or extra clamp, the shared expert
// left out, one routed expert left out.
func expertHypotheses(d DiagnoseInput) string {
	b := blockWeights(d)
	x, okX := d.In["ffn_in"]
	idxT, okI := d.In["moe_indices"]
	wT, okW := d.In["moe_weights"]
	if b == nil || !okX || !okI || !okW || len(idxT.I) != len(wT.F) {
		return ""
	}
	m := *b.MoE
	idx := make([]int32, len(idxT.I))
	for i, e := range idxT.I {
		if e < 0 || e >= int64(m.Gate.Experts) {
			return ""
		}
		idx[i] = int32(e)
	}
	dim := len(x.F)
	try := func(mm *moe.MoE, indices []int32, weights []float32) bool {
		out, err := mm.Combine(x.F, indices, weights)
		return err == nil && matches(d, engine.FromF(engine.KindBF16, out, dim))
	}
	reason := d.Result.Reason
	// FP4 nibble order: the even column read from the high nibble.
	sw := m
	sw.Experts = make([]*moe.Expert, m.Gate.Experts)
	sw.Source = nil
	for _, e := range idx {
		ex, err := expertOf(&m, int(e))
		if err != nil {
			return ""
		}
		sw.Experts[e] = &moe.Expert{W1: swapNibbles(ex.W1), W2: swapNibbles(ex.W2), W3: swapNibbles(ex.W3)}
	}
	if try(&sw, idx, wT.F) {
		return fmt.Sprintf("%s: the GPU's routed experts (%v) read their FP4 weights with the nibbles swapped (even column from the HIGH nibble; float4_e2m1fn_x2 keeps it in the low one)", reason, idx)
	}
	if m.SwigluLimit > 0 {
		nc := m
		nc.SwigluLimit = 0
		if try(&nc, idx, wT.F) {
			return fmt.Sprintf("%s: the GPU's routed experts skip the swiglu_limit clamp (up to ±%g, gate ≤ %g)", reason, m.SwigluLimit, m.SwigluLimit)
		}
		if out, ok := sharedClamped(&m, x.F, idx, wT.F); ok && matches(d, engine.FromF(engine.KindBF16, out, dim)) {
			return fmt.Sprintf("%s: the GPU clamps the shared expert too (swiglu_limit %g; the release-day model.py applies it to routed experts only)", reason, m.SwigluLimit)
		}
	}
	ns := m
	ns.Shared = nil
	if try(&ns, idx, wT.F) {
		return reason + ": the GPU's ffn_out lacks the shared expert"
	}
	for t := range idx {
		rest := slices.Delete(slices.Clone(idx), t, t+1)
		restW := slices.Delete(slices.Clone(wT.F), t, t+1)
		if try(&m, rest, restW) {
			return fmt.Sprintf("%s: the GPU's ffn_out lacks routed expert %d (slot %d, weight %g)", reason, idx[t], t, wT.F[t])
		}
	}
	return ""
}

func expertOf(m *moe.MoE, e int) (*moe.Expert, error) {
	if e < len(m.Experts) && m.Experts[e] != nil {
		return m.Experts[e], nil
	}
	if m.Source != nil {
		return m.Source.Expert(e)
	}
	return nil, fmt.Errorf("expert %d has no weights", e)
}

// swapNibbles returns w with the two codes of every byte exchanged.
func swapNibbles(w *moe.FP4Weight) *moe.FP4Weight {
	p := make([]uint8, len(w.Packed))
	for i, b := range w.Packed {
		p[i] = b<<4 | b>>4
	}
	return &moe.FP4Weight{Rows: w.Rows, Cols: w.Cols, Packed: p, Scale: w.Scale}
}

// sharedClamped is ffn_out with the shared expert clamped like a routed one
// (false: no shared expert, or a routing or expert Combine refuses).
func sharedClamped(m *moe.MoE, x []float32, idx []int32, w []float32) ([]float32, bool) {
	if m.Shared == nil {
		return nil, false
	}
	out, err := m.CombineWith(x, idx, w, func(out, x []float32) { m.Shared.ForwardClamped(out, x, m.SwigluLimit) })
	return out, err == nil
}

func scoresOf(g *moe.Gate, x []float32) []float32 {
	s := make([]float32, g.Experts)
	g.Scores(s, x)
	return s
}

func inTokOf(d DiagnoseInput) (int64, error) {
	t, ok := d.In[engine.GlobalPrefix+"tok"]
	if !ok || len(t.I) != 1 {
		return 0, fmt.Errorf("no token")
	}
	return t.I[0], nil
}

func sameIDs(a []int32, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if int64(a[i]) != b[i] {
			return false
		}
	}
	return true
}

func sameSet(a []int32, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for _, v := range a {
		if !slices.Contains(b, int64(v)) {
			return false
		}
	}
	return true
}

// routerTieRel is how close (relative) two experts' score + bias must be for
// the router's choice between them to count as a tie: the gate is an fp32
// GEMV whose summation order differs on the GPU (measured: the scores agree
// to ~2 fp32 ulps on the tiny golden; a 4096-wide gate sums 16× more terms).
const routerTieRel = 1e-5

// RouterNearTie is the replay's tie rule for moe_indices (routerNearTie)
// for one layer's weights w: sr (a judged moe_indices result) becomes a tie
// when the GPU's experts differ from the reference's ref only among near-
// equal candidates. Fault injection uses it so that a router fault is never
// placed where a replay would rightly call it a tie.
func RouterNearTie(sr *StageResult, cfg *engine.Config, layer int, w *engine.LayerWeights, in map[string]engine.Tensor, ref, gpu engine.Tensor) {
	routerNearTie(sr, &engine.Model{Cfg: cfg, Weights: map[int]*engine.LayerWeights{layer: w}}, layer, in, ref, gpu)
}

// routerNearTie turns a failed moe_indices comparison into a tie when the
// GPU's experts differ from the reference's only among experts whose score
// + bias lie within routerTieRel of the k-th selected one: which of nearly
// equal candidates the top-k keeps depends on the last bits of an fp32 GEMV,
// so both choices are legal (the weights then follow the GPU's choice). The
// same set in another order, a hash layer, or a gap larger than that stays
// a divergence.
func routerNearTie(sr *StageResult, m *engine.Model, layer int, in map[string]engine.Tensor, ref, gpu engine.Tensor) {
	if sr.Stage != "moe_indices" || sr.Status != StatusFail || gpu.Kind.IsFloat() || len(gpu.I) != len(ref.I) {
		return
	}
	if m.Cfg.V32() {
		v32RouterNearTie(sr, m, layer, in, ref, gpu) // the grouped router (v32.go)
		return
	}
	w := m.Weights[layer]
	x, ok := in["ffn_in"]
	if w == nil || w.Block == nil || !ok {
		return
	}
	g := &w.Block.MoE.Gate
	if g.Hash() || g.Bias == nil || len(x.F) != g.Dim {
		return
	}
	for _, e := range gpu.I {
		if e < 0 || e >= int64(g.Experts) {
			return
		}
	}
	s := scoresOf(g, x.F)
	sel := make([]float32, len(s))
	for e, v := range s {
		sel[e] = v + g.Bias[e]
	}
	kth := sel[ref.I[len(ref.I)-1]]
	near := func(e int64) bool {
		d := float64(sel[e]) - float64(kth)
		return math.Abs(d) <= routerTieRel*max(math.Abs(float64(kth)), 1e-30)
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
	for _, e := range append(onlyGPU, onlyRef...) {
		if !near(e) {
			return
		}
	}
	sr.Status, sr.Severity = StatusTie, 0.5
	sr.Reason = fmt.Sprintf("experts %v chosen instead of %v: their score + bias are within %g (relative) of the k-th (%v), a near tie the fp32 gate's summation order decides", onlyGPU, onlyRef, routerTieRel, kth)
}
