package replay

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"testing"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/mhc"
	"sparsemla/moe"
	"sparsemla/quant"
)

// v41WholeGolden is the GPU golden of a whole V4.1 decode step (the official
// Transformer.forward; testdata/v41-tiny-whole/README.md). Its attention
// stages are in v41-tiny's layout, so V41Run replays them; the block, MoE
// and head stages are not judged by V41Run (engine's TestV41WholeGolden*
// check them).
const v41WholeGolden = "../testdata/v41-tiny-whole"

// TestV41WholeGoldenAttention replays the attention sub-layer of every layer
// and step of the whole-step golden with V41Run (each layer's x is now the
// official attn_norm output of the real stream, not a random input), in both
// modes, and logs the agreement per stage. Every attention stage must be
// compared. Local: every stage passes V41Tolerance except kv_normed, where
// the reference's index-order fp32 sum of squares (attention.RMSNorm) can
// differ from torch's reduction by a few ulps and flip one bf16 rounding at a
// near-tie (1 value of 512, 1 ulp). Propagated: failures only at the layers
// and steps of such a near-tie (the flipped value goes through FQ8 into the
// window and the attention).
func TestV41WholeGoldenAttention(t *testing.T) {
	d, err := LoadV41Dir(v41WholeGolden)
	if err != nil {
		t.Fatal(err)
	}
	nearTie := map[string]bool{}
	for _, mode := range []Mode{Local, Propagated} {
		rep, err := V41Run(d, V41Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		type agg struct {
			results, pass, n, mismatch int
			maxULP                     int64
			maxAbs                     float64
			fails                      []string
		}
		per := map[string]*agg{}
		for _, r := range rep.Results {
			if r.Status == StatusMissing || r.Status == StatusSkipped {
				continue
			}
			a := per[r.Stage]
			if a == nil {
				a = &agg{}
				per[r.Stage] = a
			}
			a.results++
			if r.Status == StatusPass || r.Status == StatusTie {
				a.pass++
			}
			where := fmt.Sprintf("P%d L%d", r.Step, r.Layer)
			if r.Metrics != nil {
				a.n += r.Metrics.N
				a.mismatch += r.Metrics.Mismatch
				a.maxULP = max(a.maxULP, r.Metrics.MaxULP)
				a.maxAbs = max(a.maxAbs, r.Metrics.MaxAbs)
			}
			if r.Status != StatusFail {
				continue
			}
			a.fails = append(a.fails, where)
			switch {
			case mode == Local && r.Stage == "kv_normed" && r.Metrics != nil && r.Metrics.Mismatch == 1 && r.Metrics.MaxULP == 1:
				nearTie[where] = true
			case mode == Propagated && nearTie[where]:
			default:
				t.Errorf("%s: %s %s: %s", mode, where, r.Stage, r.Reason)
			}
		}
		var names []string
		for n := range per {
			names = append(names, n)
		}
		sort.Strings(names)
		var b strings.Builder
		fmt.Fprintf(&b, "%s mode, %d steps x %d layers:\n", mode, len(d.Steps), d.Cfg.NLayers)
		for _, n := range names {
			a := per[n]
			fmt.Fprintf(&b, "  %-16s %3d/%3d results pass, %7d values, %8.4f %% bit-exact, max %d bf16 ulp, max |Δ| %.2g", n, a.pass, a.results, a.n, 100*float64(a.n-a.mismatch)/float64(max(a.n, 1)), a.maxULP, a.maxAbs)
			if len(a.fails) > 0 {
				fmt.Fprintf(&b, "; fail at %s", strings.Join(a.fails, ", "))
			}
			b.WriteString("\n")
		}
		t.Log(b.String())
		for _, want := range []string{"q_a", "cq", "q_b", "q", "kv_raw", "kv_normed", "kv", "window", "kv_cache", "o", "y",
			"cmp_a", "cmp_b", "cmp_raw", "cmp_latent", "ik_normed", "icache", "iq_b", "iw_raw", "cand_mask", "index_sel", "topk_idxs"} {
			if per[want] == nil || per[want].results == 0 {
				t.Errorf("%s: stage %s never compared", mode, want)
			}
		}
	}
}

// v41WholeRef is a test-local whole V4.1 step built from the reference's
// pieces: engine.V41Step (attention, layer by layer), engine.V41Block (the
// pipelined mHC), engine.V41Head, and a V4.1 MoE written here from the moe
// package's gate and SwiGLU with V4.1's differences (gate_temp, act blocks of
// 32, FP8 32×32 shared expert with swiglu_limit): the reference has no V4.1
// MoE or whole step yet, so this checks how far its pieces chain.
type v41WholeRef struct {
	cfg *engine.Config
	ws  *dump.Safetensors
	t   *testing.T
}

func (r v41WholeRef) f32(name string) []float32 {
	r.t.Helper()
	v, _, err := r.ws.Float32(name)
	if err != nil {
		r.t.Fatal(err)
	}
	return v
}

func (r v41WholeRef) raw(name string) []uint8 {
	r.t.Helper()
	rec, err := r.ws.Read(name)
	if err != nil || rec.DType != dump.U8 {
		r.t.Fatalf("%s: %v (%s)", name, err, rec.DType)
	}
	return rec.Data
}

func (r v41WholeRef) block(l int) *engine.V41BlockWeights {
	site := func(side string) *mhc.Site {
		p := fmt.Sprintf("layers.%d.hc_%s_", l, side)
		s := &mhc.Site{Mult: r.cfg.HCMult, Dim: r.cfg.Dim, Fn: r.f32(p + "fn"), Base: r.f32(p + "base"), Scale: r.f32(p + "scale")}
		s.Check()
		return s
	}
	return &engine.V41BlockWeights{AttnSite: site("attn"), FFNSite: site("ffn"),
		AttnNorm: r.f32(fmt.Sprintf("layers.%d.attn_norm.weight", l)), FFNNorm: r.f32(fmt.Sprintf("layers.%d.ffn_norm.weight", l))}
}

// fp4Linear: FP8 activation per 32 columns, E2M1 weight with UE8M0 per 1×32,
// block sums in fp32 (k ascending), scaled, added in a second fp32
// accumulator, bf16 out.
func (r v41WholeRef) fp4Linear(y, x []float32, name string, rows, cols int) {
	codes, scales := r.raw(name+".weight"), r.raw(name+".scale")
	qx, sx := make([]float32, cols), make([]float32, cols/32)
	quant.QuantizeActFP8(qx, sx, x, 32)
	nb := cols / 32
	for n := 0; n < rows; n++ {
		var acc float32
		for b := 0; b < nb; b++ {
			var blk float32
			for k := b * 32; k < (b+1)*32; k++ {
				blk += float32(qx[k] * quant.DecodeE2M1(codes[n*cols/2+k/2]>>(4*uint(k&1))))
			}
			acc += float32(float32(blk*sx[b]) * quant.DecodeUE8M0(scales[n*nb+b]))
		}
		y[n] = quant.BF16Round(acc)
	}
}

// moe is MoE.forward of V41-M for one token; it also returns the stages.
func (r v41WholeRef) moe(l int, x []float32) map[string]engine.Tensor {
	cfg := r.cfg
	dim, inter, E := cfg.Dim, cfg.MoEInterDim, cfg.NRoutedExperts
	p := fmt.Sprintf("layers.%d.ffn.", l)
	sc := make([]float32, E)
	attention.F32Linear(sc, x, r.f32(p+"gate.weight"), E, dim)
	for e := range sc {
		sc[e] /= float32(cfg.GateTemp)
	}
	moe.ApplyScoreFunc(sc, moe.ScoreFunc(cfg.ScoreFunc))
	bias := r.f32(p + "gate.bias")
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
	limit := float32(cfg.SwigluLimit)
	outs := make([]float32, len(idx)*dim)
	ii := make([]int64, len(idx))
	for k, e := range idx {
		ii[k] = int64(e)
		ep := fmt.Sprintf("%sexperts.%d.", p, e)
		g, u, h := make([]float32, inter), make([]float32, inter), make([]float32, inter)
		r.fp4Linear(g, x, ep+"w1", inter, dim)
		r.fp4Linear(u, x, ep+"w3", inter, dim)
		moe.SwiGLU(h, g, u, limit, w[k], true)
		r.fp4Linear(outs[k*dim:(k+1)*dim], h, ep+"w2", dim, inter)
	}
	fp8 := func(n string, rows, cols int) *attention.V41FP8Weight {
		return attention.NewV41FP8Weight(r.raw(p+"shared_experts."+n+".weight"), r.raw(p+"shared_experts."+n+".scale"), rows, cols)
	}
	g, u, h, sh := make([]float32, inter), make([]float32, inter), make([]float32, inter), make([]float32, dim)
	attention.V41FP8Linear(g, x, fp8("w1", inter, dim))
	attention.V41FP8Linear(u, x, fp8("w3", inter, dim))
	moe.SwiGLU(h, g, u, limit, 0, false)
	attention.V41FP8Linear(sh, h, fp8("w2", dim, inter))
	order := make([]int, len(idx))
	for k := range order {
		order[k] = k
	}
	sort.Slice(order, func(a, b int) bool { return idx[order[a]] < idx[order[b]] })
	y := make([]float32, dim)
	for _, k := range order {
		for i := range y {
			y[i] += outs[k*dim+i]
		}
	}
	for i := range y {
		y[i] = quant.BF16Round(y[i] + sh[i])
	}
	return map[string]engine.Tensor{
		"moe_indices": engine.FromI(engine.KindI64, ii, len(ii)), "moe_weights": engine.FromF(engine.KindF32, w, len(w)),
		"moe_expert_out": engine.FromF(engine.KindBF16, outs, len(idx), dim), "moe_shared_out": engine.FromF(engine.KindBF16, sh, dim),
		"ffn_out": engine.FromF(engine.KindBF16, y, dim),
	}
}

// TestV41WholeGoldenChained runs the whole decode step on the reference's
// pieces from the token alone — embed row, 8 blocks (attention by V41Step
// from the previous block's own output, the pipelined mHC, the MoE above),
// the head — and the decode state from the prefill state onwards on its own
// values (steps 12, 13, 14 chained), and compares every stage with the
// official forward's. The discrete decisions (expert ids, index and top-k
// lists, candidate mask) and the sampled token (argmax) must agree at every
// step and the logits stay within 5 % of their max; the per-stage agreement
// and each step's first stream stage that is not bit-exact are logged
// (1-ulp fp32 differences of the mixes flip bf16 roundings of the streams,
// which the chain carries on).
func TestV41WholeGoldenChained(t *testing.T) {
	d, err := LoadV41Dir(v41WholeGolden)
	if err != nil {
		t.Fatal(err)
	}
	cfg := d.Cfg
	ws, err := dump.OpenSafetensors(v41WholeGolden + "/weights.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	r := v41WholeRef{cfg: cfg, ws: ws, t: t}
	hc, dim := cfg.HCMult, cfg.Dim
	emb := r.f32("embed.weight")
	hw := &engine.V41HeadWeights{Norm: r.f32("norm.weight"), Head: r.f32("head.weight"), Vocab: cfg.VocabSize}
	type agg struct {
		n, diff int
		maxRel  float64
	}
	per := map[string]*agg{}
	cmp := func(stage string, got, want engine.Tensor) {
		a := per[stage]
		if a == nil {
			a = &agg{}
			per[stage] = a
		}
		if len(got.F) != len(want.F) || len(got.I) != len(want.I) {
			t.Errorf("%s: shapes %v / %v", stage, got.Shape, want.Shape)
			return
		}
		for i := range want.I {
			a.n++
			if got.I[i] != want.I[i] {
				a.diff++
				a.maxRel = math.Inf(1)
			}
		}
		var scale float64
		for _, v := range want.F {
			scale = math.Max(scale, math.Abs(float64(v)))
		}
		for i, w := range want.F {
			a.n++
			if math.Float32bits(got.F[i]) != math.Float32bits(w) {
				a.diff++
				if scale > 0 {
					a.maxRel = math.Max(a.maxRel, math.Abs(float64(got.F[i])-float64(w))/scale)
				}
			}
		}
	}
	st := d.Pre
	for _, p := range d.Steps {
		gs := d.step[p]
		tok := gs["token"].I[0]
		h0 := make([]float32, hc*dim)
		for j := 0; j < hc; j++ {
			copy(h0[j*dim:], emb[int(tok)*dim:(int(tok)+1)*dim])
		}
		h := engine.FromF(engine.KindBF16, h0, hc, dim)
		pre := engine.V41IdentityPreMix(hc)
		xs := make([]engine.Tensor, cfg.NLayers)
		var res *engine.V41StepResult
		first := ""
		for l := 0; l < cfg.NLayers; l++ {
			var ffnStages map[string]engine.Tensor
			attn := func(x engine.Tensor) (engine.Tensor, error) {
				xs[l] = x
				m := *d.Model
				m.Layers = slices.Clone(d.Model.Layers)
				for k := l + 1; k < cfg.NLayers; k++ {
					m.Layers[k] = nil
				}
				var err error
				if res, err = engine.V41Step(&m, st, xs, p, nil); err != nil {
					return engine.Tensor{}, err
				}
				return res.Stages[l]["y"], nil
			}
			ffn := func(x engine.Tensor) (engine.Tensor, error) {
				ffnStages = r.moe(l, x.F)
				return ffnStages["ffn_out"], nil
			}
			out, err := engine.V41Block(cfg, r.block(l), h, pre, attn, ffn)
			if err != nil {
				t.Fatal(err)
			}
			for _, src := range []map[string]engine.Tensor{out, ffnStages} {
				for n, v := range src {
					if want, ok := gs[fmt.Sprintf("L%d.%s", l, n)]; ok && (n != "ffn_out" || len(src) == len(ffnStages)) {
						cmp(n, v, want)
					}
				}
			}
			if first == "" {
				for _, n := range []string{"attn_norm_in", "x", "y", "h_mid", "ffn_norm_in", "ffn_in", "ffn_out", "h_out"} {
					if !slices.Equal(out[n].F, gs[fmt.Sprintf("L%d.%s", l, n)].F) {
						first = fmt.Sprintf("layer %d %s", l, n)
						break
					}
				}
			}
			h, pre = out["h_out"], out["pre_mix_out"].F
		}
		for l := 0; l < cfg.NLayers; l++ {
			for n, v := range res.Stages[l] {
				if want, ok := gs[fmt.Sprintf("L%d.%s", l, n)]; ok && n != "x" {
					cmp("attn:"+n, v, want)
				}
			}
		}
		out, err := engine.V41Head(cfg, hw, h, pre)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"head_in", "head_x", "logits"} {
			cmp(n, out[n], gs[n])
		}
		am := func(v []float32) int { return slices.Index(v, slices.Max(v)) }
		if a, b := am(out["logits"].F), am(gs["logits"].F); a != b {
			t.Errorf("step %d: the reference's argmax is %d, the official forward's %d", p, a, b)
		}
		t.Logf("step %d: the first bf16 stream stage not bit-exact: %s", p, first)
		st = res.Next
	}
	var names []string
	for n := range per {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	fmt.Fprintf(&b, "whole step chained from the tokens and the prefill state (%d steps x %d layers):\n", len(d.Steps), cfg.NLayers)
	for _, n := range names {
		a := per[n]
		fmt.Fprintf(&b, "  %-20s %7d values, %8.4f %% bit-exact, max |Δ|/max|golden| %.2g\n", n, a.n, 100*float64(a.n-a.diff)/float64(a.n), a.maxRel)
	}
	t.Log(b.String())
	for _, n := range []string{"moe_indices", "attn:topk_idxs", "attn:index_sel", "attn:cand_mask"} {
		if a := per[n]; a == nil || a.diff != 0 {
			t.Errorf("%s: a discrete decision differs (or was never compared) in the chained step", n)
		}
	}
	if a := per["logits"]; a == nil || a.maxRel > 0.05 {
		t.Errorf("logits drift beyond 5 %% of their max in the chained step")
	}
}
