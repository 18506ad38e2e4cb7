package kvcache

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"sparsemla/quant"
)

func randBF16(rng *rand.Rand, n int, s float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = quant.BF16Round(float32(rng.NormFloat64() * s))
	}
	return v
}

// TestV41RowsLossless: the model's rows (FQ8/32 window K, FQ4E4M3/16
// compressed rows, FQ4/32 index keys) survive the cache rows bit for bit, and
// a writer that quantises the pre-quantisation row stores the model's values.
func TestV41RowsLossless(t *testing.T) {
	rng := rand.New(rand.NewPCG(41, 1))
	for trial := 0; trial < 300; trial++ {
		s := float64(1 + rng.IntN(8))
		for _, c := range []struct {
			row  V41Row
			fake func([]float32)
		}{
			{V41WindowFP8, func(v []float32) { quant.FQ8(v, 32) }},
			{V41KVFP4, func(v []float32) { quant.FQ4E4M3(v, 16) }},
			{V41IndexFP4, func(v []float32) { quant.FQ4(v, 32) }},
		} {
			pre := randBF16(rng, c.row.Dims(), s)
			model := slices.Clone(pre)
			c.fake(model)
			buf := make([]byte, c.row.RowBytes())
			got := make([]float32, c.row.Dims())
			for _, in := range [][]float32{model, pre} {
				c.row.EncodeRow(buf, in)
				if err := c.row.DecodeRow(got, buf); err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(got, model) {
					t.Fatalf("%s trial %d: decoded row differs from the model's values", c.row, trial)
				}
			}
		}
	}
	if V41WindowFP8.RowBytes() != 528 || V41KVFP4.RowBytes() != 288 || V41IndexFP4.RowBytes() != 68 {
		t.Errorf("row sizes %d %d %d, want 528 288 68", V41WindowFP8.RowBytes(), V41KVFP4.RowBytes(), V41IndexFP4.RowBytes())
	}
}

// TestV41RowBytes: a hand-made compressed row decodes to the values the
// layout says (low nibble = even dim, E4M3 scale per 16).
func TestV41RowBytes(t *testing.T) {
	buf := make([]byte, 288)
	buf[0] = 0x2 | 0xB<<4 // dim 0: code 2 (1.0), dim 1: code 0xB (−1.5)
	buf[256] = 0x38       // E4M3 1.0 for dims 0..15
	buf[257] = 0x40       // E4M3 2.0 for dims 16..31
	buf[8] = 0x07         // dim 16: code 7 (6.0) → 12
	got := make([]float32, 512)
	if err := V41KVFP4.DecodeRow(got, buf); err != nil {
		t.Fatal(err)
	}
	if got[0] != 1 || got[1] != -1.5 || got[16] != 12 || got[17] != 0 {
		t.Errorf("decoded %v %v %v %v, want 1 -1.5 12 0", got[0], got[1], got[16], got[17])
	}
	buf[256+5] = 0x7f
	_, err := V41KVFP4.DecodeRows(append(make([]byte, 288), buf...))
	if err == nil || !strings.Contains(err.Error(), "row 1 (page offset 288)") || !strings.Contains(err.Error(), "byte 261 (scale of dims 80…95)") {
		t.Errorf("NaN scale error = %v", err)
	}
	w := make([]byte, 528)
	w[3] = 0xff
	if err := V41WindowFP8.DecodeRow(make([]float32, 512), w); err == nil || !strings.Contains(err.Error(), "byte 3") {
		t.Errorf("NaN code error = %v", err)
	}
	if _, err := V41IndexFP4.DecodeRows(make([]byte, 69)); err == nil {
		t.Errorf("a page of 69 bytes was accepted")
	}
}

// TestV41Budget is V41-D's 890 B per token of V4.1-Flash (KV sources 2, 8, 14
// at r = 2 and 20 at r = 1): 2.5 compressed rows and 2.5 index keys per token.
func TestV41Budget(t *testing.T) {
	if got := V41BytesPerToken([]int{2, 2, 2, 1}); got != 890 {
		t.Errorf("V41BytesPerToken = %g, want 890", got)
	}
}
