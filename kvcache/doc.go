// Package kvcache reads and writes DeepSeek-V4 KV caches the way GPU engines
// store them, and models prefix reuse well enough to prove a cache hit clean.
//
// # Overview
//
//   - Page codecs (layout.go, codec.go): a [Layout] is a value read from dump
//     metadata ("v4-model1", "v32", "indexer-fp8", "indexer-mxfp4", "bf16"); a
//     [Format] adds the entry width and the page size. [Format.EncodePage] and
//     [Format.DecodePage] are bit-exact both ways with the GPU (testdata/kvcache
//     holds pages made by torch on an H200). Decoding reports structural
//     [Fault]s with entry, byte offset and field; [Format.ComparePages] names
//     the first differing byte a kernel reads (pad bytes masked), and
//     [Format.CompareValues] the first differing decoded value (pages from
//     different encoders can differ in bytes and agree in values, §9.4).
//     DecodePage runs word-at-a-time decoders (codec_fast.go) beside the
//     per-value reference loops; tests run both and an element-by-element
//     decoder under fuzzing.
//   - V4.1 rows (v41.go): [V41Row] encodes and decodes the 528-byte FP8
//     window row, the 288-byte FP4 (E4M3 block-16 scales) compressed row and
//     the 68-byte FP4 index key of DeepSeek-V4.1, losslessly for the model's
//     values; [V41BytesPerToken] is the long-term cache budget.
//   - Block tables and per-layer caches (table.go, layer.go): slot =
//     table[pos/B]·B + pos%B; a [LayerCache] holds the window ring, the
//     compressed rows, the indexer keys and the fp32 compressor state of one
//     layer (spec §2.2) in pools of any page size, gathers the rows of an
//     attention index list in the reference's index space (window slots, then
//     128 + j, -1 empty), and rebuilds the reference's kv_cache / kv_state
//     tensors from them.
//   - Radix prefix cache (radix.go; eviction and removal in radix_lru.go;
//     resume.go): token-keyed, page-aligned, in namespaces (LoRA adapter,
//     cache salt), with lock references, LRU eviction of unlocked leaves
//     (indexed heaps: O(log n) a node, no tree walk),
//     removal of a page and its extensions (an engine's recorded eviction),
//     and explicit V4 resume points: a prefix is only resumable where the
//     window rows and compressor state needed to continue are kept.
//   - Cache-hit verification (verify.go): [VerifyPrefixHit] compares the rows a
//     GPU served from a prefix hit with the rows this request should have, and
//     names the first stale or foreign row.
//
// # Using it in a replay
//
//	f, _ := kvcache.NewFormat(layout, 0, pageSize)   // layout parsed from the dump's id
//	pool, err := kvcache.WrapPool(f, pageBytes, blockTable) // sizes checked, no copy
//	faults, err := pool.Gather(rows, indexList)       // rows + faults naming entry/byte
//	d := f.CompareValues(gpuPage, refPage)            // or ComparePages for bytes
//	stale, err := kvcache.VerifyPrefixHit(hit, gpuRows, ownRows, otherRequests)
//
// A LayerCache does the same for one layer's window, compressed rows, indexer
// keys and compressor state, and rebuilds the reference's kv_cache and
// kv_state/score_state tensors (ReferenceKV, StatePool.Reference) for a direct
// comparison with the dumped ones.
//
// # Shapes and axis order
//
// Row-major, innermost last (PyTorch order). A decoded page is [P, Dim] fp32
// holding bf16 values: Dim = 512 for v4-model1 (448 nope + 64 rope, rope last),
// 576 for v32 (512 + 64), 128 for the indexer layouts. Compressor state rows are
// fp32 [coff·D] (kv) and [coff·D] (score), coff = 2 for r = 4, else 1.
//
// # Invariants
//
//   - Layout geometry: v4-model1 entry 584 B (448 E4M3, 64 bf16, 7 UE8M0, 1 pad),
//     page = P data rows of 576 B, then P scale rows of 8 B, padded to a multiple
//     of 576 B; v32 entry 656 B contiguous; indexer-fp8 P·128 codes then P fp32
//     scales; indexer-mxfp4 P·64 packed codes then P·4 UE8M0 scales.
//   - Pad bytes are never read: decoders warn on them, comparers mask them.
//   - Radix cache: every locked node's ancestors are locked; only unlocked
//     leaves are evicted; evictable + protected size = cached tokens; the
//     eviction heaps hold exactly the unlocked leaves and the unlocked nodes
//     with window rows; namespaces never share a node; all accounting returns
//     to zero when everything is unlocked and evicted (CheckInvariants).
//
// # Precision
//
// Dequantisation is exact: E4M3/E2M1 values times a power-of-two scale are bf16
// values unless the product leaves bf16's normal range, where the decoder
// rounds to bf16 as FlashMLA's bf16 multiply does. Any mismatch between a GPU's
// dequantised KV and the reference is therefore a wrong byte, a wrong scale or
// a stale page, never rounding. Encoding uses a selectable [Scaling] (spec §9.4);
// with [RefFP8] encoding the reference's FQ8 rows is lossless.
package kvcache
