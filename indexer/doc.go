// Package indexer is the lightning indexer of DeepSeek-V4's CSA (compress
// ratio 4) layers (spec dsv4-attention.md §6; mirrors `Indexer` in the official
// model.py): at each decode step it scores every complete compressed row and
// selects the top index_topk of them for sparse attention.
//
// # Overview
//
// One decode step at position p, with cq the q_norm output and x the attention
// input:
//
//	iq_b       = FP8Lin(indexer.wq_b, cq)                      [H_I, 128]
//	iq_roped   = RoPE(iq_b[h][64:128], p)                      per head
//	iq_had     = Had(iq_roped[h])                              per head (§3.5)
//	iq         = FQ4(iq_had, 32)                               (§3.4)
//	             the indexer compressor (attention.Compressor, d = 128, Rotate)
//	             ingests x and, when (p+1) mod 4 = 0, appends icache[p div 4]
//	iw_raw     = bf16(weights_proj · x)                        [H_I]
//	iw         = bf16(iw_raw · f32(128^-0.5 · H_I^-0.5))       [H_I]
//	index_qk   = bf16(iq[h] · icache[j])                       [H_I, Tc]
//	index_score= bf16(Σ_h bf16(ReLU(index_qk[h][j]) · iw[h]))  [Tc]
//	index_topk = TopK(index_score, min(index_topk, Tc))        [K]
//	index_sel  = index_topk + 128                              offsets into kv_cache
//
// The score is Σ_h w_h · ReLU(q_h · k_j): a per-head weighted sum of rectified
// dot products, with head weights from x (not cq) and no softmax. Queries and
// keys are both Hadamard-rotated before their FP4 rounding; the rotation is
// orthonormal, so it leaves q·k unchanged in exact arithmetic and only spreads
// outliers so that 4-bit blocks lose less.
//
// Every stage is its own function of its inputs (QueryB, QueryRoped, QueryHad,
// Query, WeightsRaw, Weights, IndexQK, IndexScore, TopK), so a replay can
// recompute each from the dumped values of its inputs; Indexer.Step chains them.
//
// # Shapes and axis order
//
// PyTorch row-major order, batch and sequence dims removed: iq [H_I, 128] is
// iq[h*128+k]; icache [Tc, 128] is icache[j*128+k]; index_qk [H_I, Tc] is
// qk[h*Tc+j]. Tc = (p+1) div 4 is the number of complete compressed rows at
// step p; Tc = 0 (p < 3) gives empty scores and an empty selection.
//
// # Invariants
//
// Selections are deterministic: larger score first, then lower row index
// (spec §9.6's recommended rule). torch.topk on CUDA breaks ties in no
// particular order (§14), so a GPU selection is compared as a set with
// CompareSelection, which calls a difference confined to rows that tie exactly
// with the k-th score a "tie", not a divergence. (Measured on an H200: in all
// 196 boundary ties of testdata/official-compressor/topk.safetensors, Tc from 64
// to 16,384, torch.topk kept the lowest-index members of the tie, i.e. the
// reference's set; only the order inside the selection differed, at Tc = 64.)
// Shape mismatches panic with an "indexer: …" message.
//
// # Fast path
//
// ScoreRows fuses IndexQK and IndexScore per compressed row and spreads the rows
// over GOMAXPROCS goroutines; each score is still computed by one goroutine in
// the reference order, so it is bit-identical to the reference (tested) at any
// GOMAXPROCS. The staged functions stay the reference and what the replay uses.
//
// # Precision
//
// The dot products and the head sum accumulate in fp32 in index order and
// round to bf16 where the official code holds bf16 tensors: each dot product,
// each ReLU·weight product (§14 confirmed this rounding: without it only ~75%
// of scores match), and the sum. A GPU may differ by an fp32 summation order,
// so bf16 results can differ by one ulp, which can in turn reorder near-equal
// scores.
package indexer
