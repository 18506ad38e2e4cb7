package replay

import (
	"context"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/attention"
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
			for _, mode := range []Mode{Local, Propagated, Chained} {
				rep, err := Run(context.Background(), m, src, Options{Mode: mode})
				if err != nil {
					t.Fatal(err)
				}
				if rep.Diverged() {
					t.Errorf("%s %s: %s", name, mode, rep.First.Text)
				}
				if rep.Summary.Compared == 0 || rep.Summary.Skipped != 0 || rep.Verdict != VerdictAgree {
					t.Errorf("%s %s: verdict %s, summary %+v", name, mode, rep.Verdict, rep.Summary)
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

// A GPU whose RoPE table is wrong is caught by the table check, as a
// divergence of its own kind at the first step, with the wrong table named:
// each known wrong table (bf16 inv_freq, no YaRN, another rope_factor,
// another theta) in place of the golden's own table of layer 1 (r = 4),
// carrying the golden's CUDA libm noise (its angle errors, in ulps of θ).
func TestReplayWrongRopeTable(t *testing.T) {
	for _, want := range []string{"bf16 inv_freq", "no YaRN", "YaRN with rope_factor 40", "base 10000 (the other layer kind's theta)"} {
		m, src := openReplayGolden(t, "official-v4-tiny")
		cfg := m.Cfg
		p := cfg.RopeParams(1)
		gpu := m.Rope[1]
		var freqs [attention.RopePairs]float32
		found := false
		for _, h := range attention.RopeHypotheses(p, cfg.RopeTheta, p) {
			if h.Name == want {
				freqs, found = h.Freqs, true
			}
		}
		if !found {
			t.Fatalf("no hypothesis %q", want)
		}
		ref := attention.RopeFreqs(p)
		tb := &engine.RopeTable{T: gpu.T, Cos: make([]float32, len(gpu.Cos)), Sin: make([]float32, len(gpu.Sin)), Source: "wrong table"}
		for tt := 0; tt < gpu.T; tt++ {
			for i := 0; i < attention.RopePairs; i++ {
				k := tt*attention.RopePairs + i
				ulp := func(x float64) float64 { return math.Ldexp(1, math.Ilogb(math.Max(math.Abs(x), 1))-23) }
				th0 := float64(float32(float32(tt) * ref[i]))
				noise := math.Remainder(math.Atan2(float64(gpu.Sin[k]), float64(gpu.Cos[k]))-th0, 2*math.Pi)
				th := float64(float32(float32(tt) * freqs[i]))
				th += noise / ulp(th0) * ulp(th)
				tb.Cos[k], tb.Sin[k] = float32(math.Cos(th)), float32(math.Sin(th))
			}
		}
		for l := range m.Rope {
			if cfg.Ratio(l) > 0 {
				m.Rope[l] = tb
			}
		}
		rep, err := Run(context.Background(), m, src, Options{})
		if err != nil {
			t.Fatal(err)
		}
		d := rep.First
		if d == nil || d.Step != 2 || d.Layer != 1 || d.Stage != RopeStage || d.Kind != KindRopeTable || d.Hypothesis == nil || d.Hypothesis.Best == nil {
			t.Fatalf("%s: first divergence %+v", want, d)
		}
		if d.Hypothesis.Best.Name != want || !d.Hypothesis.Best.Exact || !strings.Contains(d.Text, `hypothesis "`+want+`"`) {
			t.Fatalf("%s: named %q (exact %v): %s", want, d.Hypothesis.Best.Name, d.Hypothesis.Best.Exact, d.Text)
		}
	}
}
