package replay

import (
	"context"
	"path/filepath"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/quant"
)

// openReplayGolden opens a GPU-made dump directory under testdata/
// (committed: a missing one fails the test) and its model; the dump is
// closed when the test ends.
func openReplayGolden(t *testing.T, name string) (*engine.Model, *DumpSource) {
	t.Helper()
	d, err := dump.Open(filepath.Join("..", "testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	src, err := NewDumpSource(d, "")
	if err != nil {
		t.Fatal(err)
	}
	m, err := LoadModel(d, src, "")
	if err != nil {
		t.Fatal(err)
	}
	return m, src
}

// TestReplayGPUDumpsAgree: the default tolerances give zero divergences on the
// clean GPU dumps of the official model.py, in both modes, with every stage
// of every step compared.
func TestReplayGPUDumpsAgree(t *testing.T) {
	for _, name := range []string{"official-v4-tiny", "gpu-v4-tiny-long"} {
		t.Run(name, func(t *testing.T) {
			m, src := openReplayGolden(t, name)
			if !m.GPURope {
				t.Errorf("%s: the dump's GPU RoPE tables were not picked up", name)
			}
			for _, mode := range []Mode{Local, Propagated} {
				rep, err := Run(context.Background(), m, src, Options{Mode: mode})
				if err != nil {
					t.Fatal(err)
				}
				if rep.Diverged() {
					t.Errorf("%s %s: %s", name, mode, rep.First.Text)
				}
				if rep.Summary.Compared == 0 || rep.Summary.Skipped != 0 {
					t.Errorf("%s %s: summary %+v", name, mode, rep.Summary)
				}
				t.Logf("%s %s: %+v", name, mode, rep.Summary)
			}
		})
	}
}

// TestReplayGoldenCorrupted: one value of the official dump changed by one
// bf16 ulp in an exact stage is the first divergence, at its place.
func TestReplayGoldenCorrupted(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	mem := NewMemSource("corrupted golden")
	for _, p := range src.Steps() {
		for _, l := range src.Layers() {
			names := []string{"x"}
			for _, d := range engine.Stages(m.Cfg, l, p) {
				names = append(names, d.Name)
			}
			for _, n := range names {
				if v, ok, err := src.Stage(p, l, n); err != nil {
					t.Fatal(err)
				} else if ok {
					mem.Put(p, l, n, v)
				}
			}
		}
	}
	for _, l := range src.Layers() {
		st, after, _, err := src.State(l)
		if err != nil {
			t.Fatal(err)
		}
		mem.Start[l], mem.StartAfter = st, after
	}
	k := StageKey{Step: 5, Layer: 2, Stage: "kv"}
	v := mem.Values[k].Clone()
	v.F[3] = quant.BF16Next(v.F[3], 1)
	mem.Values[k] = v
	rep, err := Run(context.Background(), m, mem, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.First == nil || rep.First.Step != 5 || rep.First.Layer != 2 || rep.First.Stage != "kv" {
		t.Fatalf("first divergence %+v, want step 5 layer 2 kv", rep.First)
	}
}
