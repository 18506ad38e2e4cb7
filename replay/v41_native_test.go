package replay

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
)

// v41NativeFromGolden writes the GPU golden testdata/v41-tiny as a native
// dump (WriteV41Native) into a temporary directory and returns its path and
// the golden.
func v41NativeFromGolden(t *testing.T, opt V41NativeOptions) (string, *V41Dump) {
	t.Helper()
	g, err := LoadV41Dir(v41Golden)
	if err != nil {
		t.Fatal(err)
	}
	steps := map[int64][]map[string]engine.Tensor{}
	for _, p := range g.Steps {
		ls := make([]map[string]engine.Tensor, g.Cfg.NLayers)
		for l := range ls {
			ls[l] = map[string]engine.Tensor{}
		}
		for k, v := range g.step[p] {
			var l int
			var n string
			if _, err := fmt.Sscanf(k, "L%d.", &l); err != nil {
				t.Fatalf("%s: %v", k, err)
			}
			_, n, _ = strings.Cut(k, ".")
			ls[l][n] = v
		}
		steps[p] = ls
	}
	dir := filepath.Join(t.TempDir(), "native")
	if err := WriteV41Native(dir, g.Model, g.Pre, steps, g.IndexKAt, opt); err != nil {
		t.Fatal(err)
	}
	return dir, g
}

// v41Counts counts results by status and the page results.
func v41Counts(r *Report) (pass, fail, pages int) {
	for _, s := range r.Results {
		switch s.Status {
		case StatusPass, StatusTie:
			pass++
		case StatusFail:
			fail++
		}
		if strings.HasSuffix(s.Stage, "_pages") {
			pages++
		}
	}
	return
}

// TestV41NativeRoundTrip: the GPU golden written as a native dump (with
// its caches also as V4.1 KV pages, and as pages only) replays exactly as
// the official layout does, in both modes, the pages compared at every
// step and layer holding them; the .smd file alone reads the same.
func TestV41NativeRoundTrip(t *testing.T) {
	for _, pagesOnly := range []bool{false, true} {
		dir, g := v41NativeFromGolden(t, V41NativeOptions{Request: "r1", PageBlock: 64, PagesOnly: pagesOnly})
		for _, mode := range []Mode{Local, Propagated} {
			want, err := V41Run(g, V41Options{Mode: mode})
			if err != nil {
				t.Fatal(err)
			}
			for _, path := range []string{dir, filepath.Join(dir, "dump.smd")} {
				if !IsV41(path) {
					t.Fatalf("IsV41(%s) = false", path)
				}
				d, err := OpenV41(path, V41OpenOptions{})
				if err != nil {
					t.Fatal(err)
				}
				rep, err := V41Run(d, V41Options{Mode: mode})
				if err != nil {
					t.Fatal(err)
				}
				if rep.First != nil || rep.Verdict != VerdictAgree {
					t.Fatalf("pagesOnly %v %s %s: %s", pagesOnly, mode, path, v41Text(rep))
				}
				wp, wf, _ := v41Counts(want)
				gp, gf, pages := v41Counts(rep)
				// 8 layers × 4 steps of window pages, 2 KV sources × 4 of ckv and icache
				if pages != 4*(8+2+2) || gf != wf {
					t.Errorf("pagesOnly %v %s: %d page results (want 48), %d fails (want %d)", pagesOnly, mode, pages, gf, wf)
				}
				// the golden dumps no ckv: its pages decode into the
				// 8 ckv stages (2 KV sources × 4 steps), judged too
				if !pagesOnly && gp != wp+pages+8 {
					t.Errorf("%s: %d pass, want %d + %d pages + 8 ckv", mode, gp, wp, pages)
				}
			}
		}
	}
}

// TestV41PagesNameCorruptedScale: one UE8M0 scale byte of an older window
// row in a page, and one E4M3 scale byte of a compressed row, flipped: the
// replay names the page, entry, row and scale byte, with or without the
// cache tensors beside the pages.
func TestV41PagesNameCorruptedScale(t *testing.T) {
	for _, pagesOnly := range []bool{false, true} {
		dir, _ := v41NativeFromGolden(t, V41NativeOptions{PageBlock: 64, PagesOnly: pagesOnly})
		for _, c := range []struct {
			cache     string
			layer     int
			row, off  int
			rowBytes  int
			wantField string
		}{
			{"window", 3, 5, 512 + 2, 528, "scale byte 2 (dims 64…95)"},
			{"ckv", 5, 3, 256 + 7, 288, "scale byte 7 (dims 112…127)"},
			{"icache", 2, 1, 64 + 1, 68, "scale byte 1 (dims 32…63)"},
		} {
			d, err := OpenV41(dir, V41OpenOptions{})
			if err != nil {
				t.Fatal(err)
			}
			p := d.Steps[1]
			pg := d.pages[p][fmt.Sprintf("L%d.%s", c.layer, c.cache)][0]
			pg.Data[c.row*c.rowBytes+c.off] ^= 0x01
			rep, err := V41Run(d, V41Options{Mode: Local})
			if err != nil {
				t.Fatal(err)
			}
			f := rep.First
			if f == nil || f.Step != p || f.Layer != c.layer || f.Stage != c.cache+"_pages" {
				t.Fatalf("pagesOnly %v %s: first = %+v", pagesOnly, c.cache, f)
			}
			t.Log(f.Text)
			if wantKind := map[string]string{"window": KindFP8Cache, "ckv": KindCache, "icache": KindCache}[c.cache]; f.Kind != wantKind {
				t.Errorf("%s: kind %q, want %q", c.cache, f.Kind, wantKind)
			}
			if !strings.Contains(f.Why, c.wantField) || !strings.Contains(f.Why, fmt.Sprintf("cache row %d", c.row)) {
				t.Errorf("pagesOnly %v %s: %s", pagesOnly, c.cache, f.Why)
			}
		}
	}
}

// v41RewriteNative copies the native dump dir/dump.smd into a new
// directory (with its config.json and weights), passing every record
// through edit (false drops it).
func v41RewriteNative(t *testing.T, dir string, edit func(r *dump.Record) bool, header func(h *dump.Header)) string {
	t.Helper()
	d, err := dump.Open(filepath.Join(dir, "dump.smd"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	out := t.TempDir()
	for _, f := range []string{"config.json", dump.WeightsFile} {
		copyTestFile(t, filepath.Join(dir, f), filepath.Join(out, f))
	}
	h := d.Header
	if header != nil {
		header(&h)
	}
	w, err := dump.Create(filepath.Join(out, "dump.smd"), h)
	if err != nil {
		t.Fatal(err)
	}
	for i := range d.Entries {
		r, err := d.Read(&d.Entries[i])
		if err != nil {
			t.Fatal(err)
		}
		if edit != nil && !edit(&r) {
			continue
		}
		if err := w.Write(&r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestV41NativeHostile: malformed V4.1 native dumps are errors naming the
// record or what is missing, never a panic or a replay.
func TestV41NativeHostile(t *testing.T) {
	dir, _ := v41NativeFromGolden(t, V41NativeOptions{PageBlock: 64})
	isPage := func(r *dump.Record, stage string, l int) bool {
		return r.Kind == dump.KindPage && r.Layer == l && strings.HasPrefix(r.Stage, stage)
	}
	for _, c := range []struct {
		name   string
		edit   func(r *dump.Record) bool
		header func(h *dump.Header)
		want   string
	}{
		{"page layout", func(r *dump.Record) bool {
			if isPage(r, "window/", 1) {
				r.Page.Layout = "v4-model1"
			}
			return true
		}, nil, `page of layout "v4-model1", want v41-window-fp8`},
		{"long page layout", func(r *dump.Record) bool {
			if isPage(r, "window/", 1) {
				r.Page.Layout = strings.Repeat("v4-model1", 100000)
			}
			return true
		}, nil, `page of layout "v4-model1v4-model1v4-model1v4-model1v4-model1v4-model1v4-model1v"… (900000 bytes), want v41-window-fp8`},
		{"page stage", func(r *dump.Record) bool {
			if isPage(r, "window/1", 1) {
				r.Stage = "kv_cache/0"
			}
			return true
		}, nil, "V4.1 pages are window/<n>, ckv/<n> or icache/<n>"},
		{"ckv page at a non-source", func(r *dump.Record) bool {
			if isPage(r, "window/1", 1) {
				r.Stage = "ckv/0"
				r.Page.Layout = "v41-kv-fp4"
			}
			return true
		}, nil, "layer 1 has no ckv cache"},
		{"short block table", func(r *dump.Record) bool {
			if isPage(r, "window/", 4) {
				r.Page.BlockTable = r.Page.BlockTable[:1]
			}
			return true
		}, nil, "block table of 1 blocks"},
		{"page size", func(r *dump.Record) bool {
			if isPage(r, "icache/", 2) {
				r.Page.BlockSize = 32
			}
			return true
		}, nil, "page of 4352 bytes, want 2176"},
		{"block table to a missing page", func(r *dump.Record) bool {
			if isPage(r, "window/", 6) {
				r.Page.BlockTable = []int{7, 1}
			}
			return true
		}, nil, "maps to page 7, which the dump does not hold"},
		{"index_k_at out of range", func(r *dump.Record) bool {
			if r.Stage == "index_k_at" && r.Kind == dump.KindState {
				r.Data = []byte{3, 0, 0, 0}
			}
			return true
		}, nil, "index_k_at state record (valid after step 11) is 3: not −1 nor a layer owning index keys"},
		{"missing start state", func(r *dump.Record) bool {
			return !(r.Kind == dump.KindState && r.Layer == 4)
		}, nil, "layer 4 has no start-state records"},
		{"steps not consecutive", func(r *dump.Record) bool {
			return r.Step != 13 || r.Kind == dump.KindState
		}, nil, "are not consecutive"},
		{"state missing a tensor", func(r *dump.Record) bool {
			return !(r.Kind == dump.KindState && r.Layer == 5 && r.Stage == "icache")
		}, nil, "missing L5.icache"},
		{"hf-eager policy", nil, func(h *dump.Header) { h.DTypePolicy["policy"] = "hf-eager" }, "names policy hf-eager"},
		{"V4 config", nil, func(h *dump.Header) {
			c, _ := engine.Preset("tiny")
			b, _ := jsonMarshal(c)
			h.ModelArgs = string(b)
		}, "not a DeepSeek-V4.1 config"},
	} {
		out := v41RewriteNative(t, dir, c.edit, c.header)
		d, err := OpenV41(out, V41OpenOptions{Policy: ""})
		if err == nil {
			var rep *Report
			// a page the block table misses is the GPU's error (a
			// divergence), not a malformed dump
			if rep, err = V41Run(d, V41Options{Mode: Local}); err == nil && rep.First != nil {
				err = fmt.Errorf("first divergence: %s", rep.First.Why)
			}
		}
		if err == nil || !strings.Contains(err.Error(), c.want) || len(err.Error()) > 1000 {
			t.Errorf("%s: err = %.1000v, want %q", c.name, err, c.want)
		}
	}
	if _, err := OpenV41(dir, V41OpenOptions{Policy: "hf-eager"}); err == nil || !strings.Contains(err.Error(), "one numerics policy") {
		t.Errorf("--policy hf-eager: %v", err)
	}
	if _, err := OpenV41(dir, V41OpenOptions{Request: "nope"}); err == nil || !strings.Contains(err.Error(), `no stage records for request "nope"`) {
		t.Errorf("--request nope: %v", err)
	}
	if _, err := OpenV41(v41Golden, V41OpenOptions{Request: "x"}); err == nil || !strings.Contains(err.Error(), "holds one request") {
		t.Errorf("golden --request: %v", err)
	}
}

// TestV41DeriveIndexKAt: without index_k_at records the slot is derived as
// model.py leaves it, and the replay of the golden is unchanged.
func TestV41DeriveIndexKAt(t *testing.T) {
	dir, _ := v41NativeFromGolden(t, V41NativeOptions{})
	out := v41RewriteNative(t, dir, func(r *dump.Record) bool { return r.Stage != "index_k_at" }, nil)
	d, err := OpenV41(out, V41OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	g, _ := LoadV41Dir(v41Golden)
	for _, p := range g.Steps {
		if d.IndexKAt[p] != g.IndexKAt[p] {
			t.Errorf("step %d: derived index_k_at %d, the golden's %d", p, d.IndexKAt[p], g.IndexKAt[p])
		}
	}
	rep, err := V41Run(d, V41Options{Mode: Local})
	if err != nil || rep.First != nil {
		t.Fatalf("%v %v", err, rep.First)
	}
}

func copyTestFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }

// TestV41PagesTooFew: a cache held only as pages, with fewer pages than its
// live rows need, is an error before any row is decoded.
func TestV41PagesTooFew(t *testing.T) {
	dir, _ := v41NativeFromGolden(t, V41NativeOptions{PageBlock: 4, PagesOnly: true})
	out := v41RewriteNative(t, dir, func(r *dump.Record) bool {
		keep := r.Stage == "window/0" || r.Stage == "window/1" || r.Stage == "window/2"
		return !(r.Kind == dump.KindPage && r.Step == 12 && r.Layer == 1 && strings.HasPrefix(r.Stage, "window/") && !keep)
	}, nil)
	d, err := OpenV41(out, V41OpenOptions{})
	if err == nil {
		_, err = V41Run(d, V41Options{Mode: Local})
	}
	if err == nil || !strings.Contains(err.Error(), "step 12 layer 1 window pages: its 13 live rows need 4 pages of 4 entries, the dump holds 3") {
		t.Errorf("err = %v", err)
	}
}

// TestV41NativeTruncatedRecords: every stage and state record of layers 2
// (r = 2 KV and index source) and 5 (r = 1, candidate source) cut by one
// element, one at a time: the replay returns an error or a divergence,
// never panics or agrees silently about a tensor it did not read whole.
func TestV41NativeTruncatedRecords(t *testing.T) {
	dir, _ := v41NativeFromGolden(t, V41NativeOptions{PageBlock: 64, PagesOnly: true})
	d, err := dump.Open(filepath.Join(dir, "dump.smd"))
	if err != nil {
		t.Fatal(err)
	}
	type target struct {
		kind  dump.Kind
		step  int
		layer int
		stage string
	}
	var targets []target
	for _, e := range d.Entries {
		if (e.Kind == dump.KindStage && e.Step == 13 || e.Kind == dump.KindState) && (e.Layer == 2 || e.Layer == 5 || e.Layer == -1) {
			targets = append(targets, target{e.Kind, e.Step, e.Layer, e.Stage})
		}
	}
	d.Close()
	if len(targets) < 40 {
		t.Fatalf("only %d records to cut", len(targets))
	}
	for _, tg := range targets {
		out := v41RewriteNative(t, dir, func(r *dump.Record) bool {
			if r.Kind == tg.kind && r.Step == tg.step && r.Layer == tg.layer && r.Stage == tg.stage {
				n := len(r.Data) / max(1, prodInts(r.Shape))
				r.Shape = []int{prodInts(r.Shape) - 1}
				r.Data = r.Data[:len(r.Data)-n]
			}
			return true
		}, nil)
		v, err := OpenV41(out, V41OpenOptions{})
		var rep *Report
		if err == nil {
			rep, err = V41Run(v, V41Options{Mode: Local})
		}
		if err == nil && rep.First == nil && !slices.Contains(rep.Coverage.NotModelled, tg.stage) {
			t.Errorf("%v cut by one: the replay agrees", tg)
		}
	}
}

func prodInts(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}
