package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/replay"
)

// TestReplayV41Golden: replay on the V4.1 GPU golden agrees in both modes,
// names the model and what it did not judge; --json writes the common
// schema; --steps restricts the steps (a step the dump lacks is an error);
// --tol-stage o=exact makes the 1-ulp o of the golden diverge; --mode
// chained and --policy hf-eager are refused in one line, a missing map file
// is an error.
func TestReplayV41Golden(t *testing.T) {
	dir := goldenTestdata("v41-tiny")
	for _, mode := range []string{"local", "propagated"} {
		var out, errb bytes.Buffer
		if code := run([]string{"replay", "--mode", mode, dir}, &out, &errb); code != exitOK {
			t.Fatalf("replay --mode %s: exit %d: %s%s", mode, code, out.String(), errb.String())
		}
		for _, want := range []string{"(" + mode + " mode): 4 steps x 8 layers, 470 stages compared: 470 pass", "model: DeepSeek-V4.1",
			"agree: 470 stage tensors compared, none out of tolerance"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("replay --mode %s output lacks %q:\n%s", mode, want, out.String())
			}
		}
		if strings.Contains(out.String(), "not judged") {
			t.Errorf("replay --mode %s: a tensor of the golden is not judged:\n%s", mode, out.String())
		}
	}
	var out, errb bytes.Buffer
	if code := run([]string{"replay", "--json", "--steps", "13-14", dir}, &out, &errb); code != exitOK {
		t.Fatalf("replay --json: exit %d: %s", code, errb.String())
	}
	var rep replay.Report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Schema != replay.SchemaVersion || rep.Model != "DeepSeek-V4.1" || rep.Verdict != replay.VerdictAgree ||
		len(rep.Steps) != 2 || rep.Steps[0] != 13 || rep.Steps[1] != 14 || rep.Summary.Pass != 235 || rep.First != nil {
		t.Errorf("replay --json: schema %q model %q verdict %q steps %v pass %d", rep.Schema, rep.Model, rep.Verdict, rep.Steps, rep.Summary.Pass)
	}
	var raw map[string]any
	_ = json.Unmarshal(out.Bytes(), &raw)
	for _, k := range []string{"schema", "command", "dump", "mode", "model", "steps", "layers", "verdict", "summary", "coverage", "first_divergence", "stages"} {
		if _, ok := raw[k]; !ok {
			t.Errorf("replay --json lacks %q", k)
		}
	}
	errb.Reset()
	if code := run([]string{"replay", "--steps", "3", dir}, &out, &errb); code != exitError || !strings.Contains(errb.String(), "the dump holds steps 12..15") {
		t.Errorf("replay --steps 3: exit %d, %q", code, errb.String())
	}
	out.Reset()
	if code := run([]string{"replay", "--tol-stage", "o=exact", dir}, &out, &errb); code != exitDiverged ||
		!strings.Contains(out.String(), "stage o — attention kernel: 1 of 2048 values differ (exact stage)") {
		t.Errorf("replay --tol-stage o=exact: exit %d: %s", code, out.String())
	}
	for _, c := range []struct {
		flags []string
		want  string
	}{{[]string{"--map", "x.json"}, "x.json"}, {[]string{"--mode", "chained"}, "not implemented for DeepSeek-V4.1"},
		{[]string{"--policy", "hf-eager"}, "one numerics policy"}} {
		errb.Reset()
		if code := run(append([]string{"replay"}, append(c.flags, dir)...), &out, &errb); code != exitError ||
			strings.Count(errb.String(), "\n") != 1 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("replay %v on V4.1: exit %d, %q", c.flags, code, errb.String())
		}
	}
}

// TestV41Commands: report (HTML), diff and bisect on a synthetic V4.1 dump
// and a copy with a window-order fault at step 9, layer 3: the clean dump
// agrees, the faulty one is named exactly (diff with the reference as
// referee saying A is right), bisect gives the replay's answer.
func TestV41Commands(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	for _, c := range [][]string{{"--out", dir + "/s"}, {"--out", dir + "/w", "--fault", "window-order@9,3"}} {
		if code := run(append([]string{"synth", "--config", "v41-tiny"}, c...), &out, &errb); code != exitOK {
			t.Fatalf("synth %v: exit %d: %s", c, code, errb.String())
		}
	}
	const first = "first divergence: decode step 9, layer 3, stage topk_idxs — index list:"
	out.Reset()
	if code := run([]string{"report", dir + "/w", "--html", dir + "/w.html"}, &out, &errb); code != exitDiverged || !strings.Contains(out.String(), first) {
		t.Errorf("report: exit %d: %s", code, out.String())
	}
	if b, err := os.ReadFile(filepath.Join(dir, "w.html")); err != nil || !bytes.Contains(b, []byte("topk_idxs")) || !bytes.Contains(b, []byte(`<img src="data:image/svg`)) {
		t.Errorf("report page: %v (%d bytes)", err, len(b))
	}
	out.Reset()
	if code := run([]string{"report", dir + "/s", "--html", dir + "/s.html"}, &out, &errb); code != exitOK || !strings.Contains(out.String(), "(agree)") {
		t.Errorf("report clean: exit %d: %s", code, out.String())
	}
	out.Reset()
	if code := run([]string{"diff", dir + "/s", dir + "/w"}, &out, &errb); code != exitDiverged || !strings.Contains(out.String(), first) ||
		!strings.Contains(out.String(), "the reference agrees with A: B is wrong here") || !strings.Contains(out.String(), "A is right") {
		t.Errorf("diff: exit %d: %s%s", code, out.String(), errb.String())
	}
	out.Reset()
	if code := run([]string{"diff", dir + "/s", dir + "/s"}, &out, &errb); code != exitOK || !strings.Contains(out.String(), "both are right") {
		t.Errorf("diff clean: exit %d: %s", code, out.String())
	}
	errb.Reset()
	if code := run([]string{"diff", goldenTestdata("v41-tiny"), dir + "/s"}, &out, &errb); code != exitError || !strings.Contains(errb.String(), "different models") {
		t.Errorf("diff golden synth: exit %d: %q", code, errb.String())
	}
	out.Reset()
	if code := run([]string{"bisect", dir + "/w"}, &out, &errb); code != exitDiverged || !strings.Contains(out.String(), first) ||
		!strings.Contains(out.String(), `hypothesis "v4-window-order"`) {
		t.Errorf("bisect: exit %d: %s", code, out.String())
	}
	out.Reset()
	if code := run([]string{"bisect", "--json", dir + "/s"}, &out, &errb); code != exitOK {
		t.Errorf("bisect clean: exit %d: %s", code, out.String())
	}
	var rep replay.Report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil || rep.Command != "bisect" || rep.StepsReplayed != 8 || len(rep.Probes) == 0 {
		t.Errorf("bisect --json: %v %+v", err, rep.Probes)
	}
}

// TestFaultV41In: fault --in on the V4.1 golden writes a copy that replays to
// exactly the injected step, layer, stage and hypothesis; a kind V4.1 does
// not have and a layer where the kind does not apply are refused in one
// line; the golden itself is not changed (it still agrees).
func TestFaultV41In(t *testing.T) {
	g := goldenTestdata("v41-tiny")
	dir := t.TempDir()
	var out, errb bytes.Buffer
	if code := run([]string{"fault", "--in", g, "--out", dir + "/t", "--fault", "topk-off-by-one@14,2"}, &out, &errb); code != exitOK {
		t.Fatalf("fault: exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "changed: p14/L2: index_sel, topk_idxs, o, y; p14/L3: topk_idxs, o, y; p14/L4: topk_idxs, o, y") {
		t.Errorf("fault output: %s", out.String())
	}
	out.Reset()
	if code := run([]string{"replay", dir + "/t"}, &out, &errb); code != exitDiverged ||
		!strings.Contains(out.String(), "1 fail;") ||
		!strings.Contains(out.String(), "first divergence: decode step 14, layer 2, stage index_sel — indexer selection:") ||
		!strings.Contains(out.String(), `hypothesis "topk-off-by-one"`) {
		t.Errorf("replay faulted copy: exit %d: %s", code, out.String())
	}
	for _, c := range []struct{ flt, want string }{
		{"wrong-lse@13,2", "fault wrong-lse@13,2: not implemented for DeepSeek-V4.1 dumps"},
		{"topk-off-by-one@13,3", "layer 3 runs no indexer"},
	} {
		errb.Reset()
		if code := run([]string{"fault", "--in", g, "--out", dir + "/x", "--fault", c.flt}, &out, &errb); code != exitError ||
			strings.Count(errb.String(), "\n") != 1 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("fault %s: exit %d, %q", c.flt, code, errb.String())
		}
	}
	// A fault at the last step: bisect's first probe diverges, the search
	// narrows to it, and the answer is the replay's.
	if code := run([]string{"fault", "--in", g, "--out", dir + "/w", "--fault", "window-order@15,0"}, &out, &errb); code != exitOK {
		t.Fatalf("fault window-order: exit %d: %s", code, errb.String())
	}
	out.Reset()
	if code := run([]string{"bisect", dir + "/w"}, &out, &errb); code != exitDiverged ||
		!strings.Contains(out.String(), "probes: step 15 diverged, step 13 agrees, step 14 agrees; then scanned steps 12)") ||
		!strings.Contains(out.String(), "first divergence: decode step 15, layer 0, stage topk_idxs") {
		t.Errorf("bisect: exit %d: %s", code, out.String())
	}
	out.Reset()
	if code := run([]string{"replay", g}, &out, &errb); code != exitOK {
		t.Errorf("golden after fault: exit %d: %s", code, out.String())
	}
}
