package prodkernel

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/dump"
)

// writeRun writes a kernels-bad run of the given records into a temp folder.
func writeRun(t *testing.T, recs []dump.Record) *Run {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "kernels-bad.json"), []byte(`{"dump":"x","runs":{}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "kernels-bad.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if err := dump.WriteSafetensors(f, recs, nil); err != nil {
		t.Fatal(err)
	}
	f.Close()
	r, err := Open(dir, "bad")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func i64s(v ...int64) dump.Record {
	b := make([]byte, 8*len(v))
	for i, x := range v {
		putU64(b[8*i:], uint64(x))
	}
	return dump.Record{DType: dump.I64, Shape: []int{len(v)}, Data: b}
}

func named(r dump.Record, name string) dump.Record { r.Name = name; return r }

// TestLoadWindowKBadInput: malformed kernel outputs are errors naming the
// tensor, never a panic: an entry of the wrong width, a block table naming a
// page the run does not hold, a stored scale byte no encoder writes, a row
// outside the cache.
func TestLoadWindowKBadInput(t *testing.T) {
	_, src := openGolden(t, "official-v4-tiny")
	entry := make([]byte, 584)
	good := dump.Record{DType: dump.U8, Shape: []int{1, 584}, Data: entry}
	pages := dump.Record{DType: dump.U8, Shape: []int{2, model1.PageBytes()}, Data: make([]byte, 2*model1.PageBytes())}
	cases := []struct {
		name string
		recs []dump.Record
		want string
	}{
		{"entry width", []dump.Record{named(dump.Record{DType: dump.U8, Shape: []int{1, 500}, Data: make([]byte, 500)}, "vllm_k.p2.L0.entries"), named(i64s(2), "vllm_k.p2.L0.rows")}, "entries shape [1 500]"},
		{"page id", []dump.Record{named(good, "vllm_k.p2.L0.entries"), named(i64s(2), "vllm_k.p2.L0.rows"), named(pages, "vllm_k.p2.L0.pages"), named(i64s(5), "vllm_k.p2.L0.block_table")}, "block_table names page 5 of 2"},
		{"scale byte", []dump.Record{named(good, "vllm_k.p2.L0.entries"), named(i64s(2), "vllm_k.p2.L0.rows")}, "scale"},
		{"row", []dump.Record{named(dump.Record{DType: dump.U8, Shape: []int{1, 584}, Data: validEntry()}, "vllm_k.p2.L0.entries"), named(i64s(4096), "vllm_k.p2.L0.rows")}, "row 4096 outside kv_cache"},
	}
	for _, c := range cases {
		r := writeRun(t, c.recs)
		w, err := LoadWindowK(r, "vllm_k", src.Steps(), src.Layers())
		if err == nil {
			err = w.Apply(NewOverlay(src, "bad"), 128)
		}
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want it to say %q", c.name, err, c.want)
		}
	}
}

// validEntry is a MODEL1 entry of zeros with the scale bytes a zero block gets
// (2^-22: the reference floor 1e-4 / 448).
func validEntry() []byte {
	e := make([]byte, 584)
	for i := 0; i < 7; i++ {
		e[576+i] = 127 - 22
	}
	return e
}
