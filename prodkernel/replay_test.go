package prodkernel

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/replay"
)

// kernelDir is where the committed harness outputs of a golden dump live.
func kernelDir(name string) string { return filepath.Join("..", "testdata", "kernels", name) }

// openKernelRun opens the golden dump, its model and the committed Triton run.
func openKernelRun(t *testing.T, name string) (*engine.Model, *replay.DumpSource, *Run) {
	t.Helper()
	d, src := openGolden(t, name)
	m, err := replay.LoadModel(d, src, "")
	if err != nil {
		t.Fatal(err)
	}
	r, err := Open(kernelDir(name), "triton")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return m, src, r
}

// forDumps runs a test on the committed Triton run of each golden.
func forDumps(t *testing.T, f func(t *testing.T, name string)) {
	for _, name := range goldenDumps {
		t.Run(name, func(t *testing.T) { f(t, name) })
	}
}

// windowKWriters are the window-K / compressed-row cache writers the harness ran.
var windowKWriters = []struct{ run, prefix string }{
	{"vllm_quantize_and_insert_k_cache", "vllm_k"},
	{"sglang_quant_k_cache_set_k_and_s", "sglang_k"},
}

// TestWindowKWritersReplay: the MODEL1 entries vLLM's and SGLang's cache
// writers stored, decoded, are the reference's kv and cmp_row at every step
// and layer, and their pages after the last step match the reference encoding
// byte for byte: the replay agrees with the default tolerances, every stage
// compared (kv_pages included).
func TestWindowKWritersReplay(t *testing.T) { forDumps(t, testWindowKWritersReplay) }

func testWindowKWritersReplay(t *testing.T, name string) {
	m, src, r := openKernelRun(t, name)
	for _, wk := range windowKWriters {
		t.Run(wk.prefix, func(t *testing.T) {
			if !r.Info.Runs[wk.run].OK {
				t.Fatalf("%s did not run: %s", wk.run, r.Info.Runs[wk.run].Error)
			}
			w, err := LoadWindowK(r, wk.prefix, src.Steps(), src.Layers())
			if err != nil {
				t.Fatal(err)
			}
			if len(w.Entries) != len(src.Steps())*len(src.Layers()) || len(w.Pages) != len(src.Layers()) {
				t.Fatalf("%d entry sets, %d page sets", len(w.Entries), len(w.Pages))
			}
			for k, set := range w.Pages {
				kv, _, _ := src.Stage(k[0], int(k[1]), "kv_cache")
				if want, _ := BlockTable(kv.Shape[0]); !slices.Equal(set.Table, want) {
					t.Errorf("p%d L%d: the harness's block table %v, Go's %v", k[0], k[1], set.Table, want)
				}
			}
			o := NewOverlay(src, wk.prefix)
			if err := w.Apply(o, m.Cfg.WindowSize); err != nil {
				t.Fatal(err)
			}
			rep, err := replay.Run(context.Background(), m, o, replay.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if rep.Diverged() {
				t.Fatalf("false alarm: %s", rep.First.Text)
			}
			pages := 0
			for _, sr := range rep.Results {
				if sr.Stage == "kv_pages" && sr.Status == replay.StatusPass {
					pages++
				}
			}
			if pages != len(src.Layers()) || rep.Summary.Skipped != 0 {
				t.Errorf("kv_pages passed %d times, summary %+v", pages, rep.Summary)
			}
			t.Logf("%s: %+v", wk.prefix, rep.Summary)
		})
	}
}

// TestWindowKWrongPage: the last row each writer stored, sent to the page of
// another logical block (a wrong slot mapping), is the first divergence at
// exactly that step, layer and stage (kv_cache; the K it computed, kv, still
// agrees), and the report names the row.
func TestWindowKWrongPage(t *testing.T) {
	m, src, r := openKernelRun(t, "official-v4-tiny")
	steps := src.Steps()
	last := steps[len(steps)-1]
	row := int(last) % m.Cfg.WindowSize
	for _, wk := range windowKWriters {
		for _, layer := range []int{0, 1} {
			w, err := LoadWindowK(r, wk.prefix, steps, src.Layers())
			if err != nil {
				t.Fatal(err)
			}
			if err := w.WrongPage(last, layer, row, 1); err != nil {
				t.Fatal(err)
			}
			o := NewOverlay(src, wk.prefix+"+wrong-page")
			if err := w.Apply(o, m.Cfg.WindowSize); err != nil {
				t.Fatal(err)
			}
			rep, err := replay.Run(context.Background(), m, o, replay.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if !rep.Diverged() {
				t.Fatalf("%s L%d: wrong page not found", wk.prefix, layer)
			}
			f := rep.First
			if f.Step != last || f.Layer != layer || f.Stage != "kv_cache" {
				t.Fatalf("%s L%d: first divergence p%d L%d %s, want p%d L%d kv_cache: %s", wk.prefix, layer, f.Step, f.Layer, f.Stage, last, layer, f.Text)
			}
			want := fmt.Sprintf("(cache row %d, window slot %d, token %d) is not in its place, which holds zeros, but in cache row %d", row, row, last, row+PageEntries)
			if !strings.Contains(f.Text, want) || !strings.Contains(f.Text, "wrong page or slot") {
				t.Errorf("%s L%d: %s\nwant it to say %q", wk.prefix, layer, f.Text, want)
			}
			t.Logf("%s L%d: %s", wk.prefix, layer, f.Text)
		}
	}
}

// TestRunRecord: the committed run says what ran where: every Triton kernel
// the README lists ran on the H200 from the recorded kernel files, and vLLM's
// MXFP4 indexer-q kernel is recorded as failing to compile for sm_90a (its
// inline PTX cvt ... e2m1x2 needs a newer target), not silently missing.
func TestRunRecord(t *testing.T) { forDumps(t, testRunRecord) }

func testRunRecord(t *testing.T, name string) {
	_, _, r := openKernelRun(t, name)
	if g := r.Info.Env["gpu"]; g != "NVIDIA H200" {
		t.Errorf("gpu %q", g)
	}
	for _, k := range []string{"vllm_quantize_and_insert_k_cache", "sglang_quant_k_cache_set_k_and_s", "vllm_fused_inv_rope_fp8_quant", "vllm_fused_indexer_q_rope_quant_fp8"} {
		if !r.Info.Runs[k].OK {
			t.Errorf("%s: %+v", k, r.Info.Runs[k])
		}
	}
	mx := r.Info.Runs["vllm_fused_indexer_q_rope_quant_mxfp4"]
	if mx.OK || !strings.Contains(mx.Error, "'cvt with .e2m1x2' not supported on .target 'sm_90a'") {
		t.Errorf("mxfp4 run: %+v", mx)
	}
	for f, h := range r.Info.Hashes {
		if len(h) != 64 {
			t.Errorf("%s: sha256 %q", f, h)
		}
	}
}
