package indexer

import (
	"fmt"
	"math"

	"sparsemla/attention"
	"sparsemla/quant"
)

// The DeepSeek-V3.2 lightning indexer (deepseek-ai/DeepSeek-V3.2-Exp
// inference/model.py Indexer.forward at 8631a81 "fix indexer rope", the
// current official code, and kernel.py act_quant / fp8_index, V32-K). One decode step at position p, H_I =
// index_n_heads heads of d = index_head_dim = 128, T = p + 1 keys — every
// token so far, no compression:
//
//	iq_b      = FP8Lin(indexer.wq_b, qr)  viewed [H_I][128]
//	iq_roped  = iq_b with RoPE(dims 0..63, p)          the rope dims come FIRST, pairs (i, i+32)
//	iq_had    = Had(iq_roped) per head                  rotate_activation: bf16, scale 128^-0.5
//	iq_fp8, iq_scale = act_quant(iq_had, 128, ue8m0)    one E4M3 block (and scale) per head
//	ik_raw    = FP8Lin(indexer.wk, x)  [128]
//	ik_normed = LayerNorm(ik_raw) (k_norm.weight, k_norm.bias, eps 1e-6; fp32, then bf16)
//	ik_roped, ik_had, ik_fp8, ik_scale                  as for the query
//	k_cache[p], k_scale_cache[p] = ik_fp8, ik_scale
//	iw_raw    = weights_proj · f32(x)                   fp32 F.linear (fp32 weights_proj)
//	iw        = f32(iw_raw · f32(H_I^-0.5))
//	index_weights[h] = f32( f32(iw[h] · iq_scale[h]) · f32(128^-0.5) )
//	index_score[t]   = f32( f32( Σ_h f32( ReLU(f32(Σ_d iq_fp8[h][d]·k_cache[t][d])) · index_weights[h] ) ) · k_scale_cache[t] )
//	topk_indices     = top-min(index_topk, T) of index_score (torch.topk; no mask at decode)
//
// The E4M3 products are exact and their 128-term sum is exact in float64
// (≤ 51 significant bits), rounded once to fp32; the head sum is fp32, h
// ascending (the kernel's reduce_sum order may differ in the last bit).

// V32Quant is act_quant(x, 128, "ue8m0") of one 128-block (V32-K
// act_quant_kernel, round_scale): s = 2^ceil(log2(max(amax, 1e-4)/448)),
// codes = E4M3(clamp(x/s, ±448)). codes receives the E4M3 values as fp32; it
// returns s.
func V32Quant(codes, x []float32) float32 {
	if len(x) != 128 || len(codes) != 128 {
		panic("indexer: V32Quant needs one 128-block")
	}
	var s [1]float32
	quant.QuantizeActFP8(codes, s[:], x, 128)
	return s[0]
}

// V32LayerNorm is LayerNorm.forward: F.layer_norm(x.float(), (d,), w, b,
// 1e-6).type_as(x):
//
//	μ = f32(Σ x_i)/d;  σ² = f32(Σ (x_i − μ)²)/d;  y_i = bf16( f32(f32((x_i − μ)·rsqrt(σ² + eps))·w_i) + b_i )
//
// (sums fp32, i ascending; CUDA's Welford pass may differ in the last fp32
// bit of μ and σ², hence rarely one bf16 ulp).
func V32LayerNorm(y, x, w, b []float32, eps float32) {
	n := len(x)
	if len(y) != n || len(w) != n || len(b) != n {
		panic("indexer: V32LayerNorm length mismatch")
	}
	var sum float32
	for _, v := range x {
		sum += v
	}
	mu := sum / float32(n)
	var ss float32
	for _, v := range x {
		d := v - mu
		ss += float32(d * d)
	}
	rs := float32(1 / math.Sqrt(float64(ss/float32(n)+eps)))
	for i, v := range x {
		y[i] = quant.BF16Round(float32(float32(float32(v-mu)*rs)*w[i]) + b[i])
	}
}

// V32RopeFirst rotates the FIRST 64 dims of each 128-d vector of x (the
// indexer's q_pe / k_pe split) to position pos, NON-interleaved
// (apply_rotary_emb(..., interleaved=False), official fix 8631a81 "fix
// indexer rope"): pair i is (x[i], x[i+32]), rotated by θ(pos, i) with the
// same fused complex product as the interleaved MLA RoPE and rounded to bf16.
// The demo code before that fix rotated interleaved pairs here
// (V32RopeFirstInterleaved).
func V32RopeFirst(x []float32, pos int64, rope *attention.RopeTable) {
	const half = attention.RopePairs
	var buf [attention.RopeDims]float32
	for h := 0; h+128 <= len(x); h += 128 {
		v := x[h : h+attention.RopeDims]
		for i := 0; i < half; i++ {
			buf[2*i], buf[2*i+1] = v[i], v[half+i]
		}
		rope.Apply(buf[:], pos)
		for i := 0; i < half; i++ {
			v[i], v[half+i] = buf[2*i], buf[2*i+1]
		}
	}
}

// V32RopeFirstInterleaved is the indexer RoPE of the V3.2-Exp demo code
// before the 2025-11-17 fix (2305c7e): interleaved pairs (x[2i], x[2i+1]) of
// the first 64 dims — a known bug of that code, kept for diagnosis.
func V32RopeFirstInterleaved(x []float32, pos int64, rope *attention.RopeTable) {
	for h := 0; h+128 <= len(x); h += 128 {
		rope.Apply(x[h:h+attention.RopeDims], pos)
	}
}

// V32IndexWeights computes index_weights [H_I] from iw and iq_scale.
func V32IndexWeights(dst, iw, qScale []float32, softmaxScale float32) {
	if len(dst) != len(iw) || len(qScale) != len(iw) {
		panic("indexer: V32IndexWeights length mismatch")
	}
	for h, w := range iw {
		dst[h] = float32(w*qScale[h]) * softmaxScale
	}
}

// V32Score computes index_score [T] (fp8_index) from iq_fp8 [H_I][128],
// index_weights [H_I], k_cache [T][128] (E4M3 values) and k_scale_cache [T].
func V32Score(score, q, w, k, kScale []float32) error {
	T, H := len(kScale), len(w)
	if len(score) != T || len(q) != H*128 || len(k) != T*128 {
		return fmt.Errorf("indexer: V32Score shapes: score %d, q %d, weights %d, k_cache %d, k_scale_cache %d", len(score), len(q), H, len(k), T)
	}
	for t := 0; t < T; t++ {
		kt := k[t*128 : (t+1)*128]
		var acc float32
		for h := 0; h < H; h++ {
			var d float64
			for i, x := range q[h*128 : (h+1)*128] {
				d += float64(x) * float64(kt[i])
			}
			logit := max(float32(d), 0)
			acc += float32(logit * w[h])
		}
		score[t] = acc * kScale[t]
	}
	return nil
}
