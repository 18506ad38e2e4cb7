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
