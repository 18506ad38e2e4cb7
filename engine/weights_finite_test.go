package engine

import (
	"math"
	"testing"
)

// TestWeightFiniteScans checks the two scans LoadLayerWeights uses to refuse
// non-finite weights: every position of an E4M3 NaN code (0x7F, 0xFF) is
// found, in and after the eight-code words, and no finite code is taken for
// one; every NaN/inf float is found.
func TestWeightFiniteScans(t *testing.T) {
	codes := make([]uint8, 37)
	for i := range codes {
		codes[i] = uint8(i*5) & 0x7E // finite codes, both signs' low bits
		if i%3 == 0 {
			codes[i] |= 0x80
		}
	}
	if i := firstE4M3NaN(codes); i != -1 {
		t.Fatalf("finite codes: NaN reported at %d", i)
	}
	for c := 0; c < 256; c++ {
		one := []uint8{uint8(c)}
		want := -1
		if c&0x7F == 0x7F {
			want = 0
		}
		if got := firstE4M3NaN(one); got != want {
			t.Fatalf("code 0x%02X: got %d, want %d", c, got, want)
		}
	}
	for j := range codes {
		for _, nan := range []uint8{0x7F, 0xFF} {
			c := append([]uint8(nil), codes...)
			c[j] = nan
			if j+1 < len(c) {
				c[len(c)-1] = 0xFF // a later NaN must not hide the first
			}
			if got := firstE4M3NaN(c); got != j {
				t.Fatalf("NaN 0x%02X at %d: got %d", nan, j, got)
			}
		}
	}
	v := []float32{0, -1, math.MaxFloat32, -math.SmallestNonzeroFloat32}
	if i := firstNonFinite(v); i != -1 {
		t.Fatalf("finite floats: %d", i)
	}
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		w := append(append([]float32(nil), v...), bad, 1)
		if i := firstNonFinite(w); i != len(v) {
			t.Fatalf("%g: got %d, want %d", bad, i, len(v))
		}
	}
}

// BenchmarkWeightFiniteScan measures the cost of refusing non-finite weights
// on one V4-Pro-sized FP8 matrix (wq_b, 4096 × 7168 codes): the code scan
// (about 3 ms per 29 M codes on one core) is well under the dequantisation
// the load does anyway.
func BenchmarkWeightFiniteScan(b *testing.B) {
	codes := make([]uint8, 4096*7168)
	for i := range codes {
		codes[i] = uint8(i*7) & 0x7E
	}
	b.SetBytes(int64(len(codes)))
	for b.Loop() {
		if firstE4M3NaN(codes) >= 0 {
			b.Fatal("NaN in finite codes")
		}
	}
}
