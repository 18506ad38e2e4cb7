package fault

import (
	"context"
	"testing"

	"sparsemla/replay"
)

func TestSynthWholeProbe(t *testing.T) {
	s, err := Synthesize(SynthOptions{Prefill: 6, Steps: 3, Seed: 1, Whole: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated, replay.Chained} {
		rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: %s", mode, rep.First.Text)
		}
		t.Logf("%s: %+v notmodelled %v", mode, rep.Summary, rep.Coverage.NotModelled)
	}
}
