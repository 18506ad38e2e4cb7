package moe

import (
	"math"
	"testing"
)

// Four groups of two experts, top-2 groups, top-2 experts. The group maxima
// and the top-2 sums rank the groups differently, so the two rules choose
// different experts.
func TestGroupMaskRules(t *testing.T) {
	sel := []float32{0.9, 0.0, 0.5, 0.5, 0.6, 0.45, 0.1, 0.2}
	// max: groups 0.9, 0.5, 0.6, 0.2 → keep 0 and 2
	m := append([]float32(nil), sel...)
	GroupMask(m, 4, 2, false)
	ninf := float32(math.Inf(-1))
	want := []float32{0.9, 0.0, ninf, ninf, 0.6, 0.45, ninf, ninf}
	for i := range want {
		if m[i] != want[i] {
			t.Fatalf("max rule: got %v, want %v", m, want)
		}
	}
	// top-2 sums: 0.9, 1.0, 1.05, 0.3 → keep 2 and 1
	s := append([]float32(nil), sel...)
	GroupMask(s, 4, 2, true)
	want = []float32{ninf, ninf, 0.5, 0.5, 0.6, 0.45, ninf, ninf}
	for i := range want {
		if s[i] != want[i] {
			t.Fatalf("top-2 rule: got %v, want %v", s, want)
		}
	}
}

// The bias picks the experts; the weights are the unbiased scores,
// normalised and scaled.
func TestGroupedRouteBiasSelectsOnly(t *testing.T) {
	g := &Gate{Experts: 8, TopK: 2, Dim: 1, Func: Sigmoid, RouteScale: 2.5, Weight: make([]float32, 8),
		Bias: []float32{0, 0, 0, 0, 0, 0, 0, 1}}
	s := []float32{0.9, 0.0, 0.5, 0.5, 0.6, 0.45, 0.1, 0.2}
	r, err := g.GroupedRoute(s, 4, 2)
	if err != nil {
		t.Fatal(err)
	}
	// biased: group 3 = 0.1 + 1.2 = 1.3 first, then group 2 (1.05); experts 7 (1.2) then 4 (0.6)
	if len(r.Indices) != 2 || r.Indices[0] != 7 || r.Indices[1] != 4 {
		t.Fatalf("indices %v, want [7 4]", r.Indices)
	}
	sum := float32(0.2) + float32(0.6)
	w0, w1 := float32(0.2)/sum*2.5, float32(0.6)/sum*2.5
	if r.Weights[0] != w0 || r.Weights[1] != w1 {
		t.Fatalf("weights %v, want [%v %v] (unbiased scores)", r.Weights, w0, w1)
	}
	// one group: the plain top-k of the biased scores
	r1, err := g.GroupedRoute(s, 1, 1)
	if err != nil || r1.Indices[0] != 7 || r1.Indices[1] != 0 {
		t.Fatalf("one group: %v %v, want [7 0]", r1.Indices, err)
	}
	if _, err := g.GroupedRoute(s, 3, 1); err == nil {
		t.Fatal("8 experts in 3 groups accepted")
	}
}
