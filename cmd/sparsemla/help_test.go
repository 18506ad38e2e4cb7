package main

import (
	"regexp"
	"sort"
	"strings"
	"testing"
)

// helpCommands are the command lines whose --help the tests read: every
// command, and synth's prefix-cache run (its own flags).
func helpCommands() [][]string {
	var cs [][]string
	for n := range commands {
		cs = append(cs, []string{n})
	}
	sort.Slice(cs, func(i, j int) bool { return cs[i][0] < cs[j][0] })
	return append(cs, []string{"synth", "--prefix", "x"})
}

// Help that is asked for is output: stdout, exit 0, nothing on stderr
// ('sparsemla replay --help | less' shows it). A wrong command line is an
// error: stderr, exit 2.
func TestHelpGoesToStdout(t *testing.T) {
	for _, c := range helpCommands() {
		args := append(append([]string{}, c...), "--help")
		code, o, e := rpRun(args...)
		if code != exitOK || e != "" || !strings.HasPrefix(o, "usage: sparsemla "+c[0]) {
			t.Errorf("%v: exit %d, stdout %q…, stderr %q", args, code, clip(o), e)
		}
		if len(c) == 1 {
			code2, o2, e2 := rpRun("help", c[0])
			if code2 != exitOK || e2 != "" || o2 != o {
				t.Errorf("help %s: exit %d, stderr %q; stdout differs from %s --help: %v", c[0], code2, e2, c[0], o2 != o)
			}
		}
	}
	if code, o, e := rpRun("help"); code != exitOK || e != "" || !strings.Contains(o, "Commands:") {
		t.Errorf("help: exit %d, stderr %q", code, e)
	}
	for _, args := range [][]string{{"help", "bogus"}, {"help", "replay", "extra"}, {"bogus"}, {}} {
		code, o, e := rpRun(args...)
		if code != exitError || o != "" || !strings.HasPrefix(e, "sparsemla") {
			t.Errorf("%v: exit %d (want 2), stdout %q, stderr %q", args, code, clip(o), clip(e))
		}
	}
}

var (
	helpFlagLine = regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`)
	helpAlias    = regexp.MustCompile(`the same as -`)
)

// Every flag a command takes is in its usage line, and no flag's default is
// said twice ("(default: …) (default -1)").
func TestUsageLineNamesEveryFlag(t *testing.T) {
	for _, c := range helpCommands() {
		_, o, _ := rpRun(append(append([]string{}, c...), "--help")...)
		usage, rest, _ := strings.Cut(o, "\n")
		_, flags, ok := strings.Cut(rest, "\nflags:\n")
		if !ok {
			t.Errorf("%v --help: no flags section", c)
			continue
		}
		entries := helpFlagLine.FindAllStringSubmatchIndex(flags, -1)
		for i, m := range entries {
			name := flags[m[2]:m[3]]
			end := len(flags)
			if i+1 < len(entries) {
				end = entries[i+1][0]
			}
			text := flags[m[0]:end]
			if strings.Count(text, "(default") > 1 {
				t.Errorf("%v: -%s says its default twice: %q", c, name, text)
			}
			if helpAlias.MatchString(text) {
				continue // an alias: the usage line names the flag it stands for
			}
			if !strings.Contains(usage+" ", "--"+name+" ") && !strings.Contains(usage, "--"+name+"]") && !strings.Contains(usage, "--"+name+"=") {
				t.Errorf("%v: the usage line leaves out --%s:\n%s", c, name, usage)
			}
		}
	}
}
