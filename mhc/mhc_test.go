package mhc

import (
	"math"
	"math/rand/v2"
	"testing"

	"sparsemla/quant"
)

// TestSinkhornDoublyStochastic: after the iterations every row and column of
// comb sums to 1 within the eps terms, every entry is positive, and pre, post
// lie in (eps, 1+eps) and (0, 2).
func TestSinkhornDoublyStochastic(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const hc = 4
	for trial := 0; trial < 50; trial++ {
		mixes := make([]float32, NMixes(hc))
		base := make([]float32, NMixes(hc))
		for i := range mixes {
			mixes[i] = float32(rng.NormFloat64() * 3)
			base[i] = float32(rng.NormFloat64() * 0.1)
		}
		scale := []float32{0.5, 0.6, 0.4}
		pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
		SplitSinkhorn(pre, post, comb, mixes, scale, base, hc, 20, 1e-6)
		for j := 0; j < hc; j++ {
			if !(pre[j] > 1e-6 && pre[j] <= 1+1e-6) || !(post[j] > 0 && post[j] < 2) {
				t.Fatalf("pre %v post %v out of range", pre, post)
			}
			var row, col float64
			for k := 0; k < hc; k++ {
				if !(comb[j*hc+k] > 0) {
					t.Fatalf("comb %v has a non-positive entry", comb)
				}
				row += float64(comb[j*hc+k])
				col += float64(comb[k*hc+j])
			}
			if math.Abs(col-1) > 1e-5 || math.Abs(row-1) > 1e-3 {
				t.Fatalf("trial %d: row %d sums to %v, column to %v", trial, j, row, col)
			}
		}
	}
}

// TestSplitSinkhornFirstIteration: with one iteration comb is the row
// softmax plus eps, column-normalised — written out independently.
func TestSplitSinkhornFirstIteration(t *testing.T) {
	const hc = 2
	mixes := []float32{0, 0, 0, 0, 1, 2, 3, 5}
	base := make([]float32, NMixes(hc))
	scale := []float32{1, 1, 1}
	pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
	SplitSinkhorn(pre, post, comb, mixes, scale, base, hc, 1, 0)
	if pre[0] != 0.5 || post[0] != 1 {
		t.Fatalf("pre %v post %v, want 0.5 and 1 at mixes 0", pre, post)
	}
	r0 := []float64{1 / (1 + math.E), math.E / (1 + math.E)}
	r1 := []float64{1 / (1 + math.E*math.E), math.E * math.E / (1 + math.E*math.E)}
	want := []float64{r0[0] / (r0[0] + r1[0]), r0[1] / (r0[1] + r1[1]), r1[0] / (r0[0] + r1[0]), r1[1] / (r0[1] + r1[1])}
	for i := range comb {
		if math.Abs(float64(comb[i])-want[i]) > 1e-6 {
			t.Fatalf("comb %v, want %v", comb, want)
		}
	}
}

// TestPostAndCollapse checks hc_post's index roles (comb[k][j] reads stream
// k into stream j) and the collapse against fp64 on random bf16 data: each
// output is the fp64 value rounded to bf16 within one ulp.
func TestPostAndCollapse(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	const hc, dim = 4, 64
	h := make([]float32, hc*dim)
	a := make([]float32, dim)
	for i := range h {
		h[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	for i := range a {
		a[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
	for j := range pre {
		pre[j], post[j] = rng.Float32(), 2*rng.Float32()
	}
	for i := range comb {
		comb[i] = rng.Float32()
	}
	out := make([]float32, hc*dim)
	Post(out, a, h, post, comb)
	x := make([]float32, dim)
	Collapse(x, h, pre)
	for i := 0; i < dim; i++ {
		var c float64
		for j := 0; j < hc; j++ {
			c += float64(pre[j]) * float64(h[j*dim+i])
			r := float64(post[j]) * float64(a[i])
			for k := 0; k < hc; k++ {
				r += float64(comb[k*hc+j]) * float64(h[k*dim+i])
			}
			if d := quant.BF16ULPDistance(out[j*dim+i], quant.BF16Round(float32(r))); d > 1 || d < -1 {
				t.Fatalf("Post[%d][%d] = %v, fp64 %v", j, i, out[j*dim+i], r)
			}
		}
		if d := quant.BF16ULPDistance(x[i], quant.BF16Round(float32(c))); d > 1 || d < -1 {
			t.Fatalf("Collapse[%d] = %v, fp64 %v", i, x[i], c)
		}
	}
}

// TestMixes checks the RMS scaling: scaling the streams by 2^k leaves the
// mixes unchanged (exact: a power of two passes through every fp32 op), and
// the value against fp64.
func TestMixes(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	const n, m = 256, 6
	h := make([]float32, n)
	fn := make([]float32, m*n)
	for i := range h {
		h[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	for i := range fn {
		fn[i] = float32(rng.NormFloat64() * 0.01)
	}
	got := make([]float32, m)
	Mixes(got, h, fn, 0)
	h4 := make([]float32, n)
	for i, v := range h {
		h4[i] = 4 * v
	}
	got4 := make([]float32, m)
	Mixes(got4, h4, fn, 0)
	var ss float64
	for _, v := range h {
		ss += float64(v) * float64(v)
	}
	rho := 1 / math.Sqrt(ss/n)
	for r := range got {
		if got4[r] != got[r] {
			t.Errorf("mixes[%d]: %v at 4h, %v at h", r, got4[r], got[r])
		}
		var s float64
		for c, v := range h {
			s += float64(fn[r*n+c]) * float64(v)
		}
		if math.Abs(float64(got[r])-s*rho) > 1e-5*math.Abs(s*rho)+1e-7 {
			t.Errorf("mixes[%d] = %v, fp64 %v", r, got[r], s*rho)
		}
	}
}

func TestHeadPreAndExpand(t *testing.T) {
	pre := make([]float32, 2)
	HeadPre(pre, []float32{0, 2}, []float32{0, -1}, 0.5, 1e-6)
	if pre[0] != 0.5+1e-6 || pre[1] != Sigmoid(0)+1e-6 {
		t.Errorf("HeadPre = %v", pre)
	}
	h := make([]float32, 6)
	Expand(h, []float32{1, 2}, 3)
	for i, v := range []float32{1, 2, 1, 2, 1, 2} {
		if h[i] != v {
			t.Fatalf("Expand = %v", h)
		}
	}
}
