package indexer

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"sparsemla/attention"
)

// BenchmarkIndexerScoring times the scoring of one decode step at the V4-Flash
// dims (64 heads × 128) over Tc = ctx/4 compressed rows: index_qk, index_score
// and the top-512 selection.
//
//	go test -run '^$' -bench IndexerScoring ./indexer/
func BenchmarkIndexerScoring(b *testing.B) {
	const heads, hd, k = 64, 128, 512
	for _, ctx := range []int{4096, 65536} {
		tc := ctx / 4
		b.Run(fmt.Sprintf("ctx=%d/Tc=%d", ctx, tc), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(8, 8))
			iq := randVec(rng, heads*hd)
			icache := randVec(rng, tc*hd)
			iw := randVec(rng, heads)
			qk := make([]float32, heads*tc)
			score := make([]float32, tc)
			b.ResetTimer()
			for b.Loop() {
				IndexQK(qk, iq, icache, heads, hd)
				IndexScore(score, qk, iw)
				TopK(score, min(k, tc))
			}
		})
	}
}

// BenchmarkTopK times the selection alone: top-512 of Tc bf16-like scores with
// many exact ties (scores on a coarse grid).
func BenchmarkTopK(b *testing.B) {
	for _, tc := range []int{1024, 16384} {
		b.Run(fmt.Sprintf("Tc=%d", tc), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(9, 9))
			score := make([]float32, tc)
			for i := range score {
				score[i] = float32(rng.IntN(64)) / 8
			}
			b.ResetTimer()
			for b.Loop() {
				TopK(score, 512)
			}
		})
	}
}

// BenchmarkIndexerStep times a whole indexer decode step at the V4-Flash dims
// (dim 4096, q_lora_rank 1024, 64 heads × 128, top-512) at context 65,536
// (Tc = 16,384 keys): the FP8 query projection, RoPE, Hadamard, FQ4, the
// indexer compressor's step, the head weights and the scoring/selection.
func BenchmarkIndexerStep(b *testing.B) {
	rng := rand.New(rand.NewPCG(10, 10))
	const heads, dim, qLora, k, tc = 64, 4096, 1024, 512, 16384
	ix := randIndexer(rng, heads, dim, qLora, k)
	rope := attention.NewRopeTable(attention.RopeParams{Base: 160000, OriginalSeqLen: 65536, Factor: 16, BetaFast: 32, BetaSlow: 1}, 4*tc+4)
	icache := randVec(rng, tc*128)
	st := ix.Compressor.NewState()
	x, cq := randVec(rng, dim), randVec(rng, qLora)
	pos := int64(4*tc + 1) // a step that emits no row: Tc stays 16,384
	b.ResetTimer()
	for b.Loop() {
		ix.Step(st, icache, x, cq, pos, rope)
	}
}

// BenchmarkScoreRows is BenchmarkIndexerScoring with the fused parallel fast
// path (ScoreRows) in place of IndexQK + IndexScore.
func BenchmarkScoreRows(b *testing.B) {
	const heads, hd, k = 64, 128, 512
	for _, ctx := range []int{4096, 65536} {
		tc := ctx / 4
		b.Run(fmt.Sprintf("ctx=%d/Tc=%d", ctx, tc), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(8, 8))
			iq := randVec(rng, heads*hd)
			icache := randVec(rng, tc*hd)
			iw := randVec(rng, heads)
			score := make([]float32, tc)
			b.ResetTimer()
			for b.Loop() {
				ScoreRows(score, iq, icache, iw, heads, hd)
				TopK(score, min(k, tc))
			}
		})
	}
}
