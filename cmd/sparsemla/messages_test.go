package main

import (
	"strings"
	"testing"

	"sparsemla/replay"
)

// fault's "changed" list names the head as the head, not as layer -1.
func TestStageKeysHead(t *testing.T) {
	got := stageKeys([]replay.StageKey{{Step: 12, Layer: -1, Stage: "logits"}, {Step: 12, Layer: 3, Stage: "h_out"}, {Step: 12, Layer: 3, Stage: "kv_cache"},
		{Step: 13, Layer: -1, Stage: "logits"}, {Step: 13, Layer: 0, Stage: "o"}})
	if want := "p12/L3: h_out, kv_cache; p12/head: logits; p13/L0: o; p13/head: logits"; got != want {
		t.Errorf("stageKeys = %q, want %q", got, want)
	}
}

// One step is "1 step", in the text, the verdict and the HTML page.
func TestOneStepGrammar(t *testing.T) {
	code, out, e := rpRun("replay", "--steps", "3", goldenTestdata("official-v4-tiny"))
	if code != exitOK || strings.Contains(out, "1 steps") || strings.Count(out, "1 step x 4 layers") != 2 {
		t.Errorf("exit %d\n%s%s", code, out, e)
	}
}
