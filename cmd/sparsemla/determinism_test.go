package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// Determinism: the same dump gives byte-identical machine output (replay
// --json in both modes, diff --json, bisect --json, inspect --json, the HTML
// report) at GOMAXPROCS 1 and 2, and across repeated runs in one process
// (-determinism-all, as .ci/run passes: every command on every dump, and
// GOMAXPROCS 4 too).

var determinismAll = flag.Bool("determinism-all", false, "TestDeterministicOutput: every command on every dump at GOMAXPROCS 1, 2, 4, 2 (.ci/run); default: a subset at 1, 2, 2")

// determinismDumps are the dumps the determinism test replays: a clean and a
// faulty synthetic dump, and the GPU goldens in testdata (when present).
func determinismDumps(t *testing.T) map[string]string {
	t.Helper()
	dir := t.TempDir()
	dumps := map[string]string{}
	for name, args := range map[string][]string{
		"synth-clean": {"--steps", "4", "--seed", "11"},
		"synth-lse":   {"--steps", "4", "--seed", "11", "--fault", "wrong-lse@8,1"},
		"synth-stale": {"--steps", "6", "--seed", "11", "--fault", "stale-prefix@9,3"},
	} {
		p := filepath.Join(dir, name)
		if code, _, e := rpRun(append([]string{"synth", "--out", p}, args...)...); code != exitOK {
			t.Fatalf("synth %s: %s", name, e)
		}
		dumps[name] = p
	}
	for _, g := range []string{"official-v4-tiny", "gpu-v4-tiny-long"} {
		p := filepath.Join("..", "..", "testdata", g)
		if _, err := os.Stat(p); err == nil {
			dumps[g] = p
		}
	}
	return dumps
}

// atProcs runs args at GOMAXPROCS n and returns exit code and stdout.
func atProcs(n int, args ...string) (int, string, string) {
	old := runtime.GOMAXPROCS(n)
	defer runtime.GOMAXPROCS(old)
	return rpRun(args...)
}

func TestDeterministicOutput(t *testing.T) {
	dumps := determinismDumps(t)
	htmlDir := t.TempDir()
	type job struct {
		name string
		args []string
		file string // output file compared instead of stdout
	}
	var jobs []job
	for name, p := range dumps {
		golden := name == "official-v4-tiny" || name == "gpu-v4-tiny-long"
		// Default: every dump in local mode, the faulty synthetic ones in
		// propagated mode too; -determinism-all: everything.
		jobs = append(jobs, job{name + "/replay-local", []string{"replay", "--json", p}, ""})
		if *determinismAll || name == "synth-lse" || name == "synth-stale" {
			jobs = append(jobs, job{name + "/replay-propagated", []string{"replay", "--json", "--mode", "propagated", p}, ""})
		}
		if *determinismAll || name == "synth-lse" || name == "official-v4-tiny" {
			in := p
			if !golden {
				in = filepath.Join(p, "dump.smd")
			}
			jobs = append(jobs, job{name + "/inspect", []string{"inspect", "--json", in}, ""})
		}
		if *determinismAll || name == "synth-stale" {
			jobs = append(jobs, job{name + "/bisect", []string{"bisect", "--json", p}, ""})
		}
		if *determinismAll || name == "synth-lse" {
			html := filepath.Join(htmlDir, name+".html")
			jobs = append(jobs, job{name + "/report", []string{"report", p, "--html", html}, html})
		}
	}
	jobs = append(jobs, job{"diff", []string{"diff", "--json", dumps["synth-clean"], dumps["synth-lse"]}, ""})
	procs := []int{1, 2, 2}
	if *determinismAll {
		procs = []int{1, 2, 4, 2}
	}
	if testing.Short() {
		// -short: not the long golden.
		var keep []job
		for _, j := range jobs {
			if !bytes.Contains([]byte(j.name), []byte("gpu-v4-tiny-long")) {
				keep = append(keep, j)
			}
		}
		jobs = keep
	}
	for _, j := range jobs {
		t.Run(j.name, func(t *testing.T) {
			var first string
			firstCode := -1
			for _, n := range procs {
				code, out, e := atProcs(n, j.args...)
				if code == exitError {
					t.Fatalf("GOMAXPROCS %d: exit 2: %s", n, e)
				}
				if j.file != "" {
					b, err := os.ReadFile(j.file)
					if err != nil {
						t.Fatal(err)
					}
					out = string(b)
				}
				if len(out) == 0 {
					t.Fatalf("GOMAXPROCS %d: no output", n)
				}
				if firstCode < 0 {
					first, firstCode = out, code
					continue
				}
				if code != firstCode || out != first {
					t.Fatalf("GOMAXPROCS %d: exit %d and %d bytes of output; first run: exit %d and %d bytes (first difference at byte %d)",
						n, code, len(out), firstCode, len(first), firstDiff(out, first))
				}
			}
		})
	}
}

func firstDiff(a, b string) int {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
