package engine

import (
	"sort"
	"strings"
	"testing"
)

func TestSetPolicy(t *testing.T) {
	c, _ := Preset("tiny")
	if err := c.SetPolicy(PolicyHFEager); err == nil || !strings.Contains(err.Error(), "bf16 checkpoint") {
		t.Errorf("hf-eager on the FP8 checkpoint: %v", err)
	}
	if err := c.SetPolicy("mine"); err == nil {
		t.Error("unknown policy accepted")
	}
	c.DType = "bf16"
	if err := c.SetPolicy(PolicyHFEager); err != nil || c.PolicyName() != PolicyHFEager {
		t.Fatalf("hf-eager: %v (%s)", err, c.PolicyName())
	}
	if err := c.SetPolicy(""); err != nil || c.PolicyName() != PolicyOfficial {
		t.Fatalf("back to official: %v (%s)", err, c.PolicyName())
	}
}

// PolicyDiff names exactly the stages a policy changes: the five bf16 linears
// for a bf16 checkpoint, and HFEagerStages besides for hf-eager (at an
// emitting step of a CSA layer, where every one of them runs).
func TestPolicyDiff(t *testing.T) {
	c, _ := Preset("tiny")
	const l, p = 1, 255 // r = 4, (p+1) mod 4 == 0
	if d := PolicyDiff(c, l, p); len(d) != 0 {
		t.Fatalf("official FP8 differs from itself: %v", d)
	}
	c.DType = "bf16"
	lin := []string{"iq_b", "kv_raw", "q_a", "q_b", "y"}
	if got := diffNames(PolicyDiff(c, l, p)); strings.Join(got, ",") != strings.Join(lin, ",") {
		t.Errorf("bf16 checkpoint: %v, want %v", got, lin)
	}
	c.SetPolicy(PolicyHFEager)
	want := append([]string(nil), lin...)
	for n := range HFEagerStages() {
		want = append(want, n)
	}
	sort.Strings(want)
	if got := diffNames(PolicyDiff(c, l, p)); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("hf-eager: %v, want %v", got, want)
	}
	// every replaced stage runs on a synthetic step
	var sb strings.Builder
	if err := Explain(&sb, c, "tiny", l, p, 1, 2); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(sb.String(), "numerics policy hf-eager on a bf16 checkpoint: 27 stages differ") {
		t.Errorf("explain header:\n%s", sb.String()[:400])
	}
}

func diffNames(d []string) []string {
	var n []string
	for _, s := range d {
		n = append(n, s[:strings.IndexByte(s, ':')])
	}
	sort.Strings(n)
	return n
}

// TestHFProjectCompact: HF's bf16 compressor projections on a compressor
// whose weights are panels only (PreparedLayer.CompactCompressors) are the
// bits of those on its fp32 weights.
func TestHFProjectCompact(t *testing.T) {
	cfg, _ := Preset("tiny")
	for l := 0; l < cfg.NLayers; l++ {
		full, cw := RandomLayerWeights(cfg, l, 3), RandomLayerWeights(cfg, l, 3)
		if full.Compressor == nil {
			continue
		}
		Prepare(cfg, cw).CompactCompressors()
		in := map[string]Tensor{"x": SyntheticInput(cfg, 9, 4)}
		for _, idx := range []bool{false, true} {
			if idx && full.Indexer == nil {
				continue
			}
			for _, wantA := range []bool{false, true} {
				a, err := hfProject(idx, wantA)(&StepContext{Cfg: cfg, Layer: l, W: full}, in)
				if err != nil {
					t.Fatal(err)
				}
				b, err := hfProject(idx, wantA)(&StepContext{Cfg: cfg, Layer: l, W: cw}, in)
				if err != nil {
					t.Fatal(err)
				}
				if k := bitsEqual(a.F, b.F); k != -1 || len(a.F) == 0 {
					t.Fatalf("layer %d indexer %v a %v: differs at %d", l, idx, wantA, k)
				}
			}
		}
	}
}
