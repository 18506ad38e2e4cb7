package replay_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/fault"
	"sparsemla/replay"
)

// synthWhole is `sparsemla synth --whole [--fault KIND@P,L]` with the
// command's defaults (prefill 6, steps 6..13, seed 1), in memory.
func synthWhole(t *testing.T, f *fault.Fault) *fault.Synth {
	t.Helper()
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 8, Seed: 1, Whole: true, Fault: f})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func runMode(t *testing.T, m *engine.Model, src replay.Source, mode replay.Mode, tol *replay.Tolerance) *replay.Report {
	t.Helper()
	rep, err := replay.Run(context.Background(), m, src, replay.Options{Mode: mode, Tol: tol})
	if err != nil {
		t.Fatalf("%s: %v", mode, err)
	}
	return rep
}

func resultOf(rep *replay.Report, step int64, layer int, stage string) *replay.StageResult {
	for i := range rep.Results {
		r := &rep.Results[i]
		if r.Step == step && r.Layer == layer && r.Stage == stage {
			return r
		}
	}
	return nil
}

// TestChainedBlamesTheStageThatMadeIt: the routed experts skip the
// swiglu_limit clamp at step 9, layer 1. ffn_out's chained cos_diff there
// (3.7e-3) is inside the chained tolerance (1e-2); the chain first leaves
// it at step 9, layer 3, iw_raw, whose chain input x was only within that
// tolerance. The chained replay names step 9, layer 1, ffn_out — as the
// local and propagated replays do — found by the teacher-forced check of
// the steps and layers up to iw_raw, and says so; it never says that
// iw_raw itself differs. The clean model still agrees in chained mode.
func TestChainedBlamesTheStageThatMadeIt(t *testing.T) {
	s := synthWhole(t, &fault.Fault{Kind: fault.ExpertNoClamp, Step: 9, Layer: 1})
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated, replay.Chained} {
		rep := runMode(t, s.Model(), s.Src, mode, nil)
		d := rep.First
		if d == nil || d.Step != 9 || d.Layer != 1 || d.Stage != "ffn_out" || d.Kind != replay.KindExperts || d.Mode != string(mode) {
			t.Fatalf("%s: first divergence %+v, want step 9, layer 1, ffn_out (MoE experts)", mode, d)
		}
		if !strings.Contains(d.Text, `"no-swiglu-clamp"`) || strings.Contains(d.Text, "iw_raw itself differs") {
			t.Fatalf("%s: %s", mode, d.Text)
		}
		if r := resultOf(rep, 9, 1, "ffn_out"); r == nil || r.Status != replay.StatusFail {
			t.Fatalf("%s: the result of step 9 layer 1 ffn_out is %+v, want failed", mode, r)
		}
		if mode != replay.Chained {
			continue
		}
		for _, want := range []string{
			"chained: the reference's own chain stays within the chained tolerance here (cos_diff 0.00374)",
			"first leaves it at decode step 9, layer 3, stage iw_raw (cos_diff 0.0119 > 0.01)",
			"the local check of every step and layer up to there finds this stage the first out of tolerance",
		} {
			if !strings.Contains(d.Text, want) {
				t.Errorf("chained: %q lacks %q", d.Text, want)
			}
		}
		if r := resultOf(rep, 9, 3, "iw_raw"); r == nil || r.Status != replay.StatusFail {
			t.Errorf("chained: step 9 layer 3 iw_raw %+v: the chain's own results (the growth) must stay as judged", r)
		}
		if d.Inputs[0].From != replay.FromDump {
			t.Errorf("chained: inputs %+v, want the teacher-forced check's (from the dump)", d.Inputs)
		}
	}
	clean := synthWhole(t, nil)
	if rep := runMode(t, clean.Model(), clean.Src, replay.Chained, nil); rep.Verdict != replay.VerdictAgree {
		t.Fatalf("clean whole model, chained: %s", rep.VerdictLine())
	}
}

// TestPropagatedSameUnitLocalStage: hc_post with comb transposed at step
// 11, layer 3 moves h_mid's propagated cos_diff to 5.7e-5, inside the
// propagated tolerance (1e-4); the chain first leaves it at ffn_out of the
// same step and layer. The teacher-forced check names h_mid.
func TestPropagatedSameUnitLocalStage(t *testing.T) {
	s := synthWhole(t, &fault.Fault{Kind: fault.HCPostTransposed, Step: 11, Layer: 3})
	rep := runMode(t, s.Model(), s.Src, replay.Propagated, nil)
	d := rep.First
	if d == nil || d.Step != 11 || d.Layer != 3 || d.Stage != "h_mid" || d.Kind != replay.KindHyperConn ||
		!strings.Contains(d.Text, "first leaves it at stage ffn_out of this step and layer") || !strings.Contains(d.Text, `"hc-post-comb-transposed"`) {
		t.Fatalf("propagated: %+v, want step 11, layer 3, h_mid found teacher-forced", d)
	}
}

// TestChainedDriftNamesNoCulprit: on the clean official GPU dump the
// chain's ffn_out of layer 3 drifts to cos_diff 4e-4 (FP8/FP4 activation
// quantisation from layer to layer); with ffn_out judged by cos_diff 1e-4
// the chain leaves its tolerance there, while teacher-forced no stage is
// out of tolerance. The divergence is drift, no stage is blamed.
func TestChainedDriftNamesNoCulprit(t *testing.T) {
	d, err := dump.Open(filepath.Join("..", "testdata", "official-v4-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		t.Fatal(err)
	}
	m, err := replay.LoadModel(d, src, "")
	if err != nil {
		t.Fatal(err)
	}
	if rep := runMode(t, m, src, replay.Chained, nil); rep.Verdict != replay.VerdictAgree {
		t.Fatalf("chained, default tolerance: %s", rep.VerdictLine())
	}
	tol := replay.ChainedTolerance()
	tol.Set("ffn_out", replay.StageTol{Mode: replay.TolClose, Abs: 1e30, Cos: 1e-4})
	rep := runMode(t, m, src, replay.Chained, tol)
	f := rep.First
	if f == nil || f.Kind != replay.KindDrift || f.Step != 2 || f.Layer != 3 || f.Stage != "ffn_out" || !rep.Diverged() {
		t.Fatalf("chained, ffn_out at cos_diff 1e-4: %+v, want drift at step 2 layer 3 ffn_out", f)
	}
	for _, want := range []string{"finds no stage out of tolerance", "not shown to be an error of ffn_out", "ffn_in: cos_diff"} {
		if !strings.Contains(f.Text, want) {
			t.Errorf("%q lacks %q", f.Text, want)
		}
	}
	if strings.Contains(f.Text, "itself differs") || f.Hypothesis != nil {
		t.Errorf("drift blames a stage: %s", f.Text)
	}
}

// TestChainedV32LayerLink: a V3.2 chain's layer links are judged by the
// chain only (a local replay reads x_in, it does not compare it with the
// layer below). A dumped x_in of layer 1 that is not layer 0's dumped
// ffn_out, and a dumped x_in of layer 0 that is not the embedding row of
// the dumped token, are confirmed from the dump's own values: the chained
// replay keeps naming the link.
func TestChainedV32LayerLink(t *testing.T) {
	for _, c := range []struct {
		layer int
		kind  string
	}{{1, replay.KindLayerLink}, {0, replay.KindEmbedding}} {
		s, err := fault.Synthesize(fault.SynthOptions{Config: "v32-tiny", Prefill: 14, Steps: 3, Seed: 7, Whole: true})
		if err != nil {
			t.Fatal(err)
		}
		key := replay.StageKey{Step: 15, Layer: c.layer, Stage: "x_in"}
		x := s.Src.Values[key].Clone()
		for i := range x.F {
			x.F[i] *= 1.5
		}
		s.Src.Values[key] = x
		rep := runMode(t, s.Model(), s.Src, replay.Chained, nil)
		d := rep.First
		if d == nil || d.Step != 15 || d.Layer != c.layer || d.Stage != "x_in" || d.Kind != c.kind {
			t.Fatalf("x_in of layer %d scaled: %+v, want step 15, layer %d, x_in (%s)", c.layer, d, c.layer, c.kind)
		}
	}
}

// TestV41PropagatedBlamesTheStageThatMadeIt: on a whole V4.1 dump the
// propagated replay runs the model from the token through every layer.
// hc_post with comb transposed at step 14, layer 1 moves h_mid's
// propagated cos_diff to 3.5e-5, inside the tolerance; the chain first
// leaves it at layer 5's index_sel. The teacher-forced check names h_mid
// of layer 1, as the local replay does.
func TestV41PropagatedBlamesTheStageThatMadeIt(t *testing.T) {
	in := filepath.Join("..", "testdata", "v41-tiny-whole")
	d, err := replay.LoadV41Dir(in)
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "f")
	if _, err := fault.WriteFaultedV41(in, d, out, fault.Fault{Kind: fault.HCPostTransposed, Step: 14, Layer: 1}); err != nil {
		t.Fatal(err)
	}
	fd, err := replay.LoadV41Dir(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
		rep, err := replay.V41Run(fd, replay.V41Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		f := rep.First
		if f == nil || f.Step != 14 || f.Layer != 1 || f.Stage != "h_mid" || f.Mode != string(mode) {
			t.Fatalf("%s: %+v, want step 14, layer 1, h_mid", mode, f)
		}
		if mode == replay.Propagated && !strings.Contains(f.Text, "first leaves it at decode step 14, layer 5, stage index_sel") {
			t.Errorf("propagated: %s", f.Text)
		}
	}
}

// TestChainAgreeCheckedLocally: a fault whose error never grows past the
// chained tolerance (hc_post with comb transposed at step 10, layer 2 of
// the whole synthetic model; the chain stays within cos_diff 1e-2 at every
// stage) gave chained mode an "agree" that local mode contradicts. A chain
// that agrees is checked teacher-forced too, and the local divergence is
// the replay's, in both chain modes; a clean dump still agrees.
func TestChainAgreeCheckedLocally(t *testing.T) {
	s := synthWhole(t, &fault.Fault{Kind: fault.HCPostTransposed, Step: 10, Layer: 2})
	local := runMode(t, s.Model(), s.Src, replay.Local, nil)
	if local.First == nil {
		t.Fatalf("local: %s, want a divergence", local.VerdictLine())
	}
	for _, mode := range []replay.Mode{replay.Propagated, replay.Chained} {
		rep := runMode(t, s.Model(), s.Src, mode, nil)
		d := rep.First
		if d == nil || d.Step != local.First.Step || d.Layer != local.First.Layer || d.Stage != local.First.Stage || d.Mode != string(mode) || !rep.Diverged() {
			t.Fatalf("%s: %s (first %+v), want local's step %d, layer %d, %s", mode, rep.VerdictLine(), d, local.First.Step, local.First.Layer, local.First.Stage)
		}
		if r := resultOf(rep, d.Step, d.Layer, d.Stage); r == nil || r.Status != replay.StatusFail {
			t.Fatalf("%s: the result of the divergence's stage is %+v, want failed", mode, r)
		}
		if mode == replay.Chained && !strings.Contains(d.Text, "stays within the chained tolerance at every stage it compares") {
			t.Errorf("chained: %q does not say the chain stayed within its tolerance", d.Text)
		}
	}
	clean := synthWhole(t, nil)
	for _, mode := range []replay.Mode{replay.Propagated, replay.Chained} {
		if rep := runMode(t, clean.Model(), clean.Src, mode, nil); rep.Verdict != replay.VerdictAgree {
			t.Fatalf("clean whole model, %s: %s", mode, rep.VerdictLine())
		}
	}
}

// TestPropagatedLaterLocalFailureIsNotFirst: layer 0's kv_cache of step 12
// replaced by its kv_cache of step 11 (so step 11 holds none). The chain's
// own cache differs from it at step 12 (the dumped rows lack the row step 12
// wrote); teacher-forced, kv_cache cannot be compared (no dumped cache
// before it), and o, computed from that dumped cache, is out of tolerance
// further on. The first divergence is the first failing stage of the
// report, kv_cache, neither backed by the local check nor shown to be drift
// (kind unconfirmed), and its diagnosis names o; it had been o, after a
// failed kv_cache (found by FuzzReplay).
func TestPropagatedLaterLocalFailureIsNotFirst(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 11, Steps: 2, Seed: 5})
	if err != nil {
		t.Fatal(err)
	}
	prev, at := replay.StageKey{Step: 11, Layer: 0, Stage: "kv_cache"}, replay.StageKey{Step: 12, Layer: 0, Stage: "kv_cache"}
	if _, ok := s.Src.Values[prev]; !ok {
		t.Fatalf("the synthetic dump holds no %v", prev)
	}
	s.Src.Values[at] = s.Src.Values[prev]
	delete(s.Src.Values, prev)
	if d := runMode(t, s.Model(), s.Src, replay.Local, nil).First; d == nil || d.Step != 12 || d.Layer != 0 || d.Stage != "o" {
		t.Fatalf("local: %+v, want step 12, layer 0, o", d)
	}
	rep := runMode(t, s.Model(), s.Src, replay.Propagated, nil)
	d := rep.First
	if d == nil || d.Step != 12 || d.Layer != 0 || d.Stage != "kv_cache" || d.Kind != replay.KindUnconfirmed {
		t.Fatalf("propagated: %+v, want step 12, layer 0, kv_cache (unconfirmed: the local check could not compare it)", d)
	}
	if strings.Contains(d.Hint, "drifted") {
		t.Errorf("hint %q: nothing shows drift", d.Hint)
	}
	for _, want := range []string{"this stage itself could not be compared", "further on in this step and layer, teacher-forced from the dump's inputs, stage o is out of the local tolerance"} {
		if !strings.Contains(d.Text, want) {
			t.Errorf("%q lacks %q", d.Text, want)
		}
	}
	for _, r := range rep.Results {
		if r.Status == replay.StatusFail {
			if r.Step != d.Step || r.Layer != d.Layer || r.Stage != d.Stage {
				t.Errorf("the first failing stage is step %d layer %d %s, the first divergence %s", r.Step, r.Layer, r.Stage, d.Stage)
			}
			break
		}
	}
}
