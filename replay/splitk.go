package replay

import (
	"sparsemla/attention"
	"sparsemla/engine"
)

// SplitBounds splits an index list into the two split-K pieces synth dumps:
// [0, h) and [h, len) where h is the list position after which half of the
// valid (non −1) entries have been seen, so both splits hold keys. nil when
// fewer than two entries are valid.
func SplitBounds(idx []int64) []int64 {
	valid := 0
	for _, v := range idx {
		if v >= 0 {
			valid++
		}
	}
	if valid < 2 {
		return nil
	}
	seen := 0
	for i, v := range idx {
		if v >= 0 {
			seen++
		}
		if seen == valid/2 {
			return []int64{0, int64(i + 1), int64(len(idx))}
		}
	}
	return nil
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
