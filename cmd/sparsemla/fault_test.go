package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/fault"
)

// ftDiagnosis is the diagnosis kind, as replay prints it, of each fault.
var ftDiagnosis = map[string]string{
	"splitk-merge":       "attention kernel",
	"wrong-lse":          "attention kernel",
	"fp8-scale":          "FP8 cache",
	"scale-byte":         "FP8 cache",
	"topk-off-by-one":    "indexer selection",
	"stale-prefix":       "prefix cache",
	"compressor-late":    "compressor",
	"window-order":       "index list",
	"expert-nibble":      "MoE experts",
	"router-bias":        "MoE router",
	"hc-post-transposed": "hyper-connections",
	// The kinds of issue 12's diagnoses of the whole step.
	"router-hash-off":        "MoE router",
	"router-unnormalised":    "MoE router",
	"expert-scale-block":     "MoE experts",
	"expert-no-clamp":        "MoE experts",
	"shared-gate-up-swapped": "MoE experts",
	"hc-split-no-sigmoid":    "hyper-connections",
	"head-no-norm":           "head",
}

// TestFaultCommandGPUDumps: for every fault kind that applies to the GPU
// dumps, 'fault' writes a copy that 'replay' (no flags: the weights are
// beside it) names at exactly the injected step, layer and stage with the
// fault's diagnosis, in text and in --json, with exit status 1.
func TestFaultCommandGPUDumps(t *testing.T) {
	cases := []struct{ dump, fault, stage string }{
		{"official-v4-tiny", "splitk-merge@5,1", "o"},
		{"official-v4-tiny", "wrong-lse@4,2", "o"},
		{"official-v4-tiny", "fp8-scale@3,0", "kv"},
		{"official-v4-tiny", "scale-byte@6,3", "kv_cache"},
		{"official-v4-tiny", "stale-prefix@6,1", "kv_cache"},
		{"official-v4-tiny", "compressor-late@3,1", "kv_cache"},
		{"official-v4-tiny", "window-order@2,0", "topk_idxs"},
		{"official-v4-tiny", "expert-nibble@4,2", "ffn_out"},
		{"official-v4-tiny", "router-bias@2,2", "moe_indices"},
		{"official-v4-tiny", "hc-post-transposed@7,3", "h_mid"},
		{"official-v4-tiny", "router-hash-off@3,0", "moe_indices"},
		{"official-v4-tiny", "router-unnormalised@3,2", "moe_weights"},
		{"official-v4-tiny", "expert-scale-block@4,1", "ffn_out"},
		{"official-v4-tiny", "shared-gate-up-swapped@5,2", "ffn_out"},
		{"official-v4-tiny", "hc-split-no-sigmoid@6,1", "hc_ffn_post"},
		{"official-v4-tiny", "head-no-norm@7,3", "logits"},
		{"gpu-v4-tiny-long", "topk-off-by-one@255,1", "index_topk"},
		{"gpu-v4-tiny-long", "scale-byte@128,3", "kv_cache"},
		{"gpu-v4-tiny-long", "compressor-late@255,2", "kv_cache"}, // HCA, r = 128
	}
	if len(ftDiagnosis) != len(fault.Kinds()) {
		t.Fatalf("ftDiagnosis covers %d kinds, engine has %d", len(ftDiagnosis), len(fault.Kinds()))
	}
	covered := map[string]bool{}
	for _, c := range cases {
		kind, at, _ := strings.Cut(c.fault, "@")
		covered[kind] = true
		var step int64
		var layer int
		if _, err := fmt.Sscanf(at, "%d,%d", &step, &layer); err != nil {
			t.Fatal(err)
		}
		t.Run(c.dump+"/"+c.fault, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "faulted")
			code, so, e := rpRun("fault", "--in", filepath.Join("..", "..", "testdata", c.dump), "--out", out, "--fault", c.fault)
			if code != exitOK {
				t.Fatalf("fault: exit %d\n%s%s", code, so, e)
			}
			if !strings.Contains(so, "replay it: sparsemla replay "+out) {
				t.Errorf("fault output does not say how to replay the copy:\n%s", so)
			}
			code, so, e = rpRun("replay", out)
			if code != exitDiverged {
				t.Fatalf("replay: exit %d\n%s%s", code, so, e)
			}
			want := fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: ", step, layer, c.stage, ftDiagnosis[kind])
			if !strings.Contains(so, want) {
				t.Fatalf("replay output lacks %q:\n%s", want, so)
			}
			code, so, e = rpRun("replay", "--json", out)
			if code != exitDiverged {
				t.Fatalf("replay --json: exit %d\n%s", code, e)
			}
			var rep struct {
				Dump  string `json:"dump"`
				First struct {
					Step  int64  `json:"step"`
					Layer int    `json:"layer"`
					Stage string `json:"stage"`
					Kind  string `json:"kind"`
				} `json:"first_divergence"`
			}
			if err := json.Unmarshal([]byte(so), &rep); err != nil {
				t.Fatal(err)
			}
			if rep.First.Step != step || rep.First.Layer != layer || rep.First.Stage != c.stage || rep.First.Kind != ftDiagnosis[kind] {
				t.Fatalf("JSON first divergence %+v, want step %d layer %d stage %s kind %s", rep.First, step, layer, c.stage, ftDiagnosis[kind])
			}
			if !strings.HasPrefix(rep.Dump, out) {
				t.Errorf("JSON names dump %q, want the copy %s", rep.Dump, out)
			}
		})
	}
	// expert-no-clamp cannot be written on these dumps (the clamp never
	// acts there: TestFaultCommandErrors).
	covered["expert-no-clamp"] = true
	if len(covered) != len(ftDiagnosis) {
		t.Errorf("cases cover %d of the %d fault kinds", len(covered), len(ftDiagnosis))
	}
}

// TestFaultCommandReport: 'report --html' on a faulted copy writes a page
// that names the first divergence and its diagnosis.
func TestFaultCommandReport(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "faulted")
	if code, so, e := rpRun("fault", filepath.Join("..", "..", "testdata", "official-v4-tiny"), "--out", out, "--fault", "stale-prefix@6,1", "--seed", "9"); code != exitOK {
		t.Fatalf("fault: exit %d\n%s%s", code, so, e)
	}
	page := filepath.Join(dir, "report.html")
	code, so, e := rpRun("report", out, "--html", page)
	if code != exitDiverged {
		t.Fatalf("report: exit %d\n%s%s", code, so, e)
	}
	b, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	html := string(b)
	for _, want := range []string{"decode step 6, layer 1, stage kv_cache", "prefix cache", "a stale page from that request", out} {
		if !strings.Contains(html, want) {
			t.Errorf("HTML report does not name %q", want)
		}
	}
}

// TestFaultCommandErrors: faults that cannot happen where asked, and bad
// arguments, exit 2 with one line on stderr and write nothing.
func TestFaultCommandErrors(t *testing.T) {
	tiny := filepath.Join("..", "..", "testdata", "official-v4-tiny")
	long := filepath.Join("..", "..", "testdata", "gpu-v4-tiny-long")
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--in", tiny, "--fault", "topk-off-by-one@7,1"}, "selects every one of its Tc = 2 compressed rows"},
		{[]string{"--in", tiny, "--fault", "topk-off-by-one@5,1"}, "step >= 67 on layer 1; this dump's decode steps (2..7) all come before it"},
		{[]string{"--in", long, "--fault", "topk-off-by-one@60,3"}, "from step 67 on; dumped steps that can: 126..128, 255..256"},
		{[]string{"--in", long, "--fault", "topk-off-by-one@255,2"}, "no indexer"},
		{[]string{"--in", tiny, "--fault", "compressor-late@5,3"}, "not an emission step"},
		{[]string{"--in", long, "--fault", "compressor-late@255,0"}, "no compressor"},
		{[]string{"--in", long, "--fault", "window-order@255,1"}, "no -1 padding"},
		{[]string{"--in", long, "--fault", "fp8-scale@200,0"}, "not a dumped decode step"},
		{[]string{"--in", tiny, "--fault", "gremlins@3,1"}, "unknown kind"},
		{[]string{"--in", tiny, "--fault", "router-hash-off@3,1"}, "it has no tid2eid lookup"},
		{[]string{"--in", tiny, "--fault", "router-bias@3,0"}, "it has no selection bias"},
		{[]string{"--in", tiny, "--fault", "head-no-norm@7,2"}, "the head runs after the last layer (3) only"},
		{[]string{"--in", tiny, "--fault", "expert-no-clamp@4,1"}, "the clamp does not act"},
		{[]string{"--in", long, "--fault", "expert-scale-block@255,1"}, "does not hold stage ffn_out"},
		{[]string{"--in", filepath.Join(tiny, "no-such-dump"), "--fault", "wrong-lse@3,1"}, "no-such-dump"},
		{[]string{"--fault", "wrong-lse@3,1"}, "see 'sparsemla fault --help'"},
		{[]string{"--in", tiny}, "see 'sparsemla fault --help'"},
	}
	for _, c := range cases {
		out := filepath.Join(t.TempDir(), "faulted")
		code, so, e := rpRun(append([]string{"fault", "--out", out}, c.args...)...)
		if code != exitError {
			t.Errorf("%v: exit %d, want %d\n%s%s", c.args, code, exitError, so, e)
		}
		if !strings.Contains(e, c.want) {
			t.Errorf("%v: stderr does not say %q:\n%s", c.args, c.want, e)
		}
		if strings.Count(strings.TrimSpace(e), "\n") != 0 {
			t.Errorf("%v: error is not one line: %q", c.args, e)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("%v: refused, but %s was written", c.args, out)
		}
	}
	if code, o, e := rpRun("fault", "--help"); code != exitOK || !strings.Contains(o, "usage: sparsemla fault") || e != "" {
		t.Errorf("fault --help: exit %d\n%s%s", code, o, e)
	}
}

// TestFaultCommandDownstream: the copy 'fault' writes is consistent
// downstream of the fault (README's stale-prefix walk-through and a split-K
// fault): its output says what it recomputed beyond the fault's layer and
// that nothing was left as dumped; a replay of the whole copy fails at the
// fault's stage only; replays of the steps after the fault agree (no layer
// link between the faulted layer and the next); and a tolerance loose
// enough to pass the faulty stage leaves nothing else to fail.
func TestFaultCommandDownstream(t *testing.T) {
	tiny := filepath.Join("..", "..", "testdata", "official-v4-tiny")
	for _, c := range []struct {
		fault, down string
		after       []string // --steps windows after the fault
		loose       string   // a --tol-stage passing the fault's stage ("": none)
	}{
		{"stale-prefix@6,1", "(step 6: layers 2, 3, logits; step 7: layers 1, 2, 3, logits)", []string{"7"}, ""},
		{"splitk-merge@5,1", "(step 5: layers 2, 3, logits; step 6: layers 2, 3, logits; step 7: layers 2, 3, logits)", []string{"6", "7", "6-7"}, "o=close,abs=100,rel=100,cos=1"},
	} {
		t.Run(c.fault, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "faulted")
			code, so, e := rpRun("fault", "--in", tiny, "--out", out, "--fault", c.fault)
			if code != exitOK {
				t.Fatalf("fault: exit %d\n%s%s", code, so, e)
			}
			if !strings.Contains(so, "  recomputed downstream from the faulty values: ") || !strings.Contains(so, c.down) {
				t.Errorf("fault output does not say %q:\n%s", c.down, so)
			}
			if strings.Contains(so, "not recomputed") {
				t.Errorf("fault output leaves something as dumped:\n%s", so)
			}
			code, so, e = rpRun("replay", out)
			if code != exitDiverged || !strings.Contains(so, " 1 fail;") {
				t.Errorf("replay: exit %d, want %d with one failing stage\n%s%s", code, exitDiverged, so, e)
			}
			for _, w := range c.after {
				code, so, e = rpRun("replay", "--steps", w, out)
				if code != exitOK || strings.Contains(so, "layer link") {
					t.Errorf("replay --steps %s: exit %d, want %d (every stage of the later steps follows from the copy's records)\n%s%s", w, code, exitOK, so, e)
				}
			}
			if c.loose != "" {
				code, so, e = rpRun("replay", "--tol-stage", c.loose, out)
				if code != exitOK || strings.Contains(so, "layer link") {
					t.Errorf("replay --tol-stage %s: exit %d, want %d\n%s%s", c.loose, code, exitOK, so, e)
				}
			}
		})
	}
}

// TestFaultV32GroupedRouter: README's V3.2 router faults. router-bias and
// router-groups-ignored are refused on testdata/v32-tiny (one expert group,
// no gate bias) with a pointer to the preset that takes them;
// v32-tiny-grouped takes both, in synth and in a faulted copy, and replay
// names each at its step with its hypothesis.
func TestFaultV32GroupedRouter(t *testing.T) {
	v32 := filepath.Join("..", "..", "testdata", "v32-tiny")
	for _, f := range []string{"router-bias@12,1", "router-groups-ignored@12,1"} {
		out := filepath.Join(t.TempDir(), "x")
		code, so, e := rpRun("fault", "--in", v32, "--out", out, "--fault", f)
		if code != exitError || !strings.Contains(e, "synth --config v32-tiny-grouped --whole") {
			t.Errorf("fault %s on v32-tiny: exit %d, want %d naming the preset\n%s%s", f, code, exitError, so, e)
		}
	}
	dir := t.TempDir()
	clean := filepath.Join(dir, "clean")
	if code, so, e := rpRun("synth", "--config", "v32-tiny-grouped", "--whole", "--out", clean); code != exitOK {
		t.Fatalf("synth: exit %d\n%s%s", code, so, e)
	}
	if code, so, e := rpRun("replay", clean); code != exitOK {
		t.Fatalf("replay of the clean grouped dump: exit %d\n%s%s", code, so, e)
	}
	for _, c := range []struct{ how, fault, hyp string }{
		{"synth", "router-groups-ignored@6,1", "v32-topk-ignoring-groups"},
		{"fault", "router-bias@10,1", "v32-no-selection-bias"},
		{"fault", "router-groups-ignored@6,1", "v32-topk-ignoring-groups"},
	} {
		out := filepath.Join(t.TempDir(), "out")
		args := []string{"synth", "--config", "v32-tiny-grouped", "--whole", "--out", out, "--fault", c.fault}
		if c.how == "fault" {
			args = []string{"fault", "--in", clean, "--out", out, "--fault", c.fault}
		}
		if code, so, e := rpRun(args...); code != exitOK {
			t.Fatalf("%v: exit %d\n%s%s", args, code, so, e)
		}
		kind, at, _ := strings.Cut(c.fault, "@")
		step, _, _ := strings.Cut(at, ",")
		code, so, e := rpRun("replay", out)
		want := fmt.Sprintf("first divergence: decode step %s, layer 1, stage moe_indices — MoE router: ", step)
		if code != exitDiverged || !strings.Contains(so, want) || !strings.Contains(so, fmt.Sprintf("hypothesis %q", c.hyp)) || !strings.Contains(so, " 1 fail;") {
			t.Errorf("%s %s: replay exit %d, want %d naming %q and %q\n%s%s", c.how, kind, code, exitDiverged, want, c.hyp, so, e)
		}
	}
}

// TestFaultV41WeightsCopied: fault --weights W on a DeepSeek-V4.1 dump
// (official layout and native) whose weights are not beside it copies W
// into the faulted copy, as the help says, so that 'replay DIR' (the
// command fault prints) runs with no flags; the copy used to have no
// weights and that replay failed.
func TestFaultV41WeightsCopied(t *testing.T) {
	dir := t.TempDir()
	official := filepath.Join(dir, "official")
	if err := os.CopyFS(official, os.DirFS(filepath.Join("..", "..", "testdata", "v41-tiny"))); err != nil {
		t.Fatal(err)
	}
	native := filepath.Join(dir, "native")
	if code, so, e := rpRun("synth", "--config", "v41-tiny", "--format", "native", "--out", native); code != exitOK {
		t.Fatalf("synth: exit %d\n%s%s", code, so, e)
	}
	for _, in := range []string{official, native} {
		w := filepath.Join(dir, filepath.Base(in)+"-weights")
		if err := os.Mkdir(w, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(in, "weights.safetensors"), filepath.Join(w, "weights.safetensors")); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, filepath.Base(in)+"-faulted")
		if code, so, e := rpRun("fault", in, "--weights", w, "--out", out, "--fault", "topk-off-by-one@13,2"); code != exitOK {
			t.Fatalf("fault %s: exit %d\n%s%s", in, code, so, e)
		}
		if code, so, e := rpRun("replay", out); code != exitDiverged || !strings.Contains(so, "decode step 13, layer 2") {
			t.Errorf("replay of the faulted copy of %s: exit %d\n%s%s", in, code, so, e)
		}
	}
}
