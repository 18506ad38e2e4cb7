package replay

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/quant"
)

// memCopy copies every stage record and start state of src into a
// MemSource (the tensors of no layer too: tok, pos, logits).
func memCopy(t *testing.T, src *DumpSource) *MemSource {
	t.Helper()
	mem := NewMemSource(src.Name() + " (copy)")
	for _, e := range src.D.Entries {
		if e.Kind != dump.KindStage || e.Request != src.Request {
			continue
		}
		v, ok, err := src.Stage(int64(e.Step), e.Layer, e.Stage)
		if err != nil || !ok {
			t.Fatalf("%v: %v %v", e.Key, ok, err)
		}
		mem.Put(int64(e.Step), e.Layer, e.Stage, v)
	}
	for _, l := range src.Layers() {
		st, after, _, err := src.State(l)
		if err != nil {
			t.Fatal(err)
		}
		mem.Start[l], mem.StartAfter = st, after
	}
	return mem
}

// attentionOnly is m with the attention sub-layers' weights only: no
// whole-layer tensors (mHC, norms, MoE), no embedding or head.
func attentionOnly(m *engine.Model) *engine.Model {
	a := *m
	a.Weights = map[int]*engine.LayerWeights{}
	for l, w := range m.Weights {
		c := *w
		c.Block = nil
		a.Weights[l] = &c
	}
	a.Head = nil
	return &a
}

// corruptBeyondAttention changes, at step 4 of the official golden, what the
// attention sub-layer does not compute: layer 2's ffn_out (one value), its
// moe_indices (expert 16386, no expert of the model) and the logits (100
// at 7).
func corruptBeyondAttention(mem *MemSource) {
	k := StageKey{Step: 4, Layer: 2, Stage: "ffn_out"}
	v := mem.Values[k].Clone()
	v.F[0] = quant.BF16Next(v.F[0], 64)
	mem.Values[k] = v
	k = StageKey{Step: 4, Layer: 2, Stage: "moe_indices"}
	v = mem.Values[k].Clone()
	v.I[0] = 16386
	mem.Values[k] = v
	k = StageKey{Step: 4, Layer: dump.Global, Stage: "logits"}
	v = mem.Values[k].Clone()
	v.F[7] = 100
	mem.Values[k] = v
}

// notCheckedWhy is why (step, layer, stage) was not compared ("" when it is
// not in the report's not_checked).
func notCheckedWhy(rep *Report, step int64, layer int, stage string) string {
	for _, n := range rep.Coverage.NotChecked {
		if n.Step == step && n.Layer == layer && n.Stage == stage {
			return n.Why
		}
	}
	return ""
}

// checkHeldAccounted: every stage tensor the dump holds at the replayed
// steps is compared, not checked or an input, and held counts them all
// (plus the RoPE tables, one result per layer).
func checkHeldAccounted(t *testing.T, what string, rep *Report, mem *MemSource) {
	t.Helper()
	c := rep.Coverage
	if c.Held != c.Compared+len(c.NotChecked)+len(c.Inputs) {
		t.Errorf("%s: held %d != compared %d + not checked %d + inputs %d", what, c.Held, c.Compared, len(c.NotChecked), len(c.Inputs))
	}
	want := 0
	for k := range mem.Values {
		if slices.Contains(c.Steps, k.Step) {
			want++
		}
	}
	rope := 0
	for _, r := range rep.Results {
		if r.Stage == "rope_table" {
			rope++
		}
	}
	if c.Held != want+rope {
		t.Errorf("%s: held %d, the dump holds %d stage tensors at the steps replayed (+ %d RoPE tables)", what, c.Held, want, rope)
	}
}

// TestReplayAttentionOnlyWeightsIncomplete: with weights that hold the
// attention sub-layers only, a dump whose FFN output, expert ids and logits
// were corrupted is not "agree": the stages the weights cannot compute are
// named as not compared, with the reason (the weights given lack them),
// and the verdict is incomplete — in every mode, in bisect and in diff,
// whose referee does not call either side right. With the whole model's
// weights the same dump diverges.
func TestReplayAttentionOnlyWeightsIncomplete(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	mem := memCopy(t, src)
	corruptBeyondAttention(mem)
	attn := attentionOnly(m)
	ctx := context.Background()
	for _, mode := range []Mode{Local, Propagated} {
		rep, err := Run(ctx, attn, mem, Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Verdict != VerdictIncomplete || rep.Coverage.Complete {
			t.Fatalf("%s: verdict %s (complete %v), want incomplete: %s", mode, rep.Verdict, rep.Coverage.Complete, rep.VerdictLine())
		}
		for _, c := range []struct {
			layer      int
			stage, why string
		}{{2, "ffn_out", WhyNoBlockWeights}, {2, "moe_indices", WhyNoBlockWeights}, {2, "h_in", WhyNoBlockWeights}, {3, "logits", WhyNoHead}} {
			if got := notCheckedWhy(rep, 4, c.layer, c.stage); got != c.why {
				t.Errorf("%s: step 4 layer %d %s not checked because %q, want %q", mode, c.layer, c.stage, got, c.why)
			}
		}
		if len(rep.Coverage.NotModelled) != 0 {
			t.Errorf("%s: not modelled %v: those are stages of the reference the weights lack", mode, rep.Coverage.NotModelled)
		}
		if !strings.Contains(rep.Coverage.Scope, "attention sub-layers only") {
			t.Errorf("%s: scope %q", mode, rep.Coverage.Scope)
		}
		inputs := map[string]string{}
		for _, in := range rep.Coverage.Inputs {
			inputs[in.Stage] = in.Why
		}
		if inputs["x"] != WhyInputX || inputs["tok"] != WhyInputToken || inputs["pos"] != WhyInputToken || len(inputs) != 3 {
			t.Errorf("%s: inputs %v", mode, inputs)
		}
		checkHeldAccounted(t, string(mode), rep, mem)
		var b strings.Builder
		rep.WriteText(&b)
		for _, want := range []string{"not compared: attn_norm_in (24)", "not compared: logits (6)", WhyNoHead, "incomplete: "} {
			if !strings.Contains(b.String(), want) {
				t.Errorf("%s: the text report lacks %q:\n%s", mode, want, b.String())
			}
		}
	}
	full, err := Run(ctx, m, mem, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !full.Diverged() {
		t.Errorf("whole-model weights: verdict %s, want diverged", full.Verdict)
	}
	bis, err := Bisect(ctx, attn, mem, nil)
	if err != nil {
		t.Fatal(err)
	}
	if bis.Verdict != VerdictIncomplete || notCheckedWhy(bis, 4, 2, "moe_indices") != WhyNoBlockWeights || notCheckedWhy(bis, 4, 3, "logits") != WhyNoHead {
		t.Errorf("bisect: verdict %s: %s", bis.Verdict, bis.VerdictLine())
	}
	d, err := Diff(ctx, m.Cfg, attn, src, mem, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.First == nil || d.First.Step != 4 || d.First.Layer != 2 || d.First.Stage != "moe_indices" {
		t.Fatalf("diff: first divergence %+v", d.First)
	}
	if r := d.Referee; r == nil || r.A != VerdictIncomplete || r.B != VerdictIncomplete || r.Right != "unknown" {
		t.Errorf("diff: referee %+v, want both incomplete and right unknown", d.Referee)
	}
}

// TestReplayNotModelledIncomplete: a tensor the reference does not model
// (an engine's own buffer) that the dump holds makes the verdict incomplete,
// named with the reason, even with the whole model's weights.
func TestReplayNotModelledIncomplete(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	mem := memCopy(t, src)
	mem.Put(5, 1, "engine_scratch", engine.FromF(engine.KindBF16, []float32{1, 2}, 2))
	rep, err := Run(context.Background(), m, mem, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdict != VerdictIncomplete || notCheckedWhy(rep, 5, 1, "engine_scratch") != WhyNotModelled ||
		!slices.Equal(rep.Coverage.NotModelled, []string{"engine_scratch"}) || len(rep.Coverage.NotChecked) != 1 {
		t.Errorf("verdict %s, not checked %v, not modelled %v", rep.Verdict, rep.Coverage.NotChecked, rep.Coverage.NotModelled)
	}
	checkHeldAccounted(t, "local", rep, mem)
}

// TestReplayInputsNamed: the official golden agrees in local and
// propagated mode, and both reports account for the same 1102 tensors: the
// propagated replay names the 18 h_in of layers 1-3 it starts each layer's
// chain from as inputs (local mode compares them with the h_out below), and
// both name tok and pos; the verdict line says so.
func TestReplayInputsNamed(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	mem := memCopy(t, src)
	for _, c := range []struct {
		mode           Mode
		compared, hIns int
	}{{Local, 1090, 0}, {Propagated, 1072, 18}} {
		rep, err := Run(context.Background(), m, mem, Options{Mode: c.mode})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Verdict != VerdictAgree {
			t.Fatalf("%s: %s", c.mode, rep.VerdictLine())
		}
		n := 0
		for _, in := range rep.Coverage.Inputs {
			if in.Stage == "h_in" {
				n++
				if in.Why != WhyInputHInPropagated || in.Layer == 0 {
					t.Errorf("%s: input %+v", c.mode, in)
				}
			}
		}
		if rep.Coverage.Compared != c.compared || n != c.hIns || rep.Coverage.Held != 1102 || len(rep.Coverage.Inputs) != 12+c.hIns {
			t.Errorf("%s: compared %d, h_in inputs %d, held %d, inputs %d", c.mode, rep.Coverage.Compared, n, rep.Coverage.Held, len(rep.Coverage.Inputs))
		}
		checkHeldAccounted(t, string(c.mode), rep, mem)
		line := rep.VerdictLine()
		if want := "but the " + strconv.Itoa(12+c.hIns) + " inputs the replay starts from"; !strings.Contains(line, want) {
			t.Errorf("%s: verdict line %q lacks %q", c.mode, line, want)
		}
	}
}

// TestBisectCountsAsReplay: bisect of a dump with one kv_cache record
// removed is incomplete for the same reason and over the same counts as a
// local replay (each RoPE table counted once, though every probe and the
// scan judge the tables at their first step).
func TestBisectCountsAsReplay(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	mem := memCopy(t, src)
	delete(mem.Values, StageKey{Step: 4, Layer: 2, Stage: "kv_cache"})
	ctx := context.Background()
	rep, err := Run(ctx, m, mem, Options{})
	if err != nil {
		t.Fatal(err)
	}
	bis, err := Bisect(ctx, m, mem, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdict != VerdictIncomplete || bis.Verdict != VerdictIncomplete {
		t.Fatalf("verdicts: replay %s, bisect %s", rep.Verdict, bis.Verdict)
	}
	rc, bc := rep.Coverage, bis.Coverage
	if bc.Held != rc.Held || bc.Compared != rc.Compared || !slices.Equal(bc.NotChecked, rc.NotChecked) || len(bc.Inputs) != len(rc.Inputs) {
		t.Errorf("bisect held %d compared %d not checked %v; replay held %d compared %d not checked %v",
			bc.Held, bc.Compared, bc.NotChecked, rc.Held, rc.Compared, rc.NotChecked)
	}
	if line := bis.VerdictLine(); !strings.Contains(line, "kv_cache: no value of kv_cache after step 4") || strings.Contains(line, "did not probe") {
		t.Errorf("bisect verdict: %s", line)
	}
	checkHeldAccounted(t, "bisect", bis, mem)
}

// TestDiffWording: a diff's verdict is about A against B and says so; the
// referee's sentence agrees with it: two copies of one faulty dump agree
// with each other while the reference says neither is right (and where);
// a dump against itself: both are right; a selection that differs is
// described as B's against A's (not the GPU's against the reference's);
// the header names both dumps.
func TestDiffWording(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	ctx := context.Background()
	faulty := func() *MemSource {
		mem := memCopy(t, src)
		k := StageKey{Step: 5, Layer: 2, Stage: "kv"}
		v := mem.Values[k].Clone()
		v.F[3] = quant.BF16Next(v.F[3], 1)
		mem.Values[k] = v
		return mem
	}
	rep, err := Diff(ctx, m.Cfg, m, faulty(), faulty(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	rep.WriteText(&b)
	out := b.String()
	for _, want := range []string{"(A) vs ", "agree: A and B agree with each other: ",
		"referee: reference vs A diverged, vs B diverged: neither is right: the reference's first divergence from A is at decode step 5, layer 2, stage kv, from B at the same stage"} {
		if !strings.Contains(out, want) {
			t.Errorf("diff of two copies of one faulty dump lacks %q:\n%s", want, out)
		}
	}
	if rep.Verdict != VerdictAgree || rep.Referee.Right != "neither" {
		t.Errorf("verdict %s, referee %+v", rep.Verdict, rep.Referee)
	}
	self, err := Diff(ctx, m.Cfg, m, src, src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if self.Referee.Right != "both" || !strings.HasSuffix(self.Referee.Text, "both are right") {
		t.Errorf("diff of the golden with itself: referee %+v", self.Referee)
	}
	sel := memCopy(t, src)
	k := StageKey{Step: 5, Layer: 1, Stage: "index_topk"}
	v := sel.Values[k].Clone()
	v.I[0] = v.I[0] + 1
	if slices.Contains(v.I[1:], v.I[0]) {
		v.I[0]++
	}
	sel.Values[k] = v
	d, err := Diff(ctx, m.Cfg, m, src, sel, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.First == nil || d.First.Stage != "index_topk" || strings.Contains(d.First.Why, "GPU") || strings.Contains(d.First.Why, "reference") || !strings.Contains(d.First.Why, "B ") {
		t.Errorf("diff of a selection: %+v", d.First)
	}
}

// TestToleranceOverridesReported: a tolerance the user sets (Override, as
// --tol-stage and --tol do) is named in the report and beside its verdict;
// a replay with the defaults names none.
func TestToleranceOverridesReported(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	ctx := context.Background()
	tol := DefaultTolerance()
	name, st, err := ParseStageTol("o=close,abs=2e-3,rel=0.02,cos=1e-5")
	if err != nil {
		t.Fatal(err)
	}
	tol.Override(name, st)
	tol.Override("*", StageTol{Mode: TolULP, MaxULP: 2})
	rep, err := Run(ctx, m, src, Options{Tol: tol, Steps: []int64{3}})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"o=close,abs=0.002,rel=0.02,cos=1e-05", "*=ulp,max_ulp=2"}
	if !slices.Equal(rep.TolOverrides, want) || rep.Verdict != VerdictAgree ||
		!strings.HasSuffix(rep.VerdictLine(), "(tolerances overridden: o=close,abs=0.002,rel=0.02,cos=1e-05; *=ulp,max_ulp=2)") {
		t.Errorf("overrides %q, verdict %s: %s", rep.TolOverrides, rep.Verdict, rep.VerdictLine())
	}
	bis, err := Bisect(ctx, m, src, tol)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(bis.TolOverrides, want) || !strings.Contains(bis.VerdictLine(), "tolerances overridden") {
		t.Errorf("bisect: overrides %q: %s", bis.TolOverrides, bis.VerdictLine())
	}
	def, err := Run(ctx, m, src, Options{Steps: []int64{3}})
	if err != nil {
		t.Fatal(err)
	}
	if len(def.TolOverrides) != 0 || strings.Contains(def.VerdictLine(), "overridden") {
		t.Errorf("defaults: %q %s", def.TolOverrides, def.VerdictLine())
	}
}

// TestReplayNoEmbeddingInput: with the whole layers' weights and the head
// but no embedding, layer 0 starts from the dumped h_in: an input (named,
// with why), not a stage the replay left out, and the scope says it.
func TestReplayNoEmbeddingInput(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	noEmbed := *m
	noEmbed.Head = &engine.HeadWeights{Head: m.Head.Head}
	for _, mode := range []Mode{Local, Propagated} {
		rep, err := Run(context.Background(), &noEmbed, src, Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, in := range rep.Coverage.Inputs {
			if in.Stage == "h_in" && in.Layer == 0 {
				n++
				if in.Why != WhyInputNoEmbed {
					t.Errorf("%s: %+v", mode, in)
				}
			}
		}
		if rep.Verdict != VerdictAgree || n != 6 || !strings.Contains(rep.Coverage.Scope, "no embedding") {
			t.Errorf("%s: verdict %s, %d layer-0 h_in inputs, scope %q", mode, rep.Verdict, n, rep.Coverage.Scope)
		}
	}
}
