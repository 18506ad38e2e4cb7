package engine

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/userfile"
)

// Config is the model configuration, the official ModelArgs (R-M:34-80). The json
// tags equal the ModelArgs keys, so the official inference/config.json (and the
// golden's config.json) load directly. Fields the attention path does not use
// (MoE, vocabulary) are kept so a config round-trips.
type Config struct {
	MaxBatchSize int    `json:"max_batch_size"`
	MaxSeqLen    int    `json:"max_seq_len"` // cache sizing only
	DType        string `json:"dtype"`       // "fp8": FP8 E4M3 linears; "bf16": a bf16 checkpoint (BF16Checkpoint)
	ScaleFmt     string `json:"scale_fmt"`   // "ue8m0": power-of-two scales
	ExpertDType  string `json:"expert_dtype"`
	ScaleDType   string `json:"scale_dtype"`
	// Policy is the numerics policy (SetPolicy; "" = PolicyOfficial); not a
	// ModelArgs field.
	Policy      string `json:"-"`
	VocabSize   int    `json:"vocab_size"`
	Dim         int    `json:"dim"` // hidden size: width of the attention input x
	MoEInterDim int    `json:"moe_inter_dim"`
	NLayers     int    `json:"n_layers"`
	NHashLayers int    `json:"n_hash_layers"`
	NMTPLayers  int    `json:"n_mtp_layers"`
	NHeads      int    `json:"n_heads"` // query heads H (one shared KV head)

	NRoutedExperts    int     `json:"n_routed_experts"`
	NSharedExperts    int     `json:"n_shared_experts"`
	NActivatedExperts int     `json:"n_activated_experts"`
	ScoreFunc         string  `json:"score_func"`
	RouteScale        float64 `json:"route_scale"`
	SwigluLimit       float64 `json:"swiglu_limit"`

	QLoraRank   int     `json:"q_lora_rank"`   // wq_a output width
	HeadDim     int     `json:"head_dim"`      // 512 = 448 nope + 64 rope
	RopeHeadDim int     `json:"rope_head_dim"` // 64, the LAST dims of each head
	NormEps     float64 `json:"norm_eps"`
	OGroups     int     `json:"o_groups"`    // wo_a groups G
	OLoraRank   int     `json:"o_lora_rank"` // wo_a rank per group R
	WindowSize  int     `json:"window_size"` // sliding window (128)
	// CompressRatios[l] is layer l's r: 0 (SWA), 4 (CSA, indexer) or 128 (HCA).
	// It may carry extra trailing entries for MTP layers.
	CompressRatios []int `json:"compress_ratios"`

	CompressRopeTheta float64 `json:"compress_rope_theta"` // RoPE base of r > 0 layers
	OriginalSeqLen    int     `json:"original_seq_len"`    // YaRN (r > 0 layers only)
	RopeTheta         float64 `json:"rope_theta"`          // RoPE base of r = 0 layers
	RopeFactor        float64 `json:"rope_factor"`
	BetaFast          int     `json:"beta_fast"`
	BetaSlow          int     `json:"beta_slow"`

	IndexNHeads  int `json:"index_n_heads"`
	IndexHeadDim int `json:"index_head_dim"`
	IndexTopK    int `json:"index_topk"`

	HCMult          int     `json:"hc_mult"`
	HCSinkhornIters int     `json:"hc_sinkhorn_iters"`
	HCEps           float64 `json:"hc_eps"`

	// V41Args are the DeepSeek-V4.1 keys (engine/v41config.go; IsV41).
	V41Args
	// V3.2 (DSA) ModelArgs keys (engine/v32config.go); zero in a V4 config.
	// A config with kv_lora_rank > 0 is a V3.2 model (Config.V32).
	InterDim       int     `json:"inter_dim,omitempty"`
	NDenseLayers   int     `json:"n_dense_layers,omitempty"`
	NExpertGroups  int     `json:"n_expert_groups,omitempty"`
	NLimitedGroups int     `json:"n_limited_groups,omitempty"`
	KVLoraRank     int     `json:"kv_lora_rank,omitempty"`
	QKNopeHeadDim  int     `json:"qk_nope_head_dim,omitempty"`
	QKRopeHeadDim  int     `json:"qk_rope_head_dim,omitempty"`
	VHeadDim       int     `json:"v_head_dim,omitempty"`
	Mscale         float64 `json:"mscale,omitempty"`
}

// defaults returns the ModelArgs dataclass defaults (R-M:36-80) for the keys a
// config.json may omit.
func defaults() Config {
	return Config{
		MaxBatchSize: 4, MaxSeqLen: 4096, DType: "fp8", ScaleFmt: "ue8m0", ScaleDType: "fp8",
		VocabSize: 129280, Dim: 4096, MoEInterDim: 4096, NLayers: 7, NMTPLayers: 1, NHeads: 64,
		NRoutedExperts: 8, NSharedExperts: 1, NActivatedExperts: 2, ScoreFunc: "sqrtsoftplus",
		RouteScale: 1, QLoraRank: 1024, HeadDim: 512, RopeHeadDim: 64, NormEps: 1e-6,
		OGroups: 8, OLoraRank: 1024, WindowSize: 128, CompressRatios: []int{0, 0, 4, 128, 4, 128, 4, 0},
		CompressRopeTheta: 40000, RopeTheta: 10000, RopeFactor: 40, BetaFast: 32, BetaSlow: 1,
		IndexNHeads: 64, IndexHeadDim: 128, IndexTopK: 512, HCMult: 4, HCSinkhornIters: 20, HCEps: 1e-6,
	}
}

// ParseConfig decodes a ModelArgs JSON (unknown keys are an error, missing keys
// take the ModelArgs defaults) and validates it. A Hugging Face transformers
// DeepSeek-V4 config.json (model_type deepseek_v4) is converted first
// (dump.ModelArgsFromHF).
func ParseConfig(b []byte) (*Config, error) {
	if isV32JSON(b) {
		return parseV32Config(b)
	}
	if dump.IsHFConfig(b) {
		ma, err := dump.ModelArgsFromHF(b)
		if err != nil {
			return nil, fmt.Errorf("engine: config: %w", err)
		}
		b = ma
	}
	c := defaults()
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("engine: config: %w", userfile.JSONError(err))
	}
	c.V41Args.dropEmptyLists()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// LoadConfig reads and validates a ModelArgs JSON file (inference/config.json).
func LoadConfig(path string) (*Config, error) {
	// A regular file of at most 1 MiB (a ModelArgs JSON is a few KiB): a
	// FIFO, a device or a huge file is refused before it is read.
	b, err := userfile.ReadFile(path, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("engine: config: %w", err)
	}
	c, err := ParseConfig(b)
	if err != nil {
		return nil, fmt.Errorf("%w (file %s)", err, path)
	}
	return c, nil
}

// Validate checks every value the attention path relies on, once, so that the
// math can assume fixed shapes. The error lists every problem found.
func (c *Config) Validate() error {
	if c.IsV41() {
		return c.validateV41()
	}
	if c.V32() {
		return c.validateV32()
	}
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	pos := func(name string, v int) {
		if v <= 0 {
			bad("%s = %d must be positive", name, v)
		}
	}
	pos("dim", c.Dim)
	pos("n_layers", c.NLayers)
	pos("n_heads", c.NHeads)
	pos("q_lora_rank", c.QLoraRank)
	pos("head_dim", c.HeadDim)
	pos("o_groups", c.OGroups)
	pos("o_lora_rank", c.OLoraRank)
	pos("window_size", c.WindowSize)
	pos("max_seq_len", c.MaxSeqLen)
	if c.RopeHeadDim != attention.RopeDims {
		bad("rope_head_dim = %d: the reference implements 64 rotated dims", c.RopeHeadDim)
	}
	if c.HeadDim > 0 && (c.HeadDim <= c.RopeHeadDim || (c.HeadDim-c.RopeHeadDim)%64 != 0) {
		bad("head_dim = %d: the nope part head_dim-rope_head_dim must be a positive multiple of 64 (FQ8 blocks)", c.HeadDim)
	}
	for _, kv := range []struct {
		name string
		v    int
	}{{"dim", c.Dim}, {"q_lora_rank", c.QLoraRank}, {"o_groups*o_lora_rank", c.OGroups * c.OLoraRank}} {
		if kv.v > 0 && kv.v%attention.ActBlock != 0 {
			bad("%s = %d must be a multiple of 128 (FP8 activation blocks)", kv.name, kv.v)
		}
	}
	if c.NHeads > 0 && c.OGroups > 0 && c.NHeads%c.OGroups != 0 {
		bad("n_heads = %d is not a multiple of o_groups = %d", c.NHeads, c.OGroups)
	}
	if c.DType != "fp8" && c.DType != "bf16" {
		bad("dtype = %q: the reference implements the FP8 checkpoint (\"fp8\") and a bf16 one (\"bf16\")", c.DType)
	}
	if c.ScaleFmt != "ue8m0" {
		bad("scale_fmt = %q: the reference implements power-of-two scales (\"ue8m0\")", c.ScaleFmt)
	}
	if c.NormEps <= 0 {
		bad("norm_eps = %g must be positive", c.NormEps)
	}
	if len(c.CompressRatios) < c.NLayers {
		bad("compress_ratios has %d entries for n_layers = %d", len(c.CompressRatios), c.NLayers)
	}
	csa := false
	for l, r := range c.CompressRatios {
		switch r {
		case 0, 128:
		case 4:
			csa = csa || l < c.NLayers
		default:
			bad("compress_ratios[%d] = %d: V4 layers have r in {0, 4, 128}", l, r)
		}
	}
	if c.RopeTheta <= 0 || c.CompressRopeTheta <= 0 {
		bad("rope_theta = %g and compress_rope_theta = %g must be positive", c.RopeTheta, c.CompressRopeTheta)
	}
	if c.OriginalSeqLen > 0 && (c.RopeFactor <= 0 || c.BetaFast <= 0 || c.BetaSlow <= 0) {
		bad("YaRN needs positive rope_factor, beta_fast, beta_slow (have %g, %d, %d)", c.RopeFactor, c.BetaFast, c.BetaSlow)
	}
	if csa {
		if c.IndexHeadDim != 128 {
			bad("index_head_dim = %d: the indexer's Hadamard and FQ4 blocks need 128", c.IndexHeadDim)
		}
		pos("index_n_heads", c.IndexNHeads)
		pos("index_topk", c.IndexTopK)
	}
	if len(errs) > 0 {
		return fmt.Errorf("engine: invalid config: %w", errors.Join(errs...))
	}
	return nil
}

// Ratio is layer l's compress ratio r (0, 4 or 128). It panics for a layer
// outside 0 … n_layers-1.
func (c *Config) Ratio(layer int) int {
	if layer < 0 || layer >= c.NLayers {
		panic("engine: layer outside the model")
	}
	if c.V32() {
		return 0 // no compressor: V3.2 attends over the whole latent cache
	}
	return c.CompressRatios[layer]
}

// LayerKind names layer l's attention type as serving engines do: "SWA" (r = 0,
// window only), "CSA" (r = 4: window + indexer top-k of the compressed rows) or
// "HCA" (r = 128: window + every compressed row).
func (c *Config) LayerKind(layer int) string {
	if c.IsV41() {
		return c.v41LayerKind(layer)
	}
	if c.V32() {
		return "DSA"
	}
	switch c.Ratio(layer) {
	case 4:
		return "CSA"
	case 128:
		return "HCA"
	}
	return "SWA"
}

// Coff is 2 for the overlapping r = 4 compressors, else 1.
func Coff(r int) int {
	if r == 4 {
		return 2
	}
	return 1
}

// NopeDim is head_dim − rope_head_dim (448): the dims FQ8 quantises.
func (c *Config) NopeDim() int { return c.HeadDim - c.RopeHeadDim }

// SoftmaxScale is τ = f32(head_dim^-0.5) (0x3D3504F3 for 512).
func (c *Config) SoftmaxScale() float32 {
	if c.V32() {
		return c.V32SoftmaxScale()
	}
	return float32(1 / math.Sqrt(float64(c.HeadDim)))
}

// IndexWeightScale is f32(index_head_dim^-0.5 · index_n_heads^-0.5), the fixed
// factor of the indexer head weights (R-M:418; 0x3C3504F3 for V4-Flash).
func (c *Config) IndexWeightScale() float32 {
	return float32(1 / math.Sqrt(float64(c.IndexHeadDim)) * (1 / math.Sqrt(float64(c.IndexNHeads))))
}

// RopeParams are the RoPE parameters of layer l (R-M:475-482): base rope_theta
// and no YaRN for r = 0; base compress_rope_theta and YaRN for r > 0.
func (c *Config) RopeParams(layer int) attention.RopeParams {
	if c.V32() {
		return c.v32RopeParams()
	}
	if c.Ratio(layer) == 0 {
		return attention.RopeParams{Base: c.RopeTheta, Factor: c.RopeFactor, BetaFast: c.BetaFast, BetaSlow: c.BetaSlow}
	}
	return attention.RopeParams{Base: c.CompressRopeTheta, OriginalSeqLen: c.OriginalSeqLen,
		Factor: c.RopeFactor, BetaFast: c.BetaFast, BetaSlow: c.BetaSlow}
}

// Preset returns a built-in configuration: "tiny" (the golden official-v4-tiny
// run), "flash" (DeepSeek-V4-Flash inference/config.json) or "pro" (V4-Pro).
func Preset(name string) (*Config, error) {
	c := defaults()
	switch name {
	case "tiny":
		c.MaxBatchSize, c.MaxSeqLen, c.ExpertDType, c.VocabSize = 1, 512, "fp4", 512
		c.Dim, c.MoEInterDim, c.NLayers, c.NHashLayers, c.NMTPLayers, c.NHeads = 256, 256, 4, 1, 0, 4
		c.NRoutedExperts, c.NActivatedExperts, c.RouteScale, c.SwigluLimit = 4, 2, 1.5, 10
		c.QLoraRank, c.OGroups, c.OLoraRank = 128, 2, 128
		c.CompressRatios = []int{0, 4, 128, 4}
		c.CompressRopeTheta, c.OriginalSeqLen, c.RopeFactor = 160000, 65536, 16
		c.IndexNHeads, c.IndexTopK = 4, 16
	case "flash":
		c.ExpertDType, c.MoEInterDim, c.NLayers, c.NHashLayers = "fp4", 2048, 43, 3
		c.NRoutedExperts, c.NActivatedExperts, c.RouteScale, c.SwigluLimit = 256, 6, 1.5, 10
		c.CompressRatios = flashRatios(43)
		c.CompressRopeTheta, c.OriginalSeqLen, c.RopeFactor = 160000, 65536, 16
	case "pro":
		// V4-Pro (spec §1, P-C): the attention-path values differ from Flash in
		// dim, layers, heads, q_lora_rank, o_groups, index_topk and the first two
		// ratios. The MoE fields other than the expert count are Flash's (unchecked;
		// the attention path does not read them).
		c.ExpertDType, c.MoEInterDim, c.NLayers, c.NHashLayers = "fp4", 2048, 61, 3
		c.Dim, c.NHeads, c.QLoraRank, c.OGroups, c.IndexTopK = 7168, 128, 1536, 16, 1024
		c.NRoutedExperts, c.NActivatedExperts, c.RouteScale, c.SwigluLimit = 384, 6, 1.5, 10
		c.CompressRatios = flashRatios(61)
		c.CompressRatios[0], c.CompressRatios[1] = 128, 128
		c.CompressRopeTheta, c.OriginalSeqLen, c.RopeFactor = 160000, 65536, 16
	case "v41-flash", "v41-tiny":
		return v41Preset(name)
	case "v32", "v32-tiny", "v32-tiny-grouped":
		return v32Preset(name), nil
	default:
		return nil, fmt.Errorf("engine: unknown config preset %q (have %s)", name, strings.Join(PresetNames(), ", "))
	}
	if err := c.Validate(); err != nil {
		panic("engine: built-in preset " + name + " is invalid: " + err.Error())
	}
	return &c, nil
}

// PresetNames lists the built-in presets.
func PresetNames() []string {
	n := append([]string{"tiny", "flash", "pro", "v32", "v32-tiny", "v32-tiny-grouped"}, v41PresetNames...)
	sort.Strings(n)
	return n
}

// flashRatios is the V4 schedule for n layers plus one MTP entry: layers 0, 1
// SWA, then CSA on even and HCA on odd layers, the last layer CSA, MTP SWA
// ([0,0, 4,128, …, 4,128, 4, 0] for n = 43).
func flashRatios(n int) []int {
	r := make([]int, n+1)
	for l := 2; l < n; l++ {
		if l%2 == 0 {
			r[l] = 4
		} else {
			r[l] = 128
		}
	}
	return r
}

// BF16Checkpoint reports whether the config names a bf16 checkpoint (dtype
// "bf16"): model.py's Linear then holds bf16 weights and its linear() is
// F.linear(x, weight) — a bf16 GEMM with fp32 accumulation, one rounding to
// bf16, no FP8 activation quantisation (attention.BF16Linear) — for wq_a,
// wq_b, wkv, wo_b and the indexer's wq_b. Everything else is the FP8
// checkpoint's computation: model.py applies the FQ8 of the KV rows, the
// indexer's Hadamard and FP4, the fp32 compressors and the bf16 wo_a whatever
// the weights' dtype.
func (c *Config) BF16Checkpoint() bool { return c.DType == "bf16" }
