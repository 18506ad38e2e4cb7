package quant

import (
	"math"
	"math/rand/v2"
	"testing"
)

// hypBlocks returns n blocks of 64 bf16 values with varied magnitudes,
// including blocks whose amax/448 is an exact power of two and near-zero
// blocks (where the scale rules differ).
func hypBlocks(n int, seed uint64) []float32 {
	rng := rand.New(rand.NewPCG(seed, 7))
	v := make([]float32, 64*n)
	for b := 0; b < n; b++ {
		blk := v[b*64 : (b+1)*64]
		mag := math.Ldexp(1, rng.IntN(40)-30)
		for i := range blk {
			blk[i] = BF16Round(float32(rng.NormFloat64() * mag))
		}
		switch b % 4 {
		case 1: // amax = 448·2^k exactly: t is a power of two
			blk[rng.IntN(64)] = float32(448 * math.Ldexp(1, rng.IntN(10)-12))
		case 2: // amax a little above 448·2^k
			blk[rng.IntN(64)] = BF16Next(float32(448*math.Ldexp(1, rng.IntN(10)-12)), 1)
		case 3: // near zero: below the 1e-4 floor
			for i := range blk {
				blk[i] = BF16Round(blk[i] * 1e-9)
			}
		}
	}
	return v
}

func TestFQ8RuleCeil2IsFQ8(t *testing.T) {
	v := hypBlocks(400, 1)
	a := append([]float32(nil), v...)
	b := append([]float32(nil), v...)
	FQ8(a, 64)
	FQ8Rule(b, 64, ScaleCeil2, FP8AmaxFloor)
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			t.Fatalf("element %d: FQ8 %g, FQ8Rule(ceil2) %g (input %g)", i, a[i], b[i], v[i])
		}
	}
}

// Every other rule must differ from the reference on some block of the set
// (else it is no hypothesis), and where it differs, its scale is the
// rule's: the result must be FQ8 with exactly that power of two.
func TestFQ8RuleOtherRulesDiffer(t *testing.T) {
	v := hypBlocks(400, 2)
	ref := append([]float32(nil), v...)
	FQ8(ref, 64)
	for _, c := range []struct {
		rule  ScaleRule
		floor float32
	}{{ScaleLog2Ceil, 1e-8}, {ScaleFlashMLA, FP8AmaxFloor}, {ScaleRoundLog2, FP8AmaxFloor}} {
		got := append([]float32(nil), v...)
		FQ8Rule(got, 64, c.rule, c.floor)
		differ := 0
		for b := 0; b < len(v)/64; b++ {
			blk := v[b*64 : (b+1)*64]
			x := BlockScaleExp(c.rule, absMax(blk), E4M3Max, c.floor)
			s := float32(math.Ldexp(1, x))
			same := true
			for i, f := range blk {
				want := BF16Round(E4M3(min(max(f/s, -448), 448)) * s)
				if math.Float32bits(got[b*64+i]) != math.Float32bits(want) {
					t.Fatalf("%s floor %g block %d element %d: %g, want %g with scale 2^%d", c.rule, c.floor, b, i, got[b*64+i], want, x)
				}
				same = same && math.Float32bits(want) == math.Float32bits(ref[b*64+i])
			}
			if !same {
				differ++
			}
		}
		if differ == 0 {
			t.Errorf("%s floor %g: no block differs from FQ8", c.rule, c.floor)
		}
	}
}

// FQ8Floor2: every block's scale is the reference's, or half of it exactly
// when amax/448 is not a power of two.
func TestFQ8Floor2(t *testing.T) {
	v := hypBlocks(400, 3)
	got := append([]float32(nil), v...)
	FQ8Floor2(got, 64)
	halved, kept := 0, 0
	for b := 0; b < len(v)/64; b++ {
		blk := v[b*64 : (b+1)*64]
		tt := float64(max(absMax(blk), FP8AmaxFloor) * InvE4M3Max)
		e := math.Floor(math.Log2(tt)) // exact for these magnitudes
		s := float32(math.Ldexp(1, int(e)))
		if float64(s) == tt {
			kept++
		} else {
			halved++
		}
		for i, f := range blk {
			want := BF16Round(E4M3(min(max(f/s, -448), 448)) * s)
			if math.Float32bits(got[b*64+i]) != math.Float32bits(want) {
				t.Fatalf("block %d element %d: %g, want %g (scale %g)", b, i, got[b*64+i], want, s)
			}
		}
	}
	if halved == 0 || kept == 0 {
		t.Fatalf("test set covers halved=%d kept=%d blocks; want both", halved, kept)
	}
}

func TestQuantizeActFP8RuleCeil2IsReference(t *testing.T) {
	x := hypBlocks(64, 4) // 4096 values = 32 blocks of 128
	q1, s1 := make([]float32, len(x)), make([]float32, len(x)/128)
	q2, s2 := make([]float32, len(x)), make([]float32, len(x)/128)
	QuantizeActFP8(q1, s1, x, 128)
	QuantizeActFP8Rule(q2, s2, x, 128, ScaleCeil2, FP8AmaxFloor)
	for i := range q1 {
		if math.Float32bits(q1[i]) != math.Float32bits(q2[i]) {
			t.Fatalf("code %d: %g vs %g", i, q1[i], q2[i])
		}
	}
	for b := range s1 {
		if s1[b] != s2[b] {
			t.Fatalf("scale %d: %g vs %g", b, s1[b], s2[b])
		}
	}
	for i := 0; i < 128; i++ { // one near-zero block, below the 1e-4 floor
		x[i] = BF16Round(float32(i-64) * 1e-9)
	}
	QuantizeActFP8(q1, s1, x, 128)
	QuantizeActFP8Rule(q2, s2, x, 128, ScaleLog2Ceil, 1e-8)
	diff := 0
	for b := range s1 {
		if s1[b] != s2[b] {
			diff++
		}
	}
	if diff == 0 {
		t.Fatal("log2ceil with floor 1e-8 picks the reference scale for every block of the set")
	}
}

// On bf16 block maxima the vLLM rule (log2 + ceil, floor 1e-4) picks the
// reference scale for every finite positive value: the two rules can differ
// only where f32(a·f32(1/448)) and a/448 straddle a power of two, which no
// bf16 a does. So an FQ8 of bf16 values cannot tell vLLM's writer from the
// reference, and the replay must not name it as a distinct hypothesis there.
func TestLog2CeilEqualsCeil2OnBF16(t *testing.T) {
	for h := uint32(1); h < 0x7f80; h++ {
		a := math.Float32frombits(h << 16)
		x1 := BlockScaleExp(ScaleCeil2, a, E4M3Max, FP8AmaxFloor)
		x2 := BlockScaleExp(ScaleLog2Ceil, a, E4M3Max, FP8AmaxFloor)
		if x1 != x2 {
			t.Fatalf("amax %g (bf16 0x%04x): ceil2 2^%d, log2ceil 2^%d", a, h, x1, x2)
		}
	}
}
