package moe

import (
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
)

// TestFP4LinearFastBitIdentical: FP4LinearFast returns exactly the bits of
// the reference FP4Linear on random weights with every code and extreme scale
// bytes (0, 1, 254, 255 = NaN), on activations with zeros, -0, huge and
// subnormal-range values, at several GOMAXPROCS.
func TestFP4LinearFastBitIdentical(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, shape := range [][2]int{{1, 128}, {63, 256}, {200, 384}, {256, 1024}} {
		rows, cols := shape[0], shape[1]
		packed := make([]uint8, rows*cols/2)
		scale := make([]uint8, rows*cols/FP4Block)
		for i := range packed {
			packed[i] = uint8(rng.UintN(256))
		}
		for i := range scale {
			switch rng.IntN(40) {
			case 0:
				scale[i] = 0
			case 1:
				scale[i] = 255
			case 2:
				scale[i] = 254
			default:
				scale[i] = uint8(110 + rng.IntN(30))
			}
		}
		w, err := NewFP4Weight(packed, scale, rows, cols)
		if err != nil {
			t.Fatal(err)
		}
		x := randBF16(rng, cols, 1)
		x[0], x[1] = 0, float32(math.Copysign(0, -1))
		x[cols-1] = 3e4
		if cols > 200 {
			x[130] = 1e-30
		}
		want := make([]float32, rows)
		FP4Linear(want, x, w)
		for _, procs := range []int{1, 2, 3, 8} {
			runtime.GOMAXPROCS(procs)
			got := make([]float32, rows)
			FP4LinearFast(got, x, w)
			for n := range want {
				if math.Float32bits(got[n]) != math.Float32bits(want[n]) {
					t.Fatalf("[%d, %d] GOMAXPROCS %d: row %d = %v (%#x), reference %v (%#x)",
						rows, cols, procs, n, got[n], math.Float32bits(got[n]), want[n], math.Float32bits(want[n]))
				}
			}
		}
	}
}

// BenchmarkFP4Linear: one V4-Flash routed-expert projection (w1: 2048 × 4096).
func BenchmarkFP4Linear(b *testing.B) {
	rng := rand.New(rand.NewPCG(13, 14))
	w := randFP4(rng, 2048, 4096)
	x := randBF16(rng, 4096, 1)
	y := make([]float32, 2048)
	b.Run("reference", func(b *testing.B) {
		for b.Loop() {
			FP4Linear(y, x, w)
		}
	})
	b.Run("fast", func(b *testing.B) {
		for b.Loop() {
			FP4LinearFast(y, x, w)
		}
		b.ReportMetric(float64(len(w.Packed)+len(w.Scale))/(b.Elapsed().Seconds()/float64(b.N))/1e9, "GB/s")
	})
	b.Run("fast-go", func(b *testing.B) {
		defer func(u bool) { UseFP4Assembly = u }(UseFP4Assembly)
		UseFP4Assembly = false
		for b.Loop() {
			FP4LinearFast(y, x, w)
		}
		b.ReportMetric(float64(len(w.Packed)+len(w.Scale))/(b.Elapsed().Seconds()/float64(b.N))/1e9, "GB/s")
	})
}
