package engine

import (
	"strings"
	"testing"
)

// officialV41ModelArgs is every field of the official V4.1 inference
// ModelArgs (model.py at dba1be0a) with its default value, as a config.json
// written from it holds them.
const officialV41ModelArgs = `{"max_batch_size":4,"max_seq_len":4096,"temperature":1,"dtype":"fp8","expert_dtype":"fp4","vocab_size":129280,"dim":1024,"moe_inter_dim":1024,"n_layers":5,"n_mtp_layers":1,"n_heads":16,"n_routed_experts":8,"n_shared_experts":1,"n_activated_experts":2,"score_func":"sqrtsoftplus","gate_temp":1.0,"norm_topk_prob":true,"route_scale":1.0,"swiglu_limit":0.0,"q_lora_rank":256,"head_dim":128,"rope_head_dim":32,"norm_eps":1e-20,"o_groups":8,"o_lora_rank":256,"window_size":128,"compress_ratios":[0,2,2,1,1,0],"kv_source_layers":[1,3],"index_source_layers":[1,3],"compress_rope_theta":40000.0,"original_seq_len":0,"rope_theta":10000.0,"rope_factor":40,"beta_fast":32,"beta_slow":1,"index_n_heads":16,"index_head_dim":64,"index_topk":64,"candidate_source_layer":-1,"candidate_topk_blocks":0,"candidate_block_size":0,"hc_mult":4,"hc_sinkhorn_iters":20,"hc_eps":1e-6,"engram_layer_ids":[],"engram_num_embeddings":[],"engram_max_ngram_size":1,"engram_vocab_size":0,"engram_n_heads":0,"engram_head_dim":0,"engram_pad_id":2,"engram_compressed_vocab_size":0,"vision_n_layers":0,"vision_dim":1024,"vision_n_heads":16,"vision_inter_dim":2816,"vision_patch_size":14,"vision_rope_theta":10000.0,"vision_downsample_ratio":3,"vision_max_n_token":1024,"vision_min_pixels":295936,"vision_max_wh_ratio":null,"image_token_id":129264,"dspark_block_size":0,"dspark_noise_token_id":0,"dspark_target_layer_ids":[],"dspark_markov_rank":256,"dspark_n_routed_experts":0,"dspark_n_activated_experts":0}`

// TestV41ConfigOfficialKeys: a config.json carrying every ModelArgs key of
// the official V4.1 code (the ViT's shape keys included) is read, not
// refused as holding unknown keys. (The defaults are model.py's small demo
// model, whose rope_head_dim 32 the reference does not implement: that is
// the error expected, about a value, not a key.)
func TestV41ConfigOfficialKeys(t *testing.T) {
	_, err := ParseConfig([]byte(officialV41ModelArgs))
	if err == nil || strings.Contains(err.Error(), "unknown field") || !strings.Contains(err.Error(), "rope_head_dim") {
		t.Fatalf("official V4.1 ModelArgs keys: %v, want only the rope_head_dim refusal", err)
	}
}
