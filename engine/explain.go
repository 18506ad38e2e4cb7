package engine

import (
	"fmt"
	"io"
	"math"
	"strings"

	"sparsemla/attention"
	"sparsemla/head"
)

// explainSections groups the stages into the parts of the algorithm, each with
// the sentence that says why it exists.
var explainSections = []struct {
	title, why string
	match      func(stage string) bool
}{
	{"Hyper-connections in (attention side)", "the layer carries hc_mult = 4 residual streams h; hc_pre reads them: 24 mixes from the fp32 RMS-scaled streams, split into pre (sigmoid + eps), post (2·sigmoid) and comb (row softmax, then Sinkhorn: rows and columns normalised hc_sinkhorn_iters times), and the streams collapsed to one bf16 vector by pre, then attn_norm.",
		func(s string) bool {
			return s == "h_in" || strings.HasPrefix(s, "hc_attn_") || s == "attn_norm_in" || s == "x"
		}},
	{"Query", "low-rank query: x → wq_a → q_norm → wq_b, then every 512-d head is divided by its RMS (V4 only, each op rounded to bf16) and its last 64 dims rotated to position p.",
		func(s string) bool { return s == "q_a" || s == "cq" || s == "q_b" || s == "q_pe_prerope" || s == "q" }},
	{"Window K (= V) of the new token", "one 512-d latent per token serves as key AND value (MQA, one KV head); dims 0..447 are snapped to the FP8 grid (FQ8, blocks of 64, power-of-two scales) as QAT trained them, the 64 rope dims stay bf16.",
		func(s string) bool { return s == "kv_raw" || s == "kv_normed" || s == "kv_roped" || s == "kv" }},
	{"Indexer query (CSA)", "the lightning indexer chooses which compressed rows to attend: an H_I-head 128-d query from cq, rotated to p, then Hadamard-rotated and snapped to FP4 (blocks of 32) exactly as its keys are.",
		func(s string) bool { return strings.HasPrefix(s, "iq") }},
	{"Indexer compressor (CSA)", "the indexer keeps its own 128-d compressed keys: every 4 tokens (overlapping with the previous 4) are pooled by a learned per-channel softmax, normed, rotated to position 4j, Hadamard-rotated and snapped to FP4.",
		func(s string) bool { return strings.HasPrefix(s, "icmp_") || s == "icache" }},
	{"Indexer scores and top-k (CSA)", "score_j = Σ_h w_h · ReLU(q_h · k_j) with per-head weights from x (no softmax; many scores tie); the top index_topk rows, larger score first, lower row on ties.",
		func(s string) bool { return strings.HasPrefix(s, "iw") || strings.HasPrefix(s, "index_") }},
	{"Index list", "what sparse_attn reads: the 128 window slots oldest → newest (−1 = empty), then kv_cache rows 128 + j of the selected compressed rows.",
		func(s string) bool { return s == "topk_idxs" }},
	{"Main compressor", "every r tokens (r = 4 overlapping, or 128) become ONE 512-d compressed K/V row: per-channel softmax pooling of Wkv·x with scores Wgate·x + ape, bf16, RMSNorm, RoPE at position j·r, FQ8 of the nope dims.",
		func(s string) bool { return strings.HasPrefix(s, "cmp_") }},
	{"Cache write", "the new token's K goes to window slot p mod 128 and an emitted compressed row to row 128 + p div r, both BEFORE attention, so the query sees them at this very step.",
		func(s string) bool { return s == "kv_cache" }},
	{"Sparse attention", "softmax over the listed rows with a per-head sink logit in the denominator only (a key with value 0), in chunks of 64 with a running max, P rounded to bf16 for P·V; then the query's rotation is removed from the output's rope dims.",
		func(s string) bool { return s == "o" || s == "o_inv" }},
	{"Output projection", "grouped low rank: heads are split into o_groups groups, each projected by its block of wo_a (bf16 GEMM) to o_lora_rank dims, then wo_b (FP8) maps all groups back to dim.",
		func(s string) bool { return s == "u" || s == "y" }},
	{"Hyper-connections out (attention side)", "hc_post writes the sub-layer output back: stream j becomes post_j · y plus Σ_k comb[k][j] · h_k (fp32, bf16 out) — the residual connection, mixed across the streams.",
		func(s string) bool { return s == "h_mid" }},
	{"Hyper-connections in (FFN side)", "the same hc_pre with the FFN's own hc_ffn_* parameters, then ffn_norm.",
		func(s string) bool { return strings.HasPrefix(s, "hc_ffn_") || s == "ffn_norm_in" || s == "ffn_in" }},
	{"Router", "the gate scores every routed expert, sqrt(softplus(W_g · ffn_in)) in fp32; a bias shifts the scores for the choice only; the first n_hash_layers layers take their experts from tid2eid[token] instead; the chosen scores are normalised to sum 1 and scaled by route_scale.",
		func(s string) bool { return strings.HasPrefix(s, "moe_") }},
	{"Experts", "each chosen expert is a SwiGLU with FP4 weights (E2M1 codes, a UE8M0 scale per 32) on the FP8-quantised input, up clamped to ±swiglu_limit and gate from above, weighted; the shared FP8 expert (no clamp) is added; the sum is fp32, in expert-id order, bf16 out.",
		func(s string) bool { return s == "ffn_out" }},
	{"Hyper-connections out (FFN side)", "hc_post again, with the FFN's post and comb: h_out, the next layer's h_in.",
		func(s string) bool { return s == "h_out" }},
	{"Head (last layer)", "hc_head collapses the last streams (sigmoid weights, no Sinkhorn), the final norm, then fp32 logits over the vocabulary; the greedy token is their argmax.",
		func(s string) bool { return s == "logits" }},
}

// Explain writes the teaching view of one decode step of layer l at position
// p of the model cfg (preset name): every stage of the whole layer
// (BlockStages: hc_pre, attention, hc_post, hc_pre, MoE, hc_post, and the head
// on the last layer) in model order with its equation, shape, dtype and the
// first nvals values and RMS, grouped into the parts of the algorithm with the
// sentence that says why each exists. Weights, the state of tokens 0 … p−1,
// the token and the layer input are synthetic (RandomLayerWeights,
// RandomBlockWeights, RandomEmbedding, RandomHead, SyntheticState,
// SyntheticInput with seed); the arithmetic is the reference's. It is what
// 'sparsemla explain' prints.
func Explain(w io.Writer, cfg *Config, name string, l int, p int64, seed uint64, nvals int) error {
	if cfg.V32() {
		return explainV32(w, cfg, name, l, p, seed, nvals)
	}
	r := cfg.Ratio(l)
	rope := LayerRope(cfg, l, int(p)+1)
	W := RandomLayerWeights(cfg, l, seed)
	st := SyntheticState(cfg, W, rope, p, seed)
	W.Block = RandomBlockWeights(cfg, l, seed)
	hw := &HeadWeights{Embed: RandomEmbedding(cfg, seed)}
	if l == cfg.NLayers-1 && int64(cfg.VocabSize)*int64(cfg.Dim) <= explainMaxHead {
		hw.Head = RandomHead(cfg, seed)
	}
	ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: W, Rope: rope, Head: hw}
	// The layer's input: the embedding of a token on layer 0, else four
	// synthetic bf16 streams.
	tok := FromI(KindI64, []int64{int64(seed % uint64(cfg.VocabSize))}, 1)
	var hIn Tensor
	if l > 0 {
		hIn = NewF(KindBF16, cfg.HCMult, cfg.Dim)
		for j := 0; j < cfg.HCMult; j++ {
			copy(hIn.F[j*cfg.Dim:], SyntheticInput(cfg, p, seed+uint64(j)).F)
		}
	}

	fmt.Fprintf(w, "sparsemla explain: one decode step of one DeepSeek-V4 layer (hyper-connections, attention, MoE), in the order of model.py\n\n")
	if diff := PolicyDiff(cfg, l, p); len(diff) > 0 {
		ck := "FP8"
		if cfg.BF16Checkpoint() {
			ck = "bf16"
		}
		fmt.Fprintf(w, "numerics policy %s on a %s checkpoint: %d stages differ from model.py on the FP8 checkpoint\n", cfg.PolicyName(), ck, len(diff))
		for _, d := range diff {
			fmt.Fprintf(w, "  %s\n", d)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "config %s: dim %d, %d query heads × %d (%d nope + %d rope), ONE shared KV head; q_lora_rank %d; o_groups %d × o_lora_rank %d; window %d\n",
		name, cfg.Dim, cfg.NHeads, cfg.HeadDim, cfg.NopeDim(), cfg.RopeHeadDim, cfg.QLoraRank, cfg.OGroups, cfg.OLoraRank, cfg.WindowSize)
	kind := map[int]string{0: "SWA: sliding window only", 4: fmt.Sprintf("CSA: window + the indexer's top-%d compressed rows (one row per 4 tokens)", cfg.IndexTopK),
		128: "HCA: window + every compressed row (one row per 128 tokens)"}[r]
	fmt.Fprintf(w, "layer %d: compress ratio r = %d, %s\n", l, r, kind)
	rp := cfg.RopeParams(l)
	if rp.OriginalSeqLen > 0 {
		fmt.Fprintf(w, "RoPE: base %g with YaRN (factor %g, original_seq_len %d, beta %d/%d) on the last 64 dims, interleaved pairs\n", rp.Base, rp.Factor, rp.OriginalSeqLen, rp.BetaFast, rp.BetaSlow)
	} else {
		fmt.Fprintf(w, "RoPE: base %g, no YaRN, on the last 64 dims, interleaved pairs\n", rp.Base)
	}
	first, last := attention.VisibleWindow(p, cfg.WindowSize)
	fmt.Fprintf(w, "step p = %d: the query sees window tokens %d … %d", p, first, last)
	if r > 0 {
		tc := attention.VisibleRows(p, r)
		fmt.Fprintf(w, " and compressed rows 0 … %d (Tc = %d)", tc-1, tc)
		if r == 4 {
			fmt.Fprintf(w, ", of which the indexer picks %d", min(cfg.IndexTopK, tc))
		}
		if attention.EmitsRow(p, r) {
			j := attention.EmittedRow(p, r)
			aF, aL, bF, bL := attention.RowTokens(j, r)
			fmt.Fprintf(w, "\n  this step completes compressed row %d (tokens %d … %d", j, bF, bL)
			if aF >= 0 {
				fmt.Fprintf(w, ", plus the overlap half of tokens %d … %d", aF, aL)
			}
			fmt.Fprintf(w, "), RoPE position %d", attention.RowRopePos(j, r))
		} else {
			fmt.Fprintf(w, "\n  no row completes here: the next one appears at p = %d", attention.EmissionPos(attention.VisibleRows(p, r), r))
		}
	}
	fmt.Fprintf(w, "\nresidual: %d streams (mHC); MoE: %d routed FP4 experts, %d per token (%s), + 1 shared FP8 expert, inter dim %d",
		cfg.HCMult, cfg.NRoutedExperts, cfg.NActivatedExperts, cfg.ScoreFunc, cfg.MoEInterDim)
	if cfg.HashLayer(l) {
		fmt.Fprintf(w, "; this layer routes by token id (hash, layer < n_hash_layers = %d)", cfg.NHashLayers)
	}
	fmt.Fprintf(w, "\nsynthetic: weights, the %d earlier tokens' state and the layer input (seed %d); dims and arithmetic are the model's\n", p, seed)

	fmt.Fprintf(w, "\n%-16s %-4s %-10s %s\n", "stage", "type", "shape", "equation / first values and RMS")
	fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", "tok", tok.Kind, shapeStr(tok.Shape), "token id fed at this step (synthetic)")
	fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", "", "", "", valuesStr(tok, 0, nvals))
	avail := map[string]Tensor{GlobalPrefix + "tok": tok}
	if l > 0 {
		fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", "h_in", hIn.Kind, shapeStr(hIn.Shape), "layer input: the streams h_out of layer "+fmt.Sprint(l-1)+" (synthetic)")
		fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", "", "", "", valuesStr(hIn, 0, nvals))
		avail["h_in"] = hIn
	}
	for n, t := range st.StateTensors() {
		avail[PrevPrefix+n] = t
	}
	section := -1
	for _, def := range BlockStages(cfg, l, p, W, hw) {
		for i, s := range explainSections {
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
		fmt.Fprintf(w, "%-16s %-4s %-10s %s\n", "", "", "", stageValues(def.Name, t, nvals, cfg.WindowSize))
	}
	if lg, ok := avail["logits"]; ok {
		fmt.Fprintf(w, "\ngreedy token: %d (argmax of the logits)\n", head.Greedy(lg.F))
	} else if l == cfg.NLayers-1 {
		fmt.Fprintf(w, "\nh_out goes to the head (not shown: a synthetic %d × %d head table is too large here).\n", cfg.VocabSize, cfg.Dim)
	} else {
		fmt.Fprintf(w, "\nh_out (bf16 [%d, %d]) is layer %d's input h_in.\n", cfg.HCMult, cfg.Dim, l+1)
	}
	return nil
}

// explainMaxHead is the largest vocab × dim head explain synthesises (the
// tiny preset's is 131072; V4-Flash's 530 M would take 2 GiB).
const explainMaxHead = 1 << 24

func shapeStr(s []int) string {
	p := make([]string, len(s))
	for i, d := range s {
		p[i] = fmt.Sprint(d)
	}
	return "[" + strings.Join(p, ",") + "]"
}

// ropeStages change only the last 64 dims of each row: show those.
var ropeStages = map[string]bool{"q": true, "kv_roped": true, "iq_roped": true, "cmp_roped": true, "icmp_roped": true, "o_inv": true}

// stageValues prints a few values of a stage: where RoPE acted, from the
// rotated dims; for the index list, the window part's ends and the compressed part.
func stageValues(name string, t Tensor, n, win int) string {
	if ropeStages[name] && len(t.Shape) > 0 {
		d := t.Shape[len(t.Shape)-1]
		return fmt.Sprintf("dims %d: %s", d-attention.RopeDims, valuesStr(t, d-attention.RopeDims, n))
	}
	if name == "topk_idxs" && len(t.I) >= win {
		w := t.I[:win]
		s := fmt.Sprintf("window %v … %v", w[:min(n, win)], w[win-min(n, win):])
		if len(t.I) > win {
			c := t.I[win:]
			s += fmt.Sprintf(" | compressed %v", c[:min(len(c), 2*n)])
			if len(c) > 2*n {
				s = s[:len(s)-1] + fmt.Sprintf(" …] (%d)", len(c))
			}
		}
		return s
	}
	return valuesStr(t, 0, n)
}

// valuesStr prints the first n values (the start of the first row for
// matrices) and the RMS of a float tensor, or the first entries of an index list.
func valuesStr(t Tensor, off, n int) string {
	if !t.Kind.IsFloat() {
		if len(t.I) == 0 {
			return "(empty)"
		}
		k := min(len(t.I), 2*n)
		s := fmt.Sprint(t.I[:k])
		if k < len(t.I) {
			s = s[:len(s)-1] + fmt.Sprintf(" … %v] (%d entries)", t.I[len(t.I)-1], len(t.I))
		}
		return s
	}
	if len(t.F) == 0 {
		return "(empty)"
	}
	var ss float64
	for _, v := range t.F {
		ss += float64(v) * float64(v)
	}
	k := min(len(t.F)-off, n)
	parts := make([]string, k)
	for i := range parts {
		parts[i] = fmt.Sprintf("%.5g", t.F[off+i])
	}
	more := ""
	if off+k < len(t.F) {
		more = " …"
	}
	return fmt.Sprintf("[%s%s]  rms %.4g", strings.Join(parts, " "), more, math.Sqrt(ss/float64(len(t.F))))
}
