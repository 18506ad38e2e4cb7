package indexer

import (
	"fmt"
	"math/rand/v2"
	"testing"
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
