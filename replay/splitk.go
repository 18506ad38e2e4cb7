package replay

import (
	"fmt"
	"math"
	"strings"

	"sparsemla/attention"
	"sparsemla/engine"
)

// SplitBounds is attention.HalfSplit on an int64 index list: the two split-K
// pieces synth dumps, [0, h) and [h, len) where h is the list position after
// which half of the valid (non −1) entries have been seen, so both splits hold
// keys. nil when fewer than two entries are valid.
func SplitBounds(idx []int64) []int64 {
	i32 := make([]int32, len(idx))
	for i, v := range idx {
		switch {
		case v < 0:
			i32[i] = -1 // invalid, whatever its value
		case v > math.MaxInt32:
			i32[i] = math.MaxInt32 // valid: only v >= 0 counts
		default:
			i32[i] = int32(v)
		}
	}
	return attention.HalfSplit(i32)
}

// SplitPartials computes the split-K partials of sparse attention over the
// pieces topk_idxs[bounds[s]:bounds[s+1]] (attention.SparseAttnPartial:
// FlashMLA's per-split output and base-2 LSE, no sink).
func SplitPartials(cfg *engine.Config, q, kv, idx engine.Tensor, bounds []int64) []attention.Partial {
	var parts []attention.Partial
	for s := 0; s+1 < len(bounds); s++ {
		sub := make([]int32, 0, bounds[s+1]-bounds[s])
		for _, v := range idx.I[bounds[s]:bounds[s+1]] {
			sub = append(sub, int32(v))
		}
		parts = append(parts, attention.SparseAttnPartial(q.F, kv.F, cfg.HeadDim, sub, cfg.SoftmaxScale()))
	}
	return parts
}

// isSplitStage reports whether name is one of the split-K records a dump may
// hold beside o (split_bounds, o_split/<s>, lse_split/<s>).
func isSplitStage(name string) bool {
	return name == "split_bounds" || strings.HasPrefix(name, "o_split/") || strings.HasPrefix(name, "lse_split/")
}

// splitResults judges the split-K records the dump holds beside o at (p, l):
// split_bounds must cover the index list (0 … len, ascending), and each
// split's o_split/<s> and lse_split/<s> is compared with the reference's
// partial over that split, computed from q, kv_cache and topk_idxs (the
// dumped values in local mode, the chain's own in propagated mode) with the
// tolerances of o and lse. Nothing when the dump holds no split_bounds.
func splitResults(cfg *engine.Config, src Source, p int64, l int, q, kv, idx engine.Tensor, tol *Tolerance, gpuRope bool) ([]StageResult, error) {
	bt, ok, err := src.Stage(p, l, "split_bounds")
	if err != nil || !ok {
		return nil, err
	}
	inputs := []InputInfo{{Name: "q", From: FromDump, Status: "unchecked"}, {Name: "kv_cache", From: FromDump, Status: "unchecked"}, {Name: "topk_idxs", From: FromDump, Status: "unchecked"}}
	br := StageResult{Step: p, Layer: l, Stage: "split_bounds", Equation: "split_bounds = 0 = b_0 ≤ b_1 ≤ … ≤ b_S = len(topk_idxs): the split-K pieces of the index list", Tol: string(TolExact), Shape: bt.Shape, GPUShape: bt.Shape, Inputs: inputs}
	valid := !bt.Kind.IsFloat() && len(bt.I) >= 2 && bt.I[0] == 0 && bt.I[len(bt.I)-1] == int64(len(idx.I))
	for i := 1; valid && i < len(bt.I); i++ {
		valid = bt.I[i] >= bt.I[i-1]
	}
	if !valid || !q.Kind.IsFloat() || !kv.Kind.IsFloat() || idx.Kind.IsFloat() {
		br.Status, br.Severity = StatusFail, 2
		br.Reason = fmt.Sprintf("split_bounds %v do not cover the %d-entry index list (0 … %d, ascending)", bt.I, len(idx.I), len(idx.I))
		return []StageResult{br}, nil
	}
	br.Status = StatusPass
	out := []StageResult{br}
	H, D := cfg.NHeads, cfg.HeadDim
	for s, pt := range SplitPartials(cfg, q, kv, idx, bt.I) {
		for _, c := range []struct {
			name string
			ref  engine.Tensor
			tol  StageTol
		}{
			{fmt.Sprintf("o_split/%d", s), engine.FromF(engine.KindF32, pt.O, H, D), tol.For("o")},
			{fmt.Sprintf("lse_split/%d", s), engine.FromF(engine.KindF32, pt.LSE2, H), tol.For("lse")},
		} {
			gpu, ok, err := src.Stage(p, l, c.name)
			if err != nil {
				return nil, err
			}
			sr := StageResult{Step: p, Layer: l, Stage: c.name, Shape: c.ref.Shape, Inputs: inputs,
				Equation: fmt.Sprintf("split %d of the index list (entries %d..%d): FlashMLA's partial (output normalised by its own sum, base-2 LSE, no sink)", s, bt.I[s], bt.I[s+1]-1)}
			if !ok {
				sr.Status = StatusMissing
				out = append(out, sr)
				continue
			}
			JudgeStage(&sr, c.ref, gpu, nil, c.tol, JudgeContext{GPURope: gpuRope, Window: cfg.WindowSize})
			out = append(out, sr)
		}
	}
	return out, nil
}
