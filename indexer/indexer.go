package indexer

import (
	"math"

	"sparsemla/attention"
	"sparsemla/quant"
)

// Indexer holds the parameters of the lightning indexer of one CSA (r = 4)
// layer (mirrors `Indexer` in the official model.py, spec §6).
type Indexer struct {
	NHeads  int // index_n_heads H_I: 64 (V4-Flash), 4 (tiny golden)
	HeadDim int // index_head_dim: 128
	TopK    int // index_topk: 512 (V4-Flash), 1024 (V4-Pro), 16 (tiny golden)

	WqB         *attention.FP8Weight  // indexer.wq_b [H_I·128, q_lora_rank], FP8 with 128×128 UE8M0 blocks
	WeightsProj []float32             // indexer.weights_proj.weight [H_I, dim], bf16 values
	Compressor  *attention.Compressor // indexer.compressor: r = 4, d = 128, Rotate = true
}

// dim is the width of the attention input x that weights_proj reads.
func (ix *Indexer) dim() int {
	if ix.NHeads <= 0 || len(ix.WeightsProj)%ix.NHeads != 0 {
		panic("indexer: weights_proj shape mismatch")
	}
	return len(ix.WeightsProj) / ix.NHeads
}

func (ix *Indexer) checkHeads(v []float32) {
	if len(v) != ix.NHeads*ix.HeadDim {
		panic("indexer: query length is not heads·head_dim")
	}
}

// QueryB is the query projection (iq_b): dst = FP8Lin(indexer.wq_b, cq),
// bf16 [H_I, 128]. cq is the q_norm output [q_lora_rank] (model.py's `qr`).
func (ix *Indexer) QueryB(dst, cq []float32) {
	ix.checkHeads(dst)
	attention.FP8Linear(dst, cq, ix.WqB)
}

// QueryRoped rotates the last 64 dims of every head at the token's own position
// p (iq_roped), with the layer's table. Dims 0..63 are copied.
func (ix *Indexer) QueryRoped(dst, iqB []float32, pos int64, rope *attention.RopeTable) {
	ix.checkHeads(dst)
	ix.checkHeads(iqB)
	copy(dst, iqB)
	rope.RopeLast(dst, ix.HeadDim, pos, false)
}

// QueryHad applies the Hadamard rotation to every head (iq_had):
// dst[h] = Had(roped[h]), bf16 [H_I, 128] (spec §3.5). The keys get the same
// rotation in the indexer compressor, so q·k is preserved up to rounding.
func (ix *Indexer) QueryHad(dst, roped []float32) {
	ix.checkHeads(dst)
	ix.checkHeads(roped)
	copy(dst, roped)
	for h := 0; h < ix.NHeads; h++ {
		quant.Hadamard(dst[h*ix.HeadDim : (h+1)*ix.HeadDim])
	}
}

// Query is the last query stage (iq): dst = FQ4(had, 32) per head, the FP4
// fake quantisation of spec §3.4 in blocks of 32 (so blocks never straddle heads).
func (ix *Indexer) Query(dst, had []float32) {
	ix.checkHeads(dst)
	ix.checkHeads(had)
	copy(dst, had)
	quant.FQ4(dst, 32)
}

// QueryHeads computes QueryRoped, QueryHad and Query (iq_roped, iq_had, iq)
// for heads lo … hi−1 only: each output's values [lo·128, hi·128), the same
// values the three whole-query stages give, since each works head by head
// (the FP4 blocks of 32 never straddle a head of 128). The prepared step runs
// the heads in parallel through it. Every slice is [H_I·128].
func (ix *Indexer) QueryHeads(iqR, iqH, iq, iqB []float32, pos int64, rope *attention.RopeTable, lo, hi int) {
	for _, v := range [][]float32{iqR, iqH, iq, iqB} {
		ix.checkHeads(v)
	}
	if lo < 0 || hi > ix.NHeads || lo > hi || ix.HeadDim%32 != 0 {
		panic("indexer: QueryHeads head range or head_dim")
	}
	a, b := lo*ix.HeadDim, hi*ix.HeadDim
	copy(iqR[a:b], iqB[a:b])
	rope.RopeLast(iqR[a:b], ix.HeadDim, pos, false)
	copy(iqH[a:b], iqR[a:b])
	for h := lo; h < hi; h++ {
		quant.Hadamard(iqH[h*ix.HeadDim : (h+1)*ix.HeadDim])
	}
	copy(iq[a:b], iqH[a:b])
	quant.FQ4(iq[a:b], 32)
}

// WeightsRaw is the per-head weight projection (iw_raw): dst = bf16(weights_proj · x),
// a bf16 linear (fp32 accumulation) on the attention input x [dim] (not on cq).
// dst is [H_I].
func (ix *Indexer) WeightsRaw(dst, x []float32) {
	if len(dst) != ix.NHeads {
		panic("indexer: weights length mismatch")
	}
	attention.BF16Linear(dst, x, ix.WeightsProj, ix.NHeads, ix.dim())
}

// WeightScale is f32(head_dim^-0.5 · H_I^-0.5), the fixed scale model.py folds
// into the head weights (`softmax_scale * n_heads ** -0.5`, a Python float
// turned into fp32 by the bf16 multiply). V4-Flash (64 heads): 0x3C3504F3;
// the tiny golden (4 heads): 128^-0.5·4^-0.5.
func (ix *Indexer) WeightScale() float32 {
	return float32(math.Pow(float64(ix.HeadDim), -0.5) * math.Pow(float64(ix.NHeads), -0.5))
}

// Weights scales the raw head weights (iw): dst[h] = bf16(iwRaw[h] · WeightScale()).
// The weights may be negative; there is no softmax over heads.
func (ix *Indexer) Weights(dst, iwRaw []float32) {
	if len(dst) != ix.NHeads || len(iwRaw) != ix.NHeads {
		panic("indexer: weights length mismatch")
	}
	s := ix.WeightScale()
	for h, v := range iwRaw {
		dst[h] = quant.BF16Round(v * s)
	}
}

// K returns the number of rows the indexer selects at a step with tc complete
// compressed rows: min(index_topk, tc).
func (ix *Indexer) K(tc int) int { return min(ix.TopK, tc) }

// Step holds every intermediate of one indexer decode step, named after the dump
// stages.
type Step struct {
	IqB, IqRoped, IqHad, Iq []float32 // iq_b, iq_roped, iq_had, iq: bf16 [H_I, 128]
	Cmp                     attention.CompressorStep
	IwRaw, Iw               []float32 // iw_raw, iw: bf16 [H_I]
	ICache                  []float32 // icache after the step: bf16 [Tc, 128]
	IndexQK                 []float32 // index_qk: bf16 [H_I, Tc]
	IndexScore              []float32 // index_score: bf16 [Tc]
	IndexTopK               []int64   // index_topk: [K], descending score, ties by lower row
	IndexSel                []int64   // index_sel = index_topk + 128 (offsets into kv_cache)
	Ties                    TieReport // boundary-tie report of the selection
}

// KVCacheOffset is the offset of compressed row 0 in the layer's kv_cache: the
// 128 window slots come first (model.py passes offset = window_size).
const KVCacheOffset = 128

// Step runs the indexer for the token at pos (model.py `Indexer.forward` with
// start_pos = pos, spec §6):
//
//	iq_b = FP8Lin(wq_b, cq); iq_roped = RoPE(last 64 dims, p); iq_had = Had; iq = FQ4(·, 32)
//	the indexer compressor ingests x and may append icache[pos div 4]
//	iw_raw = bf16(weights_proj · x); iw = bf16(iw_raw · f32(128^-0.5·H_I^-0.5))
//	index_qk[h][j] = bf16(iq[h] · icache[j]);  index_score[j] = bf16(Σ_h bf16(ReLU(index_qk[h][j])·iw[h]))
//	index_topk = TopK(index_score, min(index_topk, Tc))
//
// x is the bf16 attention input [dim], cq the q_norm output [q_lora_rank].
// st (the indexer compressor state) is updated in place; icache is the key cache
// before the step [Tc_before, 128] and is not modified: Step.ICache is the cache
// after the step (a new slice). rope is the layer's table.
func (ix *Indexer) Step(st *attention.CompressorState, icache, x, cq []float32, pos int64, rope *attention.RopeTable) Step {
	hd := ix.NHeads * ix.HeadDim
	s := Step{
		IqB: make([]float32, hd), IqRoped: make([]float32, hd),
		IqHad: make([]float32, hd), Iq: make([]float32, hd),
		IwRaw: make([]float32, ix.NHeads), Iw: make([]float32, ix.NHeads),
	}
	ix.QueryB(s.IqB, cq)
	ix.QueryRoped(s.IqRoped, s.IqB, pos, rope)
	ix.QueryHad(s.IqHad, s.IqRoped)
	ix.Query(s.Iq, s.IqHad)

	s.Cmp = ix.Compressor.Step(st, x, pos, rope)
	s.ICache = append([]float32(nil), icache...)
	if s.Cmp.Emitted {
		if int64(len(icache)/ix.HeadDim) != s.Cmp.Row {
			panic("indexer: key cache length does not match the emitted row")
		}
		s.ICache = append(s.ICache, s.Cmp.Out...)
	}

	ix.WeightsRaw(s.IwRaw, x)
	ix.Weights(s.Iw, s.IwRaw)

	tc := len(s.ICache) / ix.HeadDim
	s.IndexQK = make([]float32, ix.NHeads*tc)
	IndexQK(s.IndexQK, s.Iq, s.ICache, ix.NHeads, ix.HeadDim)
	s.IndexScore = make([]float32, tc)
	IndexScore(s.IndexScore, s.IndexQK, s.Iw)
	s.IndexTopK, s.Ties = TopK(s.IndexScore, ix.K(tc))
	s.IndexSel = Sel(s.IndexTopK)
	return s
}

// Sel turns row indices into kv_cache offsets: sel[i] = topk[i] + 128 (the
// indexer's return value, model.py `topk_idxs += offset`).
func Sel(topk []int64) []int64 {
	sel := make([]int64, len(topk))
	for i, j := range topk {
		sel[i] = j + KVCacheOffset
	}
	return sel
}
