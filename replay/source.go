package replay

import (
	"fmt"
	"sort"

	"sparsemla/engine"
)

// Source is one request's dump as a replay reads it: the stage tensors of each
// decode step and layer, and the state the replay starts from. Implementations
// read lazily; the replay asks for each tensor when it needs it.
type Source interface {
	// Name is how reports and errors name the dump (a path).
	Name() string
	// Steps lists the decode steps (absolute positions p) present, ascending.
	Steps() []int64
	// Layers lists the layers present, ascending.
	Layers() []int
	// Stage returns the dumped value of one stage; ok is false when the dump
	// does not hold it. err is for unreadable or malformed records.
	Stage(step int64, layer int, stage string) (t engine.Tensor, ok bool, err error)
	// State returns the start state of one layer (stage names kv_cache,
	// cmp_kv_state, ... of LayerState.StateTensors) and the step it is valid
	// after; ok is false when the dump carries none.
	State(layer int) (st map[string]engine.Tensor, validAfter int64, ok bool, err error)
}

// StageLister is implemented by sources that can list what they hold
// without reading it; the replay uses it to report coverage (which held
// stage tensors it compared, which the reference does not define).
type StageLister interface {
	// StageNames lists the stage tensors held at one step and layer, sorted.
	StageNames(step int64, layer int) []string
	// Has reports whether one stage tensor is held.
	Has(step int64, layer int, stage string) bool
}

// PrefixHit says that a request's cache rows for positions < Tokens were
// reused from another request (a radix / prefix cache hit).
type PrefixHit struct {
	From   string // request whose rows were reused
	Tokens int64  // number of leading positions reused
}

// PrefixSource is implemented by sources that know about prefix-cache hits and
// can give the cache rows another request held (to name where a stale row came
// from).
type PrefixSource interface {
	PrefixHit() (PrefixHit, bool)
	// OtherState returns stage tensors (kv_cache, ...) of another request at a
	// step, for naming the origin of a stale row.
	OtherStage(request string, step int64, layer int, stage string) (engine.Tensor, bool, error)
}

// MemSource is a Source held in memory (synthetic dumps, tests, and the
// adapter over dump files fill it).
type MemSource struct {
	Path       string
	Values     map[StageKey]engine.Tensor
	Start      map[int]map[string]engine.Tensor // layer -> start state
	StartAfter int64                            // step the start state is valid after
	Hit        *PrefixHit
	Others     map[string]map[StageKey]engine.Tensor // other requests' stage tensors
}

// StageKey names one stage tensor of a request.
type StageKey struct {
	Step  int64
	Layer int
	Stage string
}

func (k StageKey) String() string { return fmt.Sprintf("p%d/L%d/%s", k.Step, k.Layer, k.Stage) }

// NewMemSource returns an empty in-memory source.
func NewMemSource(name string) *MemSource {
	return &MemSource{Path: name, Values: map[StageKey]engine.Tensor{}, Start: map[int]map[string]engine.Tensor{}}
}

// Name implements Source.
func (m *MemSource) Name() string { return m.Path }

// Put stores one stage tensor.
func (m *MemSource) Put(step int64, layer int, stage string, t engine.Tensor) {
	m.Values[StageKey{step, layer, stage}] = t
}

// Steps implements Source.
func (m *MemSource) Steps() []int64 {
	seen := map[int64]bool{}
	for k := range m.Values {
		if k.Layer >= 0 {
			seen[k.Step] = true
		}
	}
	out := make([]int64, 0, len(seen))
	for s := range seen {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// Layers implements Source.
func (m *MemSource) Layers() []int {
	seen := map[int]bool{}
	for k := range m.Values {
		if k.Layer >= 0 {
			seen[k.Layer] = true
		}
	}
	for l := range m.Start {
		seen[l] = true
	}
	out := make([]int, 0, len(seen))
	for l := range seen {
		out = append(out, l)
	}
	sort.Ints(out)
	return out
}

// Stage implements Source.
func (m *MemSource) Stage(step int64, layer int, stage string) (engine.Tensor, bool, error) {
	t, ok := m.Values[StageKey{step, layer, stage}]
	return t, ok, nil
}

// State implements Source.
func (m *MemSource) State(layer int) (map[string]engine.Tensor, int64, bool, error) {
	st, ok := m.Start[layer]
	return st, m.StartAfter, ok, nil
}

// StageNames implements StageLister.
func (m *MemSource) StageNames(step int64, layer int) []string {
	var out []string
	for k := range m.Values {
		if k.Step == step && k.Layer == layer {
			out = append(out, k.Stage)
		}
	}
	sort.Strings(out)
	return out
}

// Has implements StageLister.
func (m *MemSource) Has(step int64, layer int, stage string) bool {
	_, ok := m.Values[StageKey{step, layer, stage}]
	return ok
}

// PrefixHit implements PrefixSource.
func (m *MemSource) PrefixHit() (PrefixHit, bool) {
	if m.Hit == nil {
		return PrefixHit{}, false
	}
	return *m.Hit, true
}

// OtherStage implements PrefixSource.
func (m *MemSource) OtherStage(request string, step int64, layer int, stage string) (engine.Tensor, bool, error) {
	t, ok := m.Others[request][StageKey{step, layer, stage}]
	return t, ok, nil
}
