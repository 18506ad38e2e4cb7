package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func inspectRun(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := run(append([]string{"inspect"}, args...), &out, &errb)
	return code, out.String(), errb.String()
}

func TestInspectGolden(t *testing.T) {
	code, out, errs := inspectRun("../../testdata/dump/official-v4-tiny", "--json")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var rep inspectReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Map != "official-v4-tiny" || len(rep.Steps) != 2 || rep.Steps[0] != 2 || len(rep.StateAt) != 1 || rep.StateAt[0] != 1 ||
		len(rep.Layers) != 4 || rep.Records != len(rep.List) || len(rep.Unknown) != 0 || rep.NaN != 0 {
		t.Errorf("report: map %q steps %v state %v layers %v records %d/%d unknown %v nan %d",
			rep.Map, rep.Steps, rep.StateAt, rep.Layers, rep.Records, len(rep.List), rep.Unknown, rep.NaN)
	}
	// score_state holds -inf by design (README of the golden): inf > 0.
	if rep.Inf == 0 {
		t.Error("no inf counted in the score states")
	}
}

func TestInspectFormats(t *testing.T) {
	for _, p := range []string{
		"../../testdata/dump/capture/capture_smoke.smd",
		"../../testdata/dump/capture/capture_split",
		"../../testdata/dump/capture/capture_smoke.npz",
		"../../testdata/dump/official-v4-tiny/step_2.safetensors",
	} {
		code, out, errs := inspectRun(p)
		if code != exitOK || !strings.Contains(out, "records") {
			t.Errorf("%s: exit %d, stderr %s", p, code, errs)
		}
	}
	code, out, _ := inspectRun("--map", "official-v4-tiny", "--filter", "/L1/kv$", "--index-only", "../../testdata/dump/official-v4-tiny")
	if code != exitOK || !strings.Contains(out, "-/p3/L1/kv ") || strings.Contains(out, "L0/kv") {
		t.Errorf("filter: exit %d\n%s", code, out)
	}
}

// TestInspectFilterPrefixHits: with --filter, the header lists only the
// prefix hits of the requests that have a matching record (capture_smoke
// holds one hit: request "r1" reused 5 tokens of request "").
func TestInspectFilterPrefixHits(t *testing.T) {
	const smoke = "../../testdata/dump/capture/capture_smoke.smd"
	for _, c := range []struct {
		filter string
		hit    bool
	}{{"", true}, {"^-/p5/", true}, {"^r1/", false}, {"^nomatch$", false}} {
		args := []string{smoke}
		if c.filter != "" {
			args = append([]string{"--filter", c.filter}, args...)
		}
		for _, js := range []bool{false, true} {
			a := args
			if js {
				a = append([]string{"--json"}, a...)
			}
			code, out, errs := inspectRun(a...)
			if code != exitOK {
				t.Fatalf("%v: exit %d: %s", a, code, errs)
			}
			got := strings.Contains(out, "prefix hit: request \"r1\"")
			if js {
				var rep inspectReport
				if err := json.Unmarshal([]byte(out), &rep); err != nil {
					t.Fatal(err)
				}
				got = len(rep.Prefix) == 1 && rep.Prefix[0].Request == "r1"
				if !c.hit && len(rep.Prefix) != 0 {
					t.Errorf("%v: prefix hits %v", a, rep.Prefix)
				}
			}
			if got != c.hit {
				t.Errorf("%v: prefix hit listed %v, want %v\n%s", a, got, c.hit, out)
			}
		}
	}
}

func TestInspectBadInput(t *testing.T) {
	b, err := os.ReadFile("../../testdata/dump/capture/capture_smoke.smd")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "cut.smd")
	if err := os.WriteFile(p, b[:len(b)-100], 0o644); err != nil {
		t.Fatal(err)
	}
	code, _, errs := inspectRun(p)
	if code != exitError || strings.Count(errs, "\n") != 1 || !strings.Contains(errs, p) || !strings.Contains(errs, "record") || !strings.Contains(errs, "offset") {
		t.Errorf("truncated: exit %d, stderr %q", code, errs)
	}
	if code, _, _ := inspectRun(filepath.Join(t.TempDir(), "missing")); code != exitError {
		t.Errorf("missing path: exit %d", code)
	}
	if code, _, _ := inspectRun("a", "b"); code != exitError {
		t.Errorf("two args: exit %d", code)
	}
}

func TestInspectNpzWithMap(t *testing.T) {
	code, out, errs := inspectRun("../../testdata/dump/capture/capture_smoke.npz", "--map", "../../testdata/dump/capture/smoke-npz.map.json", "--json")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var rep inspectReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Steps) != 2 || rep.Steps[0] != 5 || len(rep.Stages) != 1 || rep.Stages[0] != "cq" || rep.DTypes["bf16"] != 4 || len(rep.Unmapped) != 0 {
		t.Errorf("steps %v stages %v dtypes %v unmapped %v", rep.Steps, rep.Stages, rep.DTypes, rep.Unmapped)
	}
	for _, r := range rep.List {
		if r.Min == nil || *r.Min > -0.1 || *r.Max < 0.1 {
			t.Errorf("%s/%d: values not decoded as bf16: min %v max %v", r.Stage, r.Layer, r.Min, r.Max)
		}
	}
}

// TestInspectIncomplete: a capture cut at a frame boundary (no end frame)
// is listed, with a warning.
func TestInspectIncomplete(t *testing.T) {
	b, err := os.ReadFile("../../testdata/dump/capture/capture_smoke.smd")
	if err != nil {
		t.Fatal(err)
	}
	// The longest readable proper prefix ends where the end frame starts.
	for cut := len(b) - 1; cut > 12; cut-- {
		p := filepath.Join(t.TempDir(), "cut.smd")
		if err := os.WriteFile(p, b[:cut], 0o644); err != nil {
			t.Fatal(err)
		}
		code, out, _ := inspectRun(p, "--summary")
		if code == exitOK {
			if !strings.Contains(out, "warning: "+p+" has no end frame") {
				t.Errorf("cut at %d: no warning:\n%s", cut, out)
			}
			return
		}
	}
	t.Fatal("no cut of the capture was readable")
}
