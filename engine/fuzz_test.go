package engine

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// The decoders of outside input in this package: the ModelArgs JSON (a dump
// header's model args, a config.json), the --tol-stage flag and the --tol
// file. Each must return an error, never panic, on any input.

// FuzzConfig: ParseConfig never panics; an accepted config round-trips
// through JSON unchanged, and the per-layer helpers the replay calls on it
// (Ratio, LayerKind, Coff, RopeParams, Stages at a few positions) do not
// panic.
func FuzzConfig(f *testing.F) {
	if b, err := os.ReadFile(filepath.Join("..", "testdata", "official-v4-tiny", "config.json")); err == nil {
		f.Add(b)
	}
	for _, name := range PresetNames() {
		c, err := Preset(name)
		if err != nil {
			f.Fatal(err)
		}
		b, err := json.Marshal(c)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte(`{}`))
	f.Add([]byte(`{"n_layers": 2, "compress_ratios": [4, 128], "index_head_dim": 128, "window_size": 1}`))
	f.Add([]byte(`{"head_dim": 64, "rope_head_dim": 64}`))
	f.Add([]byte(`{"n_layers": 1, "compress_ratios": [5]}`))
	f.Add([]byte(`{"dim": 1e400}`))
	// Round trips that once changed the config: a V3.2 key whose default is
	// not zero, set to zero (omitempty dropped it, the parse restored the
	// default), and an empty V4.1 list (it came back nil).
	for _, k := range []string{"n_limited_groups", "n_expert_groups", "n_dense_layers", "inter_dim", "mscale"} {
		f.Add([]byte(`{"kv_lora_rank": 512, "q_lora_rank": 128, "` + k + `": 0}`))
	}
	f.Add([]byte(`{"n_layers": 2, "compress_ratios": [4, 128], "kv_source_layers": [], "engram_num_embeddings": [], "index_head_dim": 128, "window_size": 1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseConfig(b)
		if err != nil {
			if c != nil {
				t.Fatal("ParseConfig returned a config with an error")
			}
			return
		}
		again, err := json.Marshal(c)
		if err != nil {
			t.Fatalf("accepted config does not marshal: %v", err)
		}
		c2, err := ParseConfig(again)
		if err != nil {
			t.Fatalf("accepted config rejected after a JSON round trip: %v\n%s", err, again)
		}
		if !reflect.DeepEqual(c, c2) {
			t.Fatalf("config changed in a JSON round trip:\n%+v\n%+v", c, c2)
		}
		if s := c.SoftmaxScale(); !(s > 0) || math.IsInf(float64(s), 0) {
			t.Fatalf("softmax scale %g", s)
		}
		for l := 0; l < c.NLayers && l < 64; l++ {
			r := c.Ratio(l)
			_ = c.LayerKind(l)
			_ = Coff(r)
			_ = c.RopeParams(l)
			for _, p := range []int64{0, 3, int64(c.WindowSize) - 1, int64(c.WindowSize), 4*int64(c.WindowSize) + 3} {
				if p < 0 {
					continue
				}
				defs := Stages(c, l, p)
				if len(defs) == 0 || defs[len(defs)-1].Name != "y" {
					t.Fatalf("layer %d step %d: stage list ends with %v", l, p, defs)
				}
			}
		}
	})
}
