package engine

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// This file holds the Compute function of every stage (see Stages for the
// order). Each reads its inputs by name, checks their sizes (inputs may come
// from a dump, so a mismatch is an error, not a panic), and calls the
// attention / indexer step it names. The heavy steps go through the
// StepContext helpers of prepared_stages.go (ctx.fp8Lin, ctx.sparseAttn, …),
// which run the reference loops, or the bit-identical fast kernels when the
// layer's weights are prepared (W.Fast).

// inF returns the float input name with exactly n elements.
func inF(in map[string]Tensor, name string, n int) ([]float32, error) {
	t, ok := in[name]
	if !ok {
		return nil, fmt.Errorf("missing input %s", name)
	}
	if !t.Kind.IsFloat() || len(t.F) != n {
		return nil, fmt.Errorf("input %s is %s %v, want %d float values", name, t.Kind, t.Shape, n)
	}
	return t.F, nil
}

// inRows returns the float input name shaped [rows, cols] for any rows ≥ 0.
func inRows(in map[string]Tensor, name string, cols int) ([]float32, int, error) {
	t, ok := in[name]
	if !ok {
		return nil, 0, fmt.Errorf("missing input %s", name)
	}
	if !t.Kind.IsFloat() || len(t.Shape) != 2 || t.Shape[1] != cols || len(t.F) != t.Len() {
		return nil, 0, fmt.Errorf("input %s is %s %v, want [rows, %d]", name, t.Kind, t.Shape, cols)
	}
	return t.F, t.Shape[0], nil
}

// inI returns the integer input name.
func inI(in map[string]Tensor, name string) ([]int64, error) {
	t, ok := in[name]
	if !ok {
		return nil, fmt.Errorf("missing input %s", name)
	}
	if t.Kind.IsFloat() || len(t.I) != t.Len() {
		return nil, fmt.Errorf("input %s is %s %v, want integers", name, t.Kind, t.Shape)
	}
	return t.I, nil
}

func bf16T(data []float32, shape ...int) Tensor { return FromF(KindBF16, data, shape...) }

func stageQA(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "x", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	return bf16T(ctx.fp8Lin(ctx.W.WqA, x), ctx.Cfg.QLoraRank), nil
}

func stageCQ(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	qa, err := inF(in, "q_a", ctx.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	cq := make([]float32, len(qa))
	attention.RMSNorm(cq, qa, ctx.W.QNorm, float32(ctx.Cfg.NormEps))
	return bf16T(cq, len(cq)), nil
}

func stageQB(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	cq, err := inF(in, "cq", ctx.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	return bf16T(ctx.fp8Lin(ctx.W.WqB, cq), ctx.Cfg.NHeads, ctx.Cfg.HeadDim), nil
}

// headNorm normalises each D-wide head of q in place: attention.HeadRMS for
// model.py (every op rounds to bf16), HFHeadNorm for Hugging Face's eager path.
type headNorm func(q []float32, d int, eps float32)

// headNormed is norm applied to a copy of q_b [H][D].
func headNormed(ctx *StepContext, in map[string]Tensor, norm headNorm) ([]float32, error) {
	qb, err := inF(in, "q_b", ctx.Cfg.NHeads*ctx.Cfg.HeadDim)
	if err != nil {
		return nil, err
	}
	q := append([]float32(nil), qb...)
	norm(q, ctx.Cfg.HeadDim, float32(ctx.Cfg.NormEps))
	return q, nil
}

// qPePreropeWith is q_pe_prerope [H][rd]: the last rd dims of each head of
// norm(q_b), before RoPE.
func qPePreropeWith(ctx *StepContext, in map[string]Tensor, norm headNorm) (Tensor, error) {
	q, err := headNormed(ctx, in, norm)
	if err != nil {
		return Tensor{}, err
	}
	H, D, rd := ctx.Cfg.NHeads, ctx.Cfg.HeadDim, ctx.Cfg.RopeHeadDim
	pe := make([]float32, 0, H*rd)
	for h := 0; h < H; h++ {
		pe = append(pe, q[h*D+D-rd:(h+1)*D]...)
	}
	return bf16T(pe, H, rd), nil
}

// qWith is q [H][D]: norm(q_b) with the last rd dims of each head replaced by
// RoPE(q_pe_prerope, p).
func qWith(ctx *StepContext, in map[string]Tensor, norm headNorm) (Tensor, error) {
	q, err := headNormed(ctx, in, norm)
	if err != nil {
		return Tensor{}, err
	}
	H, D, rd := ctx.Cfg.NHeads, ctx.Cfg.HeadDim, ctx.Cfg.RopeHeadDim
	pe, err := inF(in, "q_pe_prerope", H*rd)
	if err != nil {
		return Tensor{}, err
	}
	for h := 0; h < H; h++ {
		dst := q[h*D+D-rd : (h+1)*D]
		copy(dst, pe[h*rd:(h+1)*rd])
		ctx.Rope.Apply(dst, ctx.Pos)
	}
	return bf16T(q, H, D), nil
}

func stageQPePrerope(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	return qPePreropeWith(ctx, in, attention.HeadRMS)
}

func stageQ(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	return qWith(ctx, in, attention.HeadRMS)
}

func stageKVRaw(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "x", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	return bf16T(ctx.fp8Lin(ctx.W.Wkv, x), ctx.Cfg.HeadDim), nil
}

func stageKVNormed(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	kv, err := inF(in, "kv_raw", ctx.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := make([]float32, len(kv))
	attention.RMSNorm(y, kv, ctx.W.KVNorm, float32(ctx.Cfg.NormEps))
	return bf16T(y, len(y)), nil
}

func stageKVRoped(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	kv, err := inF(in, "kv_normed", ctx.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), kv...)
	ctx.Rope.Apply(y[ctx.Cfg.NopeDim():], ctx.Pos)
	return bf16T(y, len(y)), nil
}

func stageKV(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	kv, err := inF(in, "kv_roped", ctx.Cfg.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), kv...)
	quant.FQ8(y[:ctx.Cfg.NopeDim()], 64)
	return bf16T(y, len(y)), nil
}

// ---- indexer (r = 4) ----

func iqStage(ctx *StepContext, in map[string]Tensor, from string, f func(ix *indexer.Indexer, dst, src []float32)) (Tensor, error) {
	ix := ctx.W.Indexer
	src, err := inF(in, from, ix.NHeads*ix.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	dst := make([]float32, len(src))
	f(ix, dst, src)
	return bf16T(dst, ix.NHeads, ix.HeadDim), nil
}

func stageIqB(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	ix := ctx.W.Indexer
	cq, err := inF(in, "cq", ctx.Cfg.QLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	dst := make([]float32, ix.NHeads*ix.HeadDim)
	ctx.indexerQueryB(dst, cq)
	return bf16T(dst, ix.NHeads, ix.HeadDim), nil
}

func stageIqRoped(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	return iqStage(ctx, in, "iq_b", func(ix *indexer.Indexer, dst, src []float32) { ix.QueryRoped(dst, src, ctx.Pos, ctx.Rope) })
}

func stageIqHad(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	return iqStage(ctx, in, "iq_roped", (*indexer.Indexer).QueryHad)
}

func stageIq(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	return iqStage(ctx, in, "iq_had", (*indexer.Indexer).Query)
}

func stageICache(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	hd := ctx.Cfg.IndexHeadDim
	prev, rows, err := inRows(in, PrevPrefix+"icache", hd)
	if err != nil {
		return Tensor{}, err
	}
	out := append([]float32(nil), prev...)
	if attention.EmitsRow(ctx.Pos, 4) {
		j := attention.EmittedRow(ctx.Pos, 4)
		if rows != j {
			return Tensor{}, fmt.Errorf("prev:icache has %d rows, the step emits row %d", rows, j)
		}
		row, err := inF(in, "icmp_row", hd)
		if err != nil {
			return Tensor{}, err
		}
		out = append(out, row...)
		rows++
	}
	return bf16T(out, rows, hd), nil
}

func stageIwRaw(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	x, err := inF(in, "x", ctx.Cfg.Dim)
	if err != nil {
		return Tensor{}, err
	}
	ix := ctx.W.Indexer
	w := make([]float32, ix.NHeads)
	ctx.indexerWeightsRaw(w, x)
	return bf16T(w, len(w)), nil
}

func stageIw(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	ix := ctx.W.Indexer
	raw, err := inF(in, "iw_raw", ix.NHeads)
	if err != nil {
		return Tensor{}, err
	}
	w := make([]float32, ix.NHeads)
	ix.Weights(w, raw)
	return bf16T(w, len(w)), nil
}

func stageIndexQK(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	ix := ctx.W.Indexer
	iq, err := inF(in, "iq", ix.NHeads*ix.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	ic, tc, err := inRows(in, "icache", ix.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	qk := make([]float32, ix.NHeads*tc)
	ctx.indexQK(qk, iq, ic, ix.NHeads, ix.HeadDim)
	return bf16T(qk, ix.NHeads, tc), nil
}

func stageIndexScore(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	ix := ctx.W.Indexer
	t, ok := in["index_qk"]
	if !ok || !t.Kind.IsFloat() || len(t.Shape) != 2 || t.Shape[0] != ix.NHeads || len(t.F) != t.Len() {
		return Tensor{}, fmt.Errorf("input index_qk missing or not [%d, Tc] floats", ix.NHeads)
	}
	w, err := inF(in, "iw", ix.NHeads)
	if err != nil {
		return Tensor{}, err
	}
	score := make([]float32, t.Shape[1])
	indexer.IndexScore(score, t.F, w)
	return bf16T(score, len(score)), nil
}

func stageIndexTopK(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	t, ok := in["index_score"]
	if !ok || !t.Kind.IsFloat() || len(t.Shape) != 1 || len(t.F) != t.Len() {
		return Tensor{}, fmt.Errorf("input index_score missing or not a float vector")
	}
	top := ctx.topK(t.F, ctx.W.Indexer.K(len(t.F)))
	return FromI(KindI64, top, len(top)), nil
}

func stageIndexSel(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	top, err := inI(in, "index_topk")
	if err != nil {
		return Tensor{}, err
	}
	sel := make([]int64, len(top))
	for i, j := range top {
		sel[i] = j + int64(ctx.Cfg.WindowSize)
	}
	return FromI(KindI64, sel, len(sel)), nil
}

// stageTopkIdxs assembles the index list of sparse_attn: the window part, then
// the compressed part (index_sel for r = 4, every row for r = 128).
func stageTopkIdxs(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	win := attention.WindowIdx(ctx.Pos, ctx.Cfg.WindowSize)
	var cmp []int32
	switch r := ctx.Cfg.Ratio(ctx.Layer); r {
	case 4:
		sel, err := inI(in, "index_sel")
		if err != nil {
			return Tensor{}, err
		}
		for _, s := range sel {
			cmp = append(cmp, int32(s))
		}
	case 128:
		cmp = attention.CompressedIdx(ctx.Pos, r, ctx.Cfg.WindowSize)
	}
	idx := attention.IndexList(win, cmp)
	out := make([]int64, len(idx))
	for i, v := range idx {
		out[i] = int64(v)
	}
	return FromI(KindI32, out, len(out)), nil
}

// ---- compressor (main "cmp_", indexer "icmp_") ----

func cmpProject(ctx *StepContext, c *attention.Compressor, in map[string]Tensor, wantA bool) (Tensor, error) {
	x, err := inF(in, "x", c.Dim)
	if err != nil {
		return Tensor{}, err
	}
	a, b := make([]float32, c.Width()), make([]float32, c.Width())
	ctx.project(c, a, b, x)
	if wantA {
		return FromF(KindF32, a, len(a)), nil
	}
	return FromF(KindF32, b, len(b)), nil
}

// prevCmpState widens a dumped state (r = 128 dumps hold only the live rows)
// to the full buffer; absent rows are kv = 0, score = −∞.
func prevCmpState(c *attention.Compressor, in map[string]Tensor, p string) (*attention.CompressorState, error) {
	st := newCompressorState(c.Ratio, c.HeadDim)
	kv, rk, err := inRows(in, PrevPrefix+p+"kv_state", c.Width())
	if err != nil {
		return nil, err
	}
	sc, rs, err := inRows(in, PrevPrefix+p+"score_state", c.Width())
	if err != nil {
		return nil, err
	}
	if rk > c.StateRows() || rs > c.StateRows() {
		return nil, fmt.Errorf("prev %sstate has %d/%d rows, the buffer %d", p, rk, rs, c.StateRows())
	}
	copy(st.KV, kv)
	copy(st.Score, sc)
	return st, nil
}

// liveRows is the number of state rows a dump shows after step pos: all of them
// for r = 4, rows 0 … pos mod 128 for r = 128.
func liveRows(c *attention.Compressor, pos int64) int {
	if c.Coff() == 2 {
		return c.StateRows()
	}
	return int(pos%int64(c.Ratio)) + 1
}

// cmpState computes the state after the step for one of the two buffers (kv
// or score) from the same buffer before the step and the step's projection.
func cmpState(ctx *StepContext, c *attention.Compressor, in map[string]Tensor, p string, kv bool) (Tensor, error) {
	name, src := "score_state", p+"b"
	if kv {
		name, src = "kv_state", p+"a"
	}
	prev, rows, err := inRows(in, PrevPrefix+p+name, c.Width())
	if err != nil {
		return Tensor{}, err
	}
	if rows > c.StateRows() {
		return Tensor{}, fmt.Errorf("prev:%s%s has %d rows, the buffer %d", p, name, rows, c.StateRows())
	}
	v, err := inF(in, src, c.Width())
	if err != nil {
		return Tensor{}, err
	}
	st := newCompressorState(c.Ratio, c.HeadDim)
	zero := make([]float32, c.Width())
	if kv {
		copy(st.KV, prev)
		c.Advance(st, v, zero, ctx.Pos)
		n := liveRows(c, ctx.Pos)
		return FromF(KindF32, st.KV[:n*c.Width()], n, c.Width()), nil
	}
	copy(st.Score, prev)
	c.Advance(st, zero, v, ctx.Pos)
	n := liveRows(c, ctx.Pos)
	return FromF(KindF32, st.Score[:n*c.Width()], n, c.Width()), nil
}

func cmpPooled(ctx *StepContext, c *attention.Compressor, in map[string]Tensor, p string) (Tensor, error) {
	prev, err := prevCmpState(c, in, p)
	if err != nil {
		return Tensor{}, err
	}
	a, err := inF(in, p+"a", c.Width())
	if err != nil {
		return Tensor{}, err
	}
	b, err := inF(in, p+"b", c.Width())
	if err != nil {
		return Tensor{}, err
	}
	dst := make([]float32, c.HeadDim)
	c.PoolAt(dst, prev, a, b, ctx.Pos)
	return bf16T(dst, c.HeadDim), nil
}

// cmpRowStage computes one of the per-row stages after the pool from its
// single input.
func cmpRowStage(ctx *StepContext, c *attention.Compressor, in map[string]Tensor, from, what string) (Tensor, error) {
	src, err := inF(in, from, c.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	dst := make([]float32, c.HeadDim)
	switch what {
	case "normed":
		c.Normed(dst, src)
	case "roped":
		c.Roped(dst, src, int64(attention.EmittedRow(ctx.Pos, c.Ratio)), ctx.Rope)
	case "had":
		c.Had(dst, src)
	case "row":
		c.Quantize(dst, src)
	default:
		panic("engine: unknown compressor row stage " + what)
	}
	return bf16T(dst, c.HeadDim), nil
}

// ---- cache write, attention, output ----

func stageKVCache(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	D, win := ctx.Cfg.HeadDim, ctx.Cfg.WindowSize
	prev, rows, err := inRows(in, PrevPrefix+"kv_cache", D)
	if err != nil {
		return Tensor{}, err
	}
	if rows < win {
		return Tensor{}, fmt.Errorf("prev:kv_cache has %d rows, fewer than the %d window slots", rows, win)
	}
	kv, err := inF(in, "kv", D)
	if err != nil {
		return Tensor{}, err
	}
	out := append([]float32(nil), prev...)
	slot := int(ctx.Pos % int64(win))
	copy(out[slot*D:(slot+1)*D], kv)
	r := ctx.Cfg.Ratio(ctx.Layer)
	if attention.EmitsRow(ctx.Pos, r) {
		j := attention.EmittedRow(ctx.Pos, r)
		if rows-win != j {
			return Tensor{}, fmt.Errorf("prev:kv_cache has %d compressed rows, the step emits row %d", rows-win, j)
		}
		row, err := inF(in, "cmp_row", D)
		if err != nil {
			return Tensor{}, err
		}
		out = append(out, row...)
		rows++
	}
	return bf16T(out, rows, D), nil
}

// attnInputs reads o's inputs: q [H][D], the cache rows kv [rows][D] and the
// index list (each entry −1 or a row of kv).
func attnInputs(ctx *StepContext, in map[string]Tensor) (q, kv []float32, idx []int32, err error) {
	H, D := ctx.Cfg.NHeads, ctx.Cfg.HeadDim
	if q, err = inF(in, "q", H*D); err != nil {
		return nil, nil, nil, err
	}
	kv, rows, err := inRows(in, "kv_cache", D)
	if err != nil {
		return nil, nil, nil, err
	}
	idx64, err := inI(in, "topk_idxs")
	if err != nil {
		return nil, nil, nil, err
	}
	idx = make([]int32, len(idx64))
	for i, v := range idx64 {
		if v < -1 || v >= int64(rows) {
			return nil, nil, nil, fmt.Errorf("topk_idxs[%d] = %d outside the %d cache rows", i, v, rows)
		}
		idx[i] = int32(v)
	}
	return q, kv, idx, nil
}

func stageO(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	q, kv, idx, err := attnInputs(ctx, in)
	if err != nil {
		return Tensor{}, err
	}
	H, D := ctx.Cfg.NHeads, ctx.Cfg.HeadDim
	o := make([]float32, H*D)
	ctx.sparseAttn(o, q, kv, D, idx, ctx.W.AttnSink, ctx.Cfg.SoftmaxScale())
	return bf16T(o, H, D), nil
}

func stageOInv(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	H, D := ctx.Cfg.NHeads, ctx.Cfg.HeadDim
	o, err := inF(in, "o", H*D)
	if err != nil {
		return Tensor{}, err
	}
	y := append([]float32(nil), o...)
	ctx.Rope.RopeLast(y, D, ctx.Pos, true)
	return bf16T(y, H, D), nil
}

func stageU(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	H, D, G, R := ctx.Cfg.NHeads, ctx.Cfg.HeadDim, ctx.Cfg.OGroups, ctx.Cfg.OLoraRank
	o, err := inF(in, "o_inv", H*D)
	if err != nil {
		return Tensor{}, err
	}
	u := make([]float32, G*R)
	ctx.woA(u, o)
	return bf16T(u, G, R), nil
}

func stageY(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	u, err := inF(in, "u", ctx.Cfg.OGroups*ctx.Cfg.OLoraRank)
	if err != nil {
		return Tensor{}, err
	}
	return bf16T(ctx.fp8Lin(ctx.W.WoB, u), ctx.Cfg.Dim), nil
}
