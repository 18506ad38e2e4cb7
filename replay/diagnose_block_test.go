package replay

import (
	"context"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// memGolden copies every stage tensor (all layers and the global ones) and
// the start state of a dump into a MemSource.
func memGolden(t *testing.T, src *DumpSource) *MemSource {
	t.Helper()
	mem := NewMemSource("edited golden")
	for _, e := range src.D.Entries {
		if e.Kind != dump.KindStage {
			continue
		}
		v, ok, err := src.Stage(int64(e.Step), e.Layer, e.Stage)
		if err != nil || !ok {
			t.Fatalf("%s: %v", e.Key, err)
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

// TestDiagnoseBlockBugs: the official golden with one stage of the whole layer
// replaced by what a plausibly buggy GPU kernel computes (from the stage's
// own dumped inputs) replays to exactly that stage, with the kind and the
// bug named.
func TestDiagnoseBlockBugs(t *testing.T) {
	m, src := openReplayGolden(t, "official-v4-tiny")
	cfg := m.Cfg
	hc, dim := cfg.HCMult, cfg.Dim
	get := func(p int64, l int, name string) engine.Tensor {
		v, ok, err := src.Stage(p, l, name)
		if err != nil || !ok {
			t.Fatalf("p%d L%d %s: %v", p, l, name, err)
		}
		return v
	}
	route := func(p int64, l int) ([]int32, []float32) {
		var idx []int32
		for _, e := range get(p, l, "moe_indices").I {
			idx = append(idx, int32(e))
		}
		return idx, get(p, l, "moe_weights").F
	}
	type bug struct {
		name  string
		p     int64
		l     int
		stage string
		kind  string
		why   string
		value func() engine.Tensor
	}
	var bugs []bug
	bugs = append(bugs, bug{"nibble order", 4, 2, "ffn_out", KindExperts, "nibbles swapped", func() engine.Tensor {
		b := m.Weights[2].Block
		mm := *b.MoE
		mm.Experts = make([]*moe.Expert, len(b.MoE.Experts))
		for e, ex := range b.MoE.Experts {
			mm.Experts[e] = &moe.Expert{W1: swapNibbles(ex.W1), W2: swapNibbles(ex.W2), W3: swapNibbles(ex.W3)}
		}
		idx, w := route(4, 2)
		out, err := mm.Combine(get(4, 2, "ffn_in").F, idx, w)
		if err != nil {
			t.Fatal(err)
		}
		return engine.FromF(engine.KindBF16, out, dim)
	}})
	// The per-expert evidence of a variant of every routed expert: each
	// routed expert of p4 L2 (ids 2 and 1) named with what the variant
	// changes in its own output.
	bugs = append(bugs, bug{"nibble order, per expert", 4, 2, "ffn_out", KindExperts,
		`routed experts: max 32626 bf16 ulps (allowed 1) at [234]: GPU 1.4765625, reference -1.4140625: the GPU's routed experts ([2 1]) read their FP4 weights with the nibbles swapped (even column from the HIGH nibble; float4_e2m1fn_x2 keeps it in the low one); what "fp4-nibble-swap" changes in each routed expert's own output: expert 2 (slot 0, weight 0.8619975): 256 of 256 outputs, expert 1 (slot 1, weight 0.6380025): 256 of 256 outputs`,
		bugs[0].value})
	// One routed expert alone decoded with the scale rule per 128: no
	// hypothesis of all the routed experts reproduces it, the localisation
	// names the expert.
	bugs = append(bugs, bug{"one expert's scales per 128", 4, 2, "ffn_out", KindExperts,
		`routed experts: max 32300 bf16 ulps (allowed 1) at [60]: GPU -0.62109375, reference 0.55078125; routed expert 1 (slot 1, weight 0.6380025) ALONE reproduces the GPU's ffn_out bit for bit under "fp4-scale-per-128"`, func() engine.Tensor {
			idx, w := route(4, 2)
			mm, err := m.Weights[2].Block.MoE.WithRouted(idx, func(e *moe.Expert) *moe.Expert { return e })
			if err != nil {
				t.Fatal(err)
			}
			mm.Experts[1] = mm.Experts[1].Map((*moe.FP4Weight).ScalePer128)
			out, err := mm.Combine(get(4, 2, "ffn_in").F, idx, w)
			if err != nil {
				t.Fatal(err)
			}
			return engine.FromF(engine.KindBF16, out, dim)
		}})
	bugs = append(bugs, bug{"head without its final norm", 7, 3, "logits", KindHead, `final norm: `, func() engine.Tensor {
		hd := m.Head.Head
		return engine.FromF(engine.KindF32, hd.Logits(hd.Forward(get(7, 3, "h_out").F).X), cfg.VocabSize)
	}})
	bugs = append(bugs, bug{"no shared expert", 6, 1, "ffn_out", KindExperts, "lacks the shared expert", func() engine.Tensor {
		mm := *m.Weights[1].Block.MoE
		mm.Shared = nil
		idx, w := route(6, 1)
		out, err := mm.Combine(get(6, 1, "ffn_in").F, idx, w)
		if err != nil {
			t.Fatal(err)
		}
		return engine.FromF(engine.KindBF16, out, dim)
	}})
	bugs = append(bugs, bug{"weights not normalised", 3, 3, "moe_weights", KindRouter, "without dividing by their sum", func() engine.Tensor {
		g := &m.Weights[3].Block.MoE.Gate
		idx, _ := route(3, 3)
		s := make([]float32, g.Experts)
		g.Scores(s, get(3, 3, "ffn_in").F)
		w := moe.RouteWeights(s, idx, moe.Softmax, g.RouteScale)
		return engine.FromF(engine.KindF32, w, len(w))
	}})
	bugs = append(bugs, bug{"hash lookup of another token", 5, 0, "moe_indices", KindRouter, "are tid2eid[", func() engine.Tensor {
		g := &m.Weights[0].Block.MoE.Gate
		tok := get(5, dump.Global, "tok").I[0]
		own := g.TID2EID[tok*2 : tok*2+2]
		for t2 := int64(0); ; t2++ {
			o := g.TID2EID[t2*2 : t2*2+2]
			if o[0] != own[0] || o[1] != own[1] {
				return engine.FromI(engine.KindI32, []int64{int64(o[0]), int64(o[1])}, 2)
			}
		}
	}})
	bugs = append(bugs, bug{"3 Sinkhorn iterations", 2, 1, "hc_ffn_comb", KindHyperConn, "after 3 Sinkhorn iterations", func() engine.Tensor {
		s := m.Weights[1].Block.FFNSite
		pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
		mhc.SplitSinkhorn(pre, post, comb, get(2, 1, "hc_ffn_mixes").F, s.Scale, s.Base, hc, 3, float32(cfg.HCEps))
		return engine.FromF(engine.KindF32, comb, hc, hc)
	}})
	bugs = append(bugs, bug{"comb transposed in hc_post", 7, 3, "h_mid", KindHyperConn, "comb transposed", func() engine.Tensor {
		comb := get(7, 3, "hc_attn_comb").F
		tr := make([]float32, len(comb))
		for j := 0; j < hc; j++ {
			for k := 0; k < hc; k++ {
				tr[k*hc+j] = comb[j*hc+k]
			}
		}
		out := make([]float32, hc*dim)
		mhc.Post(out, get(7, 3, "y").F, get(7, 3, "h_in").F, get(7, 3, "hc_attn_post").F, tr)
		return engine.FromF(engine.KindBF16, out, hc, dim)
	}})
	// The selection bias left out: at the first step and layer where it
	// changes the chosen experts.
	found := false
	for _, p := range src.Steps() {
		for l := cfg.NHashLayers; l < cfg.NLayers && !found; l++ {
			g := &m.Weights[l].Block.MoE.Gate
			s := make([]float32, g.Experts)
			g.Scores(s, get(p, l, "ffn_in").F)
			noBias, _ := moe.TopK(s, g.TopK)
			gpu := get(p, l, "moe_indices").I
			if !sameSet(noBias, gpu) {
				found = true
				v := []int64{int64(noBias[0]), int64(noBias[1])}
				bugs = append(bugs, bug{"bias left out of the selection", p, l, "moe_indices", KindRouter, "WITHOUT the selection bias",
					func() engine.Tensor { return engine.FromI(engine.KindI64, v, 2) }})
			}
		}
	}
	if !found {
		t.Error("no step of the golden where the bias changes the routing")
	}
	// The clamps never act on this golden (|up|, gate < 4 < swiglu_limit
	// 10): a model with swiglu_limit 0.5 makes them act. Its reference
	// clamps; the dumped ffn_out (no clamp acted on the GPU) is then a GPU
	// "without the clamp", and one computed with the shared expert clamped
	// too is the other bug.
	lowLimit := func() *engine.Model {
		c := *m
		c.Weights = map[int]*engine.LayerWeights{}
		for l, w := range m.Weights {
			wc, bc := *w, *w.Block
			mc := *w.Block.MoE
			mc.SwigluLimit = 0.5
			bc.MoE, wc.Block = &mc, &bc
			c.Weights[l] = &wc
		}
		return &c
	}()
	clampCases := []bug{
		{"routed clamp missing", 5, 2, "ffn_out", KindExperts, "skip the swiglu_limit clamp", func() engine.Tensor { return get(5, 2, "ffn_out") }},
		{"shared expert clamped", 3, 1, "ffn_out", KindExperts, "clamps the shared expert too", func() engine.Tensor {
			idx, w := route(3, 1)
			out, ok := sharedClamped(lowLimit.Weights[1].Block.MoE, get(3, 1, "ffn_in").F, idx, w)
			if !ok {
				t.Fatal("no shared expert")
			}
			return engine.FromF(engine.KindBF16, out, dim)
		}},
	}
	models := map[string]*engine.Model{}
	for _, b := range clampCases {
		models[b.name] = lowLimit
	}
	bugs = append(bugs, clampCases...)
	for _, b := range bugs {
		t.Run(b.name, func(t *testing.T) {
			mem := memGolden(t, src)
			mm := m
			if c, ok := models[b.name]; ok {
				mm = c // the low-limit model: replay the bug's step only
			}
			putLayer := b.l
			if b.stage == "logits" {
				putLayer = dump.Global
			}
			mem.Put(b.p, putLayer, b.stage, b.value())
			opt := Options{}
			if mm != m {
				opt.Steps = []int64{b.p}
			}
			rep, err := Run(context.Background(), mm, mem, opt)
			if err != nil {
				t.Fatal(err)
			}
			dv := rep.First
			if dv == nil {
				t.Fatal("replays clean")
			}
			if mm != m {
				// The low-limit model differs from the dump on every
				// layer: judge the first divergence of the bug's layer.
				for _, r := range rep.Results {
					if r.Layer == b.l && r.Status == StatusFail {
						if r.Stage != b.stage {
							t.Fatalf("layer %d first fails at %s", b.l, r.Stage)
						}
						break
					}
				}
				dv = diagnoseAt(t, mm, mem, rep, b.p, b.l, b.stage)
			}
			if dv.Step != b.p || dv.Layer != b.l || dv.Stage != b.stage || dv.Kind != b.kind || !strings.Contains(dv.Why, b.why) {
				t.Fatalf("first divergence %s\nwant step %d layer %d stage %s kind %q, why with %q", dv.Text, b.p, b.l, b.stage, b.kind, b.why)
			}
			t.Log(dv.Text)
		})
	}
}

// diagnoseAt runs the diagnosis of one failing stage result of rep.
func diagnoseAt(t *testing.T, m *engine.Model, src Source, rep *Report, p int64, l int, stage string) *Divergence {
	t.Helper()
	for _, r := range rep.Results {
		if r.Step != p || r.Layer != l || r.Stage != stage {
			continue
		}
		var def engine.StageDef
		for _, d := range engine.BlockStages(m.Cfg, l, p, m.Weights[l], m.Head) {
			if d.Name == stage {
				def = d
			}
		}
		in := map[string]engine.Tensor{}
		for _, n := range def.Inputs {
			layer, name := l, n
			if b, ok := strings.CutPrefix(n, engine.GlobalPrefix); ok {
				layer, name = dump.Global, b
			}
			v, _, _ := src.Stage(p, layer, name)
			in[n] = v
		}
		ctx := &engine.StepContext{Cfg: m.Cfg, Layer: l, Pos: p, W: m.Weights[l], Rope: m.Rope[l], Head: m.Head}
		ref, err := ComputeStage(def, ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		gpu, _, _ := src.Stage(p, l, stage)
		return Diagnose(DiagnoseInput{Model: m, Src: src, Def: def, Result: r, Ref: ref, GPU: gpu, In: in, Own: map[string]engine.Tensor{}, Mode: Local})
	}
	t.Fatalf("no result for p%d L%d %s", p, l, stage)
	return nil
}

// TestRouterNearTie: a different expert whose score + bias is within
// routerTieRel of the k-th is a tie; a clear gap, or the same experts in
// another order, stays a divergence.
func TestRouterNearTie(t *testing.T) {
	cfg, _ := engine.Preset("tiny")
	mk := func(bias1 float32) *engine.Model {
		g := moe.Gate{Experts: 3, TopK: 1, Dim: 1, Func: moe.Sigmoid, RouteScale: 1,
			Weight: []float32{1, 1, 0}, Bias: []float32{0, bias1, 0}}
		return &engine.Model{Cfg: cfg, Weights: map[int]*engine.LayerWeights{
			1: {Block: &engine.BlockWeights{MoE: &moe.MoE{Gate: g}}}}}
	}
	in := map[string]engine.Tensor{"ffn_in": engine.FromF(engine.KindBF16, []float32{1}, 1)}
	ref := engine.FromI(engine.KindI64, []int64{1}, 1)
	gpu := engine.FromI(engine.KindI64, []int64{0}, 1)
	for _, c := range []struct {
		bias float32
		want string
	}{{1e-7, StatusTie}, {1e-2, StatusFail}} {
		sr := StageResult{Stage: "moe_indices", Status: StatusFail}
		routerNearTie(&sr, mk(c.bias), 1, in, ref, gpu)
		if sr.Status != c.want {
			t.Errorf("bias %g: status %s (%s), want %s", c.bias, sr.Status, sr.Reason, c.want)
		}
	}
	// Same set, other order (k = 2): stays a divergence.
	m := mk(1e-7)
	m.Weights[1].Block.MoE.Gate.TopK = 2
	sr := StageResult{Stage: "moe_indices", Status: StatusFail}
	routerNearTie(&sr, m, 1, in, engine.FromI(engine.KindI64, []int64{1, 0}, 2), engine.FromI(engine.KindI64, []int64{0, 1}, 2))
	if sr.Status != StatusFail {
		t.Errorf("same experts in another order: %s", sr.Status)
	}
}

// TestRouterSelectionNotATie: an expert chosen clearly below the k-th
// score + bias is named with its value and called not a boundary tie.
func TestRouterSelectionNotATie(t *testing.T) {
	cfg, _ := engine.Preset("tiny")
	g := moe.Gate{Experts: 3, TopK: 1, Dim: 1, Func: moe.Sigmoid, RouteScale: 1,
		Weight: []float32{1, 1, 0}, Bias: []float32{0, 1e-2, 0}}
	m := &engine.Model{Cfg: cfg, Weights: map[int]*engine.LayerWeights{1: {Block: &engine.BlockWeights{MoE: &moe.MoE{Gate: g}}}}}
	d := DiagnoseInput{Model: m, Result: StageResult{Stage: "moe_indices", Layer: 1},
		In:  map[string]engine.Tensor{"ffn_in": engine.FromF(engine.KindBF16, []float32{1}, 1)},
		GPU: engine.FromI(engine.KindI64, []int64{2}, 1)}
	why := routerIndicesHypotheses(d)
	for _, want := range []string{"the GPU's experts [2] are not the top-1", "it chose 2 (score + bias 0.5) below the k-th", "not a boundary tie"} {
		if !strings.Contains(why, want) {
			t.Errorf("diagnosis %q does not say %q", why, want)
		}
	}
}
