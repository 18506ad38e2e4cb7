package dump

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeST writes a minimal safetensors file: one F32 tensor per name, and
// the given __metadata__.
func writeSTMeta(t *testing.T, path string, tensors map[string][]float32, md map[string]string) {
	t.Helper()
	hdr := map[string]interface{}{}
	if md != nil {
		hdr["__metadata__"] = md
	}
	var data bytes.Buffer
	names := make([]string, 0, len(tensors))
	for n := range tensors {
		names = append(names, n)
	}
	for _, n := range names {
		v := tensors[n]
		off := data.Len()
		binary.Write(&data, binary.LittleEndian, v)
		hdr[n] = map[string]interface{}{"dtype": "F32", "shape": []int{len(v)}, "data_offsets": []int{off, data.Len()}}
	}
	h, _ := json.Marshal(hdr)
	var out bytes.Buffer
	binary.Write(&out, binary.LittleEndian, uint64(len(h)))
	out.Write(h)
	out.Write(data.Bytes())
	if err := os.WriteFile(path, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The sidecar gives requests (default and per file) and prefix hits to an
// official-layout safetensors dump.
func TestSidecarRequestsAndPrefix(t *testing.T) {
	dir := t.TempDir()
	copyFiles(t, dir, "../testdata/official-v4-tiny", func(n string) bool { return !strings.Contains(n, ".") })
	os.WriteFile(filepath.Join(dir, SidecarFile), []byte(`{"version": 1, "request": "r1",
	  "files": [{"file": "^prefill_state\\.safetensors$", "request": "r0"}],
	  "prefix": [{"request": "r1", "source": "r0", "tokens": 2}]}`), 0o644)
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, ok := d.Lookup(Key{Request: "r1", Step: 3, Layer: 0, Stage: "q"}, KindStage); !ok {
		t.Error("step 3 is not request r1")
	}
	if _, ok := d.Lookup(Key{Request: "r0", Step: 1, Layer: 0, Stage: "kv_cache"}, KindState); !ok {
		t.Error("the prefill state is not request r0's")
	}
	if _, ok := d.Lookup(Key{Request: "", Step: NoStep, Layer: Global, Stage: "freqs_cis_r0"}, KindTable); !ok {
		t.Error("tables must keep no request")
	}
	if len(d.Prefix) != 1 || d.Prefix[0].Request != "r1" || d.Prefix[0].Source != "r0" || d.Prefix[0].Tokens != 2 {
		t.Errorf("prefix %+v", d.Prefix)
	}
}

// safetensors __metadata__ keys: sparsemla.request and sparsemla.prefix.
func TestSafetensorsMetadataRequest(t *testing.T) {
	dir := t.TempDir()
	writeSTMeta(t, filepath.Join(dir, "step_5.safetensors"), map[string][]float32{"L0.q_a": {1, 2}},
		map[string]string{MetaRequest: "rB", MetaPrefix: `[{"request": "rB", "source": "rA", "tokens": 4}]`})
	writeSTMeta(t, filepath.Join(dir, "step_6.safetensors"), map[string][]float32{"L0.q_a": {3, 4}},
		map[string]string{MetaRequest: "rB", MetaPrefix: `[{"request": "rB", "source": "rA", "tokens": 4}]`})
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for _, p := range []int{5, 6} {
		if _, ok := d.Lookup(Key{Request: "rB", Step: p, Layer: 0, Stage: "q_a"}, KindStage); !ok {
			t.Errorf("step %d: no rB record: %v", p, d.Entries)
		}
	}
	if len(d.Prefix) != 1 || d.Prefix[0].Source != "rA" || d.Prefix[0].Tokens != 4 {
		t.Errorf("prefix %+v", d.Prefix)
	}
}

func TestSidecarErrors(t *testing.T) {
	cases := map[string]string{
		"unknown key":  `{"version": 1, "requests": "r1"}`,
		"version":      `{"version": 2}`,
		"no version":   `{"request": "r1"}`,
		"bad prefix":   `{"version": 1, "prefix": [{"request": "r1", "source": "r0"}]}`,
		"self prefix":  `{"version": 1, "prefix": [{"request": "r1", "source": "r1", "tokens": 3}]}`,
		"zero tokens":  `{"version": 1, "prefix": [{"request": "r1", "source": "r0", "tokens": 0}]}`,
		"bad regexp":   `{"version": 1, "files": [{"file": "(", "request": "x"}]}`,
		"extra prefix": `{"version": 1, "prefix": [{"request": "r1", "source": "r0", "tokens": 3, "x": 1}]}`,
	}
	for name, js := range cases {
		if _, err := ParseSidecar([]byte(js), name); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// two sources disagreeing about one request's prefix hit
	dir := t.TempDir()
	writeSTMeta(t, filepath.Join(dir, "step_5.safetensors"), map[string][]float32{"L0.q_a": {1}},
		map[string]string{MetaPrefix: `[{"request": "rB", "source": "rA", "tokens": 4}]`})
	os.WriteFile(filepath.Join(dir, SidecarFile), []byte(`{"version": 1, "prefix": [{"request": "rB", "source": "rA", "tokens": 5}]}`), 0o644)
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "tokens 5") {
		t.Errorf("conflict: %v", err)
	}
}

// FuzzSidecar: any bytes as sparsemla.json must parse or fail, never panic.
func FuzzSidecar(f *testing.F) {
	f.Add([]byte(`{"version": 1, "request": "r1", "files": [{"file": "^a", "request": "r0"}], "prefix": [{"request": "r1", "source": "r0", "tokens": 2}]}`))
	f.Add([]byte(`{"version": 1, "prefix": []}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		sc, err := ParseSidecar(b, "fuzz")
		if err != nil {
			return
		}
		for _, h := range sc.Prefix {
			if h.Tokens <= 0 || h.Request == h.Source {
				t.Fatalf("accepted prefix hit %+v", h)
			}
		}
	})
}

// Prefix hits are merged through an index by request: a safetensors
// __metadata__ can hold a million of them, and scanning every hit kept for
// each new one took 16 s for 100k. The merge keeps each request once, in
// the order it first came, and still refuses a later hit that disagrees
// with the first.
func TestPrefixHitsMerged(t *testing.T) {
	const n = 1 << 17
	d := &Dump{}
	hit := func(i, tokens int, file string) PrefixHit {
		return PrefixHit{Request: "r" + istr(i), Source: "s", Tokens: tokens, File: file}
	}
	for i := 0; i < n; i++ {
		if err := d.addPrefixHit(hit(i, i+1, "a")); err != nil {
			t.Fatal(err)
		}
		// every hit named again, agreeing, by a later source
		if err := d.addPrefixHit(hit(i/2, i/2+1, "b")); err != nil {
			t.Fatal(err)
		}
	}
	if len(d.Prefix) != n {
		t.Fatalf("%d hits kept, want %d", len(d.Prefix), n)
	}
	for i, h := range d.Prefix {
		if h != hit(i, i+1, "a") {
			t.Fatalf("hit %d: %+v, want %+v", i, h, hit(i, i+1, "a"))
		}
	}
	err := d.addPrefixHit(hit(0, 7, "c"))
	if want := `prefix hit of request "r0": a says source "s" tokens 1, c says source "s" tokens 7`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("conflict: %v, want an error containing %q", err, want)
	}
	if len(d.Prefix) != n {
		t.Errorf("%d hits kept after a conflict, want %d", len(d.Prefix), n)
	}
}
