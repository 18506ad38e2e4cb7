package fault

import (
	"strings"
	"testing"

	"sparsemla/replay"
)

// faultV41Copy writes the V4.1 dump in (loaded as d) with f injected into a
// temporary copy, loads the copy and replays it locally.
func faultV41Copy(t *testing.T, in string, d *replay.V41Dump, f Fault) (*V41FaultResult, *replay.V41Dump, *replay.Report) {
	t.Helper()
	out := t.TempDir() + "/copy"
	res, err := WriteFaultedV41(in, d, out, f)
	if err != nil {
		t.Fatalf("%s: %v", f, err)
	}
	fd, err := replay.LoadV41Dir(out)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := replay.V41Run(fd, replay.V41Options{Mode: replay.Local})
	if err != nil {
		t.Fatal(err)
	}
	return res, fd, rep
}

// TestWriteFaultedV41Golden: each applicable fault injected into the V4.1
// GPU golden is named exactly by a local replay of the copy (step, layer,
// stage, the hypothesis reproducing it) with no other stage failing, the
// clean golden still agrees, and inapplicable faults are refused.
func TestWriteFaultedV41Golden(t *testing.T) {
	const in = "../testdata/v41-tiny"
	d, err := replay.LoadV41Dir(in)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		f   Fault
		hyp string
	}{
		{Fault{Kind: WindowOrder, Step: 13, Layer: 4}, "v4-window-order"},
		{Fault{Kind: WindowOrder, Step: 15, Layer: 0}, "v4-window-order"},
		{Fault{Kind: TopKOffByOne, Step: 14, Layer: 2}, "topk-off-by-one"},
		{Fault{Kind: TopKOffByOne, Step: 12, Layer: 7}, "topk-off-by-one"},
	} {
		res, _, rep := faultV41Copy(t, in, d, c.f)
		stage, _ := V41FaultStage(c.f)
		if len(res.Changed) == 0 || res.Changed[0] != (replay.StageKey{Step: c.f.Step, Layer: c.f.Layer, Stage: stage}) {
			t.Errorf("%s: changed %v", c.f, res.Changed)
		}
		// The later layers' inputs x (the residual stream, not in an
		// attention-only dump) are not recomputed, and the copy says so
		// (nothing is above the last layer, 7).
		if want := c.f.Layer < 7; (len(res.NotRecomputed) == 1 && strings.Contains(res.NotRecomputed[0], "the inputs x of the layers above keep their dumped values")) != want || len(res.NotRecomputed) > 1 {
			t.Errorf("%s: not recomputed %q", c.f, res.NotRecomputed)
		}
		f := rep.First
		if f == nil || f.Step != c.f.Step || f.Layer != c.f.Layer || f.Stage != stage || rep.Summary.Fail != 1 ||
			f.Hypothesis == nil || f.Hypothesis.Best == nil || !f.Hypothesis.Best.Exact || f.Hypothesis.Best.Name != c.hyp {
			t.Errorf("%s: %d failing; %s", c.f, rep.Summary.Fail, v41Text(rep))
		}
	}
	rep, err := replay.V41Run(d, replay.V41Options{Mode: replay.Local})
	if err != nil || rep.Verdict != replay.VerdictAgree {
		t.Errorf("the golden itself: %v %s", err, rep.Verdict)
	}
	for _, c := range []struct {
		f    Fault
		want string
	}{
		{Fault{Kind: WrongLSE, Step: 13, Layer: 2}, "not implemented for DeepSeek-V4.1"},
		{Fault{Kind: SplitKMerge, Step: 13, Layer: 2}, "not implemented for DeepSeek-V4.1"},
		{Fault{Kind: WindowOrder, Step: 16, Layer: 1}, "outside the dumped steps"},
		{Fault{Kind: TopKOffByOne, Step: 13, Layer: 3}, "runs no indexer"},
	} {
		if _, err := WriteFaultedV41(in, d, t.TempDir()+"/x", c.f); err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: err = %v, want one line with %q", c.f, err, c.want)
		}
	}
}
