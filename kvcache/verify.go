package kvcache

import (
	"fmt"
	"math"
	"sort"
)

// CacheKind names one of a layer's caches, as VerifyPrefixHit walks them.
type CacheKind uint8

const (
	CacheWindow     CacheKind = iota // window row of token t (512 values)
	CacheCompressed                  // compressed row j (512 values)
	CacheIndex                       // indexer key j (128 values)
	CacheState                       // main compressor state of token t: a_t ‖ s_t (fp32)
	CacheIndexState                  // indexer compressor state of token t (fp32)
)

var cacheNames = [...]string{"window", "compressed", "index", "state", "index-state"}

func (k CacheKind) String() string {
	if int(k) < len(cacheNames) {
		return cacheNames[k]
	}
	return fmt.Sprintf("CacheKind(%d)", uint8(k))
}

// RowSource gives the rows of one request's caches, decoded to fp32 (bf16
// values for KV rows and keys). ok is false when the source has no such row.
type RowSource interface {
	Row(layer int, cache CacheKind, index int) (row []float32, ok bool)
}

// RowKey addresses one row of a RowMap.
type RowKey struct {
	Layer int
	Cache CacheKind
	Index int
}

// RowMap is an in-memory RowSource.
type RowMap map[RowKey][]float32

// Row implements RowSource.
func (m RowMap) Row(layer int, cache CacheKind, index int) ([]float32, bool) {
	r, ok := m[RowKey{layer, cache, index}]
	return r, ok
}

// PrefixHit describes a request (Request) whose first Tokens tokens were served
// from a prefix-cache hit on rows another request (Donor) computed.
type PrefixHit struct {
	Request  string
	Donor    string
	Tokens   int      // N: the hit length
	Schedule Schedule // window and per-layer ratios
	// StateRelTol is the relative tolerance for compressor-state rows, which
	// come from fp32 GEMMs whose summation order differs between GPU and CPU
	// (spec §14: up to ~1e-3). KV rows and indexer keys are always compared
	// exactly: their dequantisation is exact, so any difference is a wrong row.
	StateRelTol float32
}

// StaleRow is the first row of a prefix hit that is not this request's own.
type StaleRow struct {
	Layer    int
	Cache    CacheKind
	Index    int    // token t (window, state) or row j (compressed, index)
	Tokens   [2]int // raw token positions the row depends on, [lo, hi)
	Missing  bool   // the GPU has no row there
	Dim      int    // first differing value
	GPU, Own float32
	Values   int // differing values in the row
	// MatchesOther names another request whose row equals the GPU's ("" when
	// none does), and OtherIndex the row index in that request (for window
	// rows a stale ring slot shows up as the other request's t + k·window).
	MatchesOther string
	OtherIndex   int
	StaleRows    int // stale rows found in the whole hit (this one included)
}

func (s *StaleRow) String() string {
	what := fmt.Sprintf("layer %d %v row %d (tokens %d..%d)", s.Layer, s.Cache, s.Index, s.Tokens[0], s.Tokens[1]-1)
	var msg string
	if s.Missing {
		msg = what + ": missing on the GPU"
	} else {
		msg = fmt.Sprintf("%s: dim %d GPU %g, own %g (%d values differ)", what, s.Dim, s.GPU, s.Own, s.Values)
	}
	if s.MatchesOther != "" {
		msg += fmt.Sprintf("; the GPU row equals request %s's %v row %d", s.MatchesOther, s.Cache, s.OtherIndex)
	}
	return fmt.Sprintf("%s (%d stale rows in the hit)", msg, s.StaleRows)
}

// hitRow is one row the hit must have restored.
type hitRow struct {
	layer  int
	cache  CacheKind
	index  int
	tokens [2]int
}

// hitRows lists, in verification order (layer, then window, compressed,
// index, state, index-state, then ascending index), every row a resume at
// N = hit.Tokens needs (Schedule.Needs).
func hitRows(hit PrefixHit) []hitRow {
	N, W := hit.Tokens, hit.Schedule.Window
	var rows []hitRow
	for l, r := range hit.Schedule.Ratios {
		for t := max(0, N-W); t < N; t++ {
			rows = append(rows, hitRow{l, CacheWindow, t, [2]int{t, t + 1}})
		}
		if r == 0 {
			continue
		}
		for j := 0; j < N/r; j++ {
			lo := j * r
			if r == 4 && j > 0 {
				lo -= 4 // overlap: row j pools the previous group's A halves
			}
			rows = append(rows, hitRow{l, CacheCompressed, j, [2]int{lo, j*r + r}})
		}
		if r == 4 {
			for j := 0; j < N/4; j++ {
				rows = append(rows, hitRow{l, CacheIndex, j, [2]int{max(0, 4*j-4), 4*j + 4}})
			}
		}
		from := N - N%r
		if r == 4 {
			from = max(0, from-4)
		}
		for t := from; t < N; t++ {
			rows = append(rows, hitRow{l, CacheState, t, [2]int{t, t + 1}})
		}
		if r == 4 {
			for t := from; t < N; t++ {
				rows = append(rows, hitRow{l, CacheIndexState, t, [2]int{t, t + 1}})
			}
		}
	}
	return rows
}

// VerifyPrefixHit checks a request served from a prefix hit of hit.Tokens
// tokens: every row the resume needs (window rows of the last Window tokens,
// all compressed rows and indexer keys, the compressor state of the
// unfinished group and the ratio-4 halo; Schedule.Needs) must equal the row the
// reference computed for this request's own prefix. gpu holds the rows the
// GPU served, own the reference's rows for this request, others the rows of
// other requests (by name) to identify where a foreign row came from.
//
// It returns the first stale or foreign row in verification order (layer, then
// cache kind, then index), with the number of stale rows in the whole hit, or
// nil when the hit is clean. A row missing from own is an error (the caller
// must give the reference rows of the whole prefix).
func VerifyPrefixHit(hit PrefixHit, gpu, own RowSource, others map[string]RowSource) (*StaleRow, error) {
	if hit.Tokens < 0 {
		return nil, fmt.Errorf("kvcache: prefix hit of %d tokens", hit.Tokens)
	}
	names := make([]string, 0, len(others))
	for n := range others {
		names = append(names, n)
	}
	sort.Strings(names)
	var first *StaleRow
	stale := 0
	for _, hr := range hitRows(hit) {
		want, ok := own.Row(hr.layer, hr.cache, hr.index)
		if !ok {
			return nil, fmt.Errorf("kvcache: reference rows of request %s lack layer %d %v row %d", hit.Request, hr.layer, hr.cache, hr.index)
		}
		tol := float32(0)
		if hr.cache == CacheState || hr.cache == CacheIndexState {
			tol = hit.StateRelTol
		}
		got, ok := gpu.Row(hr.layer, hr.cache, hr.index)
		var s *StaleRow
		if !ok {
			s = &StaleRow{Layer: hr.layer, Cache: hr.cache, Index: hr.index, Tokens: hr.tokens, Missing: true}
		} else if d, n := diffRows(got, want, tol); n > 0 {
			s = &StaleRow{Layer: hr.layer, Cache: hr.cache, Index: hr.index, Tokens: hr.tokens, Dim: d, Values: n}
			if d < len(got) && d < len(want) {
				s.GPU, s.Own = got[d], want[d]
			}
		}
		if s == nil {
			continue
		}
		stale++
		if first != nil {
			continue
		}
		first = s
		if !ok {
			continue
		}
		for _, name := range names {
			if idx, found := findInOther(others[name], hr, got, tol, hit.Schedule.Window); found {
				s.MatchesOther, s.OtherIndex = name, idx
				break
			}
		}
	}
	if first != nil {
		first.StaleRows = stale
	}
	return first, nil
}

// findInOther looks for got in another request's rows: at the same index, and
// for window rows also at index + k·window (a ring slot never overwritten, or
// overwritten by a later token of the other request).
func findInOther(o RowSource, hr hitRow, got []float32, tol float32, window int) (int, bool) {
	if r, ok := o.Row(hr.layer, hr.cache, hr.index); ok {
		if _, n := diffRows(got, r, tol); n == 0 {
			return hr.index, true
		}
	}
	if hr.cache != CacheWindow || window <= 0 {
		return 0, false
	}
	for k := 1; k <= 1<<14; k++ {
		found := false
		for _, idx := range []int{hr.index + k*window, hr.index - k*window} {
			if idx < 0 {
				continue
			}
			r, ok := o.Row(hr.layer, hr.cache, idx)
			if !ok {
				continue
			}
			found = true
			if _, n := diffRows(got, r, tol); n == 0 {
				return idx, true
			}
		}
		if !found {
			break
		}
	}
	return 0, false
}

// diffRows compares a row under test with the expected one: values equal
// (NaN equals NaN; +0 equals -0), or within relative tolerance tol. It returns
// the first differing dim and the number of differing values (a length
// mismatch counts the missing values).
func diffRows(got, want []float32, tol float32) (first, n int) {
	first = -1
	m := min(len(got), len(want))
	for i := 0; i < m; i++ {
		g, w := got[i], want[i]
		if g == w || (g != g && w != w) {
			continue
		}
		if tol > 0 && !math.IsInf(float64(w), 0) && float32(math.Abs(float64(g-w))) <= tol*float32(math.Abs(float64(w))) {
			continue
		}
		if first < 0 {
			first = i
		}
		n++
	}
	if len(got) != len(want) {
		if first < 0 {
			first = m
		}
		n += max(len(got), len(want)) - m
	}
	return first, n
}
