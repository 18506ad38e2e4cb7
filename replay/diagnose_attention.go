package replay

import (
	"fmt"
	"math"

	"sparsemla/attention"
	"sparsemla/engine"
)

// diagnoseAttention looks at o per head.
func diagnoseAttention(d DiagnoseInput, div *Divergence) {
	div.Kind = KindAttention
	ref, gpu := d.Ref, d.GPU
	if len(ref.Shape) != 2 || !engine.SameShape(ref.Shape, gpu.Shape) {
		div.Why = d.Result.Reason
		return
	}
	H, D := ref.Shape[0], ref.Shape[1]
	tol := DefaultTolerance().For(d.Result.Stage)
	var scaled, other []string
	for h := 0; h < H; h++ {
		r := engine.FromF(ref.Kind, ref.F[h*D:(h+1)*D], D)
		g := engine.FromF(gpu.Kind, gpu.F[h*D:(h+1)*D], D)
		m := CompareFloat(r, g, tol, true)
		if ok, _ := tol.Judge(m, true); ok {
			continue
		}
		div.Heads = append(div.Heads, h)
		if c, ok := rescaling(r.F, g.F); ok {
			scaled = append(scaled, fmt.Sprintf("head %d = %.6g × reference", h, c))
		} else {
			other = append(other, fmt.Sprintf("head %d cos_diff %.3g, max abs %.3g", h, m.CosDiff, m.MaxAbs))
		}
	}
	inputs := inputsPhrase(d.Result.Inputs)
	if line := indexListSummary(d); line != "" {
		div.Detail = append(div.Detail, line)
	}
	if h := exactHypothesis(d.hyp); h != "" && len(div.Heads) > 0 {
		// A known alternative computation reproduces the GPU's o bit for
		// bit from the same inputs: that is the diagnosis.
		why := fmt.Sprintf("%s, but heads %v differ", inputs, div.Heads)
		if len(other) == 0 && len(scaled) > 0 {
			why += " and are the reference output times a constant"
		}
		if sw, lines, ok := diagnoseSplits(d, div.Heads); ok {
			why += "; " + sw
			div.Detail = append(div.Detail, lines...)
		}
		div.Why = why + "; " + d.hyp.Text()
		div.Detail = append(div.Detail, append(other, scaled...)...)
		return
	}
	if why, lines, ok := diagnoseSplits(d, div.Heads); ok {
		div.Detail = append(div.Detail, lines...)
		if len(scaled) > 0 && len(other) == 0 {
			why += fmt.Sprintf("; heads %v are the reference times a constant: the combine's LSE or sink term is wrong", div.Heads)
			div.Detail = append(div.Detail, scaled...)
		} else {
			div.Detail = append(div.Detail, other...)
			div.Detail = append(div.Detail, scaled...)
		}
		div.Why = inputs + "; " + why
		return
	}
	switch {
	case len(div.Heads) == 0:
		div.Why = inputs + "; " + d.Result.Reason
	case len(other) == 0:
		div.Why = fmt.Sprintf("%s, but heads %v are the reference output times a constant: a normalisation error (wrong LSE or sink term in the softmax denominator / split-K combine)", inputs, div.Heads)
		div.Detail = scaled
	default:
		div.Why = fmt.Sprintf("%s, but heads %v differ and are not a rescaling of the reference, and no known alternative (split-K merges, bf16 logits or softmax, -1 entries read as rows, …) reproduces them: a split-K combine error, keys read from other rows, or another softmax", inputs, div.Heads)
		div.Detail = append(other, scaled...)
	}
}

// rescaling reports whether g ≈ c·r for one constant c ≠ 1 (to bf16 accuracy).
func rescaling(r, g []float32) (float64, bool) {
	var rg, rr float64
	for i := range r {
		rg += float64(r[i]) * float64(g[i])
		rr += float64(r[i]) * float64(r[i])
	}
	if rr == 0 {
		return 0, false
	}
	c := rg / rr
	if math.Abs(c-1) < 1e-3 {
		return c, false
	}
	var res, gg float64
	for i := range r {
		e := float64(g[i]) - c*float64(r[i])
		res += e * e
		gg += float64(g[i]) * float64(g[i])
	}
	return c, gg > 0 && res/gg < 1e-4
}

// diagnoseSplits uses split-K partials the dump holds beside o (stages
// split_bounds [S+1] = offsets into topk_idxs, o_split/<s> [H, D] and
// lse_split/<s> [H], FlashMLA's per-split output and base-2 LSE without the
// sink): each split is recomputed from the dumped q, kv_cache and its slice of
// the index list; if every split matches, the GPU's partials are merged the
// reference way (attention.MergePartials) to tell a combine bug from a split
// bug. ok is false when the dump has no partials.
func diagnoseSplits(d DiagnoseInput, heads []int) (why string, lines []string, ok bool) {
	p, l := d.Result.Step, d.Result.Layer
	bt, has, err := d.Src.Stage(p, l, "split_bounds")
	if err != nil || !has || bt.Kind.IsFloat() || len(bt.I) < 2 {
		return "", nil, false
	}
	q, okq := d.In["q"]
	kv, okk := d.In["kv_cache"]
	idx, oki := d.In["topk_idxs"]
	if !okq || !okk || !oki {
		return "", nil, false
	}
	for i := 1; i < len(bt.I); i++ {
		if bt.I[i] < bt.I[i-1] || bt.I[0] != 0 || bt.I[len(bt.I)-1] != int64(len(idx.I)) {
			return "", []string{fmt.Sprintf("split_bounds %v do not cover the %d-entry index list", bt.I, len(idx.I))}, false
		}
	}
	cfg := d.Model.Cfg
	H, D := cfg.NHeads, cfg.HeadDim
	ref := SplitPartials(cfg, q, kv, idx, bt.I)
	gpuParts := make([]attentionPartial, len(ref))
	outTol := DefaultTolerance().For("o")
	lseTol := DefaultTolerance().For("lse")
	for s := range ref {
		o, ok1, _ := d.Src.Stage(p, l, fmt.Sprintf("o_split/%d", s))
		lse, ok2, _ := d.Src.Stage(p, l, fmt.Sprintf("lse_split/%d", s))
		if !ok1 || !ok2 || len(o.F) != H*D || len(lse.F) != H {
			return "", nil, false
		}
		gpuParts[s] = attentionPartial{O: o.F, LSE2: lse.F}
		mo := CompareFloat(engine.FromF(engine.KindF32, ref[s].O, H, D), engine.FromF(engine.KindF32, o.F, H, D), outTol, true)
		ml := CompareFloat(engine.FromF(engine.KindF32, ref[s].LSE2, H), engine.FromF(engine.KindF32, lse.F, H), lseTol, true)
		okO, whyO := outTol.Judge(mo, true)
		okL, whyL := lseTol.Judge(ml, true)
		if !okO || !okL {
			msg := fmt.Sprintf("split %d (index entries %d..%d) already differs:", s, bt.I[s], bt.I[s+1]-1)
			if !okO {
				msg += " partial output " + whyO
			}
			if !okL {
				msg += " partial LSE " + whyL
			}
			return msg + " — the split kernel, not the combine", lines, true
		}
		lines = append(lines, fmt.Sprintf("split %d (index entries %d..%d): partial output and LSE match the reference", s, bt.I[s], bt.I[s+1]-1))
	}
	// The reference o runs the kernel-faithful chunked softmax (P rounded
	// to bf16 for P·V); a merge of fp32 partials differs from it in the low
	// bits, so "reproduces o" means within tolerance or far closer to the
	// reference than the GPU's o is.
	merged := mergeGPUPartials(d, gpuParts)
	mm := CompareFloat(d.Ref, merged, outTol, true)
	okM, _ := outTol.Judge(mm, true)
	if gpuCos := CosDiff(d.Ref.F, d.GPU.F); okM || mm.CosDiff*100 < gpuCos {
		lines = append(lines, fmt.Sprintf("merged GPU partials vs reference o: cos_diff %.3g; GPU o vs reference o: cos_diff %.3g", mm.CosDiff, gpuCos))
		return fmt.Sprintf("every split-K partial matches the reference, and merging them the reference way gives the reference o, but the GPU's o differs in heads %v: the split-K combine (merge) is wrong", heads), lines, true
	}
	return "every split-K partial matches the reference, but merging them does not reproduce o: the index list was split differently from split_bounds", lines, true
}

// attentionPartial is attention.Partial (kept local to name its use here).
type attentionPartial = attention.Partial

// mergeGPUPartials merges dumped partials with the reference combine
// (attention.MergePartials: base-2 LSE, sink folded in) into a bf16 o.
func mergeGPUPartials(d DiagnoseInput, parts []attentionPartial) engine.Tensor {
	cfg := d.Model.Cfg
	o := make([]float32, cfg.NHeads*cfg.HeadDim)
	attention.MergePartials(o, parts, d.Model.Weights[d.Result.Layer].AttnSink, cfg.HeadDim)
	return engine.FromF(engine.KindBF16, o, cfg.NHeads, cfg.HeadDim)
}
