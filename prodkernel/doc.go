// Package prodkernel replays the outputs of real production kernels — vLLM's
// and SGLang's DeepSeek-V4 Triton kernels and FlashMLA's sparse FP8 decode,
// run unmodified on a GPU over the golden's dumped inputs by
// capture/prodkernels/harness.py — against the reference, so a correct serving
// kernel is not a false alarm and a faulty one is named.
//
// Kernel outputs come as kernels-*.safetensors with a kernels-*.json of what
// ran (testdata/kernels/README.md). Overlay turns them into a replay.Source:
// the golden dump with the stages a kernel computes replaced by the kernel's
// values (window K kv and compressed rows cmp_row decoded from the MODEL1
// entries a cache writer stored, the attention output o of FlashMLA) and the
// kernel's MODEL1 pages attached for the byte-level kv_pages check. replay.Run
// then judges them with the default tolerances.
//
// Kernels that compute something the reference never forms (vLLM's FP8
// attention output after the inverse RoPE, vLLM's FP8 / MXFP4 indexer query
// without the Hadamard rotation) cannot be replayed as a reference stage;
// CheckInvRopeFP8 and CheckIndexerQ state the engine's rule as an equation
// over the reference's own stage tensors and count how many stored codes it
// reproduces bit for bit, next to the reference stage the engine replaces
// (a named difference, never an "agree").
//
// WritePages writes the MODEL1 pages of a dump's kv_cache (kvcache's encoder,
// the reference scaling) that the FlashMLA run reads.
package prodkernel
