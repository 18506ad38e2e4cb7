package main

import (
	"bytes"
	"strings"
	"testing"

	"sparsemla/engine"
)

// TestExplainTiny runs the teaching walk on the tiny config at an emitting CSA
// step and checks that every stage of the step is printed in spec order.
func TestExplainTiny(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"explain", "--config", "tiny", "--layer", "1", "--step", "7"}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	cfg, _ := engine.Preset("tiny")
	text := out.String()
	at := 0
	for _, def := range engine.Stages(cfg, 1, 7) {
		i := strings.Index(text[at:], "\n"+def.Name+" ")
		if i < 0 {
			t.Fatalf("stage %s missing or out of order in:\n%s", def.Name, text)
		}
		at += i + 1
	}
	for _, want := range []string{"CSA", "completes compressed row 1", "Sparse attention"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

func TestExplainBadFlags(t *testing.T) {
	for _, args := range [][]string{{"--config", "huge"}, {"--step", "0"}, {"--layer", "9"}, {"extra"},
		{"--values", "-1"}, {"--values", "0"}, {"--policy", "fast"}, {"--config", "v41-tiny", "--policy", "bf16"}} {
		var out, errb bytes.Buffer
		if code := run(append([]string{"explain"}, args...), &out, &errb); code != exitError {
			t.Errorf("explain %v: exit %d, want %d", args, code, exitError)
		}
		if e := errb.String(); !strings.HasPrefix(e, "sparsemla explain: ") || strings.Count(e, "\n") != 1 || out.Len() != 0 {
			t.Errorf("explain %v: want one error line 'sparsemla explain: …' and no output, got %q / %q", args, e, clip(out.String()))
		}
	}
}
