package fault

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/replay"
)

// v32Synth is a v32-tiny synthetic run past the top-k (16) so that the
// indexer really selects: prefill 14, steps 14..21.
func v32Synth(t *testing.T, f *Fault, seed uint64) (*Synth, error) {
	t.Helper()
	return Synthesize(SynthOptions{Config: "v32-tiny", Prefill: 14, Steps: 8, Seed: seed, Fault: f})
}

func TestV32SynthCleanAgrees(t *testing.T) {
	s, err := v32Synth(t, nil, 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
		rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: clean V3.2 synthetic dump diverged: %s", mode, rep.First.Text)
		}
		// 8 steps × 2 layers × every V3.2 stage
		if want := 8 * 2 * len(engine.V32Stages(s.Cfg, 0, 14)); rep.Summary.Compared != want || rep.Summary.Missing != 0 || rep.Summary.Skipped != 0 {
			t.Fatalf("%s: summary %+v, want %d stages compared", mode, rep.Summary, want)
		}
		for _, r := range rep.Results {
			if mode == replay.Local && r.Metrics != nil && r.Metrics.Mismatch != 0 {
				t.Fatalf("step %d layer %d %s: %d mismatches in a clean synthetic dump", r.Step, r.Layer, r.Stage, r.Metrics.Mismatch)
			}
		}
	}
}

// TestV32SynthFaultsFound: every kind that applies to V3.2 is named exactly
// (step, layer, stage, kind) by a local and a propagated replay, in a
// synthetic run and in a faulted copy of a clean dump; every other kind is
// refused with its one-line reason.
func TestV32SynthFaultsFound(t *testing.T) {
	applies := map[Kind]Fault{
		SplitKMerge:  {SplitKMerge, 17, 1},
		ScaleByte:    {ScaleByte, 16, 0},
		TopKOffByOne: {TopKOffByOne, 19, 1},
	}
	refused := map[Kind]string{
		WrongLSE: "no attention sink", FP8Scale: "latent cache in bf16", CompressorLate: "no compressor",
		WindowOrder: "no sliding window", ExpertNibble: "FP8", ExpertScaleBlock: "FP8", ExpertNoClamp: "no swiglu_limit",
		RouterHashOff: "no hash layers", HCPostTransposed: "no hyper-connections", HCSplitNoSigmoid: "no hyper-connections",
		StalePrefix: "not implemented for V3.2",
		// FFN-side kinds: this model holds the attention path only
		RouterBias: "whole V3.2 layer", RouterUnnormalised: "whole V3.2 layer", SharedGateUp: "whole V3.2 layer",
		HeadNoNorm: "whole V3.2 layer",
	}
	clean, err := v32Synth(t, nil, 3)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := clean.Write(dir); err != nil {
		t.Fatal(err)
	}
	d, src, m := openDumpModel(t, filepath.Join(dir, SynthDumpFile))
	for _, kind := range Kinds() {
		f, ok := applies[kind]
		if !ok {
			f = Fault{kind, 17, 1}
			_, err := v32Synth(t, &f, 3)
			if err == nil || !strings.Contains(err.Error(), refused[kind]) || strings.Contains(err.Error(), "\n") {
				t.Errorf("%s: Synthesize: %v, want a one-line refusal saying %q", f, err, refused[kind])
			}
			if _, err := WriteFaulted(d, src, m, t.TempDir(), Options{Fault: f}); err == nil || !strings.Contains(err.Error(), refused[kind]) {
				t.Errorf("%s: WriteFaulted: %v, want a refusal saying %q", f, err, refused[kind])
			}
			continue
		}
		want := func(what string, rep *replay.Report) {
			d := rep.First
			if d == nil {
				t.Fatalf("%s (%s): replay agrees, want a divergence", f, what)
			}
			if d.Step != f.Step || d.Layer != f.Layer || d.Stage != f.StageIn(m.Cfg) || d.Kind != f.DiagnosisIn(m.Cfg) {
				t.Fatalf("%s (%s): got step %d layer %d stage %s kind %q; want stage %s kind %q\n%s",
					f, what, d.Step, d.Layer, d.Stage, d.Kind, f.StageIn(m.Cfg), f.DiagnosisIn(m.Cfg), d.Text)
			}
			t.Logf("%s (%s): %s", f, what, d.Text)
		}
		s, err := v32Synth(t, &f, 3)
		if errors.Is(err, ErrInvisible) || err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
			rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: mode})
			if err != nil {
				t.Fatal(err)
			}
			want("synth, "+string(mode), rep)
		}
		out := t.TempDir()
		if _, err := WriteFaulted(d, src, m, out, Options{Fault: f, Seed: 3}); err != nil {
			t.Fatalf("%s: WriteFaulted: %v", f, err)
		}
		_, fsrc, fm := openDumpModel(t, filepath.Join(out, SynthDumpFile))
		rep, err := replay.Run(context.Background(), fm, fsrc, replay.Options{})
		if err != nil {
			t.Fatal(err)
		}
		want("faulted copy", rep)
	}
}

// TestV32FaultedGPUDump: the three V3.2 kinds injected into a copy of the
// GPU dump of the official model.py (testdata/v32-tiny) are named exactly by
// a local and a propagated replay of the copy.
func TestV32FaultedGPUDump(t *testing.T) {
	d, src, m := openFaultInput(t, "v32-tiny")
	hyp := map[Kind]string{}
	for _, c := range v32FFNFaults {
		hyp[c.kind] = c.hyp
	}
	// The FFN-side kinds at the steps the golden dumps the whole layer
	// (10 … 13); router-bias and router-groups-ignored have no place there
	// (no bias, one group: refused).
	for _, f := range []Fault{{SplitKMerge, 17, 1}, {ScaleByte, 16, 0}, {TopKOffByOne, 18, 1},
		{DenseGateUp, 10, 0}, {SharedGateUp, 11, 1}, {RouterUnnormalised, 12, 1}, {HeadNoNorm, 13, 1}} {
		out := t.TempDir()
		if _, err := WriteFaulted(d, src, m, out, Options{Fault: f, Seed: 1}); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		_, fsrc, fm := openDumpModel(t, filepath.Join(out, SynthDumpFile))
		for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
			rep, err := replay.Run(context.Background(), fm, fsrc, replay.Options{Mode: mode})
			if err != nil {
				t.Fatal(err)
			}
			d := rep.First
			if d == nil || d.Step != f.Step || d.Layer != f.Layer && f.Kind != HeadNoNorm || d.Stage != f.StageIn(m.Cfg) || d.Kind != f.DiagnosisIn(m.Cfg) {
				t.Fatalf("%s %s: got %+v, want step %d layer %d stage %s kind %q", f, mode, d, f.Step, f.Layer, f.StageIn(m.Cfg), f.DiagnosisIn(m.Cfg))
			}
			if h := hyp[f.Kind]; h != "" && !strings.Contains(d.Text, fmt.Sprintf("bit for bit by hypothesis %q", h)) {
				t.Fatalf("%s %s: want hypothesis %q named: %s", f, mode, h, d.Text)
			}
		}
	}
	for _, f := range []Fault{{RouterBias, 11, 1}, {RouterGroupsIgnored, 11, 1}} {
		if _, err := WriteFaulted(d, src, m, t.TempDir(), Options{Fault: f}); err == nil || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v, want a one-line refusal (no bias, one group)", f, err)
		} else {
			t.Logf("%s: %v", f, err)
		}
	}
}

// TestV32SynthWholeAgrees: synth --whole on a V3.2 config makes the whole
// layer (engine.V32BlockStages: norms and residuals, the dense MLP of layer
// 0, the MoE of layer 1, the logits), and both replay modes compare every
// stage of it, bit for bit in local mode.
func TestV32SynthWholeAgrees(t *testing.T) {
	s, err := Synthesize(SynthOptions{Config: "v32-tiny", Prefill: 14, Steps: 4, Seed: 2, Whole: true})
	if err != nil {
		t.Fatal(err)
	}
	perStep := 0
	for l := 0; l < s.Cfg.NLayers; l++ {
		perStep += len(engine.V32BlockStages(s.Cfg, l, 14, s.Weights[l]))
	}
	if attn := 2 * len(engine.V32Stages(s.Cfg, 0, 14)); perStep != attn+4+8 {
		t.Fatalf("%d stages per step, want the attention's %d + 4 (layer 0) + 8 (layer 1 with the logits)", perStep, attn)
	}
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
		rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: clean whole V3.2 synthetic dump diverged: %s", mode, rep.First.Text)
		}
		if want := 4 * perStep; rep.Summary.Compared != want || rep.Summary.Missing != 0 || rep.Summary.Skipped != 0 {
			t.Fatalf("%s: summary %+v, want %d stages compared", mode, rep.Summary, want)
		}
		seen := map[string]bool{}
		for _, r := range rep.Results {
			seen[r.Stage] = true
			if mode == replay.Local && r.Metrics != nil && r.Metrics.Mismatch != 0 {
				t.Fatalf("step %d layer %d %s: %d mismatches in a clean synthetic dump", r.Step, r.Layer, r.Stage, r.Metrics.Mismatch)
			}
		}
		for _, n := range []string{"h_in", "x", "h_mid", "ffn_in", "moe_indices", "moe_weights", "ffn_out", "logits"} {
			if !seen[n] {
				t.Fatalf("%s: stage %s not compared", mode, n)
			}
		}
	}
}

// v32GroupedCfg is the preset v32-tiny-grouped (what synth --config
// v32-tiny-grouped makes): v32-tiny with grouped routing, 8 experts in 4
// groups, the best group kept, top-2 — and so (engine.V32SynthGateBias) a
// synthetic gate bias, the 671B router's shape in small.
func v32GroupedCfg(t *testing.T) *engine.Config {
	t.Helper()
	cfg, err := engine.Preset("v32-tiny-grouped")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.NRoutedExperts != 8 || cfg.NExpertGroups != 4 || cfg.NLimitedGroups != 1 || !engine.V32SynthGateBias(cfg) {
		t.Fatalf("preset v32-tiny-grouped: %d experts in %d groups, %d kept, gate bias %v", cfg.NRoutedExperts, cfg.NExpertGroups, cfg.NLimitedGroups, engine.V32SynthGateBias(cfg))
	}
	return cfg
}

// v32FFNFaults are the FFN-side V3.2 faults, each with the hypothesis that
// must reproduce it bit for bit and the part the diagnosis names.
var v32FFNFaults = []struct {
	kind      Kind
	layer     int
	hyp, part string
}{
	{RouterBias, 1, "v32-no-selection-bias", "selection"},
	{RouterGroupsIgnored, 1, "v32-topk-ignoring-groups", "selection"},
	{RouterUnnormalised, 1, "v32-weights-unnormalised", "weights, selection correct"},
	{SharedGateUp, 1, "v32-shared-gate-up-swapped", "shared expert"},
	{DenseGateUp, 0, "v32-dense-gate-up-swapped", "gate and up (w1, w3)"},
	{HeadNoNorm, 1, "v32-head-no-final-norm", "final norm"},
}

// v32WantFFN checks that rep's first divergence is f, with its diagnosis
// kind, part and hypothesis.
func v32WantFFN(t *testing.T, what string, f Fault, cfg *engine.Config, hyp, part string, rep *replay.Report) {
	t.Helper()
	d := rep.First
	if d == nil {
		t.Fatalf("%s (%s): replay agrees, want a divergence", f, what)
	}
	layer := f.Layer
	if d.Step != f.Step || d.Layer != layer && !(f.Kind == HeadNoNorm) || d.Stage != f.StageIn(cfg) || d.Kind != f.DiagnosisIn(cfg) {
		t.Fatalf("%s (%s): got step %d layer %d stage %s kind %q; want stage %s kind %q\n%s",
			f, what, d.Step, d.Layer, d.Stage, d.Kind, f.StageIn(cfg), f.DiagnosisIn(cfg), d.Text)
	}
	if !strings.Contains(d.Text, fmt.Sprintf("bit for bit by hypothesis %q", hyp)) || !strings.Contains(d.Why, part+": ") {
		t.Fatalf("%s (%s): want hypothesis %q and part %q named:\n%s", f, what, hyp, part, d.Text)
	}
	t.Logf("%s (%s): %s", f, what, d.Text)
}

// TestV32SynthFFNFaultsFound: every FFN-side V3.2 kind injected into a
// whole synthetic V3.2 model with grouped routing (synth --whole) is named
// exactly — step, layer, stage, kind, part and the hypothesis reproducing
// it bit for bit — by a local and a propagated replay, and again in a
// faulted copy of the clean dump (fault --in).
func TestV32SynthFFNFaultsFound(t *testing.T) {
	cfg := v32GroupedCfg(t)
	synth := func(f *Fault, seed uint64) (*Synth, error) {
		return Synthesize(SynthOptions{Config: "v32-tiny-grouped", Prefill: 14, Steps: 8, Seed: seed, Whole: true, Fault: f})
	}
	clean, err := synth(nil, 5)
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
		rep, err := replay.Run(context.Background(), clean.Model(), clean.Src, replay.Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: clean grouped V3.2 dump diverged: %s", mode, rep.First.Text)
		}
	}
	dir := t.TempDir()
	if err := clean.Write(dir); err != nil {
		t.Fatal(err)
	}
	d, src, m := openDumpModel(t, filepath.Join(dir, SynthDumpFile))
	if g := m.Weights[1].V32.FFN.Gate; g.Bias == nil {
		t.Fatal("the written grouped model's gate lost its bias")
	}
	for _, c := range v32FFNFaults {
		var f Fault
		var s *Synth
		for step := int64(14); step <= 21 && s == nil; step++ {
			f = Fault{c.kind, step, c.layer}
			s, err = synth(&f, 5)
			if errors.Is(err, ErrInvisible) {
				s = nil
				continue
			}
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
		}
		if s == nil {
			t.Fatalf("%s: invisible at every step 14..21", c.kind)
		}
		for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
			rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: mode})
			if err != nil {
				t.Fatal(err)
			}
			v32WantFFN(t, "synth, "+string(mode), f, cfg, c.hyp, c.part, rep)
		}
		out := t.TempDir()
		if _, err := WriteFaulted(d, src, m, out, Options{Fault: f, Seed: 5}); err != nil {
			t.Fatalf("%s: WriteFaulted: %v", f, err)
		}
		_, fsrc, fm := openDumpModel(t, filepath.Join(out, SynthDumpFile))
		rep, err := replay.Run(context.Background(), fm, fsrc, replay.Options{})
		if err != nil {
			t.Fatal(err)
		}
		v32WantFFN(t, "faulted copy", f, cfg, c.hyp, c.part, rep)
	}
}

// TestV32FFNRefusals: FFN-side kinds where V3.2 has no such part, or the
// model no such place, are refused in one line; the V3.2-only kinds are
// refused in a V4 model.
func TestV32FFNRefusals(t *testing.T) {
	tiny, err := engine.Preset("v32-tiny")
	if err != nil {
		t.Fatal(err)
	}
	v4, err := engine.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  *engine.Config
		f    Fault
		want string
	}{
		{tiny, Fault{RouterBias, 14, 0}, "dense MLP layer"},
		{tiny, Fault{SharedGateUp, 14, 0}, "dense MLP layer"},
		{tiny, Fault{DenseGateUp, 14, 1}, "MoE layer"},
		{tiny, Fault{RouterGroupsIgnored, 14, 1}, "no group limit to ignore"},
		{tiny, Fault{HeadNoNorm, 14, 0}, "last layer"},
		{tiny, Fault{ExpertNibble, 14, 1}, "FP8"},
		{tiny, Fault{ExpertScaleBlock, 14, 1}, "FP8"},
		{tiny, Fault{ExpertNoClamp, 14, 1}, "no swiglu_limit"},
		{tiny, Fault{RouterHashOff, 14, 1}, "no hash layers"},
		{tiny, Fault{HCSplitNoSigmoid, 14, 1}, "no hyper-connections"},
		{v4, Fault{RouterGroupsIgnored, 6, 1}, "no expert groups"},
		{v4, Fault{DenseGateUp, 6, 1}, "no dense MLP layers"},
	} {
		err := c.f.Check(c.cfg, 0, 100)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v, want a one-line refusal saying %q", c.f, err, c.want)
		}
	}
	// router-bias on a gate without a bias (v32-tiny: dim 256, one group)
	f := Fault{RouterBias, 14, 1}
	if _, err := Synthesize(SynthOptions{Config: "v32-tiny", Prefill: 14, Steps: 2, Whole: true, Fault: &f}); err == nil || !strings.Contains(err.Error(), "no bias to leave out") {
		t.Errorf("%s: %v, want the refusal of a gate without bias", f, err)
	}
	if g, err := Parse("router-groups-ignored@3,1"); err != nil || g.Kind != RouterGroupsIgnored {
		t.Errorf("Parse: %v %v", g, err)
	}
}
