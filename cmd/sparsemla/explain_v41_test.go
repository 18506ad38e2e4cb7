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

// TestV41CommandsRefused: synth and prefix refuse a V4.1 preset with the
// reason (exit 2) rather than running V4's rules on it.
func TestV41CommandsRefused(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"synth", "--config", "v41-tiny", "--out", t.TempDir() + "/s"}, &out, &errb); code != exitError || !strings.Contains(errb.String(), "DeepSeek-V4.1") {
		t.Errorf("synth --config v41-tiny: exit %d, %q", code, errb.String())
	}
}

// TestReplayV41Golden: replay on the V4.1 GPU golden agrees in both modes and
// says what it compared; V4-only flags are refused.
func TestReplayV41Golden(t *testing.T) {
	dir := goldenTestdata("v41-tiny")
	for _, mode := range []string{"local", "propagated"} {
		var out, errb bytes.Buffer
		if code := run([]string{"replay", "--mode", mode, dir}, &out, &errb); code != exitOK {
			t.Fatalf("replay --mode %s: exit %d: %s%s", mode, code, out.String(), errb.String())
		}
		for _, want := range []string{"DeepSeek-V4.1, " + mode, "compared: cand_mask", "agree: every compared stage"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("replay --mode %s output lacks %q:\n%s", mode, want, out.String())
			}
		}
	}
	var out, errb bytes.Buffer
	if code := run([]string{"replay", "--json", dir}, &out, &errb); code != exitError || !strings.Contains(errb.String(), "--json: not implemented for DeepSeek-V4.1") {
		t.Errorf("replay --json on V4.1: exit %d, %q", code, errb.String())
	}
}
