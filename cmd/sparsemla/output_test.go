package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every command follows one rule for its output files (output.go): an
// earlier output of its own is replaced (rerunning a README command works),
// a file sparsemla cannot tell it wrote is refused with one line naming it
// and saying what to do, --force replaces it; every refusal names the path
// the user gave.
func TestOutputRule(t *testing.T) {
	base := badBase(t)
	dir := t.TempDir()
	events := "../../testdata/prefixcheck/vllm-kv-events.msgpack"
	user := filepath.Join(dir, "notes.html")
	userText := "<!DOCTYPE html>\n<html><head><title>my notes</title>"
	for _, c := range []struct {
		name string
		args func(out string) []string // the command line writing out
		out  string                    // in dir
		exit int                       // of a run that writes
	}{
		{"report", func(o string) []string { return []string{"report", base, "--html", o} }, "r.html", exitOK},
		{"prefix", func(o string) []string { return []string{"prefix", events, "--html", o} }, "p.html", exitDiverged},
		{"synth-events", func(o string) []string { return []string{"synth", "--prefix", "branching", "--out", o} }, "run.msgpack", exitOK},
		{"synth-native", func(o string) []string {
			return []string{"synth", "--prefix", "branching", "--format", "native", "--out", o}
		}, "run.smd", exitOK},
	} {
		out := filepath.Join(dir, c.out)
		if code, so, e := rpRun(c.args(out)...); code != c.exit {
			t.Fatalf("%s: exit %d\n%s%s", c.name, code, so, e)
		}
		// Rerun over its own output: replaced, except an event stream,
		// which carries no mark of its writer.
		code, _, e := rpRun(c.args(out)...)
		if c.name == "synth-events" {
			if code != exitError || !strings.Contains(e, out+": refused as an output: it exists") || !strings.Contains(e, "--force") {
				t.Errorf("%s rerun: exit %d %q", c.name, code, e)
			}
			if code, _, e := rpRun(append(c.args(out), "--force")...); code != c.exit {
				t.Errorf("%s rerun --force: exit %d %q", c.name, code, e)
			}
		} else if code != c.exit {
			t.Errorf("%s rerun over its own output: exit %d %q", c.name, code, e)
		}
		// A user's file: refused, kept, named; replaced with --force.
		if err := os.WriteFile(user, []byte(userText), 0o644); err != nil {
			t.Fatal(err)
		}
		code, so, e := rpRun(c.args(user)...)
		cmd, _, _ := strings.Cut(c.name, "-")
		if code != exitError || so != "" || strings.Count(e, "\n") != 1 ||
			!strings.HasPrefix(e, "sparsemla "+cmd+": "+user+": refused as an output: it exists and is not ") ||
			!strings.HasSuffix(e, "; remove it, give another path, or give --force to replace it\n") {
			t.Errorf("%s over a user's file: exit %d\n%s%s", c.name, code, so, e)
		}
		if b, _ := os.ReadFile(user); string(b) != userText {
			t.Fatalf("%s replaced a user's file", c.name)
		}
		if code, _, e := rpRun(append(c.args(user), "--force")...); code != c.exit {
			t.Errorf("%s --force: exit %d %q", c.name, code, e)
		}
		// A directory, a missing directory: named as given, not a temporary.
		for _, bad := range []struct{ path, want string }{
			{dir, dir + ": refused as an output: it is a directory; give the path of a file"},
			{"/nonexistent/x.out", "/nonexistent/x.out: cannot be written: the directory /nonexistent does not exist"},
		} {
			code, _, e := rpRun(append(c.args(bad.path), "--force")...)
			if code != exitError || !strings.Contains(e, bad.want) || strings.Count(e, "\n") != 1 {
				t.Errorf("%s --out %s: exit %d %q, want %q", c.name, bad.path, code, e, bad.want)
			}
		}
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.Contains(e.Name(), ".tmp-") {
			t.Errorf("left behind: %s", e.Name())
		}
	}
	// A required flag that is missing is named.
	if code, _, e := rpRun("report", base); code != exitError || !strings.Contains(e, "--html is required") {
		t.Errorf("report without --html: exit %d %q", code, e)
	}
	if code, _, e := rpRun("synth", "--prefix", "branching"); code != exitError || !strings.Contains(e, "--out is required") {
		t.Errorf("synth --prefix without --out: exit %d %q", code, e)
	}
}
