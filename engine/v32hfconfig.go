package engine

import (
	"encoding/json"
	"fmt"
	"strings"

	"sparsemla/userfile"
)

// A Hugging Face transformers DeepSeek-V3.2 config.json (model_type
// deepseek_v32, DeepseekV32Config) is converted to the V3.2 ModelArgs
// before parsing (parseV32Config), key for key:
//
//	hidden_size → dim, intermediate_size → inter_dim, moe_intermediate_size → moe_inter_dim,
//	num_hidden_layers → n_layers, first_k_dense_replace → n_dense_layers,
//	num_attention_heads → n_heads, num_experts_per_tok → n_activated_experts,
//	n_group → n_expert_groups, topk_group → n_limited_groups,
//	scoring_func → score_func (absent: sigmoid, transformers' V3 gate),
//	routed_scaling_factor → route_scale, max_position_embeddings → max_seq_len,
//	vocab_size, n_routed_experts, n_shared_experts, q_lora_rank, kv_lora_rank,
//	qk_nope_head_dim, qk_rope_head_dim, v_head_dim, index_n_heads,
//	index_head_dim, index_topk: the same names;
//	rope_parameters (or the older rope_scaling) and rope_theta: rope_theta,
//	  YaRN factor → rope_factor, original_max_position_embeddings →
//	  original_seq_len, beta_fast, beta_slow, mscale_all_dim → mscale
//	  (transformers scales the softmax by mscale_all_dim² and the cos/sin by
//	  get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim): the
//	  official code has only the first, so mscale must equal mscale_all_dim);
//	  no YaRN: original_seq_len = max_seq_len, rope_factor 1;
//	quantization_config → dtype fp8 (fmt e4m3, weight_block_size [128, 128],
//	  its scale_fmt, default ue8m0); none → dtype bf16.
//
// Values model.py fixes and a config cannot change are checked: rms_norm_eps
// must be 1e-6 (the RMSNorm eps of model.py), norm_topk_prob true (the
// sigmoid gate normalises), topk_method noaux_tc where given. Other keys
// (token ids, torch_dtype, …) are ignored; a needed key that is missing is
// an error naming it.

// isV32HFConfig reports whether b is a transformers DeepSeek-V3.2 config.
func isV32HFConfig(b []byte) bool {
	var v struct {
		ModelType     string   `json:"model_type"`
		Architectures []string `json:"architectures"`
	}
	if json.Unmarshal(b, &v) != nil {
		return false
	}
	return v.ModelType == "deepseek_v32" || len(v.Architectures) > 0 && strings.HasPrefix(v.Architectures[0], "DeepseekV32")
}

type v32HFRope struct {
	Type       string   `json:"type"`
	RopeType   string   `json:"rope_type"`
	RopeTheta  *float64 `json:"rope_theta"`
	Factor     *float64 `json:"factor"`
	OrigMaxPos *int     `json:"original_max_position_embeddings"`
	BetaFast   *float64 `json:"beta_fast"`
	BetaSlow   *float64 `json:"beta_slow"`
	Mscale     *float64 `json:"mscale"`
	MscaleAll  *float64 `json:"mscale_all_dim"`
}

// v32ModelArgsFromHF converts a transformers DeepseekV32Config JSON to the
// V3.2 ModelArgs JSON (see above).
func v32ModelArgsFromHF(b []byte) ([]byte, error) {
	var c struct {
		ScoringFunc *string          `json:"scoring_func"`
		RouteScale  *float64         `json:"routed_scaling_factor"`
		RMSNormEps  *float64         `json:"rms_norm_eps"`
		NormTopK    *bool            `json:"norm_topk_prob"`
		TopKMethod  *string          `json:"topk_method"`
		RopeTheta   *float64         `json:"rope_theta"`
		RopeParams  *v32HFRope       `json:"rope_parameters"`
		RopeScaling *v32HFRope       `json:"rope_scaling"`
		Quant       *json.RawMessage `json:"quantization_config"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("engine: hf config: %w", userfile.JSONError(err))
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("engine: hf config: %w", userfile.JSONError(err))
	}
	out := map[string]any{"max_batch_size": 1}
	var missing []string
	for _, k := range []struct{ hf, ma string }{
		{"vocab_size", "vocab_size"}, {"hidden_size", "dim"}, {"intermediate_size", "inter_dim"},
		{"moe_intermediate_size", "moe_inter_dim"}, {"num_hidden_layers", "n_layers"}, {"first_k_dense_replace", "n_dense_layers"},
		{"num_attention_heads", "n_heads"}, {"n_routed_experts", "n_routed_experts"}, {"n_shared_experts", "n_shared_experts"},
		{"num_experts_per_tok", "n_activated_experts"}, {"n_group", "n_expert_groups"}, {"topk_group", "n_limited_groups"},
		{"q_lora_rank", "q_lora_rank"}, {"kv_lora_rank", "kv_lora_rank"}, {"qk_nope_head_dim", "qk_nope_head_dim"},
		{"qk_rope_head_dim", "qk_rope_head_dim"}, {"v_head_dim", "v_head_dim"}, {"index_n_heads", "index_n_heads"},
		{"index_head_dim", "index_head_dim"}, {"index_topk", "index_topk"}, {"max_position_embeddings", "max_seq_len"},
	} {
		v, ok := raw[k.hf]
		if !ok || string(v) == "null" {
			missing = append(missing, k.hf)
			continue
		}
		var n int
		if err := json.Unmarshal(v, &n); err != nil {
			return nil, fmt.Errorf("engine: hf config: %s: %w", k.hf, userfile.JSONError(err))
		}
		out[k.ma] = n
	}
	out["score_func"] = "sigmoid"
	if c.ScoringFunc != nil {
		out["score_func"] = *c.ScoringFunc
	}
	if c.RouteScale == nil {
		missing = append(missing, "routed_scaling_factor")
	} else {
		out["route_scale"] = *c.RouteScale
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("engine: hf config (deepseek_v32): missing %s", strings.Join(missing, ", "))
	}
	if c.RMSNormEps != nil && *c.RMSNormEps != 1e-6 {
		return nil, fmt.Errorf("engine: hf config (deepseek_v32): rms_norm_eps = %g; model.py's RMSNorm eps is 1e-6 (not a ModelArgs key)", *c.RMSNormEps)
	}
	if c.NormTopK != nil && !*c.NormTopK {
		return nil, fmt.Errorf("engine: hf config (deepseek_v32): norm_topk_prob false; the official sigmoid gate divides the chosen weights by their sum")
	}
	if c.TopKMethod != nil && *c.TopKMethod != "noaux_tc" {
		return nil, fmt.Errorf("engine: hf config (deepseek_v32): topk_method %q; the official gate is noaux_tc (score + bias, groups by their top-2 sum)", *c.TopKMethod)
	}
	rope := c.RopeParams
	if rope == nil {
		rope = c.RopeScaling
	}
	theta := c.RopeTheta
	if rope != nil && rope.RopeTheta != nil {
		theta = rope.RopeTheta
	}
	if theta == nil {
		return nil, fmt.Errorf("engine: hf config (deepseek_v32): missing rope_theta")
	}
	out["rope_theta"] = *theta
	kind := ""
	if rope != nil {
		kind = rope.RopeType
		if kind == "" {
			kind = rope.Type
		}
	}
	switch kind {
	case "", "default":
		out["original_seq_len"], out["rope_factor"] = out["max_seq_len"], 1
	case "yarn":
		if rope.Factor == nil || rope.OrigMaxPos == nil {
			return nil, fmt.Errorf("engine: hf config (deepseek_v32): YaRN rope needs factor and original_max_position_embeddings")
		}
		out["rope_factor"], out["original_seq_len"] = *rope.Factor, *rope.OrigMaxPos
		if rope.BetaFast != nil {
			out["beta_fast"] = *rope.BetaFast
		}
		if rope.BetaSlow != nil {
			out["beta_slow"] = *rope.BetaSlow
		}
		ms, all := 1.0, 0.0
		if rope.Mscale != nil {
			ms = *rope.Mscale
		}
		if rope.MscaleAll != nil {
			all = *rope.MscaleAll
		}
		if ms != all {
			return nil, fmt.Errorf("engine: hf config (deepseek_v32): YaRN mscale %g ≠ mscale_all_dim %g: transformers then scales cos/sin by their ratio, which model.py does not (its softmax scale takes one mscale)", ms, all)
		}
		out["mscale"] = all
	default:
		return nil, fmt.Errorf("engine: hf config (deepseek_v32): rope type %q; model.py implements YaRN (or none)", kind)
	}
	out["dtype"], out["scale_fmt"] = "bf16", "ue8m0"
	if c.Quant != nil && string(*c.Quant) != "null" {
		var q struct {
			Fmt      string `json:"fmt"`
			Block    []int  `json:"weight_block_size"`
			ScaleFmt string `json:"scale_fmt"`
		}
		if err := json.Unmarshal(*c.Quant, &q); err != nil {
			return nil, fmt.Errorf("engine: hf config (deepseek_v32): quantization_config: %w", userfile.JSONError(err))
		}
		if q.Fmt != "" && q.Fmt != "e4m3" || len(q.Block) != 0 && (len(q.Block) != 2 || q.Block[0] != 128 || q.Block[1] != 128) {
			return nil, fmt.Errorf("engine: hf config (deepseek_v32): quantization_config fmt %q, weight_block_size %v; the reference implements E4M3 weights in 128×128 blocks", q.Fmt, q.Block)
		}
		out["dtype"] = "fp8"
		if q.ScaleFmt != "" {
			out["scale_fmt"] = q.ScaleFmt
		}
	}
	ma, err := json.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("engine: hf config: %w", err)
	}
	return ma, nil
}
