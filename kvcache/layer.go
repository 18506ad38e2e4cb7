package kvcache

import (
	"fmt"
	"math"
)

// Geometry is how an engine pages the caches of one layer (spec §2.2,
// tools-and-formats.md §2.4-2.5). Every field is a deployment choice, read from
// the dump's metadata; DefaultGeometry is vLLM's.
type Geometry struct {
	Window int // sliding window (128)
	// WindowRing selects the window's logical addressing: true = the
	// reference ring, token t at logical entry t mod Window; false = vLLM's
	// paged SWA, token t at logical entry t (pages that slid out are freed).
	WindowRing bool
	SWAPage    int // tokens per window page (64)
	// RawPage is the number of raw tokens a compressed page covers (256): a
	// page holds RawPage/r compressed rows (64 for r = 4, 2 for r = 128) and
	// RawPage/4 indexer keys.
	RawPage int
	// StatePage is the number of tokens per compressor-state page (vLLM: 4 for
	// r = 4, 8 for r = 128); 0 means r·coff, one reference-sized state.
	StatePage int
}

// DefaultGeometry is vLLM's V4 geometry: window 128 in 64-token pages, 256-token
// compressed blocks.
var DefaultGeometry = Geometry{Window: 128, SWAPage: 64, RawPage: 256}

// LayerSpec says what one layer caches and how it stores it.
type LayerSpec struct {
	Ratio       int    // 0 (SWA), 4 (CSA) or 128 (HCA)
	KVLayout    Layout // window and compressed rows: v4-model1 or bf16 (dim 512)
	IndexLayout Layout // indexer keys (r = 4): indexer-fp8, indexer-mxfp4 or bf16 (dim 128)
}

// LayerCache holds the three per-layer caches of spec §2.2 as an engine pages
// them, for one request of up to MaxTokens tokens:
//
//	Window     entries = tokens, 512 wide      (every layer)
//	Compressed entries = compressed rows j      (r > 0)
//	Index      entries = indexer keys j         (r = 4)
//	State, IndexState: fp32 compressor state per token (r > 0; IndexState r = 4)
//
// Each pool has its own block table; NewLayerCache gives every request page a
// physical page in order (an identity table), which tests and the replay then
// overwrite with the dump's tables.
type LayerCache struct {
	Spec       LayerSpec
	Geo        Geometry
	Window     *Pool
	Compressed *Pool       // nil when r = 0
	Index      *Pool       // nil unless r = 4
	State      *StatePool  // nil when r = 0
	IndexState *StatePool  // nil unless r = 4
	MaxTokens  int         //
	written    map[int]int // window logical entry → token held (for ring bookkeeping)
}

// NewLayerCache allocates the caches of one layer for maxTokens tokens.
func NewLayerCache(spec LayerSpec, g Geometry, maxTokens int) (*LayerCache, error) {
	if spec.Ratio != 0 && spec.Ratio != 4 && spec.Ratio != 128 {
		return nil, fmt.Errorf("kvcache: compress ratio %d is not 0, 4 or 128", spec.Ratio)
	}
	if g.Window <= 0 || g.SWAPage <= 0 || maxTokens <= 0 {
		return nil, fmt.Errorf("kvcache: geometry %+v / %d tokens out of range", g, maxTokens)
	}
	c := &LayerCache{Spec: spec, Geo: g, MaxTokens: maxTokens, written: map[int]int{}}
	winEntries := maxTokens
	if g.WindowRing {
		winEntries = g.Window
	}
	var err error
	if c.Window, err = newIdentityPool(spec.KVLayout, 512, g.SWAPage, winEntries); err != nil {
		return nil, err
	}
	if spec.Ratio == 0 {
		return c, nil
	}
	if g.RawPage <= 0 || g.RawPage%spec.Ratio != 0 {
		return nil, fmt.Errorf("kvcache: compressed page of %d raw tokens is not a multiple of ratio %d", g.RawPage, spec.Ratio)
	}
	if c.Compressed, err = newIdentityPool(spec.KVLayout, 512, g.RawPage/spec.Ratio, maxTokens/spec.Ratio); err != nil {
		return nil, err
	}
	sp := g.StatePage
	if sp == 0 {
		sp = coffOf(spec.Ratio) * spec.Ratio
	}
	c.State = NewStatePool(spec.Ratio, 512, sp, maxTokens)
	if spec.Ratio == 4 {
		if c.Index, err = newIdentityPool(spec.IndexLayout, 128, g.RawPage/4, maxTokens/4); err != nil {
			return nil, err
		}
		c.IndexState = NewStatePool(4, 128, sp, maxTokens)
	}
	return c, nil
}

func newIdentityPool(l Layout, dim, P, entries int) (*Pool, error) {
	f, err := NewFormat(l, dim, P)
	if err != nil {
		return nil, err
	}
	pages := (entries + P - 1) / P
	p := NewPool(f, pages)
	p.Table = make(BlockTable, pages)
	for i := range p.Table {
		p.Table[i] = int32(i)
	}
	return p, nil
}

// WindowEntry is the logical window entry of token t: t mod Window for the
// reference ring, t for paged SWA.
func (c *LayerCache) WindowEntry(t int) int {
	if c.Geo.WindowRing {
		return t % c.Geo.Window
	}
	return t
}

// WriteWindow stores token t's window row (the FQ8'd K, 512 values).
func (c *LayerCache) WriteWindow(t int, row []float32, sc Scaling) error {
	if err := c.Window.Write(c.WindowEntry(t), row, sc); err != nil {
		return fmt.Errorf("window token %d: %w", t, err)
	}
	c.written[c.WindowEntry(t)] = t
	return nil
}

// ReadWindow decodes token t's window row. It fails when t is outside the
// window of the newest token written (the ring slot holds a later token).
func (c *LayerCache) ReadWindow(dst []float32, t int) (Faults, error) {
	if held, ok := c.written[c.WindowEntry(t)]; c.Geo.WindowRing && ok && held != t {
		return nil, fmt.Errorf("kvcache: window slot %d holds token %d, not %d", c.WindowEntry(t), held, t)
	}
	return c.Window.Read(dst, c.WindowEntry(t))
}

// WriteCompressed stores compressed row j; ReadCompressed decodes it.
func (c *LayerCache) WriteCompressed(j int, row []float32, sc Scaling) error {
	if c.Compressed == nil {
		panic("kvcache: WriteCompressed on a layer without compression")
	}
	return c.Compressed.Write(j, row, sc)
}

func (c *LayerCache) ReadCompressed(dst []float32, j int) (Faults, error) {
	if c.Compressed == nil {
		panic("kvcache: ReadCompressed on a layer without compression")
	}
	return c.Compressed.Read(dst, j)
}

// WriteIndex stores indexer key j (128 values); ReadIndex decodes it.
func (c *LayerCache) WriteIndex(j int, key []float32, sc Scaling) error {
	if c.Index == nil {
		panic("kvcache: WriteIndex on a layer without an indexer")
	}
	return c.Index.Write(j, key, sc)
}

func (c *LayerCache) ReadIndex(dst []float32, j int) (Faults, error) {
	if c.Index == nil {
		panic("kvcache: ReadIndex on a layer without an indexer")
	}
	return c.Index.Read(dst, j)
}

// ReferenceKV rebuilds the reference's kv_cache tensor after decode step p
// (spec §2.2, golden key L<l>.kv_cache): bf16 [128 + Tc, 512] (r > 0) or
// [128, 512] (r = 0), Tc = (p+1) div r. Row s < 128 holds the newest token
// t ≤ p with t mod 128 = s (zeros when no such token exists); row 128+j holds
// compressed row j. The tensor is returned row-major with its row count (the
// package stays below engine, which may import it). Faults of every decoded
// entry are returned with the row.
func (c *LayerCache) ReferenceKV(p int) (kv []float32, rows int, faults []GatherFault, err error) {
	W := c.Geo.Window
	tc := 0
	if c.Spec.Ratio > 0 {
		tc = (p + 1) / c.Spec.Ratio
	}
	rows = W + tc
	kv = make([]float32, rows*512)
	for s := 0; s < W; s++ {
		t := p - ((p-s)%W+W)%W // newest t ≤ p with t ≡ s (mod W)
		if t < 0 {
			continue
		}
		fs, err := c.ReadWindow(kv[s*512:(s+1)*512], t)
		if err != nil {
			return kv, rows, faults, fmt.Errorf("kv_cache row %d: %w", s, err)
		}
		for _, f := range fs {
			faults = append(faults, GatherFault{Index: s, Pos: t, Fault: f})
		}
	}
	for j := 0; j < tc; j++ {
		fs, err := c.ReadCompressed(kv[(W+j)*512:(W+j+1)*512], j)
		if err != nil {
			return kv, rows, faults, fmt.Errorf("kv_cache row %d: %w", W+j, err)
		}
		for _, f := range fs {
			faults = append(faults, GatherFault{Index: W + j, Pos: j, Fault: f})
		}
	}
	return kv, rows, faults, nil
}

// GatherIndexList decodes the rows an attention index list names at decode
// step p, in the reference's index space (spec §4, golden key topk_idxs):
// entry i < Window is window ring slot i (the newest token t ≤ p with
// t mod Window = i), entry Window+j is compressed row j, -1 is empty (a zero
// row, as the sparse kernel reads it). dst gets len(idx)·512 values. Faults
// carry the list position (Index) and the token or row read (Pos).
func (c *LayerCache) GatherIndexList(dst []float32, idx []int64, p int) ([]GatherFault, error) {
	if len(dst) < len(idx)*512 {
		panic("kvcache: GatherIndexList destination too short")
	}
	W := c.Geo.Window
	var out []GatherFault
	for i, x := range idx {
		row := dst[i*512 : (i+1)*512]
		var fs Faults
		var err error
		pos := int(x)
		switch {
		case x == -1:
			clear(row)
			continue
		case x < 0:
			return out, fmt.Errorf("index list entry %d: %d is negative (only -1 means empty)", i, x)
		case x < int64(W):
			pos = p - ((p-int(x))%W+W)%W
			if pos < 0 {
				return out, fmt.Errorf("index list entry %d: window slot %d holds no token at step %d", i, x, p)
			}
			fs, err = c.ReadWindow(row, pos)
		default:
			pos = int(x) - W
			if c.Compressed == nil || pos >= (p+1)/c.Spec.Ratio {
				return out, fmt.Errorf("index list entry %d: compressed row %d is not visible at step %d", i, pos, p)
			}
			fs, err = c.ReadCompressed(row, pos)
		}
		if err != nil {
			return out, fmt.Errorf("index list entry %d: %w", i, err)
		}
		for _, f := range fs {
			out = append(out, GatherFault{Index: i, Pos: pos, Fault: f})
		}
	}
	return out, nil
}

func coffOf(ratio int) int {
	if ratio == 4 {
		return 2
	}
	return 1
}

// StatePool is a compressor's fp32 state stored per token, as vLLM pages it:
// token t's row is [a_t | s_t] (kv then score+ape), each coff·D wide, at
// logical entry t, TokensPerPage tokens per page. The reference keeps the same
// values in kv_state/score_state [coff·r, coff·D]; Reference converts.
type StatePool struct {
	Ratio, D      int
	TokensPerPage int
	Data          []float32 // pages · TokensPerPage · 2·coff·D
	Table         BlockTable
	written       []bool // per logical token
}

// NewStatePool allocates state for maxTokens tokens with an identity table.
func NewStatePool(ratio, d, tokensPerPage, maxTokens int) *StatePool {
	if ratio <= 0 || d <= 0 || tokensPerPage <= 0 || maxTokens <= 0 {
		panic("kvcache: NewStatePool arguments must be positive")
	}
	pages := (maxTokens + tokensPerPage - 1) / tokensPerPage
	s := &StatePool{Ratio: ratio, D: d, TokensPerPage: tokensPerPage,
		Data: make([]float32, pages*tokensPerPage*2*coffOf(ratio)*d), Table: make(BlockTable, pages),
		written: make([]bool, pages*tokensPerPage)}
	for i := range s.Table {
		s.Table[i] = int32(i)
	}
	return s
}

// Width is coff·D, the width of a_t and of s_t.
func (s *StatePool) Width() int { return coffOf(s.Ratio) * s.D }

// Rows is coff·r, the number of rows of the reference kv_state / score_state.
func (s *StatePool) Rows() int { return coffOf(s.Ratio) * s.Ratio }

// Row returns token t's state row (a_t and s_t, views into the pool).
func (s *StatePool) Row(t int) (kv, score []float32, err error) {
	slot, err := s.Table.Slot(t, s.TokensPerPage)
	if err != nil {
		return nil, nil, err
	}
	w := s.Width()
	if (slot+1)*2*w > len(s.Data) {
		return nil, nil, fmt.Errorf("kvcache: state token %d maps to slot %d outside the pool", t, slot)
	}
	r := s.Data[slot*2*w : (slot+1)*2*w]
	return r[:w], r[w:], nil
}

// Store writes token t's a_t (kv) and s_t = b_t + ape[t mod r] (score).
func (s *StatePool) Store(t int, kv, score []float32) error {
	dk, ds, err := s.Row(t)
	if err != nil {
		return err
	}
	if len(kv) != len(dk) || len(score) != len(ds) {
		panic("kvcache: StatePool.Store row width mismatch")
	}
	copy(dk, kv)
	copy(ds, score)
	if t < len(s.written) {
		s.written[t] = true
	}
	return nil
}

// ReferenceTokens lists, for each row of the reference kv_state/score_state
// [coff·r, coff·D] after decode step p, the token whose values it holds
// (-1 = never written: kv 0, score −∞), following spec §5's state machine:
//
//	r = 128: row i holds the newest token t ≤ p with t mod 128 = i
//	r = 4:   row 4+i holds the newest t ≤ p with t mod 4 = i; rows 0..3 hold the
//	         group before the current one (after an emission at p, when
//	         (p+1) mod 4 = 0, rows 0..3 = rows 4..7 = the group just completed)
func (s *StatePool) ReferenceTokens(p int) []int {
	r := s.Ratio
	newest := func(i int) int { return p - ((p-i)%r+r)%r }
	if r != 4 {
		out := make([]int, r)
		for i := range out {
			out[i] = max(newest(i), -1)
		}
		return out
	}
	out := make([]int, 8)
	g := p / 4 * 4 // first token of p's group
	prev := g - 4
	if (p+1)%4 == 0 {
		prev = g // shifted after emission
	}
	for i := 0; i < 4; i++ {
		out[i] = max(prev+i, -1)
		out[4+i] = max(newest(i), -1)
	}
	return out
}

// Reference rebuilds the reference kv_state and score_state after decode step
// p (fp32 [coff·r, coff·D] each, row-major: Rows() × Width()) from the
// per-token rows.
func (s *StatePool) Reference(p int) (kv, score []float32, err error) {
	rows, w := s.Rows(), s.Width()
	kv = make([]float32, rows*w)
	score = make([]float32, rows*w)
	ninf := float32(math.Inf(-1))
	for i, t := range s.ReferenceTokens(p) {
		dk, ds := kv[i*w:(i+1)*w], score[i*w:(i+1)*w]
		if t < 0 {
			for c := range ds {
				ds[c] = ninf
			}
			continue
		}
		a, b, err := s.Row(t)
		if err != nil {
			return kv, score, fmt.Errorf("state row %d (token %d): %w", i, t, err)
		}
		copy(dk, a)
		copy(ds, b)
	}
	return kv, score, nil
}
