package dump

import (
	"archive/zip"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Fuzz targets for the decoders not covered by FuzzNative,
// FuzzSafetensorsHeader, FuzzNpyHeader and FuzzNameMap: .npz archives (zip
// directory + npy members, stored or deflated) and checkpoint index files.

// npzBytes builds an .npz with one stored and one deflated member.
func npzBytes(tb testing.TB) []byte {
	npy := func(descr, shape string, data []byte) []byte {
		dict := "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }"
		for (10+len(dict)+1)%64 != 0 {
			dict += " "
		}
		dict += "\n"
		b := append([]byte("\x93NUMPY\x01\x00"), byte(len(dict)), byte(len(dict)>>8))
		return append(append(b, dict...), data...)
	}
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, m := range []struct {
		name   string
		method uint16
		data   []byte
	}{
		{"L0.q.npy", zip.Store, npy("<u2", "(2, 2)", []byte{0, 0x3f, 0, 0x40, 0, 0xc0, 0x80, 0x3f})},
		{"L1.kv.npy", zip.Deflate, npy("<f4", "(3,)", bytes.Repeat([]byte{0, 0, 0x80, 0x3f}, 3))},
	} {
		w, err := zw.CreateHeader(&zip.FileHeader{Name: m.name, Method: m.method})
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := w.Write(m.data); err != nil {
			tb.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

// FuzzNpz: any bytes as an .npz file open or fail with an error; every
// entry of an opened archive reads as a record that passes Check.
func FuzzNpz(f *testing.F) {
	f.Add(npzBytes(f))
	if b, err := os.ReadFile(filepath.Join("..", "testdata", "dump", "capture", "capture_smoke.npz")); err == nil {
		f.Add(b)
	}
	f.Add([]byte("PK\x05\x06\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(dir, "f.npz")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		d, err := Open(p)
		if err != nil {
			return
		}
		defer d.Close()
		for i := range d.Entries {
			r, err := d.Read(&d.Entries[i])
			if err != nil {
				continue // a member's deflate stream may be corrupt past its header
			}
			if err := r.Check(); err != nil {
				t.Fatalf("entry %d (%s) read but invalid: %v", i, d.Entries[i].Name, err)
			}
			if _, err := r.Stats(); err != nil {
				t.Fatalf("entry %d: stats: %v", i, err)
			}
		}
	})
}

// FuzzCheckpointIndex: a checkpoint directory whose
// model.safetensors.index.json is fuzzed (its one shard is valid) opens or
// fails with an error; every name it lists reads as a valid record or fails
// with an error.
func FuzzCheckpointIndex(f *testing.F) {
	f.Add([]byte(`{"metadata": {}, "weight_map": {"model.layers.0.self_attn.q_a_proj.weight": "model-00001.safetensors", "layers.0.attn.attn_sink": "model-00001.safetensors"}}`))
	f.Add([]byte(`{"weight_map": {"x": "../model-00001.safetensors"}}`))
	f.Add([]byte(`{"weight_map": {"layers.0.attn.attn_sink": "model-00002.safetensors"}}`))
	f.Add([]byte(`{"weight_map": {}}`))
	var shard bytes.Buffer
	recs := []Record{
		{Name: "model.layers.0.self_attn.q_a_proj.weight", DType: BF16, Shape: []int{2, 2}, Data: make([]byte, 8)},
		{Name: "layers.0.attn.attn_sink", DType: F32, Shape: []int{2}, Data: make([]byte, 8)},
	}
	if err := WriteSafetensors(&shard, recs, nil); err != nil {
		f.Fatal(err)
	}
	dir := f.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "model-00001.safetensors"), shard.Bytes(), 0o644); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, idx []byte) {
		if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), idx, 0o644); err != nil {
			t.Fatal(err)
		}
		c, err := OpenCheckpoint(dir)
		if err != nil {
			return
		}
		defer c.Close()
		for _, n := range c.Names() {
			if !c.Has(n) {
				t.Fatalf("listed name %q is not Has", n)
			}
			r, err := c.Read(n)
			if err != nil {
				continue
			}
			if err := r.Check(); err != nil {
				t.Fatalf("%q read but invalid: %v", n, err)
			}
		}
		for l := 0; l < 2; l++ {
			_ = c.LayerAttention(l)
		}
	})
}

// TestNpzStoredMemberClaim: a stored member whose zip directory entry claims
// more bytes than the archive holds (64 GiB in a few hundred bytes, with an
// npy header to match) is refused at Open; it used to be indexed and then
// allocated in full by Read (found by engineer I's bad-input corpus,
// testdata/bad/npz_claims_64g.npz).
func TestNpzStoredMemberClaim(t *testing.T) {
	const claim = 1 << 36
	dict := "{'descr': '<u2', 'fortran_order': False, 'shape': (34359738304,), }"
	for (10+len(dict)+1)%64 != 0 {
		dict += " "
	}
	dict += "\n"
	npy := append(append([]byte("\x93NUMPY\x01\x00"), byte(len(dict)), byte(len(dict)>>8)), dict...)
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	w, err := zw.CreateRaw(&zip.FileHeader{Name: "L0.q.npy", Method: zip.Store, CompressedSize64: claim, UncompressedSize64: claim})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(append(npy, make([]byte, 16)...)); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "claim.npz")
	if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	d, err := Open(p)
	if err == nil {
		d.Close()
		t.Fatal("Open accepted a stored member larger than the archive")
	}
	if !strings.Contains(err.Error(), "exceeds the") || !strings.Contains(err.Error(), "L0.q.npy") {
		t.Fatalf("error %q does not name the member and the claim", err)
	}
}
