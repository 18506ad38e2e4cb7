package attention

import (
	"math"
	"math/big"
	"math/rand/v2"
	"slices"
	"testing"

	"sparsemla/quant"
)

// TestRMSNormHand checks RMSNorm on values derived by hand.
func TestRMSNormHand(t *testing.T) {
	// x = [3, 4]: mean(x²) = 12.5, rsqrt(12.5 + 1e-6) = 0.28284270
	// y0 = bf16(1 · 3·0.2828427) = bf16(0.8485281) = 217·2^-8 = 0.84765625
	// y1 = bf16(2 · 4·0.2828427) = bf16(2.2627417) = 145·2^-6 = 2.265625
	y := make([]float32, 2)
	RMSNorm(y, []float32{3, 4}, []float32{1, 2}, NormEps)
	if y[0] != 0.84765625 || y[1] != 2.265625 {
		t.Errorf("RMSNorm([3 4], [1 2]) = %v, want [0.84765625 2.265625]", y)
	}
	// x all ones: rsqrt(1 + 1e-6) = 0.9999995 → w·x·rs rounds back to w in bf16.
	w := []float32{0.5, -1.5, 3, 0.25}
	RMSNorm(y[:0], nil, nil, NormEps) // zero-length is allowed
	y = make([]float32, 4)
	RMSNorm(y, []float32{1, 1, 1, 1}, w, NormEps)
	if !slices.Equal(y, w) {
		t.Errorf("RMSNorm(ones, w) = %v, want w = %v", y, w)
	}
}

// TestHeadRMSHand checks the per-op bf16 head norm on two heads of d = 4.
func TestHeadRMSHand(t *testing.T) {
	// head 0 = [2, 2, 2, 2]: sq = 4, Σ = 16, m = 4, v = bf16(4 + 1e-6) = 4, ρ = 0.5 → 1.
	// head 1 = [1, 1, 1, 3]: sq = [1 1 1 9], Σ = 12, m = 3, v = 3,
	// ρ = bf16(rsqrt 3 = 0.57735) = 148·2^-8 = 0.578125 → [0.578125 ×3, bf16(1.734375) = 1.734375].
	q := []float32{2, 2, 2, 2, 1, 1, 1, 3}
	HeadRMS(q, 4, NormEps)
	want := []float32{1, 1, 1, 1, 0.578125, 0.578125, 0.578125, 1.734375}
	if !slices.Equal(q, want) {
		t.Errorf("HeadRMS = %v, want %v", q, want)
	}
}

// TestFP8LinearHand checks the activation quantisation and the block sums.
func TestFP8LinearHand(t *testing.T) {
	// One output row of 128 ones (scale byte 127 = 2^0).
	codes := make([]uint8, 128)
	for i := range codes {
		codes[i] = quant.EncodeE4M3(1)
	}
	w := NewFP8Weight(codes, []uint8{127}, 1, 128)
	y := make([]float32, 1)
	x := make([]float32, 128)
	// x = 1: s = ceil2(f32(1·f32(1/448))) = 2^-8, qx = 256 (exact in E4M3), y = 128·256·2^-8 = 128.
	for i := range x {
		x[i] = 1
	}
	FP8Linear(y, x, w)
	if y[0] != 128 {
		t.Errorf("FP8Linear(ones) = %v, want 128", y[0])
	}
	// x = bf16(0.3) = 0.30078125: s = ceil2(6.71e-4) = 2^-10, x/s = 308, E4M3 rounds 308 to 320
	// (step 32 in [256, 512)), so every qx·s = 0.3125 and y = 128·0.3125 = 40 — the
	// activation really is quantised (a plain bf16 dot would give 38.5).
	for i := range x {
		x[i] = quant.BF16Round(0.3)
	}
	FP8Linear(y, x, w)
	if y[0] != 40 {
		t.Errorf("FP8Linear(0.3) = %v, want 40", y[0])
	}
}

// TestQuantizeFP8WeightRoundTrip checks that synthetic FP8 weights dequantise
// to values on the block grid and that the weight survives a re-wrap.
func TestQuantizeFP8WeightRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	rows, cols := 200, 256
	W := make([]float32, rows*cols)
	for i := range W {
		W[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	fw := QuantizeFP8Weight(W, rows, cols)
	if len(fw.Scale) != 2*2 {
		t.Fatalf("scale blocks = %d, want 4", len(fw.Scale))
	}
	again := NewFP8Weight(fw.Codes, fw.Scale, rows, cols)
	if !slices.Equal(again.W, fw.W) {
		t.Fatal("dequantisation is not deterministic")
	}
	for i, v := range fw.W {
		if quant.BF16Round(v) != v {
			t.Fatalf("W[%d] = %v is not a bf16 value", i, v)
		}
		if d := math.Abs(float64(v - W[i])); d > 0.07*math.Abs(float64(W[i]))+1e-2 {
			t.Fatalf("W[%d] = %v far from %v", i, v, W[i])
		}
	}
}

// TestLinearsHand checks the bf16 and fp32 linears and the grouped wo_a.
func TestLinearsHand(t *testing.T) {
	y := make([]float32, 2)
	// [[1 1] [1 -1]] · [0.5, 0.25] = [0.75, 0.25]
	BF16Linear(y, []float32{0.5, 0.25}, []float32{1, 1, 1, -1}, 2, 2)
	if y[0] != 0.75 || y[1] != 0.25 {
		t.Errorf("BF16Linear = %v", y)
	}
	// fp32 keeps bits that bf16 rounds away: 1 + 2^-10 is not a bf16 value.
	F32Linear(y[:1], []float32{1, 0x1p-10}, []float32{1, 1}, 1, 2)
	if y[0] != 1+0x1p-10 {
		t.Errorf("F32Linear = %v, want 1+2^-10", y[0])
	}
	BF16Linear(y[:1], []float32{1, 0x1p-10}, []float32{1, 1}, 1, 2)
	if y[0] != 1 {
		t.Errorf("BF16Linear rounds 1+2^-10 to %v, want 1", y[0])
	}
	// wo_a with 2 groups of rank 1: o = [1 2 | 3 4], wo_a rows [1 1] (group 0), [1 -1] (group 1)
	// u = [1+2, 3-4] = [3, -1].
	u := make([]float32, 2)
	WoA(u, []float32{1, 2, 3, 4}, []float32{1, 1, 1, -1}, 2, 1)
	if u[0] != 3 || u[1] != -1 {
		t.Errorf("WoA = %v, want [3 -1]", u)
	}
}

// TestRopeHand checks the table, the fused rotation and its inverse.
func TestRopeHand(t *testing.T) {
	tb := NewRopeTable(RopeParams{Base: 10000}, 4)
	// Position 0: cos 1, sin 0 → identity.
	v := make([]float32, RopeDims)
	for i := range v {
		v[i] = quant.BF16Round(float32(i) * 0.37)
	}
	orig := slices.Clone(v)
	tb.Apply(v, 0)
	if !slices.Equal(v, orig) {
		t.Errorf("RoPE at position 0 changed the vector")
	}
	// Position 1, pair 0: ω_0 = 1, θ = 1 rad. (1, 0) → (cos 1, sin 1) = (0.5403023, 0.8414710)
	// → bf16: 138·2^-8 = 0.5390625, 215·2^-8 = 0.83984375.
	clear(v)
	v[0] = 1
	tb.Apply(v, 1)
	if v[0] != 0.5390625 || v[1] != 0.83984375 {
		t.Errorf("RoPE((1,0), θ=1) = (%v, %v), want (0.5390625, 0.83984375)", v[0], v[1])
	}
	// The inverse rotates back to within a bf16 ulp of (1, 0).
	tb.Inverse(v, 1)
	if quant.BF16ULPDistance(v[0], 1) > 1 || math.Abs(float64(v[1])) > 0x1p-8 {
		t.Errorf("inverse RoPE gives (%v, %v), want ≈ (1, 0)", v[0], v[1])
	}
	// A dumped table [T][32][2] = (cos, sin): at t = 1 pair 0 is a quarter turn
	// (cos 0, sin 1), so (x0, x1) = (1, 2) → (fma(1, 0, −2·1), fma(1, 1, 2·0)) = (−2, 1).
	cis := make([]float32, 2*RopePairs*2)
	for i := 0; i < 2*RopePairs; i++ {
		cis[2*i] = 1 // cos 1, sin 0: identity for every other pair and t = 0
	}
	cis[2*RopePairs*1], cis[2*RopePairs*1+1] = 0, 1
	g := RopeTableFromCis(cis, 2, "test")
	clear(v)
	v[0], v[1], v[2], v[3] = 1, 2, 3, 4
	g.Apply(v, 1)
	if v[0] != -2 || v[1] != 1 || v[2] != 3 || v[3] != 4 {
		t.Errorf("quarter turn of (1,2),(3,4) = %v, want (-2,1),(3,4)", v[:4])
	}
}

// TestRopeFreqsYaRN checks the YaRN blend boundaries of spec §3.6: for base
// 160000, L = 65536, factor 16, betas 32/1: low = 15, high = 25, pairs 0..15
// keep ω_i, pairs 25..31 get ω_i/16, pairs in between are blended.
func TestRopeFreqsYaRN(t *testing.T) {
	plain := RopeFreqs(RopeParams{Base: 160000})
	yarn := RopeFreqs(RopeParams{Base: 160000, OriginalSeqLen: 65536, Factor: 16, BetaFast: 32, BetaSlow: 1})
	for i := 0; i < RopePairs; i++ {
		switch {
		case i <= 15:
			if yarn[i] != plain[i] {
				t.Errorf("pair %d: YaRN %v, want unchanged %v", i, yarn[i], plain[i])
			}
		case i >= 25:
			if yarn[i] != plain[i]/16 {
				t.Errorf("pair %d: YaRN %v, want ω/16 = %v", i, yarn[i], plain[i]/16)
			}
		default:
			if !(yarn[i] < plain[i] && yarn[i] > plain[i]/16) {
				t.Errorf("pair %d: YaRN %v not strictly between ω/16 and ω = %v", i, yarn[i], plain[i])
			}
		}
	}
	if plain[0] != 1 {
		t.Errorf("ω_0 = %v, want 1", plain[0])
	}
}

// TestFMA32 checks the single-rounding fp32 FMA against exact arithmetic,
// including inputs built to land exactly halfway in float64.
func TestFMA32(t *testing.T) {
	exact := func(a, b, c float32) float32 {
		x := new(big.Float).SetPrec(200).SetFloat64(float64(a))
		x.Mul(x, new(big.Float).SetPrec(200).SetFloat64(float64(b)))
		x.Add(x, new(big.Float).SetPrec(200).SetFloat64(float64(c)))
		f, _ := x.Float32()
		return f
	}
	rng := rand.New(rand.NewPCG(3, 4))
	// a = 1 + 2^-23, b = 1 + 2^-23: a·b = 1 + 2^-22 + 2^-46. With c = 2^-24 the sum
	// 1 + 2^-22 + 2^-24 + 2^-46 rounds (float64) to 1 + 2^-22 + 2^-24, an fp32 tie,
	// which the second rounding would send to even; the exact value is above it.
	cases := [][3]float32{{1 + 0x1p-23, 1 + 0x1p-23, 0x1p-24}, {1 + 0x1p-23, 1 + 0x1p-23, -0x1p-24}}
	for i := 0; i < 200000; i++ {
		a := float32(rng.NormFloat64())
		b := float32(rng.NormFloat64())
		c := -float32(float64(a) * float64(b) * (1 + 1e-7*rng.NormFloat64()))
		cases = append(cases, [3]float32{a, b, c})
	}
	for _, k := range cases {
		if got, want := fma32(k[0], k[1], k[2]), exact(k[0], k[1], k[2]); got != want {
			t.Fatalf("fma32(%g, %g, %g) = %g, want %g", k[0], k[1], k[2], got, want)
		}
	}
}

// TestWindowIdxGrid checks get_window_topk_idxs at decode with a window of 8
// (the rule does not depend on the size; V4 uses 128).
func TestWindowIdxGrid(t *testing.T) {
	const N = -1 // "no key"
	grid := []struct {
		p    int64
		want []int32
	}{
		{1, []int32{0, 1, N, N, N, N, N, N}}, // 0 < p < win−1: 0..p then −1 at the end
		{6, []int32{0, 1, 2, 3, 4, 5, 6, N}},
		{7, []int32{0, 1, 2, 3, 4, 5, 6, 7}},  // p = win−1: s = 7, full ring in order
		{9, []int32{2, 3, 4, 5, 6, 7, 0, 1}},  // s = 1: oldest (token 2, slot 2) … newest (token 9, slot 1)
		{15, []int32{0, 1, 2, 3, 4, 5, 6, 7}}, // s = 7 again
	}
	for _, g := range grid {
		if got := WindowIdx(g.p, 8); !slices.Equal(got, g.want) {
			t.Errorf("WindowIdx(%d, 8) = %v, want %v", g.p, got, g.want)
		}
	}
	if got := IndexList(WindowIdx(3, 4), CompressedIdx(3, 4, 4)); !slices.Equal(got, []int32{0, 1, 2, 3, 4}) {
		t.Errorf("IndexList at p = 3, r = 4, win 4 = %v, want [0 1 2 3 4]", got)
	}
}

// TestEmissionTimeline checks the visible sets and the emission timeline of §2.3.
func TestEmissionTimeline(t *testing.T) {
	for _, c := range []struct {
		p     int64
		r     int
		tc    int
		emits bool
	}{
		{2, 4, 0, false}, {3, 4, 1, true}, {4, 4, 1, false}, {7, 4, 2, true},
		{126, 128, 0, false}, {127, 128, 1, true}, {255, 128, 2, true}, {5, 0, 0, false},
	} {
		if got := VisibleRows(c.p, c.r); got != c.tc {
			t.Errorf("VisibleRows(%d, %d) = %d, want %d", c.p, c.r, got, c.tc)
		}
		if got := EmitsRow(c.p, c.r); got != c.emits {
			t.Errorf("EmitsRow(%d, %d) = %v", c.p, c.r, got)
		}
		if c.emits && (EmissionPos(EmittedRow(c.p, c.r), c.r) != c.p || EmittedRow(c.p, c.r) != c.tc-1) {
			t.Errorf("row emitted at %d (r = %d) is %d, appears at %d", c.p, c.r, EmittedRow(c.p, c.r), EmissionPos(EmittedRow(c.p, c.r), c.r))
		}
	}
	if RowRopePos(3, 4) != 12 || RowRopePos(1, 128) != 128 {
		t.Error("RowRopePos is not j·r")
	}
	if f, l := VisibleWindow(200, 128); f != 73 || l != 200 {
		t.Errorf("VisibleWindow(200) = %d..%d, want 73..200", f, l)
	}
	aF, aL, bF, bL := RowTokens(2, 4)
	if aF != 4 || aL != 7 || bF != 8 || bL != 11 {
		t.Errorf("RowTokens(2, 4) = A %d..%d B %d..%d, want A 4..7 B 8..11", aF, aL, bF, bL)
	}
}

// TestSparseAttnHand: one head, d = 2, keys K0 = [1 0], K1 = [0 1], q = [1 0],
// τ = 1, sink σ = 0. ℓ = [1, 0], m = 1, P = [1, e^-1 = 0.36788] (bf16(P1) =
// 188·2^-9 = 0.3671875), l = 1 + 0.36788 + e^(0−1) = 1.73576.
// o = bf16([1/l, 0.3671875/l]) = bf16([0.57612, 0.21154]) = [0.57421875, 0.2119140625].
// The definition gives [e/(e+2), 1/(e+2)] = [0.57612, 0.21194] → the same bf16 values.
// lse = 1 + ln(1.73576) = 1.55144 = ln(e + 1 + 1).
func TestSparseAttnHand(t *testing.T) {
	q := []float32{1, 0}
	kv := []float32{1, 0, 0, 1}
	sink := []float32{0}
	want := []float32{0.57421875, 0.2119140625}
	for _, idx := range [][]int32{{0, 1}, {0, -1, 1, -1}, {1, 0}} {
		o := make([]float32, 2)
		lse := SparseAttn(o, q, kv, 2, idx, sink, 1)
		if !slices.Equal(o, want) {
			t.Errorf("SparseAttn idx %v = %v, want %v", idx, o, want)
		}
		if math.Abs(float64(lse[0])-math.Log(math.E+2)) > 1e-6 {
			t.Errorf("lse = %v, want ln(e+2) = %v", lse[0], math.Log(math.E+2))
		}
		o2 := make([]float32, 2)
		SparseAttnTwoPass(o2, q, kv, 2, idx, sink, 1)
		if !slices.Equal(o2, want) {
			t.Errorf("SparseAttnTwoPass idx %v = %v, want %v", idx, o2, want)
		}
	}
	// Ties: two equal keys get equal weights: o = bf16(2·e^0 K / (2 + e^(σ−0))) with σ = −∞ → K.
	o := make([]float32, 2)
	SparseAttn(o, q, []float32{0.5, 0.25, 0.5, 0.25}, 2, []int32{0, 1}, []float32{float32(math.Inf(-1))}, 1)
	if o[0] != 0.5 || o[1] != 0.25 {
		t.Errorf("two tied keys, no sink: o = %v, want [0.5 0.25]", o)
	}
	// No valid key: the definition leaves only the sink, o = 0.
	SparseAttnTwoPass(o, q, kv, 2, []int32{-1, -1}, sink, 1)
	if o[0] != 0 || o[1] != 0 {
		t.Errorf("all −1: o = %v, want 0", o)
	}
}

// attnCase is a random attention problem with V4 head dims.
func attnCase(seed uint64, heads, rows, L int) (q, kv []float32, idx []int32, sink []float32) {
	rng := rand.New(rand.NewPCG(seed, 7))
	const d = 512
	q = make([]float32, heads*d)
	kv = make([]float32, rows*d)
	for i := range q {
		q[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	for i := range kv {
		kv[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	idx = make([]int32, L)
	for i := range idx {
		idx[i] = int32(rng.IntN(rows))
	}
	// trailing −1 entries, as the window part has them early in a sequence
	for i := L - 10; i < L-3; i++ {
		idx[i] = -1
	}
	sink = make([]float32, heads)
	for i := range sink {
		sink[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	return
}

// maxScaledULP is max_i |a_i − b_i| in units of the bf16 ulp of max_i |b_i| of
// each d-wide row (head): the error relative to the head's output scale.
func maxScaledULP(a, b []float32, d int) float64 {
	var m float64
	for h := 0; h < len(a)/d; h++ {
		var scale float64
		for _, v := range b[h*d : (h+1)*d] {
			scale = max(scale, math.Abs(float64(v)))
		}
		ulp := float64(quant.BF16Next(float32(scale), 1)) - scale
		for i := h * d; i < (h+1)*d; i++ {
			m = max(m, math.Abs(float64(a[i])-float64(b[i]))/ulp)
		}
	}
	return m
}

func maxULP(a, b []float32) int32 {
	var m int32
	for i := range a {
		m = max(m, quant.BF16ULPDistance(a[i], b[i]))
	}
	return m
}

// TestSparseAttnChunkedVsTwoPass: the kernel order (chunks of 64, running
// max, bf16(P) for P·V) agrees with the two-pass definition within one bf16 ulp.
func TestSparseAttnChunkedVsTwoPass(t *testing.T) {
	const heads, d = 8, 512
	for seed := uint64(0); seed < 4; seed++ {
		q, kv, idx, sink := attnCase(seed, heads, 700, 640)
		a, b := make([]float32, heads*d), make([]float32, heads*d)
		la := SparseAttn(a, q, kv, d, idx, sink, float32(1/math.Sqrt(512)))
		lb := SparseAttnTwoPass(b, q, kv, d, idx, sink, float32(1/math.Sqrt(512)))
		t.Logf("seed %d: max %d bf16 ulps elementwise, %.3f ulps of the head's output scale", seed, maxULP(a, b), maxScaledULP(a, b, d))
		if u := maxScaledULP(a, b, d); u > 1 {
			t.Errorf("seed %d: chunked vs two-pass differ by %.3f bf16 ulps of the head's scale", seed, u)
		}
		for h := range la {
			if math.Abs(float64(la[h]-lb[h])) > 1e-5*max(1, math.Abs(float64(lb[h]))) {
				t.Errorf("seed %d head %d: lse %v vs %v", seed, h, la[h], lb[h])
			}
		}
	}
}

// TestSplitKMerge: attention split into partials over slices of the index list
// and merged FlashMLA-style (base 2, sink folded) equals the unsplit result.
func TestSplitKMerge(t *testing.T) {
	const heads, d = 4, 512
	q, kv, idx, sink := attnCase(9, heads, 500, 450)
	tau := float32(1 / math.Sqrt(512))
	ref := make([]float32, heads*d)
	lse := SparseAttnTwoPass(ref, q, kv, d, idx, sink, tau)
	one := make([]float32, heads*d)
	MergePartials(one, []Partial{SparseAttnPartial(q, kv, d, idx, tau)}, sink, d)
	if u := maxULP(one, ref); u > 1 {
		t.Errorf("single partial vs two-pass: %d ulps", u)
	}
	for _, cuts := range [][]int{{0, 64, 450}, {0, 100, 200, 300, 450}, {0, 440, 445, 450}} {
		var parts []Partial
		for i := 0; i+1 < len(cuts); i++ {
			parts = append(parts, SparseAttnPartial(q, kv, d, idx[cuts[i]:cuts[i+1]], tau))
		}
		o := make([]float32, heads*d)
		l2 := MergePartials(o, parts, sink, d)
		if u := maxULP(o, one); u > 1 {
			t.Errorf("cuts %v: merged vs unsplit differ by %d ulps", cuts, u)
		}
		for h := range l2 {
			if got := float64(l2[h]) * math.Ln2; math.Abs(got-float64(lse[h])) > 1e-5*math.Abs(float64(lse[h]))+1e-6 {
				t.Errorf("cuts %v head %d: merged lse %v, unsplit %v", cuts, h, got, lse[h])
			}
		}
	}
	// A split whose entries are all −1 contributes nothing.
	o := make([]float32, heads*d)
	MergePartials(o, []Partial{SparseAttnPartial(q, kv, d, idx, tau), SparseAttnPartial(q, kv, d, []int32{-1, -1}, tau)}, sink, d)
	if u := maxULP(o, one); u != 0 {
		t.Errorf("an empty split changed the result by %d ulps", u)
	}
}
