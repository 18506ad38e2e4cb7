package attention

import (
	"math"

	"sparsemla/quant"
)

// AttnChunk is the number of index-list entries the sparse_attn kernel processes
// per iteration (R-K sparse_attn_kernel `block = 64`).
const AttnChunk = 64

// Log2e is f32(log2 e), the factor FlashMLA multiplies scores by to work in base 2.
const Log2e float32 = 1.4426950408889634

func exp32(x float32) float32   { return float32(math.Exp(float64(x))) }
func exp2_32(x float32) float32 { return float32(math.Exp2(float64(x))) }
func log32(x float32) float32   { return float32(math.Log(float64(x))) }
func log2_32(x float32) float32 { return float32(math.Log2(float64(x))) }

var negInf = float32(math.Inf(-1))

// checkAttn validates the shapes shared by the attention functions.
func checkAttn(q, kv []float32, d int, idx []int32) (heads int) {
	if d <= 0 || len(q)%d != 0 || len(kv)%d != 0 {
		panic("attention: q or kv width not a multiple of the head dim")
	}
	rows := len(kv) / d
	for _, j := range idx {
		if j < -1 || int(j) >= rows {
			panic("attention: index list entry outside the kv cache")
		}
	}
	return len(q) / d
}

// SparseAttn is the reference kernel sparse_attn (R-K sparse_attn_kernel, spec
// §7) in its own evaluation order, so that its bf16 output can be compared
// bit for bit:
//
//	q [H][d] bf16, kv [rows][d] bf16 (K doubles as V), idx [L] (−1 = no key),
//	sink [H] fp32 logits, scale τ (512^-0.5).  o [H][d] receives bf16 values.
//
// Per head, over consecutive chunks of 64 list entries in list order, starting
// from m = −∞, l = 0, O = 0 (fp32):
//
//	ℓ_i = f32(q·K_i)·τ              (−∞ for −1 entries, whose row reads as 0)
//	m'  = max(m, max_i ℓ_i);  α = exp(m − m');  P_i = exp(ℓ_i − m')
//	l   = l·α + Σ_i P_i             (P unrounded)
//	O   = O·α + Σ_i bf16(P_i)·K_i   (P rounded to bf16 for the P·V product,
//	                                 accumulated into the rescaled O as the
//	                                 kernel's `acc_o *= scale; gemm(P, K, acc_o)`)
//	m   = m'
//
// then l += exp(σ_h − m) (the sink: a logit in the denominator only, it carries
// no value row) and o_h = bf16(O / l). It returns the natural log-sum-exp of each
// head including the sink, lse_h = m + ln l.
//
// A chunk made only of −1 entries before any valid entry gives NaN, as the
// kernel does (exp(−∞ − (−∞))); V4 decode lists never start that way.
func SparseAttn(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) (lse []float32) {
	heads := checkAttn(q, kv, d, idx)
	if len(o) != len(q) || len(sink) != heads {
		panic("attention: SparseAttn output or sink length mismatch")
	}
	lse = make([]float32, heads)
	acc := make([]float32, d)
	s := make([]float32, AttnChunk)
	for h := 0; h < heads; h++ {
		qh := q[h*d : (h+1)*d]
		m, l := negInf, float32(0)
		clear(acc)
		for c0 := 0; c0 < len(idx); c0 += AttnChunk {
			chunk := idx[c0:min(c0+AttnChunk, len(idx))]
			mNew := m
			for i, j := range chunk {
				s[i] = negInf
				if j >= 0 {
					s[i] = float32(dot(qh, kv[int(j)*d:int(j+1)*d]) * scale)
				}
				mNew = max(mNew, s[i])
			}
			alpha := exp32(m - mNew)
			var sum float32
			for i := range chunk {
				s[i] = exp32(s[i] - mNew) // P_i
				sum += s[i]
			}
			l = float32(l*alpha) + sum
			for k := range acc {
				acc[k] *= alpha
			}
			for i, j := range chunk {
				if j < 0 {
					continue // P_i = 0 and the row reads as zeros
				}
				p := quant.BF16Round(s[i])
				row := kv[int(j)*d : int(j+1)*d]
				for k, v := range row {
					acc[k] += float32(p * v)
				}
			}
			m = mNew
		}
		l += exp32(sink[h] - m)
		oh := o[h*d : (h+1)*d]
		for k, v := range acc {
			oh[k] = quant.BF16Round(v / l)
		}
		lse[h] = m + log32(l)
	}
	return lse
}

// SparseAttnTwoPass is the definition of sparse attention with a sink (spec §7),
// written as two plain passes with no chunking and no bf16 rounding of P:
//
//	ℓ_i = f32(q_h·K_i)·τ over valid entries,  m = max_i ℓ_i
//	o_h = bf16( Σ_i e^(ℓ_i − m)·K_i / (Σ_i e^(ℓ_i − m) + e^(σ_h − m)) )
//
// Shapes as SparseAttn; returns lse_h = m + ln(Σ_i e^(ℓ_i−m) + e^(σ_h−m)).
// A head with no valid entry gets o_h = 0 (only the sink is left).
func SparseAttnTwoPass(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) (lse []float32) {
	heads := checkAttn(q, kv, d, idx)
	if len(o) != len(q) || len(sink) != heads {
		panic("attention: SparseAttnTwoPass output or sink length mismatch")
	}
	lse = make([]float32, heads)
	acc := make([]float32, d)
	s := make([]float32, len(idx))
	for h := 0; h < heads; h++ {
		qh := q[h*d : (h+1)*d]
		// pass 1: logits and their maximum (the sink joins the max so that an
		// all-empty list stays finite; it does not change the result).
		m := sink[h]
		for i, j := range idx {
			s[i] = negInf
			if j >= 0 {
				s[i] = float32(dot(qh, kv[int(j)*d:int(j+1)*d]) * scale)
				m = max(m, s[i])
			}
		}
		// pass 2: exponentials, denominator (with the sink), weighted sum of rows.
		clear(acc)
		l := exp32(sink[h] - m)
		for i, j := range idx {
			if j < 0 {
				continue
			}
			p := exp32(s[i] - m)
			l += p
			for k, v := range kv[int(j)*d : int(j+1)*d] {
				acc[k] += float32(p * v)
			}
		}
		oh := o[h*d : (h+1)*d]
		for k, v := range acc {
			oh[k] = quant.BF16Round(v / l)
		}
		lse[h] = m + log32(l)
	}
	return lse
}

// Partial is one split-K piece of sparse attention over a slice of the index
// list, in FlashMLA's form (FM combine.cu): O [H][d] fp32 normalised by the
// split's own sum (no sink), and LSE2 [H] = log2 Σ_i 2^(ℓ_i·log2e) in base 2
// (−∞ for a split with no valid entry).
type Partial struct {
	O    []float32
	LSE2 []float32
}

// SparseAttnPartial computes the Partial of the entries idx (one split):
//
//	ℓ2_i = f32(q_h·K_i)·τ·log2e,  m = max_i ℓ2_i,  l = Σ_i 2^(ℓ2_i − m)
//	O_h  = Σ_i 2^(ℓ2_i − m)·K_i / l,   LSE2_h = m + log2 l
func SparseAttnPartial(q, kv []float32, d int, idx []int32, scale float32) Partial {
	heads := checkAttn(q, kv, d, idx)
	pt := Partial{O: make([]float32, len(q)), LSE2: make([]float32, heads)}
	s := make([]float32, len(idx))
	sl2 := float32(scale * Log2e)
	for h := 0; h < heads; h++ {
		qh := q[h*d : (h+1)*d]
		m := negInf
		for i, j := range idx {
			s[i] = negInf
			if j >= 0 {
				s[i] = float32(dot(qh, kv[int(j)*d:int(j+1)*d]) * sl2)
				m = max(m, s[i])
			}
		}
		if m == negInf {
			pt.LSE2[h] = negInf
			continue
		}
		acc := pt.O[h*d : (h+1)*d]
		var l float32
		for i, j := range idx {
			if j < 0 {
				continue
			}
			p := exp2_32(s[i] - m)
			l += p
			for k, v := range kv[int(j)*d : int(j+1)*d] {
				acc[k] += float32(p * v)
			}
		}
		for k := range acc {
			acc[k] /= l
		}
		pt.LSE2[h] = m + log2_32(l)
	}
	return pt
}

// MergePartials combines split-K partials the way FlashMLA's combine kernel does
// (base 2, sink folded into the total):
//
//	M   = max_s LSE2_s;   L = M + log2 Σ_s 2^(LSE2_s − M)
//	L  += log2(1 + 2^(σ_h·log2e − L))                 the sink: denominator only
//	o_h = bf16( Σ_s 2^(LSE2_s − L) · O_s,h )
//
// o [H][d] receives bf16 values; it returns L per head (base-2 LSE with the
// sink; multiply by ln 2 for SparseAttn's natural lse).
func MergePartials(o []float32, parts []Partial, sink []float32, d int) (lse2 []float32) {
	heads := len(sink)
	if len(o) != heads*d {
		panic("attention: MergePartials output length mismatch")
	}
	for _, p := range parts {
		if len(p.O) != heads*d || len(p.LSE2) != heads {
			panic("attention: MergePartials partial shape mismatch")
		}
	}
	lse2 = make([]float32, heads)
	w := make([]float32, len(parts))
	for h := 0; h < heads; h++ {
		M := negInf
		for _, p := range parts {
			M = max(M, p.LSE2[h])
		}
		var L float32
		if M == negInf {
			L = negInf // no valid key anywhere: only the sink remains
		} else {
			var sum float32
			for _, p := range parts {
				sum += exp2_32(p.LSE2[h] - M)
			}
			L = M + log2_32(sum)
		}
		sl := float32(sink[h] * Log2e)
		if L == negInf {
			L = sl
		} else {
			L += log2_32(1 + exp2_32(sl-L))
		}
		for si, p := range parts {
			w[si] = exp2_32(p.LSE2[h] - L)
		}
		oh := o[h*d : (h+1)*d]
		for k := range oh {
			var v float32
			for si, p := range parts {
				v += float32(w[si] * p.O[h*d+k])
			}
			oh[k] = quant.BF16Round(v)
		}
		lse2[h] = L
	}
	return lse2
}
