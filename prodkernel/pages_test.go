package prodkernel

import (
	"flag"
	"os"
	"path/filepath"
	"testing"

	"sparsemla/dump"
	"sparsemla/replay"
)

var writePages = flag.String("write-pages", "", "write the MODEL1 pages of the golden dumps (FlashMLA's input) under this folder and stop")

var goldenDumps = []string{"official-v4-tiny", "gpu-v4-tiny-long"}

func openGolden(t *testing.T, name string) (*dump.Dump, *replay.DumpSource) {
	t.Helper()
	d, err := dump.Open(filepath.Join("..", "testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		t.Fatal(err)
	}
	return d, src
}

// TestEncodePagesRoundTrip: the pages WritePages gives FlashMLA decode back to
// the dumped kv_cache rows exactly, every row of every step and layer, and page
// 0 is never written.
func TestEncodePagesRoundTrip(t *testing.T) {
	for _, name := range goldenDumps {
		_, src := openGolden(t, name)
		n := 0
		for _, p := range src.Steps() {
			for _, l := range src.Layers() {
				kv, ok, err := src.Stage(p, l, "kv_cache")
				if err != nil || !ok {
					t.Fatalf("%s p%d L%d: kv_cache %v %v", name, p, l, ok, err)
				}
				pages, table, err := EncodePages(kv)
				if err != nil {
					t.Fatal(err)
				}
				pb := model1.PageBytes()
				for _, b := range pages[:pb] {
					if b != 0 {
						t.Fatalf("%s p%d L%d: page 0 written", name, p, l)
					}
				}
				row := make([]float32, model1.Dim)
				for r := 0; r < kv.Shape[0]; r++ {
					id := table[r/PageEntries]
					clear(row)
					if f := model1.DecodeEntry(row, pages[id*pb:(id+1)*pb], r%PageEntries, nil); len(f) != 0 {
						t.Fatalf("%s p%d L%d row %d: %v", name, p, l, r, f[0])
					}
					for i, v := range row {
						if v != kv.F[r*model1.Dim+i] {
							t.Fatalf("%s p%d L%d row %d dim %d: %v, want %v", name, p, l, r, i, v, kv.F[r*model1.Dim+i])
						}
					}
					n++
				}
			}
		}
		t.Logf("%s: %d rows round-trip", name, n)
	}
}

// TestWritePages writes FlashMLA's input pages when -write-pages DIR is given
// (testdata/kernels/README.md); otherwise it checks that WritePages runs.
func TestWritePages(t *testing.T) {
	for _, name := range goldenDumps {
		_, src := openGolden(t, name)
		path := filepath.Join(t.TempDir(), "pages.safetensors")
		if *writePages != "" {
			if err := os.MkdirAll(filepath.Join(*writePages, name), 0o755); err != nil {
				t.Fatal(err)
			}
			path = filepath.Join(*writePages, name, "pages.safetensors")
		}
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := WritePages(f, src); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		st, err := dump.OpenSafetensors(path)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := len(st.Names()), 2*len(src.Steps())*len(src.Layers()); got != want {
			t.Errorf("%s: %d tensors, want %d", name, got, want)
		}
		st.Close()
	}
}

var writeFlash = flag.String("write-flashmla", "", "write the synthetic FlashMLA input (flashmla-in.safetensors) into this folder and stop")

// TestFlashInput: the generated cache decodes back through its table, the
// index lists hold the window then distinct compressed rows, and with
// -write-flashmla DIR the input file is written for the harness.
func TestFlashInput(t *testing.T) {
	in, err := NewFlashInput()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range FlashCases {
		idx := in.Idx[c.Name]
		for r := 0; r < c.Queries(); r++ {
			l := idx[r*c.TopK() : (r+1)*c.TopK()]
			seen := map[int32]bool{}
			for i, v := range l {
				if v >= 0 && seen[v] {
					t.Fatalf("%s query %d: row %d twice", c.Name, r, v)
				}
				seen[v] = true
				if (i < c.Window) != (v >= 0 && v < FlashWindow) && i < FlashWindow {
					t.Fatalf("%s query %d entry %d = %d", c.Name, r, i, v)
				}
			}
		}
	}
	dir := t.TempDir()
	if *writeFlash != "" {
		dir = *writeFlash
	}
	f, err := os.Create(filepath.Join(dir, "flashmla-in.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Write(f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}
