// The stage computations of the DeepSeek-V4.1 attention sub-layer (V41Stages' Compute functions).

package engine

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// ---- stage computations ----

func v41QA(c *V41Context, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "x", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.QLoraRank)
	attention.V41FP8Linear(y, x, c.W.WqA)
	return bf16T(y, len(y)), nil
}

func v41CQ(c *V41Context, in map[string]Tensor) (Tensor, error) {
	qa, err := inF(in, "q_a", c.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(qa))
	attention.RMSNorm(y, qa, c.W.QNorm, float32(c.Cfg.NormEps))
	return bf16T(y, len(y)), nil
}

func v41QB(c *V41Context, in map[string]Tensor) (Tensor, error) {
	cq, err := inF(in, "cq", c.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.NHeads*c.Cfg.HeadDim)
	attention.V41FP8Linear(y, cq, c.W.WqB)
	return bf16T(y, c.Cfg.NHeads, c.Cfg.HeadDim), nil
}

func v41Q(c *V41Context, in map[string]Tensor) (Tensor, error) {
	qb, err := inF(in, "q_b", c.Cfg.NHeads*c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	q := append([]float32(nil), qb...)
	c.Rope.RopeLast(q, c.Cfg.HeadDim, c.Pos, false)
	return bf16T(q, c.Cfg.NHeads, c.Cfg.HeadDim), nil
}

func v41KVRaw(c *V41Context, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "x", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.HeadDim)
	attention.V41FP8Linear(y, x, c.W.Wkv)
	return bf16T(y, len(y)), nil
}

func v41KVNormed(c *V41Context, in map[string]Tensor) (Tensor, error) {
	k, err := inF(in, "kv_raw", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(k))
	attention.RMSNorm(y, k, c.W.KVNorm, float32(c.Cfg.NormEps))
	return bf16T(y, len(y)), nil
}

func v41KVRoped(c *V41Context, in map[string]Tensor) (Tensor, error) {
	k, err := inF(in, "kv_normed", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), k...)
	c.Rope.ApplyRope(y[len(y)-attention.RopeDims:], c.Pos, false)
	return bf16T(y, len(y)), nil
}

func v41KV(c *V41Context, in map[string]Tensor) (Tensor, error) {
	k, err := inF(in, "kv_roped", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), k...)
	attention.V41FQ8Window(y)
	return bf16T(y, len(y)), nil
}

func v41Window(c *V41Context, in map[string]Tensor) (Tensor, error) {
	D, win := c.Cfg.HeadDim, c.Cfg.WindowSize
	w, err := inF(in, PrevPrefix+"window", win*D)
	if err != nil {
		return Tensor{}, err
	}
	k, err := inF(in, "kv", D)
	if err != nil {
		return Tensor{}, err
	}
	out := append([]float32(nil), w...)
	copy(out[int(c.Pos%int64(win))*D:], k)
	return bf16T(out, win, D), nil
}

func v41CmpRaw(c *V41Context, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "x", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.HeadDim)
	attention.BF16Linear(y, x, c.W.Compressor.Wkv, c.Cfg.HeadDim, c.Cfg.Dim)
	return bf16T(y, len(y)), nil
}

func v41CmpLatent1(c *V41Context, in map[string]Tensor) (Tensor, error) {
	raw, err := inF(in, "cmp_raw", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(raw))
	c.W.Compressor.Normed(y, raw)
	return bf16T(y, len(y)), nil
}

func v41CmpProject(c *V41Context, in map[string]Tensor, kv bool) (Tensor, error) {
	x, err := inF(in, "x", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	a := make([]float32, c.Cfg.HeadDim)
	W := c.W.Compressor.Wgate
	if kv {
		W = c.W.Compressor.Wkv
	}
	attention.F32Linear(a, x, W, c.Cfg.HeadDim, c.Cfg.Dim) // f32(x): bf16 values widened
	return FromF(KindF32, a, len(a)), nil
}

func v41CmpA(c *V41Context, in map[string]Tensor) (Tensor, error) { return v41CmpProject(c, in, true) }
func v41CmpB(c *V41Context, in map[string]Tensor) (Tensor, error) { return v41CmpProject(c, in, false) }

func v41CmpState(kv bool) func(*V41Context, map[string]Tensor) (Tensor, error) {
	prev, cur := PrevPrefix+"cmp_score_state", "cmp_b"
	if kv {
		prev, cur = PrevPrefix+"cmp_kv_state", "cmp_a"
	}
	return func(c *V41Context, in map[string]Tensor) (Tensor, error) {
		D := c.Cfg.HeadDim
		st, err := inF(in, prev, 2*D)
		if err != nil {
			return Tensor{}, err
		}
		v, err := inF(in, cur, D)
		if err != nil {
			return Tensor{}, err
		}
		out := append([]float32(nil), st...)
		copy(out[int(c.Pos%2)*D:], v)
		return FromF(KindF32, out, 2, D), nil
	}
}

func v41CmpPooled(c *V41Context, in map[string]Tensor) (Tensor, error) {
	D := c.Cfg.HeadDim
	kv, err := inF(in, "cmp_kv_state", 2*D)
	if err != nil {
		return Tensor{}, err
	}
	sc, err := inF(in, "cmp_score_state", 2*D)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, D)
	c.W.Compressor.Pool(y, &attention.V41CompressorState{KV: kv, Score: sc})
	return bf16T(y, D), nil
}

func v41CmpLatent2(c *V41Context, in map[string]Tensor) (Tensor, error) {
	p, err := inF(in, "cmp_pooled", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(p))
	c.W.Compressor.Normed(y, p)
	return bf16T(y, len(y)), nil
}

func v41IKRaw(c *V41Context, in map[string]Tensor) (Tensor, error) {
	lat, err := inF(in, "cmp_latent", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.IndexHeadDim)
	c.W.Indexer.KeyLinear(y, lat)
	return bf16T(y, len(y)), nil
}

func v41IKNormed(c *V41Context, in map[string]Tensor) (Tensor, error) {
	raw, err := inF(in, "ik_raw", c.Cfg.IndexHeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(raw))
	c.W.Indexer.KeyNorm(y, raw)
	return bf16T(y, len(y)), nil
}

func v41RowIndex(c *V41Context) int64 { return c.Pos / int64(c.W.Ratio) }

func v41IKRow(c *V41Context, in map[string]Tensor) (Tensor, error) {
	k, err := inF(in, "ik_normed", c.Cfg.IndexHeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(k))
	c.W.Indexer.Key(y, k, v41RowIndex(c), c.W.Ratio, c.Rope)
	return bf16T(y, len(y)), nil
}

func v41CmpRoped(c *V41Context, in map[string]Tensor) (Tensor, error) {
	lat, err := inF(in, "cmp_latent", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), lat...)
	c.Rope.ApplyRope(y[len(y)-attention.RopeDims:], v41RowIndex(c)*int64(c.W.Ratio), false)
	return bf16T(y, len(y)), nil
}

func v41CmpRow(c *V41Context, in map[string]Tensor) (Tensor, error) {
	ro, err := inF(in, "cmp_roped", c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), ro...)
	attention.V41FQ4KV(y)
	return bf16T(y, len(y)), nil
}

// v41Append is prev ++ row (if given), checking that prev has the rows the
// step expects before the write: (p div r) rows.
func v41Append(c *V41Context, in map[string]Tensor, prev, row string, cols int) (Tensor, error) {
	p, rows, err := inRows(in, prev, cols)
	if err != nil {
		return Tensor{}, err
	}
	if want := int(c.Pos / int64(c.W.Ratio)); rows != want {
		return Tensor{}, fmt.Errorf("input %s has %d rows, position %d with r = %d has %d rows before the step", prev, rows, c.Pos, c.W.Ratio, want)
	}
	out := append([]float32(nil), p...)
	if _, ok := in[row]; ok {
		v, err := inF(in, row, cols)
		if err != nil {
			return Tensor{}, err
		}
		out = append(out, v...)
		rows++
	}
	return bf16T(out, rows, cols), nil
}

func v41CKV(c *V41Context, in map[string]Tensor) (Tensor, error) {
	return v41Append(c, in, PrevPrefix+"ckv", "cmp_row", c.Cfg.HeadDim)
}

func v41ICache(c *V41Context, in map[string]Tensor) (Tensor, error) {
	return v41Append(c, in, PrevPrefix+"icache", "ik_row", c.Cfg.IndexHeadDim)
}

func v41IqB(c *V41Context, in map[string]Tensor) (Tensor, error) {
	cq, err := inF(in, "cq", c.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.IndexNHeads*c.Cfg.IndexHeadDim)
	c.W.Indexer.QueryB(y, cq)
	return bf16T(y, c.Cfg.IndexNHeads, c.Cfg.IndexHeadDim), nil
}

func v41IqRoped(c *V41Context, in map[string]Tensor) (Tensor, error) {
	q, err := inF(in, "iq_b", c.Cfg.IndexNHeads*c.Cfg.IndexHeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), q...)
	c.Rope.RopeLast(y, c.Cfg.IndexHeadDim, c.Pos, false)
	return bf16T(y, c.Cfg.IndexNHeads, c.Cfg.IndexHeadDim), nil
}

func v41Iq(c *V41Context, in map[string]Tensor) (Tensor, error) {
	q, err := inF(in, "iq_roped", c.Cfg.IndexNHeads*c.Cfg.IndexHeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), q...)
	quant.FQ4(y, 32)
	return bf16T(y, c.Cfg.IndexNHeads, c.Cfg.IndexHeadDim), nil
}

func v41IwRaw(c *V41Context, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "x", c.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.IndexNHeads)
	attention.BF16Linear(y, x, c.W.Indexer.WeightsProj, c.Cfg.IndexNHeads, c.Cfg.Dim)
	return bf16T(y, len(y)), nil
}

func v41Iw(c *V41Context, in map[string]Tensor) (Tensor, error) {
	raw, err := inF(in, "iw_raw", c.Cfg.IndexNHeads)
	if err != nil {
		return Tensor{}, err
	}
	s := c.W.Indexer.WeightScale()
	y := make([]float32, len(raw))
	for h, v := range raw {
		y[h] = quant.BF16Round(v * s)
	}
	return bf16T(y, len(y)), nil
}

func v41Tc(c *V41Context) int { return attention.VisibleRows(c.Pos, c.W.Ratio) }

func v41IndexQK(c *V41Context, in map[string]Tensor) (Tensor, error) {
	H, d := c.Cfg.IndexNHeads, c.Cfg.IndexHeadDim
	iq, err := inF(in, "iq", H*d)
	if err != nil {
		return Tensor{}, err
	}
	name := SharedPrefix + "icache"
	ic, rows, err := inRows(in, name, d)
	if err != nil {
		return Tensor{}, err
	}
	tc := v41Tc(c)
	if rows < tc {
		return Tensor{}, fmt.Errorf("input %s has %d index keys, the step reads %d", name, rows, tc)
	}
	qk := make([]float32, H*tc)
	indexer.IndexQK(qk, iq, ic[:tc*d], H, d) // model.py reads index_k[:, :end_pos // ratio]
	return bf16T(qk, H, tc), nil
}

func v41IndexScore(c *V41Context, in map[string]Tensor) (Tensor, error) {
	H, tc := c.Cfg.IndexNHeads, v41Tc(c)
	qk, err := inF(in, "index_qk", H*tc)
	if err != nil {
		return Tensor{}, err
	}
	w, err := inF(in, "iw", H)
	if err != nil {
		return Tensor{}, err
	}
	s := make([]float32, tc)
	indexer.IndexScore(s, qk, w)
	return bf16T(s, tc), nil
}

func v41CandMask(c *V41Context, in map[string]Tensor) (Tensor, error) {
	tc := v41Tc(c)
	s, err := inF(in, "index_score", tc)
	if err != nil {
		return Tensor{}, err
	}
	mask := indexer.SelectCandidateBlocks(s, c.Cfg.CandidateTopKBlocks, c.Cfg.CandidateBlockSize)
	out := make([]int64, tc)
	for j, m := range mask {
		if m {
			out[j] = 1
		}
	}
	return FromI(KindI32, out, tc), nil
}

func v41ScoreMasked(c *V41Context, in map[string]Tensor) (Tensor, error) {
	tc := v41Tc(c)
	s, err := inF(in, "index_score", tc)
	if err != nil {
		return Tensor{}, err
	}
	m, err := inI(in, SharedPrefix+"cand_mask")
	if err != nil {
		return Tensor{}, err
	}
	if len(m) != tc {
		return Tensor{}, fmt.Errorf("input %scand_mask covers %d rows, the scores %d", SharedPrefix, len(m), tc)
	}
	mask := make([]bool, tc)
	for j, v := range m {
		mask[j] = v != 0
	}
	out := make([]float32, tc)
	indexer.MaskScores(out, s, mask)
	return bf16T(out, tc), nil
}

func v41IndexSel(c *V41Context, in map[string]Tensor) (Tensor, error) {
	tc := v41Tc(c)
	name := "index_score"
	if _, ok := in["index_score_masked"]; ok {
		name = "index_score_masked"
	}
	s, err := inF(in, name, tc)
	if err != nil {
		return Tensor{}, err
	}
	sel, _ := indexer.V41Select(s, min(c.Cfg.IndexTopK, tc), tc, c.Cfg.WindowSize)
	out := make([]int64, len(sel))
	for i, v := range sel {
		out[i] = int64(v)
	}
	return FromI(KindI32, out, len(out)), nil
}

func v41TopkIdxs(c *V41Context, in map[string]Tensor) (Tensor, error) {
	win := attention.V41WindowIdx(c.Pos, c.Cfg.WindowSize)
	out := make([]int64, 0, len(win))
	for _, v := range win {
		out = append(out, int64(v))
	}
	for _, name := range []string{"index_sel", SharedPrefix + "index_sel"} {
		if _, ok := in[name]; !ok {
			continue
		}
		sel, err := inI(in, name)
		if err != nil {
			return Tensor{}, err
		}
		limit := int64(c.Cfg.WindowSize + v41Tc(c))
		for _, v := range sel {
			if v < -1 || v >= limit || (v >= 0 && v < int64(c.Cfg.WindowSize)) {
				return Tensor{}, fmt.Errorf("input %s entry %d outside the compressed rows %d … %d", name, v, c.Cfg.WindowSize, limit-1)
			}
		}
		out = append(out, sel...)
	}
	return FromI(KindI32, out, len(out)), nil
}

func v41KVCache(c *V41Context, in map[string]Tensor) (Tensor, error) {
	D, win := c.Cfg.HeadDim, c.Cfg.WindowSize
	w, err := inF(in, "window", win*D)
	if err != nil {
		return Tensor{}, err
	}
	out := append([]float32(nil), w...)
	rows := win
	for _, name := range []string{"ckv", SharedPrefix + "ckv"} {
		if _, ok := in[name]; !ok {
			continue
		}
		ck, n, err := inRows(in, name, D)
		if err != nil {
			return Tensor{}, err
		}
		tc := v41Tc(c)
		if n < tc {
			return Tensor{}, fmt.Errorf("input %s has %d rows, the step reads %d", name, n, tc)
		}
		out = append(out, ck[:tc*D]...) // model.py: shared_attn.compress_kv[:, :compress_len]
		rows += tc
	}
	return bf16T(out, rows, D), nil
}

func v41O(c *V41Context, in map[string]Tensor) (Tensor, error) {
	H, D := c.Cfg.NHeads, c.Cfg.HeadDim
	q, err := inF(in, "q", H*D)
	if err != nil {
		return Tensor{}, err
	}
	kv, rows, err := inRows(in, "kv_cache", D)
	if err != nil {
		return Tensor{}, err
	}
	idx64, err := inI(in, "topk_idxs")
	if err != nil {
		return Tensor{}, err
	}
	idx := make([]int32, len(idx64))
	for i, v := range idx64 {
		if v < -1 || v >= int64(rows) {
			return Tensor{}, fmt.Errorf("topk_idxs[%d] = %d outside the %d kv_cache rows", i, v, rows)
		}
		idx[i] = int32(v)
	}
	o := make([]float32, H*D)
	attention.V41SparseAttn(o, q, kv, D, idx, c.W.AttnSink, c.Cfg.SoftmaxScale())
	return bf16T(o, H, D), nil
}

func v41OInv(c *V41Context, in map[string]Tensor) (Tensor, error) {
	o, err := inF(in, "o", c.Cfg.NHeads*c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), o...)
	c.Rope.RopeLast(y, c.Cfg.HeadDim, c.Pos, true)
	return bf16T(y, c.Cfg.NHeads, c.Cfg.HeadDim), nil
}

func v41U(c *V41Context, in map[string]Tensor) (Tensor, error) {
	o, err := inF(in, "o_inv", c.Cfg.NHeads*c.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	u := make([]float32, c.Cfg.OGroups*c.Cfg.OLoraRank)
	attention.WoA(u, o, c.W.WoA, c.Cfg.OGroups, c.Cfg.OLoraRank)
	return bf16T(u, c.Cfg.OGroups, c.Cfg.OLoraRank), nil
}

func v41Y(c *V41Context, in map[string]Tensor) (Tensor, error) {
	u, err := inF(in, "u", c.Cfg.OGroups*c.Cfg.OLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, c.Cfg.Dim)
	attention.V41FP8Linear(y, u, c.W.WoB)
	return bf16T(y, len(y)), nil
}
