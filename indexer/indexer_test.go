package indexer

import (
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"

	"sparsemla/attention"
	"sparsemla/quant"
)

// TestIndexQKHand: 2 heads of 2 dims against 3 keys.
//
//	iq = [[1, 2], [0.5, -1]], icache = [[1, 0], [0, 1], [1, 1]]
//	qk[0] = [1, 2, 3];  qk[1] = [0.5, -1, -0.5]
func TestIndexQKHand(t *testing.T) {
	qk := make([]float32, 6)
	IndexQK(qk, []float32{1, 2, 0.5, -1}, []float32{1, 0, 0, 1, 1, 1}, 2, 2)
	if want := []float32{1, 2, 3, 0.5, -1, -0.5}; !slices.Equal(qk, want) {
		t.Fatalf("qk = %v, want %v", qk, want)
	}
	// Tc = 0: nothing to do, no panic.
	IndexQK(nil, []float32{1, 2, 0.5, -1}, nil, 2, 2)
}

// TestIndexScoreHand checks the ReLU, the signed head weights and the per-product
// bf16 rounding.
//
//	qk = [[1, -2, 0.5], [3, 1, -1]] (heads × rows), w = [0.5, -1]
//	score[0] = 0.5·1 + (−1)·3 = −2.5
//	score[1] = 0 (ReLU)  + (−1)·1 = −1
//	score[2] = 0.5·0.5 + 0 (ReLU) = 0.25
func TestIndexScoreHand(t *testing.T) {
	score := make([]float32, 3)
	IndexScore(score, []float32{1, -2, 0.5, 3, 1, -1}, []float32{0.5, -1})
	if want := []float32{-2.5, -1, 0.25}; !slices.Equal(score, want) {
		t.Fatalf("score = %v, want %v", score, want)
	}
}

// TestIndexScorePerProductRounding: each ReLU·weight product is rounded to bf16
// before the head sum (§14). With qk = [1.0078125, 1] and w = [1.03125, 1]:
//
//	head 0: 1.0078125·1.03125 = 1.039306640625 → bf16 1.0390625 (step 2^-7)
//	sum = 1.0390625 + 1 = 2.0390625, exactly halfway between the bf16 values
//	2.03125 and 2.046875 (step 2^-6) → ties to even → 2.03125
//
// Without the per-product rounding the sum 2.039306640625 rounds up to 2.046875.
func TestIndexScorePerProductRounding(t *testing.T) {
	score := make([]float32, 1)
	IndexScore(score, []float32{1.0078125, 1}, []float32{1.03125, 1})
	if score[0] != 2.03125 {
		t.Fatalf("score = %v, want 2.03125", score[0])
	}
}

// TestWeightScale: f32(128^-0.5 · 64^-0.5) has bits 0x3C3504F3 (spec §1), and
// the tiny golden's 4 heads give f32(128^-0.5 · 0.5).
func TestWeightScale(t *testing.T) {
	if got := math.Float32bits((&Indexer{NHeads: 64, HeadDim: 128}).WeightScale()); got != 0x3C3504F3 {
		t.Errorf("64 heads: scale bits %#x, want 0x3C3504F3", got)
	}
	if got, want := (&Indexer{NHeads: 4, HeadDim: 128}).WeightScale(), float32(0.08838834764831845*0.5); got != want {
		t.Errorf("4 heads: scale %v, want %v", got, want)
	}
	ix := &Indexer{NHeads: 4, HeadDim: 128}
	iw := make([]float32, 4)
	// iw = bf16(iw_raw · f32(0.0441941738)): 1 → bf16(0.0441941738) = 0.044189453125.
	ix.Weights(iw, []float32{1, -2, 0, 0.5})
	s := ix.WeightScale()
	for h, raw := range []float32{1, -2, 0, 0.5} {
		if iw[h] != quant.BF16Round(raw*s) {
			t.Errorf("iw[%d] = %v", h, iw[h])
		}
	}
	if iw[0] != 0.044189453125 {
		t.Errorf("iw[0] = %v, want 0.044189453125", iw[0])
	}
}

// TestTopK: ties resolved by the lower row index; the tie report.
//
//	scores = [1, 3, 2, 3, 2, 0, 2]
//	order  = 1 (3), 3 (3), 2 (2), 4 (2), 6 (2), 0 (1), 5 (0)
//	k = 3: [1, 3, 2]; the k-th score 2 is shared by rows 2, 4, 6 and only row 2 is
//	selected: a boundary tie (a GPU may pick 4 or 6 instead).
//	k = 5: [1, 3, 2, 4, 6]: all three rows of score 2 selected, no boundary tie.
func TestTopK(t *testing.T) {
	scores := []float32{1, 3, 2, 3, 2, 0, 2}
	for _, tc := range []struct {
		k        int
		want     []int64
		kth      float32
		tied     int
		tiedSel  int
		boundary bool
	}{
		{0, []int64{}, 0, 0, 0, false},
		{1, []int64{1}, 3, 2, 1, true},
		{2, []int64{1, 3}, 3, 2, 2, false},
		{3, []int64{1, 3, 2}, 2, 3, 1, true},
		{5, []int64{1, 3, 2, 4, 6}, 2, 3, 3, false},
		{7, []int64{1, 3, 2, 4, 6, 0, 5}, 0, 1, 1, false},
	} {
		got, rep := TopK(scores, tc.k)
		if !slices.Equal(got, tc.want) {
			t.Errorf("k=%d: %v, want %v", tc.k, got, tc.want)
		}
		if rep.K != tc.k || rep.KthScore != tc.kth || rep.Tied != tc.tied || rep.TiedSelected != tc.tiedSel || rep.Boundary() != tc.boundary {
			t.Errorf("k=%d: report %v, want kth=%v tied=%d selected=%d boundary=%v", tc.k, rep, tc.kth, tc.tied, tc.tiedSel, tc.boundary)
		}
	}
	// Tc = 0 (steps before the first compressed row): empty selection.
	if got, rep := TopK(nil, 0); len(got) != 0 || rep.Boundary() {
		t.Errorf("empty: %v %v", got, rep)
	}
	// NaN ranks first, as in torch.topk.
	if got, _ := TopK([]float32{1, float32(math.NaN()), 2}, 2); !slices.Equal(got, []int64{1, 2}) {
		t.Errorf("NaN: %v, want [1 2]", got)
	}
}

// TestCompareSelection covers the verdicts over scores = [1, 3, 2, 3, 2, 0, 2]
// with k = 3 (reference [1, 3, 2]; rows 2, 4, 6 tie at the k-th score 2).
func TestCompareSelection(t *testing.T) {
	scores := []float32{1, 3, 2, 3, 2, 0, 2}
	for _, tc := range []struct {
		name    string
		gpu     []int64
		verdict Verdict
		recall  float64
		jaccard float64
	}{
		{"same set, other order", []int64{3, 1, 2}, Same, 1, 1},
		{"other member of the tie", []int64{3, 1, 6}, Tie, 2.0 / 3, 2.0 / 4},
		{"row below the k-th score", []int64{3, 1, 0}, Diverged, 2.0 / 3, 2.0 / 4},
		{"row above the k-th left out", []int64{3, 2, 4}, Diverged, 2.0 / 3, 2.0 / 4},
		{"too short", []int64{3, 1}, Diverged, 2.0 / 3, 2.0 / 3},
		{"duplicate", []int64{3, 1, 1}, Diverged, 2.0 / 3, 2.0 / 3},
		{"out of range", []int64{3, 1, 7}, Diverged, 2.0 / 3, 2.0 / 4},
	} {
		d := CompareSelection(tc.gpu, scores, 3)
		if d.Verdict != tc.verdict || d.Recall != tc.recall || d.Jaccard != tc.jaccard {
			t.Errorf("%s: %v recall %v jaccard %v (%s), want %v %v %v", tc.name, d.Verdict, d.Recall, d.Jaccard, d.Reason, tc.verdict, tc.recall, tc.jaccard)
		}
		if (d.Verdict == Diverged) != (d.Reason != "") {
			t.Errorf("%s: reason %q with verdict %v", tc.name, d.Reason, d.Verdict)
		}
	}
	d := CompareSelection([]int64{3, 1, 6}, scores, 3)
	if !slices.Equal(d.Missing, []int64{2}) || !slices.Equal(d.Extra, []int64{6}) {
		t.Errorf("missing %v extra %v, want [2] [6]", d.Missing, d.Extra)
	}
	if d := CompareSelection(nil, nil, 0); d.Verdict != Same || d.Recall != 1 || d.Jaccard != 1 {
		t.Errorf("empty: %+v", d)
	}
}

// randIndexer returns a small indexer (H_I heads of 128, the real head_dim, as
// the Hadamard and RoPE need) with seeded random weights.
func randIndexer(rng *rand.Rand, heads, dim, qLora, topk int) *Indexer {
	fill := func(n int, s float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = quant.BF16Round(float32(rng.NormFloat64() * s))
		}
		return v
	}
	c := &attention.Compressor{Ratio: 4, HeadDim: 128, Dim: dim, Rotate: true, Eps: attention.NormEps,
		Wkv: fill(256*dim, 1/math.Sqrt(float64(dim))), Wgate: fill(256*dim, 1/math.Sqrt(float64(dim))),
		Ape: fill(4*256, 0.5), Norm: fill(128, 0.1)}
	for i := range c.Norm {
		c.Norm[i]++
	}
	return &Indexer{NHeads: heads, HeadDim: 128, TopK: topk,
		WqB:         attention.QuantizeFP8Weight(fill(heads*128*qLora, 1/math.Sqrt(float64(qLora))), heads*128, qLora),
		WeightsProj: fill(heads*dim, 1/math.Sqrt(float64(dim))),
		Compressor:  c}
}

func randVec(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	return v
}

// TestIndexerStep decodes 30 tokens from position 0 and checks the wiring of
// Step: Tc = (p+1) div 4 rows, icache grows by the compressor's row exactly at
// emission steps, k = min(index_topk, Tc), index_sel = index_topk + 128, and the
// stages equal their stand-alone functions on Step's own values.
func TestIndexerStep(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	const heads, dim, qLora, topk = 2, 32, 128, 5
	ix := randIndexer(rng, heads, dim, qLora, topk)
	rope := attention.NewRopeTable(attention.RopeParams{Base: 160000, OriginalSeqLen: 65536, Factor: 16, BetaFast: 32, BetaSlow: 1}, 64)
	st := ix.Compressor.NewState()
	var icache []float32
	for p := int64(0); p < 30; p++ {
		x, cq := randVec(rng, dim), randVec(rng, qLora)
		s := ix.Step(st, icache, x, cq, p, rope)
		tc := int((p + 1) / 4)
		if len(s.ICache) != tc*128 || len(s.IndexScore) != tc || len(s.IndexQK) != heads*tc {
			t.Fatalf("p=%d: icache %d, scores %d, qk %d; want Tc = %d", p, len(s.ICache)/128, len(s.IndexScore), len(s.IndexQK), tc)
		}
		if s.Cmp.Emitted && !slices.Equal(s.ICache[(tc-1)*128:], s.Cmp.Out) {
			t.Fatalf("p=%d: icache row %d is not the compressor's row", p, tc-1)
		}
		if len(s.IndexTopK) != min(topk, tc) || len(s.IndexSel) != len(s.IndexTopK) {
			t.Fatalf("p=%d: %d selected, want %d", p, len(s.IndexTopK), min(topk, tc))
		}
		for i := range s.IndexTopK {
			if s.IndexSel[i] != s.IndexTopK[i]+128 {
				t.Fatalf("p=%d: index_sel %v, index_topk %v", p, s.IndexSel, s.IndexTopK)
			}
		}
		// Every stage from its inputs (teacher forcing on our own values).
		got := make([]float32, heads*128)
		ix.Query(got, s.IqHad)
		if !slices.Equal(got, s.Iq) {
			t.Fatal("Query differs")
		}
		again := append([]float32(nil), s.Iq...)
		quant.FQ4(again, 32)
		if !slices.Equal(again, s.Iq) {
			t.Fatal("iq is not on the FQ4 grid")
		}
		score := make([]float32, tc)
		IndexScore(score, s.IndexQK, s.Iw)
		if !slices.Equal(score, s.IndexScore) {
			t.Fatal("IndexScore differs")
		}
		if d := CompareSelection(s.IndexTopK, s.IndexScore, ix.K(tc)); d.Verdict != Same {
			t.Fatalf("p=%d: own selection compares as %v", p, d.Verdict)
		}
		icache = s.ICache
	}
}

// TestHadamardPreservesScores: the rotation is orthonormal, so the index
// scores with Hadamard on q and k (before FP4) approximate the unrotated ones;
// this is the reason both sides are rotated. Checked on bf16 vectors with the
// FP4 step left out: |Had(q)·Had(k) − q·k| stays at bf16 rounding level.
func TestHadamardPreservesScores(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	for trial := 0; trial < 20; trial++ {
		q, k := randVec(rng, 128), randVec(rng, 128)
		var direct float64
		for i := range q {
			direct += float64(q[i]) * float64(k[i])
		}
		hq, hk := append([]float32(nil), q...), append([]float32(nil), k...)
		quant.Hadamard(hq)
		quant.Hadamard(hk)
		var rot float64
		for i := range hq {
			rot += float64(hq[i]) * float64(hk[i])
		}
		// Each rotated element carries a relative bf16 error ≤ 2^-9; the dot of
		// two such 128-vectors of norm ~11 errs by at most ~2·2^-9·|q||k|.
		var nq, nk float64
		for i := range q {
			nq += float64(q[i]) * float64(q[i])
			nk += float64(k[i]) * float64(k[i])
		}
		if lim := 2 * 0x1p-9 * math.Sqrt(nq*nk); math.Abs(rot-direct) > lim {
			t.Fatalf("trial %d: rotated dot %v vs %v (limit %v)", trial, rot, direct, lim)
		}
	}
}

// TestScoreRowsEqualsReference: the fused, parallel fast path gives the
// reference's scores bit for bit, for several Tc (0 included) and GOMAXPROCS.
func TestScoreRowsEqualsReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 6))
	const heads, hd = 8, 128
	iq := randVec(rng, heads*hd)
	w := randVec(rng, heads)
	for _, procs := range []int{1, 2, 5} {
		old := runtime.GOMAXPROCS(procs)
		for _, tc := range []int{0, 1, 63, 64, 200, 1000} {
			icache := randVec(rng, tc*hd)
			qk := make([]float32, heads*tc)
			IndexQK(qk, iq, icache, heads, hd)
			want := make([]float32, tc)
			IndexScore(want, qk, w)
			got := make([]float32, tc)
			ScoreRows(got, iq, icache, w, heads, hd)
			for j := range want {
				if math.Float32bits(got[j]) != math.Float32bits(want[j]) {
					t.Fatalf("GOMAXPROCS=%d Tc=%d row %d: %v, reference %v", procs, tc, j, got[j], want[j])
				}
			}
		}
		runtime.GOMAXPROCS(old)
	}
}

// TestQueryHeadsEqualsStages checks that the query's per-head stages run on
// head ranges (the prepared step's split) give QueryRoped, QueryHad and
// Query's values, for every split of 5 heads into two ranges.
func TestQueryHeadsEqualsStages(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 1))
	const heads = 5
	ix := randIndexer(rng, heads, 32, 128, 4)
	rope := attention.NewRopeTable(attention.RopeParams{Base: 160000, OriginalSeqLen: 65536, Factor: 16, BetaFast: 32, BetaSlow: 1}, 64)
	n := heads * ix.HeadDim
	iqB := randVec(rng, n)
	for i := range iqB {
		iqB[i] = quant.BF16Round(iqB[i] * 40)
	}
	wR, wH, w := make([]float32, n), make([]float32, n), make([]float32, n)
	ix.QueryRoped(wR, iqB, 37, rope)
	ix.QueryHad(wH, wR)
	ix.Query(w, wH)
	for cut := 0; cut <= heads; cut++ {
		r, h, q := make([]float32, n), make([]float32, n), make([]float32, n)
		ix.QueryHeads(r, h, q, iqB, 37, rope, cut, heads)
		ix.QueryHeads(r, h, q, iqB, 37, rope, 0, cut)
		for name, pair := range map[string][2][]float32{"iq_roped": {r, wR}, "iq_had": {h, wH}, "iq": {q, w}} {
			for i := range pair[0] {
				if math.Float32bits(pair[0][i]) != math.Float32bits(pair[1][i]) {
					t.Fatalf("cut %d: %s[%d] = %g, the stage gives %g", cut, name, i, pair[0][i], pair[1][i])
				}
			}
		}
	}
}
