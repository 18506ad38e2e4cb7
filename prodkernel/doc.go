// Package prodkernel replays the outputs of real production kernels against
// the reference, so that a correct serving kernel is not a false alarm and a
// faulty one is named. The kernels are vLLM's and SGLang's DeepSeek-V4 Triton
// kernels and FlashMLA's sparse FP8 decode, run unmodified on a GPU over the
// golden's dumped inputs by capture/prodkernels/harness.py.
//
// It sits beside fault, on top of replay (it imports replay, engine, kvcache
// and dump); no command imports it: its tests replay the committed kernel
// runs in testdata/kernels.
//
// Kernel outputs come as kernels-*.safetensors with a kernels-*.json of what
// ran (testdata/kernels/README.md). Overlay turns them into a replay.Source:
// the golden dump with the stages a kernel computes replaced by the kernel's
// values (WindowK.Apply: window K kv, compressed rows cmp_row and the kv_cache
// decoded from the MODEL1 entries and pages a cache writer stored) and the
// kernel's pages attached for the byte-level kv_pages check. replay.Run then
// judges them with the default tolerances. WindowK.WrongPage injects a wrong
// slot mapping into real pages.
//
// Kernels that compute something the reference never forms (vLLM's FP8
// attention output after the inverse RoPE, vLLM's FP8 / MXFP4 indexer query
// without the Hadamard rotation) cannot be replayed as a reference stage;
// CheckInvRopeFP8 and CheckIndexerQ state the engine's rule as an equation
// over the reference's own stage tensors and count how many stored codes it
// reproduces bit for bit, next to the reference stage the engine replaces
// (a named difference, never an "agree").
//
// The same holds for the compressor kernels: VLLMCompressEntry and
// VLLMIndexerCompressFP8 are vLLM's fused_compress_quant_cache rules (fp32
// pooled row normalised without the bf16 cast), CheckSGLangPool holds
// SGLang's fused_ape_pool_norm_rope to the fp32 rule and names the rows whose
// RoPE dims are not a RoPE of the row's own values.
//
// FlashMLA's sparse FP8 decode is replayed by ReplayFlash: each query row's o
// against attention.SparseAttn over the rows the kernel read (NewFlashCache
// decodes every page), lse against the sink-free log-sum-exp (FlashMLA's lse
// excludes the sink), judged with FlashMLATolerance — the default with the
// o bounds FlashMLA was measured to need (docs/production-kernels.md). A row
// that fails is diagnosed by DiagnoseFlash (a dropped split partial, a wrong
// page id). FlashModel (FlashMLA's split-K order over FlashSchedule's split
// ranges) is the evidence behind the widened tolerance. Its inputs: WritePages (the goldens' MODEL1 pages, kvcache's
// encoder) and NewFlashInput (synthetic V4-Flash cases, FlashCases).
//
// The indexer's scoring and top-k kernels (SGLang's and vLLM's torch scorers
// fp8_paged_mqa_logits_torch, SGLang's torch top-k, vLLM's CUDA
// top_k_per_row_decode) are fed the reference's own q, index keys and
// weights, exactly (E4M3 with power-of-two scales). CheckIndexScores holds
// their fp32 logits to the reference's bf16 index_score under IndexScoreTol,
// a bound derived from the reference's three bf16 rounding points; beside it
// the fp32-scorer form (indexer.IndexScoreF32) they compute. CheckIndexTopK
// holds each list to a top-k of the kernel's own logits (an index off by one
// is named) and to the reference's set up to boundary ties within that
// tolerance. CheckIndexSynthScores / CheckIndexSynthTopK do the same on
// synthetic units at V4-Flash dims. vLLM's persistent_topk (k = 512, run on
// vLLM's logits) is read from its own kernels-ptopk file, joined onto the
// kernels-index run by unit key (Run.Join), and checked the same way;
// CheckPTopKExtra holds its logits-only units to a top-k of their own logits
// (exact ties only).
package prodkernel
