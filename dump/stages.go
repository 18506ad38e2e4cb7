package dump

// Stage describes one canonical stage name: what tensor a dump key with this
// stage holds in one decode step at position P.
type Stage struct {
	Name  string // canonical stage name (the key suffix of the official-v4-tiny dumps)
	DType string // dtype in the official code (the dump may hold a wider one)
	Shape string // symbolic shape (symbols below)
	When  string // which layers/steps have it: all, r>0, r=4, emit (r>0, (P+1) mod r == 0), r=4 emit, global, prefill, table
	State bool   // also dumped as a replay start state (KindState, valid after step p0-1)
	Doc   string // one-line meaning
}

// Shape symbols used in Stages:
//
//	H    n_heads                 D    head_dim = 512 (448 nope + 64 rope)
//	dim  model width             Dq   q_lora_rank
//	G    o_groups                Do   o_lora_rank
//	W    window_size = 128       r    compress ratio of the layer (0, 4, 128)
//	Tc   (P+1) div r, compressed rows after step P
//	K    min(index_topk, Tc)     coff 2 if r = 4 else 1
//	IH   index_n_heads           ID   index_head_dim
//	hc   hc_mult                 T    max_seq_len (table rows)
//	S    prompt length           E    routed experts per token (n_activated_experts)
//	V    vocab size              NT   hc_mult*(2+hc_mult) mixes
//
// Stages lists every tensor of one decode step in the order the official
// model.py computes them (release-day DeepSeek-V4 model.py line ranges in
// the golden README), then the replay start state and the GPU tables.
var Stages = []Stage{
	// global
	{"pos", "i64", "[1]", "global", false, "absolute position P of the decoded token"},
	{"tok", "i64", "[1]", "global", false, "token id fed at P"},
	{"logits", "f32", "[V]", "global", false, "model output logits at P"},

	// block / mHC
	{"h_in", "bf16", "[hc, dim]", "all", false, "layer input hidden stream (L0: embedding repeated hc times; L(l+1).h_in == L(l).h_out)"},
	{"hc_attn_mixes", "f32", "[NT]", "all", false, "(hc_attn_fn . flatten(h)) * rsqrt(mean(h^2)+eps), input of hc_split_sinkhorn"},
	{"hc_attn_pre", "f32", "[hc]", "all", false, "hc_split_sinkhorn pre weights"},
	{"hc_attn_post", "f32", "[hc]", "all", false, "hc_split_sinkhorn post weights"},
	{"hc_attn_comb", "f32", "[hc, hc]", "all", false, "hc_split_sinkhorn combination matrix"},
	{"attn_norm_in", "bf16", "[dim]", "all", false, "hc_pre collapse bf16(sum_j pre_j h_j)"},
	{"x", "bf16", "[dim]", "all", false, "attention input = attn_norm output"},

	// attention projections
	{"q_a", "bf16", "[Dq]", "all", false, "wq_a(x) (FP8 linear)"},
	{"cq", "bf16", "[Dq]", "all", false, "q_norm output (also the indexer's qr)"},
	{"q_b", "bf16", "[H, D]", "all", false, "wq_b(cq), before the per-head RMS norm"},
	{"q_pe_prerope", "bf16", "[H, 64]", "all", false, "dims 448..511 after the head norm, before RoPE"},
	{"q", "bf16", "[H, D]", "all", false, "query given to sparse_attn (head norm + RoPE at P)"},
	{"kv_raw", "bf16", "[D]", "all", false, "wkv(x)"},
	{"kv_normed", "bf16", "[D]", "all", false, "kv_norm output (before RoPE and FQ8)"},
	{"kv_roped", "bf16", "[D]", "all", false, "after RoPE of dims 448..511, before FQ8"},
	{"kv", "bf16", "[D]", "all", false, "window K after FQ8 of dims 0..447 (blocks of 64) == kv_cache[P mod W]"},

	// main compressor
	{"cmp_a", "f32", "[coff*D]", "r>0", false, "compressor.wkv(f32(x)) of token P"},
	{"cmp_b", "f32", "[coff*D]", "r>0", false, "compressor.wgate(f32(x)) without ape"},
	{"cmp_kv_state", "f32", "[coff*r, coff*D] (r=128 step dump: [P mod 128 + 1, D])", "r>0", true, "compressor kv_state after the step"},
	{"cmp_score_state", "f32", "[coff*r, coff*D] (r=128 step dump: [P mod 128 + 1, D])", "r>0", true, "compressor score_state after the step (-inf = never written)"},
	{"cmp_pooled", "bf16", "[D]", "emit", false, "bf16(pooled row j = P div r), input of compressor.norm"},
	{"cmp_normed", "bf16", "[D]", "emit", false, "compressor.norm output (before RoPE)"},
	{"cmp_roped", "bf16", "[D]", "emit", false, "after RoPE at position j*r, before FQ8"},
	{"cmp_row", "bf16", "[D]", "emit", false, "final compressed row (FQ8 on dims 0..447) == kv_cache[W + j]"},

	// indexer
	{"iq_b", "bf16", "[IH, ID]", "r=4", false, "indexer.wq_b(cq), before RoPE"},
	{"iq_roped", "bf16", "[IH, ID]", "r=4", false, "after RoPE of dims 64..127 (input of the Hadamard)"},
	{"iq_had", "bf16", "[IH, ID]", "r=4", false, "Hadamard output (input of FP4)"},
	{"iq", "bf16", "[IH, ID]", "r=4", false, "after FP4 fake-quant (blocks of 32) = indexer query"},
	{"iw_raw", "bf16", "[IH]", "r=4", false, "weights_proj(x)"},
	{"iw", "bf16", "[IH]", "r=4", false, "iw_raw * (ID^-0.5 * IH^-0.5)"},
	{"icmp_a", "f32", "[coff*ID]", "r=4", false, "indexer compressor wkv output"},
	{"icmp_b", "f32", "[coff*ID]", "r=4", false, "indexer compressor wgate output (without ape)"},
	{"icmp_kv_state", "f32", "[coff*r, coff*ID]", "r=4", true, "indexer compressor kv_state after the step"},
	{"icmp_score_state", "f32", "[coff*r, coff*ID]", "r=4", true, "indexer compressor score_state after the step"},
	{"icmp_pooled", "bf16", "[ID]", "r=4 emit", false, "indexer pooled row"},
	{"icmp_normed", "bf16", "[ID]", "r=4 emit", false, "indexer compressor norm output"},
	{"icmp_roped", "bf16", "[ID]", "r=4 emit", false, "after RoPE at position 4j"},
	{"icmp_had", "bf16", "[ID]", "r=4 emit", false, "after the Hadamard"},
	{"icmp_row", "bf16", "[ID]", "r=4 emit", false, "after FP4 == icache[j]"},
	{"index_qk", "bf16", "[IH, Tc]", "r=4", false, "einsum(iq, icache) before ReLU"},
	{"index_score", "bf16", "[Tc]", "r=4", false, "sum_h relu(index_qk)*iw (the tensor given to topk)"},
	{"index_topk", "i64", "[K]", "r=4", false, "topk indices (descending score; CUDA tie order)"},
	{"index_sel", "i64", "[K]", "r=4", false, "indexer return value = index_topk + W (== topk_idxs[W:])"},
	{"icache", "bf16", "[Tc, ID]", "r=4", true, "indexer key cache after the step"},

	// sparse attention and output
	{"topk_idxs", "i32", "[W + K] (r=4) | [W + Tc] (r=128) | [W] (r=0)", "all", false, "index list given to sparse_attn (window first, -1 = empty; compressed = W + row)"},
	{"o", "bf16", "[H, D]", "all", false, "sparse_attn output (before inverse RoPE)"},
	{"o_inv", "bf16", "[H, D]", "all", false, "after inverse RoPE of dims 448..511 (input of wo_a)"},
	{"u", "bf16", "[G, Do]", "all", false, "wo_a grouped einsum output"},
	{"y", "bf16", "[dim]", "all", false, "attention output (wo_b), input of hc_post"},
	{"kv_cache", "bf16", "[W + Tc, D] (r>0) | [W, D] (r=0)", "all", true, "cache rows after the step: window slots (token t at t mod W), then compressed rows"},

	// block after attention
	{"h_mid", "bf16", "[hc, dim]", "all", false, "stream after the attention hc_post"},
	{"hc_ffn_mixes", "f32", "[NT]", "all", false, "FFN hc mixes"},
	{"hc_ffn_pre", "f32", "[hc]", "all", false, "FFN hc pre weights"},
	{"hc_ffn_post", "f32", "[hc]", "all", false, "FFN hc post weights"},
	{"hc_ffn_comb", "f32", "[hc, hc]", "all", false, "FFN hc combination matrix"},
	{"ffn_norm_in", "bf16", "[dim]", "all", false, "FFN hc_pre collapse"},
	{"ffn_in", "bf16", "[dim]", "all", false, "ffn_norm output"},
	{"ffn_out", "bf16", "[dim]", "all", false, "MoE output"},
	{"moe_weights", "f32", "[E]", "all", false, "routing weights"},
	{"moe_indices", "i64", "[E] (i32 on hash layers)", "all", false, "routed expert ids"},
	{"h_out", "bf16", "[hc, dim]", "all", false, "layer output hidden stream"},

	// replay start (prefill) globals and GPU tables
	{"prompt", "i64", "[S]", "prefill", true, "prompt tokens (prefill)"},
	{"decode_tokens", "i64", "[steps]", "prefill", true, "tokens fed at the dumped decode steps"},
	{"freqs_cis_r0", "f32", "[T, 32, 2]", "table", false, "GPU RoPE (cos, sin) of position t, pair i, for ratio-0 layers"},
	{"freqs_cis_cmp", "f32", "[T, 32, 2]", "table", false, "GPU RoPE (cos, sin) for ratio>0 layers (compress_rope_theta + YaRN)"},
}

// StateStages are the stages a replay starts from (dumped as KindState,
// valid after step p0-1).
var StateStages = []string{"kv_cache", "cmp_kv_state", "cmp_score_state", "icache", "icmp_kv_state", "icmp_score_state"}

var stageIndex = func() map[string]int {
	m := make(map[string]int, len(Stages))
	for i, s := range Stages {
		if _, dup := m[s.Name]; dup {
			panic("dump: duplicate stage " + s.Name)
		}
		m[s.Name] = i
	}
	return m
}()

// LookupStage returns the table entry of a canonical stage name.
func LookupStage(name string) (Stage, bool) {
	i, ok := stageIndex[name]
	if !ok {
		return Stage{}, false
	}
	return Stages[i], true
}
