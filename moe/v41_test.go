package moe

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"sparsemla/attention"
	"sparsemla/quant"
)

func v41TestMoE(t *testing.T, limit float32) (*V41MoE, []float32) {
	t.Helper()
	r := rand.New(rand.NewPCG(41, 1))
	dim, inter, E := 64, 32, 4
	g := V41Gate{Experts: E, TopK: 2, Dim: dim, Func: SqrtSoftplus, Temp: 1, NormTopK: true, RouteScale: 1.5,
		Weight: make([]float32, E*dim), Bias: make([]float32, E)}
	for i := range g.Weight {
		g.Weight[i] = quant.BF16Round(float32(r.NormFloat64() / 8))
	}
	for i := range g.Bias {
		g.Bias[i] = float32(r.NormFloat64() / 10)
	}
	m := &V41MoE{Gate: g, SwigluLimit: limit, SharedLimit: limit}
	for e := 0; e < E; e++ {
		m.Experts = append(m.Experts, &V41Expert{W1: RandomV41FP4Weight(r, inter, dim), W2: RandomV41FP4Weight(r, dim, inter), W3: RandomV41FP4Weight(r, inter, dim)})
	}
	fp8 := func(rows, cols int) *attention.V41FP8Weight {
		w := make([]float32, rows*cols)
		for i := range w {
			w[i] = float32(r.NormFloat64())
		}
		return attention.QuantizeV41FP8Weight(w, rows, cols)
	}
	m.Shared = &V41Shared{W1: fp8(inter, dim), W2: fp8(dim, inter), W3: fp8(inter, dim)}
	x := make([]float32, dim)
	for i := range x {
		x[i] = quant.BF16Round(float32(4 * r.NormFloat64()))
	}
	return m, x
}

// TestV41FP4LinearBlocks: V41FP4Linear is the dequantised dot product with
// the activation quantised per 32 (checked in float64 against the exact
// dequantised operands), and differs from V4's per-128 FP4Linear on an
// input whose 32-blocks have different magnitudes.
func TestV41FP4LinearBlocks(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	w := RandomV41FP4Weight(r, 8, 128)
	x := make([]float32, 128)
	for i := range x {
		x[i] = quant.BF16Round(float32(r.NormFloat64()))
		if i >= 96 {
			x[i] *= 4096 // one large block sets V4's per-128 scale
		}
	}
	for n := 0; n < 8; n++ {
		for k := 96; k < 128; k += 2 {
			w.Packed[n*64+k/2] = 0 // the large block meets zero weights: only the small blocks count
		}
	}
	y := make([]float32, 8)
	V41FP4Linear(y, x, w)
	qx, sx := make([]float32, 128), make([]float32, 4)
	quant.QuantizeActFP8(qx, sx, x, 32)
	wd := w.Dequant()
	for n := range y {
		var s float64
		for k := range x {
			s += float64(qx[k]) * float64(sx[k/32]) * float64(wd[n*128+k])
		}
		if d := math.Abs(float64(y[n]) - s); d > 1e-2*math.Abs(s)+1e-6 {
			t.Errorf("row %d: %g, float64 %g", n, y[n], s)
		}
	}
	v4 := make([]float32, 8)
	FP4Linear(v4, x, w)
	same := true
	for n := range y {
		same = same && y[n] == v4[n]
	}
	if same {
		t.Error("activation blocks of 32 and of 128 give the same outputs on blocks of different magnitudes")
	}
}

// TestV41RouteWeights: the V4.1 rule normalises softmax scores too (V4 does
// not), adds 1e-20 to the sum (all-zero scores give 0, not NaN), and leaves
// k = 1 unnormalised.
func TestV41RouteWeights(t *testing.T) {
	s := []float32{0.1, 0.2, 0.3, 0.4}
	w := V41RouteWeights(s, []int32{3, 2}, true, 2)
	sum := s[3] + s[2] + 1e-20
	want := []float32{s[3] / sum * 2, s[2] / sum * 2}
	for i := range w {
		if w[i] != want[i] {
			t.Errorf("w[%d] = %g, want %g", i, w[i], want[i])
		}
	}
	if v4 := RouteWeights(s, []int32{3, 2}, Softmax, 2); v4[0] == w[0] {
		t.Error("V4's softmax rule (no division) equals V4.1's")
	}
	z := V41RouteWeights([]float32{0, 0, 0}, []int32{0, 1}, true, 1)
	if z[0] != 0 || z[1] != 0 {
		t.Errorf("zero scores: %v, want 0 (the + 1e-20)", z)
	}
	if one := V41RouteWeights(s, []int32{1}, true, 1); one[0] != 0.2 {
		t.Errorf("k = 1: %v, want the score itself", one)
	}
	if un := V41RouteWeights(s, []int32{3, 2}, false, 1); un[0] != 0.4 {
		t.Errorf("norm_topk_prob false: %v", un)
	}
}

// TestV41GateTemp: gate_temp 2 gives the scores of the halved logits; the
// bias changes the selection, not the weights.
func TestV41GateTemp(t *testing.T) {
	m, x := v41TestMoE(t, 0)
	g := m.Gate
	s1 := make([]float32, g.Experts)
	g.Scores(s1, x)
	g2 := g
	g2.Temp = 2
	s2 := make([]float32, g.Experts)
	g2.Scores(s2, x)
	l := make([]float32, g.Experts)
	attention.F32Linear(l, x, g.Weight, g.Experts, g.Dim)
	for e := range l {
		l[e] *= 0.5
	}
	ApplyScoreFunc(l, SqrtSoftplus)
	for e := range s2 {
		if s2[e] != l[e] {
			t.Errorf("gate_temp 2: score %d = %g, want %g", e, s2[e], l[e])
		}
		if s2[e] == s1[e] {
			t.Errorf("gate_temp 2: score %d unchanged", e)
		}
	}
	r, err := g.Route(x)
	if err != nil {
		t.Fatal(err)
	}
	gb := g
	gb.Bias = make([]float32, g.Experts)
	gb.Bias[r.Indices[0]] = -100 // drops the first choice
	rb, _ := gb.Route(x)
	if rb.Indices[0] == r.Indices[0] || rb.Indices[1] == r.Indices[0] {
		t.Errorf("a −100 bias on expert %d still selects it: %v", r.Indices[0], rb.Indices)
	}
}

// TestV41MoESharedClamp: swiglu_limit acts on the shared expert too: with a
// small limit the output differs from the unclamped shared expert; image
// tokens are refused.
func TestV41MoESharedClamp(t *testing.T) {
	m, x := v41TestMoE(t, 0.5)
	res, err := m.Forward(x, false)
	if err != nil {
		t.Fatal(err)
	}
	if acts, _, _ := m.ClampActs(x, res.Indices); !acts {
		t.Fatal("the test's limit does not act on the routed experts")
	}
	c := *m
	c.SharedLimit = 0
	no, err := c.Combine(x, res.Indices, res.Weights)
	if err != nil {
		t.Fatal(err)
	}
	diff := 0
	for i := range no {
		if no[i] != res.Out[i] {
			diff++
		}
	}
	if diff == 0 {
		t.Error("the shared expert's clamp changes nothing")
	}
	// Combine is the expert-id-ordered fp32 sum of the experts' bf16 outputs.
	y := make([]float32, len(x))
	out := make([]float32, len(x))
	ids := append([]int32(nil), res.Indices...)
	for e := int32(0); e < int32(m.Gate.Experts); e++ {
		for t2, id := range ids {
			if id == e {
				m.Experts[e].Forward(out, x, res.Weights[t2], m.SwigluLimit)
				for i := range y {
					y[i] += out[i]
				}
			}
		}
	}
	m.Shared.Forward(out, x, m.SwigluLimit)
	for i := range y {
		if quant.BF16Round(y[i]+out[i]) != res.Out[i] {
			t.Fatalf("ffn_out[%d] = %g, want %g", i, res.Out[i], quant.BF16Round(y[i]+out[i]))
		}
	}
	if _, err := m.Forward(x, true); err == nil || !strings.Contains(err.Error(), "bias_vl") {
		t.Errorf("image token: err = %v", err)
	}
}
