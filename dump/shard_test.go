package dump

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"
)

func writeRank(t *testing.T, path string, rank int, recs []Record, shards []*ShardInfo) {
	t.Helper()
	w, err := Create(path, Header{Producer: map[string]string{"tp_rank": istr(rank), "tp_size": "2"}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range recs {
		if shards[i] != nil {
			err = w.WriteShard(&recs[i], *shards[i])
		} else {
			err = w.Write(&recs[i])
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

func bf16Rec(stage string, shape []int, data []byte) Record {
	return Record{Key: Key{Step: 5, Layer: 0, Stage: stage}, DType: U8, Shape: shape, Data: data}
}

// Two TP ranks: q sharded along dim 0 (heads) and along dim 1, x replicated.
// Open merges the shards in rank order and keeps one copy of x.
func TestTPShardsMerged(t *testing.T) {
	dir := t.TempDir()
	x := []byte{9, 8, 7}
	writeRank(t, filepath.Join(dir, "step_5.tp0.smd"), 0,
		[]Record{bf16Rec("q", []int{1, 2}, []byte{1, 2}), bf16Rec("u", []int{2, 1}, []byte{1, 3}), bf16Rec("x", []int{3}, x)},
		[]*ShardInfo{{Rank: 0, Size: 2, Dim: 0}, {Rank: 0, Size: 2, Dim: 1}, nil})
	writeRank(t, filepath.Join(dir, "step_5.tp1.smd"), 1,
		[]Record{bf16Rec("q", []int{1, 2}, []byte{3, 4}), bf16Rec("u", []int{2, 1}, []byte{2, 4}), bf16Rec("x", []int{3}, x)},
		[]*ShardInfo{{Rank: 1, Size: 2, Dim: 0}, {Rank: 1, Size: 2, Dim: 1}, nil})
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for stage, want := range map[string][]byte{"q": {1, 2, 3, 4}, "u": {1, 2, 3, 4}, "x": x} {
		r, err := d.Get(Key{Step: 5, Layer: 0, Stage: stage}, KindStage)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(r.Data, want) {
			t.Errorf("%s = %v %v, want %v", stage, r.Shape, r.Data, want)
		}
	}
	if e, _ := d.Lookup(Key{Step: 5, Layer: 0, Stage: "u"}, KindStage); e.Shape[0] != 2 || e.Shape[1] != 2 {
		t.Errorf("u shape %v", e.Shape)
	}
	if len(d.Entries) != 3 {
		t.Errorf("%d entries", len(d.Entries))
	}
}

func TestTPShardErrors(t *testing.T) {
	// a missing rank, and a replicated record that differs between ranks
	dir := t.TempDir()
	writeRank(t, filepath.Join(dir, "a.tp0.smd"), 0, []Record{bf16Rec("q", []int{1, 2}, []byte{1, 2})}, []*ShardInfo{{Rank: 0, Size: 2, Dim: 0}})
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "1 of 2 TP shards present") {
		t.Errorf("missing rank: %v", err)
	}
	dir = t.TempDir()
	writeRank(t, filepath.Join(dir, "a.tp0.smd"), 0, []Record{bf16Rec("x", []int{1}, []byte{1})}, []*ShardInfo{nil})
	writeRank(t, filepath.Join(dir, "a.tp1.smd"), 1, []Record{bf16Rec("x", []int{1}, []byte{2})}, []*ShardInfo{nil})
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "differs between TP rank 0") {
		t.Errorf("replicated differs: %v", err)
	}
}

// testdata/dump/capture-tp: two TP ranks written by the Python helper
// (capture/tests/test_capture_cpu.py): q split along dim 0, u along dim 1,
// x replicated. Open merges them back into arange(24).reshape(4, 6).
func TestCaptureTPMerged(t *testing.T) {
	d, err := Open("../testdata/dump/capture-tp")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for _, st := range []string{"q", "u"} {
		r, err := d.Get(Key{Step: 5, Layer: 0, Stage: st}, KindStage)
		if err != nil {
			t.Fatal(err)
		}
		v, err := r.Float32()
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Shape) != 2 || r.Shape[0] != 4 || r.Shape[1] != 6 {
			t.Fatalf("%s shape %v", st, r.Shape)
		}
		for i, x := range v {
			if x != float32(i) {
				t.Fatalf("%s[%d] = %v", st, i, x)
			}
		}
	}
	if len(d.Entries) != 3 {
		t.Errorf("%d entries", len(d.Entries))
	}
}
