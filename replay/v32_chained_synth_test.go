package replay_test

import (
	"context"
	"strings"
	"testing"

	"sparsemla/fault"
	"sparsemla/replay"
)

// TestV32ChainedSynth: a whole synthetic V3.2 model (synth --whole: layer 0
// from the embedding of a seeded token stream) replays clean in chained
// mode, the embedding row of every step judged (x_in of layer 0) and every
// layer link; with a fault in layer 0's dense MLP the chained replay names
// it first (step, layer, stage, kind) and the divergence reaches layer 1 and
// the logits (growth up to the head).
func TestV32ChainedSynth(t *testing.T) {
	opt := fault.SynthOptions{Config: "v32-tiny", Prefill: 14, Steps: 4, Seed: 7, Whole: true}
	clean, err := fault.Synthesize(opt)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := replay.Run(context.Background(), clean.Model(), clean.Src, replay.Options{Mode: replay.Chained})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Diverged() {
		t.Fatalf("clean: %s", rep.First.Text)
	}
	embed, links := 0, 0
	for _, r := range rep.Results {
		if r.Stage == "x_in" && r.Layer == 0 && r.Status == replay.StatusPass {
			embed++
		}
		if (r.Stage == "x_in" || r.Stage == "res_in") && r.Layer == 1 && r.Status == replay.StatusPass {
			links++
		}
	}
	if embed != 4 || links != 8 {
		t.Fatalf("%d embedding rows judged (want 4), %d layer links (want 8)", embed, links)
	}
	f := fault.Fault{Kind: fault.DenseGateUp, Step: 15, Layer: 0}
	opt.Fault = &f
	bad, err := fault.Synthesize(opt)
	if err != nil {
		t.Fatal(err)
	}
	rep, err = replay.Run(context.Background(), bad.Model(), bad.Src, replay.Options{Mode: replay.Chained})
	if err != nil {
		t.Fatal(err)
	}
	d := rep.First
	if d == nil || d.Step != 15 || d.Layer != 0 || d.Stage != "ffn_out" || d.Kind != replay.KindDenseMLP || !strings.Contains(d.Text, "v32-dense-gate-up-swapped") {
		t.Fatalf("chained: %+v, want step 15 layer 0 ffn_out, dense MLP, the hypothesis named", d)
	}
	failed := map[string]bool{}
	for _, r := range rep.Results {
		if r.Step == 15 && r.Status == replay.StatusFail {
			failed[r.Stage] = true
		}
	}
	if !failed["logits"] {
		t.Fatalf("the fault did not reach the logits in the chain: failed %v", failed)
	}
	t.Log(d.Text)
}

// TestV32LocalLayer0HMid: a V3.2 layer has no hyper-connections (hc_mult
// 0), and on layer 0 h_mid reads x_in, not h_in: a divergence of h_mid
// there is diagnosed (the hc_post hypotheses do not apply) instead of
// ending the replay with an internal error.
func TestV32LocalLayer0HMid(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Config: "v32-tiny", Prefill: 14, Steps: 3, Seed: 7, Whole: true})
	if err != nil {
		t.Fatal(err)
	}
	key := replay.StageKey{Step: 15, Layer: 0, Stage: "x_in"}
	x := s.Src.Values[key].Clone()
	for i := range x.F {
		x.F[i] *= 1.5 // RMSNorm does not see it; the residual h_mid = y + x_in does
	}
	s.Src.Values[key] = x
	rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: replay.Local})
	if err != nil {
		t.Fatal(err)
	}
	if d := rep.First; d == nil || d.Step != 15 || d.Layer != 0 || d.Stage != "h_mid" {
		t.Fatalf("local: %+v, want step 15 layer 0 h_mid", d)
	}
	// named as the residual add, not as hyper-connections V3.2 does not have
	if d := rep.First; d.Kind != replay.KindResidual || strings.Contains(d.Text, "hc_post") || strings.Contains(d.Text, "hyper-connections") || strings.Contains(d.Hint, "hc_") {
		t.Fatalf("local: kind %q, text %q, hint %q: want the residual, no hyper-connections", d.Kind, d.Text, d.Hint)
	}
}
