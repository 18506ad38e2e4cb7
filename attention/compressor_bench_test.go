package attention

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkCompressorStep times one decode step of the main compressor at the
// V4-Flash dims (dim 4096, d 512) at a position that emits a row (project both
// fp32 GEMMs, ingest, pool, shift, norm, RoPE, FQ8):
//
//	go test -run '^$' -bench CompressorStep ./attention/
func BenchmarkCompressorStep(b *testing.B) {
	rope := NewRopeTable(RopeParams{Base: 160000, OriginalSeqLen: 65536, Factor: 16, BetaFast: 32, BetaSlow: 1}, 1024)
	for _, tc := range []struct {
		r, d   int
		rotate bool
	}{{4, 512, false}, {128, 512, false}, {4, 128, true}} {
		name := fmt.Sprintf("r=%d/d=%d", tc.r, tc.d)
		b.Run(name, func(b *testing.B) {
			rng := rand.New(rand.NewPCG(7, 7))
			c := randCompressor(rng, tc.r, tc.d, 4096, tc.rotate)
			x := randTokens(rng, 1, 4096)[0]
			st := c.NewState()
			for p := 0; p < tc.r-1; p++ {
				c.Step(st, x, int64(p), rope)
			}
			pos := int64(tc.r - 1) // emits row 0
			b.ResetTimer()
			for b.Loop() {
				s := st.Clone()
				c.Step(s, x, pos, rope)
			}
		})
	}
}
