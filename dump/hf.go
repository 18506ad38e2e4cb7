package dump

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"

	"sparsemla/userfile"
)

// Hugging Face transformers' DeepSeek-V4 (DeepseekV4ForCausalLM) names.
//
// Two spellings reach us: the module names of the in-memory model
// (state_dict(), forward hooks: model.layers.N.self_attn.q_a_proj.weight,
// ...self_attn.compressor.indexer.scorer.weights_proj, attn_hc.fn, ...), and
// the names save_pretrained writes (transformers 5.17 converts back to
// nearly the official names: model.layers.N.attn.wq_a.weight,
// model.layers.N.ffn.experts.E.w1.weight, ... but model.layers.N.attn.norm
// for kv_norm and model.hc_head.hc_fn for hc_head_fn). hfV4Rules maps both to
// the official model.py names; the rules are tried in order, first match wins.
var hfV4Rules = []struct {
	re   *regexp.Regexp
	repl string
}{
	// module names (state_dict / hooks)
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.`), "layers.$1.attn.indexer.weights_proj."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.indexer\.q_b_proj\.`), "layers.$1.attn.indexer.wq_b."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.indexer\.kv_proj\.`), "layers.$1.attn.indexer.compressor.wkv."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.indexer\.gate_proj\.`), "layers.$1.attn.indexer.compressor.wgate."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.indexer\.kv_norm\.`), "layers.$1.attn.indexer.compressor.norm."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.indexer\.position_bias$`), "layers.$1.attn.indexer.compressor.ape"},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.kv_proj\.`), "layers.$1.attn.compressor.wkv."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.gate_proj\.`), "layers.$1.attn.compressor.wgate."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.kv_norm\.`), "layers.$1.attn.compressor.norm."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.compressor\.position_bias$`), "layers.$1.attn.compressor.ape"},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.q_a_norm\.`), "layers.$1.attn.q_norm."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.kv_proj\.`), "layers.$1.attn.wkv."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.kv_norm\.`), "layers.$1.attn.kv_norm."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.o_a_proj\.`), "layers.$1.attn.wo_a."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.o_b_proj\.`), "layers.$1.attn.wo_b."},
	{regexp.MustCompile(`^layers\.(\d+)\.self_attn\.sinks$`), "layers.$1.attn.attn_sink"},
	{regexp.MustCompile(`^layers\.(\d+)\.(attn|ffn)_hc\.(fn|base|scale)$`), "layers.$1.hc_${2}_$3"},
	{regexp.MustCompile(`^layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$`), "layers.$1.ffn.gate.bias"},
	{regexp.MustCompile(`^layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.`), "layers.$1.ffn.shared_experts.w1."},
	{regexp.MustCompile(`^layers\.(\d+)\.mlp\.shared_experts\.up_proj\.`), "layers.$1.ffn.shared_experts.w3."},
	{regexp.MustCompile(`^layers\.(\d+)\.mlp\.shared_experts\.down_proj\.`), "layers.$1.ffn.shared_experts.w2."},
	// packed routed experts of the in-memory model ([E, 2I, dim] / [E, dim, I]): no official
	// single tensor; named so that they never collide with one
	{regexp.MustCompile(`^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$`), "layers.$1.ffn.experts.hf_packed_$2"},
	{regexp.MustCompile(`^hc_head\.hc_(fn|base|scale)$`), "hc_head_$1"},
	// save_pretrained names
	{regexp.MustCompile(`^layers\.(\d+)\.attn\.norm\.`), "layers.$1.attn.kv_norm."},
}

// hfV4Name maps a Hugging Face DeepSeek-V4 name (without "model.") to the
// official one, if a V4 rule applies.
func hfV4Name(name string) (string, bool) {
	for _, r := range hfV4Rules {
		if r.re.MatchString(name) {
			return r.re.ReplaceAllString(name, r.repl), true
		}
	}
	return "", false
}

// hfConfig is the part of a transformers DeepseekV4Config (config.json)
// that ModelArgs needs.
type hfConfig struct {
	ModelType           string            `json:"model_type"`
	VocabSize           *int              `json:"vocab_size"`
	HiddenSize          *int              `json:"hidden_size"`
	MoEInter            *int              `json:"moe_intermediate_size"`
	Layers              *int              `json:"num_hidden_layers"`
	Heads               *int              `json:"num_attention_heads"`
	KVHeads             *int              `json:"num_key_value_heads"`
	HeadDim             *int              `json:"head_dim"`
	QLoraRank           *int              `json:"q_lora_rank"`
	ExpertsPerTok       *int              `json:"num_experts_per_tok"`
	RoutedExperts       *int              `json:"n_routed_experts"`
	SharedExperts       *int              `json:"n_shared_experts"`
	ScoringFunc         *string           `json:"scoring_func"`
	RoutedScaling       *float64          `json:"routed_scaling_factor"`
	MaxPos              *int              `json:"max_position_embeddings"`
	RopeTheta           *float64          `json:"rope_theta"`
	LayerTypes          []string          `json:"layer_types"`
	CompressRates       map[string]int    `json:"compress_rates"`
	CompressRopeTheta   *float64          `json:"compress_rope_theta"`
	HCMult              *int              `json:"hc_mult"`
	HCSinkhornIters     *int              `json:"hc_sinkhorn_iters"`
	HCEps               *float64          `json:"hc_eps"`
	MLPLayerTypes       []string          `json:"mlp_layer_types"`
	SwigluLimit         *float64          `json:"swiglu_limit"`
	SlidingWindow       *int              `json:"sliding_window"`
	OGroups             *int              `json:"o_groups"`
	OLoraRank           *int              `json:"o_lora_rank"`
	IndexHeads          *int              `json:"index_n_heads"`
	IndexHeadDim        *int              `json:"index_head_dim"`
	IndexTopk           *int              `json:"index_topk"`
	NextN               *int              `json:"num_nextn_predict_layers"`
	RMSNormEps          *float64          `json:"rms_norm_eps"`
	QKRopeHeadDim       *int              `json:"qk_rope_head_dim"`
	PartialRotaryFactor *float64          `json:"partial_rotary_factor"`
	RopeParameters      map[string]hfRope `json:"rope_parameters"`
	DType               string            `json:"dtype"`
	TorchDType          string            `json:"torch_dtype"`
	Quantization        json.RawMessage   `json:"quantization_config"`
}

type hfRope struct {
	RopeType    string   `json:"rope_type"`
	RopeTheta   *float64 `json:"rope_theta"`
	Factor      *float64 `json:"factor"`
	OrigMaxPos  *int     `json:"original_max_position_embeddings"`
	BetaFast    *float64 `json:"beta_fast"`
	BetaSlow    *float64 `json:"beta_slow"`
	AttnFactor  *float64 `json:"attention_factor"`
	PartialRoPE *float64 `json:"partial_rotary_factor"`
}

// IsHFConfig reports whether a config.json is a transformers DeepSeek-V4 one.
func IsHFConfig(b []byte) bool {
	var v struct {
		ModelType     string   `json:"model_type"`
		Architectures []string `json:"architectures"`
	}
	if json.Unmarshal(b, &v) != nil {
		return false
	}
	return v.ModelType == "deepseek_v4" || len(v.Architectures) > 0 && strings.HasPrefix(v.Architectures[0], "DeepseekV4")
}

// ModelArgsFromHF converts a transformers DeepseekV4Config (config.json) to
// the official ModelArgs JSON (the fields of model.py's ModelArgs that the
// reference reads). The layer schedule comes from layer_types and
// compress_rates, the hash layers from mlp_layer_types (they must come
// first, as model.py requires), RoPE from rope_parameters.main / .compress
// (YaRN on the compress rope only). dtype is "bf16" unless the config has a
// quantization_config (then "fp8", the official checkpoint). A field the
// conversion needs but the config lacks is an error naming it.
func ModelArgsFromHF(b []byte) ([]byte, error) {
	var c hfConfig
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("dump: hf config: %w", userfile.JSONError(err))
	}
	if c.ModelType != "deepseek_v4" {
		return nil, fmt.Errorf("dump: hf config: model_type %s, want deepseek_v4", userfile.Quote(c.ModelType))
	}
	var missing []string
	geti := func(name string, p *int) int {
		if p == nil {
			missing = append(missing, name)
			return 0
		}
		return *p
	}
	getf := func(name string, p *float64, def float64, hasDef bool) float64 {
		if p == nil {
			if !hasDef {
				missing = append(missing, name)
			}
			return def
		}
		return *p
	}
	out := map[string]interface{}{}
	out["max_batch_size"] = 1
	out["max_seq_len"] = geti("max_position_embeddings", c.MaxPos)
	out["vocab_size"] = geti("vocab_size", c.VocabSize)
	out["dim"] = geti("hidden_size", c.HiddenSize)
	out["moe_inter_dim"] = geti("moe_intermediate_size", c.MoEInter)
	n := geti("num_hidden_layers", c.Layers)
	out["n_layers"] = n
	out["n_heads"] = geti("num_attention_heads", c.Heads)
	out["n_routed_experts"] = geti("n_routed_experts", c.RoutedExperts)
	out["n_shared_experts"] = geti("n_shared_experts", c.SharedExperts)
	out["n_activated_experts"] = geti("num_experts_per_tok", c.ExpertsPerTok)
	if c.ScoringFunc == nil {
		missing = append(missing, "scoring_func")
	} else {
		out["score_func"] = *c.ScoringFunc
	}
	out["route_scale"] = getf("routed_scaling_factor", c.RoutedScaling, 0, false)
	out["swiglu_limit"] = getf("swiglu_limit", c.SwigluLimit, 0, false)
	out["q_lora_rank"] = geti("q_lora_rank", c.QLoraRank)
	hd := geti("head_dim", c.HeadDim)
	out["head_dim"] = hd
	switch {
	case c.QKRopeHeadDim != nil:
		out["rope_head_dim"] = *c.QKRopeHeadDim
	case c.PartialRotaryFactor != nil:
		out["rope_head_dim"] = int(float64(hd)**c.PartialRotaryFactor + 0.5)
	default:
		missing = append(missing, "qk_rope_head_dim")
	}
	out["norm_eps"] = getf("rms_norm_eps", c.RMSNormEps, 0, false)
	out["o_groups"] = geti("o_groups", c.OGroups)
	out["o_lora_rank"] = geti("o_lora_rank", c.OLoraRank)
	out["window_size"] = geti("sliding_window", c.SlidingWindow)
	out["index_n_heads"] = geti("index_n_heads", c.IndexHeads)
	out["index_head_dim"] = geti("index_head_dim", c.IndexHeadDim)
	out["index_topk"] = geti("index_topk", c.IndexTopk)
	out["hc_mult"] = geti("hc_mult", c.HCMult)
	out["hc_sinkhorn_iters"] = geti("hc_sinkhorn_iters", c.HCSinkhornIters)
	out["hc_eps"] = getf("hc_eps", c.HCEps, 0, false)
	out["n_mtp_layers"] = 0
	if c.NextN != nil {
		out["n_mtp_layers"] = *c.NextN
	}
	if c.KVHeads != nil && *c.KVHeads != 1 {
		return nil, fmt.Errorf("dump: hf config: num_key_value_heads %d (V4 shares one KV head)", *c.KVHeads)
	}
	// layer schedule
	if len(c.LayerTypes) != n {
		return nil, fmt.Errorf("dump: hf config: %d layer_types for %d layers", len(c.LayerTypes), n)
	}
	ratios := make([]int, n)
	for i, t := range c.LayerTypes {
		switch t {
		case "sliding_attention":
			ratios[i] = 0
		case "compressed_sparse_attention", "heavily_compressed_attention":
			r, ok := c.CompressRates[t]
			if !ok {
				return nil, fmt.Errorf("dump: hf config: compress_rates has no %s", userfile.Quote(t))
			}
			ratios[i] = r
		default:
			return nil, fmt.Errorf("dump: hf config: layer_types[%d] = %s", i, userfile.Quote(t))
		}
	}
	out["compress_ratios"] = ratios
	hash := 0
	for i, t := range c.MLPLayerTypes {
		if t == "hash_moe" {
			if i != hash {
				return nil, fmt.Errorf("dump: hf config: mlp_layer_types[%d] is hash_moe after a moe layer (model.py puts the hash layers first)", i)
			}
			hash++
		}
	}
	if len(c.MLPLayerTypes) != n {
		return nil, fmt.Errorf("dump: hf config: %d mlp_layer_types for %d layers", len(c.MLPLayerTypes), n)
	}
	out["n_hash_layers"] = hash
	// RoPE
	main, cmp := c.RopeParameters["main"], c.RopeParameters["compress"]
	out["rope_theta"] = getf("rope_theta", firstF(main.RopeTheta, c.RopeTheta), 0, false)
	out["compress_rope_theta"] = getf("compress_rope_theta", firstF(cmp.RopeTheta, c.CompressRopeTheta), 0, false)
	if main.RopeType != "" && main.RopeType != "default" {
		return nil, fmt.Errorf("dump: hf config: rope_parameters.main.rope_type %s (the official model scales only the compress rope)", userfile.Quote(main.RopeType))
	}
	switch cmp.RopeType {
	case "yarn":
		if cmp.AttnFactor != nil && *cmp.AttnFactor != 1 {
			return nil, fmt.Errorf("dump: hf config: YaRN attention_factor %g (the official model uses no mscale)", *cmp.AttnFactor)
		}
		out["rope_factor"] = getf("rope_parameters.compress.factor", cmp.Factor, 0, false)
		out["original_seq_len"] = geti("rope_parameters.compress.original_max_position_embeddings", cmp.OrigMaxPos)
		out["beta_fast"] = getf("rope_parameters.compress.beta_fast", cmp.BetaFast, 32, true)
		out["beta_slow"] = getf("rope_parameters.compress.beta_slow", cmp.BetaSlow, 1, true)
	case "", "default":
		// no YaRN: model.py applies YaRN only when max_seq_len > original_seq_len
		out["rope_factor"] = 1.0
		out["original_seq_len"] = out["max_seq_len"]
		out["beta_fast"] = 32
		out["beta_slow"] = 1
	default:
		return nil, fmt.Errorf("dump: hf config: rope_parameters.compress.rope_type %s", userfile.Quote(cmp.RopeType))
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("dump: hf config: missing %s", strings.Join(missing, ", "))
	}
	q := bytes.TrimSpace(c.Quantization)
	if len(q) > 0 && string(q) != "null" {
		out["dtype"], out["scale_fmt"], out["expert_dtype"], out["scale_dtype"] = "fp8", "ue8m0", "fp4", "fp8"
	} else {
		out["dtype"] = "bf16"
	}
	return json.MarshalIndent(out, "", "  ")
}

func firstF(a, b *float64) *float64 {
	if a != nil {
		return a
	}
	return b
}

// configArgs returns the ModelArgs JSON of a dump directory's config file:
// itself, or converted from a transformers DeepSeek-V4 config.json (the raw
// HF config is kept in the header's user map as "hf_config").
func (d *Dump) configArgs(cfg []byte, path string) ([]byte, error) {
	if !IsHFConfig(cfg) {
		return cfg, nil
	}
	ma, err := ModelArgsFromHF(cfg)
	if err != nil {
		return nil, fmt.Errorf("%w (in %s)", err, path)
	}
	if d.Header.User == nil {
		d.Header.User = map[string]string{}
	}
	d.Header.User["hf_config"] = string(cfg)
	return ma, nil
}
