package engine

import (
	"errors"
	"fmt"
	"slices"
	"sort"

	"sparsemla/attention"
)

// V41Args are the ModelArgs keys of DeepSeek-V4.1 ("CSA2", spec §11; V41-M
// ModelArgs) that V4 does not have, embedded in Config so that a V4.1
// inference config loads through ParseConfig. A config is V4.1 when it names
// KV-source or index-source layers or candidate blocks (IsV41), in the
// ModelArgs spelling (kv_source_layers, …) or the Hugging Face one
// (kv_source_layer_ids, …; both are read, the ModelArgs one first). Fields
// the attention path does not read (engram, vision, DSpark, sampling) are kept
// so that the official config round-trips.
type V41Args struct {
	KVSourceLayers       []int `json:"kv_source_layers,omitempty"`
	IndexSourceLayers    []int `json:"index_source_layers,omitempty"`
	CandidateSourceLayer *int  `json:"candidate_source_layer,omitempty"` // nil or < 0: no candidate level
	CandidateTopKBlocks  int   `json:"candidate_topk_blocks,omitempty"`
	CandidateBlockSize   int   `json:"candidate_block_size,omitempty"`

	// Hugging Face spellings of the same lists.
	KVSourceLayerIDs       []int `json:"kv_source_layer_ids,omitempty"`
	IndexSourceLayerIDs    []int `json:"index_source_layer_ids,omitempty"`
	CandidateSourceLayerID *int  `json:"candidate_source_layer_id,omitempty"`

	// Not read by the attention path.
	Temperature               float64 `json:"temperature,omitempty"`
	GateTemp                  float64 `json:"gate_temp,omitempty"`
	NormTopKProb              *bool   `json:"norm_topk_prob,omitempty"`
	EngramLayerIDs            []int   `json:"engram_layer_ids,omitempty"`
	EngramNumEmbeddings       []int64 `json:"engram_num_embeddings,omitempty"`
	EngramMaxNgramSize        int     `json:"engram_max_ngram_size,omitempty"`
	EngramVocabSize           int     `json:"engram_vocab_size,omitempty"`
	EngramNHeads              int     `json:"engram_n_heads,omitempty"`
	EngramHeadDim             int     `json:"engram_head_dim,omitempty"`
	EngramPadID               int     `json:"engram_pad_id,omitempty"`
	EngramCompressedVocabSize int     `json:"engram_compressed_vocab_size,omitempty"`
	VisionNLayers             int     `json:"vision_n_layers,omitempty"`
	VisionDim                 int     `json:"vision_dim,omitempty"`
	VisionNHeads              int     `json:"vision_n_heads,omitempty"`
	VisionInterDim            int     `json:"vision_inter_dim,omitempty"`
	VisionPatchSize           int     `json:"vision_patch_size,omitempty"`
	VisionRopeTheta           float64 `json:"vision_rope_theta,omitempty"`
	VisionDownsampleRatio     int     `json:"vision_downsample_ratio,omitempty"`
	VisionMaxNToken           int     `json:"vision_max_n_token,omitempty"`
	VisionMinPixels           int     `json:"vision_min_pixels,omitempty"`
	VisionMaxWHRatio          *int    `json:"vision_max_wh_ratio,omitempty"`
	ImageTokenID              int     `json:"image_token_id,omitempty"`
	DSparkBlockSize           int     `json:"dspark_block_size,omitempty"`
	DSparkNoiseTokenID        int     `json:"dspark_noise_token_id,omitempty"`
	DSparkTargetLayerIDs      []int   `json:"dspark_target_layer_ids,omitempty"`
	DSparkMarkovRank          int     `json:"dspark_markov_rank,omitempty"`
	DSparkNRoutedExperts      int     `json:"dspark_n_routed_experts,omitempty"`
	DSparkNActivatedExperts   int     `json:"dspark_n_activated_experts,omitempty"`
}

// dropEmptyLists makes an empty list key ("kv_source_layers": []) the same
// config as an absent one: every reader takes only their length and elements,
// and a config must come back unchanged from a JSON round trip, where
// omitempty drops an empty list.
func (a *V41Args) dropEmptyLists() {
	for _, l := range []*[]int{&a.KVSourceLayers, &a.IndexSourceLayers, &a.KVSourceLayerIDs,
		&a.IndexSourceLayerIDs, &a.EngramLayerIDs, &a.DSparkTargetLayerIDs} {
		if len(*l) == 0 {
			*l = nil
		}
	}
	if len(a.EngramNumEmbeddings) == 0 {
		a.EngramNumEmbeddings = nil
	}
}

// IsV41 reports whether the config is DeepSeek-V4.1 (CSA2): it names KV-source
// or index-source layers, or candidate blocks.
func (c *Config) IsV41() bool {
	a := &c.V41Args
	return len(a.KVSourceLayers) > 0 || len(a.KVSourceLayerIDs) > 0 || len(a.IndexSourceLayers) > 0 ||
		len(a.IndexSourceLayerIDs) > 0 || a.CandidateTopKBlocks > 0 || a.CandidateBlockSize > 0
}

// KVSources is kv_source_layers (or kv_source_layer_ids), ascending.
func (c *Config) KVSources() []int {
	if len(c.KVSourceLayers) > 0 {
		return c.KVSourceLayers
	}
	return c.KVSourceLayerIDs
}

// IndexSources is index_source_layers (or index_source_layer_ids), ascending.
func (c *Config) IndexSources() []int {
	if len(c.IndexSourceLayers) > 0 {
		return c.IndexSourceLayers
	}
	return c.IndexSourceLayerIDs
}

// CandidateSource is the candidate-source layer, −1 when there is none.
func (c *Config) CandidateSource() int {
	p := c.CandidateSourceLayer
	if p == nil {
		p = c.CandidateSourceLayerID
	}
	if p == nil || *p < 0 || c.CandidateTopKBlocks <= 0 || c.CandidateBlockSize <= 0 {
		return -1
	}
	return *p
}

// IsKVSource: layer l owns a compressor and the compressed cache its group reads.
func (c *Config) IsKVSource(l int) bool { return l < c.NLayers && slices.Contains(c.KVSources(), l) }

// IsIndexSource: layer l runs an indexer and publishes its top-k list.
func (c *Config) IsIndexSource(l int) bool {
	return l < c.NLayers && slices.Contains(c.IndexSources(), l)
}

// KVSourceOf is the layer whose compressed cache layer l attends (the latest
// KV source ≤ l: model.py's shared_attn.compress_kv, published by sources
// before consumers run), −1 for r = 0 layers.
func (c *Config) KVSourceOf(l int) int { return latestAtMost(c.KVSources(), l, c.Ratio(l)) }

// IndexSourceOf is the layer whose top-k list layer l uses (itself for an
// index source; otherwise the latest index source < l, shared_attn.topk_idxs),
// −1 for r = 0 layers.
func (c *Config) IndexSourceOf(l int) int { return latestAtMost(c.IndexSources(), l, c.Ratio(l)) }

func latestAtMost(src []int, l, r int) int {
	if r == 0 {
		return -1
	}
	best := -1
	for _, s := range src {
		if s <= l && s > best {
			best = s
		}
	}
	return best
}

// UsesCandidates: layer l is an index source after the candidate source, so
// it masks its scores with the candidate blocks (level two).
func (c *Config) UsesCandidates(l int) bool {
	cs := c.CandidateSource()
	return cs >= 0 && cs < l && c.IsIndexSource(l)
}

// v41LayerKind names a V4.1 layer: "SWA" (r = 0), "CSA2" with its ratio and
// role: KV source (owns the compressor), index source (runs an indexer),
// candidate source, or consumer.
func (c *Config) v41LayerKind(l int) string {
	r := c.Ratio(l)
	if r == 0 {
		return "SWA"
	}
	role := "consumer"
	switch {
	case c.IsKVSource(l):
		role = "kv+index source"
	case c.IsIndexSource(l):
		role = "index source"
	}
	if l == c.CandidateSource() {
		role += ", candidate source"
	}
	return fmt.Sprintf("CSA2 r=%d (%s)", r, role)
}

// validateV41 checks a V4.1 config: ratios in {0, 1, 2}, the source lists
// ascending and inside the model, every r > 0 layer with a KV source of its
// own ratio and an index source at or before it, head_dim / dims multiples of
// the 32-blocks and the FP4 16-blocks, the indexer 128-d, and a candidate
// level that can hold index_topk rows.
func (c *Config) validateV41() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	for _, kv := range []struct {
		name string
		v    int
	}{{"dim", c.Dim}, {"n_layers", c.NLayers}, {"n_heads", c.NHeads}, {"q_lora_rank", c.QLoraRank},
		{"head_dim", c.HeadDim}, {"o_groups", c.OGroups}, {"o_lora_rank", c.OLoraRank}, {"window_size", c.WindowSize},
		{"max_seq_len", c.MaxSeqLen}, {"index_n_heads", c.IndexNHeads}, {"index_topk", c.IndexTopK}} {
		if kv.v <= 0 {
			bad("%s = %d must be positive", kv.name, kv.v)
		}
	}
	if c.RopeHeadDim != attention.RopeDims {
		bad("rope_head_dim = %d: the reference implements 64 rotated dims", c.RopeHeadDim)
	}
	if c.HeadDim%attention.V41Block != 0 || c.HeadDim <= c.RopeHeadDim {
		bad("head_dim = %d must be a multiple of 32 above rope_head_dim (FQ8 blocks of 32, FP4 blocks of 16)", c.HeadDim)
	}
	for _, kv := range []struct {
		name string
		v    int
	}{{"dim", c.Dim}, {"q_lora_rank", c.QLoraRank}, {"o_groups*o_lora_rank", c.OGroups * c.OLoraRank}} {
		if kv.v > 0 && kv.v%attention.V41Block != 0 {
			bad("%s = %d must be a multiple of 32 (V4.1 FP8 activation blocks)", kv.name, kv.v)
		}
	}
	if c.NHeads > 0 && c.OGroups > 0 && c.NHeads%c.OGroups != 0 {
		bad("n_heads = %d is not a multiple of o_groups = %d", c.NHeads, c.OGroups)
	}
	if c.IndexHeadDim != 128 {
		bad("index_head_dim = %d: the reference implements 128", c.IndexHeadDim)
	}
	if c.DType != "fp8" {
		bad("dtype = %q: the V4.1 reference implements the FP8 checkpoint", c.DType)
	}
	if c.ScaleFmt != "ue8m0" {
		bad("scale_fmt = %q: the reference implements power-of-two scales (\"ue8m0\")", c.ScaleFmt)
	}
	if c.NormEps <= 0 {
		bad("norm_eps = %g must be positive", c.NormEps)
	}
	if c.Policy != "" && c.Policy != PolicyOfficial {
		bad("policy %q: V4.1 has only the official numerics", c.Policy)
	}
	if len(c.CompressRatios) < c.NLayers {
		bad("compress_ratios has %d entries for n_layers = %d", len(c.CompressRatios), c.NLayers)
		return fmt.Errorf("engine: invalid V4.1 config: %w", errors.Join(errs...))
	}
	for l, r := range c.CompressRatios {
		if r != 0 && r != 1 && r != 2 {
			bad("compress_ratios[%d] = %d: V4.1 layers have r in {0, 1, 2}", l, r)
		}
	}
	for _, list := range []struct {
		name string
		v    []int
	}{{"kv_source_layers", c.KVSources()}, {"index_source_layers", c.IndexSources()}} {
		if !sort.IntsAreSorted(list.v) {
			bad("%s %v is not ascending", list.name, list.v)
		}
		for i, l := range list.v {
			if l < 0 || l >= c.NLayers {
				bad("%s[%d] = %d outside the %d layers", list.name, i, l, c.NLayers)
			} else if c.CompressRatios[l] == 0 {
				bad("%s[%d] = %d is an r = 0 layer", list.name, i, l)
			}
		}
	}
	if len(errs) == 0 {
		for l := 0; l < c.NLayers; l++ {
			r := c.CompressRatios[l]
			if r == 0 {
				continue
			}
			ks := c.KVSourceOf(l)
			if ks < 0 {
				bad("layer %d (r = %d) has no KV source at or before it", l, r)
			} else if c.CompressRatios[ks] != r {
				bad("layer %d (r = %d) reads KV source %d of another ratio (r = %d)", l, r, ks, c.CompressRatios[ks])
			}
			if c.IndexSourceOf(l) < 0 {
				bad("layer %d (r = %d) has no index source at or before it", l, r)
			}
			if c.IsIndexSource(l) && !c.IsKVSource(l) && ks >= 0 && !c.IsIndexSource(ks) {
				bad("index source %d reads the index keys of KV source %d, which runs no indexer (keys are made in the indexer)", l, ks)
			}
		}
	}
	if cs := c.CandidateSource(); cs >= 0 {
		if !c.IsIndexSource(cs) {
			bad("candidate_source_layer %d is not an index source", cs)
		}
		if c.CandidateTopKBlocks*c.CandidateBlockSize-(c.CandidateBlockSize-1) < c.IndexTopK {
			bad("%d candidate blocks of %d cannot hold index_topk = %d rows", c.CandidateTopKBlocks, c.CandidateBlockSize, c.IndexTopK)
		}
	}
	if c.RopeTheta <= 0 || c.CompressRopeTheta <= 0 {
		bad("rope_theta = %g and compress_rope_theta = %g must be positive", c.RopeTheta, c.CompressRopeTheta)
	}
	if c.OriginalSeqLen > 0 && (c.RopeFactor <= 0 || c.BetaFast <= 0 || c.BetaSlow <= 0) {
		bad("YaRN needs positive rope_factor, beta_fast, beta_slow (have %g, %d, %d)", c.RopeFactor, c.BetaFast, c.BetaSlow)
	}
	if len(errs) > 0 {
		return fmt.Errorf("engine: invalid V4.1 config: %w", errors.Join(errs...))
	}
	return nil
}

// v41Preset returns the V4.1 presets (spec §11; V41-D and V41-M defaults):
//
//	v41-flash  DeepSeek-V4.1-Flash: 40 layers, dim 5120, 64 heads × 512,
//	           q_lora_rank 1280, o_groups 8 × 1024, ratios 0,0, 2 ×18, 1 ×20
//	           (+3 DSpark stages at r = 0), KV sources [2,8,14,20], index
//	           sources [2,8,14,20,24,28,32,36], indexer 32 × 128 top-512,
//	           candidate source 20 with 2048 blocks of 8, rms_norm_eps 1e-20,
//	           384 experts top-6 (MoE fields not read by the attention path)
//	v41-tiny   the same structure at a size a CPU replays in a moment:
//	           8 layers [0, 0, 2, 2, 2, 1, 1, 1], KV sources [2, 5], index
//	           sources [2, 5, 7], candidate source 5 with 2 blocks of 4 (a
//	           candidate level that really masks past 8 compressed rows),
//	           dim 256, 4 heads × 512, q_lora_rank 128, o_groups 2 × 128,
//	           indexer 4 × 128 top-4, window 128
func v41Preset(name string) (*Config, error) {
	c := defaults()
	c.NormEps = 1e-20
	c.ExpertDType = "fp4"
	c.CompressRopeTheta, c.OriginalSeqLen, c.RopeFactor = 160000, 65536, 16
	c.NHashLayers = 0
	switch name {
	case "v41-flash":
		c.Dim, c.NLayers, c.NMTPLayers, c.NHeads = 5120, 40, 3, 64
		c.QLoraRank, c.OGroups, c.OLoraRank = 1280, 8, 1024
		c.NRoutedExperts, c.NActivatedExperts, c.RouteScale, c.SwigluLimit = 384, 6, 1.5, 10
		c.CompressRatios = make([]int, 43)
		for l := 2; l < 40; l++ {
			c.CompressRatios[l] = 2
			if l >= 20 {
				c.CompressRatios[l] = 1
			}
		}
		c.KVSourceLayers = []int{2, 8, 14, 20}
		c.IndexSourceLayers = []int{2, 8, 14, 20, 24, 28, 32, 36}
		cs := 20
		c.CandidateSourceLayer, c.CandidateTopKBlocks, c.CandidateBlockSize = &cs, 2048, 8
		c.IndexNHeads, c.IndexTopK = 32, 512
		c.EngramLayerIDs = []int{1, 14}
	case "v41-tiny":
		c.MaxBatchSize, c.MaxSeqLen, c.VocabSize = 1, 512, 512
		c.Dim, c.MoEInterDim, c.NLayers, c.NMTPLayers, c.NHeads = 256, 256, 8, 0, 4
		c.NRoutedExperts, c.NActivatedExperts, c.RouteScale, c.SwigluLimit = 4, 2, 1.5, 10
		c.QLoraRank, c.OGroups, c.OLoraRank = 128, 2, 128
		c.CompressRatios = []int{0, 0, 2, 2, 2, 1, 1, 1}
		c.KVSourceLayers = []int{2, 5}
		c.IndexSourceLayers = []int{2, 5, 7}
		cs := 5
		c.CandidateSourceLayer, c.CandidateTopKBlocks, c.CandidateBlockSize = &cs, 2, 4
		c.IndexNHeads, c.IndexTopK = 4, 4
	default:
		return nil, fmt.Errorf("engine: unknown V4.1 preset %q", name)
	}
	if err := c.Validate(); err != nil {
		panic("engine: built-in preset " + name + " is invalid: " + err.Error())
	}
	return &c, nil
}

// v41PresetNames lists the V4.1 presets.
var v41PresetNames = []string{"v41-flash", "v41-tiny"}
