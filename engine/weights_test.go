package engine

import (
	"bytes"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"sparsemla/dump"
)

// TestRandomWeightsDeterministic: synthetic weights are generated in parallel
// but do not depend on GOMAXPROCS.
func TestRandomWeightsDeterministic(t *testing.T) {
	cfg, _ := Preset("tiny")
	a := RandomLayerWeights(cfg, 1, 11)
	prev := runtime.GOMAXPROCS(1)
	b := RandomLayerWeights(cfg, 1, 11)
	runtime.GOMAXPROCS(prev)
	if !slices.Equal(a.WqB.Codes, b.WqB.Codes) || !slices.Equal(a.WoA, b.WoA) || !slices.Equal(a.Indexer.Compressor.Wkv, b.Indexer.Compressor.Wkv) {
		t.Error("RandomLayerWeights depends on GOMAXPROCS")
	}
	c := RandomLayerWeights(cfg, 1, 12)
	if slices.Equal(a.WqB.Codes, c.WqB.Codes) {
		t.Error("different seeds give the same weights")
	}
}

// TestLoadLayerWeightsErrors: a tensor with the wrong shape or dtype, or a
// missing one, is an error naming it; nothing is read before the check.
func TestLoadLayerWeightsErrors(t *testing.T) {
	src, err := dump.OpenSafetensors(filepath.Join(goldenTiny, "weights.safetensors"))
	if err != nil {
		t.Skipf("golden weights: %v", err)
	}
	defer src.Close()
	cfg, _ := Preset("tiny")
	if _, err := LoadLayerWeights(cfg, 3, src); err != nil {
		t.Fatalf("golden layer 3: %v", err)
	}
	build := func(edit func(r *dump.Record) bool) *dump.Safetensors {
		var recs []dump.Record
		for _, n := range src.Names() {
			if !strings.HasPrefix(n, "layers.0.") {
				continue
			}
			r, err := src.Read(n)
			if err != nil {
				t.Fatal(err)
			}
			if edit(&r) {
				recs = append(recs, r)
			}
		}
		var buf bytes.Buffer
		if err := dump.WriteSafetensors(&buf, recs, nil); err != nil {
			t.Fatal(err)
		}
		s, err := dump.NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "edited")
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, c := range []struct {
		name string
		edit func(r *dump.Record) bool
		want string
	}{
		{"missing wkv", func(r *dump.Record) bool { return r.Name != "layers.0.attn.wkv.weight" }, "no tensor layers.0.attn.wkv.weight"},
		{"wrong shape", func(r *dump.Record) bool {
			if r.Name == "layers.0.attn.q_norm.weight" {
				r.Shape = []int{r.Shape[0] / 2, 2}
			}
			return true
		}, "q_norm.weight has shape"},
		{"wrong dtype", func(r *dump.Record) bool {
			if r.Name == "layers.0.attn.wq_a.scale" {
				r.DType = dump.I8
			}
			return true
		}, "wq_a.scale has dtype"},
		{"NaN scale", func(r *dump.Record) bool {
			if r.Name == "layers.0.attn.wo_b.scale" {
				r.Data = slices.Clone(r.Data)
				r.Data[0] = 0xFF
			}
			return true
		}, "UE8M0 NaN"},
	} {
		_, err := LoadLayerWeights(cfg, 0, build(c.edit))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want %q", c.name, err, c.want)
		}
	}
}
