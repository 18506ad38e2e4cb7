package attention

import (
	"math"

	"sparsemla/quant"
)

// headPanels writes q [heads][d] as panels of 64 heads, each transposed:
// qT[(g·d + k)·64 + l] = q[(g·64 + l)·d + k] (one lane per head, zero lanes
// past heads), so that panel g is contiguous for the kernels.
func headPanels(q []float32, heads, d int) (qT []float32, groups int) {
	groups = (heads + PanelRows - 1) / PanelRows
	qT = make([]float32, groups*d*PanelRows)
	for h := 0; h < heads; h++ {
		g, l := h/PanelRows, h%PanelRows
		for k := 0; k < d; k++ {
			qT[(g*d+k)*PanelRows+l] = q[h*d+k]
		}
	}
	return qT, groups
}

// SparseAttnFast is SparseAttn, bit-identical at any GOMAXPROCS: the same
// chunked online softmax per head, in the same order, with the two inner loops
// on SIMD lanes. The logits ℓ_i = f32(q_h·K_i)·τ run with one lane per head
// (each lane a sequential fp32 dot product, k ascending), the P·V update with
// one lane per dim (O[k] = O[k]·α, then O[k] += bf16(P_i)·K_i[k], i ascending).
// Heads are spread over goroutines; each head is computed by one goroutine.
// Shapes as SparseAttn; d must be a multiple of 64 for the kernels (other d
// run the reference).
func SparseAttnFast(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) (lse []float32) {
	heads := checkAttn(q, kv, d, idx)
	if len(o) != len(q) || len(sink) != heads {
		panic("attention: SparseAttnFast output or sink length mismatch")
	}
	if !useAsm() || d%PanelRows != 0 || len(idx) == 0 {
		return SparseAttn(o, q, kv, d, idx, sink, scale)
	}
	L := len(idx)
	// logits[h*L+i] = f32(q_h·K_i)·τ, −∞ for −1 entries
	logits := make([]float32, heads*L)
	qT, groups := headPanels(q, heads, d)
	parallelFor(L, L*heads*d, func(lo, hi int) {
		var tmp [PanelRows]float32
		for i := lo; i < hi; i++ {
			j := idx[i]
			for g := 0; g < groups; g++ {
				if j >= 0 {
					f32Panel64AVX2(&tmp[0], &qT[g*d*PanelRows], &kv[int(j)*d], d)
				}
				for l := 0; l < PanelRows && g*PanelRows+l < heads; l++ {
					s := negInf
					if j >= 0 {
						s = float32(tmp[l] * scale)
					}
					logits[(g*PanelRows+l)*L+i] = s
				}
			}
		}
	})
	lse = make([]float32, heads)
	parallelFor(heads, heads*L*d, func(lo, hi int) {
		acc := make([]float32, d)
		p := make([]float32, AttnChunk)
		pv := make([]float32, 0, AttnChunk)
		rows := make([]*float32, 0, AttnChunk)
		for h := lo; h < hi; h++ {
			s := logits[h*L : (h+1)*L]
			m, l := negInf, float32(0)
			clear(acc)
			for c0 := 0; c0 < L; c0 += AttnChunk {
				chunk := idx[c0:min(c0+AttnChunk, L)]
				cs := s[c0 : c0+len(chunk)]
				mNew := m
				for _, v := range cs {
					mNew = max(mNew, v)
				}
				alpha := exp32(m - mNew)
				var sum float32
				for i, v := range cs {
					p[i] = exp32(v - mNew)
					sum += p[i]
				}
				l = float32(l*alpha) + sum
				pv, rows = pv[:0], rows[:0]
				for i, j := range chunk {
					if j >= 0 {
						pv = append(pv, quant.BF16Round(p[i]))
						rows = append(rows, &kv[int(j)*d])
					}
				}
				var pp *float32
				var rp **float32
				if len(rows) > 0 {
					pp, rp = &pv[0], &rows[0]
				}
				pvChunkAVX2(&acc[0], rp, pp, len(rows), alpha, d)
				m = mNew
			}
			l += exp32(sink[h] - m)
			oh := o[h*d : (h+1)*d]
			for k, v := range acc {
				oh[k] = quant.BF16Round(v / l)
			}
			lse[h] = m + log32(l)
		}
	})
	return lse
}

// IndexScoresFast is the fast path of the indexer's IndexQK followed by
// IndexScore (indexer.ScoreRows), bit-identical at any GOMAXPROCS:
//
//	score[j] = bf16( Σ_h bf16( max(bf16(iq[h]·icache[j]), 0) · w[h] ) )
//
// with each dot product a sequential fp32 sum (k ascending) and the head sum in
// fp32 in head order. The assembly runs one lane per head (64 heads × 128 dims,
// the V4 indexer); other shapes, and rows whose score is not finite (where the
// SIMD bf16 rounding of a NaN may differ), run the scalar reference form.
// score [Tc], iq [heads][hd], icache [Tc][hd], w [heads].
func IndexScoresFast(score, iq, icache, w []float32, heads, hd int) {
	if hd <= 0 || heads != len(w) || len(iq) != heads*hd || len(icache) != len(score)*hd {
		panic("attention: IndexScoresFast shape mismatch")
	}
	tc := len(score)
	asm := useAsm() && heads == PanelRows && hd == 128
	var iqT []float32
	if asm {
		iqT, _ = headPanels(iq, heads, hd)
	}
	avx512 := asm && useAVX512()
	const rowsPerTask = 256
	parallelFor((tc+rowsPerTask-1)/rowsPerTask, tc*heads*hd, func(lo, hi int) {
		var terms [8 * PanelRows]float32 // 8 keys' score terms (indexTerms64AVX2)
		qk := make([]float32, heads)
		for t := lo; t < hi; t++ {
			j0, j1 := t*rowsPerTask, min(tc, (t+1)*rowsPerTask)
			// groups of 8 keys: their terms, then their sums (indexSum64)
			for g := j0; asm && g < j1; g += 8 {
				n := min(8, j1-g)
				if avx512 {
					indexTerms64AVX512(&terms[0], &icache[g*hd], &iqT[0], &w[0], n)
				} else {
					indexTerms64AVX2(&terms[0], &icache[g*hd], &iqT[0], &w[0], n)
				}
				indexSum64(&score[g], &terms[0], n)
			}
			for j := j0; j < j1; j++ {
				if asm {
					s := quant.BF16Round(score[j])
					if !math.IsInf(float64(s), 0) && s == s {
						score[j] = s
						continue
					}
				}
				BF16Linear(qk, icache[j*hd:(j+1)*hd], iq, heads, hd)
				var sum float32
				for h, d := range qk {
					sum += quant.BF16Round(max(d, 0) * w[h])
				}
				score[j] = quant.BF16Round(sum)
			}
		}
	})
}

// IndexQKFast is the indexer's IndexQK (index_qk, materialised for a replay
// that compares it), bit-identical at any GOMAXPROCS:
//
//	qk[h][j] = bf16( Σ_k iq[h][k] · icache[j][k] )     k ascending, fp32
//
// with one SIMD lane per head. qk [heads, Tc], iq [heads, hd], icache [Tc, hd].
func IndexQKFast(qk, iq, icache []float32, heads, hd int) {
	if hd <= 0 || len(iq) != heads*hd || len(icache)%hd != 0 || len(qk) != heads*(len(icache)/hd) {
		panic("attention: IndexQKFast shape mismatch")
	}
	tc := len(icache) / hd
	if !useAsm() || tc == 0 {
		for h := 0; h < heads; h++ {
			BF16Linear(qk[h*tc:(h+1)*tc], iq[h*hd:(h+1)*hd], icache, tc, hd)
		}
		return
	}
	qT, groups := headPanels(iq, heads, hd)
	parallelFor(tc, tc*heads*hd, func(lo, hi int) {
		var tmp [PanelRows]float32
		for j := lo; j < hi; j++ {
			for g := 0; g < groups; g++ {
				f32Panel64AVX2(&tmp[0], &qT[g*hd*PanelRows], &icache[j*hd], hd)
				for l := 0; l < PanelRows && g*PanelRows+l < heads; l++ {
					qk[(g*PanelRows+l)*tc+j] = quant.BF16Round(tmp[l])
				}
			}
		}
	})
}
