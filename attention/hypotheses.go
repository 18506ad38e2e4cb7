package attention

import (
	"math"

	"sparsemla/quant"
)

// Hypotheses: the stages of this package computed the way known GPU engines
// (or known bugs) compute them, from the same inputs as the reference
// functions. The replay runs them on the dumped inputs of a diverging stage
// and names the one that reproduces the GPU's value (spec §9, §9.11). None of
// them is the reference; each says what it changes.

// sparseAttnNaive is sparse attention written the way a plain PyTorch
// implementation evaluates it (one pass over the whole index list, no
// chunks, no online rescaling):
//
//	ℓ_i = f32(q_h·K_i)·τ                   (bf16Logits: ℓ_i = bf16(bf16(q_h·K_i)·τ),
//	                                        a bf16 GEMM output scaled in bf16)
//	m   = max(σ_h, max_i ℓ_i)
//	P_i = e^(ℓ_i − m) / (Σ_j e^(ℓ_j − m) + e^(σ_h − m))   fp32 softmax with the sink column
//	                                        (bf16Probs: P_i = bf16(P_i), softmax output in bf16)
//	o_h = bf16( Σ_i P_i·K_i )              fp32 accumulation, list order
//
// A sink of −∞ leaves the sink column out. Shapes as SparseAttn; −1 entries
// carry no key. With both roundings this is Hugging Face transformers' eager
// attention on bf16 tensors (matmul(q, kᵀ)·scaling in bf16, the sink
// concatenated as a logit column, softmax(dtype=float32).to(bf16), matmul
// with V accumulated in fp32).
func sparseAttnNaive(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32, bf16Logits, bf16Probs bool) {
	heads := checkAttn(q, kv, d, idx)
	if len(o) != len(q) || len(sink) != heads {
		panic("attention: sparse attention hypothesis: output or sink length mismatch")
	}
	s := make([]float32, len(idx))
	acc := make([]float32, d)
	for h := 0; h < heads; h++ {
		qh := q[h*d : (h+1)*d]
		m := sink[h]
		for i, j := range idx {
			s[i] = negInf
			if j < 0 {
				continue
			}
			l := dot(qh, kv[int(j)*d:int(j+1)*d])
			if bf16Logits {
				l = quant.BF16Round(quant.BF16Round(l) * scale)
			} else {
				l = float32(l * scale)
			}
			s[i] = l
			m = max(m, l)
		}
		var sum float32
		for i := range idx {
			if s[i] != negInf {
				s[i] = exp32(s[i] - m)
				sum += s[i]
			}
		}
		sum += exp32(sink[h] - m)
		clear(acc)
		for i, j := range idx {
			if j < 0 || s[i] == negInf {
				continue
			}
			p := s[i] / sum
			if bf16Probs {
				p = quant.BF16Round(p)
			}
			for k, v := range kv[int(j)*d : int(j+1)*d] {
				acc[k] += float32(p * v)
			}
		}
		oh := o[h*d : (h+1)*d]
		for k, v := range acc {
			oh[k] = quant.BF16Round(v)
		}
	}
}

// SparseAttnBF16Logits is sparse attention with the logits held in bf16 (a
// bf16 q·Kᵀ GEMM, scaled in bf16) and an fp32 softmax: sparseAttnNaive with
// ℓ_i = bf16(bf16(q_h·K_i)·τ). Shapes as SparseAttn.
func SparseAttnBF16Logits(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) {
	sparseAttnNaive(o, q, kv, d, idx, sink, scale, true, false)
}

// SparseAttnBF16Softmax is sparse attention with fp32 logits and the softmax
// output rounded to bf16 before P·V (softmax(…).to(bf16) @ V):
// sparseAttnNaive with P_i = bf16(P_i). Shapes as SparseAttn.
func SparseAttnBF16Softmax(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) {
	sparseAttnNaive(o, q, kv, d, idx, sink, scale, false, true)
}

// SparseAttnBF16LogitsSoftmax is sparse attention with bf16 logits and a
// bf16 softmax output: sparseAttnNaive with both roundings. Shapes as
// SparseAttn.
func SparseAttnBF16LogitsSoftmax(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) {
	sparseAttnNaive(o, q, kv, d, idx, sink, scale, true, true)
}

// SparseAttnNoSink is the reference kernel (SparseAttn, same chunks and
// rounding) without the attention sink in the denominator: every head's
// output is the reference's times 1 + e^(σ_h − lse_h). Shapes as SparseAttn
// (no sink argument).
func SparseAttnNoSink(o, q, kv []float32, d int, idx []int32, scale float32) (lse []float32) {
	heads := checkAttn(q, kv, d, idx)
	return SparseAttn(o, q, kv, d, idx, noSink(heads), scale)
}

func noSink(heads int) []float32 {
	s := make([]float32, heads)
	for i := range s {
		s[i] = negInf
	}
	return s
}

// mergeWeighted is the combine of MergePartials with per-split weights
// w_s(h) given by weight: o_h = bf16(Σ_s w_s·O_s,h), fp32, split order.
func mergeWeighted(o []float32, parts []Partial, heads, d int, weight func(h, s int) float32) {
	if len(o) != heads*d {
		panic("attention: merge hypothesis output length mismatch")
	}
	for _, p := range parts {
		if len(p.O) != heads*d || len(p.LSE2) != heads {
			panic("attention: merge hypothesis partial shape mismatch")
		}
	}
	w := make([]float32, len(parts))
	for h := 0; h < heads; h++ {
		for s := range parts {
			w[s] = weight(h, s)
		}
		oh := o[h*d : (h+1)*d]
		for k := range oh {
			var v float32
			for s, p := range parts {
				v += float32(w[s] * p.O[h*d+k])
			}
			oh[k] = quant.BF16Round(v)
		}
	}
}

// MergePartialsUnscaled is FlashMLA's combine (MergePartials) with split s
// added without its rescaling: its weight is 1 instead of 2^(LSE2_s − L)
// (the total L, sink included, is the reference's; the other splits keep
// their weights). It is the splitk-merge fault. o [H][d] bf16.
func MergePartialsUnscaled(o []float32, parts []Partial, sink []float32, d, s int) {
	if s < 0 || s >= len(parts) {
		panic("attention: MergePartialsUnscaled split out of range")
	}
	L := MergePartials(make([]float32, len(o)), parts, sink, d)
	mergeWeighted(o, parts, len(sink), d, func(h, t int) float32 {
		if t == s {
			return 1
		}
		return exp2_32(parts[t].LSE2[h] - L[h])
	})
}

// MergePartialsNoSink is the combine without the sink term in the total LSE
// (the wrong-lse fault): MergePartials with every σ_h = −∞. o [H][d] bf16;
// returns the base-2 total L without the sink.
func MergePartialsNoSink(o []float32, parts []Partial, d int) []float32 {
	heads := len(o) / d
	return MergePartials(o, parts, noSink(heads), d)
}

// MergePartialsBaseE is the combine with the base-2 LSEs exponentiated in
// base e: w_s = e^(LSE2_s − L) with L the reference's base-2 total (sink
// included). o [H][d] bf16.
func MergePartialsBaseE(o []float32, parts []Partial, sink []float32, d int) {
	L := MergePartials(make([]float32, len(o)), parts, sink, d)
	mergeWeighted(o, parts, len(sink), d, func(h, s int) float32 {
		return exp32(parts[s].LSE2[h] - L[h])
	})
}

// MergePartialsNoTotal is the combine normalised by the largest split's
// LSE instead of the total: w_s = 2^(LSE2_s − max_t LSE2_t), so the weights
// do not sum to one and the sink is ignored. o [H][d] bf16.
func MergePartialsNoTotal(o []float32, parts []Partial, sink []float32, d int) {
	mergeWeighted(o, parts, len(sink), d, func(h, s int) float32 {
		M := negInf
		for _, p := range parts {
			M = max(M, p.LSE2[h])
		}
		if parts[s].LSE2[h] == negInf {
			return 0
		}
		return exp2_32(parts[s].LSE2[h] - M)
	})
}

// FP8LinearBF16 is an FP8 linear run as a bf16 GEMM on the dequantised
// weight with no activation quantisation (weight-only FP8, W8A16):
//
//	y[n] = bf16( Σ_k x[k]·W[n,k] )     fp32, k ascending
//
// x [Cols] bf16, y [Rows]. The reference quantises x per 128 columns first
// (FP8Linear).
func FP8LinearBF16(y, x []float32, w *FP8Weight) {
	if len(x) != w.Cols || len(y) != w.Rows {
		panic("attention: FP8LinearBF16 shape mismatch")
	}
	var buf []float32
	if w.W == nil {
		buf = make([]float32, w.Cols)
	}
	for n := range y {
		y[n] = quant.BF16Round(dot(x, w.Row(n, buf)))
	}
}

// FP8LinearActRule is FP8Linear with the activation block scales picked by
// rule and floor (quant.QuantizeActFP8Rule) instead of ceil2 and 1e-4; the
// block sums are the reference's. FP8LinearActRule(y, x, w, ScaleCeil2,
// FP8AmaxFloor) is FP8Linear (tested).
func FP8LinearActRule(y, x []float32, w *FP8Weight, rule quant.ScaleRule, floor float32) {
	if len(x) != w.Cols || len(y) != w.Rows || w.Cols%ActBlock != 0 {
		panic("attention: FP8LinearActRule shape mismatch")
	}
	qx := make([]float32, len(x))
	sx := make([]float32, len(x)/ActBlock)
	quant.QuantizeActFP8Rule(qx, sx, x, ActBlock, rule, floor)
	var buf []float32
	if w.W == nil {
		buf = make([]float32, w.Cols)
	}
	for n := range y {
		row := w.Row(n, buf)
		var acc float32
		for b, s := range sx {
			var blk float32
			for k := b * ActBlock; k < (b+1)*ActBlock; k++ {
				blk += float32(qx[k] * row[k])
			}
			acc += float32(blk * s)
		}
		y[n] = quant.BF16Round(acc)
	}
}

// ProjectBF16 is the compressor projection (Project) run as bf16 GEMMs: the
// fp32 weights and x in bf16 and the outputs rounded to bf16,
//
//	a = bf16(Wkv · x),  b = bf16(Wgate · x)     fp32 accumulation
//
// where the reference keeps both in fp32 (spec §3.2). Wkv and Wgate hold
// bf16 values in the checkpoint, so only the output rounding differs.
func (c *Compressor) ProjectBF16(a, b, x []float32) {
	c.Project(a, b, x)
	quant.BF16RoundSlice(a)
	quant.BF16RoundSlice(b)
}

// PoolAtF32 is PoolAt without the final bf16 rounding of the pooled row:
// vLLM's fused compressor normalises the fp32 pooled row directly (spec
// §9.11). dst [d] fp32.
func (c *Compressor) PoolAtF32(dst []float32, prev *CompressorState, a, b []float32, pos int64) {
	if !c.Emits(pos) {
		panic("attention: compressor PoolAtF32 at a position that emits no row")
	}
	st := prev.Clone()
	c.Ingest(st, a, b, pos)
	d, w := c.HeadDim, c.Width()
	if len(dst) != d {
		panic("attention: compressor PoolAtF32 length mismatch")
	}
	rows := c.StateRows()
	col := func(e int) int {
		if c.Coff() == 2 && e >= c.Ratio {
			return d
		}
		return 0
	}
	p := make([]float32, rows)
	for ch := 0; ch < d; ch++ {
		m := float32(math.Inf(-1))
		for e := 0; e < rows; e++ {
			m = max(m, st.Score[e*w+col(e)+ch])
		}
		var sum float32
		for e := 0; e < rows; e++ {
			p[e] = exp32(st.Score[e*w+col(e)+ch] - m)
			sum += p[e]
		}
		var acc float32
		for e := 0; e < rows; e++ {
			acc += float32(st.KV[e*w+col(e)+ch] * (p[e] / sum))
		}
		dst[ch] = acc
	}
}

// RMSNormHF is RMSNorm the way Hugging Face's LlamaRMSNorm-style modules
// compute it on bf16 tensors: the normalised value is rounded to bf16
// before the weight multiplies it,
//
//	y_i = bf16( w_i · bf16( x_i · f32(1/sqrt(mean_k x_k² + eps)) ) )
//
// where the reference rounds once (RMSNorm). Shapes as RMSNorm.
func RMSNormHF(y, x, w []float32, eps float32) {
	n := len(x)
	if len(w) != n || len(y) != n {
		panic("attention: RMSNormHF length mismatch")
	}
	var ss float32
	for _, v := range x {
		ss += float32(v * v)
	}
	rs := rsqrt(ss/float32(n) + eps)
	for i, v := range x {
		y[i] = quant.BF16Round(w[i] * quant.BF16Round(float32(v*rs)))
	}
}

// HeadRMSF32 is the per-head query norm computed in fp32 with one rounding
// at the end, q_i = bf16(q_i · f32(1/sqrt(mean_k q_k² + eps))), where the
// reference (HeadRMS) rounds every op to bf16 as torch does on a bf16
// tensor (an engine that fuses the norm into one fp32 kernel).
func HeadRMSF32(q []float32, d int, eps float32) {
	if d <= 0 || len(q)%d != 0 {
		panic("attention: HeadRMSF32 length not a multiple of the head dim")
	}
	for h := 0; h < len(q)/d; h++ {
		qh := q[h*d : (h+1)*d]
		var ss float32
		for _, v := range qh {
			ss += float32(v * v)
		}
		rs := rsqrt(ss/float32(d) + eps)
		for i, v := range qh {
			qh[i] = quant.BF16Round(float32(v * rs))
		}
	}
}

// ApplyRopeHalf rotates the 64 rope dims v the GPT-NeoX way (rotate_half):
// pair i is (v[i], v[i+32]) instead of the interleaved (v[2i], v[2i+1]) of
// the reference (ApplyRope), with the same angles, fused products and bf16
// rounding. A kernel written for the other convention gives this.
func (tb *RopeTable) ApplyRopeHalf(v []float32, pos int64, inverse bool) {
	if len(v) != RopeDims {
		panic("attention: ApplyRopeHalf needs the 64 rope dims")
	}
	if pos < 0 || pos >= int64(tb.T) {
		panic("attention: ApplyRopeHalf position outside the table")
	}
	cs := tb.Cos[pos*RopePairs : (pos+1)*RopePairs]
	sn := tb.Sin[pos*RopePairs : (pos+1)*RopePairs]
	for i := 0; i < RopePairs; i++ {
		c, s := cs[i], sn[i]
		if inverse {
			s = -s
		}
		x0, x1 := v[i], v[i+RopePairs]
		v[i] = quant.BF16Round(fma32(x0, c, -float32(x1*s)))
		v[i+RopePairs] = quant.BF16Round(fma32(x0, s, float32(x1*c)))
	}
}

// HalfSplit splits an index list into two split-K pieces, [0, h) and
// [h, len), where h is the list position after which half of the valid
// (non −1) entries have been seen, so both pieces hold keys; it returns the
// bounds [0, h, len], or nil when fewer than two entries are valid. It is
// the split the synthetic GPU and the faulted copies use when a dump holds
// no split_bounds.
func HalfSplit(idx []int32) []int64 {
	valid := 0
	for _, v := range idx {
		if v >= 0 {
			valid++
		}
	}
	if valid < 2 {
		return nil
	}
	seen := 0
	for i, v := range idx {
		if v >= 0 {
			seen++
		}
		if seen == valid/2 {
			return []int64{0, int64(i + 1), int64(len(idx))}
		}
	}
	return nil
}
