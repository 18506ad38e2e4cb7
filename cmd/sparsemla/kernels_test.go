package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// kernelsLine is the report's one line naming the kernels that ran.
var kernelsLine = regexp.MustCompile(`(?m)^  "kernels": "([a-z]+)",\n`)

// TestReplayKernelsSameBytes: the prepared path (the default: fast kernels
// on compact weights) and --reference (the plain loops on the fp32 weights)
// give byte-identical --json reports apart from the "kernels" line, on the
// GPU dumps in testdata and on faulted synthetic dumps, in both replay modes,
// and for diff and bisect; text output is identical.
func TestReplayKernelsSameBytes(t *testing.T) {
	dir := t.TempDir()
	dumps := map[string]string{}
	for _, g := range []string{"official-v4-tiny", "gpu-v4-tiny-long"} {
		p := filepath.Join("..", "..", "testdata", g)
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("testdata dump %s: %v", g, err)
		}
		dumps[g] = p
	}
	for name, args := range map[string][]string{
		"synth-lse":   {"--steps", "4", "--seed", "11", "--fault", "wrong-lse@8,1"},
		"synth-topk":  {"--steps", "4", "--seed", "3", "--fault", "topk-off-by-one@8,1"},
		"synth-stale": {"--steps", "6", "--seed", "11", "--fault", "stale-prefix@9,3"},
	} {
		p := filepath.Join(dir, name)
		if code, _, e := rpRun(append([]string{"synth", "--out", p}, args...)...); code != exitOK {
			t.Fatalf("synth %s: %s", name, e)
		}
		dumps[name] = p
	}
	type job struct {
		name string
		args []string
	}
	var jobs []job
	for name, p := range dumps {
		for _, mode := range []string{"local", "propagated"} {
			jobs = append(jobs, job{name + "/replay-" + mode, []string{"replay", "--json", "--mode", mode, p}})
		}
		jobs = append(jobs, job{name + "/replay-text", []string{"replay", p}})
	}
	jobs = append(jobs,
		job{"synth-stale/bisect", []string{"bisect", "--json", dumps["synth-stale"]}},
		job{"synth-lse/diff", []string{"diff", "--json", dumps["synth-lse"], dumps["synth-stale"]}})
	diverged := 0
	for _, j := range jobs {
		codeP, outP, errP := rpRun(j.args...)
		codeR, outR, errR := rpRun(append(j.args, "--reference")...)
		if codeP == exitError || codeR == exitError {
			t.Fatalf("%s: exit %d / %d: %s %s", j.name, codeP, codeR, errP, errR)
		}
		if codeP != codeR {
			t.Errorf("%s: exit %d prepared, %d reference", j.name, codeP, codeR)
		}
		if codeP == exitDiverged {
			diverged++
		}
		if strings.Contains(j.name, "text") {
			if outP != outR {
				t.Errorf("%s: text reports differ:\nprepared:\n%s\nreference:\n%s", j.name, outP, outR)
			}
			continue
		}
		mp, mr := kernelsLine.FindStringSubmatch(outP), kernelsLine.FindStringSubmatch(outR)
		if mp == nil || mr == nil || mp[1] != "prepared" || mr[1] != "reference" {
			t.Errorf("%s: kernels line %q (default), %q (--reference), want prepared / reference", j.name, mp, mr)
			continue
		}
		sp, sr := kernelsLine.ReplaceAllString(outP, ""), kernelsLine.ReplaceAllString(outR, "")
		if sp != sr {
			a, b := strings.Split(sp, "\n"), strings.Split(sr, "\n")
			for i := range min(len(a), len(b)) {
				if a[i] != b[i] {
					t.Errorf("%s: reports differ at line %d:\nprepared:  %s\nreference: %s", j.name, i+1, a[i], b[i])
					break
				}
			}
			if len(a) != len(b) {
				t.Errorf("%s: reports of %d and %d lines", j.name, len(a), len(b))
			}
		}
	}
	// the faulted dumps must diverge (so the comparison covers diagnoses too)
	if diverged < 6 {
		t.Errorf("only %d of the runs diverged; the faulted dumps should", diverged)
	}

	// fault: the copy of a GPU dump with an injected fault is the same file
	var smd [2][]byte
	for i, extra := range [][]string{nil, {"--reference"}} {
		out := filepath.Join(dir, "fault-"+strings.Join(extra, ""))
		args := append([]string{"fault", "--in", dumps["gpu-v4-tiny-long"], "--out", out, "--fault", "wrong-lse@255,1"}, extra...)
		if code, _, e := rpRun(args...); code != exitOK {
			t.Fatalf("fault %v: exit %d: %s", extra, code, e)
		}
		b, err := os.ReadFile(filepath.Join(out, "dump.smd"))
		if err != nil {
			t.Fatal(err)
		}
		smd[i] = b
	}
	if string(smd[0]) != string(smd[1]) {
		t.Errorf("fault: the faulted dumps differ (%d and %d bytes)", len(smd[0]), len(smd[1]))
	}
}
