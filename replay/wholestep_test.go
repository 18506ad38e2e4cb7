package replay

import (
	"context"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/head"
)

// TestReplayWholeStepEveryStage: on the official-v4-tiny golden (every stage
// of the whole decode step dumped) a local and a chained replay compare every
// stage tensor the dump holds — block, attention, MoE, head — and each passes;
// only pos and tok (inputs) are not compared. This is the "no unchecked stage"
// promise for the official layout.
func TestReplayWholeStepEveryStage(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	for _, mode := range []Mode{Local, Chained} {
		rep, err := Run(context.Background(), m, src, Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Diverged() {
			t.Fatalf("%s: %s", mode, rep.First.Text)
		}
		seen := map[StageKey]string{}
		for _, r := range rep.Results {
			k := StageKey{Step: r.Step, Layer: r.Layer, Stage: r.Stage}
			if r.Stage == "logits" {
				k.Layer = dump.Global
			}
			seen[k] = r.Status
		}
		n := 0
		for _, e := range src.D.Entries {
			if e.Kind != dump.KindStage || e.Stage == "pos" || e.Stage == "tok" {
				continue
			}
			n++
			k := StageKey{Step: int64(e.Step), Layer: e.Layer, Stage: e.Stage}
			if st := seen[k]; st != StatusPass {
				t.Errorf("%s: %s is dumped but its status is %q", mode, k, st)
			}
		}
		t.Logf("%s: %d dumped stage tensors, all compared and passing (%+v)", mode, n, rep.Summary)
		if n < 1000 {
			t.Errorf("%s: only %d stage tensors in the dump", mode, n)
		}
	}
}

// TestReplayChainedNeedsWholeModel: a chained replay of a dump whose weights
// hold the attention path only is refused with a reason.
func TestReplayChainedNeedsWholeModel(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	attnOnly := *m
	attnOnly.Weights = map[int]*engine.LayerWeights{}
	for l, w := range m.Weights {
		c := *w
		c.Block = nil
		attnOnly.Weights[l] = &c
	}
	_, err := Run(context.Background(), &attnOnly, src, Options{Mode: Chained})
	if err == nil || !strings.Contains(err.Error(), "whole layer's weights") {
		t.Errorf("chained replay without block weights: %v", err)
	}
	noHead := *m
	noHead.Head = nil
	if _, err := Run(context.Background(), &noHead, src, Options{Mode: Chained}); err == nil || !strings.Contains(err.Error(), "embedding and head") {
		t.Errorf("chained replay without the head: %v", err)
	}
	// A local replay of the attention-only model compares the attention
	// stages only, as before; the block stages the dump holds are not
	// compared (skipped, with the reason: the verdict is incomplete).
	rep, err := Run(context.Background(), &attnOnly, src, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Results {
		if (strings.HasPrefix(r.Stage, "hc_") || strings.HasPrefix(r.Stage, "moe_") || r.Stage == "h_mid") && r.Status != StatusSkipped {
			t.Fatalf("attention-only model compared %s", r.Stage)
		}
	}
	if rep.Verdict != VerdictIncomplete {
		t.Errorf("attention-only model: verdict %s", rep.Verdict)
	}
}

// TestWholeModelGreedyToken: the reference run as the whole model (layer 0
// from the embedding of the dumped token, every layer on the layer below's
// own h_out, each carrying its own state from the prefill) picks the GPU's
// greedy token at every decode step of the official golden.
func TestWholeModelGreedyToken(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	st := map[int]*engine.LayerState{}
	for _, l := range src.Layers() {
		s, _, _, err := src.State(l)
		if err != nil {
			t.Fatal(err)
		}
		if st[l], err = engine.LoadState(m.Cfg, l, s); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range src.Steps() {
		tok, _, _ := src.Stage(p, dump.Global, "tok")
		var out map[string]engine.Tensor
		for _, l := range src.Layers() {
			seeds := map[string]engine.Tensor{engine.GlobalPrefix + "tok": tok}
			if l > 0 {
				seeds["h_in"] = out["h_out"]
			}
			ctx := &engine.StepContext{Cfg: m.Cfg, Layer: l, Pos: p, W: m.Weights[l], Rope: m.Rope[l], Head: m.Head}
			var err error
			if out, st[l], err = engine.RunLayer(ctx, seeds, st[l]); err != nil {
				t.Fatal(err)
			}
		}
		gpu, _, _ := src.Stage(p, dump.Global, "logits")
		if got, want := head.Greedy(out["logits"].F), head.Greedy(gpu.F); got != want {
			t.Errorf("step %d: greedy token %d, the GPU's %d", p, got, want)
		}
	}
}
