package indexer

import (
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
