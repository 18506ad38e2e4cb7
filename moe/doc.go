// Package moe holds the DeepSeek-V4 mixture-of-experts FFN of one token at
// decode time: the router (Gate), the routed experts with FP4 E2M1 weights
// (FP4Linear), the FP8 shared expert, and their sum (MoE). It mirrors Gate,
// Expert and MoE of the official release-day model.py (R-M:552-687) with the
// act_quant + fp4_gemm / fp8_gemm kernels (R-K), spec dsv4-attention.md §10.
// The DeepSeek-V4.1 MoE (V41Gate, V41Expert, V41Shared, V41MoE in v41.go:
// gate_temp, no hash routing, weights / (Σ + 1e-20), activations per 32,
// swiglu_limit on the shared expert too) lives beside it.
//
// # Overview
//
// The FFN input x [dim] is the ffn_norm output (bf16):
//
//	s      = score(W_g · f32(x))                       [E]   Gate.Scores: W_g bf16 widened, fp32 GEMV;
//	                                                         score = softmax | sigmoid | sqrt(softplus)
//	idx    = topk(s + bias, k)                         [k]   Gate.Route (layers >= n_hash_layers)
//	       | tid2eid[token]                                  (hash layers: no bias, no top-k)
//	w      = s[idx] / Σ s[idx] · route_scale           [k]   (no division for softmax)
//	out_e  = Expert_e(x, w_e)                          [dim] bf16, e = routed expert idx
//	y      = bf16( Σ_{e in idx, ascending e} out_e + Shared(x) )    fp32 sum
//
// and each expert (routed: FP4 weights, limit = swiglu_limit; shared: FP8
// weights, no limit and no weight) is
//
//	g      = f32(w1(x)),  u = f32(w3(x))               [inter]   FP4Linear / FP8Linear, bf16 out
//	u      = clamp(u, -limit, limit); g = min(g, limit)          (limit > 0 only)
//	h      = bf16( [w ·] (silu(g) · u) )               [inter]
//	out    = w2(h)                                      [dim] bf16
//
// # FP4 weights
//
// A routed expert weight [rows][cols] is stored as the checkpoint stores it:
// `.weight` U8 [rows][cols/2] (float4_e2m1fn_x2: two E2M1 codes per byte, the
// even column in the LOW nibble; code = sign<<3 | index into {0, 0.5, 1, 1.5,
// 2, 3, 4, 6}) and `.scale` U8 [rows][cols/32] (float8_e8m0fnu: 2^(byte-127)
// per 1×32 block). Its input is quantised to FP8 E4M3 per 128 columns
// (act_quant, as for every FP8 linear; the activation is NOT FP4).
//
// # Precision
//
// Every fp32 operation is one rounding in the official order: the fp4_gemm
// kernel sums each 32-column block of E4M3 × E2M1 products, scales it by the
// activation and the weight scale (powers of two, exact) and adds it into a
// second fp32 accumulator, then rounds to bf16; the reference does the same
// with the inner sum in ascending column order. The golden GPU dumps ran a
// torch port (one cuBLAS fp32 GEMM over the dequantised operands), whose
// order differs: the expert outputs then differ in the last bits before the
// bf16 rounding. The gate GEMV (fp32) differs from cuBLAS the same way. exp,
// log1p and sqrt are correctly rounded fp32 (CUDA's expf is within 2 ulp).
// The golden tests state the measured bounds.
package moe
