package moe

import (
	"math"
	"math/rand/v2"
	"testing"

	"sparsemla/attention"
	"sparsemla/quant"
)

func variantMoE(rng *rand.Rand, dim, inter int) *MoE {
	m := &MoE{SwigluLimit: 10, Gate: Gate{Experts: 3}}
	for e := 0; e < 3; e++ {
		m.Experts = append(m.Experts, &Expert{W1: randFP4(rng, inter, dim), W2: randFP4(rng, dim, inter), W3: randFP4(rng, inter, dim)})
	}
	fp8 := func(rows, cols int) *attention.FP8Weight {
		return attention.QuantizeFP8Weight(randBF16(rng, rows*cols, 1/math.Sqrt(float64(cols))), rows, cols)
	}
	m.Shared = &Shared{W1: fp8(inter, dim), W2: fp8(dim, inter), W3: fp8(inter, dim)}
	return m
}

// TestFP4Variants: NibbleSwapped and ScalePer128 are the decode rules they
// name, checked on the dequantised values: column k of the swapped weight
// is the code of column k^1, and column k of a scale-per-128 weight is
// scaled by the row's scale byte k/128 (not k/32).
func TestFP4Variants(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	w := randFP4(rng, 4, 256)
	ref := w.Dequant()
	sw := w.NibbleSwapped().Dequant()
	sc := w.ScalePer128().Dequant()
	changed := false
	for n := 0; n < w.Rows; n++ {
		for k := 0; k < w.Cols; k++ {
			code := w.Packed[(n*w.Cols+(k^1))/2] >> (4 * uint((k^1)&1)) & 0xf
			want := quant.DecodeE2M1(code) * quant.DecodeUE8M0(w.Scale[n*w.Cols/FP4Block+k/FP4Block])
			if got := sw[n*w.Cols+k]; got != want {
				t.Fatalf("NibbleSwapped [%d][%d] = %v, want %v", n, k, got, want)
			}
			c := w.Packed[(n*w.Cols+k)/2] >> (4 * uint(k&1)) & 0xf
			want = quant.DecodeE2M1(c) * quant.DecodeUE8M0(w.Scale[n*w.Cols/FP4Block+k/128])
			if got := sc[n*w.Cols+k]; got != want {
				t.Fatalf("ScalePer128 [%d][%d] = %v, want %v", n, k, got, want)
			}
			changed = changed || sc[n*w.Cols+k] != ref[n*w.Cols+k]
		}
	}
	if !changed {
		t.Error("ScalePer128 changed no value of a random weight")
	}
	if !bitsSame(w.NibbleSwapped().NibbleSwapped().Dequant(), ref) {
		t.Error("swapping the nibbles twice is not the identity")
	}
}

// TestCombineWith: with the shared expert's own forward CombineWith is
// Combine bit for bit; nil leaves the shared expert out; the shared
// variants (GateUpSwapped, ForwardClamped, ForwardActPerToken) are what they
// say, and WithRouted changes only the routed experts named.
func TestCombineWith(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	const dim, inter = 256, 128
	m := variantMoE(rng, dim, inter)
	x := randBF16(rng, dim, 1)
	idx, w := []int32{2, 0}, []float32{0.7, 0.3}
	want, err := m.Combine(x, idx, w)
	if err != nil {
		t.Fatal(err)
	}
	got, err := m.CombineWith(x, idx, w, m.Shared.Forward)
	if err != nil || !bitsSame(got, want) {
		t.Fatalf("CombineWith(Shared.Forward) differs from Combine (%v)", err)
	}
	ns := *m
	ns.Shared = nil
	noShared, _ := ns.Combine(x, idx, w)
	if got, _ := m.CombineWith(x, idx, w, nil); !bitsSame(got, noShared) {
		t.Error("CombineWith(nil) is not Combine without the shared expert")
	}
	sw := *m
	sw.Shared = m.Shared.GateUpSwapped()
	a, _ := sw.Combine(x, idx, w)
	if sw.Shared.W1 != m.Shared.W3 || sw.Shared.W3 != m.Shared.W1 || sw.Shared.W2 != m.Shared.W2 || bitsSame(a, want) {
		t.Error("GateUpSwapped does not exchange w1 and w3 (or changes nothing)")
	}
	// A limit above every activation: the clamped shared expert is the
	// plain one; a tiny limit changes it.
	big, _ := m.CombineWith(x, idx, w, func(out, x []float32) { m.Shared.ForwardClamped(out, x, 1e30) })
	small, _ := m.CombineWith(x, idx, w, func(out, x []float32) { m.Shared.ForwardClamped(out, x, 0.01) })
	if !bitsSame(big, want) || bitsSame(small, want) {
		t.Error("ForwardClamped: a huge limit must not act, a tiny one must")
	}
	// One 128-column block: per token and per 128 are the same scale.
	one := attention.QuantizeFP8Weight(randBF16(rng, 64*128, 0.1), 64, 128)
	xs := randBF16(rng, 128, 1)
	y1, y2 := make([]float32, 64), make([]float32, 64)
	attention.FP8Linear(y1, xs, one)
	FP8LinearPerToken(y2, xs, one)
	if !bitsSame(y1, y2) {
		t.Error("FP8LinearPerToken over one block differs from FP8Linear")
	}
	// Two blocks 10^5 apart: under the per-token scale the small block's
	// values fall into E4M3's subnormals (the large block's weights are
	// zero, so only the small block counts).
	x2 := append(randBF16(rng, 128, 1e-3), randBF16(rng, 128, 100)...)
	wv := randBF16(rng, 64*256, 0.1)
	for n := 0; n < 64; n++ {
		clear(wv[n*256+128 : (n+1)*256])
	}
	two := attention.QuantizeFP8Weight(wv, 64, 256)
	y3, y4 := make([]float32, 64), make([]float32, 64)
	attention.FP8Linear(y3, x2, two)
	FP8LinearPerToken(y4, x2, two)
	if bitsSame(y3, y4) {
		t.Error("FP8LinearPerToken equals FP8Linear on blocks 10^4 apart")
	}
	only, err := m.WithRouted([]int32{2}, func(e *Expert) *Expert { return e.Map((*FP4Weight).NibbleSwapped) })
	if err != nil || only.Experts[0] != nil || only.Experts[1] != nil || only.Experts[2] == m.Experts[2] || m.Experts[2].W1.Packed[0] != m.Experts[2].W1.Packed[0] {
		t.Fatalf("WithRouted: %v", err)
	}
	if _, err := m.WithRouted([]int32{3}, func(e *Expert) *Expert { return e }); err == nil {
		t.Error("WithRouted accepted expert id 3 of 3")
	}
}

func bitsSame(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}
