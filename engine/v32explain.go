package engine

import (
	"fmt"
	"io"
	"strings"
)

// v32ExplainSections group the V3.2 stages (V32Stages) into the parts of the
// algorithm, each with the sentence that says why it exists.
var v32ExplainSections = []struct {
	title, why string
	match      func(stage string) bool
}{
	{"Query (MLA)", "low-rank query: x → wq_a → q_norm (qr, shared with the indexer) → wq_b, H heads of qk_nope + qk_rope dims; the last 64 are rotated to p (q_pe); the nope part is multiplied into the latent space by the key half of wkv_b (the 'absorbed' decode form, so keys are never expanded per head).",
		func(s string) bool { return s == "q_a" || s == "qr" || s == "q_b" || s == "q_pe" || s == "q_absorbed" }},
	{"Latent KV of the new token", "ONE latent row per token serves every head as key and value: wkv_a → kv_norm on the first kv_lora_rank dims, rounded through FP8 (E4M3, one power-of-two scale per 128: the deployed FP8 cache, exactly a 656-byte page entry), RoPE on the last 64 (k_pe, bf16); appended BEFORE attention.",
		func(s string) bool {
			return s == "kv_a" || s == "kv_normed" || s == "kv_fq8" || s == "k_pe" || s == "latent_cache"
		}},
	{"Lightning indexer query", "H_I heads of 128 dims from qr (indexer.wq_b); here the FIRST 64 dims are the rotated ones, as non-interleaved pairs (i, i+32) (the MLA RoPE pairs neighbours); Hadamard-rotated, then act_quant to E4M3 with one power-of-two scale per head.",
		func(s string) bool { return strings.HasPrefix(s, "iq_") }},
	{"Lightning indexer key", "one 128-d key per token from x (indexer.wk), LayerNorm with bias, RoPE on the first 64 dims, Hadamard, E4M3 + scale; cached for every token (k_cache, k_scale_cache): nothing is compressed.",
		func(s string) bool { return strings.HasPrefix(s, "ik_") || s == "k_cache" || s == "k_scale_cache" }},
	{"Indexer scores and top-k (DSA)", "fp8_index: score_t = k_scale_t · Σ_h w_h · ReLU(q_h · k_t) with w_h = weights_proj(x)_h (fp32) · H_I^-0.5 · q_scale_h · 128^-0.5, over EVERY cached token; the top min(index_topk, p+1) tokens are the only ones attention reads.",
		func(s string) bool { return strings.HasPrefix(s, "iw") || strings.HasPrefix(s, "index_") }},
	{"Sparse MLA attention", "scores q_absorbed·latent + q_pe·k_pe, each einsum and the sum in bf16, scaled by τ = qk_head_dim^-0.5 (× mscale² under YaRN), −∞ outside the selected tokens (index_mask), softmax of the bf16 scores (P in bf16), times the latent rows: the output is still in the latent space; no attention sink.",
		func(s string) bool { return s == "o_latent" }},
	{"Output", "the value half of wkv_b maps each head's latent output to v_head_dim dims (o_v), then wo (FP8) maps all heads back to dim.",
		func(s string) bool { return s == "o_v" || s == "y" }},
	{"Residual and attn_norm (Block.forward)", "the residual stream is a pair (x, residual): RMSNorm adds them in fp32, normalises that fp32 sum (not its bf16 rounding) and hands on the bf16 sum as the new residual (h_in); layer 0 has no residual yet.",
		func(s string) bool { return s == "h_in" || s == "x" }},
	{"Residual and ffn_norm", "the same fused add-RMSNorm around the FFN: h_mid = bf16(y + h_in), ffn_in = ffn_norm of their fp32 sum.",
		func(s string) bool { return s == "h_mid" || s == "ffn_in" }},
	{"FFN", "dense MLP on the first n_dense_layers layers, else the V3 MoE: sigmoid (or softmax) gate scores, + bias for the selection only, n_expert_groups groups of which the n_limited_groups best (by max, or top-2 sum with a bias) are kept, top-k experts weighted by their unbiased scores (normalised under sigmoid) × route_scale; every expert and the shared expert an FP8 SiLU·up MLP, summed in fp32 in ascending expert order.",
		func(s string) bool { return s == "ffn_out" || strings.HasPrefix(s, "moe_") }},
	{"Final norm and head", "after the last layer: norm of the fp32 sum ffn_out + h_mid, then the fp32 head over the vocabulary.",
		func(s string) bool { return s == "logits" }},
}

// explainV32 is Explain for a V3.2 model: the attention sub-layer of one
// decode step: attn_norm, the attention, ffn_norm, the dense MLP or V3 MoE
// (and the head on the last layer), as V32BlockStages.
func explainV32(w io.Writer, cfg *Config, name string, l int, p int64, seed uint64, nvals int) error {
	if cfg.DType != "fp8" || cfg.PolicyName() != PolicyOfficial {
		return fmt.Errorf("a V3.2 model has the official FP8 path only (dtype %q, policy %s)", cfg.DType, cfg.PolicyName())
	}
	rope := LayerRope(cfg, l, int(p)+1)
	W := RandomLayerWeights(cfg, l, seed)
	W.V32.FFN = RandomV32FFNWeights(cfg, l, seed)
	st := SyntheticState(cfg, W, rope, p, seed)
	xIn := SyntheticInput(cfg, p, seed)
	resIn := SyntheticInput(cfg, p, seed+1)
	ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: W, Rope: rope}
	fmt.Fprintf(w, "sparsemla explain: one decode step of one DeepSeek-V3.2 (DSA) layer (norms, MLA + lightning indexer, FFN), in the order of model.py (8631a81)\n\n")
	fmt.Fprintf(w, "config %s: dim %d, %d query heads × (%d nope + %d rope), ONE latent KV row of %d + %d dims per token; q_lora_rank %d; v_head_dim %d\n",
		name, cfg.Dim, cfg.NHeads, cfg.QKNopeHeadDim, cfg.QKRopeHeadDim, cfg.KVLoraRank, cfg.QKRopeHeadDim, cfg.QLoraRank, cfg.VHeadDim)
	fmt.Fprintf(w, "indexer: %d heads × %d, top-%d over the whole context\n", cfg.IndexNHeads, cfg.IndexHeadDim, cfg.IndexTopK)
	rp := cfg.RopeParams(l)
	if rp.OriginalSeqLen > 0 {
		fmt.Fprintf(w, "RoPE: base %g with YaRN (factor %g, original_seq_len %d, beta %d/%d; max_seq_len %d > original_seq_len) on 64 dims, interleaved pairs in MLA, pairs (i, i+32) in the indexer; softmax scale τ = %g (mscale² applied)\n",
			rp.Base, rp.Factor, rp.OriginalSeqLen, rp.BetaFast, rp.BetaSlow, cfg.MaxSeqLen, cfg.V32SoftmaxScale())
	} else {
		fmt.Fprintf(w, "RoPE: base %g, no YaRN, on 64 dims, interleaved pairs in MLA, pairs (i, i+32) in the indexer; softmax scale τ = %g\n", rp.Base, cfg.V32SoftmaxScale())
	}
	ffn := "MoE"
	if l < cfg.NDenseLayers {
		ffn = "dense MLP"
	}
	fmt.Fprintf(w, "layer %d (%s FFN): step p = %d: the query may see tokens 0 … %d; the indexer keeps %d of them\n",
		l, ffn, p, p, min(int64(cfg.IndexTopK), p+1))
	fmt.Fprintf(w, "synthetic: weights, the %d earlier tokens' state and the Block inputs x_in, res_in (seed %d); dims and arithmetic are the model's\n", p, seed)
	fmt.Fprintf(w, "\n%-16s %-4s %-10s %s\n", "stage", "type", "shape", "equation / first values and RMS")
	avail := map[string]Tensor{"x_in": xIn}
	leaves := []struct {
		name, why string
		t         Tensor
	}{{"x_in", "Block input x: the previous layer's ffn_out (layer 0: the embedding row; synthetic)", xIn}}
	if l > 0 {
		avail["res_in"] = resIn
		leaves = append(leaves, struct {
			name, why string
			t         Tensor
		}{"res_in", "Block input residual: the previous layer's h_mid (synthetic)", resIn})
	}
	for _, lf := range leaves {
		fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", lf.name, lf.t.Kind, shapeStr(lf.t.Shape), lf.why)
		fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", "", "", "", valuesStr(lf.t, 0, nvals))
	}
	for n, t := range st.StateTensors() {
		avail[PrevPrefix+n] = t
	}
	section := -1
	for _, def := range V32BlockStages(cfg, l, p, W) {
		for i, s := range v32ExplainSections {
			if s.match(def.Name) {
				if i != section {
					section = i
					fmt.Fprintf(w, "\n── %s ──\n   %s\n", s.title, s.why)
				}
				break
			}
		}
		in := map[string]Tensor{}
		for _, n := range def.Inputs {
			in[n] = avail[n]
		}
		t, err := def.Compute(ctx, in)
		if err != nil {
			return fmt.Errorf("stage %s: %w", def.Name, err)
		}
		avail[def.Name] = t
		fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", def.Name, t.Kind, shapeStr(t.Shape), def.Equation)
		fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", "", "", "", valuesStr(t, 0, nvals))
	}
	return nil
}
