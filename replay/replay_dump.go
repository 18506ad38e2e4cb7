package replay

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
)

// DumpSource is a Source over an opened dump (any format dump.Open reads),
// restricted to one request. Tensors are read on demand and cached per key, so
// memory is bounded by what the replay touches.
type DumpSource struct {
	D       *dump.Dump
	Request string
	steps   []int64
	layers  []int

	pageOnce sync.Once
	pageIdx  map[StageKey][]int // page entries per (step, layer)
}

// NewDumpSource selects request (empty: the dump's only request, or the first
// in sorted order when there are several) from an opened dump.
//
// Every prefix-hit record is validated first (checkPrefixHits): it is
// outside input, and a hit that cannot be true would otherwise send a
// diagnosis after rows that do not exist.
func NewDumpSource(d *dump.Dump, request string) (*DumpSource, error) {
	reqs := map[string]bool{}
	for _, e := range d.Entries {
		if e.Kind == dump.KindStage && e.Layer >= 0 {
			reqs[e.Request] = true
		}
	}
	if err := checkPrefixHits(d); err != nil {
		return nil, err
	}
	if request == "" {
		// A request that reused another's prefix is the one being debugged.
		for _, p := range d.Prefix {
			if reqs[p.Request] {
				request = p.Request
			}
		}
	}
	if request == "" {
		var names []string
		for r := range reqs {
			names = append(names, r)
		}
		sort.Strings(names)
		if len(names) > 0 {
			request = names[0]
		}
	} else if !reqs[request] {
		return nil, fmt.Errorf("dump %s: no stage records for request %q", d.Path, request)
	}
	s := &DumpSource{D: d, Request: request}
	steps := map[int64]bool{}
	layers := map[int]bool{}
	for _, e := range d.Entries {
		if e.Request != request || e.Layer < 0 {
			continue
		}
		switch e.Kind {
		case dump.KindStage:
			// A step that holds only state tensors (the state after a step
			// that was decoded but not dumped) is not replayed; it serves
			// the next step's "prev:" inputs.
			if !StateStages[e.Stage] {
				steps[int64(e.Step)] = true
			}
			layers[e.Layer] = true
		case dump.KindState:
			layers[e.Layer] = true
		}
	}
	for p := range steps {
		s.steps = append(s.steps, p)
	}
	sort.Slice(s.steps, func(i, j int) bool { return s.steps[i] < s.steps[j] })
	for l := range layers {
		s.layers = append(s.layers, l)
	}
	sort.Ints(s.layers)
	if len(s.steps) == 0 {
		return nil, fmt.Errorf("dump %s: no decode-step records", d.Path)
	}
	return s, nil
}

// checkPrefixHits validates the dump's prefix-hit records: the request a
// hit reused from is not the request itself (the empty name is the default
// request, a legal source), at most one hit per request, and its token count lies within the request's positions
// (tokens 0 … Tokens−1 are reused, so Tokens ≤ the last position the dump
// holds for the request + 1). A source request the dump holds no records of
// is legal (a dump may hold only the request being debugged); the diagnosis
// then says its rows are not in the dump.
func checkPrefixHits(d *dump.Dump) error {
	last := map[string]int{} // request -> last step of its stage/state records
	for _, e := range d.Entries {
		if (e.Kind == dump.KindStage || e.Kind == dump.KindState) && e.Layer >= 0 {
			if l, ok := last[e.Request]; !ok || e.Step > l {
				last[e.Request] = e.Step
			}
		}
	}
	seen := map[string]int{}
	for i, h := range d.Prefix {
		where := fmt.Sprintf("dump %s: record %d at offset %d: prefix-hit record (request %q, source %q, %d tokens)", h.File, h.Record, h.Offset, h.Request, h.Source, h.Tokens)
		if h.File == "" {
			where = fmt.Sprintf("dump %s: prefix-hit record %d (request %q, source %q, %d tokens)", d.Path, i, h.Request, h.Source, h.Tokens)
		}
		switch l, ok := last[h.Request]; {
		case h.Source == h.Request:
			return fmt.Errorf("%s: the source is the request itself (a prefix hit reuses another request's cache)", where)
		case h.Tokens < 0:
			return fmt.Errorf("%s: negative token count", where)
		case ok && h.Tokens > l+1:
			return fmt.Errorf("%s: reuses more tokens than request %q has (its records end at position %d)", where, h.Request, l)
		}
		if j, dup := seen[h.Request]; dup {
			return fmt.Errorf("%s: a second prefix hit for request %q (the first is prefix-hit record %d)", where, h.Request, j)
		}
		seen[h.Request] = i
	}
	return nil
}

// StateStages names the stage tensors that are a layer's state after a step
// (LayerState.StateTensors).
var StateStages = map[string]bool{"kv_cache": true, "cmp_kv_state": true, "cmp_score_state": true,
	"icache": true, "icmp_kv_state": true, "icmp_score_state": true}

// Name implements Source.
func (s *DumpSource) Name() string { return s.D.Path }

// Steps implements Source.
func (s *DumpSource) Steps() []int64 { return s.steps }

// Layers implements Source.
func (s *DumpSource) Layers() []int { return s.layers }

// Stage implements Source.
func (s *DumpSource) Stage(step int64, layer int, stage string) (engine.Tensor, bool, error) {
	return s.read(dump.Key{Request: s.Request, Step: int(step), Layer: layer, Stage: stage}, dump.KindStage)
}

func (s *DumpSource) read(k dump.Key, kind dump.Kind) (engine.Tensor, bool, error) {
	e, ok := s.D.Lookup(k, kind)
	if !ok {
		return engine.Tensor{}, false, nil
	}
	rec, err := s.D.Read(e)
	if err != nil {
		return engine.Tensor{}, false, err
	}
	t, err := engine.TensorFromRecord(&rec)
	if err != nil {
		return engine.Tensor{}, false, fmt.Errorf("dump %s: record %d (%s): %w", e.File, e.Record, k, err)
	}
	return t, true, nil
}

// State implements Source: the KindState records of the layer, valid after
// their Key.Step.
func (s *DumpSource) State(layer int) (map[string]engine.Tensor, int64, bool, error) {
	st := map[string]engine.Tensor{}
	after := int64(-2)
	for i := range s.D.Entries {
		e := &s.D.Entries[i]
		if e.Kind != dump.KindState || e.Layer != layer || e.Request != s.Request {
			continue
		}
		if after != -2 && int64(e.Step) != after {
			return nil, 0, false, fmt.Errorf("dump %s: layer %d has start-state records valid after steps %d and %d", s.D.Path, layer, after, e.Step)
		}
		after = int64(e.Step)
		rec, err := s.D.Read(e)
		if err != nil {
			return nil, 0, false, err
		}
		t, err := engine.TensorFromRecord(&rec)
		if err != nil {
			return nil, 0, false, fmt.Errorf("dump %s: record %d (%s): %w", e.File, e.Record, e.Key, err)
		}
		st[e.Stage] = t
	}
	if len(st) == 0 {
		return nil, 0, false, nil
	}
	return st, after, true, nil
}

// PrefixHit implements PrefixSource from the dump's prefix records.
func (s *DumpSource) PrefixHit() (PrefixHit, bool) {
	for _, p := range s.D.Prefix {
		if p.Request == s.Request {
			return PrefixHit{From: p.Source, Tokens: int64(p.Tokens)}, true
		}
	}
	return PrefixHit{}, false
}

// OtherStage implements PrefixSource.
func (s *DumpSource) OtherStage(request string, step int64, layer int, stage string) (engine.Tensor, bool, error) {
	return s.read(dump.Key{Request: request, Step: int(step), Layer: layer, Stage: stage}, dump.KindStage)
}

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
}

// LoadModelWith is LoadModel with options (LoadOptions).
func LoadModelWith(d *dump.Dump, src Source, opt LoadOptions) (*engine.Model, error) {
	weights := opt.Weights
	if d.Header.ModelArgs == "" {
		return nil, fmt.Errorf("dump %s: no model config (ModelArgs) in the dump; write config.json beside it or use a native dump", d.Path)
	}
	cfg, err := engine.ParseConfig([]byte(d.Header.ModelArgs))
	if err != nil {
		return nil, fmt.Errorf("dump %s: %w", d.Path, err)
	}
	wpath, err := FindWeights(d.Path, weights)
	if err != nil {
		return nil, err
	}
	st, err := dump.OpenSafetensors(wpath)
	if err != nil {
		return nil, err
	}
	defer st.Close()
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
		load := engine.LoadLayerWeights
		if opt.Prepared {
			load = engine.LoadLayerWeightsPrepared
		}
		lw, err := load(cfg, l, st)
		if err != nil {
			return nil, err
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
	if err := checkDumpShapes(cfg, d); err != nil {
		return nil, fmt.Errorf("dump %s: %w", d.Path, err)
	}
	return m, nil
}

// FindWeights resolves the weights file of a dump.
func FindWeights(dumpPath, weights string) (string, error) {
	cands := []string{}
	if weights != "" {
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
		return "", fmt.Errorf("weights %s: no safetensors file there (want a file or a directory with weights.safetensors)", weights)
	}
	return "", fmt.Errorf("dump %s: no weights.safetensors beside it; pass --weights", dumpPath)
}

// Pages implements PageSource: the page records (kind "page", stage
// "kv_cache" or "kv_cache/<n>") of the layer after the step.
func (s *DumpSource) Pages(step int64, layer int) ([]Page, error) {
	s.pageOnce.Do(func() {
		s.pageIdx = map[StageKey][]int{}
		for i := range s.D.Entries {
			e := &s.D.Entries[i]
			if e.Kind == dump.KindPage && e.Request == s.Request && IsPageStage(e.Stage) {
				k := StageKey{int64(e.Step), e.Layer, "kv_cache"}
				s.pageIdx[k] = append(s.pageIdx[k], i)
			}
		}
	})
	var out []Page
	for _, i := range s.pageIdx[StageKey{step, layer, "kv_cache"}] {
		e := &s.D.Entries[i]
		if e.Page == nil {
			return nil, fmt.Errorf("dump %s: record %d (%s): page record without page info", e.File, e.Record, e.Key)
		}
		rec, err := s.D.Read(e)
		if err != nil {
			return nil, err
		}
		out = append(out, Page{Layout: e.Page.Layout, PageID: e.Page.PageID, BlockSize: e.Page.BlockSize,
			BlockTable: append([]int(nil), e.Page.BlockTable...), Data: rec.Data,
			Origin: fmt.Sprintf("dump %s: record %d (%s) at offset %d", e.File, e.Record, e.Key, e.Offset)})
	}
	return out, nil
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
