package attribute

import (
	"fmt"
	"slices"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/kvcache"
)

// ---- indexer scores ----

func scoreForm(c *Call, f func(score, qk, w []float32)) (engine.Tensor, error) {
	qk, err := inF(c, "index_qk")
	if err != nil {
		return engine.Tensor{}, err
	}
	w, err := inF(c, "iw")
	if err != nil {
		return engine.Tensor{}, err
	}
	if len(w) == 0 || len(qk)%len(w) != 0 {
		return engine.Tensor{}, fmt.Errorf("index_qk of %d values for %d heads", len(qk), len(w))
	}
	s := make([]float32, len(qk)/len(w))
	f(s, qk, w)
	return engine.FromF(engine.KindF32, s, c.Ref.Shape...), nil
}

// ---- attention ----

func attnInputs(c *Call) (q, kv []float32, rows int, idx []int32, err error) {
	cfg := c.Ctx.Cfg
	q, err = inF(c, "q")
	if err != nil {
		return
	}
	kt, ok := c.get("kv_cache")
	if !ok || !kt.Kind.IsFloat() || len(kt.Shape) != 2 || kt.Shape[1] != cfg.HeadDim {
		err = fmt.Errorf("needs kv_cache [rows, %d]", cfg.HeadDim)
		return
	}
	kv, rows = kt.F, kt.Shape[0]
	it, ok := c.get("topk_idxs")
	if !ok || it.Kind.IsFloat() {
		err = fmt.Errorf("needs topk_idxs")
		return
	}
	idx = make([]int32, len(it.I))
	for i, v := range it.I {
		if v < -1 || v >= int64(rows) {
			err = fmt.Errorf("topk_idxs[%d] = %d outside the %d cache rows", i, v, rows)
			return
		}
		idx[i] = int32(v)
	}
	return
}

func attnRun(name, desc string, f func(c *Call, o, q, kv []float32, rows int, idx []int32) error) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		q, kv, rows, idx, err := attnInputs(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		o := make([]float32, len(q))
		if err := f(c, o, q, kv, rows, idx); err != nil {
			return engine.Tensor{}, err
		}
		return like(c, o)
	}}
}

type attnFn func(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32)

func plainAttn(name, desc string, f attnFn) Hypothesis {
	return attnRun(name, desc, func(c *Call, o, q, kv []float32, _ int, idx []int32) error {
		f(o, q, kv, c.Ctx.Cfg.HeadDim, idx, c.Ctx.W.AttnSink, c.Ctx.Cfg.SoftmaxScale())
		return nil
	})
}

// partials computes the split-K partials over the dumped split_bounds, or
// over attention.HalfSplit of the list when the dump has none.
func partials(c *Call, q, kv []float32, idx []int32) ([]attention.Partial, []int64, error) {
	var bounds []int64
	if bt, ok := c.get("split_bounds"); ok && !bt.Kind.IsFloat() {
		bounds = bt.I
	} else {
		bounds = attention.HalfSplit(idx)
	}
	if len(bounds) < 3 || bounds[0] != 0 || bounds[len(bounds)-1] != int64(len(idx)) {
		return nil, nil, fmt.Errorf("no split of the %d-entry index list into two or more pieces (split_bounds %v)", len(idx), bounds)
	}
	var parts []attention.Partial
	for s := 0; s+1 < len(bounds); s++ {
		if bounds[s+1] < bounds[s] {
			return nil, nil, fmt.Errorf("split_bounds %v not ascending", bounds)
		}
		parts = append(parts, attention.SparseAttnPartial(q, kv, c.Ctx.Cfg.HeadDim, idx[bounds[s]:bounds[s+1]], c.Ctx.Cfg.SoftmaxScale()))
	}
	return parts, bounds, nil
}

func mergeHyp(name, desc string, f func(c *Call, o []float32, parts []attention.Partial) error) Hypothesis {
	return attnRun(name, desc, func(c *Call, o, q, kv []float32, _ int, idx []int32) error {
		parts, _, err := partials(c, q, kv, idx)
		if err != nil {
			return err
		}
		return f(c, o, parts)
	})
}

func attentionHypotheses() []Hypothesis {
	hs := []Hypothesis{
		plainAttn("bf16-logits", "logits q·K held in bf16 (bf16 GEMM, scaled in bf16), fp32 softmax", attention.SparseAttnBF16Logits),
		plainAttn("bf16-softmax", "fp32 logits, softmax output rounded to bf16 before P·V", attention.SparseAttnBF16Softmax),
		plainAttn("bf16-logits-softmax", "bf16 logits and bf16 softmax output (Hugging Face eager attention on bf16 tensors)", attention.SparseAttnBF16LogitsSoftmax),
		plainAttn("fp32-p", "P kept in fp32 for P·V (two-pass softmax, no bf16(P))", func(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) {
			attention.SparseAttnTwoPass(o, q, kv, d, idx, sink, scale)
		}),
		attnRun("no-sink", "the attention sink left out of the softmax denominator", func(c *Call, o, q, kv []float32, _ int, idx []int32) error {
			attention.SparseAttnNoSink(o, q, kv, c.Ctx.Cfg.HeadDim, idx, c.Ctx.Cfg.SoftmaxScale())
			return nil
		}),
		attnRun("neg-index-last-row", "-1 entries gathered as the last cache row (a negative index into the cache)", func(c *Call, o, q, kv []float32, rows int, idx []int32) error {
			return remapped(c, o, q, kv, idx, int32(rows-1))
		}),
		attnRun("neg-index-row0", "-1 entries gathered as cache row 0", func(c *Call, o, q, kv []float32, rows int, idx []int32) error {
			return remapped(c, o, q, kv, idx, 0)
		}),
		mergeHyp("splitk-no-sink", "split-K combine without the sink term in the total LSE", func(c *Call, o []float32, parts []attention.Partial) error {
			attention.MergePartialsNoSink(o, parts, c.Ctx.Cfg.HeadDim)
			return nil
		}),
		mergeHyp("splitk-base-e", "split-K combine weighting base-2 LSEs with e^x instead of 2^x", func(c *Call, o []float32, parts []attention.Partial) error {
			attention.MergePartialsBaseE(o, parts, c.Ctx.W.AttnSink, c.Ctx.Cfg.HeadDim)
			return nil
		}),
		mergeHyp("splitk-no-total", "split-K combine normalised by the largest split's LSE, not the total (weights do not sum to 1, no sink)", func(c *Call, o []float32, parts []attention.Partial) error {
			attention.MergePartialsNoTotal(o, parts, c.Ctx.W.AttnSink, c.Ctx.Cfg.HeadDim)
			return nil
		}),
	}
	for s := 0; s < maxSplits; s++ {
		hs = append(hs, mergeHyp(fmt.Sprintf("splitk-unscaled-split-%d", s), fmt.Sprintf("split-K combine adding split %d without its rescaling 2^(LSE2 - L)", s),
			func(c *Call, o []float32, parts []attention.Partial) error {
				if s >= len(parts) {
					return fmt.Errorf("the list has %d splits", len(parts))
				}
				attention.MergePartialsUnscaled(o, parts, c.Ctx.W.AttnSink, c.Ctx.Cfg.HeadDim, s)
				return nil
			}))
	}
	return hs
}

// maxSplits bounds the per-split hypotheses (FlashMLA uses a handful of splits per head group).
const maxSplits = 8

func remapped(c *Call, o, q, kv []float32, idx []int32, to int32) error {
	if !slices.Contains(idx, -1) {
		return fmt.Errorf("the index list has no -1 entries")
	}
	m := slices.Clone(idx)
	for i, v := range m {
		if v < 0 {
			m[i] = to
		}
	}
	attention.SparseAttn(o, q, kv, c.Ctx.Cfg.HeadDim, m, c.Ctx.W.AttnSink, c.Ctx.Cfg.SoftmaxScale())
	return nil
}

// ---- cache writes ----

func cacheWriteHypotheses() []Hypothesis {
	var hs []Hypothesis
	for i, h := range kvcache.WindowWriteHypotheses() {
		name := []string{"window-slot p-1", "window-slot p+1", "window-not-written", "window-double-write p,p-1", "window-double-write p,p+1"}[i]
		hs = append(hs, Hypothesis{Name: name, Desc: h.Name, run: func(c *Call) (engine.Tensor, error) {
			return cacheWith(c, h.Write, false)
		}})
	}
	hs = append(hs, Hypothesis{Name: "compressed-row-not-written", Desc: "the compressed row due at this emission step left zero (written late or not at all)",
		run: func(c *Call) (engine.Tensor, error) { return cacheWith(c, kvcache.WindowWrite, true) }})
	return hs
}

// cacheWith is the kv_cache after the step with the window written by
// write and, at an emission step, the compressed row appended (zero when
// zeroRow).
func cacheWith(c *Call, write func(prev []float32, d, W int, kv []float32, p int64) []float32, zeroRow bool) (engine.Tensor, error) {
	cfg := c.Ctx.Cfg
	D, W := cfg.HeadDim, cfg.WindowSize
	if c.Ctx.Pos < 0 || W <= 0 || D <= 0 {
		return engine.Tensor{}, fmt.Errorf("needs a decode position ≥ 0 and a window (position %d, window %d, head dim %d)", c.Ctx.Pos, W, D)
	}
	pt, ok := c.get(engine.PrevPrefix + "kv_cache")
	if !ok || !pt.Kind.IsFloat() || len(pt.Shape) != 2 || pt.Shape[1] != D || pt.Shape[0] < W {
		return engine.Tensor{}, fmt.Errorf("needs prev:kv_cache [rows ≥ %d, %d]", W, D)
	}
	kv, err := inF(c, "kv")
	if err != nil || len(kv) != D {
		return engine.Tensor{}, fmt.Errorf("needs kv [%d]", D)
	}
	r := cfg.Ratio(c.Ctx.Layer)
	emit := attention.EmitsRow(c.Ctx.Pos, r)
	if zeroRow && !emit {
		return engine.Tensor{}, fmt.Errorf("step %d emits no compressed row", c.Ctx.Pos)
	}
	out := write(pt.F, D, W, kv, c.Ctx.Pos)
	if emit {
		row := make([]float32, D)
		if !zeroRow {
			cr, err := inF(c, "cmp_row")
			if err != nil || len(cr) != D {
				return engine.Tensor{}, fmt.Errorf("needs cmp_row [%d]", D)
			}
			copy(row, cr)
		}
		out = append(out, row...)
	}
	return engine.FromF(c.Ref.Kind, out, len(out)/D, D), nil
}

// ---- index list ----

func windowPadFirst(c *Call) (engine.Tensor, error) {
	W := c.Ctx.Cfg.WindowSize
	if len(c.Ref.I) < W {
		return engine.Tensor{}, fmt.Errorf("index list shorter than the window")
	}
	out := slices.Clone(c.Ref.I)
	var valid, pad []int64
	for _, v := range out[:W] {
		if v < 0 {
			pad = append(pad, v)
		} else {
			valid = append(valid, v)
		}
	}
	if len(pad) == 0 {
		return engine.Tensor{}, fmt.Errorf("the window part has no -1 padding at step %d", c.Ctx.Pos)
	}
	copy(out, append(pad, valid...))
	return engine.FromI(c.Ref.Kind, out, c.Ref.Shape...), nil
}

func windowSlotOrder(c *Call) (engine.Tensor, error) {
	W := c.Ctx.Cfg.WindowSize
	if len(c.Ref.I) < W {
		return engine.Tensor{}, fmt.Errorf("index list shorter than the window")
	}
	out := slices.Clone(c.Ref.I)
	var valid []int64
	pads := 0
	for _, v := range out[:W] {
		if v < 0 {
			pads++
		} else {
			valid = append(valid, v)
		}
	}
	slices.Sort(valid)
	for i := range out[:W] {
		if i < len(valid) {
			out[i] = valid[i]
		} else {
			out[i] = -1
		}
	}
	if slices.Equal(out, c.Ref.I) {
		return engine.Tensor{}, fmt.Errorf("the window part is already in slot order at step %d", c.Ctx.Pos)
	}
	return engine.FromI(c.Ref.Kind, out, c.Ref.Shape...), nil
}
