package replay

import (
	"fmt"
	"sort"
	"sync"

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

	namesOnce sync.Once
	names     map[StageKey][]string // stage names per (step, layer), Stage ""
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
			if !IsStateStage(e.Stage) {
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

// stateStages names the stage tensors that are a layer's state after a step
// (LayerState.StateTensors).
var stateStages = map[string]bool{"kv_cache": true, "cmp_kv_state": true, "cmp_score_state": true,
	"icache": true, "icmp_kv_state": true, "icmp_score_state": true,
	"latent_cache": true, "k_cache": true, "k_scale_cache": true} // V3.2

// IsStateStage reports whether stage names a tensor of a layer's state after
// a step (engine.LayerState.StateTensors: kv_cache, the compressor states,
// icache): a dumped step holding only those was decoded but not dumped.
func IsStateStage(stage string) bool { return stateStages[stage] }

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

// StageNames implements StageLister: the stage records the dump holds for
// the request at one step and layer (dump.Global: the stages of no layer,
// such as a whole-model dump's tok and logits), sorted.
func (s *DumpSource) StageNames(step int64, layer int) []string {
	s.namesOnce.Do(func() {
		s.names = map[StageKey][]string{}
		for _, e := range s.D.Entries {
			if e.Kind == dump.KindStage && e.Request == s.Request && (e.Layer >= 0 || e.Layer == dump.Global) {
				k := StageKey{int64(e.Step), e.Layer, ""}
				s.names[k] = append(s.names[k], e.Stage)
			}
		}
		for k := range s.names {
			sort.Strings(s.names[k])
		}
	})
	return s.names[StageKey{step, layer, ""}]
}

// Has implements StageLister without reading the record.
func (s *DumpSource) Has(step int64, layer int, stage string) bool {
	_, ok := s.D.Lookup(dump.Key{Request: s.Request, Step: int(step), Layer: layer, Stage: stage}, dump.KindStage)
	return ok
}
