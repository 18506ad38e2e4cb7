package dump

import (
	"bytes"
	"fmt"
	"testing"
)

// testdata/sglang-v4-tiny was written by SGLang's real dumper.py (and its
// older tensor dump hook) replaying the official model's GPU tensors of
// testdata/official-v4-tiny (see its README): every mapped record must be
// bit-identical to the official step file's tensor of the same key.
func TestSGLangRealDumperMatchesOfficial(t *testing.T) {
	official, err := Open("../testdata/official-v4-tiny")
	if err != nil {
		t.Fatal(err)
	}
	defer official.Close()
	for _, dir := range []string{"../testdata/sglang-v4-tiny/sglang", "../testdata/sglang-v4-tiny/tensor_dump"} {
		d, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]bool{}
		for _, p := range []int{2, 3, 4} {
			for l := 0; l < 4; l++ {
				for _, st := range []string{"q_a", "cq", "q_b", "kv_raw", "kv_normed", "u", "y"} {
					want[Key{Step: p, Layer: l, Stage: st}.String()] = true
				}
				if d.Map.Name == "sglang" {
					want[Key{Step: p, Layer: l, Stage: "x"}.String()] = true
					want[Key{Step: p, Layer: l, Stage: "o_inv"}.String()] = true
				}
			}
			want[Key{Step: p, Layer: Global, Stage: "pos"}.String()] = true
			want[Key{Step: p, Layer: Global, Stage: "tok"}.String()] = true
		}
		got := 0
		for i := range d.Entries {
			e := &d.Entries[i]
			if !want[e.Key.String()] {
				t.Errorf("%s: unexpected record %s (%s)", dir, e.Key, e.Name)
				continue
			}
			got++
			r, err := d.Read(e)
			if err != nil {
				t.Fatal(err)
			}
			o, err := official.Get(e.Key, KindStage)
			if err != nil {
				t.Fatalf("%s: %v", e.Key, err)
			}
			if r.DType != o.DType || fmt.Sprint(r.Shape) != fmt.Sprint(o.Shape) || !bytes.Equal(r.Data, o.Data) {
				// positions / input_ids are int64 [1] in both
				t.Errorf("%s %s: %s %v differs from the official %s %v", dir, e.Key, r.DType, r.Shape, o.DType, o.Shape)
			}
		}
		if got != len(want) {
			t.Errorf("%s (map %s): %d of %d records; unmapped %d, e.g. %v", dir, d.Map.Name, got, len(want), len(d.Unmapped), d.Unmapped[:min(3, len(d.Unmapped))])
		}
		d.Close()
	}
}
