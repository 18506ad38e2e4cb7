package fault

import (
	"context"
	"errors"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
)

// wholeCfg is the config of a whole synthetic model: the tiny preset with
// SynthWholeSwigluLimit.
func wholeCfg(t *testing.T) *engine.Config {
	t.Helper()
	cfg, err := engine.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	cfg.SwigluLimit = SynthWholeSwigluLimit
	return cfg
}

// TestSynthWholeCleanAgrees: a clean whole synthetic dump holds every
// whole-step stage (block, attention, MoE, head) and replays clean, every
// stage compared, in local, propagated and chained modes — from memory and
// from the files Write makes (weights and dump read back as replay does).
func TestSynthWholeCleanAgrees(t *testing.T) {
	s, err := Synthesize(SynthOptions{Prefill: 6, Steps: 3, Seed: 1, Whole: true})
	if err != nil {
		t.Fatal(err)
	}
	want := engine.WholeStageNames(s.Cfg, s.Cfg.NLayers-1, 7)
	for _, l := range []int{0, s.Cfg.NLayers - 1} {
		for _, name := range engine.WholeStageNames(s.Cfg, l, 7) {
			layer := l
			if name == "logits" {
				layer = dump.Global
			}
			if _, ok := s.Src.Values[replay.StageKey{Step: 7, Layer: layer, Stage: name}]; !ok {
				t.Errorf("step 7 layer %d: stage %s is not in the dump", l, name)
			}
		}
	}
	if _, ok := s.Src.Values[replay.StageKey{Step: 7, Layer: dump.Global, Stage: "tok"}]; !ok || len(want) < 30 {
		t.Errorf("no global tok, or only %d whole-step stages", len(want))
	}
	fm, fsrc := writtenSynth(t, s)
	if fm.Head == nil || fm.Weights[1].Block == nil || fm.Cfg.SwigluLimit != SynthWholeSwigluLimit {
		t.Fatalf("the written weights do not load as the whole model (head %v, block %v, swiglu_limit %g)", fm.Head != nil, fm.Weights[1].Block != nil, fm.Cfg.SwigluLimit)
	}
	for _, c := range []struct {
		name string
		m    *engine.Model
		src  replay.Source
	}{{"memory", s.Model(), s.Src}, {"files", fm, fsrc}} {
		for _, mode := range []replay.Mode{replay.Local, replay.Propagated, replay.Chained} {
			rep, err := replay.Run(context.Background(), c.m, c.src, replay.Options{Mode: mode})
			if err != nil {
				t.Fatalf("%s %s: %v", c.name, mode, err)
			}
			if rep.Diverged() {
				t.Fatalf("%s %s: clean whole synthetic dump diverged: %s", c.name, mode, rep.First.Text)
			}
			if rep.Summary.Compared < 500 || rep.Summary.Missing != 0 || rep.Summary.Skipped != 0 || len(rep.Coverage.NotModelled) != 0 {
				t.Fatalf("%s %s: summary %+v, not modelled %v: want every stage compared", c.name, mode, rep.Summary, rep.Coverage.NotModelled)
			}
			seen := map[string]bool{}
			for _, r := range rep.Results {
				seen[r.Stage] = true
				if mode == replay.Local && r.Metrics != nil && r.Metrics.Mismatch != 0 {
					t.Fatalf("%s: step %d layer %d %s: %d mismatches in a clean synthetic dump", c.name, r.Step, r.Layer, r.Stage, r.Metrics.Mismatch)
				}
			}
			for _, n := range []string{"hc_attn_comb", "h_mid", "moe_indices", "moe_weights", "ffn_out", "h_out", "logits"} {
				if !seen[n] {
					t.Errorf("%s %s: stage %s not compared", c.name, mode, n)
				}
			}
		}
	}
}

// writtenSynth writes s (Synth.Write) and opens it as 'sparsemla replay'
// does: the native dump and the model loaded from its weights file.
func writtenSynth(t *testing.T, s *Synth) (*engine.Model, replay.Source) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "synth")
	if err := s.Write(dir); err != nil {
		t.Fatal(err)
	}
	d, err := dump.Open(filepath.Join(dir, SynthDumpFile))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	src, err := replay.NewDumpSource(d, SynthRequest)
	if err != nil {
		t.Fatal(err)
	}
	m, err := replay.LoadModel(d, src, "")
	if err != nil {
		t.Fatal(err)
	}
	return m, src
}

// replayLocal replays src against m in local mode.
func replayLocal(t *testing.T, m *engine.Model, src replay.Source) *replay.Report {
	t.Helper()
	rep, err := replay.Run(context.Background(), m, src, replay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// TestSynthWholeFaultsFound injects every fault of the whole layer
// (NeedsBlock) into a whole synthetic model at seeded random positions: the
// local replay names exactly the injected step, layer, stage and diagnosis
// kind, the diagnosis names the part (faultWhy) and the hypothesis that
// reproduces it bit for bit (faultHyp) — from memory and from the files
// Write makes.
func TestSynthWholeFaultsFound(t *testing.T) {
	cfg := wholeCfg(t)
	const prefill, steps = 6, 3
	first, last := int64(prefill), int64(prefill+steps-1)
	rng := rand.New(rand.NewPCG(2026, 12))
	n := -1
	for _, kind := range Kinds() {
		if !(Fault{Kind: kind}).NeedsBlock() {
			continue
		}
		if n++; !raceShortSample(n) {
			continue
		}
		pos := faultPositions(cfg, kind, first, last)
		if len(pos) == 0 {
			t.Fatalf("%s: no valid position in steps %d..%d", kind, first, last)
		}
		found := false
		for try := 0; try < 20 && !found; try++ {
			f := pos[rng.IntN(len(pos))]
			seed := rng.Uint64()
			s, err := Synthesize(SynthOptions{Prefill: prefill, Steps: steps, Seed: seed, Fault: &f, Whole: true})
			if errors.Is(err, ErrInvisible) {
				continue
			}
			if err != nil {
				t.Fatalf("%s (seed %d): %v", f, seed, err)
			}
			found = true
			// From memory, and from the files synth writes (what
			// 'sparsemla replay DIR' reads).
			m, src := writtenSynth(t, s)
			for _, c := range []struct {
				name string
				rep  *replay.Report
			}{{"memory", replaySynth(t, s)}, {"files", replayLocal(t, m, src)}} {
				d := c.rep.First
				if d == nil {
					t.Fatalf("%s (seed %d, %s): replay agrees, want a divergence", f, seed, c.name)
				}
				if d.Step != f.Step || d.Layer != f.Layer || d.Stage != f.Stage() || d.Kind != f.Diagnosis() {
					t.Fatalf("%s (seed %d, %s): got step %d layer %d stage %s kind %q; want step %d layer %d stage %s kind %q\n%s",
						f, seed, c.name, d.Step, d.Layer, d.Stage, d.Kind, f.Step, f.Layer, f.Stage(), f.Diagnosis(), d.Text)
				}
				checkWhy(t, f, d.Text, true)
			}
			t.Logf("%s: %s", f, replaySynth(t, s).First.Text)
		}
		if !found {
			t.Fatalf("%s: no visible injection in 20 tries", kind)
		}
	}
}

// TestSynthAttentionOnlyRefusesBlockFaults: without Whole a fault of the
// whole layer is refused with the way to make it.
func TestSynthAttentionOnlyRefusesBlockFaults(t *testing.T) {
	_, err := Synthesize(SynthOptions{Prefill: 6, Steps: 2, Fault: &Fault{Kind: ExpertNibble, Step: 6, Layer: 1}})
	if err == nil || !strings.Contains(err.Error(), "synth --whole") {
		t.Errorf("attention-only synth with %s: %v", ExpertNibble, err)
	}
}
