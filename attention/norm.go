package attention

import (
	"math"

	"sparsemla/quant"
)

// NormEps is the RMSNorm epsilon of every V4 norm (ModelArgs.norm_eps).
const NormEps float32 = 1e-6

// RMSNorm is the official RMSNorm (q_norm, kv_norm, compressor norm, attn_norm;
// mirrors RMSNorm.forward, spec §3.1):
//
//	y_i = bf16( w_i · ( x_i · f32(1/sqrt(mean_k x_k² + eps)) ) )
//
// x [n] holds bf16 values (widened), w [n] the fp32 weight, y [n] receives bf16
// values. mean is an fp32 sum in index order divided by n; every product is
// rounded to fp32, as torch does op by op. y may alias x.
func RMSNorm(y, x, w []float32, eps float32) {
	n := len(x)
	if len(w) != n || len(y) != n {
		panic("attention: RMSNorm length mismatch")
	}
	var ss float32
	for _, v := range x {
		ss += float32(v * v)
	}
	rs := rsqrt(ss/float32(n) + eps)
	for i, v := range x {
		y[i] = quant.BF16Round(w[i] * float32(v*rs))
	}
}

// rsqrt is f32(1/sqrt(v)), correctly rounded (CUDA's rsqrtf is within 2 ulp of it).
func rsqrt(v float32) float32 { return float32(1 / math.Sqrt(float64(v))) }

// HeadRMS is the V4 per-head query normalisation (spec §3.7, R-M:498,
// `q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)` on a bf16 tensor),
// in place on q [heads][d]. Every torch op returns a bf16 tensor, so every op
// rounds (confirmed on the GPU, §14):
//
//	sq_i = bf16(q_i²)
//	m    = bf16( (Σ_i sq_i) / d )       fp32 sum in index order
//	v    = bf16(m + eps)
//	ρ    = bf16(rsqrt(v))
//	q_i  = bf16(q_i · ρ)
func HeadRMS(q []float32, d int, eps float32) {
	if d <= 0 || len(q)%d != 0 {
		panic("attention: HeadRMS length not a multiple of the head dim")
	}
	for h := 0; h < len(q)/d; h++ {
		qh := q[h*d : (h+1)*d]
		var sum float32
		for _, v := range qh {
			sum += quant.BF16Round(v * v)
		}
		m := quant.BF16Round(sum / float32(d))
		v := quant.BF16Round(m + eps)
		rho := quant.BF16Round(rsqrt(v))
		for i, x := range qh {
			qh[i] = quant.BF16Round(x * rho)
		}
	}
}
