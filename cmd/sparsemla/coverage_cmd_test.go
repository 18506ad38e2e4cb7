package main

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/replay"
)

// attnOnlyCorrupt writes, under dir, a copy of testdata/official-v4-tiny
// whose step 4 has layer 2's ffn_out, its moe_indices (expert 16386) and
// logits[7] (100) corrupted, and attn/weights.safetensors holding only the
// attention sub-layers' weights (layers.L.attn.*) of the golden's. It
// returns the copy and the weights file.
func attnOnlyCorrupt(t *testing.T, dir string) (dumpDir, weights string) {
	t.Helper()
	src := goldenTestdata("official-v4-tiny")
	dumpDir = filepath.Join(dir, "corrupt")
	if err := os.MkdirAll(filepath.Join(dir, "attn"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dumpDir, 0o755); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".safetensors") && e.Name() != "config.json" {
			continue
		}
		if e.Name() == "step_4.safetensors" {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dumpDir, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	rewriteSafetensors(t, filepath.Join(src, "step_4.safetensors"), filepath.Join(dumpDir, "step_4.safetensors"), func(r *dump.Record) bool {
		switch r.Name {
		case "L2.ffn_out":
			r.Data = append([]byte(nil), r.Data...)
			r.Data[1] ^= 0x01
		case "L2.moe_indices":
			r.Data = append([]byte(nil), r.Data...)
			binary.LittleEndian.PutUint64(r.Data, 16386)
		case "logits":
			r.Data = append([]byte(nil), r.Data...)
			binary.LittleEndian.PutUint32(r.Data[7*4:], math.Float32bits(100))
		}
		return true
	})
	attn := regexp.MustCompile(`^layers\.[0-9]+\.attn\.`)
	weights = filepath.Join(dir, "attn", "weights.safetensors")
	rewriteSafetensors(t, filepath.Join(src, "weights.safetensors"), weights, func(r *dump.Record) bool {
		return attn.MatchString(r.Name)
	})
	return dumpDir, weights
}

// TestAttentionOnlyWeightsNotAgree: a dump whose FFN output, expert ids and
// logits were corrupted, replayed with weights that hold the attention
// sub-layers only, is incomplete (exit 3) — never agree — in replay (both
// modes), bisect and diff, each naming what the weights given cannot
// compute and why; with the golden's whole weights the replay diverges.
func TestAttentionOnlyWeightsNotAgree(t *testing.T) {
	dumpDir, weights := attnOnlyCorrupt(t, t.TempDir())
	for _, mode := range []string{"local", "propagated"} {
		code, out, e := rpRun("replay", "--mode", mode, "--weights", weights, dumpDir)
		if code != exitIncomplete {
			t.Fatalf("replay --mode %s: exit %d, want %d\n%s%s", mode, code, exitIncomplete, out, e)
		}
		for _, want := range []string{
			"scope: attention sub-layers only",
			"ffn_out (24), ", "moe_indices (24)", "the weights given have no whole-layer tensors for this layer",
			"not compared: logits (6)", "the weights given have no head",
			"incomplete: no stage compared was out of tolerance, but not everything the dump holds was compared: 414 of 1102 stage tensors",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("replay --mode %s: output lacks %q:\n%s", mode, want, out)
			}
		}
		if strings.Contains(out, "agree:") || strings.Contains(out, "outside the reference's stages") {
			t.Errorf("replay --mode %s:\n%s", mode, out)
		}
	}
	code, out, _ := rpRun("replay", "--json", "--weights", weights, dumpDir)
	var rep replay.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if code != exitIncomplete || rep.Verdict != replay.VerdictIncomplete || rep.Coverage.Complete || len(rep.Coverage.NotChecked) != 414 {
		t.Errorf("replay --json: exit %d, verdict %s, complete %v, %d not checked", code, rep.Verdict, rep.Coverage.Complete, len(rep.Coverage.NotChecked))
	}
	if code, out, e := rpRun("replay", dumpDir); code != exitDiverged {
		t.Errorf("replay with the whole weights: exit %d, want %d\n%s%s", code, exitDiverged, out, e)
	}
	html := filepath.Join(t.TempDir(), "c.html")
	code, out, e := rpRun("report", "--weights", weights, dumpDir, "--html", html)
	if b, err := os.ReadFile(html); code != exitIncomplete || err != nil || !strings.Contains(out, "incomplete: no stage compared was out of tolerance") ||
		!strings.Contains(string(b), "not compared: logits (6)") {
		t.Errorf("report: exit %d, %v\n%s%s", code, err, out, e)
	}
	code, out, e = rpRun("bisect", "--weights", weights, dumpDir)
	if code != exitIncomplete || !strings.Contains(out, "the weights given have no head") || strings.Contains(out, "agree:") {
		t.Errorf("bisect: exit %d\n%s%s", code, out, e)
	}
	code, out, e = rpRun("diff", "--weights", weights, goldenTestdata("official-v4-tiny"), dumpDir)
	if code != exitDiverged || !strings.Contains(out, "decode step 4, layer 2, stage moe_indices") ||
		!strings.Contains(out, "referee: reference vs A incomplete, vs B incomplete: unknown which is right") || strings.Contains(out, "is right\n") {
		t.Errorf("diff: exit %d\n%s%s", code, out, e)
	}
}

// TestBisectIncompleteReason: bisect of a dump with one kv_cache tensor
// removed replays every step and says why it is incomplete — the kv_cache
// of the next step has no input — with replay's counts, not that some step
// was not probed; --assume-persistent says which steps it did not probe.
func TestBisectIncompleteReason(t *testing.T) {
	src := goldenTestdata("official-v4-tiny")
	dir := t.TempDir()
	for _, f := range []string{"config.json", "rope_tables.safetensors", "weights.safetensors", "prefill_state.safetensors",
		"step_2.safetensors", "step_3.safetensors", "step_5.safetensors", "step_6.safetensors", "step_7.safetensors"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	rewriteSafetensors(t, filepath.Join(src, "step_4.safetensors"), filepath.Join(dir, "step_4.safetensors"), func(r *dump.Record) bool {
		return r.Name != "L2.kv_cache"
	})
	const why = "1 of 1101 stage tensors the dump holds were not compared: step 5 layer 2 kv_cache: no value of kv_cache after step 4 in the dump"
	code, out, e := rpRun("replay", dir)
	if code != exitIncomplete || !strings.Contains(out, why) {
		t.Fatalf("replay: exit %d\n%s%s", code, out, e)
	}
	code, out, e = rpRun("bisect", dir)
	if code != exitIncomplete || !strings.Contains(out, "replayed 6 of 6 steps") || !strings.Contains(out, why) ||
		!strings.Contains(out, "not compared: step 5 layer 2 kv_cache") || strings.Contains(out, "did not probe") {
		t.Errorf("bisect: exit %d\n%s%s", code, out, e)
	}
	code, out, e = rpRun("bisect", "--assume-persistent", dir)
	if code != exitIncomplete || !strings.Contains(out, "5 dumped steps were not compared (2..6): not probed") {
		t.Errorf("bisect --assume-persistent: exit %d\n%s%s", code, out, e)
	}
}

// TestDiffV41Wording: the V4.1 diff names both dumps in its header and
// describes the selection that differs as B's against A's, not as the
// GPU's against the reference's; the referee says A is right.
func TestDiffV41Wording(t *testing.T) {
	out := filepath.Join(t.TempDir(), "g41t")
	v41 := goldenTestdata("v41-tiny")
	if code, o, e := rpRun("fault", "--in", v41, "--out", out, "--fault", "topk-off-by-one@14,2"); code != exitOK {
		t.Fatalf("fault: exit %d\n%s%s", code, o, e)
	}
	code, o, e := rpRun("diff", v41, out)
	if code != exitDiverged || !strings.Contains(o, "(A) vs "+out+" (B)") || !strings.Contains(o, "A and B differ: B selected [] not in A's set, left out [3]") ||
		strings.Contains(o, "not in the reference set") || !strings.Contains(o, "referee: reference vs A agree, vs B diverged: A is right") {
		t.Errorf("diff: exit %d\n%s%s", code, o, e)
	}
}

// TestToleranceOverridesNamed: replay, bisect and diff with --tol-stage or
// --tol name the tolerances the user changed, in the text (a notes line and
// the agree line) and the JSON; V4.1 replays too.
func TestToleranceOverridesNamed(t *testing.T) {
	off := goldenTestdata("official-v4-tiny")
	const o = "o=close,abs=0.002,rel=0.02,cos=1e-05"
	code, out, e := rpRun("replay", "--steps", "3", "--tol-stage", "o=close,abs=2e-3,rel=0.02,cos=1e-5", off)
	if code != exitOK || !strings.Contains(out, "  tolerances overridden (--tol-stage, --tol): "+o+"\n") ||
		!strings.Contains(out, "agree: ") || !strings.HasSuffix(out, "(tolerances overridden: "+o+")\n") {
		t.Errorf("replay --tol-stage: exit %d\n%s%s", code, out, e)
	}
	tf := filepath.Join(t.TempDir(), "tol.json")
	if err := os.WriteFile(tf, []byte(`{"stages": {"u": {"mode": "ulp", "max_ulp": 3}}, "fallback": {"mode": "ulp", "max_ulp": 2}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, e = rpRun("replay", "--json", "--steps", "3", "--tol", tf, off)
	var rep replay.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("%v: %s%s", err, out, e)
	}
	if code != exitOK || strings.Join(rep.TolOverrides, " ") != "u=ulp,max_ulp=3 *=ulp,max_ulp=2" {
		t.Errorf("replay --json --tol: exit %d, overrides %q", code, rep.TolOverrides)
	}
	for _, args := range [][]string{
		{"bisect", "--tol-stage", "u=ulp,max_ulp=3", off},
		{"diff", "--tol-stage", "u=ulp,max_ulp=3", off, off},
		{"replay", "--tol-stage", "q_a=ulp,max_ulp=3", goldenTestdata("v41-tiny")},
	} {
		o := args[2]
		code, out, e := rpRun(args...)
		if code != exitOK || !strings.Contains(out, "tolerances overridden (--tol-stage, --tol): "+o+"\n") || !strings.Contains(out, "(tolerances overridden: "+o+")") {
			t.Errorf("%v: exit %d\n%s%s", args, code, out, e)
		}
	}
	// v41-tiny holds no u: the override judged nothing, and the report says so
	code, out, e = rpRun("replay", "--tol-stage", "u=ulp,max_ulp=3", goldenTestdata("v41-tiny"))
	if code != exitOK || !strings.Contains(out, "(tolerances overridden: u=ulp,max_ulp=3; u: no such stage compared here, so not applied)") {
		t.Errorf("replay --tol-stage u on v41-tiny: exit %d\n%s%s", code, out, e)
	}
	html := filepath.Join(t.TempDir(), "r.html")
	if code, out, e := rpRun("report", off, "--steps", "3", "--tol-stage", "u=ulp,max_ulp=3", "--html", html); code != exitOK {
		t.Errorf("report: exit %d\n%s%s", code, out, e)
	} else if b, err := os.ReadFile(html); err != nil || !strings.Contains(string(b), "tolerances overridden (--tol-stage, --tol): <code>u=ulp,max_ulp=3</code>") {
		t.Errorf("report page: %v, no tolerance line", err)
	}
	if code, out, _ := rpRun("replay", "--steps", "3", off); code != exitOK || strings.Contains(out, "overridden") {
		t.Errorf("replay with the defaults:\n%s", out)
	}
}

// TestWindowReplaySaysFirstStep: the replay of a window of the official
// golden without prefill_state (steps 4-7) says that step 4's cache states
// were its start state and its other 161 tensors were not compared, in the
// text and the JSON, in both modes and in bisect (inspect says the same).
func TestWindowReplaySaysFirstStep(t *testing.T) {
	src := goldenTestdata("official-v4-tiny")
	dir := t.TempDir()
	for _, f := range []string{"config.json", "rope_tables.safetensors", "weights.safetensors",
		"step_4.safetensors", "step_5.safetensors", "step_6.safetensors", "step_7.safetensors"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const note = "not read: 161 tensors: step 4, the first of this window (no prefill state): nothing says the state before it, so it is not replayed; its 16 cache states are the start state of step 5, its other tensors are not compared"
	for _, args := range [][]string{{"replay", dir}, {"replay", "--mode", "propagated", dir}, {"bisect", dir}} {
		code, out, e := rpRun(args...)
		if code != exitOK || !strings.Contains(out, note) || !strings.Contains(out, "agree: ") {
			t.Errorf("%v: exit %d\n%s%s", args, code, out, e)
		}
	}
	code, out, _ := rpRun("replay", "--json", dir)
	var rep replay.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if code != exitOK || len(rep.Coverage.Unread) != 1 || rep.Coverage.Unread[0].Tensors != 161 || !strings.HasPrefix(rep.Coverage.Unread[0].Why, "step 4, the first of this window") {
		t.Errorf("replay --json: exit %d, unread %+v", code, rep.Coverage.Unread)
	}
}

// TestModesAccountForTheSameTensors: local, propagated and chained replays
// of one dump account for the same held tensors (compared + not checked +
// inputs): the official golden, and a synthetic whole-model dump with KV
// pages (judged in every mode, beside the dumped kv_cache).
func TestModesAccountForTheSameTensors(t *testing.T) {
	synth := filepath.Join(t.TempDir(), "sw")
	if code, o, e := rpRun("synth", "--whole", "--out", synth, "--steps", "3", "--seed", "11"); code != exitOK {
		t.Fatalf("synth: exit %d\n%s%s", code, o, e)
	}
	for _, dir := range []string{goldenTestdata("official-v4-tiny"), synth} {
		held := map[string]int{}
		for _, mode := range []string{"local", "propagated", "chained"} {
			code, out, e := rpRun("replay", "--json", "--mode", mode, dir)
			var rep replay.Report
			if err := json.Unmarshal([]byte(out), &rep); err != nil {
				t.Fatalf("%s %s: %v\n%s", dir, mode, err, e)
			}
			c := rep.Coverage
			if code != exitOK || c.Held != c.Compared+len(c.NotChecked)+len(c.Inputs) {
				t.Errorf("%s %s: exit %d, held %d, compared %d, not checked %d, inputs %d", dir, mode, code, c.Held, c.Compared, len(c.NotChecked), len(c.Inputs))
			}
			pages := 0
			for _, r := range rep.Results {
				if r.Stage == "kv_pages" && r.Status == replay.StatusPass {
					pages++
				}
			}
			if dir == synth && pages == 0 {
				t.Errorf("%s %s: no KV pages judged", dir, mode)
			}
			held[mode] = c.Held
		}
		if held["local"] != held["propagated"] || held["local"] != held["chained"] {
			t.Errorf("%s: held %v", dir, held)
		}
	}
}
