package indexer

import (
	"runtime"

	"golang.org/x/sync/errgroup"

	"sparsemla/attention"
	"sparsemla/quant"
)

// IndexQK computes the per-head dot products of the queries with every index key
// (index_qk; model.py `torch.einsum("bshd,btd->bsht", q, kv_cache)`, a bf16
// GEMM with fp32 accumulation):
//
//	qk[h][j] = bf16( Σ_k iq[h][k] · icache[j][k] )     k ascending, fp32
//
// qk is [heads, Tc], iq [heads, headDim], icache [Tc, headDim]. Tc = 0 is
// allowed (nothing to do).
func IndexQK(qk, iq, icache []float32, heads, headDim int) {
	if headDim <= 0 || len(iq) != heads*headDim || len(icache)%headDim != 0 {
		panic("indexer: IndexQK shape mismatch")
	}
	tc := len(icache) / headDim
	if len(qk) != heads*tc {
		panic("indexer: IndexQK output length is not heads·Tc")
	}
	for h := 0; h < heads; h++ {
		attention.BF16Linear(qk[h*tc:(h+1)*tc], iq[h*headDim:(h+1)*headDim], icache, tc, headDim)
	}
}

// IndexScore combines the heads into one score per compressed row (index_score;
// model.py `(index_score.relu_() * weights.unsqueeze(-1)).sum(dim=2)` on bf16
// tensors, so each product is rounded to bf16 before the fp32 head sum — the
// form §14 confirmed on the GPU):
//
//	score[j] = bf16( Σ_h bf16( max(qk[h][j], 0) · w[h] ) )     h ascending, fp32
//
// score is [Tc], qk [heads, Tc], w [heads] (iw). ReLU makes many terms exactly
// 0, so equal scores (ties) are common; see [TopK].
func IndexScore(score, qk, w []float32) {
	heads := len(w)
	if heads == 0 || len(qk) != heads*len(score) {
		panic("indexer: IndexScore shape mismatch")
	}
	tc := len(score)
	for j := 0; j < tc; j++ {
		var sum float32
		for h := 0; h < heads; h++ {
			sum += quant.BF16Round(max(qk[h*tc+j], 0) * w[h])
		}
		score[j] = quant.BF16Round(sum)
	}
}

// ScoreRows is the fast path of IndexQK followed by IndexScore: the same
// per-row arithmetic (each dot product bf16-rounded, each ReLU·weight product
// bf16-rounded, the head sum in fp32 in head order), fused per compressed row
// so index_qk is never materialised, and spread over GOMAXPROCS goroutines by
// contiguous row ranges. Every score is computed by exactly one goroutine with
// the reference's order, so the result is bit-identical to the reference at any
// GOMAXPROCS (TestScoreRowsEqualsReference).
//
// score is [Tc], iq [heads, headDim], icache [Tc, headDim], w [heads].
func ScoreRows(score, iq, icache, w []float32, heads, headDim int) {
	if headDim <= 0 || heads != len(w) || len(iq) != heads*headDim || len(icache) != len(score)*headDim {
		panic("indexer: ScoreRows shape mismatch")
	}
	tc := len(score)
	workers := min(runtime.GOMAXPROCS(0), max(tc/64, 1))
	var g errgroup.Group
	for wk := 0; wk < workers; wk++ {
		lo, hi := wk*tc/workers, (wk+1)*tc/workers
		g.Go(func() error {
			qk := make([]float32, heads) // index_qk[:, j]
			for j := lo; j < hi; j++ {
				// qk[h] = bf16(icache[j] · iq[h]): the weight-matrix form of the same dot.
				attention.BF16Linear(qk, icache[j*headDim:(j+1)*headDim], iq, heads, headDim)
				var sum float32
				for h, d := range qk {
					sum += quant.BF16Round(max(d, 0) * w[h])
				}
				score[j] = quant.BF16Round(sum)
			}
			return nil
		})
	}
	g.Wait()
}
