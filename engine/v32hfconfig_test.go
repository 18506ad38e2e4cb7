package engine

import (
	"reflect"
	"strings"
	"testing"
)

// v32TinyHF is the v32-tiny preset as a transformers DeepseekV32Config
// config.json, with the keys capture/golden/v32_hf_compare.py passed to
// transformers 5.17 for the same model (rope_parameters, YaRN with
// mscale_all_dim = mscale), plus the keys a saved config carries besides.
const v32TinyHF = `{
  "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
  "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 128,
  "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
  "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
  "q_lora_rank": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
  "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": true,
  "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "index_topk": 16, "index_head_dim": 128,
  "index_n_heads": 4, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
  "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000, "factor": 40.0,
    "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
}`

// TestV32HFConfig: a transformers deepseek_v32 config.json parses to the
// same Config as the V3.2 ModelArgs it describes (the v32-tiny preset; the
// 671B shape with the older rope_scaling key); values model.py fixes are
// checked, and a missing key is named.
func TestV32HFConfig(t *testing.T) {
	got, err := ParseConfig([]byte(v32TinyHF))
	if err != nil {
		t.Fatal(err)
	}
	want, _ := Preset("v32-tiny")
	w := *want
	w.MaxBatchSize = 1
	if !reflect.DeepEqual(*got, w) {
		t.Fatalf("HF v32-tiny:\n got %+v\nwant %+v", *got, w)
	}
	big := strings.NewReplacer(`"vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 128`,
		`"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048`,
		`"num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4`,
		`"num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128`,
		`"n_routed_experts": 4`, `"n_routed_experts": 256`, `"q_lora_rank": 128`, `"q_lora_rank": 1536`,
		`"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2`, `"n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "scoring_func": "sigmoid", "topk_method": "noaux_tc"`,
		`"max_position_embeddings": 512`, `"max_position_embeddings": 16384`,
		`"index_topk": 16`, `"index_topk": 2048`, `"index_n_heads": 4`, `"index_n_heads": 64`,
		`"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000,`, `"rope_theta": 10000, "rope_scaling": {"type": "yarn",`,
		`"original_max_position_embeddings": 128`, `"original_max_position_embeddings": 4096`).Replace(v32TinyHF)
	got, err = ParseConfig([]byte(big))
	if err != nil {
		t.Fatal(err)
	}
	want, _ = Preset("v32")
	w = *want
	w.MaxBatchSize = 1
	if !reflect.DeepEqual(*got, w) {
		t.Fatalf("HF 671B:\n got %+v\nwant %+v", *got, w)
	}
	for _, c := range []struct{ from, to, err string }{
		{`"rms_norm_eps": 1e-06`, `"rms_norm_eps": 1e-05`, "rms_norm_eps"},
		{`"norm_topk_prob": true`, `"norm_topk_prob": false`, "norm_topk_prob"},
		{`"mscale_all_dim": 1.0`, `"mscale_all_dim": 0.707`, "mscale_all_dim"},
		{`"index_topk": 16, `, ``, "missing index_topk"},
		{`"weight_block_size": [128, 128]`, `"weight_block_size": [64, 64]`, "128×128"},
		{`"rope_type": "yarn"`, `"rope_type": "llama3"`, "rope type"},
	} {
		b := strings.Replace(v32TinyHF, c.from, c.to, 1)
		if _, err := ParseConfig([]byte(b)); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%s → %s: %v, want an error naming %q", c.from, c.to, err, c.err)
		}
	}
}
