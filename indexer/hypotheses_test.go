package indexer

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"sparsemla/quant"
)

// hypCase is an indexer scoring case: heads, Tc rows of keys with outliers
// (so the Hadamard rotation matters to FP4), the reference's queries and
// keys (Had then FQ4) and the no-Hadamard engine's (FQ4 directly).
type hypCase struct {
	heads, tc              int
	iw                     []float32
	refQ, refK, gpuQ, gpuK []float32
}

func newHypCase(seed uint64, heads, tc int) hypCase {
	rng := rand.New(rand.NewPCG(seed, 3))
	c := hypCase{heads: heads, tc: tc}
	vec := func() []float32 {
		v := randVec(rng, 128)
		v[rng.IntN(128)] = quant.BF16Round(float32(8 + 8*rng.Float64())) // an outlier
		return v
	}
	for h := 0; h < heads; h++ {
		q := vec()
		g := append([]float32(nil), q...)
		quant.FQ4(g, 32)
		c.gpuQ = append(c.gpuQ, g...)
		quant.Hadamard(q)
		quant.FQ4(q, 32)
		c.refQ = append(c.refQ, q...)
	}
	for j := 0; j < tc; j++ {
		k := vec()
		g := append([]float32(nil), k...)
		quant.FQ4(g, 32)
		c.gpuK = append(c.gpuK, g...)
		quant.Hadamard(k)
		quant.FQ4(k, 32)
		c.refK = append(c.refK, k...)
	}
	c.iw = make([]float32, heads)
	for h := range c.iw {
		c.iw[h] = quant.BF16Round(float32(0.1 + 0.2*rng.Float64()))
	}
	return c
}

func scores(q, k, iw []float32, heads, tc int) []float32 {
	qk := make([]float32, heads*tc)
	IndexQK(qk, q, k, heads, 128)
	s := make([]float32, tc)
	IndexScore(s, qk, iw)
	return s
}

// A GPU without the Hadamard rotation selects by its own scores: judged
// against those it passes, judged against the reference's scores (from the
// reference's q and keys) it diverges, and the rows and scores the check
// reports are those of the reference's and the GPU's scores.
func TestCheckSelectionRefNoHadamard(t *testing.T) {
	const heads, tc, k = 4, 64, 16
	found := false
	for seed := uint64(0); seed < 8 && !found; seed++ {
		c := newHypCase(seed, heads, tc)
		gs := scores(c.gpuQ, c.gpuK, c.iw, heads, tc)
		gsel, _ := TopK(gs, k)
		if d := CompareSelection(gsel, gs, k); d.Verdict != Same {
			t.Fatalf("GPU selection against its own scores: %s", d.Verdict)
		}
		r := CheckSelectionRef(gsel, gs, c.refQ, c.refK, c.iw, heads, 128, k)
		ref := scores(c.refQ, c.refK, c.iw, heads, tc)
		if !slices.Equal(r.Scores, ref) {
			t.Fatal("CheckSelectionRef's scores are not the reference's")
		}
		if r.Diff.Verdict != Diverged {
			continue // this seed's sets happen to agree
		}
		found = true
		if len(r.Missing) == 0 || len(r.Missing) != len(r.Extra) {
			t.Fatalf("missing %v extra %v", r.Missing, r.Extra)
		}
		for _, m := range r.Missing {
			if slices.Contains(gsel, m.Row) || m.Ref != ref[m.Row] || m.GPU != gs[m.Row] {
				t.Fatalf("missing row %+v: not the reference's/GPU's scores of that row, or selected", m)
			}
		}
		for _, e := range r.Extra {
			if !slices.Contains(gsel, e.Row) || e.Ref != ref[e.Row] || e.GPU != gs[e.Row] {
				t.Fatalf("extra row %+v: wrong scores or not selected", e)
			}
		}
		if r.ScoreRows == 0 || r.FirstRow < 0 || ref[r.FirstRow] == gs[r.FirstRow] {
			t.Fatalf("score rows %d first %d", r.ScoreRows, r.FirstRow)
		}
		t.Logf("seed %d: %s", seed, r)
	}
	if !found {
		t.Fatal("no seed where the no-Hadamard GPU selects other rows than the reference")
	}
}

// The reference's own selection passes; a GPU that picks another member of a
// boundary tie is a tie, not a divergence.
func TestCheckSelectionRefSameAndTie(t *testing.T) {
	c := newHypCase(1, 4, 40)
	ref := scores(c.refQ, c.refK, c.iw, 4, 40)
	sel, _ := TopK(ref, 8)
	if r := CheckSelectionRef(sel, ref, c.refQ, c.refK, c.iw, 4, 128, 8); r.Diff.Verdict != Same || r.ScoreRows != 0 {
		t.Fatalf("reference selection: %s, %d score rows", r.Diff.Verdict, r.ScoreRows)
	}
	// Make row sel[7] tie with an unselected row by copying its key.
	var out int64 = -1
	for j := int64(0); j < 40; j++ {
		if !slices.Contains(sel, j) {
			out = j
			break
		}
	}
	copy(c.refK[out*128:(out+1)*128], c.refK[sel[7]*128:(sel[7]+1)*128])
	ref = scores(c.refQ, c.refK, c.iw, 4, 40)
	sel, tr := TopK(ref, 8)
	if !tr.Boundary() {
		t.Skip("the copied key did not land on the boundary")
	}
	gpu := slices.Clone(sel)
	for j := int64(0); j < 40; j++ {
		if !slices.Contains(sel, j) && ref[j] == tr.KthScore {
			gpu[7] = j
			break
		}
	}
	if r := CheckSelectionRef(gpu, nil, c.refQ, c.refK, c.iw, 4, 128, 8); r.Diff.Verdict != Tie {
		t.Fatalf("tie choice judged %s: %s", r.Diff.Verdict, r.Diff.Reason)
	}
}

func TestIndexerStageHypotheses(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	ix := &Indexer{NHeads: 4, HeadDim: 128, TopK: 16}
	had := randVec(rng, 4*128)
	for i := range had {
		had[i] = quant.BF16Round(had[i] * float32(math.Ldexp(1, rng.IntN(6)-3)))
	}
	ref, got := make([]float32, len(had)), make([]float32, len(had))
	ix.Query(ref, had)
	ix.QueryFP4Rule(got, had, quant.ScaleCeil2, quant.FP4AmaxFloor)
	if !slices.Equal(ref, got) {
		t.Fatal("QueryFP4Rule(ceil2) is not Query")
	}
	ix.QueryFP4Rule(got, had, quant.ScaleRoundLog2, quant.FP4AmaxFloor)
	if slices.Equal(ref, got) {
		t.Fatal("QueryFP4Rule(roundlog2) equals Query on this input")
	}
	ix.QueryFP8(got, had, quant.ScaleCeil2, quant.FP8AmaxFloor)
	for h := 0; h < 4; h++ {
		want := slices.Clone(had[h*128 : (h+1)*128])
		quant.FQ8Rule(want, 128, quant.ScaleCeil2, quant.FP8AmaxFloor)
		if !slices.Equal(want, got[h*128:(h+1)*128]) {
			t.Fatalf("QueryFP8 head %d is not FQ8 in one 128-block", h)
		}
	}
	ix.QueryNoFQ4(got, had)
	if !slices.Equal(got, had) {
		t.Fatal("QueryNoFQ4 changed the values")
	}

	// Scorers: IndexQKF32 rounds to IndexQK; the fp32-product and fp32 scorers
	// differ from IndexScore on some row and follow their formulas.
	c := newHypCase(2, 4, 50)
	qk, qk32 := make([]float32, 4*50), make([]float32, 4*50)
	IndexQK(qk, c.refQ, c.refK, 4, 128)
	IndexQKF32(qk32, c.refQ, c.refK, 4, 128)
	for i := range qk {
		if quant.BF16Round(qk32[i]) != qk[i] {
			t.Fatalf("bf16(IndexQKF32)[%d] != IndexQK", i)
		}
	}
	s, s1, s2 := make([]float32, 50), make([]float32, 50), make([]float32, 50)
	IndexScore(s, qk, c.iw)
	IndexScoreNoProductRound(s1, qk, c.iw)
	IndexScoreF32(s2, qk, c.iw)
	for j := 0; j < 50; j++ {
		var sum float32
		for h := 0; h < 4; h++ {
			sum += float32(max(qk[h*50+j], 0) * c.iw[h])
		}
		if s2[j] != sum || s1[j] != quant.BF16Round(sum) {
			t.Fatalf("row %d: fp32 scorer %g / %g, want %g / %g", j, s2[j], s1[j], sum, quant.BF16Round(sum))
		}
	}
	if slices.Equal(s, s2) {
		t.Fatal("the fp32 scorer equals the reference's")
	}
}
