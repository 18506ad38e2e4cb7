// Package prefixcheck runs a radix prefix cache as ground truth over a serving
// run's requests and judges the prefix-cache decisions the engine recorded.
// It reads its input through dump (or as a KV-cache event stream), imports
// kvcache for the radix cache, and is used by cmd/sparsemla, fault and
// htmlreport.
//
// A replay (package replay) checks the rows a GPU served for a prefix hit; this
// package checks the decision itself: which prefix a request may reuse, from
// whom, and where a DeepSeek-V4 request can resume. For every request, in
// arrival order, it looks the request's token stream up in a
// [kvcache.RadixCache] configured with the engine's page size, sliding window
// and compress ratios (the correct cache), then inserts it, and sets the hit
// the correct cache would have served next to the hit the engine recorded:
//
//	truth:    tokens [0, T) from request A, pages [0, T/P) (A's), resume at T:
//	          window rows [T-W, T), compressor state from T - T mod 4 - 4
//	          (the ratio-4 halo), compressed rows T div r
//	recorded: tokens [0, M) from request C
//
// # Verdicts
//
// Every request gets a status (agree, warn, diverged, unchecked) and, unless it
// plainly agrees, a kind:
//
//   - hit-too-long: the engine reused M tokens of C but the two streams share
//     only L < M (names position L and both tokens);
//   - namespace-mix: C is in another namespace (LoRA adapter, cache salt):
//     prefixes of different namespaces never match;
//   - overwritten-page: a page id of the hit holds other content now (a page
//     reused for another prefix, or a content hash stored twice with different
//     tokens);
//   - evicted-page: the hit covers pages that were evicted before the request
//     (the engine's own recorded eviction: diverged; the model's LRU when the
//     input records no evictions: warn);
//   - beyond-cache: the hit is longer than anything cached: not page aligned
//     (only whole pages are cached), longer than the source's cached length,
//     or from a request that had not arrived;
//   - resume-beyond-cache: the tokens are cached but the state to resume at M
//     is not (compressor-state snapshot or its ratio-4 halo, or window rows);
//   - missed-hit: the engine reused less than the correct cache could serve.
//     With a cause: none (the correct cache held it: diverged when the input
//     records every eviction, warn otherwise), or, when the correct cache
//     misses too (status agree), alignment (the shared tokens end inside a
//     page), eviction (the shared pages were evicted), namespace (shared with
//     a request of another namespace) or resume (cached but not resumable).
//
// The run's verdict is "diverged" when any request diverged, else
// "incomplete" when some request could not be judged (unchecked), else
// "agree"; exit statuses as replay's: 0 agree, 1 diverged, 2 error (bad
// input), 3 incomplete.
//
// # Inputs
//
// A [Trace] is input-agnostic: requests in arrival order with their token
// streams, namespaces, per-page extra keys (multimodal hashes), engine page
// ids, and the engine's recorded hits, evictions and cache clears.
// [FromDump] builds one from a multi-request native dump (tok records, prefix
// frames); [ReadEvents] decodes a vLLM or SGLang KV-cache event stream
// (msgpack EventBatch: BlockStored, BlockRemoved, AllBlocksCleared), with every
// length checked against the bytes left, and [EventsTrace] turns it into a
// trace (each BlockStored is a request whose recorded hit is its parent
// chain).
//
// Block hashes come in two schemes (EventsOptions.HashScheme). Chained: a
// block's hash names the whole prefix up to it, as vLLM's hash(parent_hash,
// tokens, extra_keys) and SGLang's since sgl-project/sglang PR #13488
// (November 2025; SHA-256 over the parent page's digest and the page's
// tokens, first 8 bytes as an int64: radix_cache.py compute_node_hash_values
// at commit 006b0e3d317f1cd4a7300e919a4eaa878b1947e7); one hash stored with
// two contents is then an overwritten page. Per-page: SGLang before PR
// #13488 hashed one page's tokens alone, Python's hash(tuple(page_tokens)),
// and gave as parent the same hash of the page before (hash(()) under the
// root, or in some versions none for a radix node's first page;
// radix_cache.py _record_store_event at commit
// 95769b280eaaf946a45dd3b50f7e864df09ac893), so a page repeated in a prompt
// has one hash at each of its places. Such a stream is read as per-page when
// every stored hash is that hash of its tokens (no chained hash is); a block
// is then placed under the one cached page its parent hash names (not
// judged when none or several do), a removal of a hash several cached pages
// have evicts none of them, and a node split (its pages removed and stored
// again at the same place) evicts nothing.
//
// A request's namespace is its LoRA adapter and SGLang's cache salt
// (`salt:"<salt>"`, then the adapter's): SGLang keys its radix tree by
// (extra_key, cache_salt), so two salts never share a prefix, and seeds a
// salted chain's event hashes with SHA-256("sglang-cache-salt-v1\0" + salt)
// (sgl-project/sglang PR #30827; mem_cache/utils.py
// compute_node_event_hash_values). The salt comes as SGLang 0.5.18's
// BlockStoredWithMetadata (PR #30827: the 7-element BlockStored array, then a
// {"cache_salt", "session_id"} map at position 7, where vLLM's array has
// lora_name), as the cache_salt field of a tagged-map event (PR #37482,
// issue #38561; mem_cache/events.py at commit
// 06f643f402f0d7e1c4fd480f6854b742fa642951) or under its "metadata" key (PR
// #37271); all are read. session_id only attributes a store to a session
// ("event metadata does not participate in block hashing or cache
// identity", PR #37482): it is read and changes nothing. vLLM gives its
// cache_salt in the first block's extra_keys, which are part of the page's
// identity already.
//
// What SGLang main sends since PR #37482 (merged; issue #38561): the batch
// stays the array [ts, events, attn_dp_rank] (EventBatch, array_like,
// python/sglang/srt/utils/event_publisher.py at commit
// 1b5a3291927650f6f3a4ed8945ebfaa188335131), each event a tagged map
// (KVCacheEvent tag=True without array_like; None defaults omitted):
// BlockStored {"type", "block_hashes", "parent_block_hash", "token_ids",
// "block_size", "lora_id" (nil), "medium"}, plus "cache_salt" and
// "session_id" when set
// (test/registered/unit/disaggregation/test_kv_events.py at commit
// 0d7e47bef1b1ec4360cbb0dc8407ae3af041d5b7, TestBlockStoredWireFormat;
// mem_cache/rust_tree_core/adapter.py at commit
// 0027895037f9a96c0e152a4813d739638b75c694, _kv_event_from_tagged),
// BlockRemoved {"type", "block_hashes", "medium"}, AllBlocksCleared {"type"};
// hashes are signed int64s, medium "GPU", "CPU_PINNED", "DISK" or "EXTERNAL".
// mem_cache/events.py at commit 06f643f402f0d7e1c4fd480f6854b742fa642951 also
// sets "lora_name", its hashes seeded by the adapter's name (the phase 3 of
// issue #39991, open: whether that commit is on main was not established):
// read as the namespace "lora:<name>". Under EAGLE each token is a (token,
// next token) pair (the radix tree's bigram keys): such streams are refused
// with an error that says so. All of this decodes as meant
// (events_wire_test.go writes it byte by byte). vLLM's maps add locality (PR
// #48281) and ownership (PR #52067), skipped, and session_id (PR #51381),
// read; a new event type (vLLM PR #50732's BlockInactive, open) would be an
// error.
//
// SGLang's per-component events (--enable-kv-events-component-types) are not
// on SGLang main: sgl-project/sglang PR #32514 (open) proposed them, first as
// a component_types list at an array BlockStored's position 7 (one event per
// block whatever its components, the shape a third-party indexer bridge
// decodes: read and dropped), then, in a revision of its branch
// (python/sglang/srt/mem_cache/events.py, KVCacheEventRecorder, still
// importing the array-era BlockStoredWithMetadata; commit not established),
// as an event per component of a hybrid model's node — "full", "swa",
// "mamba", "c128", "draft" (mem_cache/unified_cache/component_type.py) — with
// the same page hashes (a mamba checkpoint: its node's last page alone,
// without a parent): BlockStoredWithComponentType, medium then component_type
// (an array's position 7, where vLLM has lora_name; then the metadata map
// when salted), and BlockRemovedWithComponentType (position 3, where vLLM has
// group_idx), or a "component_type" key in map events. Their class
// definitions were not found: the positions are inferred from the recorder's
// keyword construction and msgspec's field order (a subclass's fields,
// keyword-only or not, follow its base's, as BlockStoredWithMetadata's
// metadata follows medium). Each component is a cache of its own, like a
// KV-cache group: the check keeps one (EventsOptions.Component, --component;
// default "full", else the first seen) and notes how many events of the
// others it skipped. A string at position 7 is a component only in SGLang's
// shape (no lora_id; nothing after it but the metadata map, or a component
// tag): vLLM writes lora_name with its lora_id, and extra_keys (an array)
// after it. A component names no namespace. The map-era recorders (events.py
// at commit 06f643f, adapter.py above) emit no component.
//
// Synthetic runs whose decisions a correct engine made, and the decision
// faults above injected into them, are package fault's (SynthPrefix,
// PrefixRun.Inject); the HTML view is htmlreport.WritePrefix; the command is
// `sparsemla prefix`.
//
// # Memory
//
// The correct cache holds at most Config.Capacity tokens (when the input
// records no evictions); per request the run keeps its page chain hashes
// (8 bytes a page) and, for the last Config.Retain requests (0: all), its
// token stream, which the hit-too-long check reads. [EventsTrace] gives
// every request and eviction its whole parent chain: together they may take
// 128 MiB plus 128 bytes per byte of the event stream (an error beyond).
package prefixcheck
