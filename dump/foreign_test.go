package dump

import (
	"fmt"
	"os"

	"path/filepath"
	"strings"
	"testing"

	"codeberg.org/sbinet/npyio"
)

func copyFiles(t *testing.T, dst, src string, skip func(string) bool) {
	t.Helper()
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() || skip(e.Name()) {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// An official-layout directory without prefill_state.safetensors (a window
// of steps): detected, config read, and the first step's cache states are the
// start state valid after that step.
func TestOfficialWindowWithoutPrefill(t *testing.T) {
	dir := t.TempDir()
	copyFiles(t, dir, "../testdata/official-v4-tiny", func(n string) bool {
		return n == "prefill_state.safetensors" || n == "step_2.safetensors" || !strings.Contains(n, ".")
	})
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Map.Name != "official-v4-window" || d.Header.ModelArgs == "" || !strings.Contains(d.Detect, "official-v4-window") {
		t.Fatalf("map %s, config %d bytes, detect %q", d.Map.Name, len(d.Header.ModelArgs), d.Detect)
	}
	for l := 0; l < 4; l++ {
		st, ok := d.Lookup(Key{Step: 3, Layer: l, Stage: "kv_cache"}, KindState)
		if !ok {
			t.Fatalf("layer %d: no start state kv_cache valid after step 3", l)
		}
		if !strings.HasSuffix(st.File, "step_3.safetensors") || st.Name != "L"+istr(l)+".kv_cache" {
			t.Errorf("layer %d: start state is %s of %s, not step 3's kv_cache", l, st.Name, st.File)
		}
		if _, ok := d.Lookup(Key{Step: 3, Layer: l, Stage: "q"}, KindStage); ok {
			t.Errorf("layer %d: the first step's stage records are still in the dump", l)
		}
		if _, ok := d.Lookup(Key{Step: 4, Layer: l, Stage: "kv_cache"}, KindState); ok {
			t.Errorf("layer %d: a later step became a start state", l)
		}
	}
	if _, ok := d.Lookup(Key{Step: 3, Layer: 1, Stage: "cmp_kv_state"}, KindState); !ok {
		t.Error("no cmp_kv_state start state")
	}
	// What became of the first step is recorded (a replay says it).
	st, err := OpenSafetensors(filepath.Join(dir, "step_3.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	w := d.Window
	if w == nil || w.Step != 3 || w.States != 16 || w.States+w.LeftOut != len(st.Names()) || w.LeftOut != len(d.Unmapped) {
		t.Errorf("window start %+v: step_3 holds %d tensors, %d unmapped", w, len(st.Names()), len(d.Unmapped))
	}
}

// Without config.json the detection report names the rule that failed.
func TestDetectReportNamesFailedRule(t *testing.T) {
	dir := t.TempDir()
	copyFiles(t, dir, "../testdata/official-v4-tiny", func(n string) bool { return n != "step_3.safetensors" })
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if !strings.Contains(d.Detect, "official-v4-window: no config.json") || !strings.Contains(d.Detect, "official-v4-tiny: no config.json") {
		t.Errorf("detect %q", d.Detect)
	}
}

// An npy directory with config.json beside it: the generic map reads the config.
func TestGenericMapReadsConfig(t *testing.T) {
	dir := t.TempDir()
	src := "../testdata/official-v4-tiny/config.json"
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644)
	os.MkdirAll(filepath.Join(dir, "step_5"), 0o755)
	f, err := os.Create(filepath.Join(dir, "step_5", "L1.q.npy"))
	if err != nil {
		t.Fatal(err)
	}
	if err := npyio.Write(f, []float32{1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Map.Name != "generic" || d.Header.ModelArgs != string(b) || len(d.Header.CompressRatios) != 4 {
		t.Fatalf("map %s config %q ratios %v", d.Map.Name, d.Header.ModelArgs, d.Header.CompressRatios)
	}
	if _, ok := d.Lookup(Key{Step: 5, Layer: 1, Stage: "q"}, KindStage); !ok {
		t.Errorf("entries %v", d.Entries)
	}
}

// A foreign dump in which no tensor maps to a key is an error, not an empty dump.
func TestNothingMappedFails(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "m.json"), []byte(`{"name":"none","files":[{"file":"^nothing$","rules":[{"match":".","stage":"x"}]}]}`), 0o644)
	m, err := LoadNameMap(filepath.Join(dir, "m.json"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = OpenMapped("../testdata/official-v4-tiny/step_3.safetensors", m)
	if err == nil || !strings.Contains(err.Error(), "no tensor mapped") {
		t.Fatalf("err %v", err)
	}
}

func TestViewShape(t *testing.T) {
	for _, c := range []struct {
		shape, view, want []int
	}{
		{[]int{2048}, []int{-1, 512}, []int{4, 512}},
		{[]int{1, 4, 512}, []int{-1, 512}, []int{4, 512}},
		{[]int{6}, []int{2, 3}, []int{2, 3}},
	} {
		got, err := viewShape(c.shape, c.view)
		if err != nil || fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("viewShape(%v, %v) = %v, %v", c.shape, c.view, got, err)
		}
	}
	for _, c := range [][2][]int{{{2047}, {-1, 512}}, {{6}, {4, 2}}, {{6}, {-1, -1}}, {{6}, {0, 6}}} {
		if got, err := viewShape(c[0], c[1]); err == nil {
			t.Errorf("viewShape(%v, %v) = %v, want an error", c[0], c[1], got)
		}
	}
}
