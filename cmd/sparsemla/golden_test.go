package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"sparsemla/dump"
)

// TestGoldenOutput is the byte-identity test: every command (replay in text
// and --json in both modes, diff, bisect, report --html, inspect, explain,
// fault, synth, demo, help) runs on every committed testdata dump, on
// synthetic dumps made by synth and on faulted copies made by fault, and
// every case of the bad-input table (testdata/bad/cases.json) runs too; its
// exit status, stdout, stderr and written files must equal the outputs
// recorded in testdata/golden-output (temporary directories normalised to
// $TMP). Text files are stored whole (gzipped when over goldenGzipOver
// bytes); binary files written by synth, fault and demo --keep by size and
// SHA-256. Regenerate after an intended change of output with
//
//	go test -run TestGoldenOutput ./cmd/sparsemla -args -update-golden
//
// and read the diff: any change it shows is a change of behaviour.

var updateGolden = flag.Bool("update-golden", false, "TestGoldenOutput: rewrite cmd/sparsemla/testdata/golden-output from the current code")

const (
	goldenDir      = "testdata/golden-output"
	goldenGzipOver = 24 << 10
)

// goldenCase is one command line and the files it writes (relative to $TMP)
// that are part of its output.
type goldenCase struct {
	name  string
	args  []string
	files []string
}

// goldenTestdata returns the path of a committed testdata dump.
func goldenTestdata(p string) string {
	return filepath.Join("..", "..", "testdata", filepath.FromSlash(p))
}

// goldenSynth are the synthetic dumps the test writes with synth (name, flags).
var goldenSynth = [][2]string{
	{"synth-clean", "--steps 4 --seed 11"},
	{"synth-splitk", "--steps 4 --seed 11 --fault splitk-merge@8,1"},
	{"synth-lse", "--steps 4 --seed 11 --fault wrong-lse@8,1"},
	{"synth-fp8", "--steps 4 --seed 11 --fault fp8-scale@7,0"},
	{"synth-scalebyte", "--steps 6 --seed 4 --fault scale-byte@9,2"},
	{"synth-topk", "--steps 4 --seed 3 --fault topk-off-by-one@8,1"},
	{"synth-stale", "--steps 6 --seed 11 --fault stale-prefix@9,3"},
	{"synth-late", "--steps 4 --seed 11 --fault compressor-late@7,1"},
	{"synth-order", "--steps 4 --seed 11 --fault window-order@8,0"},
}

// goldenFaults are the faulted copies the test writes with fault (name,
// input dump, flags).
var goldenFaults = [][3]string{
	{"fault-official-splitk", "official-v4-tiny", "--fault splitk-merge@5,1"},
	{"fault-official-lse", "official-v4-tiny", "--fault wrong-lse@4,2"},
	{"fault-official-fp8", "official-v4-tiny", "--fault fp8-scale@3,0"},
	{"fault-official-scalebyte", "official-v4-tiny", "--fault scale-byte@6,3"},
	{"fault-official-stale", "official-v4-tiny", "--fault stale-prefix@6,1"},
	{"fault-official-stale9", "official-v4-tiny", "--fault stale-prefix@6,1 --seed 9"},
	{"fault-official-late", "official-v4-tiny", "--fault compressor-late@3,1"},
	{"fault-official-order", "official-v4-tiny", "--fault window-order@2,0"},
	{"fault-official-hash", "official-v4-tiny", "--fault router-hash-off@3,0"},
	{"fault-official-expertscale", "official-v4-tiny", "--fault expert-scale-block@4,1"},
	{"fault-long-topk", "gpu-v4-tiny-long", "--fault topk-off-by-one@255,1"},
	{"fault-long-scalebyte", "gpu-v4-tiny-long", "--fault scale-byte@128,3"},
	{"fault-long-late", "gpu-v4-tiny-long", "--fault compressor-late@255,2"},
	{"fault-synth-lse", "$TMP/synth-clean", "--fault wrong-lse@9,1"},
}

// goldenBadDumps are committed dumps the replay commands refuse (no usable
// model or weights); their errors are output too.
var goldenBadDumps = []string{
	"dump/official-v4-tiny",
	"dump/capture/capture_smoke.smd",
	"dump/capture/capture_split",
	"dump/native/all_dtypes.smd",
	"dump/capture/capture_smoke.npz",
	"dump/capture/st_ref.safetensors",
}

// goldenCases lists every case in the order they run (synth and fault first:
// later cases read what they write).
func goldenCases() []goldenCase {
	var cs []goldenCase
	add := func(name string, files []string, args ...string) {
		cs = append(cs, goldenCase{name: name, args: args, files: files})
	}
	words := strings.Fields
	for _, s := range goldenSynth {
		add("synth/"+s[0], []string{s[0]}, append([]string{"synth", "--out", "$TMP/" + s[0]}, words(s[1])...)...)
	}
	add("synth/refused-kind", nil, "synth", "--out", "$TMP/refused1", "--fault", "gremlins@1,1")
	add("synth/refused-step", nil, "synth", "--out", "$TMP/refused2", "--fault", "topk-off-by-one@7,0")
	for _, f := range goldenFaults {
		in := f[1]
		if !strings.HasPrefix(in, "$TMP") {
			in = goldenTestdata(in)
		}
		add("fault/"+f[0], []string{f[0]}, append([]string{"fault", "--in", in, "--out", "$TMP/" + f[0]}, words(f[2])...)...)
	}
	add("fault/positional", []string{"fault-positional"}, "fault", goldenTestdata("official-v4-tiny"), "--out", "$TMP/fault-positional", "--fault", "wrong-lse@4,2", "--reference")
	add("fault/refused-layer", nil, "fault", "--in", goldenTestdata("official-v4-tiny"), "--out", "$TMP/refused3", "--fault", "topk-off-by-one@5,0")
	add("fault/refused-kind", nil, "fault", "--in", goldenTestdata("official-v4-tiny"), "--out", "$TMP/refused4", "--fault", "gremlins@3,1")
	add("fault/refused-hash-layer", nil, "fault", "--in", goldenTestdata("official-v4-tiny"), "--out", "$TMP/refused6", "--fault", "router-hash-off@3,1")
	add("fault/refused-no-clamp", nil, "fault", "--in", goldenTestdata("official-v4-tiny"), "--out", "$TMP/refused7", "--fault", "expert-no-clamp@4,1")
	add("synth/refused-block", nil, "synth", "--out", "$TMP/refused8", "--fault", "head-no-norm@7,3")
	// The whole synthetic model (synth --whole): clean in every mode, and a
	// fault of the whole layer found where it was injected.
	add("synth/whole-clean", []string{"synth-whole"}, "synth", "--whole", "--out", "$TMP/synth-whole", "--steps", "3", "--seed", "11")
	add("synth/whole-router", []string{"synth-whole-router"}, "synth", "--whole", "--out", "$TMP/synth-whole-router", "--steps", "3", "--seed", "11", "--fault", "router-bias@8,2")
	// The clamp left out at step 9, layer 1 stays inside the chained
	// tolerance there; the chain first leaves it at step 9, layer 3
	// (iw_raw), and the teacher-forced check names ffn_out of layer 1.
	add("synth/whole-noclamp", []string{"synth-whole-noclamp"}, "synth", "--whole", "--out", "$TMP/synth-whole-noclamp", "--steps", "4", "--fault", "expert-no-clamp@9,1")
	for _, m := range []string{"local", "propagated", "chained"} {
		add("synth-whole/replay-"+m, nil, "replay", "--mode", m, "$TMP/synth-whole")
		add("synth-whole-router/replay-"+m, nil, "replay", "--mode", m, "$TMP/synth-whole-router")
		add("synth-whole-noclamp/replay-"+m, nil, "replay", "--mode", m, "$TMP/synth-whole-noclamp")
	}
	// Drift: ffn_out judged by cos_diff 1e-4 in the chain of the clean GPU
	// golden; teacher-forced nothing is out of tolerance, no stage is blamed.
	add("official-v4-tiny/replay-chained-drift", nil, "replay", "--mode", "chained", "--tol-stage", "ffn_out=close,abs=1e30,cos=1e-4", goldenTestdata("official-v4-tiny"))

	type dumpAt struct{ name, dir, inspect string }
	var dumps []dumpAt
	for _, g := range []string{"official-v4-tiny", "gpu-v4-tiny-long"} {
		dumps = append(dumps, dumpAt{g, goldenTestdata(g), goldenTestdata(g)})
	}
	for _, s := range goldenSynth {
		dumps = append(dumps, dumpAt{s[0], "$TMP/" + s[0], "$TMP/" + s[0] + "/dump.smd"})
	}
	for _, f := range goldenFaults {
		dumps = append(dumps, dumpAt{f[0], "$TMP/" + f[0], "$TMP/" + f[0]})
	}
	for _, d := range dumps {
		n := d.name + "/"
		add(n+"replay", nil, "replay", d.dir)
		add(n+"replay-json", nil, "replay", "--json", d.dir)
		add(n+"replay-propagated", nil, "replay", "--mode", "propagated", d.dir)
		add(n+"replay-propagated-json", nil, "replay", "--json", "--mode", "propagated", d.dir)
		add(n+"bisect", nil, "bisect", d.dir)
		add(n+"bisect-json", nil, "bisect", "--json", d.dir)
		html := "$TMP/html/" + d.name + ".html"
		add(n+"report", []string{"html/" + d.name + ".html"}, "report", d.dir, "--html", html)
		add(n+"inspect", nil, "inspect", d.inspect)
		add(n+"inspect-summary-json", nil, "inspect", "--json", "--summary", d.inspect)
	}
	for _, d := range []string{"official-v4-tiny", "gpu-v4-tiny-long", "synth-lse", "fault-official-stale"} {
		p := goldenTestdata(d)
		if strings.HasPrefix(d, "synth") || strings.HasPrefix(d, "fault") {
			p = "$TMP/" + d
		}
		add(d+"/replay-reference-json", nil, "replay", "--json", "--reference", p)
		add(d+"/replay-propagated-reference", nil, "replay", "--mode", "propagated", "--reference", p)
		add(d+"/inspect-json", nil, "inspect", "--json", p)
		add(d+"/report-propagated-json", []string{"html/" + d + "-propagated.html"}, "report", p, "--mode", "propagated", "--json", "--html", "$TMP/html/"+d+"-propagated.html")
	}
	off := goldenTestdata("official-v4-tiny")
	long := goldenTestdata("gpu-v4-tiny-long")
	add("official-v4-tiny/replay-steps", nil, "replay", "--steps", "3-4,6", off)
	add("official-v4-tiny/inspect-index-only", nil, "inspect", "--index-only", off)
	add("official-v4-tiny/inspect-filter", nil, "inspect", "--filter", "L1/(q|kv)$", off)
	add("gpu-v4-tiny-long/inspect-filter-json", nil, "inspect", "--json", "--filter", "p255/L2/", long)
	add("synth-lse/replay-tol-stage", nil, "replay", "--tol-stage", "o=close,abs=2e-3,rel=0.02,cos=1e-5", "$TMP/synth-lse")
	add("synth-lse/replay-tol-stage-ulp", nil, "replay", "--json", "--tol-stage", "u=ulp,max_ulp=3", "$TMP/synth-lse")
	add("synth-stale/bisect-reference-json", nil, "bisect", "--json", "--reference", "$TMP/synth-stale")
	v32 := goldenTestdata("v32-tiny") // DeepSeek-V3.2 (DSA): the official model.py's GPU dump
	add("v32-tiny/replay", nil, "replay", v32)
	add("v32-tiny/replay-propagated", nil, "replay", "--mode", "propagated", v32)
	add("v32-tiny/replay-tol-stage-absent", nil, "replay", "--tol-stage", "o=exact", "--tol-stage", "q_a=exact", v32)
	add("v32-tiny/explain", nil, "explain", "--config", "v32-tiny", "--step", "20")

	// DeepSeek-V4.1: the official model.py's GPU golden, synthetic dumps,
	// faulted copies of the golden; every replay command on them.
	v41 := goldenTestdata("v41-tiny")
	add("synth/v41-clean", []string{"v41-clean"}, "synth", "--config", "v41-tiny", "--steps", "4", "--seed", "3", "--out", "$TMP/v41-clean")
	add("synth/v41-order", []string{"v41-order"}, "synth", "--config", "v41-tiny", "--steps", "4", "--seed", "3", "--fault", "window-order@8,3", "--out", "$TMP/v41-order")
	add("fault/v41-golden-order", []string{"v41-fault-order"}, "fault", "--in", v41, "--out", "$TMP/v41-fault-order", "--fault", "window-order@13,4")
	add("fault/v41-golden-topk", []string{"v41-fault-topk"}, "fault", "--in", v41, "--out", "$TMP/v41-fault-topk", "--fault", "topk-off-by-one@14,2")
	add("fault/v41-refused-kind", nil, "fault", "--in", v41, "--out", "$TMP/refused-v41a", "--fault", "wrong-lse@13,2")
	add("fault/v41-refused-layer", nil, "fault", "--in", v41, "--out", "$TMP/refused-v41b", "--fault", "topk-off-by-one@13,3")
	for _, d := range []struct{ name, dir string }{{"v41-tiny", v41}, {"v41-clean", "$TMP/v41-clean"}, {"v41-order", "$TMP/v41-order"},
		{"v41-fault-order", "$TMP/v41-fault-order"}, {"v41-fault-topk", "$TMP/v41-fault-topk"}} {
		n := d.name + "/"
		add(n+"replay", nil, "replay", d.dir)
		add(n+"replay-propagated", nil, "replay", "--mode", "propagated", d.dir)
		add(n+"bisect", nil, "bisect", d.dir)
		html := "$TMP/html/" + d.name + ".html"
		add(n+"report", []string{"html/" + d.name + ".html"}, "report", d.dir, "--html", html)
	}
	add("v41-tiny/replay-json", nil, "replay", "--json", v41)
	add("v41-fault-topk/replay-json", nil, "replay", "--json", "--steps", "14", "$TMP/v41-fault-topk")
	add("v41-fault-order/bisect-json", nil, "bisect", "--json", "$TMP/v41-fault-order")
	add("v41-tiny/replay-steps", nil, "replay", "--steps", "13-14", v41)
	add("v41-tiny/replay-tol-stage", nil, "replay", "--tol-stage", "o=exact", v41)
	add("v41-tiny/replay-refused-chained", nil, "replay", "--mode", "chained", v41)
	add("synth/v41-native", []string{"v41-native"}, "synth", "--config", "v41-tiny", "--format", "native-pages", "--steps", "2", "--seed", "3", "--fault", "window-order@7,3", "--out", "$TMP/v41-native")
	add("v41-native/replay", nil, "replay", "$TMP/v41-native")
	add("v41-native/replay-propagated", nil, "replay", "--mode", "propagated", "$TMP/v41-native")
	add("v41-tiny/replay-refused-step", nil, "replay", "--steps", "3", v41)
	// The whole V4.1 golden with hc_post's comb transposed at step 14,
	// layer 1: h_mid stays inside the propagated tolerance, the chain
	// first leaves it at layer 5 (index_sel); both modes name h_mid.
	add("fault/v41-whole-hcpost", []string{"v41-whole-hcpost"}, "fault", "--in", goldenTestdata("v41-tiny-whole"), "--out", "$TMP/v41-whole-hcpost", "--fault", "hc-post-transposed@14,1")
	add("v41-whole-hcpost/replay", nil, "replay", "$TMP/v41-whole-hcpost")
	add("v41-whole-hcpost/replay-propagated", nil, "replay", "--mode", "propagated", "$TMP/v41-whole-hcpost")
	add("diff/v41-golden-topk", nil, "diff", v41, "$TMP/v41-fault-topk")
	add("diff/v41-golden-order-json", nil, "diff", "--json", v41, "$TMP/v41-fault-order")
	add("diff/v41-synth-order", nil, "diff", "$TMP/v41-clean", "$TMP/v41-order")
	add("diff/v41-golden-synth", nil, "diff", v41, "$TMP/v41-clean")
	add("diff/v41-v4", nil, "diff", v41, off)

	// diff: every faulted copy against its input, with and without the referee.
	for _, f := range goldenFaults {
		a := goldenTestdata(f[1])
		if strings.HasPrefix(f[1], "$TMP") {
			a = f[1]
		}
		add("diff/"+f[0], nil, "diff", a, "$TMP/"+f[0])
		add("diff/"+f[0]+"-json", nil, "diff", "--json", a, "$TMP/"+f[0])
	}
	for _, s := range goldenSynth[1:] {
		add("diff/"+s[0], nil, "diff", "$TMP/synth-clean", "$TMP/"+s[0])
	}
	add("diff/synth-lse-json", nil, "diff", "--json", "$TMP/synth-clean", "$TMP/synth-lse")
	add("diff/synth-lse-stale-reference", nil, "diff", "--json", "--reference", "$TMP/synth-lse", "$TMP/synth-stale")
	add("diff/official-itself", nil, "diff", off, off)
	add("diff/official-long", nil, "diff", off, long)
	add("diff/weights-not-there", nil, "diff", "--weights", "$TMP/no-such-weights", "$TMP/synth-clean", "$TMP/synth-lse")
	add("diff/stale-no-weights", nil, "diff", "$TMP/fault-official-stale/dump.smd", off)

	for _, b := range goldenBadDumps {
		p := goldenTestdata(b)
		n := "bad/" + strings.ReplaceAll(b, "/", "_") + "/"
		var m []string
		if strings.HasSuffix(b, ".npz") {
			m = []string{"--map", goldenTestdata("dump/capture/smoke-npz.map.json")}
		}
		add(n+"replay", nil, append(append([]string{"replay"}, m...), p)...)
		add(n+"replay-json-propagated", nil, append(append([]string{"replay", "--json", "--mode", "propagated"}, m...), p)...)
		add(n+"bisect", nil, append(append([]string{"bisect"}, m...), p)...)
		add(n+"report", nil, append(append([]string{"report", "--html", "$TMP/html/bad.html"}, m...), p)...)
		add(n+"diff", nil, append(append([]string{"diff"}, m...), p, p)...)
		add(n+"fault", nil, append(append([]string{"fault", "--out", "$TMP/refused5", "--fault", "wrong-lse@5,1"}, m...), p)...)
		add(n+"inspect", nil, append(append([]string{"inspect"}, m...), p)...)
		add(n+"inspect-json", nil, append(append([]string{"inspect", "--json"}, m...), p)...)
	}
	add("bad/replay-missing", nil, "replay", "$TMP/no-such-dump")
	add("bad/replay-mode", nil, "replay", "--mode", "sideways", off)
	add("bad/replay-tol-stage", nil, "replay", "--tol-stage", "o=fuzzy", off)
	add("bad/replay-steps", nil, "replay", "--steps", "9-7", off)

	for _, e := range [][]string{
		{},
		{"--layer", "0", "--step", "7"},
		{"--layer", "1", "--step", "7"},
		{"--layer", "2", "--step", "127"},
		{"--layer", "3", "--step", "8", "--seed", "2", "--values", "6"},
		{"--layer", "1", "--step", "3"},
		{"--config", "flash", "--layer", "2", "--step", "300"},
		{"--layer", "9"},
		{"--step", "0"},
		{"--config", "huge"},
		{"--config", "v41-tiny", "--step", "11"},
		{"--config", "v41-tiny", "--layer", "3", "--step", "6"},
	} {
		name := "explain/default"
		if len(e) > 0 {
			name = "explain/" + strings.ReplaceAll(strings.Join(e, "_"), "-", "")
		}
		add(name, nil, append([]string{"explain"}, e...)...)
	}
	add("demo/default", nil, "demo")
	add("demo/reference", nil, "demo", "--reference")
	add("demo/keep", []string{"demo"}, "demo", "--keep", "$TMP/demo")

	add("help/help", nil, "help")
	add("help/none", nil)
	add("help/unknown", nil, "frobnicate")
	for _, c := range []string{"replay", "diff", "bisect", "report", "inspect", "explain", "synth", "fault", "demo", "prefix"} {
		add("help/"+c, nil, c, "--help")
	}
	add("help/help-replay", nil, "help", "replay")

	// Prefix-cache decisions: the event-stream fixtures, a real dump (no
	// hits recorded), synthetic runs with a decision fault.
	add("prefix/vllm-fixture", nil, "prefix", goldenTestdata("prefixcheck/vllm-kv-events.msgpack"), "--window", "4", "--ratios", "0,4,128")
	add("prefix/sglang-json", nil, "prefix", "--json", goldenTestdata("prefixcheck/sglang-kv-events.msgpack"))
	add("prefix/sglang-perpage", nil, "prefix", goldenTestdata("prefixcheck/sglang-perpage-kv-events.msgpack"), "--page", "1", "--window", "4", "--ratios", "0,4,128")
	add("prefix/sglang-salted", nil, "prefix", goldenTestdata("prefixcheck/sglang-salted-kv-events.msgpack"), "--window", "4", "--ratios", "0,4,128")
	add("prefix/sglang-perpage-as-chained", nil, "prefix", goldenTestdata("prefixcheck/sglang-perpage-kv-events.msgpack"), "--hash-scheme", "chained", "--window", "4", "--ratios", "0,4,128")
	add("prefix/official-tiny", nil, "prefix", goldenTestdata("official-v4-tiny"), "--page", "64")
	add("prefix/safetensors-hits", nil, "prefix", goldenTestdata("prefixcheck/safetensors-hits"), "--page", "4")
	add("synth/prefix-eviction", []string{"prefix-eviction.msgpack"}, "synth", "--prefix", "eviction", "--out", "$TMP/prefix-eviction.msgpack", "--fault", "evicted-page@20")
	add("prefix/synth-eviction", nil, "prefix", "$TMP/prefix-eviction.msgpack", "--window", "8", "--ratios", "0,4,128")
	add("synth/prefix-native", []string{"prefix-native.smd"}, "synth", "--prefix", "branching", "--form", "native", "--out", "$TMP/prefix-native.smd", "--fault", "hit-too-long@10")
	add("prefix/synth-native", nil, "prefix", "$TMP/prefix-native.smd", "--page", "16", "--window", "8", "--ratios", "0,4,128")
	return cs
}

// goldenUnstable normalises output that is not deterministic today, per
// case: dump.NewSafetensors checks its header's tensors in map order, so of a
// file whose data area is cut short (several tensors out of range) it names
// a random one (a dump bug, reported; the case keeps its exit status and the
// rest of its line).
var goldenUnstable = map[string]*regexp.Regexp{
	"badcorpus/replay/weights-truncated": regexp.MustCompile(`tensor "[^"]*": data_offsets \[[0-9]+, [0-9]+\]`),
}

// demoTemp matches the demo's temporary directory (os.MkdirTemp's suffix).
var demoTemp = regexp.MustCompile(`sparsemla-demo-[0-9]+`)

// goldenBadCases are the cases of testdata/bad/cases.json (TestBadCorpus),
// their inputs made under $TMP/bad-in by badMakers from the synthetic base
// dump ($BADBASE) where the case says so.
func goldenBadCases(t *testing.T, tmp string) []goldenCase {
	base := badBase(t)
	var cs []goldenCase
	for _, c := range loadBadCases(t) {
		in := filepath.Join(badDir, c.File)
		if c.File == "" {
			in = ""
		}
		if c.Make != "" {
			mk, ok := badMakers[c.Make]
			if !ok {
				t.Fatalf("unknown make %q", c.Make)
			}
			dir := filepath.Join(tmp, "bad-in", strings.ReplaceAll(c.Name, "/", "_"))
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			in = strings.ReplaceAll(mk(t, base, dir, in), tmp, "$TMP")
		}
		args := make([]string, len(c.Args))
		for j, a := range c.Args {
			out := fmt.Sprintf("$TMP/bad-out/%s-%d", strings.ReplaceAll(c.Name, "/", "_"), j)
			if strings.Contains(a, "{tmp}") {
				if err := os.MkdirAll(strings.ReplaceAll(out, "$TMP", tmp), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			args[j] = strings.NewReplacer("{in}", in, "{base}", "$BADBASE", "{tmp}", out).Replace(a)
		}
		cs = append(cs, goldenCase{name: "badcorpus/" + c.Name, args: args})
	}
	return cs
}

// goldenRun runs one case and returns its recorded output.
func goldenRun(t *testing.T, tmp string, c goldenCase) string {
	bb := ""
	if badBaseDir != "" {
		bb = badBaseDir
	}
	args := make([]string, len(c.args))
	for i, a := range c.args {
		args[i] = strings.ReplaceAll(a, "$TMP", tmp)
		if bb != "" {
			args[i] = strings.ReplaceAll(args[i], "$BADBASE", bb)
		}
	}
	code, stdout, stderr := rpRun(args...)
	norm := func(s string) string {
		if bb != "" {
			s = strings.ReplaceAll(s, bb, "$BADBASE")
		}
		if re := goldenUnstable[c.name]; re != nil {
			s = re.ReplaceAllString(s, `tensor "…": data_offsets […]`)
		}
		return demoTemp.ReplaceAllString(strings.ReplaceAll(s, tmp, "$TMP"), "sparsemla-demo-X")
	}
	var b strings.Builder
	fmt.Fprintf(&b, "$ sparsemla %s\nexit %d\n--- stdout\n%s--- stderr\n%s", strings.Join(c.args, " "), code, norm(stdout), norm(stderr))
	for _, f := range c.files {
		p := filepath.Join(tmp, filepath.FromSlash(f))
		fi, err := os.Stat(p)
		if err != nil {
			fmt.Fprintf(&b, "--- file %s: missing\n", f)
			continue
		}
		if !fi.IsDir() {
			goldenFile(t, &b, tmp, p, f, norm)
			continue
		}
		var names []string
		filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				names = append(names, q)
			}
			return err
		})
		sort.Strings(names)
		for _, q := range names {
			rel, _ := filepath.Rel(tmp, q)
			goldenFile(t, &b, tmp, q, filepath.ToSlash(rel), norm)
		}
	}
	return b.String()
}

// goldenFile appends one written file: text whole, binary by size and hash.
func goldenFile(t *testing.T, b *strings.Builder, tmp, path, name string, norm func(string) string) {
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ext := filepath.Ext(name)
	if ext == ".html" || ext == ".json" || ext == ".txt" {
		fmt.Fprintf(b, "--- file %s\n%s\n", name, norm(string(data)))
		return
	}
	if ext == ".smd" && bytes.Contains(data, []byte(tmp)) {
		// A native dump faulted from a dump in $TMP records its input's
		// path, whose length varies: hash what it holds instead.
		fmt.Fprintf(b, "--- file %s: native dump, content sha256 %x\n", name, goldenDumpHash(t, path, tmp))
		return
	}
	fmt.Fprintf(b, "--- file %s: %d bytes, sha256 %x\n", name, len(data), sha256.Sum256(data))
}

// goldenDumpHash hashes the header (with $TMP normalised), prefix hits and
// every record (key, kind, dtype, shape, page, data) of a native dump.
func goldenDumpHash(t *testing.T, path, tmp string) [32]byte {
	d, err := dump.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	h := sha256.New()
	hd := d.Header
	head := fmt.Sprintf("%q %v %v %v %v %v\n", hd.ModelArgs, hd.CompressRatios, hd.DTypePolicy, hd.Producer, hd.User, d.Prefix)
	io.WriteString(h, strings.ReplaceAll(head, tmp, "$TMP"))
	for i := range d.Entries {
		e := &d.Entries[i]
		r, err := d.Read(e)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(h, "%s %v %v %v %+v %d\n", e.Key, e.Kind, e.DType, e.Shape, e.Page, len(r.Data))
		h.Write(r.Data)
	}
	var sum [32]byte
	copy(sum[:], h.Sum(nil))
	return sum
}

// goldenPath is the file holding a case's output.
func goldenPath(name string, gz bool) string {
	p := filepath.Join(goldenDir, filepath.FromSlash(name)+".txt")
	if gz {
		p += ".gz"
	}
	return p
}

func readGolden(name string) (string, error) {
	if b, err := os.ReadFile(goldenPath(name, false)); err == nil {
		return string(b), nil
	}
	f, err := os.Open(goldenPath(name, true))
	if err != nil {
		return "", err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return "", err
	}
	b, err := io.ReadAll(zr)
	return string(b), err
}

func writeGolden(name, out string) error {
	if err := os.MkdirAll(filepath.Dir(goldenPath(name, false)), 0o755); err != nil {
		return err
	}
	if len(out) <= goldenGzipOver {
		return os.WriteFile(goldenPath(name, false), []byte(out), 0o644)
	}
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	zw.Write([]byte(out))
	if err := zw.Close(); err != nil {
		return err
	}
	return os.WriteFile(goldenPath(name, true), buf.Bytes(), 0o644)
}

// goldenFirstDiff describes the first differing line of got and want.
func goldenFirstDiff(got, want string) string {
	g, w := bufio.NewScanner(strings.NewReader(got)), bufio.NewScanner(strings.NewReader(want))
	g.Buffer(nil, 1<<26)
	w.Buffer(nil, 1<<26)
	for line := 1; ; line++ {
		gok, wok := g.Scan(), w.Scan()
		if !gok && !wok {
			return "same lines, different bytes (line endings?)"
		}
		if gok != wok || g.Text() != w.Text() {
			return fmt.Sprintf("line %d:\n  got:  %q\n  want: %q", line, g.Text(), w.Text())
		}
	}
}

func TestGoldenOutput(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the byte-identity test replays every dump (about a minute)")
	}
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // the demo's temporary directory, normalised
	if err := os.MkdirAll(filepath.Join(tmp, "html"), 0o755); err != nil {
		t.Fatal(err)
	}
	cases := append(goldenCases(), goldenBadCases(t, tmp)...)
	seen := map[string]bool{}
	for _, c := range cases {
		if seen[c.name] {
			t.Fatalf("duplicate golden case %s", c.name)
		}
		seen[c.name] = true
	}
	if *updateGolden {
		// Drop every stored output (not the README): a dropped case leaves
		// no stale file.
		for _, p := range goldenFiles(t) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, c := range cases {
		got := goldenRun(t, tmp, c)
		if *updateGolden {
			if err := writeGolden(c.name, got); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := readGolden(c.name)
		if err != nil {
			t.Errorf("%s: no golden output (%v); run with -update-golden", c.name, err)
			continue
		}
		if got != want {
			t.Errorf("%s: output differs from %s at %s", c.name, goldenDir, goldenFirstDiff(got, want))
		}
	}
	if *updateGolden {
		return
	}
	// Every stored output belongs to a case (a stale file would hide a case
	// that was dropped).
	for _, p := range goldenFiles(t) {
		rel, _ := filepath.Rel(goldenDir, p)
		name := strings.TrimSuffix(strings.TrimSuffix(filepath.ToSlash(rel), ".gz"), ".txt")
		if !seen[name] {
			t.Errorf("%s belongs to no case", p)
		}
	}
}

// goldenFiles lists the stored outputs (.txt, .txt.gz) under goldenDir.
func goldenFiles(t *testing.T) []string {
	var out []string
	err := filepath.WalkDir(goldenDir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && (strings.HasSuffix(p, ".txt") || strings.HasSuffix(p, ".txt.gz")) {
			out = append(out, p)
		}
		return err
	})
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return out
}
