package prodkernel

import (
	"fmt"
	"slices"

	"sparsemla/engine"
	"sparsemla/kvcache"
	"sparsemla/replay"
)

// Overlay is a replay.Source: a golden dump whose stages a production kernel
// computed are replaced by the kernel's values, with the kernel's KV pages
// attached (replay.PageSource).
type Overlay struct {
	replay.Source
	Over  map[replay.StageKey]engine.Tensor
	pages map[[2]int64][]replay.Page
	name  string
}

// NewOverlay wraps src; name is how reports name it.
func NewOverlay(src replay.Source, name string) *Overlay {
	return &Overlay{Source: src, Over: map[replay.StageKey]engine.Tensor{}, pages: map[[2]int64][]replay.Page{}, name: name}
}

// Name implements replay.Source.
func (o *Overlay) Name() string { return o.name }

// Stage implements replay.Source: the kernel's value where it computed one.
func (o *Overlay) Stage(step int64, layer int, stage string) (engine.Tensor, bool, error) {
	if t, ok := o.Over[replay.StageKey{Step: step, Layer: layer, Stage: stage}]; ok {
		return t, true, nil
	}
	return o.Source.Stage(step, layer, stage)
}

// Pages implements replay.PageSource.
func (o *Overlay) Pages(step int64, layer int) ([]replay.Page, error) {
	return o.pages[[2]int64{step, int64(layer)}], nil
}

// SetPages attaches the KV pages of (step, layer).
func (o *Overlay) SetPages(step int64, layer int, pages []replay.Page) {
	o.pages[[2]int64{step, int64(layer)}] = pages
}

// DecodeEntry decodes one MODEL1 entry (576 data bytes then 8 scale bytes, as
// the harness extracts them from a page) to 512 values, with the faults the
// codec finds (a scale byte no encoder writes, NaN codes).
func DecodeEntry(e []byte) ([]float32, kvcache.Faults, error) {
	if len(e) != kvcache.Model1EntryBytes {
		return nil, nil, fmt.Errorf("prodkernel: MODEL1 entry of %d bytes, want %d", len(e), kvcache.Model1EntryBytes)
	}
	f := kvcache.MustFormat(kvcache.LayoutV4Model1, 0, 1)
	page := make([]byte, f.PageBytes())
	copy(page, e[:kvcache.Model1DataBytes])
	copy(page[kvcache.Model1DataBytes:], e[kvcache.Model1DataBytes:])
	out := make([]float32, f.Dim)
	faults := f.DecodeEntry(out, page, 0, nil)
	return out, faults, nil
}

// WindowK is the output of a window-K cache writer (vLLM's
// quantize_and_insert_k_cache, SGLang's quant_k_cache + set_k_and_s) over a
// golden dump: per step and layer the MODEL1 entries it wrote from the
// pre-quantisation rows (window slot p mod 128 from kv_roped; compressed row
// 128 + p div r from cmp_roped), and the full pages after the last step.
type WindowK struct {
	Prefix string // "vllm_k", "sglang_k"
	// Entries[(step, layer)] maps a cache row to its 584 stored bytes.
	Entries map[[2]int64]map[int][]byte
	// Pages[(step, layer)]: the physical pages (index = page id) and block
	// table, where the run kept them.
	Pages map[[2]int64]PageSet
}

// PageSet is a layer's MODEL1 pages and block table.
type PageSet struct {
	Data  [][]byte // by physical page id
	Table []int
}

// LoadWindowK reads a window-K writer's outputs (names PREFIX.pP.LL.entries /
// .rows / .pages / .block_table) for the given steps and layers.
func LoadWindowK(r *Run, prefix string, steps []int64, layers []int) (*WindowK, error) {
	w := &WindowK{Prefix: prefix, Entries: map[[2]int64]map[int][]byte{}, Pages: map[[2]int64]PageSet{}}
	for _, p := range steps {
		for _, l := range layers {
			base := fmt.Sprintf("%s.p%d.L%d.", prefix, p, l)
			if !r.Has(base + "entries") {
				continue
			}
			ent, shape, err := r.Bytes(base + "entries")
			if err != nil {
				return nil, err
			}
			rows, err := r.Ints(base + "rows")
			if err != nil {
				return nil, err
			}
			if len(shape) != 2 || shape[1] != kvcache.Model1EntryBytes || shape[0] != len(rows) {
				return nil, fmt.Errorf("prodkernel: %s: %sentries shape %v for %d rows", r.Path, base, shape, len(rows))
			}
			m := map[int][]byte{}
			for i, row := range rows {
				m[int(row)] = ent[i*kvcache.Model1EntryBytes : (i+1)*kvcache.Model1EntryBytes]
			}
			w.Entries[[2]int64{p, int64(l)}] = m
			if r.Has(base + "pages") {
				data, ps, err := r.Bytes(base + "pages")
				if err != nil {
					return nil, err
				}
				tab, err := r.Ints(base + "block_table")
				if err != nil {
					return nil, err
				}
				if len(ps) != 2 || ps[1] != model1.PageBytes() {
					return nil, fmt.Errorf("prodkernel: %s: %spages shape %v, want [n, %d]", r.Path, base, ps, model1.PageBytes())
				}
				set := PageSet{}
				for i := 0; i < ps[0]; i++ {
					set.Data = append(set.Data, data[i*ps[1]:(i+1)*ps[1]])
				}
				for _, v := range tab {
					if v < 0 || int(v) >= ps[0] {
						return nil, fmt.Errorf("prodkernel: %s: %sblock_table names page %d of %d", r.Path, base, v, ps[0])
					}
					set.Table = append(set.Table, int(v))
				}
				w.Pages[[2]int64{p, int64(l)}] = set
			}
		}
	}
	return w, nil
}

// Apply puts the writer's values into o: at each step and layer the decoded
// window row is the stage kv, a decoded compressed row the stage cmp_row, and
// the layer's kv_cache holds them (the other rows are the dump's); the pages
// are attached for the kv_pages check. A decoding fault is returned as an
// error naming the entry.
func (w *WindowK) Apply(o *Overlay, window int) error {
	keys := make([][2]int64, 0, len(w.Entries))
	for k := range w.Entries {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b [2]int64) int {
		if a[0] != b[0] {
			return int(a[0] - b[0])
		}
		return int(a[1] - b[1])
	})
	for _, k := range keys {
		p, l := k[0], int(k[1])
		kvc, ok, err := o.Source.Stage(p, l, "kv_cache")
		if err != nil || !ok {
			return fmt.Errorf("prodkernel: step %d layer %d: dump has no kv_cache (%v)", p, l, err)
		}
		if len(kvc.Shape) != 2 || kvc.Shape[1] != model1.Dim || len(kvc.F) != kvc.Shape[0]*model1.Dim {
			return fmt.Errorf("prodkernel: step %d layer %d: kv_cache shape %v, want [rows, %d]", p, l, kvc.Shape, model1.Dim)
		}
		kvc = cloneTensor(kvc)
		D := kvc.Shape[1]
		rows := make([]int, 0, len(w.Entries[k]))
		for row := range w.Entries[k] {
			rows = append(rows, row)
		}
		slices.Sort(rows)
		for _, row := range rows {
			v, faults, err := DecodeEntry(w.Entries[k][row])
			if err != nil {
				return err
			}
			if len(faults) > 0 {
				return fmt.Errorf("prodkernel: %s step %d layer %d row %d: %v", w.Prefix, p, l, row, faults[0])
			}
			if row < 0 || row >= kvc.Shape[0] {
				return fmt.Errorf("prodkernel: %s step %d layer %d: row %d outside kv_cache %v", w.Prefix, p, l, row, kvc.Shape)
			}
			copy(kvc.F[row*D:(row+1)*D], v)
			stage := "kv"
			if row >= window {
				stage = "cmp_row"
			}
			ref, ok, err := o.Source.Stage(p, l, stage)
			if err != nil || !ok {
				return fmt.Errorf("prodkernel: step %d layer %d: dump has no %s (%v)", p, l, stage, err)
			}
			if len(ref.F) != len(v) {
				return fmt.Errorf("prodkernel: step %d layer %d: %s has %d values, want %d", p, l, stage, len(ref.F), len(v))
			}
			t := cloneTensor(ref)
			copy(t.F, v)
			o.Over[replay.StageKey{Step: p, Layer: l, Stage: stage}] = t
		}
		if set, ok := w.Pages[k]; ok {
			// Where the pages are kept, the cache is what they hold (an entry
			// never written, all zero bytes, holds zeros).
			for row := 0; row < kvc.Shape[0]; row++ {
				b := row / PageEntries
				if b >= len(set.Table) {
					return fmt.Errorf("prodkernel: %s step %d layer %d: row %d beyond the block table (%d blocks)", w.Prefix, p, l, row, len(set.Table))
				}
				dst := kvc.F[row*D : (row+1)*D]
				clear(dst)
				if entryZero(set.Data[set.Table[b]], row%PageEntries) {
					continue
				}
				if faults := model1.DecodeEntry(dst, set.Data[set.Table[b]], row%PageEntries, nil); len(faults) > 0 {
					return fmt.Errorf("prodkernel: %s step %d layer %d page %d: %v", w.Prefix, p, l, set.Table[b], faults[0])
				}
			}
			var pages []replay.Page
			for id, data := range set.Data {
				pages = append(pages, replay.Page{Layout: "v4-model1", PageID: id, BlockSize: PageEntries, BlockTable: set.Table, Data: data,
					Origin: fmt.Sprintf("%s step %d layer %d", w.Prefix, p, l)})
			}
			o.SetPages(p, l, pages)
		}
		o.Over[replay.StageKey{Step: p, Layer: l, Stage: "kv_cache"}] = kvc
	}
	return nil
}

func cloneTensor(t engine.Tensor) engine.Tensor {
	return engine.Tensor{Kind: t.Kind, Shape: slices.Clone(t.Shape), F: slices.Clone(t.F), I: slices.Clone(t.I)}
}

// entryZero says whether every byte of entry e of a MODEL1 page is zero.
func entryZero(page []byte, e int) bool {
	d := page[e*kvcache.Model1DataBytes : (e+1)*kvcache.Model1DataBytes]
	s0 := PageEntries*kvcache.Model1DataBytes + e*kvcache.Model1ScaleBytes
	for _, b := range append(slices.Clone(d), page[s0:s0+kvcache.Model1ScaleBytes]...) {
		if b != 0 {
			return false
		}
	}
	return true
}
