package attention

import (
	"fmt"
	"math"

	"sparsemla/quant"
)

// RopeAngleTol is the largest angle error, in fp32 ulps of max(|θ|, 1), that
// a GPU RoPE table may show against the table the config implies and still
// count as that table. CUDA's pow, cos and sin are not correctly rounded
// (spec §9.8, §14): on the two golden GPU runs (testdata/official-v4-tiny
// and testdata/gpu-v4-tiny-long, 2 × 16,384 (cos, sin) entries each) the
// worst angle error is 2.06 ulps (rope_theta 10000 table; 0.70 for the
// compress_rope_theta YaRN table), while the cos/sin values themselves
// differ by up to 131,072 ulps where cos θ is near zero (an absolute error
// of 6e-8). The tolerance is twice the golden's worst. A wrong table is
// far outside it: bf16 inv_freq moves θ by up to 2^-9·|θ| (16,384 ulps),
// a wrong YaRN factor or theta by a large fraction of θ.
const RopeAngleTol = 4.0

// RopeDiff compares a RoPE table with the frequencies it should have been
// computed from, per position t and pair i. Every figure of one sentence
// comes from one element: the worst entry by angle error is (AnglePos,
// AnglePair) and its values are GPUCos/GPUSin/WantCos/WantSin; the worst by
// cos/sin ulp distance is (ULPPos, ULPPair).
type RopeDiff struct {
	T, Pairs int // positions and pairs compared
	Differ   int // entries whose cos or sin bits differ
	Over     int // entries whose angle error exceeds RopeAngleTol

	MaxAngleULP         float64 // worst |θ_gpu − θ| in fp32 ulps of max(|θ|, 1)
	AnglePos, AnglePair int     // where it is
	Theta               float64 // θ = f32(f32(t)·ω_i) there
	GPUCos, GPUSin      float32 // the table's values there
	WantCos, WantSin    float32 // cos θ, sin θ (correctly rounded)

	MaxULP          int32 // worst cos or sin ulp distance (fp32)
	ULPPos, ULPPair int
	ULPSin          bool // the worst ulp distance is of sin (else cos)
}

// OK reports whether every entry is within RopeAngleTol.
func (d RopeDiff) OK() bool { return d.Over == 0 }

// String is one line: how many entries differ and the worst one, all from
// one element.
func (d RopeDiff) String() string {
	return fmt.Sprintf("%d of %d (cos, sin) entries differ in bits, %d beyond %g ulps of angle; worst at position %d pair %d: angle off by %.3g ulps of θ = %.6g (cos %.9g vs %.9g, sin %.9g vs %.9g)",
		d.Differ, d.T*d.Pairs, d.Over, RopeAngleTol, d.AnglePos, d.AnglePair, d.MaxAngleULP, d.Theta, d.GPUCos, d.WantCos, d.GPUSin, d.WantSin)
}

// ulp32 is the fp32 ulp distance of a and b (ordered bit patterns; ±0 are 0 apart).
func ulp32(a, b float32) int32 {
	o := func(f float32) int64 {
		u := int64(math.Float32bits(f))
		if u&(1<<31) != 0 {
			return -(u &^ (1 << 31))
		}
		return u
	}
	d := o(a) - o(b)
	if d < 0 {
		d = -d
	}
	if d > math.MaxInt32 {
		return math.MaxInt32
	}
	return int32(d)
}

// CompareRopeFreqs compares tb with the table of the frequencies w: for every
// position t < tb.T and pair i, θ = f32(f32(t)·w_i), the angle between the
// unit vectors (tb.Cos, tb.Sin) and (cos θ, sin θ) (atan2 of their cross and
// dot products, float64) in fp32 ulps of max(|θ|, 1), and the fp32 ulp
// distance of cos and sin. Ties for the worst keep the first (t, i).
func CompareRopeFreqs(tb *RopeTable, w [RopePairs]float32) RopeDiff {
	d := RopeDiff{T: tb.T, Pairs: RopePairs, MaxAngleULP: -1}
	for t := 0; t < tb.T; t++ {
		for i, wi := range w {
			k := t*RopePairs + i
			th := float64(float32(float32(t) * wi))
			wc, ws := float32(math.Cos(th)), float32(math.Sin(th))
			gc, gs := tb.Cos[k], tb.Sin[k]
			if math.Float32bits(gc) != math.Float32bits(wc) || math.Float32bits(gs) != math.Float32bits(ws) {
				d.Differ++
			}
			ang := math.Abs(math.Atan2(float64(gs)*float64(wc)-float64(gc)*float64(ws), float64(gc)*float64(wc)+float64(gs)*float64(ws)))
			u := math.Ldexp(1, math.Ilogb(math.Max(math.Abs(th), 1))-23)
			r := ang / u
			if math.IsNaN(r) {
				r = math.Inf(1)
			}
			if r > RopeAngleTol {
				d.Over++
			}
			if r > d.MaxAngleULP {
				d.MaxAngleULP, d.AnglePos, d.AnglePair, d.Theta = r, t, i, th
				d.GPUCos, d.GPUSin, d.WantCos, d.WantSin = gc, gs, wc, ws
			}
			uc, us := ulp32(gc, wc), ulp32(gs, ws)
			if uc > d.MaxULP {
				d.MaxULP, d.ULPPos, d.ULPPair, d.ULPSin = uc, t, i, false
			}
			if us > d.MaxULP {
				d.MaxULP, d.ULPPos, d.ULPPair, d.ULPSin = us, t, i, true
			}
		}
	}
	if d.MaxAngleULP < 0 {
		d.MaxAngleULP = 0
	}
	return d
}

// CompareRopeTable compares tb with the table the parameters p imply
// (NewRopeTable(p, tb.T)): CompareRopeFreqs(tb, RopeFreqs(p)).
func CompareRopeTable(tb *RopeTable, p RopeParams) RopeDiff {
	return CompareRopeFreqs(tb, RopeFreqs(p))
}

// RopeFreqsBF16 is RopeFreqs(p) with every frequency rounded to bf16: the
// inv_freq buffer of an implementation that casts the model (buffers
// included) to bf16 before it builds the table.
func RopeFreqsBF16(p RopeParams) [RopePairs]float32 {
	w := RopeFreqs(p)
	for i := range w {
		w[i] = quant.BF16Round(w[i])
	}
	return w
}

// RopeFreqsLinear is linear position interpolation instead of YaRN: every
// pair's frequency divided by the factor, ω_i/factor (no ramp), from the
// plain frequencies of p.Base.
func RopeFreqsLinear(p RopeParams) [RopePairs]float32 {
	q := p
	q.OriginalSeqLen = 0
	w := RopeFreqs(q)
	f := float32(p.Factor)
	for i := range w {
		w[i] /= f
	}
	return w
}

// NewRopeTableFreqs is NewRopeTable for given frequencies w:
// θ(t, i) = f32(f32(t)·w_i), cos and sin correctly rounded.
func NewRopeTableFreqs(w [RopePairs]float32, T int, source string) *RopeTable {
	tb := &RopeTable{T: T, Cos: make([]float32, T*RopePairs), Sin: make([]float32, T*RopePairs), Source: source}
	for t := 0; t < T; t++ {
		for i, wi := range w {
			th := float64(float32(float32(t) * wi))
			tb.Cos[t*RopePairs+i] = float32(math.Cos(th))
			tb.Sin[t*RopePairs+i] = float32(math.Sin(th))
		}
	}
	return tb
}

// RopeHypothesis is one way a GPU may have built its RoPE table other than
// the reference's: a name for reports and the frequencies it implies.
type RopeHypothesis struct {
	Name  string // e.g. "bf16 inv_freq", "no YaRN", "rope_factor 40"
	Freqs [RopePairs]float32
}

// RopeHypotheses lists the known wrong tables for a layer whose correct
// parameters are p: inv_freq in bf16; without YaRN (p has YaRN) or with the
// other layers' YaRN (yarn, when p has none and yarn has); linear
// interpolation by the factor; YaRN with another common rope_factor (4, 8,
// 16, 32, 40) or original_seq_len (4096, 8192, 32768, 65536, 163840); the
// base of the other layer kind (otherBase: rope_theta for a
// compress_rope_theta layer and back; skipped when 0 or equal). Hypotheses
// with the reference's own frequencies are left out.
func RopeHypotheses(p RopeParams, otherBase float64, yarn RopeParams) []RopeHypothesis {
	ref := RopeFreqs(p)
	var out []RopeHypothesis
	add := func(name string, w [RopePairs]float32) {
		if w == ref {
			return
		}
		for _, h := range out {
			if h.Freqs == w {
				return
			}
		}
		out = append(out, RopeHypothesis{Name: name, Freqs: w})
	}
	add("bf16 inv_freq", RopeFreqsBF16(p))
	if p.OriginalSeqLen > 0 {
		q := p
		q.OriginalSeqLen = 0
		add("no YaRN", RopeFreqs(q))
		add(fmt.Sprintf("linear interpolation by rope_factor %g", p.Factor), RopeFreqsLinear(p))
		for _, f := range []float64{4, 8, 16, 32, 40} {
			q := p
			q.Factor = f
			add(fmt.Sprintf("YaRN with rope_factor %g", f), RopeFreqs(q))
		}
		for _, L := range []int{4096, 8192, 32768, 65536, 163840} {
			q := p
			q.OriginalSeqLen = L
			add(fmt.Sprintf("YaRN with original_seq_len %d", L), RopeFreqs(q))
		}
	} else if yarn.OriginalSeqLen > 0 {
		q := yarn
		q.Base = p.Base
		add("YaRN applied (the compressed layers' rule)", RopeFreqs(q))
	}
	if otherBase > 0 && otherBase != p.Base {
		q := p
		q.Base = otherBase
		add(fmt.Sprintf("base %g (the other layer kind's theta)", otherBase), RopeFreqs(q))
	}
	return out
}

// RopeCheck is the verdict on a GPU RoPE table.
type RopeCheck struct {
	Diff RopeDiff // against the table the config implies
	// When Diff is not OK: the hypothesis whose table is closest (smallest
	// Over, then smallest MaxAngleULP; first in list order on ties) and its
	// comparison. Matches says the hypothesis explains the table within
	// RopeAngleTol (Best.Over == 0).
	Best     string
	BestDiff RopeDiff
	Matches  bool
}

// CheckRopeTable compares the GPU's table tb with the table p implies and,
// when it is outside RopeAngleTol, tries every hypothesis of hyps.
func CheckRopeTable(tb *RopeTable, p RopeParams, hyps []RopeHypothesis) RopeCheck {
	c := RopeCheck{Diff: CompareRopeTable(tb, p)}
	if c.Diff.OK() {
		return c
	}
	for i, h := range hyps {
		d := CompareRopeFreqs(tb, h.Freqs)
		if i == 0 || d.Over < c.BestDiff.Over || (d.Over == c.BestDiff.Over && d.MaxAngleULP < c.BestDiff.MaxAngleULP) {
			c.Best, c.BestDiff = h.Name, d
		}
	}
	c.Matches = c.Best != "" && c.BestDiff.OK()
	return c
}
