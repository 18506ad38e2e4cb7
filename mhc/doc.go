// Package mhc holds the manifold-constrained hyper-connections (mHC) of
// DeepSeek-V4: the hc_mult residual streams of every block, how one sub-layer
// reads them (hc_pre) and writes them back (hc_post), and the collapse to one
// stream in front of the head (hc_head). It mirrors Block.hc_pre,
// Block.hc_post and ParallelHead.hc_head of the official release-day
// model.py and the hc_split_sinkhorn kernel (spec dsv4-attention.md §10).
//
// # Overview
//
// A block holds h [hc][dim] (bf16, hc = hc_mult = 4 copies). Each of its two
// sub-layers (attention, then the MoE FFN) does, with its own parameters
// hc_<attn|ffn>_fn [(2+hc)·hc][hc·dim], _base [(2+hc)·hc], _scale [3]:
//
//	hf     = f32(flatten(h))                                   [hc·dim]
//	mixes  = (fn · hf) · rsqrt(mean(hf²) + norm_eps)           [(2+hc)·hc]   Mixes
//	pre, post, comb = split + Sinkhorn(mixes, scale, base)      [hc] [hc] [hc][hc]  SplitSinkhorn
//	x      = bf16( Σ_j pre_j · hf_j )                          [dim]         Collapse
//	a      = sub-layer(norm(x))                                [dim] bf16
//	h'_j   = bf16( post_j · a + Σ_k comb[k][j] · h_k )         [hc][dim]     Post
//
// and the head collapses the last block's output with hc_head_fn [hc][hc·dim],
// hc_head_base [hc], hc_head_scale [1]:
//
//	mixes  = (hc_head_fn · hf) · rsqrt(mean(hf²) + norm_eps)   [hc]          Mixes
//	pre_j  = sigmoid(mixes_j · scale + base_j) + hc_eps        [hc]          HeadPre
//	x      = bf16( Σ_j pre_j · hf_j )                          [dim]         Collapse
//
// # Shapes and axis order
//
// Row-major, innermost axis last: h [hc][dim] is h[j*dim+i]; fn [m][hc·dim] is
// fn[r*hc*dim+c]; comb [hc][hc] is comb[j*hc+k] (j = row, the stream read; k =
// column, the stream written).
//
// # Precision
//
// Every operation is an fp32 operation of the official code, in its order:
// torch evaluates `a * s + b` as two rounded ops (no FMA), sigmoid as
// 1/(1 + exp(-v)), and the sums over the hc copies and over the rows and
// columns of comb in index order. On the GPU dumps of the official model
// (testdata/official-v4-tiny) the collapse and hc_post computed from the dumped
// inputs are bit-exact on every value. exp and rsqrt are correctly rounded
// fp32 here; CUDA's expf is not (up to 2 ulp), so pre and post differ from
// the GPU's by up to 2 fp32 ulps and comb, after 20 Sinkhorn iterations that
// carry those last bits, by up to 8 (measured). The mixes are an fp32 GEMM
// whose summation order on the GPU (cuBLAS) is not the reference's ascending
// one: they differ by up to ~6 units of 2^-24·ρ·Σ|terms| (relative error up
// to 1e-4 where the sum cancels). The tests in golden_test.go hold these bounds.
package mhc
