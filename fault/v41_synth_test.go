package fault

import (
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/replay"
)

// TestSynthV41Faults: a clean v41-tiny dump replays clean in both modes;
// each V4.1 fault kind is the first divergence, at its step, layer and
// stage, named by its hypothesis; kinds and places that do not apply are
// refused.
func TestSynthV41Faults(t *testing.T) {
	cfg, err := engine.Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	write := func(f *Fault) *replay.V41Dump {
		s, err := SynthesizeV41(cfg, 8, 4, 5, f)
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir() + "/d"
		if err := s.Write(dir); err != nil {
			t.Fatal(err)
		}
		d, err := replay.LoadV41Dir(dir)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	clean := write(nil)
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
		rep, err := replay.V41Run(clean, replay.V41Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Verdict != replay.VerdictAgree || rep.Summary.Missing != 0 || len(rep.Coverage.NotModelled) != 0 {
			t.Errorf("clean %s: %s", mode, v41Text(rep))
		}
	}
	for _, c := range []struct {
		f   Fault
		hyp string
	}{
		{Fault{Kind: WindowOrder, Step: 9, Layer: 0}, "v4-window-order"},
		{Fault{Kind: WindowOrder, Step: 10, Layer: 4}, "v4-window-order"},
		{Fault{Kind: TopKOffByOne, Step: 10, Layer: 5}, "topk-off-by-one"},
		{Fault{Kind: TopKOffByOne, Step: 11, Layer: 2}, "topk-off-by-one"},
		{Fault{Kind: TopKOffByOne, Step: 9, Layer: 7}, "topk-off-by-one"},
	} {
		rep, err := replay.V41Run(write(&c.f), replay.V41Options{Mode: replay.Local})
		if err != nil {
			t.Fatal(err)
		}
		stage, _ := V41FaultStage(c.f)
		fd := rep.First
		if fd == nil || fd.Step != c.f.Step || fd.Layer != c.f.Layer || fd.Stage != stage ||
			fd.Hypothesis == nil || fd.Hypothesis.Best == nil || !fd.Hypothesis.Best.Exact || fd.Hypothesis.Best.Name != c.hyp {
			t.Errorf("%s: %s", c.f, v41Text(rep))
		}
	}
	for _, c := range []struct {
		f    Fault
		want string
	}{
		{Fault{Kind: WrongLSE, Step: 9, Layer: 1}, "not implemented for DeepSeek-V4.1"},
		{Fault{Kind: WindowOrder, Step: 20, Layer: 1}, "outside the dumped steps"},
		{Fault{Kind: TopKOffByOne, Step: 9, Layer: 3}, "runs no indexer"},
		{Fault{Kind: TopKOffByOne, Step: 8, Layer: 2}, "every row is selected"},
	} {
		if _, err := SynthesizeV41(cfg, 8, 4, 5, &c.f); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want %q", c.f, err, c.want)
		}
	}
}

func v41Text(r *replay.Report) string {
	var b strings.Builder
	r.WriteText(&b)
	return b.String()
}
