package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

func rpRun(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := run(args, &out, &errb)
	return code, out.String(), errb.String()
}

// rpDumps writes one clean and one faulty synthetic dump into a test
// directory (synth is fast: a fraction of a second each).
func rpDumps(t *testing.T) (clean, bad string) {
	t.Helper()
	dir := t.TempDir()
	clean, bad = filepath.Join(dir, "clean"), filepath.Join(dir, "bad")
	if code, _, e := rpRun("synth", "--out", clean, "--steps", "6", "--seed", "4"); code != 0 {
		t.Fatal("synth clean: " + e)
	}
	if code, _, e := rpRun("synth", "--out", bad, "--steps", "6", "--seed", "4", "--fault", "wrong-lse@8,2"); code != 0 {
		t.Fatal("synth bad: " + e)
	}
	return clean, bad
}

func TestReplayCommandExitCodes(t *testing.T) {
	clean, bad := rpDumps(t)
	if code, out, e := rpRun("replay", clean); code != exitOK || !strings.Contains(out, "agree") {
		t.Fatalf("clean: exit %d\n%s%s", code, out, e)
	}
	code, out, e := rpRun("replay", bad)
	if code != exitDiverged {
		t.Fatalf("faulty: exit %d\n%s%s", code, out, e)
	}
	want := "first divergence: decode step 8, layer 2, stage o — attention kernel"
	if !strings.Contains(out, want) {
		t.Fatalf("faulty output lacks %q:\n%s", want, out)
	}
	if code, _, _ := rpRun("replay", "--mode", "propagated", clean); code != exitOK {
		t.Fatalf("propagated clean: exit %d", code)
	}
}

func TestReplayCommandErrors(t *testing.T) {
	clean, _ := rpDumps(t)
	cases := [][]string{
		{"replay"},
		{"replay", filepath.Join(clean, "no-such-dump")},
		{"replay", "--mode", "sideways", clean},
		{"replay", "--tol-stage", "o=fuzzy", clean},
		{"replay", "--weights", filepath.Join(clean, "nothing-here"), clean},
		{"diff", clean},
		{"bisect"},
		{"report", clean},
		{"synth"},
		{"synth", "--out", t.TempDir(), "--fault", "gremlins@1,1"},
		{"synth", "--out", t.TempDir(), "--fault", "topk-off-by-one@7,0"},
	}
	for _, c := range cases {
		code, out, e := rpRun(c...)
		if code != exitError {
			t.Errorf("%v: exit %d, want %d\n%s%s", c, code, exitError, out, e)
		}
		if strings.Contains(e, "goroutine") || strings.Contains(e, "panic") {
			t.Errorf("%v: stack trace on stderr:\n%s", c, e)
		}
	}
	// A one-line error names the file.
	_, _, e := rpRun("replay", filepath.Join(clean, "no-such-dump"))
	if strings.Count(strings.TrimSpace(e), "\n") != 0 || !strings.Contains(e, "no-such-dump") {
		t.Errorf("error is not one line naming the file: %q", e)
	}
	for _, name := range []string{"replay", "diff", "bisect", "report", "synth", "demo"} {
		if code, o, e := rpRun(name, "--help"); code != exitOK || !strings.Contains(o, "usage: sparsemla "+name) || e != "" {
			t.Errorf("%s --help: exit %d\n%s%s", name, code, o, e)
		}
	}
}

func TestReplayCommandJSON(t *testing.T) {
	_, bad := rpDumps(t)
	get := func(procs int) string {
		old := runtime.GOMAXPROCS(procs)
		defer runtime.GOMAXPROCS(old)
		code, out, e := rpRun("replay", "--json", bad)
		if code != exitDiverged {
			t.Fatalf("exit %d: %s", code, e)
		}
		return out
	}
	a, b := get(1), get(2)
	if a != b {
		t.Fatal("--json output differs between GOMAXPROCS 1 and 2")
	}
	var rep struct {
		Schema string `json:"schema"`
		First  struct {
			Step  int64  `json:"step"`
			Layer int    `json:"layer"`
			Stage string `json:"stage"`
			Kind  string `json:"kind"`
		} `json:"first_divergence"`
	}
	if err := json.Unmarshal([]byte(a), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Schema != "sparsemla.replay/v4" || rep.First.Step != 8 || rep.First.Layer != 2 || rep.First.Stage != "o" || rep.First.Kind != "attention kernel" {
		t.Fatalf("JSON report %+v", rep)
	}
}

func TestDiffBisectReportCommands(t *testing.T) {
	clean, bad := rpDumps(t)
	code, out, e := rpRun("diff", clean, bad)
	if code != exitDiverged || !strings.Contains(out, "stage o") || !strings.Contains(out, "A is right") {
		t.Fatalf("diff: exit %d\n%s%s", code, out, e)
	}
	if code, out, e := rpRun("diff", clean, clean); code != exitOK {
		t.Fatalf("diff clean clean: exit %d\n%s%s", code, out, e)
	}
	// Weights asked for (--weights) that are not there are an error, not a
	// diff without its referee; weights beside A that cannot be read, or
	// none there, give a diff without one that says which.
	missing := filepath.Join(t.TempDir(), "no-such-weights")
	if code, out, e := rpRun("diff", "--weights", missing, clean, bad); code != exitError || !strings.Contains(e, "no-such-weights") || strings.Contains(out, "no referee") {
		t.Errorf("diff --weights %s: exit %d\n%s%s", missing, code, out, e)
	}
	bare := filepath.Join(t.TempDir(), "bare")
	if err := os.Mkdir(bare, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"dump.smd", "weights.safetensors"} {
		b, err := os.ReadFile(filepath.Join(clean, name))
		if err != nil {
			t.Fatal(err)
		}
		if name == "weights.safetensors" {
			b = b[:len(b)/2]
		}
		if err := os.WriteFile(filepath.Join(bare, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if code, out, e := rpRun("diff", bare, bad); code != exitDiverged || !strings.Contains(out, "referee: no referee: the weights beside A cannot be used (") || strings.Contains(out, "no weights beside A") {
		t.Errorf("diff with truncated weights beside A: exit %d\n%s%s", code, out, e)
	}
	// the JSON says it too (it used to have no referee key and no word of why)
	if code, out, e := rpRun("diff", "--json", bare, bad); code != exitDiverged || !strings.Contains(out, `"right": "unknown"`) || !strings.Contains(out, `"text": "no referee: the weights beside A cannot be used (`) {
		t.Errorf("diff --json with truncated weights beside A: exit %d\n%s%s", code, out, e)
	}
	// a --policy only the referee uses, which cannot be applied, is an error,
	// not a diff that drops its referee
	if code, out, e := rpRun("diff", "--policy", "bogus", clean, bad); code != exitError || !strings.Contains(e, `unknown numerics policy "bogus"`) {
		t.Errorf("diff --policy bogus: exit %d\n%s%s", code, out, e)
	}
	if err := os.Remove(filepath.Join(bare, "weights.safetensors")); err != nil {
		t.Fatal(err)
	}
	if code, out, e := rpRun("diff", bare, bad); code != exitDiverged || !strings.Contains(out, "referee: no referee: no weights beside A") {
		t.Errorf("diff with no weights beside A: exit %d\n%s%s", code, out, e)
	}
	// A divergence that persists (a stale page stays in the cache) is found
	// by the probes; the steps before it are then scanned (bisect names what
	// replay names), or, with --assume-persistent, left unchecked and said so.
	stale := filepath.Join(t.TempDir(), "stale")
	if code, _, e := rpRun("synth", "--out", stale, "--steps", "8", "--fault", "stale-prefix@9,3"); code != 0 {
		t.Fatal(e)
	}
	code, out, e = rpRun("bisect", stale)
	if code != exitDiverged || !strings.Contains(out, "replayed 5 of 8 steps") || !strings.Contains(out, "then scanned steps 6") || !strings.Contains(out, "decode step 9, layer 3, stage kv_cache") {
		t.Fatalf("bisect: exit %d\n%s%s", code, out, e)
	}
	code, out, e = rpRun("bisect", "--assume-persistent", stale)
	if code != exitDiverged || !strings.Contains(out, "replayed 4 of 8 steps") || !strings.Contains(out, "not checked: ") || !strings.Contains(out, "decode step 9, layer 3, stage kv_cache") {
		t.Fatalf("bisect --assume-persistent: exit %d\n%s%s", code, out, e)
	}
	html := filepath.Join(t.TempDir(), "r.html")
	code, out, e = rpRun("report", bad, "--html", html)
	if code != exitDiverged {
		t.Fatalf("report: exit %d\n%s%s", code, out, e)
	}
	b, err := os.ReadFile(html)
	if err != nil {
		t.Fatal(err)
	}
	page := string(b)
	for _, want := range []string{"<!DOCTYPE html>", "data:image/svg", "first divergence: decode step 8, layer 2, stage o", "Error by layer x step"} {
		if !strings.Contains(page, want) {
			t.Errorf("report page lacks %q", want)
		}
	}
	if strings.Contains(page, "src=\"http") {
		t.Error("report page is not self-contained")
	}
}

func TestDemoCommand(t *testing.T) {
	code, out, e := rpRun("demo")
	if code != exitOK {
		t.Fatalf("demo: exit %d\n%s%s", code, out, e)
	}
	for _, want := range []string{"== clean dump", "agree: ", "== faulty dump",
		"first divergence: decode step 9, layer 3, stage kv_cache — prefix cache"} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

// TestReplayPagesAndBadInput: a corrupted scale byte is named down to the page
// byte (synth writes v4-model1 pages through the kvcache codecs), and a
// truncated dump is one error line naming the file.
func TestReplayPagesAndBadInput(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "sb")
	if code, _, e := rpRun("synth", "--out", dir, "--steps", "6", "--fault", "scale-byte@9,2"); code != 0 {
		t.Fatal(e)
	}
	code, out, e := rpRun("replay", dir)
	if code != exitDiverged {
		t.Fatalf("exit %d\n%s%s", code, out, e)
	}
	for _, want := range []string{"decode step 9, layer 2, stage kv_cache — FP8 cache", "page bytes: v4-model1 page 0", "scale", "1 bytes in 1 entries differ"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	smd := filepath.Join(dir, "dump.smd")
	b, err := os.ReadFile(smd)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(smd, b[:len(b)/2], 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, e = rpRun("replay", dir)
	if code != exitError || strings.Count(strings.TrimSpace(e), "\n") != 0 || !strings.Contains(e, "dump.smd") {
		t.Fatalf("truncated dump: exit %d, stderr %q\n%s", code, e, out)
	}
	ga, gb := filepath.Join("..", "..", "testdata", "official-v4-tiny"), filepath.Join("..", "..", "testdata", "gpu-v4-tiny-long")
	if _, err := os.Stat(gb); err == nil {
		if code, _, e := rpRun("diff", ga, gb); code != exitError || !strings.Contains(e, "none in common") {
			t.Errorf("diff of dumps with no common step: exit %d, want %d (%s)", code, exitError, e)
		}
	}
	if code, out, e := rpRun("diff", ga, ga); code != exitOK || !strings.Contains(out, "referee: reference vs A agree, vs B agree: both are right") {
		t.Errorf("diff of the golden with itself: exit %d\n%s%s", code, out, e)
	}
}

func TestParseSteps(t *testing.T) {
	got, err := parseSteps("3, 7-9,12")
	if err != nil || len(got) != 5 || got[0] != 3 || got[1] != 7 || got[3] != 9 || got[4] != 12 {
		t.Fatalf("parseSteps: %v %v", got, err)
	}
	for _, bad := range []string{"x", "9-7", "1-", "1-99999999999", ","} {
		if _, err := parseSteps(bad); err == nil {
			t.Errorf("parseSteps(%q): no error", bad)
		}
	}
}

// TestReplayChainedNamesTheStageThatMadeIt is the command line of the
// review that found chained mode blaming an innocent stage: the routed
// experts of step 9, layer 1 skip the swiglu_limit clamp, ffn_out's chained
// cos_diff (3.7e-3) stays inside the chained tolerance (1e-2) and the chain
// first leaves it at step 9, layer 3, iw_raw. Every mode names step 9,
// layer 1, ffn_out; chained says how it was found and never that iw_raw
// itself differs. The clean whole model and the README's chained examples
// (official-v4-tiny; v32-tiny --steps 10-13) agree.
func TestReplayChainedNamesTheStageThatMadeIt(t *testing.T) {
	dir := t.TempDir()
	bad, clean := filepath.Join(dir, "sw"), filepath.Join(dir, "clean")
	if code, _, errs := rpRun("synth", "--out", bad, "--whole", "--fault", "expert-no-clamp@9,1"); code != exitOK {
		t.Fatalf("synth: exit %d: %s", code, errs)
	}
	name := "first divergence: decode step 9, layer 1, stage ffn_out — MoE experts: routed experts:"
	for _, mode := range []string{"local", "propagated", "chained"} {
		code, out, errs := rpRun("replay", "--mode", mode, bad)
		if code != 1 || !strings.Contains(out, name) || strings.Contains(out, "itself differs") {
			t.Fatalf("replay --mode %s: exit %d, want 1 naming %q:\n%s%s", mode, code, name, out, errs)
		}
		if mode == "chained" && !strings.Contains(out, "first leaves it at decode step 9, layer 3, stage iw_raw") {
			t.Fatalf("replay --mode chained does not say where the chain left its tolerance:\n%s", out)
		}
	}
	if code, _, errs := rpRun("synth", "--out", clean, "--whole"); code != exitOK {
		t.Fatalf("synth: exit %d: %s", code, errs)
	}
	testdata := filepath.Join("..", "..", "testdata")
	for _, args := range [][]string{
		{"replay", "--mode", "chained", clean},
		{"replay", "--mode", "chained", filepath.Join(testdata, "official-v4-tiny")},
		{"replay", "--mode", "chained", "--steps", "10-13", filepath.Join(testdata, "v32-tiny")},
	} {
		if code, out, errs := rpRun(args...); code != exitOK || !strings.Contains(out, "\nagree: ") {
			t.Fatalf("%v: exit %d, want 0 and agree:\n%s%s", args, code, out, errs)
		}
	}
}
