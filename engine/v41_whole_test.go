package engine

import (
	"testing"
)

// TestV41WholeStepComposes: the whole step of a synthetic v41-tiny model
// is, layer by layer, V41Block (the pipelined mHC reference checked against
// testdata/v41-mhc) around the attention sub-layer that V41Step computes
// from the whole step's x and the MoE's Forward, with the head V41Head on the
// last layer's h_out and hc_ffn_pre: two independent compositions of the same
// pieces, compared bit for bit; and the clamp acts somewhere (the synthetic
// MoE reaches swiglu_limit).
func TestV41WholeStepComposes(t *testing.T) {
	cfg, err := Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	const p = 9
	m := NewRandomV41WholeModel(cfg, 3, p+1)
	if !m.Whole() {
		t.Fatal("NewRandomV41WholeModel is not whole")
	}
	st := SyntheticV41State(m, p, 3)
	const tok = 77
	res, err := V41WholeStep(m, st, tok, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	xs := make([]Tensor, cfg.NLayers)
	for l := range xs {
		xs[l] = res.Stages[l]["x"]
	}
	att, err := V41Step(m, st, xs, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := res.Stages[0]["h_in"]
	for j := 0; j < cfg.HCMult; j++ {
		for i := 0; i < cfg.Dim; i++ {
			if h.F[j*cfg.Dim+i] != m.Head.Embed[tok*cfg.Dim+i] {
				t.Fatalf("h_in[%d][%d] is not embed[tok]", j, i)
			}
		}
	}
	pre := V41IdentityPreMix(cfg.HCMult)
	clamped := false
	for l := 0; l < cfg.NLayers; l++ {
		w := m.Layers[l]
		attn := func(x Tensor) (Tensor, error) { return att.Stages[l]["y"], nil }
		ffn := func(x Tensor) (Tensor, error) {
			r, err := w.MoE.Forward(x.F, false)
			if acts, _, _ := w.MoE.ClampActs(x.F, r.Indices); acts {
				clamped = true
			}
			return bf16T(r.Out, len(r.Out)), err
		}
		blk, err := V41Block(cfg, w.Block, h, pre, attn, ffn)
		if err != nil {
			t.Fatal(err)
		}
		for name, ref := range blk {
			if name == "pre_mix_out" {
				name = "hc_ffn_pre"
			}
			got, ok := res.Stages[l][name]
			if !ok || !v41TestSame(ref, got) {
				t.Errorf("layer %d %s: the whole step differs from V41Block", l, name)
			}
		}
		for name, ref := range att.Stages[l] {
			if !v41TestSame(ref, res.Stages[l][name]) {
				t.Errorf("layer %d %s: the whole step's attention differs from V41Step on its x", l, name)
			}
		}
		h, pre = blk["h_out"], blk["pre_mix_out"].F
	}
	hd, err := V41Head(cfg, m.Head, h, pre)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"head_in", "head_x", "logits"} {
		if !v41TestSame(hd[n], res.Global[n]) {
			t.Errorf("%s differs from V41Head", n)
		}
	}
	best := 0
	for i, v := range hd["logits"].F {
		if v > hd["logits"].F[best] {
			best = i
		}
	}
	if res.Global["next_token"].I[0] != int64(best) {
		t.Errorf("next_token %v, argmax %d", res.Global["next_token"].I, best)
	}
	for l := range res.Stages {
		var mx float32
		for _, v := range res.Stages[l]["h_out"].F {
			mx = max(mx, v, -v)
		}
		if !(mx < 1e4) {
			t.Errorf("layer %d: max |h_out| = %g: the synthetic magnitudes run away", l, mx)
		}
		t.Logf("layer %d: max |h_out| %g, moe %v %v", l, mx, res.Stages[l]["moe_indices"].I, res.Stages[l]["moe_weights"].F)
	}
	if !clamped {
		t.Error("the synthetic MoE never reaches swiglu_limit: the clamp is not exercised")
	}
	if _, err := V41WholeStep(NewRandomV41Model(cfg, 3, p+1), st, tok, p, nil); err == nil {
		t.Error("V41WholeStep ran a model of the attention sub-layer only")
	}
	if _, err := V41WholeStep(m, st, int64(cfg.VocabSize), p, nil); err == nil {
		t.Error("a token id outside the vocabulary was accepted")
	}
}

func v41TestSame(a, b Tensor) bool {
	if len(a.F) != len(b.F) || len(a.I) != len(b.I) {
		return false
	}
	for i := range a.F {
		if a.F[i] != b.F[i] && !(a.F[i] != a.F[i] && b.F[i] != b.F[i]) {
			return false
		}
	}
	for i := range a.I {
		if a.I[i] != b.I[i] {
			return false
		}
	}
	return true
}
