package replay

import (
	"fmt"
	"math"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/kvcache"
	"sparsemla/userfile"
)

// KV pages of V4.1 dumps. A layer's caches after step p are held as page
// records (kind page, stage "<cache>/<n>", cache window, ckv or icache) in
// the V4.1 row layouts of kvcache.V41Row: window K as 528-byte FP8 rows
// (v41-window-fp8), compressed KV as 288-byte FP4 rows with E4M3 scales
// (v41-kv-fp4, KV sources), index keys as 68-byte FP4 rows (v41-index-fp4,
// index sources owning keys). Cache row i (the window slot, or the
// compressed / index row j) is entry i mod block_size of the page the block
// table maps logical block i div block_size to.
//
// The replay reads them two ways. When the dump also holds the cache as a
// tensor (window / kv_cache, ckv, icache), the page bytes must encode those
// rows (stage <cache>_pages, teacher-forced like V4's kv_pages). When it
// holds only the pages, they are decoded into the GPU's value of the cache
// stage (and of kv, the window row just written), so that the replay's cache
// checks apply to them, and the pages are compared with the reference's rows
// first, so that a corrupted byte (a scale byte, a code) is named with its
// page, entry and field.

// v41PageCaches are the caches a V4.1 page record can hold, by stage prefix.
var v41PageCaches = []string{"window", "ckv", "icache"}

// v41CacheRows is the number of rows cache holds at layer l after step p,
// or false when the layer has no such cache.
func v41CacheRows(cfg *engine.Config, l int, cache string, p int64) (int, bool) {
	switch cache {
	case "window":
		return cfg.WindowSize, true
	case "ckv":
		if cfg.IsKVSource(l) {
			return attention.VisibleRows(p, cfg.Ratio(l)), true
		}
	case "icache":
		if cfg.IsKVSource(l) && cfg.IsIndexSource(l) {
			return attention.VisibleRows(p, cfg.Ratio(l)), true
		}
	}
	return 0, false
}

// loadV41Pages reads the page records of request into d.pages, checking
// each one's stage, layout, geometry and block table.
func (d *V41Dump) loadV41Pages(dd *dump.Dump, request string) error {
	cfg := d.Cfg
	for i := range dd.Entries {
		e := &dd.Entries[i]
		if e.Kind != dump.KindPage || e.Request != request {
			continue
		}
		where := fmt.Sprintf("dump %s: record %d (%s) at offset %d", e.File, e.Record, e.Key, e.Offset)
		cache, _, _ := strings.Cut(e.Stage, "/")
		layout, ok := V41PageLayouts[cache]
		if !ok {
			return fmt.Errorf("%s: page record of stage %q: V4.1 pages are window/<n>, ckv/<n> or icache/<n>", where, e.Stage)
		}
		if e.Layer < 0 || e.Layer >= cfg.NLayers {
			return fmt.Errorf("%s: page of layer %d outside the model (%d layers)", where, e.Layer, cfg.NLayers)
		}
		if _, held := d.step[int64(e.Step)]; !held {
			return fmt.Errorf("%s: page of step %d, which the dump holds no stages of", where, e.Step)
		}
		rows, ok := v41CacheRows(cfg, e.Layer, cache, int64(e.Step))
		if !ok {
			return fmt.Errorf("%s: layer %d has no %s cache (KV sources %v, index sources %v)", where, e.Layer, cache, cfg.KVSources(), cfg.IndexSources())
		}
		if e.Page == nil {
			return fmt.Errorf("%s: page record without page info", where)
		}
		if e.Page.Layout != layout {
			return fmt.Errorf("%s: %s page of layout %s, want %s", where, cache, userfile.Quote(e.Page.Layout), layout)
		}
		row, _ := kvcache.ParseV41Row(layout)
		B := e.Page.BlockSize
		if B <= 0 || B > 1<<20 {
			return fmt.Errorf("%s: block size %d out of range [1, 2^20]", where, B)
		}
		if e.NBytes != int64(B*row.RowBytes()) {
			return fmt.Errorf("%s: %s page of %d bytes, want %d (%d entries of %d B)", where, layout, e.NBytes, B*row.RowBytes(), B, row.RowBytes())
		}
		if need := (rows + B - 1) / B; len(e.Page.BlockTable) < need {
			return fmt.Errorf("%s: block table of %d blocks, the %d rows of %s need %d", where, len(e.Page.BlockTable), rows, cache, need)
		}
		rec, err := dd.Read(e)
		if err != nil {
			return err
		}
		key := fmt.Sprintf("L%d.%s", e.Layer, cache)
		p := int64(e.Step)
		if d.pages[p] == nil {
			d.pages[p] = map[string][]Page{}
		}
		for _, o := range d.pages[p][key] {
			if o.PageID == e.Page.PageID {
				return fmt.Errorf("%s: a second page %d of %s", where, e.Page.PageID, key)
			}
			if o.BlockSize != B || !slicesEqual(o.BlockTable, e.Page.BlockTable) {
				return fmt.Errorf("%s: block size / block table differ from those of page %d of the same cache (%s)", where, o.PageID, o.Origin)
			}
		}
		d.pages[p][key] = append(d.pages[p][key], Page{Layout: layout, PageID: e.Page.PageID, BlockSize: B,
			BlockTable: append([]int(nil), e.Page.BlockTable...), Data: rec.Data, Origin: where})
	}
	return nil
}

func slicesEqual(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// v41PageEntry locates cache row i in pages: its page and the bytes of its
// entry; "" or a sentence saying why the row is not in the pages.
func v41PageEntry(pages []Page, row kvcache.V41Row, i int) (Page, []byte, string) {
	pg0 := pages[0]
	B := pg0.BlockSize
	b := i / B
	if b >= len(pg0.BlockTable) {
		return Page{}, nil, fmt.Sprintf("cache row %d: logical block %d is not in the block table (%d blocks)", i, b, len(pg0.BlockTable))
	}
	id := pg0.BlockTable[b]
	for _, pg := range pages {
		if pg.PageID == id {
			n := row.RowBytes()
			e := i % B
			return pg, pg.Data[e*n : (e+1)*n], ""
		}
	}
	return Page{}, nil, fmt.Sprintf("cache row %d: logical block %d maps to page %d, which the dump does not hold", i, b, id)
}

// v41LiveRows lists the rows of cache that hold data after step p: window
// slots of tokens 0 … p, every compressed / index row.
func v41LiveRows(cache string, rows int, p int64) []int {
	var out []int
	for i := 0; i < rows; i++ {
		if cache != "window" || int64(i) <= p {
			out = append(out, i)
		}
	}
	return out
}

// decodeV41Pages decodes the pages of a cache into its rows [rows, dims]
// (bf16); rows no page holds, and window slots not yet written, are zero. A
// NaN scale or code decodes to NaN (compareV41Pages names it).
func decodeV41Pages(cache string, pages []Page, rows int, p int64) (engine.Tensor, string) {
	row, _ := kvcache.ParseV41Row(pages[0].Layout)
	dims := row.Dims()
	out := make([]float32, rows*dims)
	for _, i := range v41LiveRows(cache, rows, p) {
		_, b, why := v41PageEntry(pages, row, i)
		if why != "" {
			return engine.Tensor{}, why
		}
		_ = row.DecodeRow(out[i*dims:(i+1)*dims], b)
	}
	return engine.FromF(engine.KindBF16, out, rows, dims), ""
}

// compareV41Pages checks that the pages of a cache encode rows (the dumped
// rows, or the reference's): each live row's entry must decode exactly to
// it (any exact scale choice); the first that does not is encoded with the
// model's scale rule and compared byte by byte. "" when every live row
// agrees, else the first difference, in cache-row order.
func compareV41Pages(cache string, pages []Page, rows engine.Tensor, p int64) string {
	row, _ := kvcache.ParseV41Row(pages[0].Layout)
	dims := row.Dims()
	n := len(rows.F) / max(dims, 1)
	got := make([]float32, dims)
	want := make([]byte, row.RowBytes())
	for _, i := range v41LiveRows(cache, n, p) {
		pg, b, why := v41PageEntry(pages, row, i)
		if why != "" {
			return why
		}
		ref := rows.F[i*dims : (i+1)*dims]
		derr := row.DecodeRow(got, b)
		same := derr == nil
		for k := range got {
			if same && math.Float32bits(got[k]) != math.Float32bits(ref[k]) && !(got[k] == 0 && ref[k] == 0) {
				same = false
			}
		}
		if same {
			continue
		}
		e := i % pg.BlockSize
		at := fmt.Sprintf("%s page %d (logical block %d, cache rows %d..%d), entry %d = cache row %d", pg.Layout, pg.PageID, i/pg.BlockSize, i/pg.BlockSize*pg.BlockSize, i/pg.BlockSize*pg.BlockSize+pg.BlockSize-1, e, i)
		if allFinite(ref) {
			row.EncodeRow(want, ref)
			if d := row.CompareRows(b, want); d != nil {
				msg := fmt.Sprintf("%s: %s", at, d)
				if derr != nil {
					msg += " — " + strings.TrimPrefix(derr.Error(), "kvcache: ")
				}
				return msg
			}
		}
		if derr != nil {
			return fmt.Sprintf("%s: %s", at, strings.TrimPrefix(derr.Error(), "kvcache: "))
		}
		for k := range got {
			if math.Float32bits(got[k]) != math.Float32bits(ref[k]) {
				return fmt.Sprintf("%s: dim %d decodes to %g, the row holds %g", at, k, got[k], ref[k])
			}
		}
	}
	return ""
}

func allFinite(v []float32) bool {
	for _, x := range v {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return false
		}
	}
	return true
}

// v41CacheName is the cache a V4.1 stage's value is read from in the pages:
// window and kv (its row p mod W) from the window pages, ckv, icache.
func v41CacheName(stage string) string {
	if stage == "kv" {
		return "window"
	}
	return stage
}

// v41FromPages is the GPU's value of a cache stage (window, kv, ckv,
// icache) at (p, l) decoded from the dump's pages, when the dump holds
// pages of that cache; why says when the pages do not cover the cache.
func (d *V41Dump) v41FromPages(p int64, l int, stage string) (t engine.Tensor, pages []Page, ok bool, why string) {
	cache := v41CacheName(stage)
	pages = d.pages[p][fmt.Sprintf("L%d.%s", l, cache)]
	if len(pages) == 0 {
		return engine.Tensor{}, nil, false, ""
	}
	rows, _ := v41CacheRows(d.Cfg, l, cache, p)
	live := len(v41LiveRows(cache, rows, p))
	if B := pages[0].BlockSize; len(pages) < (live+B-1)/B {
		// before allocating the rows: the pages must be able to hold them
		return engine.Tensor{}, pages, false, fmt.Sprintf("its %d live rows need %d pages of %d entries, the dump holds %d", live, (live+B-1)/B, B, len(pages))
	}
	t, why = decodeV41Pages(cache, pages, rows, p)
	if why != "" {
		return engine.Tensor{}, pages, false, why
	}
	if stage == "kv" {
		D := d.Cfg.HeadDim
		s := int(p%int64(d.Cfg.WindowSize)) * D
		t = engine.FromF(engine.KindBF16, t.F[s:s+D], D)
	}
	return t, pages, true, ""
}

// v41PageResult is the <cache>_pages result of (p, l): the pages of cache
// compared with rows (vsDump: the dumped rows, else the reference's).
func (d *V41Dump) v41PageResult(p int64, l int, cache string, rows engine.Tensor, vsDump bool, rowStatus string) (StageResult, bool) {
	pages := d.pages[p][fmt.Sprintf("L%d.%s", l, cache)]
	if len(pages) == 0 || (cache == "window" && len(rows.F) != d.Cfg.WindowSize*d.Cfg.HeadDim) {
		return StageResult{}, false
	}
	from, eq := FromDump, fmt.Sprintf("%s_pages = the GPU's %s page bytes (%s rows), entry by entry, encode the dumped %s rows", cache, cache, pages[0].Layout, cache)
	if !vsDump {
		from, eq = "reference", fmt.Sprintf("%s_pages = the GPU's %s page bytes (%s rows), entry by entry, encode the reference's %s rows", cache, cache, pages[0].Layout, cache)
	}
	sr := StageResult{Step: p, Layer: l, Stage: cache + "_pages", Tol: string(TolExact), Shape: rows.Shape, Equation: eq,
		Inputs: []InputInfo{{Name: cache, From: from, Status: inputStatus(rowStatus)}}}
	if !vsDump {
		sr.Inputs[0].Status = "matched"
	}
	if why := compareV41Pages(cache, pages, rows, p); why == "" {
		sr.Status = StatusPass
	} else {
		sr.Status, sr.Reason, sr.Severity = StatusFail, why, 1.5
	}
	return sr, true
}

// v41PageDivergence is the first divergence of a failing <cache>_pages.
func v41PageDivergence(sr StageResult, mode Mode, vsDump bool) *Divergence {
	why := "the GPU's page bytes do not encode the reference's rows: " + sr.Reason
	if vsDump {
		why = "the dumped " + strings.TrimSuffix(sr.Stage, "_pages") + " rows matched, but the GPU's page bytes do not encode them: " + sr.Reason
	}
	kind := KindFP8Cache // window K: FP8 rows
	if sr.Stage != "window_pages" {
		kind = KindCache // compressed rows and index keys: FP4 rows
	}
	dv := &Divergence{Step: sr.Step, Layer: sr.Layer, Stage: sr.Stage, Kind: kind, Mode: string(mode), Inputs: sr.Inputs, Why: why,
		Hint: "check the cache writer of this step: the V4.1 row layouts (528 B FP8 window rows with UE8M0 per 32, 288 B FP4 compressed rows with E4M3 per 16, 68 B FP4 index keys with UE8M0 per 32), codes then scales, the block table"}
	dv.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", sr.Step, sr.Layer, sr.Stage, kind, why)
	return dv
}

// stepCaches is the step p's dumped tensors with, for every layer whose
// caches the dump holds only as pages, the window, ckv and icache decoded
// from them (StateBefore reads the state after p from these).
func (d *V41Dump) stepCaches(p int64) (map[string]engine.Tensor, error) {
	t := d.step[p]
	if len(d.pages[p]) == 0 {
		return t, nil
	}
	out := make(map[string]engine.Tensor, len(t)+len(d.pages[p]))
	for k, v := range t {
		out[k] = v
	}
	for l := 0; l < d.Cfg.NLayers; l++ {
		if _, ok := t[fmt.Sprintf("L%d.kv_cache", l)]; ok {
			continue
		}
		for _, c := range v41PageCaches {
			k := fmt.Sprintf("L%d.%s", l, c)
			if _, ok := out[k]; ok {
				continue
			}
			v, _, ok, why := d.v41FromPages(p, l, c)
			if why != "" {
				return nil, fmt.Errorf("%s: step %d layer %d %s pages: %s", d.Dir, p, l, c, why)
			}
			if ok {
				out[k] = v
			}
		}
	}
	return out, nil
}

// v41PagesBefore runs in V41Run's hook before a stage is judged: when the
// dump holds the cache stage (window, kv, ckv, icache) only as pages, the
// GPU's value becomes the decoded pages (fromPages), and the pages are first
// compared with the reference's rows (window, ckv, icache: <cache>_pages).
func (d *V41Dump) v41PagesBefore(rep *Report, gpu *engine.Tensor, ok *bool, p int64, l int, stage string, ref engine.Tensor, mode Mode) (bool, error) {
	if *ok || (stage != "kv" && v41CacheName(stage) != stage) || d.pages == nil {
		return false, nil
	}
	switch stage {
	case "kv", "window", "ckv", "icache":
	default:
		return false, nil
	}
	t, _, has, why := d.v41FromPages(p, l, stage)
	if why != "" {
		return false, fmt.Errorf("%s: step %d layer %d %s pages: %s", d.Dir, p, l, v41CacheName(stage), why)
	}
	if !has {
		return false, nil
	}
	if len(t.F) != len(ref.F) {
		return false, fmt.Errorf("%s: step %d layer %d: the %s pages decode to %d values, the reference's %s has %d", d.Dir, p, l, v41CacheName(stage), len(t.F), stage, len(ref.F))
	}
	*gpu, *ok = t, true
	if stage != "kv" {
		if sr, has := d.v41PageResult(p, l, stage, ref, false, ""); has {
			rep.Results = append(rep.Results, sr)
			if sr.Status == StatusFail && rep.First == nil {
				rep.First = v41PageDivergence(sr, mode, false)
			}
		}
	}
	return true, nil
}

// v41PagesAfter runs in V41Run's hook after a cache stage held as a tensor
// was judged: the dump's pages of that cache, if any, must encode the dumped
// rows (<cache>_pages).
func (d *V41Dump) v41PagesAfter(rep *Report, p int64, l int, stage string, gpu engine.Tensor, status string, mode Mode) {
	if d.pages == nil || (stage != "window" && stage != "ckv" && stage != "icache") || status == StatusMissing {
		return
	}
	if sr, has := d.v41PageResult(p, l, stage, gpu, true, status); has {
		rep.Results = append(rep.Results, sr)
		if sr.Status == StatusFail && rep.First == nil {
			rep.First = v41PageDivergence(sr, mode, true)
		}
	}
}
