package attention

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"sparsemla/quant"
)

// TestCompressorProjectHand checks a = Wkv·x and b = Wgate·x on a 2×2 case.
//
//	Wkv = [[1, 2], [3, 4]], Wgate = [[0.5, 0], [0, -1]], x = [1, -2]
//	a = [1·1 + 2·(−2), 3·1 + 4·(−2)] = [−3, −5]
//	b = [0.5, 2]       (ape is not added here: cmp_b is dumped without it)
func TestCompressorProjectHand(t *testing.T) {
	c := &Compressor{Ratio: 128, HeadDim: 2, Dim: 2,
		Wkv: []float32{1, 2, 3, 4}, Wgate: []float32{0.5, 0, 0, -1},
		Ape: make([]float32, 128*2), Norm: []float32{1, 1}}
	a, b := make([]float32, 2), make([]float32, 2)
	c.Project(a, b, []float32{1, -2})
	if !slices.Equal(a, []float32{-3, -5}) || !slices.Equal(b, []float32{0.5, 2}) {
		t.Fatalf("a = %v, b = %v; want [-3 -5], [0.5 2]", a, b)
	}
}

// TestCompressorStateMachineHand walks the overlapping r = 4 compressor with
// d = 1 (state rows of width 2: channel 0 = "A half", channel 1 = "B half")
// through two groups, feeding (a, b) directly.
//
// Token t has a_t = [A_t, B_t] = [t+1, 10(t+1)] and b_t = [0, 0]; ape = 0 except
// ape[3] = [0, ln 3] (the B half of the 4th token of a group).
//
// Row 0 (emitted at p = 3): rows 0..3 are fresh (score −∞, weight 0), rows 4..7
// hold the B halves of tokens 0..3 with scores 0, 0, 0, ln 3, so the softmax
// weights are 1/6, 1/6, 1/6, 3/6:
//
//	row_0 = (10 + 20 + 30 + 3·40) / 6 = 180/6 = 30
//
// Row 1 (p = 7): the A halves of tokens 0..3 (scores 0,0,0,0) and the B halves
// of tokens 4..7 (scores 0,0,0,ln 3): weights 1/10 each and 3/10 for token 7:
//
//	row_1 = (1+2+3+4 + 50+60+70 + 3·80) / 10 = (10 + 180 + 240)/10 = 43
//
// exp(ln 3) is not exactly 3 in fp32, but the pooled value is rounded to bf16,
// where 30 and 43 are exact and the fp32 error is far below half an ulp.
func TestCompressorStateMachineHand(t *testing.T) {
	ln3 := float32(math.Log(3))
	c := &Compressor{Ratio: 4, HeadDim: 1, Dim: 1,
		Wkv: []float32{0, 0}, Wgate: []float32{0, 0},
		Ape: []float32{0, 0, 0, 0, 0, 0, 0, ln3}, Norm: []float32{1}}
	st := c.NewState()
	for i := range st.KV {
		if st.KV[i] != 0 || st.Score[i] != negInf {
			t.Fatal("fresh state must be kv = 0, score = -inf")
		}
	}
	want := map[int64]float32{3: 30, 7: 43}
	for p := int64(0); p < 8; p++ {
		a := []float32{float32(p + 1), float32(10 * (p + 1))}
		b := []float32{0, 0}
		c.Ingest(st, a, b, p)
		// Token p lands in row 4 + p mod 4, with ape[p mod 4] added to its score.
		row := 4 + int(p%4)
		if st.KV[2*row] != a[0] || st.KV[2*row+1] != a[1] || st.Score[2*row+1] != c.Ape[2*(p%4)+1] {
			t.Fatalf("p=%d: state row %d = kv %v score %v", p, row, st.KV[2*row:2*row+2], st.Score[2*row:2*row+2])
		}
		if c.Emits(p) != (p == 3 || p == 7) {
			t.Fatalf("Emits(%d) = %v", p, c.Emits(p))
		}
		if !c.Emits(p) {
			continue
		}
		got := make([]float32, 1)
		c.Pool(got, st)
		if got[0] != want[p] {
			t.Errorf("row %d = %v, want %v", p/4, got[0], want[p])
		}
		c.Shift(st)
		// After the shift rows 0..3 equal rows 4..7 (the group just pooled).
		if !slices.Equal(st.KV[:8], st.KV[8:]) || !slices.Equal(st.Score[:8], st.Score[8:]) {
			t.Fatalf("p=%d: shift did not copy rows 4..7 into 0..3", p)
		}
	}
}

// TestCompressorR128Hand: with r = 128 (no overlap) the row is the softmax
// pooling of the 128 tokens of the group: all scores 0 and a_t = t gives the
// mean 0..127 = 63.5 (exact in bf16).
func TestCompressorR128Hand(t *testing.T) {
	c := &Compressor{Ratio: 128, HeadDim: 1, Dim: 1, Wkv: []float32{0}, Wgate: []float32{0},
		Ape: make([]float32, 128), Norm: []float32{1}}
	st := c.NewState()
	for p := int64(128); p < 256; p++ { // group 1: rows are p mod 128
		if c.Advance(st, []float32{float32(p - 128)}, []float32{0}, p) != (p == 255) {
			t.Fatalf("Advance(%d) emission flag wrong", p)
		}
	}
	got := make([]float32, 1)
	c.Pool(got, st)
	if got[0] != 63.5 {
		t.Fatalf("pooled = %v, want 63.5", got[0])
	}
}

// randCompressor returns a compressor with seeded random weights of the scale
// of the golden (wkv/wgate bf16 values ~ N(0,1)/sqrt(dim), ape 0.5·N, norm 1+0.1N).
func randCompressor(rng *rand.Rand, r, d, dim int, rotate bool) *Compressor {
	c := &Compressor{Ratio: r, HeadDim: d, Dim: dim, Rotate: rotate, Eps: NormEps}
	w := c.Width()
	fill := func(n int, f func() float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = quant.BF16Round(float32(f()))
		}
		return v
	}
	s := 1 / math.Sqrt(float64(dim))
	c.Wkv = fill(w*dim, func() float64 { return rng.NormFloat64() * s })
	c.Wgate = fill(w*dim, func() float64 { return rng.NormFloat64() * s * 4 })
	c.Ape = fill(r*w, func() float64 { return 0.5 * rng.NormFloat64() })
	c.Norm = fill(d, func() float64 { return 1 + 0.1*rng.NormFloat64() })
	return c
}

func randTokens(rng *rand.Rand, n, dim int) [][]float32 {
	xs := make([][]float32, n)
	for t := range xs {
		xs[t] = make([]float32, dim)
		for k := range xs[t] {
			xs[t][k] = quant.BF16Round(float32(rng.NormFloat64()))
		}
	}
	return xs
}

func testRope() *RopeTable {
	return NewRopeTable(RopeParams{Base: 160000, OriginalSeqLen: 65536, Factor: 16, BetaFast: 32, BetaSlow: 1}, 1024)
}

// directPool computes row j straight from the per-token projections, with the
// softmax written out over the entries of the group (and, for r = 4, the A
// halves of the previous group), in the same fp32 order as the reference: it
// checks the state machine's bookkeeping (rows, halves, ape index, shift).
// pooled64 is the same pooling in float64, for an independent check.
func directPool(c *Compressor, as, bs [][]float32, j int) (pooled []float32, pooled64 []float64) {
	d, r := c.HeadDim, c.Ratio
	type entry struct{ t, off int }
	var es []entry
	if c.Coff() == 2 {
		for t := (j - 1) * r; t < j*r; t++ {
			if t >= 0 {
				es = append(es, entry{t, 0})
			}
		}
		for t := j * r; t < (j+1)*r; t++ {
			es = append(es, entry{t, d})
		}
	} else {
		for t := j * r; t < (j+1)*r; t++ {
			es = append(es, entry{t, 0})
		}
	}
	w := c.Width()
	score := func(e entry, ch int) float32 { return bs[e.t][e.off+ch] + c.Ape[(e.t%r)*w+e.off+ch] }
	pooled = make([]float32, d)
	pooled64 = make([]float64, d)
	for ch := 0; ch < d; ch++ {
		m := negInf
		for _, e := range es {
			m = max(m, score(e, ch))
		}
		var sum float32
		var sum64 float64
		ex := make([]float32, len(es))
		for i, e := range es {
			ex[i] = float32(math.Exp(float64(score(e, ch) - m)))
			sum += ex[i]
			sum64 += math.Exp(float64(score(e, ch)) - float64(m))
		}
		var acc float32
		var acc64 float64
		for i, e := range es {
			acc += float32(as[e.t][e.off+ch] * (ex[i] / sum))
			acc64 += float64(as[e.t][e.off+ch]) * math.Exp(float64(score(e, ch))-float64(m)) / sum64
		}
		pooled[ch] = quant.BF16Round(acc)
		pooled64[ch] = acc64
	}
	return pooled, pooled64
}

// TestCompressorRowsEqualDirectPooling decodes a random sequence from a fresh
// state and checks every emitted row against directPool: bit-identical to the
// fp32 pooling written out per group, and within one bf16 ulp of the float64
// pooling. It also checks the finishing stages' invariants (FQ8/FQ4 grids).
func TestCompressorRowsEqualDirectPooling(t *testing.T) {
	rope := testRope()
	for _, tc := range []struct {
		name   string
		r, d   int
		rotate bool
		n      int
	}{
		{"main r4", 4, 512, false, 17},
		{"indexer r4", 4, 128, true, 17},
		{"main r128", 128, 512, false, 260},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(tc.r*tc.d)))
			dim := 32
			c := randCompressor(rng, tc.r, tc.d, dim, tc.rotate)
			xs := randTokens(rng, tc.n, dim)
			st := c.NewState()
			var as, bs [][]float32
			rows := 0
			for p := range xs {
				s := c.Step(st, xs[p], int64(p), rope)
				as, bs = append(as, s.A), append(bs, s.B)
				if !s.Emitted {
					continue
				}
				rows++
				j := p / tc.r
				if s.Row != int64(j) {
					t.Fatalf("p=%d: Row = %d, want %d", p, s.Row, j)
				}
				want, want64 := directPool(c, as, bs, j)
				for ch := range want {
					if math.Float32bits(s.Pooled[ch]) != math.Float32bits(want[ch]) {
						t.Fatalf("row %d ch %d: pooled %v, direct %v", j, ch, s.Pooled[ch], want[ch])
					}
					if u := quant.BF16ULPDistance(s.Pooled[ch], float32(want64[ch])); u > 1 {
						t.Fatalf("row %d ch %d: pooled %v is %d bf16 ulps from the float64 pooling %v", j, ch, s.Pooled[ch], u, want64[ch])
					}
				}
				checkRowGrid(t, c, s)
			}
			if rows != tc.n/tc.r {
				t.Fatalf("%d rows emitted, want %d", rows, tc.n/tc.r)
			}
		})
	}
}

// checkRowGrid checks the finishing invariants of one emitted row: main rows
// keep the rope dims of cmp_roped and lie on the FQ8 grid elsewhere (FQ8 is
// idempotent there); indexer rows are FQ4(Had(roped)) and FQ4-idempotent.
func checkRowGrid(t *testing.T, c *Compressor, s CompressorStep) {
	t.Helper()
	d := c.HeadDim
	again := append([]float32(nil), s.Out...)
	if c.Rotate {
		quant.FQ4(again, 32)
	} else {
		if !slices.Equal(s.Out[d-RopeDims:], s.Roped[d-RopeDims:]) {
			t.Fatal("main row: rope dims changed by the quantisation")
		}
		quant.FQ8(again[:d-RopeDims], 64)
	}
	if !slices.Equal(again, s.Out) {
		t.Fatal("row is not on its quantisation grid")
	}
	for _, v := range s.Out {
		if quant.BF16Round(v) != v {
			t.Fatal("row value is not bf16")
		}
	}
}

// TestCompressorPrefillThenDecode: the prefill hand-off of S tokens followed by
// decode steps S..N-1 gives the same rows (every stage, bit for bit) and the
// same live state as decoding every token from position 0.
func TestCompressorPrefillThenDecode(t *testing.T) {
	rope := testRope()
	for _, tc := range []struct {
		name   string
		r, d   int
		rotate bool
		n      int
		S      []int
	}{
		{"main r4", 4, 512, false, 22, []int{0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 15}},
		{"indexer r4", 4, 128, true, 22, []int{0, 2, 4, 6, 11}},
		{"main r128", 128, 512, false, 300, []int{0, 1, 127, 128, 129, 200, 256}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(2, uint64(tc.r*tc.d)))
			dim := 16
			c := randCompressor(rng, tc.r, tc.d, dim, tc.rotate)
			xs := randTokens(rng, tc.n, dim)
			w := c.Width()

			// Reference: decode every token from a fresh state.
			dec := c.NewState()
			var decRows []CompressorStep
			as, bs := make([]float32, tc.n*w), make([]float32, tc.n*w)
			states := make([]*CompressorState, tc.n+1)
			states[0] = dec.Clone()
			for p, x := range xs {
				s := c.Step(dec, x, int64(p), rope)
				copy(as[p*w:], s.A)
				copy(bs[p*w:], s.B)
				if s.Emitted {
					decRows = append(decRows, s)
				}
				states[p+1] = dec.Clone()
			}

			for _, S := range tc.S {
				st, rows := c.Prefill(as[:S*w], bs[:S*w], S, rope)
				if len(rows) != S/tc.r {
					t.Fatalf("S=%d: prefill emitted %d rows, want %d", S, len(rows), S/tc.r)
				}
				sameLiveState(t, c, st, states[S], S)
				for p := S; p < tc.n; p++ {
					s := c.Step(st, xs[p], int64(p), rope)
					if s.Emitted {
						rows = append(rows, s)
					}
				}
				if len(rows) != len(decRows) {
					t.Fatalf("S=%d: %d rows, decode from 0 gave %d", S, len(rows), len(decRows))
				}
				for j := range rows {
					if rows[j].Row != int64(j) || !slices.Equal(rows[j].Pooled, decRows[j].Pooled) ||
						!slices.Equal(rows[j].Normed, decRows[j].Normed) || !slices.Equal(rows[j].Roped, decRows[j].Roped) ||
						!slices.Equal(rows[j].Had, decRows[j].Had) || !slices.Equal(rows[j].Out, decRows[j].Out) {
						t.Fatalf("S=%d: row %d differs from decoding from position 0", S, j)
					}
				}
				sameLiveState(t, c, st, states[tc.n], tc.n)
			}
		})
	}
}

// sameLiveState compares the rows of two states that a later step can read
// after n tokens: r = 4: rows 0..3 (once a group is complete) and 4..4+rem−1;
// r = 128: rows 0..rem−1. Other rows are stale and differ legitimately.
func sameLiveState(t *testing.T, c *Compressor, got, want *CompressorState, n int) {
	t.Helper()
	w, r := c.Width(), c.Ratio
	rem := n % r
	var live []int
	if c.Coff() == 2 {
		if n >= r {
			live = append(live, 0, 1, 2, 3)
		}
		for i := 0; i < rem; i++ {
			live = append(live, r+i)
		}
	} else {
		for i := 0; i < rem; i++ {
			live = append(live, i)
		}
	}
	for _, row := range live {
		if !slices.Equal(got.KV[row*w:(row+1)*w], want.KV[row*w:(row+1)*w]) ||
			!slices.Equal(got.Score[row*w:(row+1)*w], want.Score[row*w:(row+1)*w]) {
			t.Fatalf("after %d tokens: state row %d differs", n, row)
		}
	}
}

// TestCompressorTeacherForcedStages: each stage recomputed from the previous
// stage's value equals the chained Step (the replay's local mode on the
// reference's own values), including PoolAt from the state before the step.
func TestCompressorTeacherForcedStages(t *testing.T) {
	rope := testRope()
	rng := rand.New(rand.NewPCG(3, 3))
	for _, rotate := range []bool{false, true} {
		d := 512
		if rotate {
			d = 128
		}
		c := randCompressor(rng, 4, d, 8, rotate)
		st := c.NewState()
		for p, x := range randTokens(rng, 8, 8) {
			prev := st.Clone()
			s := c.Step(st, x, int64(p), rope)
			after := prev.Clone()
			if c.Advance(after, s.A, s.B, int64(p)) != s.Emitted || !slices.Equal(after.KV, st.KV) || !slices.Equal(after.Score, st.Score) {
				t.Fatalf("p=%d: Advance differs from Step's state update", p)
			}
			if !s.Emitted {
				continue
			}
			got := make([]float32, d)
			c.PoolAt(got, prev, s.A, s.B, int64(p))
			if !slices.Equal(got, s.Pooled) {
				t.Fatal("PoolAt differs from Step's pooled row")
			}
			c.Normed(got, s.Pooled)
			if !slices.Equal(got, s.Normed) {
				t.Fatal("Normed differs")
			}
			c.Roped(got, s.Normed, s.Row, rope)
			if !slices.Equal(got, s.Roped) {
				t.Fatal("Roped differs")
			}
			in := s.Roped
			if rotate {
				c.Had(got, s.Roped)
				if !slices.Equal(got, s.Had) {
					t.Fatal("Had differs")
				}
				in = s.Had
			}
			c.Quantize(got, in)
			if !slices.Equal(got, s.Out) {
				t.Fatal("Quantize differs")
			}
		}
	}
}

func TestCompressorPanics(t *testing.T) {
	c := &Compressor{Ratio: 4, HeadDim: 1, Dim: 1, Wkv: []float32{0, 0}, Wgate: []float32{0, 0},
		Ape: make([]float32, 8), Norm: []float32{1}}
	for name, f := range map[string]func(){
		"short a":      func() { c.Ingest(c.NewState(), []float32{0}, []float32{0, 0}, 0) },
		"bad state":    func() { c.Pool([]float32{0}, &CompressorState{KV: []float32{0}, Score: []float32{0}}) },
		"bad weights":  func() { (&Compressor{Ratio: 4, HeadDim: 1, Dim: 1}).NewState() },
		"PoolAt no-op": func() { c.PoolAt([]float32{0}, c.NewState(), []float32{0, 0}, []float32{0, 0}, 1) },
		"Had on main":  func() { c.Had([]float32{0}, []float32{0}) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}

// TestCompressorUsePanels: a compressor whose projections are only panels
// (UsePanels, the prepared path's compact form) projects the same bits as
// with its fp32 Wkv and Wgate, for bf16 (checkpoint) and fp32 weights and a
// row count that is not a multiple of PanelRows; Weights gives back the
// same values; the state machine runs on it.
func TestCompressorUsePanels(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for _, bf := range []bool{true, false} {
		for _, r := range []int{4, 128} {
			d, dim := 40, 96 // width 80 (r = 4) or 40: partial panels
			c := &Compressor{Ratio: r, HeadDim: d, Dim: dim, Eps: 1e-6}
			w := c.Width()
			gen := func(n int) []float32 {
				v := make([]float32, n)
				for i := range v {
					v[i] = float32(rng.NormFloat64())
					if bf {
						v[i] = quant.BF16Round(v[i])
					}
				}
				return v
			}
			c.Wkv, c.Wgate, c.Ape, c.Norm = gen(w*dim), gen(w*dim), gen(r*w), gen(d)
			x := gen(dim)
			a0, b0 := make([]float32, w), make([]float32, w)
			c.Project(a0, b0, x)
			wkv, wgate := append([]float32(nil), c.Wkv...), append([]float32(nil), c.Wgate...)
			pk, pg := PackPanels(c.Wkv, w, dim), PackPanels(c.Wgate, w, dim)
			if (pk.BF16 != nil) != bf {
				t.Fatalf("bf16 %v: panels stored as bf16 = %v", bf, pk.BF16 != nil)
			}
			c.UsePanels(pk, pg)
			if c.Wkv != nil || c.Wgate != nil {
				t.Fatal("UsePanels kept the fp32 weights")
			}
			a1, b1 := make([]float32, w), make([]float32, w)
			c.Project(a1, b1, x)
			for i := range a0 {
				if math.Float32bits(a0[i]) != math.Float32bits(a1[i]) || math.Float32bits(b0[i]) != math.Float32bits(b1[i]) {
					t.Fatalf("bf16 %v r %d: row %d: (%g, %g) from panels, (%g, %g) from fp32", bf, r, i, a1[i], b1[i], a0[i], b0[i])
				}
			}
			gk, gg := c.Weights()
			for i := range gk {
				if gk[i] != wkv[i] || gg[i] != wgate[i] {
					t.Fatalf("Weights()[%d] = (%g, %g), want (%g, %g)", i, gk[i], gg[i], wkv[i], wgate[i])
				}
			}
			st := c.NewState()
			c.Ingest(st, a1, b1, 0)
		}
	}
}
