// Package engine is the DeepSeek-V4 reference model: the config, the weights
// and state of each layer, and one decode step of a layer — hyper-connections,
// attention, MoE, and on the last layer the head — as a graph of named stage
// tensors. It runs that step on plain reference loops or on prepared fast
// kernels with the same bits, and knows nothing of replays, reports,
// tolerances or faults (packages replay and fault build on it).
//
// # Overview
//
// A model is a Config (the official ModelArgs JSON, or a preset: "tiny" for the
// golden GPU run, "flash", "pro"), and one layer's attention path is its
// LayerWeights (official state_dict names, FP8 weights kept as codes + UE8M0
// block scales and dequantised once, exactly) and its LayerState (kv_cache:
// window ring + compressed rows; main and indexer compressor states; indexer
// key cache).
//
// One decode step of one layer is a list of stages (Stages, spec order of
// dsv4-attention.md §2.3/§4). Each StageDef names its inputs — stages of the
// same step, "x" (the bf16 attention input) or "prev:<state>" (the state before
// the step) — its one-line equation, and a Compute function:
//
//	q_a → cq → q_b → q_pe_prerope → q                    query (HeadRMS per op in bf16, RoPE at p)
//	kv_raw → kv_normed → kv_roped → kv                   window K = V (FQ8 of dims 0..447)
//	iq_b → iq_roped → iq_had → iq                        indexer query (r = 4)
//	icmp_a, icmp_b → icmp_kv_state, icmp_score_state     indexer compressor (r = 4)
//	  [→ icmp_pooled → icmp_normed → icmp_roped → icmp_had → icmp_row]   at emitting steps
//	icache → iw_raw → iw → index_qk → index_score → index_topk → index_sel
//	topk_idxs                                            WindowIdx(p) ++ compressed rows
//	cmp_a, cmp_b → cmp_kv_state, cmp_score_state         main compressor (r > 0)
//	  [→ cmp_pooled → cmp_normed → cmp_roped → cmp_row]  at emitting steps
//	kv_cache → o → o_inv → u → y                         cache write, sparse attention, output
//
// BlockStages wraps them into the whole layer when its LayerWeights carry
// Block (BlockWeights: hc_attn_* / hc_ffn_*, attn_norm / ffn_norm, the MoE;
// packages mhc and moe hold the arithmetic) — the official Block.forward:
//
//	[h_in]                                               layer 0: Expand(embed[tok]) (HeadWeights.Embed)
//	hc_attn_mixes → hc_attn_pre/post/comb → attn_norm_in → x     hc_pre, attn_norm
//	… the stages above … y
//	h_mid                                                hc_post: post·y + comb-mixed h_in
//	hc_ffn_mixes → hc_ffn_pre/post/comb → ffn_norm_in → ffn_in   hc_pre, ffn_norm
//	moe_indices → moe_weights → ffn_out                  router (top-k or tid2eid), experts
//	h_out                                                hc_post; the next layer's h_in
//	[logits]                                             last layer: hc_head, norm, head (HeadWeights.Head)
//
// Inputs named GlobalPrefix+"tok" are the step's token id (a value of no
// layer); logits is a Global stage (dumped at no layer). RunLayer chains the
// whole layer from h_in (and the token) as RunStep chains the attention part
// from x.
//
// The names are the key suffixes of the golden GPU dumps. Two ways to run them
// (package replay does both against a dump):
//
//   - teacher-forced (local): feed each Compute the DUMPED values of its
//     inputs and compare its result with the dumped value of the stage: an
//     error cannot come from upstream;
//   - propagated: RunStep chains every Compute on the reference's own outputs
//     from x and the state before the step, and returns the stage tensors and
//     the state after it.
//
// The attention and indexer packages hold the arithmetic; this package only
// names and wires it. SyntheticState / SyntheticInput / RandomLayerWeights make
// seeded synthetic layers (Explain, the teaching walk of one step that
// 'sparsemla explain' prints; benchmarks; package fault's synthetic runs).
//
// # DeepSeek-V4.1
//
// A config naming KV-source / index-source layers or candidate blocks is
// V4.1 ("CSA2", Config.IsV41; presets "v41-flash", "v41-tiny";
// engine/v41config.go). Its attention sub-layer has its own weights, state
// and stage graph (V41LayerWeights, V41State, V41Stages; engine/v41.go, the
// stage computations in engine/v41_compute.go):
// source layers publish their compressed cache, index keys, top-k list and
// candidate mask, later layers of the same step read them, so V41Step runs
// one decode step of every layer (or of V41Needs(l)) in order. The V4 stage
// graph (Stages, BlockStages, RunStep) does not take V4.1 configs (the V4
// replay refuses them; replay.V41Run replays V4.1 dumps in the official
// layout); docs/v41.md lists what was confirmed in the official code and on
// the GPU, and what is not implemented (mHC, MoE, Engram; the dump formats
// the V4.1 commands refuse).
//
// # Models and records
//
// A Model is what a decode step needs besides its inputs: the Config, the
// LayerWeights of each layer and each layer's RoPE table (RopeTable; LayerRope
// computes one, spec §3.6), and the embedding and head (HeadWeights). Weights
// load from safetensors files in the checkpoint's layout (LoadLayerWeights,
// LoadLayerWeightsPrepared; LoadBlockWeights, LoadHeadWeights for the rest of
// the model, HasBlockWeights / HasHeadWeights say whether a file has them; from
// a dump.Safetensors). A large checkpoint can stay on disk: lazy routed experts
// (BlockLoadOptions.LazyExperts) live in one byte-bounded ExpertCache shared by
// the layers (Config.ExpertCacheBytes), embedding rows are read on demand
// (HeadLoadOptions.LazyEmbed, CheckpointEmbedding), and a prepared layer or
// block keeps its compressor, hc_*_fn and gate weights as panels only
// (PreparedLayer.CompactCompressors, PreparedBlock.Compact; the reference loops
// read their rows, the same bits). LayerWeightRecords writes them back as
// records under the official names. TensorFromRecord, TensorRecord and RecordLike convert
// between dump records and Tensors.
//
// # Shapes and axis order
//
// PyTorch order, innermost axis last, batch and sequence dims removed (Tensor).
// V4-Flash (tiny golden in parentheses): x, y [4096] ([256]); q_a, cq [1024]
// ([128]); q_b, q, o, o_inv [64, 512] ([4, 512]); kv_* [512]; u [8, 1024]
// ([2, 128]); topk_idxs int32 [128 + K]; kv_cache [128 + Tc, 512];
// cmp_kv_state / cmp_score_state fp32 [8, 1024] (r = 4) or the live rows
// [p mod 128 + 1, 512] (r = 128); icache [Tc, 128]; icmp states [8, 256].
//
// # Invariants
//
// A Config is validated once (ParseConfig/LoadConfig/Preset) and weights are
// checked against it tensor by tensor before any byte is read, so stage code can
// assume shapes. Inputs of a Compute may come from a dump: a size mismatch is a
// returned error naming the input, never a panic. RunStep never modifies its
// state argument. Nothing depends on GOMAXPROCS (synthetic weights are made in
// parallel from one random stream per 128-row block).
//
// # Precision
//
// Measured against two GPU runs of the official model.py (H200, tiny config,
// all 4 layers; go test ./engine -run TestGolden -v): official-v4-tiny (decode
// steps 2..7) and gpu-v4-tiny-long (prompt 126; steps 126, 127, 128, 255, 256:
// window wrap, first HCA row, top-16 of up to 64 rows, multi-chunk attention).
// Per stage: share of values bit-identical, worst bf16 ulp distance, worst fp32
// error relative to the tensor's max.
//
//	teacher-forced (each stage from the dumped inputs): 100 % bit-exact for
//	  q_pe_prerope, q, kv_roped, kv, iq_b … iq, iw_raw, iw, index_qk,
//	  index_score, index_sel, topk_idxs, every compressor state, pooled,
//	  normed, roped, had and row, icache, kv_cache, o_inv, y; and
//	    q_a, q_b, cq, u          100 % short run; ≤ 1 ulp allowed (sum order)
//	    kv_raw                   99.99 % exact, max 1 ulp (FP8 GEMM block sum order)
//	    kv_normed                99.98 % exact, max 1 ulp (RMSNorm fp32 sum order)
//	    o                        99.993 % exact, max 1 ulp (P·V sum order, long run)
//	    index_topk               same set always; 10 of 160 entries in another
//	                             order among tied scores (CUDA topk tie order)
//	    cmp_a/b, icmp_a/b        ~29 % bit-exact, max |Δ|/max|gpu| 3.8e-7 (fp32 GEMMs)
//	propagated (RunStep from the dumped x of each layer, own state carried):
//	  as above, plus fp32 compressor states 55-92 % bit-exact (max 3.7e-7
//	  relative), cmp/icmp pooled+normed max 2 ulps on near-cancelling values
//	  (~2e-5), kv_roped / o_inv / u max 1 ulp; FQ8/FQ4 absorb the drift:
//	  kv, cmp_row, icmp_row, icache and kv_cache stay 100 % bit-exact, and the
//	  index sets equal the GPU's up to ties.
//
// The whole layer (official-v4-tiny, every step and layer; gpu-v4-tiny-long
// dumps only h_in, hc_attn_*, attn_norm_in, x and y of the block; go test
// ./mhc ./moe ./head -v, and the replays' JSON):
//
//	teacher-forced: 100 % bit-exact for h_in (layer 0: the embedding; layers
//	  1-3: = h_out below), attn_norm_in, x, h_mid, ffn_norm_in, ffn_in,
//	  moe_indices, ffn_out (FP4 routed + FP8 shared experts, also from the
//	  reference's own route), h_out; and
//	    hc_*_pre, hc_*_post      83-93 % exact, max 2 fp32 ulps (CUDA expf)
//	    hc_*_comb                28-33 % exact, max 8 fp32 ulps (20 Sinkhorn iterations carry expf's bits)
//	    hc_*_mixes               ~2 % exact, max |Δ| 6.9e-6, ≤ 5.7 u·ρ·Σ|terms| (cuBLAS fp32 GEMM order)
//	    moe_weights              69 % exact, max 2 fp32 ulps (gate GEMV order, expf/log1pf)
//	    logits                   29 % exact, max |Δ| 9.5e-7 of |logits| ≤ 3.8 (fp32 head GEMV); greedy token equal
//	propagated (RunLayer from each layer's dumped h_in): attn_norm_in, x,
//	  h_mid, h_out 99.97-99.996 % exact, max 1-2 bf16 ulps; the rest as above.
//	chained (layer 0 from the token, each layer from the chain's own h_out):
//	  across 4 layers the FP8/FP4 activation quantisation turns last-bit drift
//	  into cos_diff up to 5e-5 (y), 1.2e-3 (ffn_out of the last layer), 1.4e-4
//	  (h_out), 1.1e-4 (logits); the routing (moe_indices) and the greedy
//	  token equal the GPU's at every step (replay TestWholeModelGreedyToken).
//
// The tests enforce these bounds (goldenTol, propagatedTol; the golden tests
// of packages mhc, moe, head; the replay tolerances). With RoPE tables
// computed on the CPU instead of the GPU's own, 15842 of 65536 (cos, sin)
// entries differ (CUDA pow/cos/sin are not correctly rounded), but no rotated
// value at the golden's positions changes; allow 1 ulp on rotated stages.
//
// Speed (reference, not a target): one V4-Flash decode step at context
// 65,536 takes about 0.35 s for a CSA layer and 0.2 s for an HCA layer on two
// cores (go test ./engine -run '^$' -bench DecodeStepFlash -benchtime 3x).
//
// # DeepSeek-V3.2 (DSA)
//
// A config with kv_lora_rank > 0 and no compress_ratios is a V3.2 model
// (Config.V32; presets "v32" = config_671B_v3.2.json, "v32-tiny",
// "v32-tiny-grouped" (grouped routing in small); the V3.2 ModelArgs keys
// only, engine/v32config.go). Its layers have no window,
// compressor or hyper-connections: Stages returns V32Stages (MLA decode with
// the absorbed wkv_b, the FP8-rounded latent cache, the lightning indexer over
// every token with LayerNorm keys, non-interleaved RoPE of the first 64 dims,
// Hadamard and FP8 act_quant, fp8_index, top-index_topk, sparse MLA over the
// selected tokens with bf16 scores, value up-projection, wo), the state is
// latent_cache / k_cache / k_scale_cache (LayerState.V32), the weights
// LayerWeights.V32 (V32Weights, official names). It follows the current
// official inference/model.py of deepseek-ai/DeepSeek-V3.2-Exp (8631a81,
// "fix indexer rope"), checked against that code run on an H200
// (testdata/v32-tiny, docs/v32-agreement.md: every stage bit-exact except
// summation-order ulps in kv_normed, iw_raw, index_score, o_v). With the
// layer's FFN weights (V32Weights.FFN, engine/v32ffn.go) BlockStages is
// V32BlockStages, the whole layer: Block inputs x_in / res_in, the fused
// add-RMSNorms (h_in, x, h_mid, ffn_in), the dense MLP or the V3 MoE
// (moe_indices, moe_weights, ffn_out) and the logits; without them the
// attention only. PrepareLayer on a V3.2 layer packs its FP8 linears
// (attention and FFN) for the fast path (engine/v32prepared.go: the same
// bits, TestV32PreparedEqualsReference); official policy only. A
// transformers deepseek_v32 config.json is read too (engine/v32hfconfig.go).
//
// # Numerics policies
//
// The rounding points above are model.py's on the FP8 checkpoint, the
// default. Config.DType "bf16" is model.py on a bf16 checkpoint
// (Config.BF16Checkpoint: the five FP8 linears become F.linear on bf16
// weights, attention.BF16Linear; reference loops only). Config.SetPolicy
// selects another path's rounding points: PolicyHFEager is transformers'
// DeepseekV4ForCausalLM run eagerly in bf16 (HFEagerStages lists the 22
// stages it changes, with HF's code; PolicyDiff and 'sparsemla explain
// --policy' show them). Validated against an H200 run of transformers 5.17
// (testdata/hf-v4-tiny; go test -run 'TestHFDump|TestReplayHF' ./dump
// ./replay): every stage that run dumps agrees bit for bit or within the
// GEMM's ulp, the compressor pool on HF's first window; NOT validated
// against GPU output (derived from HF's code only): the indexer's iw /
// index_qk / index_score (not hooked there), the pool of a window with an
// overlap from the previous one, and windows past 128 tokens.
//
// # Fast path
//
// Prepare packs a layer's weights once (FP8 codes + block scales, bf16 panels;
// PreparedLayer, PreparedModel); PreparedLayer.Step is an in-place decode step
// on the attention package's fast kernels, bit-identical to RunStep (y and the
// state after). PrepareLayer / Model.PrepareFast set LayerWeights.Fast, which
// switches every stage of the graph (RunStep, StageDef.Compute, hence the
// replays) to the same kernels;
// without it the reference loops run. A CSA step at 65,536 then takes about
// 10 ms, a whole 43-layer step about 0.3 s on a quiet 2-core machine
// (bench/README.md; go test ./engine -run '^$' -bench Prepared).
//
// PreparedWhole.Step is the whole decode step on the fast path, from the
// token to the logits: per layer hc_pre (PreparedBlock: mixes and gate on
// panels), PreparedLayer.Step, hc_post, the MoE with MoE.Fast (the FP4
// kernel of package moe, the shared expert on FP8 panels), and the head on
// bf16 panels (PreparedHead) — the bits of RunLayer chained layer after
// layer (TestPreparedWholeStepEqualsRunLayer; BenchmarkWholeStep: V4-Flash
// at 64K with the routed experts read lazily from a sparse checkpoint).
//
// LoadLayerWeights keeps the full reference form (every FP8 weight with its
// fp32 dequantisation, wo_a in fp32: ≈ 0.55 GiB per V4-Flash CSA layer);
// LoadLayerWeightsPrepared packs a layer as it is read and keeps only the
// compact form (FP8 codes in their panels, FP8Weight.UsePanels; wo_a only
// packed; compressors fp32): all 43 V4-Flash layers take 5.7 GiB of heap
// (BenchmarkLoadPreparedFlash). Model.Kernels names the path a model runs
// (replay.LoadModelWith chooses it; the report's "kernels" field). A compact
// layer must keep its Fast: its reference wo_a stage has no weights (it
// panics), while its FP8 weights still serve reference loops
// (attention.FP8Linear dequantises them row by row from the panels).
package engine
