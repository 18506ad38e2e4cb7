package engine

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"

	"sparsemla/attention"
	"sparsemla/userfile"
)

// V3.2 (DeepSeek-V3.2-Exp, "DSA") configuration. The official ModelArgs
// (deepseek-ai/DeepSeek-V3.2-Exp inference/model.py, cited as V32-M:<line>)
// has MLA keys (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
// v_head_dim), V3 MoE keys (inter_dim, n_dense_layers, n_expert_groups,
// n_limited_groups) and the indexer keys, and no compress_ratios / window /
// mHC keys. A config is a V3.2 one when kv_lora_rank > 0 (Config.V32).
//
// Shapes of one V3.2 layer (671B config; v32-tiny in parentheses):
//
//	x, y          [dim]                         7168 (256)
//	q_a, qr       [q_lora_rank]                 1536 (128)
//	q             [H, qk_nope + qk_rope]        [128, 192] ([4, 192])
//	kv_a          [kv_lora_rank + qk_rope]      576
//	kv_cache      [T, kv_lora_rank + qk_rope]   T = p + 1 tokens: latent 512 | k_pe 64
//	o             [H, v_head_dim]               [128, 128] ([4, 128])
//	indexer       index_n_heads × index_head_dim = 64 × 128 (4 × 128), top 2048 (16)

// v32Defaults are the V3.2 ModelArgs dataclass defaults (V32-M:55-92) with
// dtype and scale_fmt as the official config_671B_v3.2.json sets them.
func v32Defaults() Config {
	return Config{
		MaxBatchSize: 8, MaxSeqLen: 4096 * 4, DType: "fp8", ScaleFmt: "ue8m0",
		VocabSize: 102400, Dim: 2048, InterDim: 10944, MoEInterDim: 1408, NLayers: 27, NDenseLayers: 1, NHeads: 16,
		NRoutedExperts: 64, NSharedExperts: 2, NActivatedExperts: 6, NExpertGroups: 1, NLimitedGroups: 1,
		ScoreFunc: "softmax", RouteScale: 1,
		QLoraRank: 0, KVLoraRank: 512, QKNopeHeadDim: 128, QKRopeHeadDim: 64, VHeadDim: 128,
		OriginalSeqLen: 4096, RopeTheta: 10000, RopeFactor: 40, BetaFast: 32, BetaSlow: 1, Mscale: 1,
		IndexNHeads: 64, IndexHeadDim: 128, IndexTopK: 2048,
		NormEps: 1e-6, // RMSNorm / LayerNorm eps of model.py (not a ModelArgs key)
	}
}

// v32Keys are the keys of the V3.2 ModelArgs, the only ones a V3.2
// config.json may hold.
var v32Keys = map[string]bool{
	"max_batch_size": true, "max_seq_len": true, "dtype": true, "scale_fmt": true, "vocab_size": true,
	"dim": true, "inter_dim": true, "moe_inter_dim": true, "n_layers": true, "n_dense_layers": true, "n_heads": true,
	"n_routed_experts": true, "n_shared_experts": true, "n_activated_experts": true, "n_expert_groups": true,
	"n_limited_groups": true, "score_func": true, "route_scale": true, "q_lora_rank": true, "kv_lora_rank": true,
	"qk_nope_head_dim": true, "qk_rope_head_dim": true, "v_head_dim": true, "original_seq_len": true,
	"rope_theta": true, "rope_factor": true, "beta_fast": true, "beta_slow": true, "mscale": true,
	"index_n_heads": true, "index_head_dim": true, "index_topk": true,
}

// isV32JSON reports whether b is a V3.2 ModelArgs JSON: it has kv_lora_rank
// and no compress_ratios (V4 configs have compress_ratios and no MLA keys).
func isV32JSON(b []byte) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(b, &m) != nil {
		return false
	}
	_, mla := m["kv_lora_rank"]
	_, v4 := m["compress_ratios"]
	return mla && !v4
}

// parseV32Config decodes a V3.2 ModelArgs JSON: keys outside the V3.2
// ModelArgs are an error, missing keys take its defaults. A transformers
// deepseek_v32 config.json is converted first (v32ModelArgsFromHF).
func parseV32Config(b []byte) (*Config, error) {
	if isV32HFConfig(b) {
		ma, err := v32ModelArgsFromHF(b)
		if err != nil {
			return nil, err
		}
		b = ma
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("engine: config: %w", userfile.JSONError(err))
	}
	var unknown []string
	for k := range m {
		if !v32Keys[k] {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		names := unknown[:min(len(unknown), 8)]
		for i, k := range names {
			names[i] = userfile.Clip(k)
		}
		list := strings.Join(names, ", ")
		if len(unknown) > len(names) {
			list += fmt.Sprintf(", … (%d keys)", len(unknown))
		}
		return nil, fmt.Errorf("engine: config: V3.2 config (kv_lora_rank, no compress_ratios) has keys the V3.2 ModelArgs does not: %s", list)
	}
	c := v32Defaults()
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("engine: config: %w", userfile.JSONError(err))
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// V32 reports whether the config is a DeepSeek-V3.2 (DSA) model: MLA with a
// latent KV cache and the lightning indexer over the whole context
// (kv_lora_rank > 0). Its stages are V32Stages.
func (c *Config) V32() bool { return c.KVLoraRank > 0 }

// Variant names the model family: "v3.2", "v4.1" or "v4".
func (c *Config) Variant() string {
	if c.V32() {
		return "v3.2"
	}
	if c.IsV41() {
		return "v4.1"
	}
	return "v4"
}

// V32QKHeadDim is qk_nope_head_dim + qk_rope_head_dim (192).
func (c *Config) V32QKHeadDim() int { return c.QKNopeHeadDim + c.QKRopeHeadDim }

// V32KVDim is the width of one latent cache row, kv_lora_rank +
// qk_rope_head_dim (576 = 512 latent + 64 k_pe).
func (c *Config) V32KVDim() int { return c.KVLoraRank + c.QKRopeHeadDim }

// V32YaRN reports whether precompute_freqs_cis applies YaRN (V32-M:395):
// max_seq_len > original_seq_len. The same test scales the softmax by mscale².
func (c *Config) V32YaRN() bool { return c.MaxSeqLen > c.OriginalSeqLen }

// V32SoftmaxScale is MLA's softmax_scale (V32-M:530-533), in float64 as
// Python computes it and rounded once to fp32 where the fp32 scores are
// multiplied by it:
//
//	τ = qk_head_dim^-0.5                                  (192^-0.5)
//	YaRN: m = 0.1·mscale·ln(rope_factor) + 1;  τ = τ·m·m
func (c *Config) V32SoftmaxScale() float32 {
	s := math.Pow(float64(c.V32QKHeadDim()), -0.5)
	if c.V32YaRN() {
		m := 0.1*c.Mscale*math.Log(c.RopeFactor) + 1
		s = s * m * m
	}
	return float32(s)
}

// V32IndexSoftmaxScale is the indexer's softmax_scale, index_head_dim^-0.5
// (V32-M:443), and V32IndexHeadScale its head factor index_n_heads^-0.5
// (V32-M:470); both multiply tensors as Python floats, rounded to the
// tensor's dtype's compute precision (fp32).
func (c *Config) V32IndexSoftmaxScale() float32 {
	return float32(math.Pow(float64(c.IndexHeadDim), -0.5))
}

// V32IndexHeadScale is f32(index_n_heads^-0.5).
func (c *Config) V32IndexHeadScale() float32 { return float32(math.Pow(float64(c.IndexNHeads), -0.5)) }

// v32RopeParams: one table for every layer, base rope_theta over the 64
// qk_rope dims, YaRN when max_seq_len > original_seq_len (V32-M:353-403).
func (c *Config) v32RopeParams() attention.RopeParams {
	p := attention.RopeParams{Base: c.RopeTheta, Factor: c.RopeFactor, BetaFast: c.BetaFast, BetaSlow: c.BetaSlow}
	if c.V32YaRN() {
		p.OriginalSeqLen = c.OriginalSeqLen
	}
	return p
}

// validateV32 checks every value the V3.2 attention path relies on.
func (c *Config) validateV32() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	for _, kv := range []struct {
		name string
		v    int
	}{{"dim", c.Dim}, {"n_layers", c.NLayers}, {"n_heads", c.NHeads}, {"q_lora_rank", c.QLoraRank},
		{"kv_lora_rank", c.KVLoraRank}, {"qk_nope_head_dim", c.QKNopeHeadDim}, {"v_head_dim", c.VHeadDim},
		{"max_seq_len", c.MaxSeqLen}, {"index_n_heads", c.IndexNHeads}, {"index_topk", c.IndexTopK}} {
		if kv.v <= 0 {
			bad("%s = %d must be positive (q_lora_rank = 0, no query LoRA, is not implemented)", kv.name, kv.v)
		}
	}
	if c.QKRopeHeadDim != attention.RopeDims {
		bad("qk_rope_head_dim = %d: the reference implements 64 rotated dims", c.QKRopeHeadDim)
	}
	if c.IndexHeadDim != 128 {
		bad("index_head_dim = %d: the indexer's Hadamard and its one FP8 block per head need 128", c.IndexHeadDim)
	}
	for _, kv := range []struct {
		name string
		v    int
	}{{"dim", c.Dim}, {"q_lora_rank", c.QLoraRank}, {"kv_lora_rank", c.KVLoraRank}, {"n_heads*v_head_dim", c.NHeads * c.VHeadDim}} {
		if kv.v > 0 && kv.v%attention.ActBlock != 0 {
			bad("%s = %d must be a multiple of 128 (FP8 activation blocks)", kv.name, kv.v)
		}
	}
	if c.DType != "fp8" {
		bad("dtype = %q: the V3.2 reference implements the FP8 checkpoint (\"fp8\")", c.DType)
	}
	if c.ScaleFmt != "ue8m0" {
		bad("scale_fmt = %q: the reference implements power-of-two scales (\"ue8m0\", config_671B_v3.2.json)", c.ScaleFmt)
	}
	if c.RopeTheta <= 0 {
		bad("rope_theta = %g must be positive", c.RopeTheta)
	}
	if c.V32YaRN() && (c.RopeFactor <= 0 || c.BetaFast <= 0 || c.BetaSlow <= 0 || c.OriginalSeqLen <= 0) {
		bad("YaRN (max_seq_len > original_seq_len) needs positive rope_factor, beta_fast, beta_slow, original_seq_len")
	}
	if len(c.CompressRatios) > 0 {
		bad("compress_ratios is a V4 key; a V3.2 config (kv_lora_rank > 0) has none")
	}
	if len(errs) > 0 {
		return fmt.Errorf("engine: invalid V3.2 config: %w", errors.Join(errs...))
	}
	return nil
}

// v32Preset returns "v32" (config_671B_v3.2.json over the ModelArgs
// defaults: YaRN on, since max_seq_len 16384 > original_seq_len 4096) or
// "v32-tiny" (the GPU golden's tiny random config, testdata/v32-tiny: two
// layers, 4 heads, 4 indexer heads, top-16, YaRN on) or "v32-tiny-grouped"
// (v32-tiny with 8 routed experts in 4 groups of which the router keeps 1:
// a small model whose router has a group limit, as the 671B router keeps 4
// of 8, and whose synthetic gate has a bias, V32SynthGateBias, so that the
// router-groups-ignored and router-bias faults apply to it).
func v32Preset(name string) *Config {
	c := v32Defaults()
	switch name {
	case "v32":
		c.VocabSize, c.Dim, c.InterDim, c.MoEInterDim, c.NLayers, c.NDenseLayers, c.NHeads = 129280, 7168, 18432, 2048, 61, 3, 128
		c.NRoutedExperts, c.NSharedExperts, c.NActivatedExperts, c.NExpertGroups, c.NLimitedGroups = 256, 1, 8, 8, 4
		c.RouteScale, c.ScoreFunc, c.QLoraRank = 2.5, "sigmoid", 1536
		c.IndexNHeads, c.IndexHeadDim, c.IndexTopK = 64, 128, 2048
	case "v32-tiny", "v32-tiny-grouped":
		c.MaxBatchSize, c.MaxSeqLen, c.OriginalSeqLen = 1, 512, 128
		c.VocabSize, c.Dim, c.InterDim, c.MoEInterDim, c.NLayers, c.NDenseLayers, c.NHeads = 512, 256, 256, 128, 2, 1, 4
		c.NRoutedExperts, c.NSharedExperts, c.NActivatedExperts, c.NExpertGroups, c.NLimitedGroups = 4, 1, 2, 1, 1
		c.RouteScale, c.ScoreFunc, c.QLoraRank = 2.5, "sigmoid", 128
		c.IndexNHeads, c.IndexHeadDim, c.IndexTopK = 4, 128, 16
		if name == "v32-tiny-grouped" {
			c.NRoutedExperts, c.NExpertGroups, c.NLimitedGroups = 8, 4, 1
		}
	}
	if err := c.Validate(); err != nil {
		panic("engine: built-in preset " + name + " is invalid: " + err.Error())
	}
	return &c
}

// MarshalJSON writes a V4 config with every field (as before) and a V3.2
// config with every V3.2 ModelArgs key and no other, so that it parses back
// as the same V3.2 config. The V3.2 keys that a V4 config omits when zero
// (omitempty) are written even when zero: their V3.2 defaults are not zero
// (n_limited_groups = 0 must not come back as the default 1).
func (c Config) MarshalJSON() ([]byte, error) {
	type plain Config
	b, err := json.Marshal(plain(c))
	if err != nil || !c.V32() {
		return b, err
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, userfile.JSONError(err)
	}
	for k := range m {
		if !v32Keys[k] {
			delete(m, k)
		}
	}
	for k, v := range map[string]any{
		"inter_dim": c.InterDim, "n_dense_layers": c.NDenseLayers, "n_expert_groups": c.NExpertGroups,
		"n_limited_groups": c.NLimitedGroups, "kv_lora_rank": c.KVLoraRank, "qk_nope_head_dim": c.QKNopeHeadDim,
		"qk_rope_head_dim": c.QKRopeHeadDim, "v_head_dim": c.VHeadDim, "mscale": c.Mscale,
	} {
		if m[k], err = json.Marshal(v); err != nil {
			return nil, err
		}
	}
	return json.Marshal(m)
}
