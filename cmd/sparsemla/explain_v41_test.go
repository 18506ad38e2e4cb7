package main

import (
	"bytes"
	"strings"
	"testing"

	"sparsemla/engine"
)

// TestExplainV41Tiny walks the V4.1 step of layer 7 (an index source using the
// candidate blocks of layer 5, reading layer 5's KV): both layers' stages are
// printed in order, with what each publishes and reads.
func TestExplainV41Tiny(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"explain", "--config", "v41-tiny", "--step", "11"}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	cfg, _ := engine.Preset("v41-tiny")
	text := out.String()
	at := 0
	for _, l := range []int{5, 7} {
		for _, def := range engine.V41Stages(cfg, l, 11) {
			i := strings.Index(text[at:], "\n"+def.Name+" ")
			if i < 0 {
				t.Fatalf("layer %d stage %s missing or out of order in:\n%s", l, def.Name, text)
			}
			at += i + 1
		}
	}
	for _, want := range []string{"layer 7: CSA2 r=1 (index source)", "reads: ckv ← layer 5, icache ← layer 5, cand_mask ← layer 5",
		"publishes: ckv, icache, cand_mask, index_sel", "index_score_masked", "−1 FIRST"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	var o2, e2 bytes.Buffer
	if code := run([]string{"explain", "--config", "v41-tiny", "--policy", "hf-eager"}, &o2, &e2); code != exitError || !strings.Contains(e2.String(), "V4.1 has only the official numerics") {
		t.Errorf("V4.1 with --policy hf-eager: exit %d, %q", code, e2.String())
	}
}

// TestSynthV41: synth --config v41-tiny writes a dump that replays clean; an
// injected window-order fault is named with its hypothesis (exit 1); a kind
// V4.1 does not implement is refused in one line (exit 2).
func TestSynthV41(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	if code := run([]string{"synth", "--config", "v41-tiny", "--steps", "3", "--out", dir + "/clean"}, &out, &errb); code != exitOK {
		t.Fatalf("synth: exit %d: %s", code, errb.String())
	}
	out.Reset()
	if code := run([]string{"replay", dir + "/clean"}, &out, &errb); code != exitOK || !strings.Contains(out.String(), "agree") {
		t.Errorf("replay clean: exit %d: %s", code, out.String())
	}
	if code := run([]string{"synth", "--config", "v41-tiny", "--steps", "3", "--fault", "window-order@7,6", "--out", dir + "/order"}, &out, &errb); code != exitOK {
		t.Fatalf("synth window-order: exit %d: %s", code, errb.String())
	}
	out.Reset()
	if code := run([]string{"replay", dir + "/order"}, &out, &errb); code != exitDiverged ||
		!strings.Contains(out.String(), `first divergence: decode step 7, layer 6, stage topk_idxs`) || !strings.Contains(out.String(), `hypothesis "v4-window-order"`) {
		t.Errorf("replay window-order: exit %d: %s", code, out.String())
	}
	errb.Reset()
	if code := run([]string{"synth", "--config", "v41-tiny", "--fault", "splitk-merge@7,1", "--out", dir + "/x"}, &out, &errb); code != exitError ||
		strings.Count(errb.String(), "\n") != 1 || !strings.Contains(errb.String(), "not implemented for DeepSeek-V4.1") {
		t.Errorf("synth splitk-merge on V4.1: exit %d, %q", code, errb.String())
	}
}
