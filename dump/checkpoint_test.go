package dump

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func writeST(t *testing.T, path string, recs []Record) {
	t.Helper()
	var buf bytes.Buffer
	if err := WriteSafetensors(&buf, recs, nil); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCheckpointHF(t *testing.T) {
	dir := t.TempDir()
	w := Record{Name: "model.layers.0.self_attn.q_a_proj.weight", DType: E4M3, Shape: []int{2, 2}, Data: []byte{0x38, 0xB8, 0x7E, 0}}
	s := Record{Name: "model.layers.0.self_attn.q_a_proj.weight_scale_inv", DType: E8M0, Shape: []int{1, 1}, Data: []byte{126}}
	n := Record{Name: "model.layers.0.input_layernorm.weight", DType: F32, Shape: []int{1}, Data: []byte{0, 0, 0x80, 0x3f}}
	k := Record{Name: "model.layers.1.self_attn.wkv.weight", DType: BF16, Shape: []int{1}, Data: []byte{0x80, 0x3f}}
	writeST(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), []Record{w, s, n})
	writeST(t, filepath.Join(dir, "model-00002-of-00002.safetensors"), []Record{k})
	idx := `{"metadata": {}, "weight_map": {
	  "model.layers.0.self_attn.q_a_proj.weight": "model-00001-of-00002.safetensors",
	  "model.layers.0.self_attn.q_a_proj.weight_scale_inv": "model-00001-of-00002.safetensors",
	  "model.layers.0.input_layernorm.weight": "model-00001-of-00002.safetensors",
	  "model.layers.1.self_attn.wkv.weight": "model-00002-of-00002.safetensors"}}`
	if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), []byte(idx), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := c.LayerAttention(0); !slices.Equal(got, []string{"layers.0.attn.wq_a.scale", "layers.0.attn.wq_a.weight", "layers.0.attn_norm.weight"}) {
		t.Errorf("LayerAttention(0) = %v", got)
	}
	r, err := c.Read("layers.0.attn.wq_a.weight")
	if err != nil {
		t.Fatal(err)
	}
	v, _ := r.Float32()
	if r.Layer != 0 || r.Kind != KindWeight || r.Name != w.Name || !slices.Equal(v, []float32{1, -1, 448, 0}) {
		t.Errorf("wq_a.weight: %+v %v", r.Key, v)
	}
	sc, err := c.Read("layers.0.attn.wq_a.scale")
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := sc.Float32(); !slices.Equal(v, []float32{0.5}) {
		t.Errorf("scale = %v", v)
	}
	if _, err := c.Read("model.layers.0.self_attn.q_a_proj.weight"); err != nil {
		t.Errorf("HF name: %v", err)
	}
	if len(c.shards) != 1 {
		t.Errorf("%d shards opened reading layer 0, want 1", len(c.shards))
	}
	if _, err := c.Read("layers.1.attn.wkv.weight"); err != nil || len(c.shards) != 2 {
		t.Errorf("layer 1: %v, %d shards", err, len(c.shards))
	}
	if _, err := c.Read("layers.9.attn.wkv.weight"); err == nil {
		t.Error("missing tensor read")
	}
	// inspect / Open see the checkpoint directory as weights by layer.
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if d.Map.Name != "hf-checkpoint" || len(d.Entries) != 4 {
		t.Errorf("Open: map %s, %d entries", d.Map.Name, len(d.Entries))
	}
	if _, ok := d.Lookup(Key{Step: NoStep, Layer: 1, Stage: "model.layers.1.self_attn.wkv.weight"}, KindWeight); !ok {
		t.Error("Open: layer-1 weight not indexed")
	}
	d.Close()
	// A shard outside the directory is refused.
	bad := strings.Replace(idx, `"model-00002-of-00002.safetensors"}`, `"../x.safetensors"}`, 1)
	if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), []byte(bad), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenCheckpoint(dir); err == nil || !strings.Contains(err.Error(), "../x.safetensors") {
		t.Errorf("path traversal: err = %v", err)
	}
}

func TestOfficialName(t *testing.T) {
	for hf, want := range map[string]string{
		"model.layers.3.self_attn.q_a_proj.weight_scale_inv": "layers.3.attn.wq_a.scale",
		"model.layers.3.self_attn.kv_a_layernorm.weight":     "layers.3.attn.kv_norm.weight",
		"model.layers.3.self_attn.compressor.ape":            "layers.3.attn.compressor.ape",
		"layers.3.attn.wq_b.scale":                           "layers.3.attn.wq_b.scale",
		"model.embed_tokens.weight":                          "embed.weight",
	} {
		if got := OfficialName(hf); got != want {
			t.Errorf("OfficialName(%q) = %q, want %q", hf, got, want)
		}
	}
}

// TestReadRange: part of a tensor, from a file and from a checkpoint by its
// official name; a range past the tensor's bytes and an unknown tensor are
// errors naming them.
func TestReadRange(t *testing.T) {
	dir := t.TempDir()
	a := Record{Name: "model.embed_tokens.weight", DType: BF16, Shape: []int{3, 2}, Data: []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}}
	b := Record{Name: "model.norm.weight", DType: F32, Shape: []int{1}, Data: []byte{0, 0, 0x80, 0x3f}}
	path := filepath.Join(dir, "model.safetensors")
	writeST(t, path, []Record{b, a})
	st, err := OpenSafetensors(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	got := make([]byte, 4)
	if err := st.ReadRange(a.Name, 4, got); err != nil || !bytes.Equal(got, []byte{5, 6, 7, 8}) {
		t.Fatalf("row 1: %v %v", got, err)
	}
	if err := st.ReadRange(a.Name, 10, got); err == nil || !strings.Contains(err.Error(), "bytes [10, 14) outside its 12 bytes") {
		t.Errorf("past the end: %v", err)
	}
	if err := st.ReadRange("nope", 0, got); err == nil || !strings.Contains(err.Error(), `no tensor "nope"`) {
		t.Errorf("unknown tensor: %v", err)
	}
	c, err := OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.ReadRange("embed.weight", 8, got); err != nil || !bytes.Equal(got, []byte{9, 10, 11, 12}) {
		t.Fatalf("checkpoint row 2: %v %v", got, err)
	}
	if err := c.ReadRange("embed.nope", 0, got); err == nil || !strings.Contains(err.Error(), "no tensor") {
		t.Errorf("checkpoint unknown tensor: %v", err)
	}
}
