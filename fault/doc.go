// Package fault injects realistic GPU bugs into decode-path dumps, so that a
// replay can be shown to name them. It writes a faulted copy of any dump
// (WriteFaulted) and synthesises whole runs of a seeded random model, clean or
// with a fault (Synthesize, Synth.Write).
//
// # Faults
//
// A Fault is a Kind at a decode step and layer ("wrong-lse@8,1", Parse):
// split-K merge, wrong LSE, FP8 scale rounding, a flipped scale byte, top-k
// off by one, a stale prefix-cache page, a compressor row written late, the
// V4.1 window order (Kinds lists them); and, in a dump with the whole
// layer's weights (NeedsBlock, block.go), the parts of the whole step: the
// routed experts' FP4 nibble order or scale block and a missing
// swiglu_limit clamp, the shared expert's gate and up swapped, the router
// without its selection bias, hashing the next token id, or with its
// weights not normalised, hc_post with comb transposed, hc_split_sinkhorn's
// post without its sigmoid, the head without its final norm (the decode
// variants are package moe's, variants.go). Each is applied where a buggy GPU
// makes it: the faulty stage's value is corrupted and every later stage of
// the step (and later steps, through the cache) is computed from it.
// Fault.Check refuses a fault that cannot happen at its position, and
// ErrInvisible one that would not leave its stage's tolerance there (a
// clamp that would not act, a router choice a replay calls a near tie).
// Fault.Stage and Fault.Diagnosis say what a replay must report.
//
// # Faulted copies
//
// WriteFaulted reads a dump (replay.DumpSource and its engine.Model), plans
// the changed records (the faulty stage, then every stage the faulty values
// reach, recomputed with the reference as the GPU would have: the rest of the
// layer, the layers above it through their input streams, the logits, and
// the later steps through the changed caches and states; KV pages
// re-encoded with replay.RewritePage; split-K partials; a stale-prefix donor
// request) and writes a directory that replays without flags: config.json, a
// copy of the weights and dump.smd, a native dump holding every record of
// the input, changed where the fault reaches. What the dump does not let it
// recompute (layers or steps it does not hold, weights of the attention path
// only, a token a greedy run would have picked otherwise) stays as dumped and
// is listed in Copy.NotRecomputed.
//
// # Synthetic runs
//
// Synthesize builds a model of a preset with engine.RandomLayerWeights and
// runs the reference over a seeded token stream as a GPU would (the residual
// stream between layers is synthetic glue standing in for mHC and the FFN),
// recording every stage of the dumped steps in a replay.MemSource. With
// SynthOptions.Whole the model is the whole one instead (block weights from
// engine.RandomBlockWeights with the hyper-connection parameters at the
// official golden's magnitudes, the embedding and the head; swiglu_limit
// SynthWholeSwigluLimit, so the clamp acts): layer 0 from the embedding of a
// seeded random token, each later layer from the h_out below, every stage of
// engine.BlockStages (and the logits) recorded, so that every kind of the
// whole layer (NeedsBlock) can be injected into a synthetic run too.
// Synth.Write writes it as a model directory (SynthConfigFile,
// SynthWeightsFile under the official state_dict names — a whole model's
// block and head parameters too, engine.BlockWeightRecords and
// HeadWeightRecords — and SynthDumpFile with KV pages in the v4-model1
// layout). The output of both is deterministic for a seed.
//
// # Prefix-cache decision faults (prefix.go, prefix_fault.go)
//
// SynthPrefix builds a multi-request serving run (scenarios: shared system
// prompts, branching conversations, eviction pressure) whose prefix-cache
// decisions a correct engine made: a kvcache.RadixCache with the run's page
// size, schedule and capacity (LRU), recording each request's hit, source and
// the evictions before it. PrefixRun.Events writes it as a vLLM KV-cache event
// stream (prefixcheck.EncodeEvents), PrefixRun.WriteNative as a native dump
// (tok records, prefix frames). PrefixRun.Inject inserts one extra request
// carrying a decision bug (prefixcheck's kinds: hit-too-long, beyond-cache,
// resume-beyond-cache, namespace-mix, missed-hit, evicted-page,
// overwritten-page; PrefixFaultForms says which written form can express
// each), placed where no later request reuses what it touches, so that
// prefixcheck reports exactly that request with that kind and a clean run
// all-agree.
package fault
