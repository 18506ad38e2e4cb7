package engine

import (
	"fmt"
	"io"
	"strings"

	"sparsemla/attention"
)

// v41Sections groups V4.1's stages, with the sentence that says why each part
// exists and what changed from V4.
var v41Sections = []struct {
	title, why string
	match      func(stage string) bool
}{
	{"Query", "low-rank query x → wq_a → q_norm → wq_b (FP8 with 32×32 blocks, activations quantised per 32), the last 64 dims of each head rotated to p. V4.1 has NO per-head RMS normalisation of q.",
		func(s string) bool { return s == "q_a" || s == "cq" || s == "q_b" || s == "q" }},
	{"Window K (= V) of the new token", "one 512-d latent per token is key and value; V4.1 snaps ALL 512 dims (the rope part too) to FP8 in blocks of 32 (V4: dims 0..447, blocks of 64) and writes it to window slot p mod 128.",
		func(s string) bool {
			return (strings.HasPrefix(s, "kv_") && s != "kv_cache") || s == "kv" || s == "window"
		}},
	{"Compressor (KV source only)", "only KV-source layers own a compressor: r = 1 is a plain bf16 projection + norm every token; r = 2 pools 2 tokens by a per-channel softmax (fp32, no ape, no overlap). It returns the latent BEFORE RoPE: the index keys are made from it first.",
		func(s string) bool {
			return s == "cmp_raw" || s == "cmp_a" || s == "cmp_b" || s == "cmp_kv_state" || s == "cmp_score_state" || s == "cmp_pooled" || s == "cmp_latent"
		}},
	{"Index key (KV source only)", "index key j = k_norm(wk · latent), rotated to j·r, FP4 with a power-of-two scale per 32 — no Hadamard and no separate indexer compressor (V4 has both).",
		func(s string) bool { return strings.HasPrefix(s, "ik_") || s == "icache" }},
	{"Compressed row (KV source only)", "the latent rotated to j·r, then FP4 E2M1 over all 512 dims with an E4M3 (not power-of-two) scale per 16 dims; appended to the cache every consumer of this source reads.",
		func(s string) bool { return s == "cmp_roped" || s == "cmp_row" || s == "ckv" }},
	{"Indexer (index source only)", "H_I-head 128-d query from cq, rotated to p and snapped to FP4 (no Hadamard); score_j = Σ_h w_h · ReLU(q_h · k_j) against the KV source's index keys.",
		func(s string) bool {
			return strings.HasPrefix(s, "iq") || strings.HasPrefix(s, "iw") || s == "index_qk" || s == "index_score"
		}},
	{"Two-level top-k", "the candidate source keeps the best candidate_topk_blocks blocks of candidate_block_size rows (block max, the newest row's block always); later index sources score −∞ outside them; the top index_topk rows are re-sorted by position.",
		func(s string) bool { return s == "cand_mask" || s == "index_score_masked" || s == "index_sel" }},
	{"Index list and cache", "what sparse_attn reads: the 128 window slots oldest → newest with the unfilled ones as −1 FIRST (V4: last), then 128 + j for the selected rows of the KV source's cache — the layer's own or the one published by its source.",
		func(s string) bool { return s == "topk_idxs" || s == "kv_cache" }},
	{"Sparse attention", "softmax over the listed rows with a per-head sink logit in the denominator; leading chunks with no key are skipped; then the query's rotation is removed from the output's rope dims.",
		func(s string) bool { return s == "o" || s == "o_inv" }},
	{"Output projection", "grouped low rank: o_groups blocks of wo_a (bf16 GEMM) to o_lora_rank dims each, then wo_b (FP8, 32×32 blocks) back to dim.",
		func(s string) bool { return s == "u" || s == "y" }},
}

// ExplainV41 writes the teaching view of one V4.1 decode step at position p
// for layer l: every layer l's step depends on (V41Needs: its KV source, its
// index source, the candidate source) is walked in model order, each stage
// with its equation, shape, dtype and a few values, and what each layer
// publishes to and reads from the shared runtime. Weights, the state of
// tokens 0 … p−1 and the attention inputs are synthetic
// (RandomV41LayerWeights, SyntheticV41State, SyntheticV41Input with seed).
// Then the whole step around layer l's attention is walked in replay order
// (V41WholeStages: the input streams, the pipelined mHC, the MoE, and the
// head after the last layer), with the values of a synthetic whole model
// (NewRandomV41WholeModel, token v41ExplainToken) when the config is small
// enough to draw (v41-tiny), equations and shapes otherwise (v41-flash).
func ExplainV41(w io.Writer, cfg *Config, name string, l int, p int64, seed uint64, nvals int) error {
	if !cfg.IsV41() {
		return fmt.Errorf("ExplainV41 on a %s config", cfg.Variant())
	}
	layers := V41Needs(cfg, l)
	m := NewRandomV41ModelLayers(cfg, seed, int(p)+1, layers)
	st := SyntheticV41State(m, p, seed)
	xs := make([]Tensor, cfg.NLayers)
	for _, k := range layers {
		xs[k] = SyntheticV41Input(cfg, k, p, seed)
	}
	res, err := V41Step(m, st, xs, p, nil)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "sparsemla explain: one decode step of DeepSeek-V4.1 (CSA2) attention, in the order of model.py (revision dba1be0a)\n\n")
	fmt.Fprintf(w, "config %s: dim %d, %d query heads × %d (rope %d), ONE shared KV head; q_lora_rank %d; o_groups %d × %d; window %d; rms_norm_eps %g\n",
		name, cfg.Dim, cfg.NHeads, cfg.HeadDim, cfg.RopeHeadDim, cfg.QLoraRank, cfg.OGroups, cfg.OLoraRank, cfg.WindowSize, cfg.NormEps)
	fmt.Fprintf(w, "cross-layer sharing: KV sources %v (own a compressor and the compressed cache), index sources %v (run an indexer)", cfg.KVSources(), cfg.IndexSources())
	if cs := cfg.CandidateSource(); cs >= 0 {
		fmt.Fprintf(w, ", candidate source %d (%d blocks of %d rows)", cs, cfg.CandidateTopKBlocks, cfg.CandidateBlockSize)
	}
	fmt.Fprintf(w, "\nlayer %d: %s; its step reads the publications of layers %v, walked below in order\n", l, cfg.LayerKind(l), layers)
	fmt.Fprintf(w, "synthetic: weights, the %d earlier tokens' state and each layer's input x (seed %d); dims and arithmetic are the model's\n", p, seed)
	whole := v41ExplainWhole(cfg, p, seed)
	if whole != nil {
		fmt.Fprintf(w, "the whole step around the attention (embedding, pipelined mHC, MoE, head) is walked at the end for layer %d, with values of a synthetic whole model (token %d)\n", l, v41ExplainToken)
	} else {
		fmt.Fprintf(w, "the whole step around the attention (embedding, pipelined mHC, MoE, head) is walked at the end for layer %d with equations and shapes (too large to synthesise whole: no values)\n", l)
	}
	for _, k := range layers {
		r := cfg.Ratio(k)
		fmt.Fprintf(w, "\n════ layer %d: %s ════\n", k, cfg.LayerKind(k))
		rp := cfg.RopeParams(k)
		if rp.OriginalSeqLen > 0 {
			fmt.Fprintf(w, "RoPE base %g with YaRN (factor %g); ", rp.Base, rp.Factor)
		} else {
			fmt.Fprintf(w, "RoPE base %g, no YaRN; ", rp.Base)
		}
		first, last := attention.VisibleWindow(p, cfg.WindowSize)
		fmt.Fprintf(w, "window tokens %d … %d", first, last)
		if r > 0 {
			tc := attention.VisibleRows(p, r)
			fmt.Fprintf(w, "; compressed rows 0 … %d (Tc = %d, one per %d token(s)) of layer %d's cache, top %d of them from layer %d's list",
				tc-1, tc, r, cfg.KVSourceOf(k), min(cfg.IndexTopK, tc), cfg.IndexSourceOf(k))
			if cfg.IsKVSource(k) {
				if attention.EmitsRow(p, r) {
					fmt.Fprintf(w, "\n  this step completes compressed row %d (tokens %d … %d), RoPE position %d", p/int64(r), p/int64(r)*int64(r), p, p/int64(r)*int64(r))
				} else {
					fmt.Fprintf(w, "\n  no row completes here (r = 2, group still open); the next at p = %d", p+1)
				}
			}
		}
		if pub := V41Publishes(cfg, k); len(pub) > 0 {
			fmt.Fprintf(w, "\n  publishes: %s", strings.Join(pub, ", "))
		}
		if len(res.From[k]) > 0 {
			var rd []string
			for _, n := range []string{"ckv", "icache", "cand_mask", "index_sel"} {
				if src, ok := res.From[k][n]; ok {
					rd = append(rd, fmt.Sprintf("%s ← layer %d", n, src))
				}
			}
			fmt.Fprintf(w, "\n  reads: %s", strings.Join(rd, ", "))
			if src, ok := res.From[k]["icache"]; ok && src != cfg.KVSourceOf(k) {
				fmt.Fprintf(w, "\n  (model.py's released index-key slot: shared_attn.index_k is republished only when a group completes, so here the indexer scores against layer %d's keys, not layer %d's)", src, cfg.KVSourceOf(k))
			}
		}
		fmt.Fprintf(w, "\n\n%-18s %-4s %-10s %s\n", "stage", "type", "shape", "equation / first values and RMS")
		section := -1
		for _, def := range V41Stages(cfg, k, p) {
			for i, s := range v41Sections {
				if s.match(def.Name) {
					if i != section {
						section = i
						fmt.Fprintf(w, "\n── %s ──\n   %s\n", s.title, s.why)
					}
					break
				}
			}
			t := res.Stages[k][def.Name]
			fmt.Fprintf(w, "%-18s %-4s %-10s %s\n", def.Name, t.Kind, shapeStr(t.Shape), def.Equation)
			fmt.Fprintf(w, "%-18s %-4s %-10s %s\n", "", "", "", stageValues(def.Name, t, nvals, cfg.WindowSize))
		}
	}
	fmt.Fprintf(w, "\ny (bf16 [%d]) goes to hc_post; in V4.1 the next sub-layer collapses the streams with the pre-mix THIS sub-layer's hc_mixes produced (pipelined mHC).\n", cfg.Dim)
	explainV41Block(w, cfg, l, p, whole, nvals)
	return nil
}

// v41ExplainToken is the token id explain's synthetic whole step feeds.
const v41ExplainToken = 7

// v41ExplainWhole runs the whole step of a synthetic whole model at p when
// the config is small enough to draw (nil otherwise).
func v41ExplainWhole(cfg *Config, p int64, seed uint64) *V41StepResult {
	if V41FFNSize(cfg)*int64(cfg.NLayers) > 1<<26 || int64(cfg.Dim)*int64(cfg.NHeads)*int64(cfg.HeadDim)*int64(cfg.NLayers) > 1<<28 || v41WholeCheck(cfg) != nil {
		return nil
	}
	m := NewRandomV41WholeModel(cfg, seed, int(p)+1)
	st := SyntheticV41State(m, p, seed)
	res, err := V41WholeStep(m, st, min(v41ExplainToken, int64(cfg.VocabSize-1)), p, nil)
	if err != nil {
		return nil
	}
	return res
}

// explainV41Block walks the whole step around layer l's attention in replay
// order (V41WholeStages): the embedding (layer 0) or the layer below's
// streams, the pipelined mHC, the MoE and, after the last layer, the head —
// with values from whole (a synthetic whole step) when it is non-nil.
func explainV41Block(w io.Writer, cfg *Config, l int, p int64, whole *V41StepResult, nvals int) {
	hc := cfg.HCMult
	fmt.Fprintf(w, "\n════ layer %d: the whole step around the attention — pipelined hyper-connections (hc_mult %d, norm_eps %g, hc_eps %g, %d Sinkhorn iterations) and MoE ════\n", l, hc, cfg.NormEps, cfg.HCEps, cfg.HCSinkhornIters)
	fmt.Fprintf(w, "   each site's hc_mixes comes from its own input streams, but a sub-layer is fed by the PREVIOUS site's pre-mix: the attention by pre_mix_in (")
	if l == 0 {
		fmt.Fprintf(w, "layer 0: one-hot [1,0,…,0], make_identity_pre_mix")
	} else {
		fmt.Fprintf(w, "layer %d's pre_mix_out = its hc_ffn_pre", l-1)
	}
	fmt.Fprintf(w, "), the FFN by hc_attn_pre; hc_ffn_pre goes on to the next block (V4: each sub-layer uses its own site's pre).\n")
	fmt.Fprintf(w, "   MoE: %d routed experts (FP4 E2M1, UE8M0 per 32; activations FP8 per 32), top-%d by %s(W_g·x / gate_temp %g) + bias, weights / (Σ + 1e-20) · route_scale %g, one FP8 shared expert; swiglu_limit %g on the routed AND the shared expert; moe_inter_dim %d.\n",
		cfg.NRoutedExperts, cfg.NActivatedExperts, cfg.ScoreFunc, v41GateTemp(cfg), cfg.RouteScale, cfg.SwigluLimit, cfg.MoEInterDim)
	k := cfg.NActivatedExperts
	shape := map[string]string{"h_in": fmt.Sprintf("[%d,%d]", hc, cfg.Dim), "h_mid": fmt.Sprintf("[%d,%d]", hc, cfg.Dim), "h_out": fmt.Sprintf("[%d,%d]", hc, cfg.Dim),
		"hc_attn_mixes": fmt.Sprintf("[%d]", (2+hc)*hc), "hc_ffn_mixes": fmt.Sprintf("[%d]", (2+hc)*hc), "hc_attn_comb": fmt.Sprintf("[%d,%d]", hc, hc), "hc_ffn_comb": fmt.Sprintf("[%d,%d]", hc, hc),
		"moe_indices": fmt.Sprintf("[%d]", k), "moe_weights": fmt.Sprintf("[%d]", k), "moe_expert_out": fmt.Sprintf("[%d,%d]", k, cfg.Dim),
		"logits": fmt.Sprintf("[%d]", cfg.VocabSize), "next_token": "[1]"}
	kinds := map[string]string{"moe_indices": "i64", "next_token": "i64", "moe_weights": "f32", "logits": "f32"}
	row := func(d V41StageDef, t *Tensor) {
		kind, sh := "bf16", fmt.Sprintf("[%d]", cfg.Dim)
		if strings.HasPrefix(d.Name, "hc_") || strings.Contains(d.Name, "pre_mix") {
			kind, sh = "f32", fmt.Sprintf("[%d]", hc)
		}
		if v, ok := kinds[d.Name]; ok {
			kind = v
		}
		if v, ok := shape[d.Name]; ok {
			sh = v
		}
		if t != nil {
			kind, sh = t.Kind.String(), shapeStr(t.Shape)
		}
		fmt.Fprintf(w, "%-18s %-4s %-10s %s\n", d.Name, kind, sh, d.Equation)
		if t != nil {
			fmt.Fprintf(w, "%-18s %-4s %-10s %s\n", "", "", "", stageValues(d.Name, *t, nvals, cfg.WindowSize))
		}
	}
	value := func(layer int, d V41StageDef) *Tensor {
		if whole == nil {
			return nil
		}
		m := whole.Stages[layer]
		if d.Global {
			m = whole.Global
		}
		if t, ok := m[d.Name]; ok {
			return &t
		}
		return nil
	}
	attn := map[string]bool{}
	for _, d := range V41Stages(cfg, l, p) {
		attn[d.Name] = true
	}
	part := ""
	for _, d := range V41WholeStages(cfg, l, p) {
		if attn[d.Name] {
			if part != "attn" {
				part = "attn"
				fmt.Fprintf(w, "%-18s %-4s %-10s %s\n", "…", "", "", "attention sub-layer above: x → y")
			}
			continue
		}
		var title string
		switch {
		case d.Name == "embed" || d.Name == "h_in" || d.Name == "pre_mix_in":
			title = "input streams"
		case strings.HasPrefix(d.Name, "hc_attn_") || d.Name == "attn_norm_in" || d.Name == "x":
			title = "attention site"
		case strings.HasPrefix(d.Name, "moe_") || d.Name == "ffn_out":
			title = "MoE"
		case d.Global:
			title = "head"
		default:
			title = "FFN site"
		}
		if title == "FFN site" && (part == "MoE" || part == "FFN site: hc_post") {
			title = "FFN site: hc_post"
		}
		if title != part {
			part = title
			fmt.Fprintf(w, "\n── %s ──\n", title)
		}
		row(d, value(l, d))
	}
	if last := cfg.NLayers - 1; l != last {
		fmt.Fprintf(w, "\n── head (after the last layer, %d) ──\n", last)
		for _, d := range V41WholeStages(cfg, last, p) {
			if d.Global {
				row(d, value(last, d))
			}
		}
	}
}
