package engine

import (
	"fmt"
	"math"
	"testing"

	"sparsemla/dump"
	"sparsemla/mhc"
	"sparsemla/quant"
)

// v41MHCDir is the torch golden of V4.1's pipelined mHC (testdata/v41-mhc/README.md).
const v41MHCDir = "../testdata/v41-mhc"

func v41MHCRead(t *testing.T, st *dump.Safetensors, name string) []float32 {
	t.Helper()
	v, _, err := st.Float32(name)
	if err != nil {
		t.Fatalf("%s: %s: %v", st.Path, name, err)
	}
	return v
}

func v41MHCGolden(t *testing.T) (cfg *Config, w, s *dump.Safetensors) {
	return v41MHCGoldenFile(t, "stages")
}

// v41MHCGoldenFile opens the weights and one stage file: "stages" (the CPU
// torch transcription) or "stages_gpu" (the official Block.forward on an
// H200).
func v41MHCGoldenFile(t *testing.T, stages string) (cfg *Config, w, s *dump.Safetensors) {
	t.Helper()
	cfg, err := Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []**dump.Safetensors{&w, &s} {
		name := "weights"
		if p == &s {
			name = stages
		}
		st, err := dump.OpenSafetensors(v41MHCDir + "/" + name + ".safetensors")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		*p = st
	}
	return cfg, w, s
}

func v41MHCWeights(t *testing.T, cfg *Config, w *dump.Safetensors, l int) *V41BlockWeights {
	site := func(side string) *mhc.Site {
		p := fmt.Sprintf("layers.%d.hc_%s_", l, side)
		s := &mhc.Site{Mult: cfg.HCMult, Dim: cfg.Dim, Fn: v41MHCRead(t, w, p+"fn"), Base: v41MHCRead(t, w, p+"base"), Scale: v41MHCRead(t, w, p+"scale")}
		s.Check()
		return s
	}
	return &V41BlockWeights{AttnSite: site("attn"), FFNSite: site("ffn"),
		AttnNorm: v41MHCRead(t, w, fmt.Sprintf("layers.%d.attn_norm.weight", l)),
		FFNNorm:  v41MHCRead(t, w, fmt.Sprintf("layers.%d.ffn_norm.weight", l))}
}

// v41Scale is the golden's stand-in sub-layer: out = bf16(x ⊙ c).
func v41Scale(c []float32) V41SubLayer {
	return func(x Tensor) (Tensor, error) {
		v := x.F
		out := make([]float32, len(v))
		for i := range v {
			out[i] = quant.BF16Round(v[i] * c[i])
		}
		return bf16T(out, len(out)), nil
	}
}

// v41Ulp32 is the distance of two fp32 values in units in the last place.
func v41Ulp32(a, b float32) int64 {
	ord := func(f float32) int64 {
		u := int64(math.Float32bits(f))
		if u&(1<<31) != 0 {
			return -(u &^ (1 << 31))
		}
		return u
	}
	d := ord(a) - ord(b)
	if d < 0 {
		d = -d
	}
	return d
}

// v41Compare fails when got and want differ anywhere by more than
// rel·max_i|want_i| (rel 0: bit-exact) and returns the largest difference
// over max_i|want_i|.
func v41Compare(t *testing.T, name string, got, want []float32, rel float64) float64 {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, golden %d", name, len(got), len(want))
	}
	var scale float64
	for _, v := range want {
		scale = math.Max(scale, math.Abs(float64(v)))
	}
	var worst float64
	for i := range got {
		d := math.Abs(float64(got[i]) - float64(want[i]))
		if rel == 0 && math.Float32bits(got[i]) != math.Float32bits(want[i]) || d > rel*scale {
			t.Errorf("%s[%d] = %g, golden %g (|d| = %.3g, allowed %.3g)", name, i, got[i], want[i], d, rel*scale)
			return d / scale
		}
		worst = math.Max(worst, d/scale)
	}
	return worst
}

// TestV41MHCGolden replays the goldens of the pipelined mHC (two blocks and
// the head; the CPU torch transcription and the official Block.forward on an
// H200) from the first streams alone: every block stage and the logits,
// chained on the reference's own values. bf16 stages must agree bit for bit;
// the fp32 mixes, pre, post, comb and logits within 1e-5 of the stage's max
// |value| (torch's GEMMs sum in another order).
func TestV41MHCGolden(t *testing.T) {
	for _, f := range []string{"stages", "stages_gpu"} {
		t.Run(f, func(t *testing.T) { testV41MHCGolden(t, f) })
	}
}

func testV41MHCGolden(t *testing.T, file string) {
	cfg, w, s := v41MHCGoldenFile(t, file)
	h := FromF(KindBF16, v41MHCRead(t, s, "global.h0"), cfg.HCMult, cfg.Dim)
	pre := V41IdentityPreMix(cfg.HCMult)
	// fp32 stages: torch's blocked GEMM sums the 1024-term mixes in another
	// order, which the Sinkhorn carries into pre/post/comb; bf16 stages exact.
	const fp32Rel = 1e-5
	tol := map[string]float64{"hc_attn_mixes": fp32Rel, "hc_ffn_mixes": fp32Rel, "hc_attn_pre": fp32Rel, "hc_ffn_pre": fp32Rel, "hc_attn_post": fp32Rel, "hc_ffn_post": fp32Rel,
		"hc_attn_comb": fp32Rel, "hc_ffn_comb": fp32Rel, "pre_mix_out": fp32Rel, "pre_mix_in": fp32Rel}
	for l := 0; l < 2; l++ {
		bw := v41MHCWeights(t, cfg, w, l)
		out, err := V41Block(cfg, bw, h, pre, v41Scale(v41MHCRead(t, w, fmt.Sprintf("layers.%d.sub.ca", l))), v41Scale(v41MHCRead(t, w, fmt.Sprintf("layers.%d.sub.cf", l))))
		if err != nil {
			t.Fatal(err)
		}
		a, m, f := V41BlockStages(cfg)
		names := []string{"h_in", "pre_mix_in", "y", "ffn_out"}
		for _, defs := range [][]V41BlockStageDef{a, m, f} {
			for _, d := range defs {
				names = append(names, d.Name)
			}
		}
		for _, n := range names {
			worst := v41Compare(t, fmt.Sprintf("L%d.%s", l, n), out[n].F, v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, n)), tol[n])
			if worst > 0 {
				t.Logf("L%d.%s: max |d| / max|golden| = %.2g", l, n, worst)
			}
		}
		h, pre = out["h_out"], out["pre_mix_out"].F
	}
	hw := &V41HeadWeights{Norm: v41MHCRead(t, w, "norm.weight"), Head: v41MHCRead(t, w, "head.weight"), Vocab: 64}
	out, err := V41Head(cfg, hw, h, pre)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"head_in", "head_x", "logits"} {
		tl := 0.0
		if n == "logits" {
			tl = fp32Rel
		}
		if worst := v41Compare(t, n, out[n].F, v41MHCRead(t, s, "global."+n), tl); worst > 0 {
			t.Logf("%s: max |d| / max|golden| = %.2g", n, worst)
		}
	}
}

// TestV41MHCGoldenDiscriminates shows the golden tells V4.1's mHC from V4's:
// collapsing a sub-layer's input with its own site's pre-mix (V4's order), or
// taking V4's norm_eps 1e-6 in the rsqrt, does not reproduce it.
func TestV41MHCGoldenDiscriminates(t *testing.T) {
	cfg, w, s := v41MHCGolden(t)
	hc, dim := cfg.HCMult, cfg.Dim
	differs := func(a, b []float32) bool {
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				return true
			}
		}
		return false
	}
	for l := 0; l < 2; l++ {
		for _, c := range []struct{ stage, in, ownPre string }{{"attn_norm_in", "h_in", "hc_attn_pre"}, {"ffn_norm_in", "h_mid", "hc_ffn_pre"}} {
			x := make([]float32, dim)
			mhc.Collapse(x, v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, c.in)), v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, c.ownPre)))
			if !differs(x, v41MHCRead(t, s, fmt.Sprintf("L%d.%s", l, c.stage))) {
				t.Errorf("L%d.%s: V4's order (collapse with %s) reproduces the golden", l, c.stage, c.ownPre)
			}
		}
	}
	bw := v41MHCWeights(t, cfg, w, 0)
	h := v41MHCRead(t, s, "L0.h_in")
	want := v41MHCRead(t, s, "L0.hc_attn_mixes")
	m := make([]float32, mhc.NMixes(hc))
	bw.AttnSite.Mixes(m, h, 1e-6)
	var worst, scale float64
	for i := range m {
		worst = math.Max(worst, math.Abs(float64(m[i]-want[i])))
		scale = math.Max(scale, math.Abs(float64(want[i])))
	}
	if worst <= 1e-4*scale {
		t.Errorf("hc_attn_mixes with norm_eps 1e-6 is within %.2g of the golden's (rel 1e-4): the golden does not show the eps", worst/scale)
	}
	t.Logf("norm_eps 1e-6 instead of 1e-20 moves hc_attn_mixes by %.2g of its max", worst/scale)
}

// TestV41BlockLayer0OneHot: at layer 0 the one-hot pre-mix makes the
// attention input copy 0 of the streams, bit for bit.
func TestV41BlockLayer0OneHot(t *testing.T) {
	cfg, _ := Preset("v41-tiny")
	hc, dim := cfg.HCMult, cfg.Dim
	h := make([]float32, hc*dim)
	for i := range h {
		h[i] = quant.BF16Round(float32(math.Sin(float64(i)*0.37)) * 0.05)
	}
	id := func(x Tensor) (Tensor, error) { return x.Clone(), nil }
	out, err := V41Block(cfg, RandomV41BlockWeights(cfg, 0, 1), bf16T(h, hc, dim), V41IdentityPreMix(hc), id, id)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < dim; i++ {
		if out["attn_norm_in"].F[i] != h[i] {
			t.Fatalf("attn_norm_in[%d] = %g, want h_in[0][%d] = %g", i, out["attn_norm_in"].F[i], i, h[i])
		}
	}
	for j, v := range out["pre_mix_out"].F {
		if v != out["hc_ffn_pre"].F[j] {
			t.Fatalf("pre_mix_out[%d] = %g, hc_ffn_pre %g", j, v, out["hc_ffn_pre"].F[j])
		}
	}
	if _, err := V41Block(cfg, RandomV41BlockWeights(cfg, 0, 1), bf16T(h, hc, dim), []float32{1}, id, id); err == nil {
		t.Fatal("a pre_mix of the wrong length was accepted")
	}
}
