package engine

import (
	"sparsemla/attention"
	"sparsemla/indexer"
)

// The switch between the reference loops and the fast kernels inside the
// stage graph (Stages / RunStep / the replays). A layer runs its stages on the
// fast kernels when its LayerWeights carry prepared weights (W.Fast, set by
// Model.PrepareFast or PrepareLayer); without them (the default) every stage
// runs the reference loops. Both give the same bits
// (TestStagesFastEqualReference), so the switch only changes the speed.

// PrepareLayer attaches the packed weights of w to it (w.Fast), so that stage
// computations with these weights run the fast kernels. The packed weights are
// a copy: change w afterwards and call PrepareLayer again (or set w.Fast = nil).
//
// A compact layer (LoadLayerWeightsPrepared: its fp32 wo_a is gone) keeps
// its packed weights: they are the only copy of wo_a.
func PrepareLayer(cfg *Config, w *LayerWeights) {
	if cfg.V32() {
		w.Fast = prepareV32(w) // V3.2: its FP8 linears (v32prepared.go)
		return
	}
	if w.Compact() || cfg.BF16Checkpoint() {
		// a bf16 checkpoint has no FP8 weights to pack: reference loops
		return
	}
	w.Fast = nil
	w.Fast = Prepare(cfg, w)
}

// PrepareFast prepares every layer of the model (PrepareLayer): replays of
// many steps then pack the weights once and run the fast kernels.
func (m *Model) PrepareFast() {
	for _, w := range m.Weights {
		PrepareLayer(m.Cfg, w)
	}
}

// Kernel paths a Model runs (Model.Kernels, Report.Kernels).
const (
	KernelsPrepared  = "prepared"  // every layer on the fast kernels (LayerWeights.Fast set)
	KernelsReference = "reference" // every layer on the plain reference loops
	KernelsMixed     = "mixed"     // some layers prepared, some not
)

// Kernels names the path the model's stage computations run: prepared,
// reference or mixed. Both paths give the same bits; only the speed and the
// memory differ.
func (m *Model) Kernels() string {
	prepared, ref := 0, 0
	for _, w := range m.Weights {
		if w.Fast != nil {
			prepared++
		} else {
			ref++
		}
	}
	switch {
	case ref == 0 && prepared > 0:
		return KernelsPrepared
	case prepared == 0:
		return KernelsReference
	}
	return KernelsMixed
}

// fast returns the prepared weights of the step's layer, nil for the reference.
func (ctx *StepContext) fast() *PreparedLayer {
	if ctx.W == nil {
		return nil
	}
	return ctx.W.Fast
}

// fp8Lin is FP8Linear(w, x), on the packed copy of w when the layer is prepared.
func (ctx *StepContext) fp8Lin(w *attention.FP8Weight, x []float32) []float32 {
	y := make([]float32, w.Rows)
	if ctx.Cfg.BF16Checkpoint() {
		attention.BF16Linear(y, x, w.W, w.Rows, w.Cols)
		return y
	}
	if p := ctx.fast(); p != nil {
		if pw := p.packedOf(w); pw != nil {
			pw.Linear(y, x)
			return y
		}
	}
	attention.FP8Linear(y, x, w)
	return y
}

// indexerQueryB is Indexer.QueryB (iq_b).
func (ctx *StepContext) indexerQueryB(dst, cq []float32) {
	if w := ctx.W.Indexer.WqB; ctx.Cfg.BF16Checkpoint() {
		attention.BF16Linear(dst, cq, w.W, w.Rows, w.Cols)
		return
	}
	if p := ctx.fast(); p != nil && p.IWqB != nil {
		p.IWqB.Linear(dst, cq)
		return
	}
	ctx.W.Indexer.QueryB(dst, cq)
}

// indexerWeightsRaw is Indexer.WeightsRaw (iw_raw).
func (ctx *StepContext) indexerWeightsRaw(dst, x []float32) {
	if p := ctx.fast(); p != nil && p.IWeightsProj != nil {
		p.IWeightsProj.Linear(dst, x)
		return
	}
	ctx.W.Indexer.WeightsRaw(dst, x)
}

// indexQK is indexer.IndexQK (index_qk).
func (ctx *StepContext) indexQK(qk, iq, icache []float32, heads, hd int) {
	if ctx.fast() != nil {
		attention.IndexQKFast(qk, iq, icache, heads, hd)
		return
	}
	indexer.IndexQK(qk, iq, icache, heads, hd)
}

// topK is the selection of indexer.TopK (index_topk).
func (ctx *StepContext) topK(scores []float32, k int) []int64 {
	if ctx.fast() != nil {
		return topKFast(scores, k)
	}
	top, _ := indexer.TopK(scores, k)
	return top
}

// project is Compressor.Project (cmp_a, cmp_b / icmp_a, icmp_b) for the main
// or the indexer compressor of the layer.
func (ctx *StepContext) project(c *attention.Compressor, a, b, x []float32) {
	if p := ctx.fast(); p != nil {
		switch {
		case c == p.Compressor && p.CmpWkv != nil:
			p.CmpWkv.Dot(a, x)
			p.CmpWgate.Dot(b, x)
			return
		case p.Indexer != nil && c == p.Indexer.Compressor && p.ICmpWkv != nil:
			p.ICmpWkv.Dot(a, x)
			p.ICmpWgate.Dot(b, x)
			return
		}
	}
	c.Project(a, b, x)
}

// sparseAttn is attention.SparseAttn (o).
func (ctx *StepContext) sparseAttn(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) {
	if ctx.fast() != nil {
		attention.SparseAttnFast(o, q, kv, d, idx, sink, scale)
		return
	}
	attention.SparseAttn(o, q, kv, d, idx, sink, scale)
}

// woA is attention.WoA (u).
func (ctx *StepContext) woA(u, o []float32) {
	if p := ctx.fast(); p != nil {
		p.WoA.WoA(u, o)
		return
	}
	if ctx.W.WoA == nil {
		panic("engine: the layer's wo_a is only in its prepared form (LoadLayerWeightsPrepared): keep LayerWeights.Fast set, or load with LoadLayerWeights for the reference loops")
	}
	attention.WoA(u, o, ctx.W.WoA, ctx.Cfg.OGroups, ctx.Cfg.OLoraRank)
}
