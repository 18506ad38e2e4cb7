package engine

import (
	"slices"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// V41Hypothesis is a known alternative computation of one V4.1 stage — a
// V4 habit or an engine variant — that a replay tries on a divergent stage:
// when it reproduces the dumped value bit for bit from the same inputs, the
// divergence is named by it.
type V41Hypothesis struct {
	Name, Why string
	Compute   func(ctx *V41Context, in map[string]Tensor) (Tensor, error)
}

// V41Hypotheses lists the alternatives of a stage (nil: none). Layer-level
// alternatives (the owner index keys) are options of V41Step, not listed here.
func V41Hypotheses(stage string) []V41Hypothesis {
	if h := v41BlockHypotheses(stage); h != nil {
		return h
	}
	switch stage {
	case "topk_idxs":
		return []V41Hypothesis{{"v4-window-order", "the window list in V4's order: valid slots first, the −1 of a filling ring LAST (V4.1 puts them first)",
			func(c *V41Context, in map[string]Tensor) (Tensor, error) {
				t, err := v41TopkIdxs(c, in)
				if err != nil {
					return t, err
				}
				win := attention.WindowIdx(c.Pos, c.Cfg.WindowSize)
				for i, v := range win {
					t.I[i] = int64(v)
				}
				return t, nil
			}}}
	case "kv":
		return []V41Hypothesis{
			{"v4-window-fq8", "the window K quantised as V4 does: FQ8 of the nope dims in blocks of 64, the rope dims left bf16 (V4.1: all dims, blocks of 32)",
				func(c *V41Context, in map[string]Tensor) (Tensor, error) {
					k, err := inF(in, "kv_roped", c.Cfg.HeadDim)
					if err != nil {
						return Tensor{}, err
					}
					y := append([]float32(nil), k...)
					quant.FQ8(y[:c.Cfg.HeadDim-attention.RopeDims], 64)
					return bf16T(y, len(y)), nil
				}},
			{"window-k-not-quantised", "the window K stored without its FP8 fake quantisation",
				func(c *V41Context, in map[string]Tensor) (Tensor, error) {
					k, err := inF(in, "kv_roped", c.Cfg.HeadDim)
					return bf16T(append([]float32(nil), k...), c.Cfg.HeadDim), err
				}}}
	case "cmp_row":
		return []V41Hypothesis{
			{"kv-fp4-ue8m0", "the compressed row as FP4 with power-of-two (UE8M0) scales per 32, the index keys' rule (V4.1: E4M3 scales per 16)",
				func(c *V41Context, in map[string]Tensor) (Tensor, error) {
					r, err := inF(in, "cmp_roped", c.Cfg.HeadDim)
					if err != nil {
						return Tensor{}, err
					}
					y := append([]float32(nil), r...)
					quant.FQ4(y, 32)
					return bf16T(y, len(y)), nil
				}},
			{"v4-kv-fq8", "the compressed row quantised as V4 does: FQ8 of the nope dims in blocks of 64 (V4.1: FP4 with E4M3 scales)",
				func(c *V41Context, in map[string]Tensor) (Tensor, error) {
					r, err := inF(in, "cmp_roped", c.Cfg.HeadDim)
					if err != nil {
						return Tensor{}, err
					}
					y := append([]float32(nil), r...)
					quant.FQ8(y[:c.Cfg.HeadDim-attention.RopeDims], 64)
					return bf16T(y, len(y)), nil
				}}}
	case "q":
		return []V41Hypothesis{{"v4-head-rms", "V4's per-head RMS normalisation of q applied (V4.1 has none)",
			func(c *V41Context, in map[string]Tensor) (Tensor, error) {
				qb, err := inF(in, "q_b", c.Cfg.NHeads*c.Cfg.HeadDim)
				if err != nil {
					return Tensor{}, err
				}
				q := append([]float32(nil), qb...)
				attention.HeadRMS(q, c.Cfg.HeadDim, 1e-6)
				c.Rope.RopeLast(q, c.Cfg.HeadDim, c.Pos, false)
				return bf16T(q, c.Cfg.NHeads, c.Cfg.HeadDim), nil
			}}}
	case "index_sel":
		return []V41Hypothesis{{"topk-off-by-one", "the top-k's k-th best row j replaced by its neighbour j+1 (j−1 at the last row)",
			func(c *V41Context, in map[string]Tensor) (Tensor, error) {
				name := "index_score"
				if _, ok := in["index_score_masked"]; ok {
					name = "index_score_masked"
				}
				tc := attention.VisibleRows(c.Pos, c.W.Ratio)
				sc, err := inF(in, name, tc)
				if err != nil {
					return Tensor{}, err
				}
				k := min(c.Cfg.IndexTopK, tc)
				top, _ := indexer.TopK(sc, k)
				sel := slices.Clone(top)
				if j := sel[k-1]; int(j)+1 < tc {
					sel[k-1] = j + 1
				} else {
					sel[k-1] = j - 1
				}
				slices.Sort(sel)
				for i := range sel {
					sel[i] += int64(c.Cfg.WindowSize)
				}
				return FromI(KindI32, sel, len(sel)), nil
			}}}
	case "o":
		return []V41Hypothesis{{"unguarded-empty-chunk", "the attention kernel run over a leading chunk of 64 entries that holds no key (−1 padding first) without a guard: exp(−∞ − (−∞)) = NaN",
			func(c *V41Context, in map[string]Tensor) (Tensor, error) {
				H, D := c.Cfg.NHeads, c.Cfg.HeadDim
				q, err := inF(in, "q", H*D)
				if err != nil {
					return Tensor{}, err
				}
				kv, _, err := inRows(in, "kv_cache", D)
				if err != nil {
					return Tensor{}, err
				}
				idx64, err := inI(in, "topk_idxs")
				if err != nil {
					return Tensor{}, err
				}
				idx := make([]int32, len(idx64))
				for i, v := range idx64 {
					idx[i] = int32(v)
				}
				o := make([]float32, H*D)
				attention.SparseAttn(o, q, kv, D, idx, c.W.AttnSink, c.Cfg.SoftmaxScale())
				return bf16T(o, H, D), nil
			}}}
	}
	return nil
}
