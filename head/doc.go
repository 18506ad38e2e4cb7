// Package head holds the two ends of the DeepSeek-V4 decode step around the
// blocks: the token embedding expanded into the hc_mult residual streams, and
// the head that turns the last block's streams into logits and the greedy
// token (ParallelEmbedding, Transformer.forward, ParallelHead of the official
// release-day model.py, R-M:89-111, R-M:754-792, R-M:877-884; spec §10).
//
// # Overview
//
//	e      = embed.weight[tok]                          [dim] bf16      Embed
//	h      = (e, e, …, e)                               [hc][dim]       mhc.Expand (= L0.h_in)
//	… blocks …
//	x      = hc_head(h_out)                             [dim] bf16      mhc.Mixes, mhc.HeadPre, mhc.Collapse
//	x      = RMSNorm(x, norm.weight)                    [dim] bf16
//	logits = head.weight · f32(x)                       [vocab] fp32    (head.weight bf16 values: fp32 Weight or bf16 Panels)
//	token  = argmax(logits)                             lowest id among equal maxima
//
// # Precision
//
// The logits are an fp32 GEMV (cuBLAS on the GPU, ascending order here), so
// they differ from the GPU's in the last fp32 bits; hc_head's mixes likewise
// (see package mhc). The golden tests state the measured bounds.
package head
