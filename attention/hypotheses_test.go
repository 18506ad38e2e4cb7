package attention

import (
	"math"
	"math/rand/v2"
	"testing"

	"sparsemla/dump"
	"sparsemla/quant"
)

// naive64 is sparse attention in float64 from the definition, with the
// roundings a hypothesis names applied at its points: an independent
// formulation of sparseAttnNaive.
func naive64(q, kv []float32, d int, idx []int32, sink []float32, tau float32, bf16Logits, bf16Probs bool) []float32 {
	heads := len(q) / d
	o := make([]float32, len(q))
	for h := 0; h < heads; h++ {
		l := make([]float64, len(idx))
		m := float64(sink[h])
		for i, j := range idx {
			l[i] = math.Inf(-1)
			if j < 0 {
				continue
			}
			var s float64
			for k := 0; k < d; k++ {
				s += float64(q[h*d+k]) * float64(kv[int(j)*d+k])
			}
			if bf16Logits {
				l[i] = float64(quant.BF16Round(quant.BF16Round(float32(s)) * tau))
			} else {
				l[i] = s * float64(tau)
			}
			m = math.Max(m, l[i])
		}
		den := math.Exp(float64(sink[h]) - m)
		for _, v := range l {
			den += math.Exp(v - m)
		}
		acc := make([]float64, d)
		for i, j := range idx {
			if j < 0 {
				continue
			}
			p := math.Exp(l[i]-m) / den
			if bf16Probs {
				p = float64(quant.BF16Round(float32(p)))
			}
			for k := 0; k < d; k++ {
				acc[k] += p * float64(kv[int(j)*d+k])
			}
		}
		for k := range acc {
			o[h*d+k] = quant.BF16Round(float32(acc[k]))
		}
	}
	return o
}

// Each attention hypothesis agrees with its float64 definition within one
// bf16 ulp of the head's scale, and differs from the reference kernel on
// the same inputs (else it could not be told apart).
func TestSparseAttnHypotheses(t *testing.T) {
	const heads, d = 4, 512
	tau := float32(1 / math.Sqrt(512))
	q, kv, idx, sink := attnCase(3, heads, 300, 200)
	// Larger logits make the bf16 logit rounding visible.
	for i := range q {
		q[i] = quant.BF16Round(q[i] * 3)
	}
	ref := make([]float32, heads*d)
	SparseAttn(ref, q, kv, d, idx, sink, tau)
	for _, c := range []struct {
		name               string
		f                  func(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32)
		bf16Logits, bf16Pr bool
	}{
		{"bf16 logits", SparseAttnBF16Logits, true, false},
		{"bf16 softmax", SparseAttnBF16Softmax, false, true},
		{"bf16 logits and softmax", SparseAttnBF16LogitsSoftmax, true, true},
	} {
		o := make([]float32, heads*d)
		c.f(o, q, kv, d, idx, sink, tau)
		want := naive64(q, kv, d, idx, sink, tau, c.bf16Logits, c.bf16Pr)
		if u := maxScaledULP(o, want, d); u > 1 {
			t.Errorf("%s: %.3f bf16 ulps from its float64 definition", c.name, u)
		}
		if u := maxULP(o, ref); u == 0 {
			t.Errorf("%s: bit-identical to the reference: not distinguishable", c.name)
		}
	}
	// Without either rounding the naive form is the two-pass definition.
	o := make([]float32, heads*d)
	sparseAttnNaive(o, q, kv, d, idx, sink, tau, false, false)
	tp := make([]float32, heads*d)
	SparseAttnTwoPass(tp, q, kv, d, idx, sink, tau)
	if u := maxScaledULP(o, tp, d); u > 1 {
		t.Errorf("naive without roundings vs two-pass: %.3f ulps", u)
	}
}

// The merge hypotheses: reference weights through mergeWeighted give
// MergePartials bit for bit; no-sink merge = the kernel without sink
// within an ulp; the unscaled merge follows its formula (float64) within
// an ulp and differs from the reference.
func TestMergeHypotheses(t *testing.T) {
	const heads, d = 4, 512
	tau := float32(1 / math.Sqrt(512))
	q, kv, idx, sink := attnCase(5, heads, 400, 300)
	parts := []Partial{SparseAttnPartial(q, kv, d, idx[:120], tau), SparseAttnPartial(q, kv, d, idx[120:], tau)}
	ref := make([]float32, heads*d)
	L := MergePartials(ref, parts, sink, d)

	o := make([]float32, heads*d)
	mergeWeighted(o, parts, heads, d, func(h, s int) float32 { return exp2_32(parts[s].LSE2[h] - L[h]) })
	if u := maxULP(o, ref); u != 0 {
		t.Errorf("reference weights through mergeWeighted: %d ulps from MergePartials", u)
	}

	MergePartialsNoSink(o, parts, d)
	ns := make([]float32, heads*d)
	SparseAttnNoSink(ns, q, kv, d, idx, tau)
	if u := maxScaledULP(o, ns, d); u > 1 {
		t.Errorf("no-sink merge vs no-sink kernel: %.3f ulps", u)
	}
	if u := maxScaledULP(o, ref, d); u < 1 {
		t.Errorf("no-sink merge within %.3f ulps of the reference", u)
	}

	MergePartialsUnscaled(o, parts, sink, d, 1)
	for h := 0; h < heads; h++ {
		w0 := math.Exp2(float64(parts[0].LSE2[h] - L[h]))
		for k := 0; k < d; k++ {
			i := h*d + k
			want := quant.BF16Round(float32(w0*float64(parts[0].O[i]) + float64(parts[1].O[i])))
			if quant.BF16ULPDistance(o[i], want) > 1 {
				t.Fatalf("unscaled merge [%d]: %g, want %g", i, o[i], want)
			}
		}
	}
	if u := maxScaledULP(o, ref, d); u < 2 {
		t.Errorf("unscaled merge within %.3f ulps of the reference", u)
	}
	for name, f := range map[string]func(){
		"base-e":   func() { MergePartialsBaseE(o, parts, sink, d) },
		"no total": func() { MergePartialsNoTotal(o, parts, sink, d) },
	} {
		f()
		if u := maxScaledULP(o, ref, d); u < 2 {
			t.Errorf("%s merge within %.3f ulps of the reference", name, u)
		}
	}
}

func TestLinearHypotheses(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 1))
	const rows, cols = 64, 256
	W := make([]float32, rows*cols)
	for i := range W {
		W[i] = float32(rng.NormFloat64() * 0.05)
	}
	w := QuantizeFP8Weight(W, rows, cols)
	compact := NewFP8WeightCodes(w.Codes, w.Scale, rows, cols)
	x := make([]float32, cols)
	for i := range x {
		x[i] = quant.BF16Round(float32(rng.NormFloat64() * math.Ldexp(1, rng.IntN(8)-4)))
	}
	y1, y2, y3 := make([]float32, rows), make([]float32, rows), make([]float32, rows)
	FP8Linear(y1, x, w)
	FP8LinearActRule(y2, x, w, quant.ScaleCeil2, quant.FP8AmaxFloor)
	if u := maxULP(y1, y2); u != 0 {
		t.Errorf("FP8LinearActRule(ceil2) vs FP8Linear: %d ulps", u)
	}
	FP8LinearBF16(y2, x, w)
	FP8LinearBF16(y3, x, compact)
	want := make([]float32, rows)
	BF16Linear(want, x, w.W, rows, cols)
	if u := maxULP(y2, want); u != 0 {
		t.Errorf("FP8LinearBF16 vs BF16Linear on the dequantised weight: %d ulps", u)
	}
	if u := maxULP(y3, want); u != 0 {
		t.Errorf("FP8LinearBF16 on a compact weight: %d ulps", u)
	}
	if u := maxULP(y1, y2); u == 0 {
		t.Error("FP8LinearBF16 equals FP8Linear: the activation quantisation left no trace")
	}
}

func TestCompressorHypotheses(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 2))
	c := randCompressor(rng, 4, 128, 256, true)
	xs := randTokens(rng, 4, 256)
	st := c.NewState()
	w := c.Width()
	a, b := make([]float32, w), make([]float32, w)
	for p := int64(0); p < 3; p++ {
		c.Project(a, b, xs[p])
		c.Advance(st, a, b, p)
	}
	c.Project(a, b, xs[3])
	a2, b2 := make([]float32, w), make([]float32, w)
	c.ProjectBF16(a2, b2, xs[3])
	changed := false
	for i := range a {
		if a2[i] != quant.BF16Round(a[i]) || b2[i] != quant.BF16Round(b[i]) {
			t.Fatalf("ProjectBF16 [%d] is not bf16 of Project", i)
		}
		changed = changed || a2[i] != a[i]
	}
	if !changed {
		t.Fatal("ProjectBF16 equals Project")
	}
	p32, pb := make([]float32, c.HeadDim), make([]float32, c.HeadDim)
	c.PoolAtF32(p32, st, a, b, 3)
	c.PoolAt(pb, st, a, b, 3)
	exact := true
	for i := range pb {
		if quant.BF16Round(p32[i]) != pb[i] {
			t.Fatalf("bf16(PoolAtF32)[%d] = %g, PoolAt %g", i, quant.BF16Round(p32[i]), pb[i])
		}
		exact = exact && p32[i] == pb[i]
	}
	if exact {
		t.Fatal("PoolAtF32 is already bf16 everywhere: no hypothesis")
	}
}

// goldenRope reads the GPU's own RoPE tables of a golden run.
func goldenRope(t *testing.T, dir string) map[string]*RopeTable {
	t.Helper()
	s, err := dump.OpenSafetensors(dir + "/rope_tables.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	out := map[string]*RopeTable{}
	for _, name := range []string{"freqs_cis_r0", "freqs_cis_cmp"} {
		f, sh, err := s.Float32(name)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = RopeTableFromCis(f, sh[0], dir+" "+name)
	}
	return out
}

var (
	ropeR0  = RopeParams{Base: 10000}
	ropeCmp = RopeParams{Base: 160000, OriginalSeqLen: 65536, Factor: 16, BetaFast: 32, BetaSlow: 1}
)

// The GPU tables of both goldens are the config's tables within
// RopeAngleTol, though many entries differ in bits (CUDA libm); the worst
// angle error is the figure RopeAngleTol's comment quotes.
func TestRopeGoldenTablesWithinTolerance(t *testing.T) {
	for _, dir := range []string{"../testdata/official-v4-tiny", "../testdata/gpu-v4-tiny-long"} {
		tabs := goldenRope(t, dir)
		differ := 0
		for name, p := range map[string]RopeParams{"freqs_cis_r0": ropeR0, "freqs_cis_cmp": ropeCmp} {
			c := CheckRopeTable(tabs[name], p, nil)
			t.Logf("%s %s: %s", dir, name, c.Diff)
			if !c.Diff.OK() {
				t.Errorf("%s %s: the GPU's table is outside the tolerance: %s", dir, name, c.Diff)
			}
			if c.Diff.MaxAngleULP > 2.07 {
				t.Errorf("%s %s: worst angle error %.3f ulps, the tolerance's comment says ≤ 2.06", dir, name, c.Diff.MaxAngleULP)
			}
			differ += c.Diff.Differ
		}
		if differ == 0 {
			t.Errorf("%s: the GPU tables equal the computed ones bit for bit; the tolerance test needs libm differences", dir)
		}
	}
}

// A wrong table is outside the tolerance and named: each hypothesis table,
// carrying the golden GPU's own libm noise (its angle errors added), is
// classified as that hypothesis (or as one whose table is equivalent).
func TestRopeWrongTablesClassified(t *testing.T) {
	tabs := goldenRope(t, "../testdata/official-v4-tiny")
	for name, c := range map[string]struct {
		p, yarn RopeParams
		other   float64
	}{"freqs_cis_r0": {ropeR0, ropeCmp, 160000}, "freqs_cis_cmp": {ropeCmp, ropeCmp, 10000}} {
		gpu := tabs[name]
		hyps := RopeHypotheses(c.p, c.other, c.yarn)
		if len(hyps) < 2 {
			t.Fatalf("%s: only %d hypotheses", name, len(hyps))
		}
		ref := RopeFreqs(c.p)
		for _, h := range hyps {
			// The hypothesis's table with the GPU's error pattern: rotate each
			// entry by the angle the GPU's entry is off from the reference's.
			T := gpu.T
			tb := &RopeTable{T: T, Cos: make([]float32, T*RopePairs), Sin: make([]float32, T*RopePairs), Source: h.Name}
			for tt := 0; tt < T; tt++ {
				for i := 0; i < RopePairs; i++ {
					k := tt*RopePairs + i
					th0 := float64(float32(float32(tt) * ref[i]))
					noise := math.Atan2(float64(gpu.Sin[k]), float64(gpu.Cos[k])) - th0
					noise = math.Remainder(noise, 2*math.Pi)
					th := float64(float32(float32(tt) * h.Freqs[i]))
					ulp := func(x float64) float64 { return math.Ldexp(1, math.Ilogb(math.Max(math.Abs(x), 1))-23) }
					th += noise / ulp(th0) * ulp(th) // the same error in ulps of θ
					tb.Cos[k], tb.Sin[k] = float32(math.Cos(th)), float32(math.Sin(th))
				}
			}
			ck := CheckRopeTable(tb, c.p, hyps)
			if ck.Diff.OK() {
				t.Errorf("%s, table %q: within tolerance of the config's table (%s)", name, h.Name, ck.Diff)
				continue
			}
			if !ck.Matches {
				t.Errorf("%s, table %q: no hypothesis matches; closest %q: %s", name, h.Name, ck.Best, ck.BestDiff)
				continue
			}
			if ck.Best != h.Name {
				// Only acceptable when the two hypotheses' tables agree within tolerance.
				var other RopeHypothesis
				for _, o := range hyps {
					if o.Name == ck.Best {
						other = o
					}
				}
				if d := CompareRopeFreqs(NewRopeTableFreqs(h.Freqs, T, h.Name), other.Freqs); !d.OK() {
					t.Errorf("%s, table %q classified as %q", name, h.Name, ck.Best)
				}
			}
		}
	}
}

// RopeDiff's worst entry is one element: its values are the table's at that
// position and pair.
func TestRopeDiffOneElement(t *testing.T) {
	w := RopeFreqs(ropeCmp)
	tb := NewRopeTableFreqs(w, 64, "computed")
	tb.Cos[10*RopePairs+3] = quant.BF16Round(tb.Cos[10*RopePairs+3] + 0.01)
	tb.Sin[20*RopePairs+7] = -tb.Sin[20*RopePairs+7] // far bigger angle error
	d := CompareRopeFreqs(tb, w)
	if d.AnglePos != 20 || d.AnglePair != 7 || d.GPUSin != tb.Sin[20*RopePairs+7] || d.GPUCos != tb.Cos[20*RopePairs+7] {
		t.Fatalf("worst entry (%d, %d) cos %g sin %g, want (20, 7) with the table's values", d.AnglePos, d.AnglePair, d.GPUCos, d.GPUSin)
	}
	if d.Differ != 2 || d.Over != 2 || d.OK() {
		t.Fatalf("differ %d over %d, want 2 and 2", d.Differ, d.Over)
	}
}

func TestNormAndRopeHypotheses(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 1))
	x, w := make([]float32, 512), make([]float32, 512)
	for i := range x {
		x[i] = quant.BF16Round(float32(rng.NormFloat64()))
		w[i] = quant.BF16Round(float32(1 + 0.3*rng.NormFloat64()))
	}
	a, b := make([]float32, 512), make([]float32, 512)
	RMSNorm(a, x, w, NormEps)
	RMSNormHF(b, x, w, NormEps)
	if maxULP(a, b) == 0 {
		t.Error("RMSNormHF equals RMSNorm")
	}
	if u := maxULP(a, b); u > 2 {
		t.Errorf("RMSNormHF %d ulps from RMSNorm: more than its extra rounding allows", u)
	}
	q1 := append([]float32(nil), x...)
	q2 := append([]float32(nil), x...)
	HeadRMS(q1, 128, NormEps)
	HeadRMSF32(q2, 128, NormEps)
	if maxULP(q1, q2) == 0 {
		t.Error("HeadRMSF32 equals HeadRMS")
	}
	// NeoX rotation = interleaved rotation of the permuted vector.
	tb := testRope()
	v := append([]float32(nil), x[:64]...)
	perm := make([]float32, 64)
	for i := 0; i < 32; i++ {
		perm[2*i], perm[2*i+1] = v[i], v[i+32]
	}
	tb.ApplyRopeHalf(v, 77, false)
	tb.ApplyRope(perm, 77, false)
	for i := 0; i < 32; i++ {
		if v[i] != perm[2*i] || v[i+32] != perm[2*i+1] {
			t.Fatalf("pair %d: half-split rotation is not the interleaved one on the permuted pairs", i)
		}
	}
}
