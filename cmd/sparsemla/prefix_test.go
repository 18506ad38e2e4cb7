package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func TestPrefixCommandFixtures(t *testing.T) {
	code, out, e := rpRun("prefix", "../../testdata/prefixcheck/vllm-kv-events.msgpack", "--window", "4", "--ratios", "0,4,128")
	if code != exitDiverged || !strings.Contains(out, `first divergence: request "b2.e1" (#3): evicted-page`) {
		t.Fatalf("vLLM fixture: exit %d\n%s%s", code, out, e)
	}
	if code, out, e := rpRun("prefix", "--config", "flash", "../../testdata/prefixcheck/sglang-kv-events.msgpack"); code != exitDiverged || !strings.Contains(out, "window 128, ratios [0 0 4 128 4 128") {
		t.Fatalf("--config flash: exit %d\n%s%s", code, out, e)
	}
	page := filepath.Join(t.TempDir(), "p.html")
	if code, _, e := rpRun("prefix", "--html", page, "../../testdata/prefixcheck/vllm-kv-events.msgpack"); code != exitDiverged {
		t.Fatalf("--html: exit %d %s", code, e)
	}
	if b, err := os.ReadFile(page); err != nil || !strings.Contains(string(b), "first divergence: request b2.e1") {
		t.Fatalf("page: %v", err)
	}
	if code, _, e := rpRun("prefix", "--html", page, "../../testdata/prefixcheck/vllm-kv-events.msgpack"); code != exitDiverged {
		t.Fatalf("--html over its own earlier page (replaced): exit %d %s", code, e)
	}
	code, out, e = rpRun("prefix", "--json", "../../testdata/prefixcheck/sglang-kv-events.msgpack")
	var rep struct {
		Schema, Verdict string
		Summary         struct{ Diverged, Warn int }
	}
	if code != exitDiverged || json.Unmarshal([]byte(out), &rep) != nil || rep.Schema != "sparsemla.prefix/v1" || rep.Summary.Diverged != 1 || rep.Summary.Warn != 1 {
		t.Fatalf("SGLang fixture: exit %d %+v\n%s%s", code, rep, out, e)
	}
}

// A request prefix could not judge makes the check incomplete, exit 3, as
// replay's: never agree (exit 0), which a CI job would read as a pass.
func TestPrefixIncompleteExit(t *testing.T) {
	fx := "../../testdata/prefixcheck/"
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"prefix", "../../testdata/dump/native/all_dtypes.smd", "--page", "16"}, "incomplete: none of the 2 requests could be judged"},
		{[]string{"prefix", "--hash-scheme", "per-page", fx + "vllm-kv-events.msgpack"}, "incomplete: none of the 10 requests could be judged"},
		{[]string{"prefix", fx + "sglang-perpage-kv-events.msgpack", "--page", "1", "--window", "4", "--ratios", "0,4,128"}, "incomplete: 1 of the 5 requests could not be judged"},
	} {
		code, out, e := rpRun(c.args...)
		first, _, _ := strings.Cut(out, "\n")
		if code != exitIncomplete || !strings.Contains(first, ": incomplete: ") || !strings.Contains(out, c.want) || e != "" {
			t.Errorf("%v: exit %d, want 3 and %q\n%s%s", c.args, code, c.want, out, e)
		}
	}
	code, out, _ := rpRun("prefix", "--json", fx+"sglang-perpage-kv-events.msgpack", "--page", "1")
	var rep struct{ Verdict string }
	if code != exitIncomplete || json.Unmarshal([]byte(out), &rep) != nil || rep.Verdict != "incomplete" {
		t.Errorf("--json: exit %d, verdict %q", code, rep.Verdict)
	}
}

// synth --prefix writes runs that prefix checks: clean ones agree, each fault
// diverges at exactly its request with its kind.
func TestPrefixSynthRoundTrip(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		scenario, form, fault string
		extra                 []string
	}{
		{"branching", "events", "", nil},
		{"eviction", "events", "", nil},
		{"system-prompts", "native", "", nil},
		{"eviction", "native", "", []string{"--requests", "40"}},
		{"eviction", "events", "evicted-page@10", nil},
		{"branching", "events", "namespace-mix@10", nil},
		{"branching", "events", "missed-hit@10", nil},
		{"system-prompts", "events", "overwritten-page@10", nil},
		{"branching", "native", "hit-too-long@10", nil},
		{"branching", "native", "beyond-cache@10", nil},
		{"branching", "native", "resume-beyond-cache@10", []string{"--resume-at-end-only"}},
	} {
		out := filepath.Join(dir, c.scenario+"-"+c.form+"-"+strings.Split(c.fault, "@")[0])
		args := append([]string{"synth", "--prefix", c.scenario, "--form", c.form, "--out", out, "--requests", "30"}, c.extra...)
		if c.fault != "" {
			args = append(args, "--fault", c.fault)
		}
		code, so, e := rpRun(args...)
		if code != exitOK {
			t.Fatalf("%v: exit %d\n%s%s", args, code, so, e)
		}
		_, check, ok := strings.Cut(so, "check: sparsemla ")
		if !ok {
			t.Fatalf("%v: no check command in %q", args, so)
		}
		code, ro, e := rpRun(strings.Fields(check)...)
		if c.fault == "" {
			if code != exitOK {
				t.Errorf("%s: clean run: exit %d\n%s%s", check, code, ro, e)
			}
			continue
		}
		kind := strings.Split(c.fault, "@")[0]
		_, id, _ := strings.Cut(so, "; fault "+kind+" in request ")
		id = strings.TrimSpace(strings.Split(id, "\n")[0])
		if code != exitDiverged || !strings.Contains(ro, "first divergence: request \""+id+"\"") || !strings.Contains(ro, "): "+kind+": ") || !strings.Contains(ro, " 1 diverged") {
			t.Errorf("%s: exit %d, want request %s %s\n%s%s", check, code, id, kind, ro, e)
		}
	}
}

// synth --prefix and prefix agree on how many requests there are: a request
// whose hit covers every whole page it has stores no page, so the event
// stream (as vLLM's) has no event of it; synth says so and names it, and the
// count it gives for the stream is the one prefix reports.
func TestPrefixSynthRequestCounts(t *testing.T) {
	dir := t.TempDir()
	wrote := regexp.MustCompile(`, (\d+) requests, page`)
	shows := regexp.MustCompile(`(?m)^note: the event stream shows (\d+) of the (\d+) requests: .* req10 \(batch 10\) `)
	checked := regexp.MustCompile(`: (agree|diverged): (\d+) requests: `)
	for _, c := range []struct {
		args       []string
		run, shown string
	}{
		{[]string{"--prefix", "branching"}, "24", "23"},
		{[]string{"--prefix", "eviction", "--fault", "evicted-page@5"}, "25", "24"},
		{[]string{"--prefix", "branching", "--format", "native"}, "24", "24"},
	} {
		args := append(append([]string{"synth"}, c.args...), "--out", filepath.Join(dir, strings.Join(c.args, "_")))
		code, so, e := rpRun(args...)
		w := wrote.FindStringSubmatch(so)
		if code != exitOK || w == nil || w[1] != c.run {
			t.Fatalf("%v: exit %d, want %s requests\n%s%s", args, code, c.run, so, e)
		}
		if s := shows.FindStringSubmatch(so); (c.shown != c.run) != (s != nil) || s != nil && (s[1] != c.shown || s[2] != c.run) {
			t.Errorf("%v: want a note that the stream shows %s of %s requests (req10 stores no page):\n%s", args, c.shown, c.run, so)
		}
		_, check, _ := strings.Cut(so, "check: sparsemla ")
		_, ro, _ := rpRun(strings.Fields(check)...)
		if m := checked.FindStringSubmatch(ro); m == nil || m[2] != c.shown {
			t.Errorf("%s: want %s requests checked:\n%s", check, c.shown, ro)
		}
	}
}

// One idea, one name: synth's dump format is --format in both of its forms;
// --form, the earlier name of the prefix-cache run's, is an alias in both.
func TestSynthFormatFlag(t *testing.T) {
	dir := t.TempDir()
	for i, args := range [][]string{
		{"synth", "--prefix", "branching", "--format", "native"},
		{"synth", "--prefix", "branching", "--form", "native"},
		{"synth", "--steps", "1", "--format", "native"},
		{"synth", "--steps", "1", "--form", "native"},
	} {
		out := filepath.Join(dir, fmt.Sprint(i))
		if code, so, e := rpRun(append(args, "--out", out)...); code != exitOK {
			t.Errorf("%v: exit %d\n%s%s", args, code, so, e)
		}
	}
	if code, _, e := rpRun("synth", "--prefix", "branching", "--format", "npz", "--out", filepath.Join(dir, "x")); code != exitError || !strings.Contains(e, "--format \"npz\"") {
		t.Errorf("--format npz: exit %d, %q", code, e)
	}
}

func TestPrefixCommandErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.msgpack")
	os.WriteFile(bad, []byte{0xdd, 0xff, 0xff, 0xff, 0xff}, 0o644)
	exists := filepath.Join(dir, "exists")
	os.WriteFile(exists, nil, 0o644)
	for _, c := range [][]string{
		{"prefix"},
		{"prefix", bad},
		{"prefix", filepath.Join(dir, "missing")},
		{"prefix", "--ratios", "0,5", "../../testdata/prefixcheck/sglang-kv-events.msgpack"},
		{"prefix", "--page", "3", "../../testdata/prefixcheck/sglang-kv-events.msgpack"},
		{"prefix", "--capacity", "64", "../../testdata/prefixcheck/sglang-kv-events.msgpack"},
		{"prefix", "--config", "huge", "../../testdata/prefixcheck/sglang-kv-events.msgpack"},
		{"synth", "--prefix", "nope", "--out", filepath.Join(dir, "x")},
		{"synth", "--prefix", "branching", "--out", exists},
		{"synth", "--prefix", "branching", "--form", "native", "--out", filepath.Join(dir, "y"), "--fault", "missed-hit@3"},
		{"synth", "--prefix", "branching", "--out", filepath.Join(dir, "w"), "--fault", "gremlins"},
	} {
		code, out, e := rpRun(c...)
		if code != exitError || strings.Contains(e, "panic") {
			t.Errorf("%v: exit %d\n%s%s", c, code, out, e)
		}
	}
}
