package engine

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"testing"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/mhc"
	"sparsemla/moe"
	"sparsemla/quant"
)

// v41WholeDir is the GPU golden of a whole V4.1 decode step: the official
// Transformer.forward (embed, 8 blocks with the pipelined mHC, attention and
// the FP4 MoE, the head) on an H200 (testdata/v41-tiny-whole/README.md).
const v41WholeDir = "../testdata/v41-tiny-whole"

// v41Whole is the golden opened: its config, weights and decode steps.
type v41Whole struct {
	cfg   *Config
	w     *dump.Safetensors
	steps map[int64]*dump.Safetensors
	order []int64
}

func openV41Whole(t *testing.T) *v41Whole {
	t.Helper()
	cfg, err := LoadConfig(v41WholeDir + "/config.json")
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.IsV41() {
		t.Fatal("config.json is not a V4.1 config")
	}
	g := &v41Whole{cfg: cfg, steps: map[int64]*dump.Safetensors{}}
	open := func(name string) *dump.Safetensors {
		st, err := dump.OpenSafetensors(v41WholeDir + "/" + name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return st
	}
	g.w = open("weights.safetensors")
	for p := int64(12); p <= 14; p++ {
		g.steps[p] = open(fmt.Sprintf("step_%d.safetensors", p))
		g.order = append(g.order, p)
	}
	return g
}

// tensor reads one dumped tensor as the engine's Tensor (bf16 / fp32 values
// widened, integers as int64).
func v41WholeTensor(t *testing.T, st *dump.Safetensors, name string) Tensor {
	t.Helper()
	r, err := st.Read(name)
	if err != nil {
		t.Fatalf("%s: %v", st.Path, err)
	}
	x, err := TensorFromRecord(&r)
	if err != nil {
		t.Fatalf("%s: %s: %v", st.Path, name, err)
	}
	return x
}

// v41Agree accumulates the agreement of one stage over steps and layers:
// elements compared, elements not bit-identical, the largest distance in
// units in the last place of the stage's dtype (bf16 or fp32) and the largest
// |Δ| / max|golden|.
type v41Agree struct {
	kind            Kind
	n, diff         int
	maxULP          int64
	maxRel          float64
	whereFirstDiffs []string
}

func (a *v41Agree) add(where string, got, want Tensor) error {
	if len(got.F) != len(want.F) || len(got.I) != len(want.I) {
		return fmt.Errorf("%s: %d/%d values, golden %d/%d", where, len(got.F), len(got.I), len(want.F), len(want.I))
	}
	a.kind = want.Kind
	for i := range want.I {
		a.n++
		if got.I[i] != want.I[i] {
			a.diff++
			a.maxULP = max(a.maxULP, 1)
		}
	}
	var scale float64
	for _, v := range want.F {
		scale = math.Max(scale, math.Abs(float64(v)))
	}
	before := a.diff
	for i, w := range want.F {
		g := got.F[i]
		a.n++
		if math.Float32bits(g) == math.Float32bits(w) {
			continue
		}
		a.diff++
		u := v41Ulp32(g, w)
		if want.Kind == KindBF16 {
			u = (u + 0xffff) >> 16
		}
		a.maxULP = max(a.maxULP, u)
		if scale > 0 {
			a.maxRel = math.Max(a.maxRel, math.Abs(float64(g)-float64(w))/scale)
		}
	}
	if a.diff > before && len(a.whereFirstDiffs) < 4 {
		a.whereFirstDiffs = append(a.whereFirstDiffs, fmt.Sprintf("%s (%d)", where, a.diff-before))
	}
	return nil
}

func (a *v41Agree) String() string {
	ulp := "bf16"
	if a.kind == KindF32 {
		ulp = "fp32"
	}
	if a.kind == KindI64 || a.kind == KindI32 {
		ulp = "int"
	}
	s := fmt.Sprintf("%6d values, %8.4f %% bit-exact", a.n, 100*float64(a.n-a.diff)/float64(a.n))
	if a.diff > 0 {
		s += fmt.Sprintf(", max %d %s ulp, max |Δ|/max|golden| %.2g; at %s", a.maxULP, ulp, a.maxRel, strings.Join(a.whereFirstDiffs, ", "))
	}
	return s
}

type v41AgreeTable map[string]*v41Agree

func (tb v41AgreeTable) add(t *testing.T, stage, where string, got, want Tensor) {
	t.Helper()
	a := tb[stage]
	if a == nil {
		a = &v41Agree{}
		tb[stage] = a
	}
	if err := a.add(where, got, want); err != nil {
		t.Fatal(err)
	}
}

func (tb v41AgreeTable) log(t *testing.T, title string) {
	t.Helper()
	names := make([]string, 0, len(tb))
	for n := range tb {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	fmt.Fprintf(&b, "%s:\n", title)
	for _, n := range names {
		fmt.Fprintf(&b, "  %-16s %s\n", n, tb[n])
	}
	t.Log(b.String())
}

// check fails the test for a stage that is not bit-exact unless it is in
// allowed with a bound on its ulp distance and its relative error.
func (tb v41AgreeTable) check(t *testing.T, allowed map[string]v41Allow) {
	t.Helper()
	for n, a := range tb {
		if a.diff == 0 {
			continue
		}
		al, ok := allowed[n]
		if !ok || a.maxULP > al.ulp || a.maxRel > al.rel || float64(a.diff) > al.frac*float64(a.n) {
			t.Errorf("%s: %s (allowed: %+v)", n, a, al)
		}
	}
}

type v41Allow struct {
	ulp  int64   // largest ulp distance
	rel  float64 // largest |Δ| / max|golden|
	frac float64 // largest fraction of values not bit-exact
}

func v41WholeBlockWeights(t *testing.T, g *v41Whole, l int) *V41BlockWeights {
	return v41MHCWeights(t, g.cfg, g.w, l)
}

// TestV41WholeGoldenStructure checks the golden is one chained forward: the
// embedding row of the token, repeated hc times, is layer 0's h_in; each
// block's h_out and pre_mix_out are the next block's h_in and pre_mix_in;
// pre_mix_out is hc_ffn_pre; layer 0's pre_mix_in is make_identity_pre_mix;
// the head collapses with the last pre_mix_out. Bit for bit.
func TestV41WholeGoldenStructure(t *testing.T) {
	g := openV41Whole(t)
	hc, dim := g.cfg.HCMult, g.cfg.Dim
	emb := v41MHCRead(t, g.w, "embed.weight")
	for _, p := range g.order {
		s := g.steps[p]
		tok := v41WholeTensor(t, s, "token").I[0]
		if pos := v41WholeTensor(t, s, "pos").I[0]; pos != p {
			t.Fatalf("step %d: pos %d", p, pos)
		}
		e := v41MHCRead(t, s, "embed")
		if !slices.Equal(e, emb[int(tok)*dim:(int(tok)+1)*dim]) {
			t.Errorf("step %d: embed is not embed.weight[%d]", p, tok)
		}
		h0 := v41MHCRead(t, s, "L0.h_in")
		for j := 0; j < hc; j++ {
			if !slices.Equal(h0[j*dim:(j+1)*dim], e) {
				t.Errorf("step %d: L0.h_in[%d] is not the embedding", p, j)
			}
		}
		if !slices.Equal(v41MHCRead(t, s, "L0.pre_mix_in"), V41IdentityPreMix(hc)) {
			t.Errorf("step %d: L0.pre_mix_in is not one-hot", p)
		}
		for l := 0; l < g.cfg.NLayers; l++ {
			if !slices.Equal(v41MHCRead(t, s, fmt.Sprintf("L%d.pre_mix_out", l)), v41MHCRead(t, s, fmt.Sprintf("L%d.hc_ffn_pre", l))) {
				t.Errorf("step %d: L%d.pre_mix_out is not hc_ffn_pre", p, l)
			}
			if l == 0 {
				continue
			}
			for _, c := range [][2]string{{"h_in", "h_out"}, {"pre_mix_in", "pre_mix_out"}} {
				if !slices.Equal(v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, c[0])), v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l-1, c[1]))) {
					t.Errorf("step %d: L%d.%s is not L%d.%s", p, l, c[0], l-1, c[1])
				}
			}
		}
		last := fmt.Sprintf("L%d.pre_mix_out", g.cfg.NLayers-1)
		if !slices.Equal(v41MHCRead(t, s, "head_pre_mix"), v41MHCRead(t, s, last)) {
			t.Errorf("step %d: head_pre_mix is not %s", p, last)
		}
	}
}

// TestV41WholeGoldenMHC replays every mHC stage of every block and the head
// (engine.V41BlockStages, V41HeadStages) against the official
// Transformer.forward on the GPU, in two ways: teacher-forced (each stage
// from the dumped values of its inputs) and chained through the block (every
// stage from h_in and pre_mix_in alone, the sub-layers' outputs y and ffn_out
// taken from the dump). bf16 stages must be bit-exact; the fp32 mixes, pre,
// post, comb and the logits within the bounds below (torch's GEMMs sum in
// another order than the reference's index order).
func TestV41WholeGoldenMHC(t *testing.T) {
	g := openV41Whole(t)
	cfg := g.cfg
	a, m, f := V41BlockStages(cfg)
	defs := slices.Concat(a, m, f)
	hw := &V41HeadWeights{Norm: v41MHCRead(t, g.w, "norm.weight"), Head: v41MHCRead(t, g.w, "head.weight"), Vocab: cfg.VocabSize}
	forced, chained := v41AgreeTable{}, v41AgreeTable{}
	for _, p := range g.order {
		s := g.steps[p]
		for l := 0; l < cfg.NLayers; l++ {
			bw := v41WholeBlockWeights(t, g, l)
			where := fmt.Sprintf("P%d L%d", p, l)
			dumped := func(n string) Tensor { return v41WholeTensor(t, s, fmt.Sprintf("L%d.%s", l, n)) }
			for _, d := range defs {
				in := map[string]Tensor{}
				for _, n := range d.Inputs {
					in[n] = dumped(n)
				}
				got, err := d.Compute(cfg, bw, in)
				if err != nil {
					t.Fatalf("%s %s: %v", where, d.Name, err)
				}
				forced.add(t, d.Name, where, got, dumped(d.Name))
			}
			sub := func(n string) V41SubLayer { return func(Tensor) (Tensor, error) { return dumped(n), nil } }
			out, err := V41Block(cfg, bw, dumped("h_in"), dumped("pre_mix_in").F, sub("y"), sub("ffn_out"))
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range defs {
				chained.add(t, d.Name, where, out[d.Name], dumped(d.Name))
			}
		}
		last := cfg.NLayers - 1
		hin := map[string]Tensor{"h_out": v41WholeTensor(t, s, fmt.Sprintf("L%d.h_out", last)), "pre_mix_out": v41WholeTensor(t, s, fmt.Sprintf("L%d.pre_mix_out", last))}
		for _, d := range V41HeadStages() {
			in := map[string]Tensor{}
			for _, n := range d.Inputs {
				if v, ok := hin[n]; ok {
					in[n] = v
				} else {
					in[n] = v41WholeTensor(t, s, n)
				}
			}
			got, err := d.Compute(cfg, hw, in)
			if err != nil {
				t.Fatal(err)
			}
			forced.add(t, d.Name, fmt.Sprintf("P%d", p), got, v41WholeTensor(t, s, d.Name))
		}
		out, err := V41Head(cfg, hw, hin["h_out"], hin["pre_mix_out"].F)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"head_in", "head_x", "logits"} {
			chained.add(t, n, fmt.Sprintf("P%d", p), out[n], v41WholeTensor(t, s, n))
		}
	}
	forced.log(t, "mHC and head, teacher-forced (3 steps x 8 layers)")
	chained.log(t, "mHC and head, chained within each block from h_in, pre_mix_in, y, ffn_out")
	// fp32 stages: bounded by |Δ| / max|golden| (ulps are meaningless for the
	// logits near zero).
	fp32 := v41Allow{ulp: 1 << 24, rel: 1e-5, frac: 1}
	allowed := map[string]v41Allow{}
	for _, n := range []string{"hc_attn_mixes", "hc_ffn_mixes", "hc_attn_pre", "hc_ffn_pre", "hc_attn_post", "hc_ffn_post", "hc_attn_comb", "hc_ffn_comb", "pre_mix_out", "logits"} {
		allowed[n] = fp32
	}
	// RMSNorm (x, ffn_in, head_x): the reference sums the squares in index
	// order, torch in its own reduction order; the fp32 mean can differ by a
	// few ulps and flip a bf16 rounding at a near-tie (1 value seen).
	for _, n := range []string{"x", "ffn_in", "head_x"} {
		allowed[n] = v41Allow{ulp: 1, rel: 1e-2, frac: 1e-3}
	}
	forced.check(t, allowed)
	// Chained, a near-tie fp32 difference of the mixes can flip one bf16
	// rounding of a stream: allow 1 ulp on at most 1 value in 1000.
	for _, n := range []string{"attn_norm_in", "x", "h_mid", "ffn_norm_in", "ffn_in", "h_out", "head_in", "head_x"} {
		allowed[n] = v41Allow{ulp: 1, rel: 1e-2, frac: 1e-3}
	}
	chained.check(t, allowed)
}

// v41FP4Linear is linear() with an FP4 expert weight in V4.1 (V41-M: act_quant
// with fp8_block_size = 32, then fp4_gemm with act_block_size 32): the FP8
// activation has one UE8M0 scale per 32 columns (V4's moe.FP4Linear quantises
// per 128), y[n] = bf16(Σ_b f32(f32(Σ_{k∈b} qx[k]·E2M1(code[n][k]))·s_x[b]·s_w[n][b])).
// A test-local transcription: the reference has no V4.1 MoE yet (and
// moe.NewFP4Weight takes only widths that are multiples of 128; w2 here is 64
// wide).
func v41FP4Linear(y, x []float32, w *v41FP4Weight) { v41FP4LinearAct(y, x, w, 32) }

// v41FP4LinearAct is v41FP4Linear with the activation quantised per B
// columns (B = 128: V4's act_quant block), the weight blocks staying 32.
func v41FP4LinearAct(y, x []float32, w *v41FP4Weight, B int) {
	const WB = 32
	qx := make([]float32, len(x))
	sx := make([]float32, len(x)/B)
	quant.QuantizeActFP8(qx, sx, x, B)
	nb := w.Cols / WB
	for n := range y {
		codes := w.Packed[n*w.Cols/2 : (n+1)*w.Cols/2]
		var acc float32
		for b := 0; b < nb; b++ {
			var blk float32
			for k := b * WB; k < (b+1)*WB; k++ {
				blk += float32(qx[k] * quant.DecodeE2M1(codes[k/2]>>(4*uint(k&1))))
			}
			acc += float32(float32(blk*sx[b*WB/B]) * quant.DecodeUE8M0(w.Scale[n*nb+b]))
		}
		y[n] = quant.BF16Round(acc)
	}
}

// v41FP4Weight is an FP4 expert weight as the checkpoint stores it: Packed
// [Rows][Cols/2] (even column in the low nibble), Scale [Rows][Cols/32] UE8M0.
type v41FP4Weight struct {
	Packed, Scale []uint8
	Rows, Cols    int
}

// TestV41WholeGoldenMoE checks the FFN sub-layer of every block teacher-forced
// from the dumped ffn_in, with the reference's V4 MoE pieces and V4.1's
// differences written here (the reference has no V4.1 MoE yet):
//
//	gate: l = f32(W_g)·f32(ffn_in) / gate_temp; s = sqrt(softplus(l));
//	      idx = topk(s + bias, k); w = s[idx] / (Σ s[idx] + 1e-20) · route_scale
//	routed expert e (FP4, act blocks of 32): out_e = w2(bf16(w_e·silu(min(g, L))·clamp(u, ±L)))
//	shared expert (FP8 32×32, act blocks of 32, WITH swiglu_limit L in V4.1)
//	ffn_out = bf16(Σ_{e ascending} f32(out_e) + f32(shared))
//
// moe_indices must agree exactly; the rest is measured and bounded.
func TestV41WholeGoldenMoE(t *testing.T) {
	g := openV41Whole(t)
	cfg := g.cfg
	temp := float32(cfg.GateTemp)
	limit := float32(cfg.SwigluLimit)
	if temp == 0 || temp == 1 || limit == 0 {
		t.Fatalf("the golden should exercise gate_temp (%g) and swiglu_limit (%g)", temp, limit)
	}
	fp4 := func(name string, rows, cols int) *v41FP4Weight { return v41WholeFP4(t, g, name, rows, cols) }
	fp8 := func(name string, rows, cols int) *attention.V41FP8Weight { return v41WholeFP8(t, g, name, rows, cols) }
	dim, inter, E := cfg.Dim, cfg.MoEInterDim, cfg.NRoutedExperts
	tb := v41AgreeTable{}
	clamped := 0
	for l := 0; l < cfg.NLayers; l++ {
		pre := fmt.Sprintf("layers.%d.ffn.", l)
		gw := v41MHCRead(t, g.w, pre+"gate.weight")
		bias := v41MHCRead(t, g.w, pre+"gate.bias")
		sw1, sw2, sw3 := fp8(pre+"shared_experts.w1", inter, dim), fp8(pre+"shared_experts.w2", dim, inter), fp8(pre+"shared_experts.w3", inter, dim)
		for _, p := range g.order {
			s := g.steps[p]
			where := fmt.Sprintf("P%d L%d", p, l)
			dumped := func(n string) Tensor { return v41WholeTensor(t, s, fmt.Sprintf("L%d.%s", l, n)) }
			x := dumped("ffn_in").F
			sc := make([]float32, E)
			attention.F32Linear(sc, x, gw, E, dim)
			for e := range sc {
				sc[e] /= temp
			}
			moe.ApplyScoreFunc(sc, moe.ScoreFunc(cfg.ScoreFunc))
			sel := make([]float32, E)
			for e := range sel {
				sel[e] = sc[e] + bias[e]
			}
			idx, _ := moe.TopK(sel, cfg.NActivatedExperts)
			w := make([]float32, len(idx))
			var sum float32
			for k, e := range idx {
				w[k] = sc[e]
				sum += w[k]
			}
			for k := range w {
				w[k] = w[k] / (sum + 1e-20) * float32(cfg.RouteScale)
			}
			ii := make([]int64, len(idx))
			for k, e := range idx {
				ii[k] = int64(e)
			}
			tb.add(t, "moe_indices", where, Tensor{Kind: KindI64, Shape: []int{len(ii)}, I: ii}, dumped("moe_indices"))
			tb.add(t, "moe_weights", where, FromF(KindF32, w, len(w)), dumped("moe_weights"))
			// experts, each from the dumped routing (teacher-forced)
			dIdx, dW := dumped("moe_indices").I, dumped("moe_weights").F
			outs := make([]float32, len(dIdx)*dim)
			for k, e := range dIdx {
				ep := fmt.Sprintf("%sexperts.%d.", pre, e)
				w1, w2, w3 := fp4(ep+"w1", inter, dim), fp4(ep+"w2", dim, inter), fp4(ep+"w3", inter, dim)
				gg, uu, h := make([]float32, inter), make([]float32, inter), make([]float32, inter)
				v41FP4Linear(gg, x, w1)
				v41FP4Linear(uu, x, w3)
				for i := range gg {
					if gg[i] > limit || math.Abs(float64(uu[i])) > float64(limit) {
						clamped++
					}
				}
				moe.SwiGLU(h, gg, uu, limit, dW[k], true)
				v41FP4Linear(outs[k*dim:(k+1)*dim], h, w2)
			}
			tb.add(t, "moe_expert_out", where, FromF(KindBF16, outs, len(dIdx), dim), dumped("moe_expert_out"))
			gg, uu, h, sh := make([]float32, inter), make([]float32, inter), make([]float32, inter), make([]float32, dim)
			attention.V41FP8Linear(gg, x, sw1)
			attention.V41FP8Linear(uu, x, sw3)
			moe.SwiGLU(h, gg, uu, limit, 0, false)
			attention.V41FP8Linear(sh, h, sw2)
			tb.add(t, "moe_shared_out", where, FromF(KindBF16, sh, dim), dumped("moe_shared_out"))
			// ffn_out from the dumped expert outputs: fp32 sum, experts in
			// ascending id (MoE.forward's loop), then the shared expert
			eo, so := dumped("moe_expert_out").F, dumped("moe_shared_out").F
			order := make([]int, len(dIdx))
			for k := range order {
				order[k] = k
			}
			sort.Slice(order, func(a, b int) bool { return dIdx[order[a]] < dIdx[order[b]] })
			y := make([]float32, dim)
			for _, k := range order {
				for i := range y {
					y[i] += eo[k*dim+i]
				}
			}
			for i := range y {
				y[i] = quant.BF16Round(y[i] + so[i])
			}
			tb.add(t, "ffn_out", where, FromF(KindBF16, y, dim), dumped("ffn_out"))
		}
	}
	tb.log(t, fmt.Sprintf("MoE, teacher-forced from ffn_in (3 steps x 8 layers; swiglu clamp active on %d routed-expert (g,u) pairs)", clamped))
	if clamped == 0 {
		t.Error("the swiglu clamp never acted: the golden does not test it")
	}
	tb.check(t, map[string]v41Allow{
		"moe_weights":    {ulp: 4, rel: 1e-6, frac: 1},
		"moe_expert_out": {ulp: 1, rel: 1e-2, frac: 0.05},
		"moe_shared_out": {ulp: 1, rel: 1e-2, frac: 0.05},
	})
}

// TestV41WholeGoldenMoEDiscriminates shows the golden tells V4.1's MoE from
// V4's: the shared expert without swiglu_limit (V4's shared expert has none)
// and the gate without gate_temp each fail to reproduce the dumped values. It
// also counts where the routed w1 with the activation quantised per 128
// columns (V4's act_quant block) would differ (nowhere here: not separated).
func TestV41WholeGoldenMoEDiscriminates(t *testing.T) {
	g := openV41Whole(t)
	cfg := g.cfg
	dim, inter := cfg.Dim, cfg.MoEInterDim
	limit := float32(cfg.SwigluLimit)
	var act128, noLimit, noTemp int
	for l := 0; l < cfg.NLayers; l++ {
		pre := fmt.Sprintf("layers.%d.ffn.", l)
		for _, p := range g.order {
			s := g.steps[p]
			dumped := func(n string) Tensor { return v41WholeTensor(t, s, fmt.Sprintf("L%d.%s", l, n)) }
			x := dumped("ffn_in").F
			// routed: w1 with V4's activation block; the gate branch before the clamp
			e := dumped("moe_indices").I[0]
			w1 := v41WholeFP4(t, g, fmt.Sprintf("%sexperts.%d.w1", pre, e), inter, dim)
			a, b := make([]float32, inter), make([]float32, inter)
			v41FP4LinearAct(a, x, w1, 32)
			v41FP4LinearAct(b, x, w1, 128)
			if !slices.Equal(a, b) {
				act128++
			}
			// shared without the limit
			sw := func(n string, r, c int) *attention.V41FP8Weight {
				return v41WholeFP8(t, g, pre+"shared_experts."+n, r, c)
			}
			gg, uu, h, sh := make([]float32, inter), make([]float32, inter), make([]float32, inter), make([]float32, dim)
			attention.V41FP8Linear(gg, x, sw("w1", inter, dim))
			attention.V41FP8Linear(uu, x, sw("w3", inter, dim))
			moe.SwiGLU(h, gg, uu, 0, 0, false)
			attention.V41FP8Linear(sh, h, sw("w2", dim, inter))
			if !slices.Equal(sh, dumped("moe_shared_out").F) {
				noLimit++
			}
			// the gate's weights without gate_temp
			gw := v41MHCRead(t, g.w, pre+"gate.weight")
			sc := make([]float32, cfg.NRoutedExperts)
			attention.F32Linear(sc, x, gw, cfg.NRoutedExperts, dim)
			moe.ApplyScoreFunc(sc, moe.ScoreFunc(cfg.ScoreFunc))
			idx := dumped("moe_indices").I
			w := moe.RouteWeights(sc, []int32{int32(idx[0]), int32(idx[1])}, moe.ScoreFunc(cfg.ScoreFunc), float32(cfg.RouteScale))
			if math.Abs(float64(w[0]-dumped("moe_weights").F[0])) > 1e-4 {
				noTemp++
			}
		}
	}
	t.Logf("of %d layer-steps, V4's variant differs from the golden: act block 128 (w1) %d, shared without swiglu_limit %d, gate without gate_temp %d (limit %g, gate_temp %g)",
		cfg.NLayers*len(g.order), act128, noLimit, noTemp, limit, cfg.GateTemp)
	// The activation block is NOT separated: ffn_in is an RMS-normed vector,
	// whose 32- and 128-wide blocks get the same power-of-two scale here (as
	// for the window K of testdata/v41-tiny), so act128 is only logged.
	if noLimit == 0 || noTemp == 0 {
		t.Error("the golden does not separate one of V4's MoE variants from V4.1's")
	}
}

func v41WholeFP4(t *testing.T, g *v41Whole, name string, rows, cols int) *v41FP4Weight {
	t.Helper()
	c, err1 := g.w.Read(name + ".weight")
	s, err2 := g.w.Read(name + ".scale")
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	if !slices.Equal(c.Shape, []int{rows, cols / 2}) || !slices.Equal(s.Shape, []int{rows, cols / 32}) {
		t.Fatalf("%s: codes %v, scales %v; want [%d %d], [%d %d]", name, c.Shape, s.Shape, rows, cols/2, rows, cols/32)
	}
	return &v41FP4Weight{Packed: c.Data, Scale: s.Data, Rows: rows, Cols: cols}
}

func v41WholeFP8(t *testing.T, g *v41Whole, name string, rows, cols int) *attention.V41FP8Weight {
	t.Helper()
	c, err1 := g.w.Read(name + ".weight")
	s, err2 := g.w.Read(name + ".scale")
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	return attention.NewV41FP8Weight(c.Data, s.Data, rows, cols)
}

// TestV41WholeGoldenMHCDiscriminates: on the whole-step golden, collapsing a
// sub-layer's input with its own site's pre-mix (V4's order) instead of the
// previous site's (V4.1's pipelined order; one-hot at layer 0) reproduces
// attn_norm_in / ffn_norm_in at no layer and step.
func TestV41WholeGoldenMHCDiscriminates(t *testing.T) {
	g := openV41Whole(t)
	dim := g.cfg.Dim
	for _, p := range g.order {
		s := g.steps[p]
		for l := 0; l < g.cfg.NLayers; l++ {
			for _, c := range []struct{ stage, in, ownPre string }{{"attn_norm_in", "h_in", "hc_attn_pre"}, {"ffn_norm_in", "h_mid", "hc_ffn_pre"}} {
				x := make([]float32, dim)
				mhc.Collapse(x, v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, c.in)), v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, c.ownPre)))
				if slices.Equal(x, v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, c.stage))) {
					t.Errorf("P%d L%d %s: V4's order (collapse with %s) reproduces the golden", p, l, c.stage, c.ownPre)
				}
			}
		}
	}
}
