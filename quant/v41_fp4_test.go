package quant

import (
	"math"
	"math/rand/v2"
	"testing"
)

// fq4e4m3Literal is FQ4E4M3 transcribed from V41-K's torch form in float64
// where torch computes in fp32 only at the points it rounds: amax, the scale
// (fp32 division, then the E4M3 cast through the reference encoder), the
// quotient (fp32 division), the E2M1 rounding by nearest grid value with ties
// to the even code.
func fq4e4m3Literal(v []float32, B int) []float32 {
	grid := []float64{0, 0.5, 1, 1.5, 2, 3, 4, 6}
	e2m1 := func(x float32) float32 {
		a := math.Abs(float64(x))
		best := 0
		for i := range grid {
			d, bd := math.Abs(a-grid[i]), math.Abs(a-grid[best])
			if d < bd || (d == bd && i%2 == 0 && best%2 == 1) {
				best = i
			}
		}
		return float32(math.Copysign(grid[best], float64(x)))
	}
	out := make([]float32, len(v))
	for b := 0; b < len(v); b += B {
		var amax float32
		for _, x := range v[b : b+B] {
			amax = max(amax, float32(math.Abs(float64(x))))
		}
		t := max(amax, float32(6*math.Pow(2, -9))) / 6
		t = min(t, 448)
		s := DecodeE4M3(encodeE4M3Ref(t))
		for i, x := range v[b : b+B] {
			q := x / s
			q = min(max(q, -6), 6)
			out[b+i] = BF16Round(e2m1(q) * s)
		}
	}
	return out
}

func TestFQ4E4M3Values(t *testing.T) {
	for _, c := range []struct {
		name string
		in   []float32
		want []float32
	}{
		// amax 6: s = E4M3(1) = 1, the values are E2M1 themselves.
		{"scale one", []float32{6, -0.25, 0.75, 1.25, 2.5, 3.5, 5, -6}, []float32{6, 0, 1, 1, 2, 4, 4, -6}},
		// amax 7: s = E4M3(7/6 = 1.1667) = 1.125; 7/1.125 = 6.22 clamps to 6 → 6.75.
		{"saturating block", []float32{7, 1, 0, 0, 0, 0, 0, 0}, []float32{6.75, 1.125, 0, 0, 0, 0, 0, 0}},
		// all zero: floor 6·2^-9 → s = 2^-9.
		{"zero block", make([]float32, 8), make([]float32, 8)},
		// huge: s saturates at 448, 1e6/448 clamps to 6 → 2688.
		{"satfinite scale", []float32{1e6, -1e6, 0, 0, 0, 0, 0, 0}, []float32{2688, -2688, 0, 0, 0, 0, 0, 0}},
	} {
		got := append([]float32(nil), c.in...)
		FQ4E4M3(got, 8)
		for i := range got {
			if got[i] != c.want[i] {
				t.Errorf("%s: FQ4E4M3(%v)[%d] = %g, want %g", c.name, c.in, i, got[i], c.want[i])
			}
		}
	}
	if FP4E4M3Scale(0) != 0x01 { // 2^-9, the smallest subnormal
		t.Errorf("FP4E4M3Scale(0) = %#x, want 0x01", FP4E4M3Scale(0))
	}
}

func TestFQ4E4M3MatchesLiteral(t *testing.T) {
	rng := rand.New(rand.NewPCG(41, 16))
	for trial := 0; trial < 2000; trial++ {
		v := make([]float32, 64)
		mag := math.Pow(2, float64(rng.IntN(40)-25))
		for i := range v {
			v[i] = BF16Round(float32(rng.NormFloat64() * mag))
		}
		got := append([]float32(nil), v...)
		FQ4E4M3(got, 16)
		want := fq4e4m3Literal(v, 16)
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) && !(got[i] == 0 && want[i] == 0) {
				t.Fatalf("trial %d: FQ4E4M3[%d] of %g = %g, literal %g", trial, i, v[i], got[i], want[i])
			}
		}
		// Storing the codes and scales is exact: the cache holds FQ4E4M3's values.
		packed, scales := make([]uint8, 32), make([]uint8, 4)
		QuantizeFP4E4M3(packed, scales, v, 16)
		back := make([]float32, 64)
		DequantizeFP4E4M3(back, packed, scales, 16)
		for i := range back {
			if back[i] != got[i] {
				t.Fatalf("trial %d: stored value %d = %g, FQ4E4M3 %g", trial, i, back[i], got[i])
			}
		}
	}
}

// TestFQ4E4M3Idempotence: re-quantising a row already on the grid gives it back
// when the block's scale is a normal E4M3 (≥ 2^-6): the largest code is then
// always 6, so amax' = 6s and the recomputed scale is s. For tiny blocks with a
// subnormal scale it is not: a re-quantising cache writer would change them.
func TestFQ4E4M3Idempotence(t *testing.T) {
	rng := rand.New(rand.NewPCG(41, 17))
	for trial := 0; trial < 2000; trial++ {
		v := make([]float32, 16)
		for i := range v {
			v[i] = BF16Round(float32(rng.NormFloat64() * 0.5))
		}
		v[0] = 1 // amax ≥ 1: a normal scale
		FQ4E4M3(v, 16)
		again := append([]float32(nil), v...)
		FQ4E4M3(again, 16)
		for i := range v {
			if again[i] != v[i] {
				t.Fatalf("trial %d: FQ4E4M3 not idempotent at %d: %g → %g", trial, i, v[i], again[i])
			}
		}
	}
	// amax/6 = 1.6·2^-9 → s = 2^-8, amax/s = 4.8 → code 4: amax' = 4s gives s' = 2^-9.
	v := make([]float32, 16)
	v[0] = BF16Round(float32(6 * 1.6 * math.Pow(2, -9)))
	FQ4E4M3(v, 16)
	again := append([]float32(nil), v...)
	FQ4E4M3(again, 16)
	if again[0] == v[0] && FP4E4M3Scale(v[0]) == FP4E4M3Scale(BF16Round(float32(6*1.6*math.Pow(2, -9)))) {
		t.Errorf("tiny block: expected the recomputed scale to differ (value %g, again %g)", v[0], again[0])
	}
}
