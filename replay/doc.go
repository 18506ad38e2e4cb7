// Package replay replays a GPU dump of the DeepSeek-V4 decode path through the
// engine reference and names the first stage out of tolerance, with a
// diagnosis of why. It holds everything between a dump and a verdict: the
// sources, the model a dump needs, comparison, tolerances, judging,
// diagnosis, Bisect, Diff and the Report with its JSON schema.
//
// # Sources and the model
//
// A Source yields the dumped stage tensors of one request by (step, layer,
// stage) and the start state of each layer: DumpSource reads a dump.Dump
// (any format the dump package opens, records decoded one at a time),
// MemSource holds tensors in memory (package fault's synthetic runs). A
// source may also carry the GPU's KV pages (PageSource) and a prefix-cache
// hit with the donor request's stages (PrefixSource).
//
// LoadModel builds the engine.Model a dump needs: the config from the dump's
// ModelArgs, the weights of the replayed layers from weights.safetensors
// beside the dump (or --weights; FindWeights), and each layer's RoPE table,
// the GPU's own when the dump holds it. LoadModel keeps the full reference
// form and runs the plain reference loops; LoadModelWith(LoadOptions{Prepared:
// true}), what the commands do unless --reference, packs each layer as it is
// read (engine.LoadLayerWeightsPrepared) and runs the prepared fast kernels,
// the same bits. The report's "kernels" field names the path that ran
// (engine.Model.Kernels); the reports are byte-identical otherwise (cmd/sparsemla
// TestReplayKernelsSameBytes).
//
// # Replays
//
// Run replays every stage of every layer at every decode step in spec order.
// Local mode (teacher-forced, the default) computes each stage from the
// dump's own values of its inputs, so an error is charged to the stage that
// made it; Propagated mode chains the reference's own values from each
// layer's dumped x (engine.RunStepHooked) — or, with the whole layer's
// weights, from its dumped h_in through hyper-connections, attention and MoE
// (engine.RunLayerHooked) — to show how an error grows; Chained mode runs the
// whole model end to end, layer 0 from the embedding of the dumped token and
// each later layer from the chain's own h_out below it, up to the logits.
// Bisect finds the first diverging step of a long dump: a binary search with
// few probes (a local replay of one step plus a check of the cache it
// leaves) for a persistent divergence, then a replay of the unprobed steps
// before it, so it names what a local replay names; Diff compares two dumps
// of one run (SameRun refuses two different runs), with the reference as
// referee when the weights are found.
//
// Each comparison (CompareFloat, CompareInt, sets for top-k) is judged by the
// stage's StageTol (DefaultTolerance, PropagatedTolerance, overridable from a
// file or ParseStageTol): exact, bf16 ulps, FlashMLA's abs-or-rel plus
// cos_diff, or a top-k set where a difference inside an exact score tie is a
// tie. The first failing stage is diagnosed (Diagnose): attention kernel
// (split-K partials, LSE), indexer selection and scores (the selection also
// judged against the reference's own scores), FP8 cache scales, compressor,
// index list, cache write, prefix cache (only with a recorded hit), KV cache,
// RoPE table (the GPU's own table against the config's, stage rope_table),
// upstream, NaN/inf; around the attention sub-layer (diagnose_block.go, its hypotheses in hypotheses_block_diag.go)
// embedding, layer link, hyper-connections, MoE router and experts, head;
// and the stage's hypotheses (package attribute) name the known alternative
// computation that reproduces the GPU's value. KV pages are
// checked byte by byte with the kvcache codecs (RewritePage) and prefix-cache
// hits row by row with kvcache.VerifyPrefixHit: a library caller of Run gets
// both with no wiring.
//
// # DeepSeek-V4.1
//
// A V4.1 dump (IsV41: a directory whose config.json, or a native file whose
// header, is a V4.1 config) has its own loaders and stage graph (LoadV41Dir
// for the official layout, LoadV41Dump for native and mapped dumps with
// their KV pages, OpenV41 choosing; engine.V41Step): V41Run
// replays it into the same Report (local or propagated, V41Tolerance),
// V41Diff and V41Bisect are its diff and bisect; docs/v41.md. A dump with
// the block weights (layers.L.hc_attn_fn, ffn.*, embed/norm/head) is
// replayed as the whole step (engine.V41WholeStep: mHC, MoE, head; the
// report's Coverage.Scope says which).
//
// # Reports
//
// A Report holds every stage result, the summary, the coverage (every
// stage tensor the dump holds at the steps replayed, accounted for:
// compared, read as an input the replay starts from — the token and
// position, each layer's x when the reference runs the attention sub-layer
// only, the h_in of each layer's propagated chain — or not compared, with
// why: an input missing, the weights given lacking the part that computes
// it, a tensor the reference does not model; coverage.go), the verdict —
// agree only when nothing the dump holds went uncompared but those inputs,
// else incomplete, or diverged — and the first divergence; WriteText prints it for people, WriteJSON as the
// sparsemla.replay/v4 object documented in docs/replay-json.md (every key
// path is listed in testdata/replay-schema.golden). Package htmlreport draws
// it as an HTML page. Output is deterministic: (step, layer) units run in
// parallel and are assembled in order, so a report is byte-identical at any
// GOMAXPROCS. Outside input (dumps, tolerance files) returns wrapped errors
// naming the file and record; a stage that panics on malformed dumped inputs
// becomes an error naming the stage (ComputeStage).
package replay
