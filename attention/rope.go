package attention

import (
	"math"

	"sparsemla/quant"
)

// RopeDims is the number of rotated dims (ModelArgs.rope_head_dim): the LAST 64
// dims of every 512-d query/key and of every 128-d indexer vector.
const RopeDims = 64

// RopePairs is the number of rotated (x0, x1) pairs, RopeDims/2.
const RopePairs = RopeDims / 2

// RopeParams are the inputs of precompute_freqs_cis (R-M:199-229).
type RopeParams struct {
	Base           float64 // rope_theta (r = 0 layers) or compress_rope_theta (r > 0)
	OriginalSeqLen int     // 0 disables YaRN (r = 0 layers)
	Factor         float64 // rope_factor
	BetaFast       int
	BetaSlow       int
}

// RopeTable holds cos θ(t, i) and sin θ(t, i) for positions t < T and pairs
// i < 32, fp32, row-major [T][32]. It is either computed (NewRopeTable, spec
// §3.6) or the GPU's own table (RopeTableFromCis), which the replay prefers
// because CUDA's pow/cos/sin are not correctly rounded (§14).
type RopeTable struct {
	T        int
	Cos, Sin []float32 // [T*32]
	Source   string    // "computed" or where the table was loaded from
}

// RopeFreqs returns the 32 per-pair angular frequencies ω'_i of
// precompute_freqs_cis, every op in fp32 as torch does it:
//
//	ω_i = f32( 1 / f32(base^f32(2i/64)) )
//	YaRN (OriginalSeqLen > 0): low = max(floor(D(beta_fast)),0), high = min(ceil(D(beta_slow)),63),
//	  D(n) = 64·ln(L/(2πn)) / (2 ln base)  (float64, Python math)
//	  ramp_i = clamp(f32(f32(i−low)/f32(high−low)), 0, 1); smooth_i = 1 − ramp_i
//	  ω'_i = f32( f32(f32(ω_i/factor)·f32(1−smooth_i)) + f32(ω_i·smooth_i) )
//
// For V4 r > 0 layers (base 160000, L 65536, factor 16, betas 32/1): low = 15,
// high = 25, so pairs 0..15 keep ω_i and pairs 25..31 get ω_i/16.
func RopeFreqs(p RopeParams) [RopePairs]float32 {
	var w [RopePairs]float32
	for i := range w {
		e := float32(2*i) / RopeDims
		w[i] = float32(1 / float32(math.Pow(p.Base, float64(e))))
	}
	if p.OriginalSeqLen > 0 {
		corr := func(rot int) float64 {
			return RopeDims * math.Log(float64(p.OriginalSeqLen)/(float64(rot)*2*math.Pi)) / (2 * math.Log(p.Base))
		}
		low := max(math.Floor(corr(p.BetaFast)), 0)
		high := min(math.Ceil(corr(p.BetaSlow)), RopeDims-1)
		if low == high {
			high += 0.001
		}
		lo, hi := float32(low), float32(high)
		f := float32(p.Factor)
		for i := range w {
			ramp := min(max((float32(i)-lo)/(hi-lo), 0), 1)
			smooth := 1 - ramp
			w[i] = float32(float32(w[i]/f)*float32(1-smooth)) + float32(w[i]*smooth)
		}
	}
	return w
}

// NewRopeTable computes the table for positions 0..T-1 (spec §3.6):
// θ(t, i) = f32(f32(t)·ω'_i), cos and sin correctly rounded to fp32.
func NewRopeTable(p RopeParams, T int) *RopeTable {
	w := RopeFreqs(p)
	tb := &RopeTable{T: T, Cos: make([]float32, T*RopePairs), Sin: make([]float32, T*RopePairs), Source: "computed"}
	for t := 0; t < T; t++ {
		for i, wi := range w {
			th := float64(float32(float32(t) * wi))
			tb.Cos[t*RopePairs+i] = float32(math.Cos(th))
			tb.Sin[t*RopePairs+i] = float32(math.Sin(th))
		}
	}
	return tb
}

// RopeTableFromCis wraps a dumped table F32 [T, 32, 2] = (cos, sin) (the
// golden's rope_tables.safetensors freqs_cis_r0 / freqs_cis_cmp layout).
func RopeTableFromCis(cis []float32, T int, source string) *RopeTable {
	if len(cis) != T*RopePairs*2 {
		panic("attention: RopeTableFromCis length mismatch")
	}
	tb := &RopeTable{T: T, Cos: make([]float32, T*RopePairs), Sin: make([]float32, T*RopePairs), Source: source}
	for k := 0; k < T*RopePairs; k++ {
		tb.Cos[k] = cis[2*k]
		tb.Sin[k] = cis[2*k+1]
	}
	return tb
}

// ApplyRope rotates, in place, the interleaved pairs of v (len 64: the last 64
// dims of one vector) by the angles of position pos (apply_rotary_emb, R-M:232):
//
//	y0 = bf16( fma(x0, c, −f32(x1·s)) )
//	y1 = bf16( fma(x0, s,  f32(x1·c)) )
//
// with pair i = (v[2i], v[2i+1]), c = cos θ(pos,i), s = sin θ(pos,i). This is
// torch's complex product x·e^{iθ} with the first product fused, the form the
// GPU evaluates (confirmed bit-exact on the golden, §14). inverse uses the
// conjugate e^{−iθ} (s → −s), the de-rotation of the attention output.
func (tb *RopeTable) ApplyRope(v []float32, pos int64, inverse bool) {
	if len(v) != RopeDims {
		panic("attention: ApplyRope needs the 64 rope dims")
	}
	if pos < 0 || pos >= int64(tb.T) {
		panic("attention: ApplyRope position outside the table")
	}
	cs := tb.Cos[pos*RopePairs : (pos+1)*RopePairs]
	sn := tb.Sin[pos*RopePairs : (pos+1)*RopePairs]
	for i := 0; i < RopePairs; i++ {
		c, s := cs[i], sn[i]
		if inverse {
			s = -s
		}
		x0, x1 := v[2*i], v[2*i+1]
		v[2*i] = quant.BF16Round(fma32(x0, c, -float32(x1*s)))
		v[2*i+1] = quant.BF16Round(fma32(x0, s, float32(x1*c)))
	}
}

// RopeLast applies ApplyRope to the last 64 dims of each d-wide vector in x.
func (tb *RopeTable) RopeLast(x []float32, d int, pos int64, inverse bool) {
	if d < RopeDims || len(x)%d != 0 {
		panic("attention: RopeLast width mismatch")
	}
	for h := 0; h < len(x)/d; h++ {
		tb.ApplyRope(x[h*d+d-RopeDims:(h+1)*d], pos, inverse)
	}
}

// fma32 is the fp32 fused multiply-add RN32(a·b + c) with a single rounding,
// as the GPU's fmaf. a·b is exact in float64; the float64 sum may round, and
// rounding that again to fp32 is wrong only when the float64 sum sits exactly
// halfway between two fp32 values, so that case is repaired with the exact
// error of the float64 addition (TwoSum).
func fma32(a, b, c float32) float32 {
	p := float64(a) * float64(b)
	s := p + float64(c)
	// Two-sum: err = exact (p + c) − s.
	bb := s - p
	err := (p - (s - bb)) + (float64(c) - bb)
	if err != 0 {
		bits := math.Float64bits(s)
		// s is halfway between two fp32 values iff its low 29 mantissa bits are 1<<28.
		if bits&(1<<29-1) == 1<<28 {
			if (err > 0) == (s > 0) {
				bits++
			} else {
				bits--
			}
			s = math.Float64frombits(bits)
		}
	}
	return float32(s)
}

// Apply rotates the 64 rope dims v forward to position pos: ApplyRope(v, pos, false).
func (tb *RopeTable) Apply(v []float32, pos int64) { tb.ApplyRope(v, pos, false) }

// Inverse de-rotates the 64 rope dims v from position pos: ApplyRope(v, pos, true).
func (tb *RopeTable) Inverse(v []float32, pos int64) { tb.ApplyRope(v, pos, true) }
