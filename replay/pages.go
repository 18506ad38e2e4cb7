package replay

import (
	"fmt"
	"sort"
	"strings"

	"sparsemla/engine"
)

// Page is one dumped KV page (dump record kind "page") of a layer's kv_cache:
// the raw bytes the GPU kernel reads, in a serving layout.
type Page struct {
	Layout     string // "v4-model1", "v32", "bf16", ...
	PageID     int    // physical page number
	BlockSize  int    // entries (cache rows) per page
	BlockTable []int  // logical block -> physical page of this request
	Data       []byte
	// Origin names the record the page came from ("dump FILE: record N
	// (KEY) at offset O"; empty for in-memory pages): errors about a page's
	// info or bytes are outside input and name it.
	Origin string
}

// pageErr wraps an error about one page with the record it came from.
func pageErr(pg Page, err error) error {
	if pg.Origin == "" {
		return fmt.Errorf("page %d: %w", pg.PageID, err)
	}
	return fmt.Errorf("%s: page %d: %w", pg.Origin, pg.PageID, err)
}

// PageSource is implemented by sources that carry the GPU's KV pages of a
// layer's kv_cache after a step (window rows 0..W-1 then compressed rows, as
// logical entries 0, 1, ...).
type PageSource interface {
	Pages(step int64, layer int) ([]Page, error)
}

// LivePageRows lists the kv_cache rows that hold data after step p: window
// slots of tokens 0..p (all W once p >= W-1) and the compressed rows present.
func LivePageRows(cfg *engine.Config, p int64, rows int) []int {
	W := cfg.WindowSize
	var out []int
	for s := 0; s < W && s < rows; s++ {
		if int64(s) <= p {
			out = append(out, s)
		}
	}
	for i := W; i < rows; i++ {
		out = append(out, i)
	}
	return out
}

// comparePages checks the GPU's pages of a layer's kv_cache against the
// reference rows ref [rows, D]: each live row whose entry (in the page the
// block table names) does not decode exactly to it is encoded with the
// reference scaling into that entry, and the pages are compared byte by
// byte (an entry that decodes exactly to its row, whatever scale it chose,
// encodes it: decodesTo). It returns "" when every read byte of every live
// entry agrees, else the first difference (in cache-row order).
func comparePages(cfg *engine.Config, p int64, ref engine.Tensor, pages []Page) (string, error) {
	if len(ref.Shape) != 2 {
		return "", fmt.Errorf("kv_cache shape %v", ref.Shape)
	}
	D := ref.Shape[1]
	byID := map[int]Page{}
	for _, pg := range pages {
		byID[pg.PageID] = pg
	}
	// Group live rows by logical block.
	type blk struct {
		page Page
		rows map[int][]float32
		base int
	}
	blocks := map[int]*blk{}
	var order []int
	for _, i := range LivePageRows(cfg, p, ref.Shape[0]) {
		pg0 := pages[0]
		B := pg0.BlockSize
		if B <= 0 {
			return "", pageErr(pg0, fmt.Errorf("block size %d", B))
		}
		b := i / B
		if b >= len(pg0.BlockTable) {
			return fmt.Sprintf("cache row %d: logical block %d is not in the block table (%d blocks)", i, b, len(pg0.BlockTable)), nil
		}
		id := pg0.BlockTable[b]
		pg, ok := byID[id]
		if !ok {
			return fmt.Sprintf("cache row %d: logical block %d maps to page %d, which the dump does not hold", i, b, id), nil
		}
		bl := blocks[b]
		if bl == nil {
			bl = &blk{page: pg, rows: map[int][]float32{}, base: b * B}
			blocks[b] = bl
			order = append(order, b)
		}
		bl.rows[i-b*B] = ref.F[i*D : (i+1)*D]
	}
	sort.Ints(order)
	for _, b := range order {
		bl := blocks[b]
		// The page's bytes must make a whole page before any is decoded or
		// re-encoded: its block size is a header's claim (up to 2^20
		// entries, a 1 GiB page of bf16 rows), its bytes are what the dump
		// holds (none: nil Data, which RewritePage would take as a zero page
		// to allocate).
		if f, _, err := kvFormat(bl.page.Layout, D, bl.page.BlockSize); err == nil && len(bl.page.Data) != f.PageBytes() {
			return "", pageErr(bl.page, fmt.Errorf("%v page has %d bytes, want %d", f, len(bl.page.Data), f.PageBytes()))
		}
		// An entry whose bytes decode exactly to its row encodes it (another
		// exact scale choice included): it keeps the GPU's bytes in want.
		for e, row := range bl.rows {
			if bl.page.Data == nil {
				break
			}
			ok, err := decodesTo(bl.page.Layout, D, bl.page.BlockSize, bl.page.Data, e, row)
			if err != nil {
				return "", pageErr(bl.page, err)
			}
			if ok {
				delete(bl.rows, e)
			}
		}
		want, err := RewritePage(bl.page.Layout, D, bl.page.BlockSize, bl.page.Data, bl.rows)
		if err != nil {
			return "", pageErr(bl.page, err)
		}
		d, err := comparePage(bl.page.Layout, D, bl.page.BlockSize, bl.page.Data, want)
		if err != nil {
			return "", pageErr(bl.page, err)
		}
		if d != "" {
			return fmt.Sprintf("%s page %d (logical block %d, cache rows %d..%d): %s", bl.page.Layout, bl.page.PageID, b, bl.base, bl.base+bl.page.BlockSize-1, d), nil
		}
	}
	return "", nil
}

// pageResult compares the dumped pages of (step, layer), if any, with the
// dumped kv_cache rows (whose own comparison had status kvStatus) and returns
// the "kv_pages" stage result (ok false when there is nothing to compare).
func pageResult(m *engine.Model, src Source, p int64, l int, ref engine.Tensor, kvStatus string) (StageResult, bool, error) {
	ps, ok := src.(PageSource)
	if !ok {
		return StageResult{}, false, nil
	}
	pages, err := ps.Pages(p, l)
	if err != nil || len(pages) == 0 {
		return StageResult{}, false, err
	}
	sr := StageResult{Step: p, Layer: l, Stage: "kv_pages", Tol: string(TolExact), Shape: ref.Shape,
		Equation: "kv_pages = the GPU's KV page bytes of kv_cache (serving layout), entry by entry",
		Inputs:   []InputInfo{{Name: "kv_cache", From: FromDump, Status: inputStatus(kvStatus)}}}
	if !ref.Kind.IsFloat() || len(ref.F) < ref.Len() {
		// A kv_cache record of an integer dtype: no rows to encode.
		sr.Status, sr.Reason = StatusSkipped, fmt.Sprintf("the dumped kv_cache holds %s values, not cache rows: the pages are not compared", ref.Kind)
		return sr, true, nil
	}
	d, err := comparePages(m.Cfg, p, ref, pages)
	if err != nil {
		return StageResult{}, false, fmt.Errorf("step %d layer %d pages: %w", p, l, err)
	}
	if d == "" {
		sr.Status = StatusPass
	} else {
		sr.Status, sr.Reason, sr.Severity = StatusFail, d, 1.5
	}
	return sr, true, nil
}

// pageDetail is a diagnosis line from the pages of (step, layer), or "".
func pageDetail(d DiagnoseInput) string {
	ps, ok := d.Src.(PageSource)
	if !ok {
		return ""
	}
	pages, err := ps.Pages(d.Result.Step, d.Result.Layer)
	if err != nil || len(pages) == 0 {
		return ""
	}
	s, err := comparePages(d.Model.Cfg, d.Result.Step, d.Ref, pages)
	if err != nil || s == "" {
		return ""
	}
	return "page bytes: " + s
}

// IsPageStage reports whether a dump stage name holds kv_cache pages
// ("kv_cache" or "kv_cache/<page>").
func IsPageStage(stage string) bool {
	return stage == "kv_cache" || strings.HasPrefix(stage, "kv_cache/")
}

// inputStatus maps a stage's comparison status to the status of an input
// that reads it.
func inputStatus(st string) string {
	switch st {
	case StatusPass, StatusTie:
		return "matched"
	case StatusFail:
		return "diverged"
	}
	return "unchecked"
}
