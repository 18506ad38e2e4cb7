package engine

import (
	"fmt"
	"math"
	"runtime"
	"slices"

	"golang.org/x/sync/errgroup"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// PreparedLayer is one layer's attention weights repacked once for the fast
// decode path (attention.FP8Panels, attention.Panels): FP8 weights as E4M3
// codes + UE8M0 block scales in 64-row panels (1 byte per weight, no fp32
// copy), bf16 weights (wo_a, weights_proj) and the compressor projections as
// bf16 panels (2 bytes per weight; fp32 when a value is not a bf16 value). The
// small parameters (norms, attn_sink, ape) and the compressors' state machine
// are shared with the LayerWeights it was made from.
//
// PreparedLayer.Step computes exactly what RunStep computes (bit for bit, at
// any GOMAXPROCS: TestPreparedStepEqualsRunStep), updating the state in place
// instead of materialising every stage tensor.
type PreparedLayer struct {
	Layer, Ratio       int
	WqA, WqB, Wkv, WoB *attention.FP8Panels
	WoA                *attention.WoAPanels
	QNorm, KVNorm      []float32
	AttnSink           []float32

	Compressor       *attention.Compressor // state machine, pool, row path (r > 0)
	CmpWkv, CmpWgate *attention.Panels     // its projections

	Indexer            *indexer.Indexer // query path, head weights (r = 4)
	IWqB               *attention.FP8Panels
	IWeightsProj       *attention.Panels
	ICmpWkv, ICmpWgate *attention.Panels

	src map[*attention.FP8Weight]*attention.FP8Panels // packed copy of each FP8 weight of the source LayerWeights
}

// packedOf returns the packed copy of the source FP8 weight w, nil if w is not
// one of the weights the layer was prepared from.
func (p *PreparedLayer) packedOf(w *attention.FP8Weight) *attention.FP8Panels { return p.src[w] }

// Prepare repacks the layer's weights. The packed weights are new memory; the
// fp32 FP8 dequantisations of w are not referenced, so a caller that keeps
// only the PreparedLayer lets them be collected (the compressors and the
// indexer struct are shared).
func Prepare(cfg *Config, w *LayerWeights) *PreparedLayer {
	if cfg.BF16Checkpoint() {
		panic("engine: Prepare: the fast kernels pack FP8 weights; a bf16 checkpoint runs the reference loops (PrepareLayer leaves it unprepared)")
	}
	p := &PreparedLayer{Layer: w.Layer, Ratio: w.Ratio,
		WqA: attention.PackFP8Weight(w.WqA), WqB: attention.PackFP8Weight(w.WqB),
		Wkv: attention.PackFP8Weight(w.Wkv), WoB: attention.PackFP8Weight(w.WoB),
		WoA:   attention.PackWoA(w.WoA, cfg.OGroups, cfg.OLoraRank, cfg.NHeads*cfg.HeadDim/cfg.OGroups),
		QNorm: w.QNorm, KVNorm: w.KVNorm, AttnSink: w.AttnSink,
	}
	if c := w.Compressor; c != nil {
		p.Compressor = c
		p.CmpWkv, p.CmpWgate = packCompressor(c)
	}
	p.src = map[*attention.FP8Weight]*attention.FP8Panels{w.WqA: p.WqA, w.WqB: p.WqB, w.Wkv: p.Wkv, w.WoB: p.WoB}
	if ix := w.Indexer; ix != nil {
		p.Indexer = ix
		p.IWqB = attention.PackFP8Weight(ix.WqB)
		p.src[ix.WqB] = p.IWqB
		p.IWeightsProj = attention.PackPanels(ix.WeightsProj, ix.NHeads, len(ix.WeightsProj)/ix.NHeads)
		p.ICmpWkv, p.ICmpWgate = packCompressor(ix.Compressor)
	}
	return p
}

// packCompressor returns the compressor's projections as panels: those it
// already holds its weights in (Compressor.UsePanels), else packed from its
// fp32 Wkv and Wgate (bf16 storage for checkpoint weights).
func packCompressor(c *attention.Compressor) (wkv, wgate *attention.Panels) {
	if wkv, wgate = c.Panels(); wkv != nil {
		return wkv, wgate
	}
	return attention.PackPanels(c.Wkv, c.Width(), c.Dim), attention.PackPanels(c.Wgate, c.Width(), c.Dim)
}

// CompactCompressors makes the layer's packed compressor projections the
// compressors' only copy (Compressor.UsePanels): their fp32 Wkv and Wgate
// are dropped (≈ 25 MiB a V4-Flash r = 4 layer); the reference
// Compressor.Project then reads the panels, the same bits.
func (p *PreparedLayer) CompactCompressors() {
	if c := p.Compressor; c != nil {
		c.UsePanels(p.CmpWkv, p.CmpWgate)
	}
	if p.Indexer != nil {
		p.Indexer.Compressor.UsePanels(p.ICmpWkv, p.ICmpWgate)
	}
}

// PackedBytes is the memory of the packed weights (what a replay of many steps
// keeps per layer besides the small vectors; a layer loaded by
// LoadLayerWeightsPrepared holds no other copy of the compressor weights).
func (p *PreparedLayer) PackedBytes() int64 {
	n := p.WqA.Bytes() + p.WqB.Bytes() + p.Wkv.Bytes() + p.WoB.Bytes() + p.WoA.Bytes()
	for _, q := range []*attention.Panels{p.CmpWkv, p.CmpWgate, p.IWeightsProj, p.ICmpWkv, p.ICmpWgate} {
		if q != nil {
			n += q.Bytes()
		}
	}
	if p.IWqB != nil {
		n += p.IWqB.Bytes()
	}
	return n
}

// Step is one decode step of the layer at position pos (= st.Next when known)
// from the bf16 attention input x [dim]: it returns y [dim] and advances st in
// place (window slot pos mod 128 ← kv; compressor and indexer states; at
// emitting steps the new compressed row and index key appended). The
// arithmetic is RunStep's, stage for stage:
//
//	q_a, cq, q_b, q (HeadRMS, RoPE)      attention.LinearShared (q_a with kv), RMSNorm, FP8Panels.Linear, HeadRMS, RoPE
//	kv                                    attention.LinearShared, RMSNorm, RoPE, FQ8
//	iq, icache, iw, index_score, topk    FP8Panels / Panels, Compressor.StepFrom, IndexScoresKeys, topKFast
//	cmp_* (r > 0)                         Panels.Dot, Compressor.StepFrom
//	o, o_inv, u, y                        SparseAttnFast, RoPE⁻¹, WoAPanels.WoA, FP8Panels.Linear
//
// An error (never a panic) reports a state that does not fit the layer.
func (p *PreparedLayer) Step(cfg *Config, rope *RopeTable, st *LayerState, x []float32, pos int64) ([]float32, error) {
	H, D, rd, win := cfg.NHeads, cfg.HeadDim, cfg.RopeHeadDim, cfg.WindowSize
	eps := float32(cfg.NormEps)
	r := p.Ratio
	switch {
	case len(x) != cfg.Dim:
		return nil, fmt.Errorf("engine: prepared step layer %d: x has %d values, dim is %d", p.Layer, len(x), cfg.Dim)
	case st.Ratio != r || st.HeadDim != D || st.Window != win || len(st.KV) < win*D || len(st.KV)%D != 0:
		return nil, fmt.Errorf("engine: prepared step layer %d: the state does not fit the layer (r = %d, kv %d values)", p.Layer, st.Ratio, len(st.KV))
	case st.Next != 0 && st.Next != pos:
		return nil, fmt.Errorf("engine: layer %d: the state is at position %d, the step decodes position %d", p.Layer, st.Next, pos)
	case pos <= 0 || pos >= int64(rope.T):
		return nil, fmt.Errorf("engine: layer %d: position %d outside 1 … %d (RoPE table %s)", p.Layer, pos, rope.T-1, rope.Source)
	case r > 0 && st.Rows() != int(pos/int64(r)):
		return nil, fmt.Errorf("engine: layer %d: the kv cache has %d compressed rows, position %d needs %d", p.Layer, st.Rows(), pos, pos/int64(r))
	case r == 4 && len(st.ICache) != st.Rows()*cfg.IndexHeadDim:
		return nil, fmt.Errorf("engine: layer %d: the index key cache has %d values for %d rows", p.Layer, len(st.ICache), st.Rows())
	}

	// query latent, shared by the query path and the indexer, and the
	// window kv: both read x, so one quantisation of x and one parallel
	// loop over both weights (4 + 2 MiB: two small GEMVs that alone do not
	// keep 16 cores streaming)
	t := phaseStart()
	nq := cfg.QLoraRank
	lb := headBufs.Get(2*nq + D)
	defer headBufs.Put(lb)
	// every value written: qa and kv by the GEMVs, cq by the norm
	qa, cq, kv := (*lb)[:nq:nq], (*lb)[nq:2*nq:2*nq], (*lb)[2*nq:]
	attention.LinearShared([]*attention.FP8Panels{p.WqA, p.Wkv}, [][]float32{qa, kv}, x)
	attention.RMSNorm(cq, qa, p.QNorm, eps)
	t = phaseEnd("wq_a+wkv", t)

	// Four independent branches run concurrently (each writes only its own
	// outputs and its own part of the state, and computes them the same way
	// whatever the scheduling): the query, the window K, the indexer (r = 4)
	// and the main compressor (r > 0). Overlapping the memory-bound GEMVs with
	// the compute-bound index scoring saves time on a single layer.
	var g errgroup.Group
	qb := headBufs.Get(H * D)
	defer headBufs.Put(qb)
	q := *qb // every value written by wq_b
	g.Go(func() error {
		t := phaseStart()
		p.WqB.Linear(q, cq)
		attention.HeadRMS(q, D, eps)
		for h := 0; h < H; h++ {
			rope.Apply(q[h*D+D-rd:(h+1)*D], pos)
		}
		phaseEnd("branch.q", t)
		return nil
	})
	g.Go(func() error {
		t := phaseStart()
		attention.RMSNorm(kv, kv, p.KVNorm, eps)
		rope.Apply(kv[cfg.NopeDim():], pos)
		quant.FQ8(kv[:cfg.NopeDim()], 64)
		phaseEnd("branch.kv", t)
		return nil
	})
	var cmp []int32 // compressed part of the index list
	if r == 4 {
		g.Go(func() error {
			t := phaseStart()
			sel, err := p.indexerStep(cfg, rope, st, x, cq, pos)
			cmp = sel
			phaseEnd("branch.indexer", t)
			return err
		})
	}
	var row []float32 // the compressed row this step emits, if any
	if r > 0 {
		g.Go(func() error {
			t := phaseStart()
			c := p.Compressor
			ab := headBufs.Get(2 * c.Width())
			defer headBufs.Put(ab)
			w := c.Width()
			a, b := (*ab)[:w:w], (*ab)[w:] // every value written by Dot
			p.CmpWkv.Dot(a, x)
			p.CmpWgate.Dot(b, x)
			if s := c.StepFrom(st.Cmp, a, b, pos, rope); s.Emitted {
				row = s.Out
			}
			phaseEnd("branch.compressor", t)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	t = phaseEnd("branches", t)
	if r == 128 {
		cmp = attention.CompressedIdx(pos, r, win)
	}
	idx := attention.IndexList(attention.WindowIdx(pos, win), cmp)

	// cache write: window slot, then the emitted row
	slot := int(pos % int64(win))
	copy(st.KV[slot*D:(slot+1)*D], kv)
	st.KV = append(st.KV, row...)

	// attention and output
	ob := headBufs.Get(H * D)
	defer headBufs.Put(ob)
	o := *ob // every value written by the attention
	attention.SparseAttnFast(o, q, st.KV, D, idx, p.AttnSink, cfg.SoftmaxScale())
	rope.RopeLast(o, D, pos, true)
	t = phaseEnd("attn", t)
	ub := headBufs.Get(cfg.OGroups * cfg.OLoraRank)
	defer headBufs.Put(ub)
	u := *ub // every value written by wo_a
	p.WoA.WoA(u, o)
	t = phaseEnd("wo_a", t)
	y := make([]float32, cfg.Dim)
	p.WoB.Linear(y, u)
	phaseEnd("wo_b", t)
	st.Next = pos + 1
	return y, nil
}

// headBufs keeps the step's large fp32 buffers between steps (q and o, 128
// KiB each for V4-Flash; the indexer's four query stages and its scores):
// fresh ones each step are fresh memory (attention.BufPool). None of them
// leaves the step.
var headBufs attention.BufPool[float32]

// candBufs keeps topKFast's candidate keys (128 KiB at 64K context), for the
// same reason.
var candBufs attention.BufPool[uint64]

// indexerStep runs the indexer of an r = 4 layer (query, compressor, head
// weights, scores, top-k) and returns index_sel as kv_cache offsets.
func (p *PreparedLayer) indexerStep(cfg *Config, rope *RopeTable, st *LayerState, x, cq []float32, pos int64) ([]int32, error) {
	ix := p.Indexer
	hd := ix.NHeads * ix.HeadDim
	t := phaseStart()
	qb := headBufs.Get(4 * hd)
	defer headBufs.Put(qb)
	qbuf := *qb // every value written: iqB by indexer.wq_b, the others by QueryHeads
	iqB, iqR, iqH, iq := qbuf[:hd], qbuf[hd:2*hd], qbuf[2*hd:3*hd], qbuf[3*hd:]
	p.IWqB.Linear(iqB, cq)
	t = phaseEnd("indexer.wq_b", t)
	// the query's per-head stages (RoPE, Hadamard, FP4), heads in parallel:
	// 64 heads take ≈ 0.18 ms on one core, on the step's critical path
	attention.ParallelFor(ix.NHeads, hd*64, func(lo, hi int) {
		ix.QueryHeads(iqR, iqH, iq, iqB, pos, rope, lo, hi)
	})
	t = phaseEnd("indexer.query", t)

	c := ix.Compressor
	ab := headBufs.Get(2 * c.Width())
	defer headBufs.Put(ab)
	w := c.Width()
	a, b := (*ab)[:w:w], (*ab)[w:] // every value written by Dot
	p.ICmpWkv.Dot(a, x)
	p.ICmpWgate.Dot(b, x)
	s := c.StepFrom(st.ICmp, a, b, pos, rope)
	if s.Emitted {
		if int64(len(st.ICache)/ix.HeadDim) != s.Row {
			return nil, fmt.Errorf("engine: layer %d: the index key cache has %d rows, the step emits row %d", p.Layer, len(st.ICache)/ix.HeadDim, s.Row)
		}
		st.ICache = append(st.ICache, s.Out...)
	}
	t = phaseEnd("indexer.compressor", t)

	wb := headBufs.Get(2 * ix.NHeads)
	defer headBufs.Put(wb)
	// every value written: raw by weights_proj, iw by Weights
	raw, iw := (*wb)[:ix.NHeads:ix.NHeads], (*wb)[ix.NHeads:]
	p.IWeightsProj.Linear(raw, x)
	ix.Weights(iw, raw)
	t = phaseEnd("indexer.weights", t)

	tc := len(st.ICache) / ix.HeadDim
	sb := headBufs.Get(tc)
	defer headBufs.Put(sb)
	score := *sb // every value written by the scoring; read by top-k only
	if st.ikeys == nil {
		st.ikeys = new(attention.IndexKeys)
	}
	attention.IndexScoresKeys(score, iq, st.ICache, st.ikeys, iw, ix.NHeads, ix.HeadDim)
	t = phaseEnd("indexer.scores", t)
	top := topKFast(score, ix.K(tc))
	phaseEnd("indexer.topk", t)
	sel := make([]int32, len(top))
	for i, j := range top {
		sel[i] = int32(j) + int32(cfg.WindowSize)
	}
	return sel, nil
}

// scoreKey maps (score, row) to a uint64 whose descending order is the
// reference top-k order (indexer.TopK): larger score first (NaN above every
// number, −0 = +0), then lower row.
func scoreKey(s float32, row int) uint64 {
	// (branch-free for the common cases: the signs and zeros of a step's
	// scores are unpredictable, and a mispredicted branch per row cost a third
	// of topKFast's time)
	b := math.Float32bits(s)
	ord := b ^ (uint32(int32(b)>>31) | 0x80000000) // b|1<<31 for b ≥ 0, ^b below
	if b<<1 == 0 {
		ord = 0x80000000 // −0 = +0
	}
	if s != s {
		ord = math.MaxUint32
	}
	return uint64(ord)<<32 | uint64(^uint32(row))
}

// topKFast is indexer.TopK's selection (same rows, same order) by radix
// selection on scoreKey, 8 bits at a time from the top, then a sort of the k
// selected keys: O(Tc + k log k) instead of a sort of all Tc rows. Each pass
// counts the remaining candidates' digits in a 256-entry histogram (it stays
// in L1; the 2^16-entry one of the previous form, cleared and scanned on
// every pass, made 16K rows take 0.6 ms), keeps the keys above the
// threshold digit and passes on the ties. Keys are distinct (they hold the
// row), so the selection is unique.
func topKFast(scores []float32, k int) []int64 {
	if k < 0 || k > len(scores) || len(scores) > math.MaxUint32 {
		panic("engine: topKFast k out of range")
	}
	cb := candBufs.Get(len(scores))
	defer candBufs.Put(cb)
	cand := *cb // every value written below
	for i, s := range scores {
		cand[i] = scoreKey(s, i)
	}
	sb := candBufs.Get(k)
	defer candBufs.Put(sb)
	sel := (*sb)[:0]      // the selected keys, appended (buf below: written before read)
	if len(cand) <= 256 { // a sort is cheaper than the passes
		slices.Sort(cand)
		for i := len(cand) - 1; i >= len(cand)-k; i-- {
			sel = append(sel, cand[i])
		}
		return keyRows(sel)
	}
	var hist [256]int
	for shift := 56; len(sel) < k && shift >= 0; shift -= 8 {
		need := k - len(sel)
		if len(cand) == need {
			sel = append(sel, cand...)
			break
		}
		hist = [256]int{}
		for _, c := range cand {
			hist[c>>shift&0xff]++
		}
		t, above := 0xff, 0
		for ; above+hist[t] < need; t-- {
			above += hist[t]
		}
		// keys above t to sel, ties to the front of cand, without a branch
		// per key: sel never grows past k (above < need) and a tie is
		// written at or before the key being read
		buf, ns, nt := sel[:k], len(sel), 0
		for _, c := range cand {
			d := int(c >> shift & 0xff)
			buf[ns], cand[nt] = c, c
			ns += b2i(d > t)
			nt += b2i(d == t)
		}
		sel, cand = buf[:ns], cand[:nt]
		if shift == 0 { // digit t at shift 0 identifies one key
			sel = append(sel, cand[:k-len(sel)]...)
		}
	}
	slices.Sort(sel)
	slices.Reverse(sel)
	return keyRows(sel)
}

// b2i is 1 for true, 0 for false (a SETcc, no branch).
func b2i(b bool) int {
	var i int
	if b {
		i = 1
	}
	return i
}

// keyRows returns the rows of scoreKey keys, in order.
func keyRows(keys []uint64) []int64 {
	out := make([]int64, len(keys))
	for i, c := range keys {
		out[i] = int64(^uint32(c))
	}
	return out
}

// PreparedModel is every layer of a model prepared, with each layer's RoPE
// table: what a replay of many decode steps keeps (weights packed once, reused
// by every step).
type PreparedModel struct {
	Cfg    *Config
	Layers []*PreparedLayer
	Rope   []*RopeTable
}

// Step runs one attention-path decode step of every layer at position pos:
// layer l reads xs[l] (its own attention input, as a dump provides it) and
// advances states[l]; the outputs y[l] are returned. Layers are independent
// given their inputs, so they run concurrently (at most GOMAXPROCS at a time);
// each layer's arithmetic is the same at any GOMAXPROCS.
func (m *PreparedModel) Step(states []*LayerState, xs [][]float32, pos int64) ([][]float32, error) {
	if len(states) != len(m.Layers) || len(xs) != len(m.Layers) {
		return nil, fmt.Errorf("engine: prepared model step: %d layers, %d states, %d inputs", len(m.Layers), len(states), len(xs))
	}
	ys := make([][]float32, len(m.Layers))
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for l, pl := range m.Layers {
		g.Go(func() error {
			y, err := pl.Step(m.Cfg, m.Rope[l], states[l], xs[l], pos)
			ys[l] = y
			return err
		})
	}
	return ys, g.Wait()
}
