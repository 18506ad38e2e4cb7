package replay

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sync"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/userfile"
)

// LoadModel builds the reference Model for a dump: the config from the dump
// header (ModelArgs JSON), the attention weights of the layers in src from
// weights (a safetensors file, or a directory holding weights.safetensors;
// empty: weights.safetensors next to the dump), and each layer's RoPE table —
// the GPU's own (freqs_cis_r0 / freqs_cis_cmp tables) when the dump has them,
// else computed (spec §3.6).
//
// The model runs the reference loops (its weights carry their fp32
// dequantisations); LoadModelWith can load the prepared path instead.
func LoadModel(d *dump.Dump, src Source, weights string) (*engine.Model, error) {
	return LoadModelWith(d, src, LoadOptions{Weights: weights})
}

// lazyExpertBytes is the size of one layer's routed experts above which
// LoadModel leaves them in the weights file, read when a step routes to them
// (a V4-Flash layer's are 3.2 GiB; the tiny golden's 0.4 MiB).
const lazyExpertBytes = 256 << 20

// LoadOptions configure LoadModelWith.
type LoadOptions struct {
	// Weights is the weights file or directory ("": weights.safetensors next
	// to the dump).
	Weights string
	// Prepared loads every layer with LoadLayerWeightsPrepared: the fast
	// kernels (the same bits) on the compact weights, packed once per layer
	// as it is read, so the fp32 copies of a whole model are never held at
	// once. False keeps the full reference weights (LoadLayerWeights) and the
	// plain reference loops.
	Prepared bool
	// Policy is the numerics policy (engine.PolicyNames): "" takes the
	// dump header's dtype_policy["policy"] when it names one of them (the
	// capture helper writes "hf-eager" for transformers' model), else
	// engine.PolicyOfficial.
	Policy string
	// From, when set, supplies the layer weights instead of the weights
	// file: a model loaded earlier (by LoadModelWith) for the same
	// configuration. Its weights are shared, not copied — Run and the
	// diagnosis only read a model's weights — so one loaded model serves
	// any number of dumps of its config (a fuzzer, a tool replaying many
	// dumps). Everything else is made for this dump as without From: the
	// config parsed from its header (it must equal From's), its GPU RoPE
	// tables or computed ones for its positions, its layer and shape
	// checks. Weights and Prepared are then unused.
	From *engine.Model
}

// LoadModelWith is LoadModel with options (LoadOptions).
func LoadModelWith(d *dump.Dump, src Source, opt LoadOptions) (*engine.Model, error) {
	weights := opt.Weights
	if d.Header.ModelArgs == "" {
		why := ""
		if d.Detect != "" {
			why = " (" + d.Detect + ")"
		}
		return nil, fmt.Errorf("dump %s: no model config (ModelArgs) in the dump; write config.json beside it or use a native dump%s", d.Path, why)
	}
	cfg, err := parseModelArgs(d.Header.ModelArgs)
	if err != nil {
		return nil, fmt.Errorf("dump %s: %w", d.Path, err)
	}
	if cfg.IsV41() {
		return nil, fmt.Errorf("dump %s: the config is DeepSeek-V4.1 (CSA2: kv/index source layers), which V4's stage graph would mis-replay; V4.1 dumps are read by OpenV41 / LoadV41Dump (docs/v41.md)", d.Path)
	}
	policy := opt.Policy
	if policy == "" && slices.Contains(engine.PolicyNames(), d.Header.DTypePolicy["policy"]) {
		policy = d.Header.DTypePolicy["policy"]
	}
	if err := cfg.SetPolicy(policy); err != nil {
		return nil, fmt.Errorf("dump %s: %w", d.Path, err)
	}
	var st interface {
		dump.WeightSource
		Close() error
	}
	if opt.From != nil {
		if opt.From.Cfg == nil || !reflect.DeepEqual(*cfg, *opt.From.Cfg) {
			return nil, fmt.Errorf("dump %s: its config differs from the config of the model given to reuse", d.Path)
		}
	} else {
		wpath, err := FindWeights(d.Path, weights)
		if err != nil {
			return nil, err
		}
		if fi, err := os.Stat(wpath); err == nil && fi.IsDir() {
			st, err = dump.OpenCheckpoint(wpath) // index.json + shards, official or HF names
			if err != nil {
				return nil, err
			}
		} else if st, err = dump.OpenSafetensors(wpath); err != nil {
			return nil, err
		}
	}
	// A model whose routed experts are read on demand (a real-size
	// checkpoint: BlockLoadOptions.LazyExperts) keeps its weights file open.
	lazy := cfg.ExpertBytes() > lazyExpertBytes
	// one byte-bounded cache for the lazy experts of every layer
	experts := engine.NewExpertCache(cfg.ExpertCacheBytes())
	keep := false
	defer func() {
		if st != nil && !keep {
			st.Close()
		}
	}()
	m := &engine.Model{Cfg: cfg, Weights: map[int]*engine.LayerWeights{}, Rope: map[int]*engine.RopeTable{}}
	T0 := 1 // positions the steps need
	for _, p := range src.Steps() {
		T0 = max(T0, int(p)+1)
	}
	if err := checkReplayConfig(cfg, T0); err != nil {
		return nil, fmt.Errorf("dump %s: %w", d.Path, err)
	}
	T := T0 // a computed RoPE table covers the positions the dump decodes
	gpu := map[string]*engine.RopeTable{}
	for _, name := range []string{"freqs_cis_r0", "freqs_cis_cmp"} {
		e, ok := d.Lookup(dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, dump.KindTable)
		if !ok {
			continue
		}
		rec, err := d.Read(e)
		if err != nil {
			return nil, err
		}
		if len(rec.Shape) != 3 || rec.Shape[1] != 32 || rec.Shape[2] != 2 {
			return nil, fmt.Errorf("dump %s: table %s has shape %v, want [T, 32, 2]", d.Path, name, rec.Shape)
		}
		f, err := rec.Float32()
		if err != nil {
			return nil, err
		}
		if rec.Shape[0] < T0 {
			return nil, fmt.Errorf("dump %s: table %s covers positions 0..%d, the dump decodes position %d", d.Path, name, rec.Shape[0]-1, T0-1)
		}
		gpu[name] = attention.RopeTableFromCis(f, rec.Shape[0], d.Path+":"+name)
	}
	m.GPURope = len(gpu) > 0
	for _, l := range src.Layers() {
		if l >= cfg.NLayers {
			return nil, fmt.Errorf("dump %s: layer %d outside the model (%d layers)", d.Path, l, cfg.NLayers)
		}
		var lw *engine.LayerWeights
		if opt.From != nil {
			if lw = opt.From.Weights[l]; lw == nil {
				return nil, fmt.Errorf("dump %s: the model given to reuse has no weights for layer %d", d.Path, l)
			}
		} else {
			load := engine.LoadLayerWeights
			if opt.Prepared {
				load = engine.LoadLayerWeightsPrepared
			}
			if lw, err = load(cfg, l, st); err != nil {
				return nil, err
			}
		}
		if opt.From == nil && engine.HasBlockWeights(st, l) && cfg.ValidateBlock() == nil {
			// The whole layer: mHC, norms, MoE (a file with the attention
			// path only, or a model whose MoE the reference does not
			// implement — bf16 experts, an inter dim that is not a multiple
			// of 128 — leaves Block nil and the replay compares that part).
			if lw.Block, err = engine.LoadBlockWeightsWith(cfg, l, st, engine.BlockLoadOptions{LazyExperts: lazy, Cache: experts}); err != nil {
				return nil, err
			}
			keep = keep || lazy
		}
		m.Weights[l] = lw
		name := "freqs_cis_r0"
		if cfg.Ratio(l) > 0 {
			name = "freqs_cis_cmp"
		}
		if t, ok := gpu[name]; ok {
			m.Rope[l] = t
		} else {
			m.GPURope = false
			m.Rope[l] = engine.LayerRope(cfg, l, T)
		}
	}
	if opt.From != nil {
		m.Head = opt.From.Head // shared, like the layers' weights (Block included)
	} else if engine.HasHeadWeights(st) && cfg.ValidateBlock() == nil {
		if m.Head, err = engine.LoadHeadWeights(cfg, st); err != nil {
			return nil, err
		}
	}
	if err := checkDumpShapes(cfg, d); err != nil {
		return nil, fmt.Errorf("dump %s: %w", d.Path, err)
	}
	return m, nil
}

// lastConfig is the last ModelArgs text engine.ParseConfig accepted and its
// config: dumps of one run (a diff's two, a fuzzer's executions) carry the
// same text, and parsing it was several per cent of a small replay.
var lastConfig struct {
	sync.Mutex
	text string
	cfg  engine.Config
}

// parseModelArgs is engine.ParseConfig of a dump header's ModelArgs text: a
// new config each call (CompressRatios its own), the parse skipped when the
// text is the last accepted one byte for byte. Errors are never cached.
func parseModelArgs(text string) (*engine.Config, error) {
	lastConfig.Lock()
	defer lastConfig.Unlock()
	if lastConfig.text == "" || lastConfig.text != text {
		cfg, err := engine.ParseConfig([]byte(text))
		if err != nil {
			return nil, err
		}
		lastConfig.text, lastConfig.cfg = text, *cfg
		lastConfig.cfg.CompressRatios = slices.Clone(cfg.CompressRatios)
	}
	c := lastConfig.cfg
	c.CompressRatios = slices.Clone(c.CompressRatios)
	return &c, nil
}

// FindWeights resolves the weights of the dump at dumpPath: weights itself,
// weights/weights.safetensors, or weights as a checkpoint directory
// (model.safetensors.index.json + shards, or model.safetensors) when given,
// else weights.safetensors beside the dump. The error says what was looked for.
func FindWeights(dumpPath, weights string) (string, error) {
	cands := []string{}
	if weights != "" {
		// A path that is not there (or cannot be read) says so, not "no
		// safetensors file there".
		if _, err := os.Stat(weights); err != nil {
			return "", fmt.Errorf("weights: %w", userfile.Describe(weights, err))
		}
		cands = append(cands, weights, filepath.Join(weights, "weights.safetensors"))
	} else {
		dir := dumpPath
		if fi, err := os.Stat(dumpPath); err == nil && !fi.IsDir() {
			dir = filepath.Dir(dumpPath)
		}
		cands = append(cands, filepath.Join(dir, "weights.safetensors"))
	}
	for _, c := range cands {
		if fi, err := os.Stat(c); err == nil && !fi.IsDir() {
			return c, nil
		}
	}
	if weights != "" {
		// a checkpoint directory: model.safetensors.index.json + shards, or
		// model.safetensors (a Hugging Face save_pretrained layout)
		for _, f := range []string{"model.safetensors.index.json", "model.safetensors"} {
			if fi, err := os.Stat(filepath.Join(weights, f)); err == nil && !fi.IsDir() {
				return weights, nil
			}
		}
		return "", fmt.Errorf("weights %s: no safetensors file there (want a file, a directory with weights.safetensors, or a checkpoint directory with model.safetensors.index.json or model.safetensors)", weights)
	}
	return "", &NoWeightsError{Dump: dumpPath}
}

// NoWeightsError is the error of loading the model of a dump that has no
// weights.safetensors beside it when no weights were given (--weights). A
// command that can go on without the reference (diff, without its referee)
// tells it from every other load error (a --weights path that is not
// there, weights that cannot be read), which it reports.
type NoWeightsError struct{ Dump string }

func (e *NoWeightsError) Error() string {
	return fmt.Sprintf("dump %s: no weights.safetensors beside it; pass --weights", e.Dump)
}

// Bounds on config values that size a replay's allocations but that no weight
// shape checks (the weights fix dim, heads, ranks). V4 uses window 128, top-k
// 512/1024 and at most 2^20 positions; the bounds leave ample room.
const (
	maxReplayWindow = 1 << 16
	maxReplayTopK   = 1 << 20
	maxReplayPos    = 1 << 24
)

// checkReplayConfig refuses configs and dumps whose sizes no real model has,
// before anything is allocated from them.
func checkReplayConfig(cfg *engine.Config, positions int) error {
	switch {
	case cfg.WindowSize > maxReplayWindow:
		return fmt.Errorf("config window_size = %d exceeds %d (V4 uses 128)", cfg.WindowSize, maxReplayWindow)
	case cfg.IndexTopK > maxReplayTopK:
		return fmt.Errorf("config index_topk = %d exceeds %d (V4 uses 512 or 1024)", cfg.IndexTopK, maxReplayTopK)
	case cfg.MaxSeqLen > maxReplayPos:
		return fmt.Errorf("config max_seq_len = %d exceeds %d positions", cfg.MaxSeqLen, maxReplayPos)
	case positions > maxReplayPos:
		return fmt.Errorf("the dump decodes position %d, beyond %d", positions-1, maxReplayPos)
	}
	return nil
}
