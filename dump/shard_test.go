package dump

import (
	"bytes"
	"fmt"
	"math"
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

// Zero-byte shards may claim huge leading dimensions (the shape holds no
// element when another dimension is 0): reading the merged record must not
// loop over them (it looped 2^60 times). Shards whose dimensions sum past
// the largest int are refused at open.
func TestTPShardsHugeShapes(t *testing.T) {
	t.Run("zero bytes", func(t *testing.T) {
		dir := t.TempDir()
		empty := []int{1 << 30, 1 << 30, 0}
		for rank := 0; rank < 2; rank++ {
			writeRank(t, filepath.Join(dir, "a.tp"+istr(rank)+".smd"), rank,
				[]Record{bf16Rec("x", empty, []byte{})}, []*ShardInfo{{Rank: rank, Size: 2, Dim: 2}})
		}
		d, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		r, err := d.Get(Key{Step: 5, Layer: 0, Stage: "x"}, KindStage)
		if err != nil || !equalInts(r.Shape, empty) || len(r.Data) != 0 {
			t.Errorf("read %v %d bytes, %v; want %v, no bytes", r.Shape, len(r.Data), err, empty)
		}
	})
	t.Run("dimension overflow", func(t *testing.T) {
		dir := t.TempDir()
		half := []int{math.MaxInt/2 + 1, 0}
		for rank := 0; rank < 2; rank++ {
			writeRank(t, filepath.Join(dir, "a.tp"+istr(rank)+".smd"), rank,
				[]Record{bf16Rec("x", half, []byte{})}, []*ShardInfo{{Rank: rank, Size: 2, Dim: 0}})
		}
		d, err := Open(dir)
		if err == nil {
			t.Errorf("opened shards summing past the largest int: shape %v", d.Entries[0].Shape)
			d.Close()
			return
		}
		want := fmt.Sprintf("a.tp1.smd: record 1 (-/p5/L0/x stage): shard shape %v: the 2 TP shards' dimension 0 overflows", half)
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %v, want one containing %q", err, want)
		}
	})
}
