package prodkernel

import (
	"math"

	"sparsemla/attention"
	"sparsemla/quant"
)

// FlashMLA's numerics, written out as a hypothesis of where its o differs
// from the reference (FlashMLATolerance rests on the measured distribution;
// this model says which rounding point makes it). From FlashMLA @ 9241ae3e:
// the scheduler (smxx/decode/get_decoding_sched_meta), the sm90 MODEL1
// split kernel (scale_softmax in sm90/decode/sparse_fp8/splitkv_mla.cuh) and
// the combine (smxx/decode/combine).

// FlashSchedule is FlashMLA's split of each request's index list over
// parts SM parts: request i has blocks[i] 64-entry blocks; every request
// costs its blocks + 5 (fixed overhead); each part takes payload =
// ceil(total/parts) + 5 in order, splitting a request where its payload runs
// out. It returns, per request, the [begin, end) block ranges of its splits.
func FlashSchedule(blocks []int, parts int) [][][2]int {
	const overhead = 5
	total := 0
	for _, n := range blocks {
		total += n + overhead
	}
	payload := (total+parts-1)/parts + overhead
	out := make([][][2]int, len(blocks))
	req, blk := 0, 0
	for p := 0; p < parts && req < len(blocks); p++ {
		remain := payload
		for req < len(blocks) {
			left := blocks[req] - blk
			if remain >= left+overhead {
				out[req] = append(out[req], [2]int{blk, blocks[req]})
				remain -= left + overhead
				req, blk = req+1, 0
				continue
			}
			if remain-overhead > 0 {
				out[req] = append(out[req], [2]int{blk, blk + remain - overhead})
				blk += remain - overhead
			}
			break
		}
	}
	return out
}

// FlashModel computes one query row's o [H][D] (bf16 values) and lse [H] the
// way the FlashMLA kernels order it, given the split ranges of its list:
//
//	per split, per head, over its 64-entry blocks in order (M = −∞, L = 0, O = 0):
//	  raw_i = f32(q·K_i) (−∞ for −1),  m = f32(max_i raw_i · s2),  s2 = f32(τ·log2e)
//	  M' = max(M, m);  α = 2^(M − M');  O ← O·α;  P_i = 2^(fma(raw_i, s2, −M'))
//	  L ← L·α + Σ P_i;  O ← O + Σ bf16(P_i)·K_i;  M ← M'
//	one split:  o = bf16(O · 1/(L + 2^(σ·log2e − M))),  lse = ln L + M/log2e
//	several:    partials (O/L, log2 L + M) merged by attention.MergePartials
//	            (base 2, the sink folded into the total), lse = the merged
//	            sink-free log2-sum-exp · ln 2
//
// P is rounded to bf16 against its split's running maximum, where the
// reference rounds it against the running maximum of the whole list. The
// model uses correctly rounded exp2/log2 (the kernel: ex2.approx under
// --use_fast_math) and its own summation order.
func FlashModel(q []float32, row func(i int) []float32, idx []int32, sink []float32, splits [][2]int) (o, lse []float32) {
	heads, d := len(sink), model1.Dim
	s2 := flashScale * attention.Log2e
	ninf := float32(math.Inf(-1))
	exp2 := func(x float32) float32 { return float32(math.Exp2(float64(x))) }
	type part struct {
		O    []float32
		M, L []float32
	}
	parts := make([]part, len(splits))
	for si, sp := range splits {
		pt := part{O: make([]float32, heads*d), M: make([]float32, heads), L: make([]float32, heads)}
		for h := 0; h < heads; h++ {
			qh := q[h*d : (h+1)*d]
			M, L := ninf, float32(0)
			O := pt.O[h*d : (h+1)*d]
			for b := sp[0]; b < sp[1]; b++ {
				lo, hi := b*64, min((b+1)*64, len(idx))
				raw := make([]float32, 64)
				m := ninf
				for i := range raw {
					raw[i] = ninf
					if lo+i < hi && idx[lo+i] >= 0 {
						var s float32
						for k, v := range row(lo + i) {
							s += qh[k] * v
						}
						raw[i] = s
						m = max(m, s)
					}
				}
				m *= s2
				Mn := max(M, m)
				if Mn == ninf {
					continue // nothing valid yet
				}
				alpha := float32(0)
				if M != ninf {
					alpha = exp2(M - Mn)
				}
				for k := range O {
					O[k] *= alpha
				}
				var sum float32
				for i, r := range raw {
					if r == ninf {
						continue
					}
					p := exp2(float32(math.FMA(float64(r), float64(s2), -float64(Mn))))
					sum += p
					pb := quant.BF16Round(p)
					for k, v := range row(lo + i) {
						O[k] += pb * v
					}
				}
				L = L*alpha + sum
				M = Mn
			}
			pt.M[h], pt.L[h] = M, L
		}
		parts[si] = pt
	}
	o = make([]float32, heads*d)
	lse = make([]float32, heads)
	if len(parts) == 1 {
		pt := parts[0]
		for h := 0; h < heads; h++ {
			sc := float32(0)
			if pt.L[h] != 0 {
				sc = 1 / (pt.L[h] + exp2(sink[h]*attention.Log2e-pt.M[h]))
			}
			for k := 0; k < d; k++ {
				o[h*d+k] = quant.BF16Round(pt.O[h*d+k] * sc)
			}
			lse[h] = float32(math.Log(float64(pt.L[h]))) + pt.M[h]/attention.Log2e
		}
		return o, lse
	}
	ap := make([]attention.Partial, len(parts))
	for si, pt := range parts {
		ap[si] = attention.Partial{O: make([]float32, heads*d), LSE2: make([]float32, heads)}
		for h := 0; h < heads; h++ {
			if pt.L[h] == 0 {
				ap[si].LSE2[h] = ninf
				continue
			}
			inv := 1 / pt.L[h]
			for k := 0; k < d; k++ {
				ap[si].O[h*d+k] = pt.O[h*d+k] * inv
			}
			ap[si].LSE2[h] = float32(math.Log2(float64(pt.L[h]))) + pt.M[h]
		}
	}
	attention.MergePartials(o, ap, sink, d)
	for h := 0; h < heads; h++ {
		M := ninf
		for _, p := range ap {
			M = max(M, p.LSE2[h])
		}
		var s float32
		for _, p := range ap {
			s += exp2(p.LSE2[h] - M)
		}
		lse[h] = (M + float32(math.Log2(float64(s)))) / attention.Log2e
	}
	return o, lse
}
