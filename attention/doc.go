// Package attention holds the numeric steps of one DeepSeek-V4 attention
// sub-layer at decode time, each a small function named after the official
// model.py concept it mirrors. They are RMSNorm (q_norm, kv_norm), the FP8 /
// bf16 / fp32 linears (wq_a, wq_b, wkv, wo_b; weights_proj, wo_a; compressor
// wkv/wgate), the per-head query norm (HeadRMS), RoPE with YaRN (RopeTable),
// the window index list (WindowIdx, get_window_topk_idxs), the compressor
// (compressor*.go), sparse attention with the attention sink (SparseAttn,
// sparse_attn) and the grouped output projection (WoA).
//
// # Overview
//
// One decode step of one layer (spec dsv4-attention.md §4) is, in order:
//
//	q_a  = FP8Linear(wq_a, x)                 [q_lora_rank]
//	cq   = RMSNorm(q_a, q_norm)               [q_lora_rank]  (also the indexer's qr)
//	q_b  = FP8Linear(wq_b, cq)                [H][512]
//	q    = HeadRMS(q_b); RoPE(q[h][448:], p)  [H][512]
//	kv   = RMSNorm(FP8Linear(wkv, x), kv_norm); RoPE(kv[448:], p); FQ8(kv[:448], 64)
//	idx  = WindowIdx(p) ++ compressed rows    (indexer top-k for r = 4, all rows for r = 128)
//	o    = SparseAttn(q, kv_cache, idx, attn_sink, 512^-0.5)
//	o    = RoPE⁻¹(o[h][448:], p)
//	u    = WoA(o, wo_a)                        [G][R]
//	y    = FP8Linear(wo_b, u)                  [dim]
//
// Around them: the visible sets and the emission timeline (VisibleWindow,
// VisibleRows, EmitsRow, EmissionPos, RowRopePos, RowTokens), the index list
// assembly (WindowIdx, CompressedIdx, IndexList), the plain two-pass definition
// of attention (SparseAttnTwoPass) beside the kernel-order one, and FlashMLA's
// split-K form (SparseAttnPartial, MergePartials: base-2 LSE, sink folded in
// at the merge) so GPU partial results can be checked.
//
// The engine package chains these into named stages; this package only computes.
//
// # Shapes and axis order
//
// PyTorch (row-major) order throughout, innermost axis last, batch and sequence
// dims of size 1 removed: q [H][d] is q[h*d+k]; a weight [out, in] is
// W[n*in+k]; a kv cache [rows][d] is kv[j*d+k]. The rotated dims are the LAST 64
// of each vector, taken as interleaved pairs (x[2i], x[2i+1]).
//
// # Invariants
//
// Inputs that the model holds in bf16 must hold bf16 values (every bf16 value is
// an fp32, so slices are []float32). Outputs that the model holds in bf16 are
// rounded with quant.BF16Round at exactly the points the spec names. Shape
// mismatches are programmer errors and panic with an "attention: …" message.
//
// # Precision
//
// Every sum is sequential in index order in fp32 (the reference order); GPU
// reductions use other orders, so fp32 sums can differ in the last bits and the
// bf16 results by an ulp. Products that feed a sum are written float32(a*b):
// the explicit conversion forbids the Go compiler from fusing them into an FMA,
// so results are the same on every architecture. Where the GPU does fuse (the
// RoPE complex product) the fusion is explicit (fma32). exp, log and cos/sin are
// correctly rounded fp32 (CUDA's are within an ulp or two). Results never
// depend on GOMAXPROCS: the reference functions run sequentially.
//
// # Fast paths
//
// Beside the reference, *_fast.go hold the same computations repacked for
// speed (FP8Panels, Panels, WoAPanels, SparseAttnFast, IndexScoresFast,
// IndexQKFast; AVX2 kernels in kernels_fast_amd64.s, and AVX-512 forms of
// them where the CPU has it (UseAVX512: the FP8, bf16 and fp32 panels, the
// index scoring, the attention's P·V), pure-Go lane loops
// elsewhere, with -tags purego, or with UseAssembly = false). Each SIMD lane
// owns one output and performs the reference's fp32 operations in the
// reference's order, so the results are the same bits; work is split by
// output across GOMAXPROCS goroutines, so they do not depend on it either.
// Two fast paths compute differently and prove the same bits instead: the
// index scoring's integer q·k products (AVX-512 VNNI, sparse_fast_vnni.go;
// its kernels in index_vnni_amd64.s, written by internal/vnnigen:
// FP4-rounded blocks whose exact sum the reference's fp32 sum equals, checked
// per key; IndexKeys keeps the packed keys and verifies them against the
// fp32 cache on every call) and the softmax's exps (expFast: float64 with
// an error bound, and math.Exp for every lane near a float32 rounding
// midpoint; tested on all 2^32 inputs).
// bench/README.md explains the exactness arguments and the figures.
package attention
