package moe

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"sparsemla/attention"
	"sparsemla/quant"
)

// randFP4 returns a random FP4 weight [rows][cols] quantised the way the
// golden's generator does (quant.QuantizeFP4, ceil2 scale per 32).
func randFP4(rng *rand.Rand, rows, cols int) *FP4Weight {
	v := make([]float32, rows*cols)
	for i := range v {
		v[i] = quant.BF16Round(float32(rng.NormFloat64() / math.Sqrt(float64(cols))))
	}
	packed := make([]uint8, rows*cols/2)
	scale := make([]uint8, rows*cols/FP4Block)
	quant.QuantizeFP4(packed, scale, v, FP4Block, quant.ScaleCeil2, quant.FP4AmaxFloor)
	w, err := NewFP4Weight(packed, scale, rows, cols)
	if err != nil {
		panic(err)
	}
	return w
}

func randBF16(rng *rand.Rand, n int, s float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = quant.BF16Round(float32(rng.NormFloat64() * s))
	}
	return v
}

// TestFP4LinearNibbleOrder: the even column is the LOW nibble. A weight
// whose only non-zero code is the high nibble of byte 0 (column 1) must
// select x[1], not x[0].
func TestFP4LinearNibbleOrder(t *testing.T) {
	const rows, cols = 1, 128
	packed := make([]uint8, rows*cols/2)
	scale := make([]uint8, rows*cols/FP4Block)
	for i := range scale {
		scale[i] = 127 // 2^0
	}
	packed[0] = 0x2 << 4 // column 1 = code 2 = 1.0; column 0 = 0
	w, err := NewFP4Weight(packed, scale, rows, cols)
	if err != nil {
		t.Fatal(err)
	}
	x := make([]float32, cols)
	x[0], x[1] = 3, 5 // E4M3-exact after the per-128 activation scale
	y := make([]float32, 1)
	FP4Linear(y, x, w)
	if y[0] != 5 {
		t.Fatalf("FP4Linear picked %v, want x[1] = 5 (low nibble = even column)", y[0])
	}
	d := w.Dequant()
	if d[0] != 0 || d[1] != 1 {
		t.Fatalf("Dequant row starts %v %v, want 0 1", d[0], d[1])
	}
}

// TestFP4LinearAgainstDense compares FP4Linear with an fp64 product of the
// exactly dequantised operands (what the golden's torch port multiplies):
// the only difference is the fp32 summation order, so every output is
// within one bf16 ulp of the fp64 result rounded to bf16.
func TestFP4LinearAgainstDense(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const rows, cols = 64, 512
	w := randFP4(rng, rows, cols)
	x := randBF16(rng, cols, 1)
	x[7] = 40 // one large block: a different activation scale per 128
	y := make([]float32, rows)
	FP4Linear(y, x, w)
	qx := make([]float32, cols)
	sx := make([]float32, cols/128)
	quant.QuantizeActFP8(qx, sx, x, 128)
	W := w.Dequant()
	for n := 0; n < rows; n++ {
		var s float64
		for k := 0; k < cols; k++ {
			s += float64(qx[k]) * float64(sx[k/128]) * float64(W[n*cols+k])
		}
		if d := quant.BF16ULPDistance(y[n], quant.BF16Round(float32(s))); d > 1 || d < -1 {
			t.Errorf("row %d: %v, fp64 %v (%d bf16 ulp)", n, y[n], s, d)
		}
	}
}

func TestNewFP4WeightErrors(t *testing.T) {
	for _, c := range []struct {
		packed, scale, rows, cols int
		want                      string
	}{
		{64, 4, 1, 100, "multiple of 128"},
		{63, 4, 1, 128, "63 code bytes"},
		{64, 3, 1, 128, "3 scale bytes"},
	} {
		_, err := NewFP4Weight(make([]uint8, c.packed), make([]uint8, c.scale), c.rows, c.cols)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewFP4Weight(%d, %d, %d, %d) = %v, want an error with %q", c.packed, c.scale, c.rows, c.cols, err, c.want)
		}
	}
}

func TestTopK(t *testing.T) {
	nan := float32(math.NaN())
	for _, c := range []struct {
		s    []float32
		k    int
		want []int32
		tie  bool
	}{
		{[]float32{0.1, 0.9, 0.5, 0.7}, 2, []int32{1, 3}, false},
		{[]float32{0.5, 0.9, 0.5, 0.1}, 2, []int32{1, 0}, true},  // tie at the k-th place: lower index kept
		{[]float32{0.9, 0.9, 0.5, 0.1}, 2, []int32{0, 1}, false}, // tie inside the selection only
		{[]float32{0.1, nan, 0.5, 0.2}, 2, []int32{1, 2}, false}, // NaN ranks first
	} {
		got, tie := TopK(c.s, c.k)
		if len(got) != len(c.want) || tie != c.tie {
			t.Errorf("TopK(%v, %d) = %v tie %v, want %v tie %v", c.s, c.k, got, tie, c.want, c.tie)
			continue
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Errorf("TopK(%v, %d) = %v, want %v", c.s, c.k, got, c.want)
				break
			}
		}
	}
}

func TestScoreFuncs(t *testing.T) {
	if got := Softplus(21); got != 21 {
		t.Errorf("Softplus(21) = %v, want 21 (threshold 20)", got)
	}
	if got, want := Softplus(0), float32(math.Ln2); got != want {
		t.Errorf("Softplus(0) = %v, want %v", got, want)
	}
	l := []float32{1, 2, 3}
	ApplyScoreFunc(l, Softmax)
	var sum float64
	for _, v := range l {
		sum += float64(v)
	}
	if math.Abs(sum-1) > 1e-6 || !(l[2] > l[1] && l[1] > l[0]) {
		t.Errorf("softmax = %v", l)
	}
	l = []float32{0}
	ApplyScoreFunc(l, Sigmoid)
	if l[0] != 0.5 {
		t.Errorf("sigmoid(0) = %v", l[0])
	}
	if _, err := ParseScoreFunc("relu"); err == nil {
		t.Error("ParseScoreFunc accepted relu")
	}
}

// TestRouteWeights: scores are normalised over the chosen experts except for
// softmax, then scaled; the bias chooses but never weighs.
func TestRouteWeights(t *testing.T) {
	g := Gate{Experts: 3, TopK: 2, Dim: 2, Func: Sigmoid, RouteScale: 2,
		Weight: []float32{1, 0, 0, 1, -1, 0}, Bias: []float32{0, 0, 10}}
	r, err := g.Route([]float32{1, 2}, 0)
	if err != nil {
		t.Fatal(err)
	}
	// logits 1, 2, -1; the bias makes expert 2 win the selection.
	if r.Indices[0] != 2 || r.Indices[1] != 1 {
		t.Fatalf("indices %v, want [2 1]", r.Indices)
	}
	s2, s1 := Sigmoid32(-1), Sigmoid32(2)
	want0 := s2 / (s2 + s1) * 2
	if r.Weights[0] != want0 {
		t.Errorf("weight 0 = %v, want %v (unbiased score, normalised, × route_scale)", r.Weights[0], want0)
	}
	w := RouteWeights([]float32{0.25, 0.5}, []int32{1, 0}, Softmax, 2)
	if w[0] != 1 || w[1] != 0.5 {
		t.Errorf("softmax weights %v, want [1 0.5] (no normalisation)", w)
	}
}

// Sigmoid32 is the test's own transcription of torch.sigmoid on fp32.
func Sigmoid32(v float32) float32 { return 1 / (1 + float32(math.Exp(float64(-v)))) }

func TestHashRouteErrors(t *testing.T) {
	g := Gate{Experts: 2, TopK: 1, Dim: 1, Func: SqrtSoftplus, RouteScale: 1, Weight: []float32{1, 1}, TID2EID: []int32{1, 5}}
	if _, err := g.Route([]float32{1}, 2); err == nil || !strings.Contains(err.Error(), "outside tid2eid") {
		t.Errorf("token 2 of a 2-token table: %v", err)
	}
	if _, err := g.Route([]float32{1}, 1); err == nil || !strings.Contains(err.Error(), "tid2eid[1][0] = 5") {
		t.Errorf("expert id 5 of 2: %v", err)
	}
	r, err := g.Route([]float32{1}, 0)
	if err != nil || r.Indices[0] != 1 || r.Weights[0] != 1 {
		t.Errorf("hash route of token 0 = %+v, %v; want expert 1, weight 1", r, err)
	}
}

// TestSwiGLUClamp: up is clamped on both sides, gate from above only, and
// only with a positive limit.
func TestSwiGLUClamp(t *testing.T) {
	g := []float32{-30, 30, 2}
	u := []float32{-30, 30, 3}
	h := make([]float32, 3)
	SwiGLU(h, g, u, 10, 1, true)
	want := []float32{
		quant.BF16Round(Silu(-30) * -10),
		quant.BF16Round(Silu(10) * 10),
		quant.BF16Round(Silu(2) * 3),
	}
	for i := range h {
		if h[i] != want[i] {
			t.Errorf("clamped h[%d] = %v, want %v", i, h[i], want[i])
		}
	}
	SwiGLU(h, g, u, 0, 0, false)
	if h[1] != quant.BF16Round(Silu(30)*30) {
		t.Errorf("unclamped h[1] = %v", h[1])
	}
	SwiGLU(h, g, u, 10, 0.5, true)
	if h[2] != quant.BF16Round(0.5*float32(Silu(2)*3)) {
		t.Errorf("weighted h[2] = %v", h[2])
	}
}

// TestCombine: experts are summed in expert-id order with the shared expert
// last; a repeated expert id keeps only the later slot (the official
// `y[idx] += …` writes one row twice); a bad index is an error.
func TestCombine(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const dim, inter = 128, 128
	m := &MoE{SwigluLimit: 10, Gate: Gate{Experts: 3}}
	for e := 0; e < 3; e++ {
		m.Experts = append(m.Experts, &Expert{W1: randFP4(rng, inter, dim), W2: randFP4(rng, dim, inter), W3: randFP4(rng, inter, dim)})
	}
	fp8 := func() *attention.FP8Weight {
		v := randBF16(rng, dim*inter, 1/math.Sqrt(dim))
		return attention.QuantizeFP8Weight(v, dim, inter)
	}
	m.Shared = &Shared{W1: fp8(), W2: fp8(), W3: fp8()}
	x := randBF16(rng, dim, 1)

	got, err := m.Combine(x, []int32{2, 0}, []float32{0.7, 0.3})
	if err != nil {
		t.Fatal(err)
	}
	y := make([]float32, dim)
	out := make([]float32, dim)
	m.Experts[0].Forward(out, x, 0.3, 10)
	copy(y, out)
	m.Experts[2].Forward(out, x, 0.7, 10)
	for i := range y {
		y[i] += out[i]
	}
	m.Shared.Forward(out, x)
	for i := range y {
		y[i] = quant.BF16Round(y[i] + out[i])
	}
	for i := range y {
		if got[i] != y[i] {
			t.Fatalf("Combine[%d] = %v, want %v", i, got[i], y[i])
		}
	}

	dup, err := m.Combine(x, []int32{1, 1}, []float32{0.2, 0.9})
	if err != nil {
		t.Fatal(err)
	}
	later, _ := m.Combine(x, []int32{1}, []float32{0.9})
	for i := range dup {
		if dup[i] != later[i] {
			t.Fatalf("repeated expert: out[%d] = %v, want the later slot's %v", i, dup[i], later[i])
		}
	}
	if _, err := m.Combine(x, []int32{3}, []float32{1}); err == nil {
		t.Error("Combine accepted expert id 3 of 3")
	}
	held := m.Experts[1]
	m.Experts[1] = nil
	if _, err := m.Combine(x, []int32{1}, []float32{1}); err == nil {
		t.Error("Combine accepted a routed expert without weights")
	}
	src := &countingSource{e: held}
	m.Source = src
	lazy, err := m.Combine(x, []int32{1}, []float32{0.9})
	if err != nil || src.calls != 1 {
		t.Fatalf("Combine with a Source: %v, %d calls", err, src.calls)
	}
	for i := range lazy {
		if lazy[i] != later[i] {
			t.Fatalf("expert from the Source: out[%d] = %v, want %v", i, lazy[i], later[i])
		}
	}
}

type countingSource struct {
	e     *Expert
	calls int
}

func (s *countingSource) Expert(e int) (*Expert, error) {
	s.calls++
	return s.e, nil
}
