package attention

import (
	"fmt"
	"math"

	"sparsemla/quant"
)

// DeepSeek-V3.2 MLA decode with the DSA index mask (deepseek-ai/DeepSeek-V3.2-Exp
// inference/model.py MLA.forward, the `mask is None` ("MQA decode") branch, at
// 8631a81 "fix indexer rope", 2025-11-17, the current official code; cited V32-M).
// Shapes: H heads, nope = qk_nope_head_dim (128), c = kv_lora_rank (512),
// rope = 64, v = v_head_dim (128); T = p + 1 cached tokens.
//
//	wkv_b  bf16 [H·(nope+v), c]   weight_dequant(wkv_b): FP8 codes × block scale, rounded to bf16
//	cache  bf16 [T, c + rope]     row t = FQ8(kv_norm(kv_a_t[:c]), 128) | RoPE(kv_a_t[c:], t)
//	                              (the official code rounds the latent through FP8 "to simulate
//	                              the fp8 kv cache in actual deployment")
//
// The three steps, every rounding point named (the einsums run on bf16
// tensors: fp32 accumulation, bf16 out):
//
//	q_absorbed[h][k] = bf16( Σ_{d<nope} q[h][d] · wkv_b[h(nope+v)+d][k] )            (V32Absorb)
//	s[h][t]          = bf16( bf16( bf16(Σ_k q_absorbed[h][k]·cache[t][k]) + bf16(Σ_r q_pe[h][r]·cache[t][c+r]) ) · f32(τ) )
//	                   for t in the index set, −∞ elsewhere (index_mask)
//	P[h][t]          = bf16( e_t / Σ e ),  e_t = f32(exp(s_t − max s))               softmax of a bf16 tensor (fp32 inside)
//	o_latent[h][k]   = bf16( Σ_t P[h][t] · cache[t][k] )                              (V32SparseMLA)
//	o_v[h][j]        = bf16( Σ_k o_latent[h][k] · wkv_b[h(nope+v)+nope+j][k] )       (V32ValueUp)
//
// Sums are fp32 in ascending index order (cuBLAS may order them otherwise:
// the last bf16 bit can differ). The index set is a set: a row named twice in
// the top-k list is attended once (the mask is scattered, V32-M:573).

// V32Absorb computes q_absorbed [H][c] from q [H][nope+rope] (its first nope
// dims) and the bf16 wkv_b [H·(nope+v)][c].
func V32Absorb(dst, q, wkvB []float32, H, nope, rope, v, c int) {
	if len(dst) != H*c || len(q) != H*(nope+rope) || len(wkvB) != H*(nope+v)*c {
		panic("attention: V32Absorb shape mismatch")
	}
	for h := 0; h < H; h++ {
		qh := q[h*(nope+rope) : h*(nope+rope)+nope]
		w := wkvB[h*(nope+v)*c:]
		for k := 0; k < c; k++ {
			var acc float32
			for d, x := range qh {
				acc += float32(x * w[d*c+k])
			}
			dst[h*c+k] = quant.BF16Round(acc)
		}
	}
}

// V32Scores returns the masked scores s [H][T] (bf16 values) (−∞ outside the index
// set; see the package comment above). qAbs [H][c], qPe [H][rope], cache
// [T][c+rope], sel the selected rows (each in 0..T−1).
func V32Scores(qAbs, qPe, cache []float32, H, c, rope, T int, sel []int64, tau float32) ([]float32, error) {
	return v32Scores(qAbs, qPe, cache, H, c, rope, T, sel, tau, true)
}

// V32ScoresF32 are the scores of the V3.2-Exp demo code before 8631a81:
// s = f32( f32(Σ q_absorbed·latent) + f32(Σ q_pe·k_pe) ) · τ, no bf16 rounding.
func V32ScoresF32(qAbs, qPe, cache []float32, H, c, rope, T int, sel []int64, tau float32) ([]float32, error) {
	return v32Scores(qAbs, qPe, cache, H, c, rope, T, sel, tau, false)
}

func v32Scores(qAbs, qPe, cache []float32, H, c, rope, T int, sel []int64, tau float32, bf16 bool) ([]float32, error) {
	if len(qAbs) != H*c || len(qPe) != H*rope || len(cache) != T*(c+rope) {
		return nil, fmt.Errorf("attention: V32Scores shape mismatch")
	}
	mask := make([]bool, T)
	for i, j := range sel {
		if j < 0 || j >= int64(T) {
			return nil, fmt.Errorf("attention: index entry %d names row %d, outside the %d cached tokens", i, j, T)
		}
		mask[j] = true
	}
	s := make([]float32, H*T)
	ninf := float32(math.Inf(-1))
	for h := 0; h < H; h++ {
		for t := 0; t < T; t++ {
			if !mask[t] {
				s[h*T+t] = ninf
				continue
			}
			row := cache[t*(c+rope):]
			var a, b float32
			for k := 0; k < c; k++ {
				a += float32(qAbs[h*c+k] * row[k])
			}
			for r := 0; r < rope; r++ {
				b += float32(qPe[h*rope+r] * row[c+r])
			}
			if !bf16 {
				s[h*T+t] = float32(a+b) * tau
				continue
			}
			sum := quant.BF16Round(quant.BF16Round(a) + quant.BF16Round(b))
			s[h*T+t] = quant.BF16Round(sum * tau)
		}
	}
	return s, nil
}

// V32SparseMLA is the decode attention over the latent cache: the masked
// scores (V32Scores), a softmax per head (fp32 inside) rounded to bf16, and the
// probability-weighted sum of the latent rows, o_latent [H][c] in bf16.
func V32SparseMLA(oLat, qAbs, qPe, cache []float32, H, c, rope, T int, sel []int64, tau float32) error {
	if len(oLat) != H*c {
		return fmt.Errorf("attention: V32SparseMLA output shape mismatch")
	}
	s, err := V32Scores(qAbs, qPe, cache, H, c, rope, T, sel, tau)
	if err != nil {
		return err
	}
	v32Attend(oLat, s, cache, H, c, rope, T)
	return nil
}

// V32SparseMLAF32 is V32SparseMLA with the fp32 scores and fp32 softmax of
// the demo code before 8631a81 (P rounded to bf16 by .type_as(x)).
func V32SparseMLAF32(oLat, qAbs, qPe, cache []float32, H, c, rope, T int, sel []int64, tau float32) error {
	if len(oLat) != H*c {
		return fmt.Errorf("attention: V32SparseMLAF32 output shape mismatch")
	}
	s, err := V32ScoresF32(qAbs, qPe, cache, H, c, rope, T, sel, tau)
	if err != nil {
		return err
	}
	v32Attend(oLat, s, cache, H, c, rope, T)
	return nil
}

// v32Attend is o_latent = bf16(Σ_t bf16(softmax(s[h]))_t · cache[t][:c]).
func v32Attend(oLat, s, cache []float32, H, c, rope, T int) {
	p := make([]float32, T)
	acc := make([]float32, c)
	for h := 0; h < H; h++ {
		sh := s[h*T : (h+1)*T]
		V32Softmax(p, sh)
		clear(acc)
		for t := 0; t < T; t++ {
			if p[t] == 0 {
				continue // exactly zero weight (masked): adds +0
			}
			row := cache[t*(c+rope):]
			for k := 0; k < c; k++ {
				acc[k] += float32(p[t] * row[k])
			}
		}
		for k := range acc {
			oLat[h*c+k] = quant.BF16Round(acc[k])
		}
	}
}

// V32Softmax is scores.softmax(dim=-1) of the bf16 scores:
//
//	m = max_t s_t;  e_t = f32(exp(s_t − m));  Z = Σ_t e_t (fp32, t ascending);  P_t = bf16(e_t / Z)
//
// A row with every entry −∞ gives NaN, as torch does.
func V32Softmax(p, s []float32) {
	m := float32(math.Inf(-1))
	for _, v := range s {
		m = max(m, v)
	}
	var z float32
	for t, v := range s {
		p[t] = exp32(v - m)
		z += p[t]
	}
	for t := range p {
		p[t] = quant.BF16Round(p[t] / z)
	}
}

// V32ValueUp computes o_v [H][v] from o_latent [H][c] and the value half of
// wkv_b (rows h(nope+v)+nope … h(nope+v)+nope+v−1).
func V32ValueUp(dst, oLat, wkvB []float32, H, nope, v, c int) {
	if len(dst) != H*v || len(oLat) != H*c || len(wkvB) != H*(nope+v)*c {
		panic("attention: V32ValueUp shape mismatch")
	}
	for h := 0; h < H; h++ {
		o := oLat[h*c : (h+1)*c]
		for j := 0; j < v; j++ {
			w := wkvB[(h*(nope+v)+nope+j)*c:][:c]
			dst[h*v+j] = quant.BF16Round(dot(o, w))
		}
	}
}
