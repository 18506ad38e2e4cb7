package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/engine"
)

// TestExplainV32 walks one V3.2 step: every V3.2 stage in order, no V4 stage.
func TestExplainV32(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"explain", "--config", "v32-tiny", "--step", "20"}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	cfg, _ := engine.Preset("v32-tiny")
	text := out.String()
	at := 0
	for _, def := range engine.V32Stages(cfg, 0, 20) {
		i := strings.Index(text[at:], "\n"+def.Name+" ")
		if i < 0 {
			t.Fatalf("stage %s missing or out of order in:\n%s", def.Name, text)
		}
		at += i + 1
	}
	for _, want := range []string{"DeepSeek-V3.2", "Sparse MLA attention", "top-16", "YaRN"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for _, v4 := range []string{"\nkv_cache ", "\ntopk_idxs ", "\nhc_attn_"} {
		if strings.Contains(text, v4) {
			t.Errorf("V3.2 walk prints the V4 stage %q", v4)
		}
	}
	var o2, e2 bytes.Buffer
	if code := run([]string{"explain", "--config", "v32-tiny", "--policy", "hf-eager"}, &o2, &e2); code != exitError {
		t.Errorf("explain --policy hf-eager on V3.2: exit %d, want %d", code, exitError)
	}
}

// TestSynthReplayV32 is the command-line round trip: synth a clean v32-tiny
// dump (replay exits 0) and one with a fault (replay exits 1 naming it);
// a kind V3.2 does not have is refused with exit 2.
func TestSynthReplayV32(t *testing.T) {
	dir := t.TempDir()
	clean, bad := filepath.Join(dir, "clean"), filepath.Join(dir, "bad")
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"synth", "--config", "v32-tiny", "--out", clean, "--prefill", "16", "--steps", "3"}, exitOK, "v32-tiny"},
		{[]string{"replay", clean}, exitOK, "agree"},
		{[]string{"replay", "--mode", "propagated", clean}, exitOK, "agree"},
		{[]string{"synth", "--config", "v32-tiny", "--out", bad, "--prefill", "16", "--steps", "3", "--fault", "topk-off-by-one@17,1"}, exitOK, "index_topk"},
		{[]string{"replay", bad}, 1, "first divergence: decode step 17, layer 1, stage index_topk — indexer selection"},
		{[]string{"synth", "--config", "v32-tiny", "--out", filepath.Join(dir, "no"), "--fault", "wrong-lse@7,1"}, exitError, "no attention sink"},
	} {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		if code != c.code || !strings.Contains(out.String()+errb.String(), c.want) {
			t.Fatalf("%v: exit %d (want %d), output lacks %q:\n%s%s", c.args, code, c.code, c.want, out.String(), errb.String())
		}
	}
}

// TestV32WholeCommands: the FFN side and the chained mode from the command
// line: synth --whole with a FFN fault replays to it in every mode;
// 'fault --in' the GPU golden with one is named; the golden replays clean
// chained over the steps that dump the whole layer and is refused (exit 2,
// saying which steps) over all of them.
func TestV32WholeCommands(t *testing.T) {
	dir := t.TempDir()
	bad, copyDir := filepath.Join(dir, "bad"), filepath.Join(dir, "copy")
	golden := filepath.Join("..", "..", "testdata", "v32-tiny")
	name := "first divergence: decode step 15, layer 1, stage ffn_out — MoE experts: shared expert"
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"synth", "--config", "v32-tiny", "--whole", "--out", bad, "--prefill", "14", "--steps", "3", "--fault", "shared-gate-up-swapped@15,1"}, exitOK, "ffn_out"},
		{[]string{"replay", bad}, 1, name},
		{[]string{"replay", "--mode", "propagated", bad}, 1, name},
		{[]string{"replay", "--mode", "chained", bad}, 1, name},
		{[]string{"replay", "--mode", "chained", "--reference", bad}, 1, name},
		{[]string{"fault", "--in", golden, "--out", copyDir, "--fault", "head-no-norm@12,1"}, exitOK, "logits"},
		{[]string{"replay", copyDir}, 1, `stage logits — head: final norm`},
		{[]string{"replay", "--mode", "chained", "--steps", "10-13", golden}, exitOK, "agree"},
		{[]string{"replay", "--mode", "chained", golden}, exitError, "lacks it at steps 14..21"},
		{[]string{"fault", "--in", golden, "--out", filepath.Join(dir, "no"), "--fault", "expert-nibble@10,1"}, exitError, "experts are FP8"},
	} {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		if code != c.code || !strings.Contains(out.String()+errb.String(), c.want) {
			t.Fatalf("%v: exit %d (want %d), output lacks %q:\n%s%s", c.args, code, c.code, c.want, out.String(), errb.String())
		}
	}
}

// An attention-kernel divergence of a V3.2 dump (o_latent) gets a V3.2 hint:
// the sparse MLA kernel, no attention sink (V4's hint folds a sink into the
// LSE, which V3.2 does not have).
func TestV32AttentionHint(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "v32")
	if code, o, e := rpRun("synth", "--config", "v32-tiny", "--out", dir, "--steps", "3", "--fault", "splitk-merge@7,1"); code != exitOK {
		t.Fatalf("synth: exit %d\n%s%s", code, o, e)
	}
	code, out, e := rpRun("replay", dir)
	_, hint, _ := strings.Cut(out, "\n  hint: ")
	hint, _, _ = strings.Cut(hint, "\n")
	if code != exitDiverged || !strings.Contains(out, "stage o_latent — attention kernel") ||
		!strings.Contains(hint, "sparse MLA") || !strings.Contains(hint, "no attention sink") || strings.Contains(hint, "sink folded") {
		t.Errorf("exit %d, hint %q\n%s%s", code, hint, out, e)
	}
}
