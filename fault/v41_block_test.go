package fault

import (
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/replay"
)

// TestSynthV41BlockFaults: each V4 whole-step fault kind V4.1 has a part for,
// injected by synth into a whole v41-tiny run, is the first divergence of a
// local replay at its step, layer and stage, named exactly by its
// hypothesis; a propagated replay diverges too (not before the fault's
// layer); router-hash-off and
// misplaced kinds are refused in one line.
func TestSynthV41BlockFaults(t *testing.T) {
	cfg, err := engine.Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	write := func(f *Fault) (*replay.V41Dump, error) {
		s, err := SynthesizeV41(cfg, 8, 3, 5, f)
		if err != nil {
			return nil, err
		}
		dir := t.TempDir() + "/d"
		if err := s.Write(dir); err != nil {
			t.Fatal(err)
		}
		return replay.LoadV41Dir(dir)
	}
	for i, f := range []Fault{
		{Kind: ExpertNibble, Step: 9, Layer: 3},
		{Kind: ExpertScaleBlock, Step: 9, Layer: 1},
		{Kind: ExpertNoClamp, Step: 10, Layer: 4},
		{Kind: SharedGateUp, Step: 8, Layer: 0},
		{Kind: RouterBias, Step: 9, Layer: 6},
		{Kind: RouterUnnormalised, Step: 10, Layer: 2},
		{Kind: HCPostTransposed, Step: 9, Layer: 5},
		{Kind: HCSplitNoSigmoid, Step: 8, Layer: 7},
		{Kind: HeadNoNorm, Step: 10, Layer: 7},
	} {
		if !raceShortSample(i) {
			continue
		}
		d, err := write(&f)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		stage, _ := V41FaultStage(f)
		rep, err := replay.V41Run(d, replay.V41Options{Mode: replay.Local})
		if err != nil {
			t.Fatal(err)
		}
		fd := rep.First
		if fd == nil || fd.Step != f.Step || fd.Layer != f.Layer || fd.Stage != stage ||
			fd.Hypothesis == nil || fd.Hypothesis.Best == nil || fd.Hypothesis.Best.Name != V41BlockFaultHypothesis(f.Kind) {
			t.Errorf("%s: %s", f, v41Text(rep))
			continue
		}
		prop, err := replay.V41Run(d, replay.V41Options{Mode: replay.Propagated, Steps: []int64{f.Step}})
		if err != nil {
			t.Fatal(err)
		}
		// Propagated (cos_diff ≤ 5e-3 through the whole chain) diverges at
		// the fault or, when its first effect is within that drift bound,
		// at a later stage of the same step.
		if prop.First == nil || prop.First.Layer < f.Layer {
			t.Errorf("%s propagated: %s", f, v41Text(prop))
		}
	}
	for _, c := range []struct {
		f    Fault
		want string
	}{
		{Fault{Kind: RouterHashOff, Step: 9, Layer: 0}, "no hash-routed layers"},
		{Fault{Kind: HeadNoNorm, Step: 9, Layer: 3}, "the head follows the last layer"},
	} {
		if _, err := write(&c.f); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want %q", c.f, err, c.want)
		}
	}
}

// TestWriteFaultedV41WholeGolden: fault --in on the whole-step GPU golden
// testdata/v41-tiny-whole: each block kind (and topk-off-by-one, whose
// faulty list now reaches the later layers through the residual stream) is
// the first divergence of a local replay of the copy, named by its
// hypothesis; the steps after the fault are left out; a place where the
// kind changes nothing is refused.
func TestWriteFaultedV41WholeGolden(t *testing.T) {
	const in = "../testdata/v41-tiny-whole"
	d, err := replay.LoadV41Dir(in)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		f   Fault
		hyp string
	}{
		{Fault{Kind: ExpertNibble, Step: 13, Layer: 3}, "fp4-nibble-swap"},
		{Fault{Kind: SharedGateUp, Step: 14, Layer: 0}, "shared-gate-up-swapped"},
		{Fault{Kind: RouterBias, Step: 13, Layer: 0}, "no-selection-bias"},
		{Fault{Kind: HCPostTransposed, Step: 12, Layer: 2}, "hc-post-comb-transposed"},
		{Fault{Kind: HeadNoNorm, Step: 13, Layer: 7}, "head-no-final-norm"},
		{Fault{Kind: TopKOffByOne, Step: 14, Layer: 2}, "topk-off-by-one"},
	} {
		res, fd, rep := faultV41Copy(t, in, d, c.f)
		if last := fd.Steps[len(fd.Steps)-1]; last != c.f.Step {
			t.Errorf("%s: the copy holds steps %v, want up to the fault's step only", c.f, fd.Steps)
		}
		// The steps left out are said so.
		if c.f.Step < 14 && (len(res.NotRecomputed) != 1 || !strings.Contains(res.NotRecomputed[0], "left out of the copy")) {
			t.Errorf("%s: not recomputed %q", c.f, res.NotRecomputed)
		}
		if c.f.Step == 14 && len(res.NotRecomputed) != 0 {
			t.Errorf("%s: not recomputed %q", c.f, res.NotRecomputed)
		}
		stage, _ := V41FaultStage(c.f)
		first := rep.First
		if first == nil || first.Step != c.f.Step || first.Layer != c.f.Layer || first.Stage != stage ||
			first.Hypothesis == nil || first.Hypothesis.Best == nil || first.Hypothesis.Best.Name != c.hyp {
			t.Errorf("%s: %s", c.f, v41Text(rep))
		}
	}
	f := Fault{Kind: RouterBias, Step: 13, Layer: 6}
	if _, err := WriteFaultedV41(in, d, t.TempDir()+"/copy", f); err == nil || !strings.Contains(err.Error(), "same as the correct value") {
		t.Errorf("%s: err = %v, want a refusal (the bias does not change the choice there)", f, err)
	}
}

// TestWriteFaultedV41NativeBlockRefused: a block fault kind into a native
// whole V4.1 dump is refused in one line (its KV pages and stages of no
// layer would stay as dumped), while an attention kind is still written.
func TestWriteFaultedV41NativeBlockRefused(t *testing.T) {
	cfg, err := engine.Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	s, err := SynthesizeV41(cfg, 8, 2, 5, nil)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir() + "/n"
	if err := s.WriteNative(dir, true); err != nil {
		t.Fatal(err)
	}
	d, err := replay.OpenV41(dir, replay.V41OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !d.Model.Whole() {
		t.Fatal("the native synthetic dump did not load as a whole model")
	}
	_, err = WriteFaultedV41(dir, d, t.TempDir()+"/f", Fault{Kind: ExpertNibble, Step: 9, Layer: 3})
	if err == nil || !strings.Contains(err.Error(), "official layout only") || strings.Contains(err.Error(), "\n") {
		t.Errorf("expert-nibble into a native whole dump: err = %v, want the one-line refusal", err)
	}
	if _, err := WriteFaultedV41(dir, d, t.TempDir()+"/g", Fault{Kind: WindowOrder, Step: 8, Layer: 3}); err != nil {
		t.Errorf("window-order into a native whole dump: %v", err)
	}
}
