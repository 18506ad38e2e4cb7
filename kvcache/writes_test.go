package kvcache

import (
	"math/rand/v2"
	"testing"
)

// Each write hypothesis, applied by a "GPU", is recognised as itself by
// MatchWindowWrite and differs from the reference write; the reference
// write matches with no differing rows. Positions include the ring's wrap
// (p mod W = 0 and W−1).
func TestMatchWindowWrite(t *testing.T) {
	const d, W, Tc = 8, 16, 3
	rng := rand.New(rand.NewPCG(4, 4))
	prev := make([]float32, (W+Tc)*d)
	for i := range prev {
		prev[i] = float32(rng.NormFloat64())
	}
	kv := make([]float32, d)
	for i := range kv {
		kv[i] = float32(rng.NormFloat64())
	}
	for _, p := range []int64{5, 16, 31, 47} {
		ref := WindowWrite(prev, d, W, kv, p)
		m, err := MatchWindowWrite(ref, prev, d, W, kv, p)
		if err != nil || m.Name != "" || len(m.Rows) != 0 {
			t.Fatalf("p %d: reference write judged %+v %v", p, m, err)
		}
		for _, h := range WindowWriteHypotheses() {
			gpu := h.Write(prev, d, W, kv, p)
			m, err := MatchWindowWrite(gpu, prev, d, W, kv, p)
			if err != nil {
				t.Fatal(err)
			}
			if m.Name != h.Name {
				t.Errorf("p %d: %q recognised as %q (rows %v)", p, h.Name, m.Name, m.Rows)
			}
			if len(m.Rows) == 0 {
				t.Errorf("p %d: %q equals the reference write", p, h.Name)
			}
			for _, s := range m.Rows {
				if d := (int64(s) - p%W + W) % W; d != 0 && d != 1 && d != W-1 {
					t.Errorf("p %d: %q changed slot %d, not p mod W or a neighbour", p, h.Name, s)
				}
			}
		}
	}
	// A foreign row (stale page) is no write hypothesis.
	gpu := WindowWrite(prev, d, W, kv, 5)
	gpu[2*d] += 1
	if m, _ := MatchWindowWrite(gpu, prev, d, W, kv, 5); m.Name != "" || len(m.Rows) != 1 || m.Rows[0] != 2 {
		t.Fatalf("a changed old row judged %+v", m)
	}
	if _, err := MatchWindowWrite(gpu[:d], prev, d, W, kv, 5); err == nil {
		t.Fatal("a short cache was accepted")
	}
}
