package main

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// Determinism: the same dump gives byte-identical machine output (replay
// --json in both modes, diff --json, bisect --json, inspect --json, the HTML
// report) at GOMAXPROCS 1, 2 and 4, and across repeated runs in one process.

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
		jobs = append(jobs,
			job{name + "/replay-local", []string{"replay", "--json", p}, ""},
			job{name + "/replay-propagated", []string{"replay", "--json", "--mode", "propagated", p}, ""},
			job{name + "/bisect", []string{"bisect", "--json", p}, ""},
		)
		if filepath.Base(p) != "official-v4-tiny" && filepath.Base(p) != "gpu-v4-tiny-long" {
			jobs = append(jobs, job{name + "/inspect", []string{"inspect", "--json", filepath.Join(p, "dump.smd")}, ""})
		} else {
			jobs = append(jobs, job{name + "/inspect", []string{"inspect", "--json", p}, ""})
		}
		if testing.Short() {
			continue
		}
		html := filepath.Join(htmlDir, name+".html")
		jobs = append(jobs, job{name + "/report", []string{"report", p, "--html", html}, html})
	}
	jobs = append(jobs, job{"diff", []string{"diff", "--json", dumps["synth-clean"], dumps["synth-lse"]}, ""})
	if testing.Short() {
		// -short: the synthetic dumps and the small golden only.
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
			for _, procs := range []int{1, 2, 4, 2} {
				code, out, e := atProcs(procs, j.args...)
				if code == exitError {
					t.Fatalf("GOMAXPROCS %d: exit 2: %s", procs, e)
				}
				if j.file != "" {
					b, err := os.ReadFile(j.file)
					if err != nil {
						t.Fatal(err)
					}
					out = string(b)
				}
				if len(out) == 0 {
					t.Fatalf("GOMAXPROCS %d: no output", procs)
				}
				if firstCode < 0 {
					first, firstCode = out, code
					continue
				}
				if code != firstCode || out != first {
					t.Fatalf("GOMAXPROCS %d: exit %d and %d bytes of output; first run: exit %d and %d bytes (first difference at byte %d)",
						procs, code, len(out), firstCode, len(first), firstDiff(out, first))
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
