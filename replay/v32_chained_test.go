package replay

import (
	"context"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/moe"
)

// TestReplayV32ChainedGPUDump: the chained replay of the official
// model.py's GPU dump (testdata/v32-tiny) over the steps that dump the
// whole layer (10 … 13) agrees: layer 0 from the dumped x_in (the weights
// hold no embedding), layer 1 from layer 0's own ffn_out / h_mid (judged
// against the dumped x_in / res_in), the logits from the chain, with the
// GPU's greedy token at every step. Over all steps it is refused: steps
// 14 … 21 hold no x_in to start layer 0 from.
func TestReplayV32ChainedGPUDump(t *testing.T) {
	m, src := openReplayGolden(t, "v32-tiny")
	rep, err := Run(context.Background(), m, src, Options{Mode: Chained, Steps: []int64{10, 11, 12, 13}})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Diverged() {
		t.Fatalf("chained: %s", rep.First.Text)
	}
	links, greedy := 0, 0
	for _, r := range rep.Results {
		if r.Status == StatusFail {
			t.Fatalf("step %d layer %d %s failed: %s", r.Step, r.Layer, r.Stage, r.Reason)
		}
		if r.Layer == 1 && (r.Stage == "x_in" || r.Stage == "res_in") && r.Status == StatusPass {
			links++
		}
		if r.Stage == "logits" && strings.Contains(r.Reason, "the GPU's") && !strings.Contains(r.Reason, "the GPU's is") {
			greedy++
		}
	}
	if links != 8 || greedy != 4 {
		t.Fatalf("%d layer links passed (want 8), %d steps with the GPU's greedy token (want 4)", links, greedy)
	}
	t.Logf("chained: %+v", rep.Summary)
	if _, err := Run(context.Background(), m, src, Options{Mode: Chained}); err == nil || !strings.Contains(err.Error(), "14..21") || !strings.Contains(err.Error(), "10..13") {
		t.Fatalf("chained over every step: %v, want a refusal naming the steps without x_in (14..21) and with it (10..13)", err)
	}
}

// TestReplayV32ChainedNeedsWholeModel: a chained V3.2 replay without the
// FFN weights, or without the head, is refused with a reason.
func TestReplayV32ChainedNeedsWholeModel(t *testing.T) {
	m, src := openReplayGolden(t, "v32-tiny")
	attnOnly, noHead := *m, *m
	attnOnly.Weights, noHead.Weights = map[int]*engine.LayerWeights{}, map[int]*engine.LayerWeights{}
	for l, w := range m.Weights {
		a, h := *w, *w
		va, vh := *w.V32, *w.V32
		va.FFN = nil
		f := *w.V32.FFN
		f.Head = nil
		vh.FFN = &f
		a.V32, h.V32 = &va, &vh
		attnOnly.Weights[l], noHead.Weights[l] = &a, &h
	}
	opt := Options{Mode: Chained, Steps: []int64{10, 11}}
	if _, err := Run(context.Background(), &attnOnly, src, opt); err == nil || !strings.Contains(err.Error(), "whole layer's weights") {
		t.Errorf("chained without FFN weights: %v", err)
	}
	if _, err := Run(context.Background(), &noHead, src, opt); err == nil || !strings.Contains(err.Error(), "final norm and head") {
		t.Errorf("chained without the head: %v", err)
	}
}

// TestReplayV32PreparedSameReport: the V3.2 GPU dump replayed on the
// prepared FP8 linears (the default) and on the reference loops
// (--reference: LoadOptions.Prepared false) gives the same report in every
// mode, value for value, except the kernels it names; the prepared weights
// are compact (the packed FP8 linears without their fp32 copy).
func TestReplayV32PreparedSameReport(t *testing.T) {
	d, err := dump.Open(filepath.Join("..", "testdata", "v32-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	src, err := NewDumpSource(d, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		mode  Mode
		steps []int64
	}{{Local, nil}, {Propagated, nil}, {Chained, []int64{10, 11, 12, 13}}} {
		var reps [2]*Report
		for i, prepared := range []bool{true, false} {
			m, err := LoadModelWith(d, src, LoadOptions{Prepared: prepared})
			if err != nil {
				t.Fatal(err)
			}
			if want := map[bool]string{true: engine.KernelsPrepared, false: engine.KernelsReference}[prepared]; m.Kernels() != want {
				t.Fatalf("prepared %v: kernels %q, want %q", prepared, m.Kernels(), want)
			}
			// the prepared weights are compact: the packed FP8 linears keep
			// no fp32 copy (wkv_b, read dequantised, does)
			v := m.Weights[1].V32
			if compact := v.WqA.W == nil && v.FFN.Shared.W1.W == nil && v.WkvB.W != nil; compact != prepared {
				t.Fatalf("prepared %v: compact FP8 weights %v", prepared, compact)
			}
			if reps[i], err = Run(context.Background(), m, src, Options{Mode: c.mode, Steps: c.steps}); err != nil {
				t.Fatal(err)
			}
		}
		a, b := reps[0].Results, reps[1].Results
		if len(a) != len(b) || reps[0].Diverged() || reps[1].Diverged() {
			t.Fatalf("%s: %d vs %d results, diverged %v / %v", c.mode, len(a), len(b), reps[0].Diverged(), reps[1].Diverged())
		}
		for i := range a {
			if !reflect.DeepEqual(a[i], b[i]) {
				t.Fatalf("%s: result %d differs: prepared %+v, reference %+v", c.mode, i, a[i], b[i])
			}
		}
	}
}

// TestV32RouterNearTie: with the grouped router (8 experts in 4 groups, 2
// kept, top-3, a bias), a GPU choosing an expert whose score + bias is
// within routerTieRel of the reference's k-th, from a group whose score
// nearly ties the last kept one, is a tie; a far expert or the same set in
// another order stays a divergence.
func TestV32RouterNearTie(t *testing.T) {
	base, _ := engine.Preset("v32-tiny")
	cfg := *base
	cfg.NRoutedExperts, cfg.NExpertGroups, cfg.NLimitedGroups, cfg.NActivatedExperts = 8, 4, 2, 3
	dim := cfg.Dim
	W := make([]float32, 8*dim)
	logit := []float32{3, 2.875, 1, -5, 1, -5, -5, -5}
	for e, l := range logit {
		W[e*dim] = l
	}
	W[4*dim+1] = 1 // expert 4: logit 1 + 2^-16
	g := &moe.Gate{Experts: 8, TopK: 3, Dim: dim, Func: moe.Sigmoid, RouteScale: 2.5, Weight: W, Bias: make([]float32, 8)}
	m := &engine.Model{Cfg: &cfg, Weights: map[int]*engine.LayerWeights{1: {Layer: 1, V32: &engine.V32Weights{FFN: &engine.V32FFNWeights{Gate: g}}}}}
	x := make([]float32, dim)
	x[0], x[1] = 1, 1.0/65536
	in := map[string]engine.Tensor{"ffn_in": engine.FromF(engine.KindBF16, x, dim)}
	s := make([]float32, 8)
	g.Scores(s, x)
	r, err := g.GroupedRoute(s, 4, 2)
	if err != nil {
		t.Fatal(err)
	}
	ids := func(v ...int64) engine.Tensor { return engine.FromI(engine.KindI64, v, len(v)) }
	ref := ids(int64(r.Indices[0]), int64(r.Indices[1]), int64(r.Indices[2]))
	if !reflect.DeepEqual(ref.I, []int64{0, 1, 4}) {
		t.Fatalf("reference route %v, want [0 1 4]", ref.I)
	}
	for _, c := range []struct {
		gpu  []int64
		want string
	}{{[]int64{0, 1, 2}, StatusTie}, {[]int64{0, 1, 3}, StatusFail}, {[]int64{1, 0, 4}, StatusFail}, {[]int64{0, 1, 6}, StatusFail}} {
		sr := StageResult{Stage: "moe_indices", Status: StatusFail}
		routerNearTie(&sr, m, 1, in, ref, ids(c.gpu...))
		if sr.Status != c.want {
			t.Errorf("GPU %v: %s (%s), want %s", c.gpu, sr.Status, sr.Reason, c.want)
		}
	}
}
