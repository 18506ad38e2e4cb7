package fault

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/replay"
)

// replaySynth replays a synthetic dump in local mode.
func replaySynth(t *testing.T, s *Synth) *replay.Report {
	t.Helper()
	rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func TestSynthCleanAgrees(t *testing.T) {
	s, err := Synthesize(SynthOptions{Prefill: 6, Steps: 6, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	rep := replaySynth(t, s)
	if rep.Diverged() {
		t.Fatalf("clean synthetic dump diverged: %s", rep.First.Text)
	}
	if rep.Summary.Compared == 0 || rep.Summary.Missing != 0 || rep.Summary.Skipped != 0 {
		t.Fatalf("summary %+v: want every stage compared", rep.Summary)
	}
	// Every stage is bit-identical: the "GPU" is the reference.
	for _, r := range rep.Results {
		if r.Metrics != nil && r.Metrics.Mismatch != 0 {
			t.Fatalf("step %d layer %d %s: %d mismatches in a clean synthetic dump", r.Step, r.Layer, r.Stage, r.Metrics.Mismatch)
		}
	}
	for _, mode := range []replay.Mode{replay.Propagated} {
		rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: clean synthetic dump diverged: %s", mode, rep.First.Text)
		}
	}
}

// faultPositions lists the (step, layer) where kind can be injected in the
// dumped steps first..last of the tiny config.
func faultPositions(cfg *engine.Config, kind Kind, first, last int64) []Fault {
	var out []Fault
	for p := first; p <= last; p++ {
		for l := 0; l < cfg.NLayers; l++ {
			f := Fault{Kind: kind, Step: p, Layer: l}
			if f.Check(cfg, first, last) == nil {
				out = append(out, f)
			}
		}
	}
	return out
}

// faultWhy is what the diagnosis of each fault must say.
var faultWhy = map[Kind]string{
	SplitKMerge:    `reproduced bit for bit by hypothesis "splitk-unscaled-split-1"`,
	WrongLSE:       `reproduced bit for bit by hypothesis "splitk-no-sink"`,
	FP8Scale:       `reproduced bit for bit by hypothesis "fq8-scale-floor2"`,
	ScaleByte:      "scale byte reads",
	TopKOffByOne:   "not a boundary tie",
	StalePrefix:    "a stale page from that request",
	CompressorLate: "did not emit it at its emission step",
	WindowOrder:    "the V4.1 window layout",
	// Faults of the whole layer: the part the diagnosis names first.
	ExpertNibble:       "MoE experts: routed experts: ",
	ExpertScaleBlock:   "MoE experts: routed experts: ",
	ExpertNoClamp:      "MoE experts: routed experts: ",
	SharedGateUp:       "MoE experts: shared expert: ",
	RouterBias:         "MoE router: selection: ",
	RouterHashOff:      "MoE router: hash lookup: ",
	RouterUnnormalised: "MoE router: weights, selection correct: ",
	HCPostTransposed:   "hyper-connections: residual hc_post: ",
	HCSplitNoSigmoid:   "hyper-connections: split/Sinkhorn: ",
	HeadNoNorm:         "head: final norm: ",
}

// faultHyp is the hypothesis that must reproduce the faulty stage bit for
// bit (the faults of the whole layer: their decode variant).
var faultHyp = map[Kind]string{
	ExpertNibble:       "fp4-nibble-swap",
	ExpertScaleBlock:   "fp4-scale-per-128",
	ExpertNoClamp:      "no-swiglu-clamp",
	SharedGateUp:       "shared-gate-up-swapped",
	RouterBias:         "no-selection-bias",
	RouterHashOff:      "hash-row-next",
	RouterUnnormalised: "weights-unnormalised",
	HCPostTransposed:   "hc-post-comb-transposed",
	HCSplitNoSigmoid:   "post-no-sigmoid",
	HeadNoNorm:         "head-no-final-norm",
}

// checkWhy fails unless the divergence's text names the fault's part (its
// sentence says faultWhy) and, for a fault of the whole layer in a local
// replay (exact: the stage's inputs are the dumped ones), the hypothesis
// reproducing it bit for bit.
func checkWhy(t *testing.T, f Fault, text string, exact bool) {
	t.Helper()
	if !strings.Contains(text, faultWhy[f.Kind]) {
		t.Errorf("%s: diagnosis %q does not say %q", f, text, faultWhy[f.Kind])
	}
	if h, ok := faultHyp[f.Kind]; ok && exact {
		if want := fmt.Sprintf("reproduced bit for bit by hypothesis %q", h); !strings.Contains(text, want) {
			t.Errorf("%s: diagnosis %q does not say %s", f, text, want)
		}
	}
}

// TestSynthFaultsFound injects every fault kind at seeded random positions and
// checks that the local replay names exactly the injected step, layer and
// stage, with the fault's diagnosis kind.
func TestSynthFaultsFound(t *testing.T) {
	cfg, _ := engine.Preset("tiny")
	const prefill, steps = 6, 8
	first, last := int64(prefill), int64(prefill+steps-1)
	rng := rand.New(rand.NewPCG(2026, 11))
	perKind := 2
	if testing.Short() {
		perKind = 1
	}
	for _, kind := range Kinds() {
		if (Fault{Kind: kind}).NeedsBlock() {
			// Without Whole the synthetic model holds the attention path only
			// (TestSynthWholeFaultsFound injects these into the whole model).
			if _, err := Synthesize(SynthOptions{Prefill: prefill, Steps: steps, Fault: &Fault{Kind: kind, Step: first, Layer: 1}}); err == nil || !strings.Contains(err.Error(), "whole layer") {
				t.Errorf("%s: Synthesize accepted a fault of the whole layer: %v", kind, err)
			}
			continue
		}
		pos := faultPositions(cfg, kind, first, last)
		if len(pos) == 0 {
			t.Fatalf("%s: no valid position in steps %d..%d", kind, first, last)
		}
		found := 0
		for try := 0; try < 20 && found < perKind; try++ {
			f := pos[rng.IntN(len(pos))]
			seed := rng.Uint64()
			s, err := Synthesize(SynthOptions{Prefill: prefill, Steps: steps, Seed: seed, Fault: &f})
			if errors.Is(err, ErrInvisible) {
				continue
			}
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			found++
			rep := replaySynth(t, s)
			d := rep.First
			if d == nil {
				t.Fatalf("%s (seed %d): replay agrees, want a divergence", f, seed)
			}
			if d.Step != f.Step || d.Layer != f.Layer || d.Stage != f.Stage() || d.Kind != f.Diagnosis() {
				t.Fatalf("%s (seed %d): got step %d layer %d stage %s kind %q; want step %d layer %d stage %s kind %q\n%s",
					f, seed, d.Step, d.Layer, d.Stage, d.Kind, f.Step, f.Layer, f.Stage(), f.Diagnosis(), d.Text)
			}
			if !strings.HasPrefix(d.Text, "first divergence: decode step ") || !strings.Contains(d.Why, faultWhy[kind]) {
				t.Fatalf("%s: text %q, want it to say %q", f, d.Text, faultWhy[kind])
			}
			t.Logf("%s: %s", f, d.Text)
		}
		if found == 0 {
			t.Fatalf("%s: no visible injection in 20 tries", kind)
		}
	}
}

// TestReplaySplitKernel: when a dumped split-K partial itself differs (and o
// was merged from it), the diagnosis names the split, not the combine.
func TestReplaySplitKernel(t *testing.T) {
	s, err := Synthesize(SynthOptions{Prefill: 6, Steps: 3, Seed: 21})
	if err != nil {
		t.Fatal(err)
	}
	const p, l = 7, 1
	cfg := s.Cfg
	H, D := cfg.NHeads, cfg.HeadDim
	var parts []attention.Partial
	for i := 0; ; i++ {
		o, ok := s.Src.Values[replay.StageKey{Step: p, Layer: l, Stage: fmt.Sprintf("o_split/%d", i)}]
		if !ok {
			break
		}
		lse := s.Src.Values[replay.StageKey{Step: p, Layer: l, Stage: fmt.Sprintf("lse_split/%d", i)}]
		parts = append(parts, attention.Partial{O: append([]float32(nil), o.F...), LSE2: lse.F})
	}
	if len(parts) != 2 {
		t.Fatalf("%d partials dumped, want 2", len(parts))
	}
	for k := 0; k < D; k++ { // head 2 of split 1 reads wrong keys: its output flips sign
		parts[1].O[2*D+k] = -parts[1].O[2*D+k]
	}
	s.Src.Values[replay.StageKey{Step: p, Layer: l, Stage: "o_split/1"}] = engine.FromF(engine.KindF32, parts[1].O, H, D)
	o := make([]float32, H*D)
	attention.MergePartials(o, parts, s.Weights[l].AttnSink, D)
	s.Src.Values[replay.StageKey{Step: p, Layer: l, Stage: "o"}] = engine.FromF(engine.KindBF16, o, H, D)
	d := replaySynth(t, s).First
	if d == nil || d.Step != p || d.Layer != l || d.Stage != "o" || !strings.Contains(d.Why, "split 1") || !strings.Contains(d.Why, "the split kernel") {
		t.Fatalf("diagnosis %+v", d)
	}
}
