package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// v41OfficialMap is a name map for the official V4.1 directory layout (as
// a user would write for a dump of their own names): step files, the
// prefill state, the GPU RoPE tables; the weights are read by --weights or
// beside the dump, index_k_at is derived.
const v41OfficialMap = `{
 "name": "my-v41",
 "config": "config.json",
 "files": [
  {"file": "^step_(?P<step>\\d+)\\.safetensors$", "kind": "stage", "rules": [{"match": "^L(?P<layer>\\d+)\\.(?P<stage>.+)$"}]},
  {"file": "^prefill_state\\.safetensors$", "kind": "state", "state_after_prev": true, "rules": [{"match": "^L(?P<layer>\\d+)\\.(?P<stage>.+)$"}]},
  {"file": "^rope\\.safetensors$", "kind": "table", "rules": [{"match": "^(?P<stage>.+)$"}]},
  {"file": "^weights\\.safetensors$", "skip": true}
 ]
}`

// TestV41NativeCommands: synth --format native and native-pages write
// native V4.1 dumps that replay clean in both modes (the .smd file alone
// too), with --request and --weights; diff against the official-layout
// dump of the same seed agrees; a window-order fault injected by synth or
// by fault --in on the native dump is named exactly by replay, bisect and
// report (whose page names the model); --map reads the golden through a
// user's name map; the refusals and errors are one line.
func TestV41NativeCommands(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	runOK := func(want int, args ...string) string {
		t.Helper()
		out.Reset()
		errb.Reset()
		if code := run(args, &out, &errb); code != want {
			t.Fatalf("%v: exit %d, want %d: %s%s", args, code, want, out.String(), errb.String())
		}
		return out.String() + errb.String()
	}
	runOK(exitOK, "synth", "--config", "v41-tiny", "--format", "native", "--out", dir+"/n")
	runOK(exitOK, "synth", "--config", "v41-tiny", "--format", "native-pages", "--out", dir+"/p")
	runOK(exitOK, "synth", "--config", "v41-tiny", "--out", dir+"/o")
	runOK(exitOK, "synth", "--config", "v41-tiny", "--format", "native-pages", "--fault", "window-order@9,3", "--out", dir+"/w")
	for _, d := range []string{dir + "/n", dir + "/p", dir + "/n/dump.smd"} {
		for _, mode := range []string{"local", "propagated"} {
			s := runOK(exitOK, "replay", "--mode", mode, d)
			if !strings.Contains(s, "model: DeepSeek-V4.1") || !strings.Contains(s, "agree:") {
				t.Errorf("replay %s %s: %s", mode, d, s)
			}
		}
	}
	runOK(exitOK, "replay", "--request", "B", "--weights", dir+"/o/weights.safetensors", dir+"/p")
	runOK(exitOK, "replay", "--weights", dir+"/o", dir+"/o")
	// The native-pages dump holds the caches as KV pages, the official
	// layout as tensors: those are held by one side only, not compared
	// (incomplete); every other stage agrees, and both replays agree.
	s := runOK(exitIncomplete, "diff", dir+"/o", dir+"/p")
	if !strings.Contains(s, "both are right") || !strings.Contains(s, "kv_cache (64)") || !strings.Contains(s, "only A holds it") {
		t.Errorf("diff official native: %s", s)
	}
	const first = "first divergence: decode step 9, layer 3, stage topk_idxs — index list:"
	for _, args := range [][]string{{"replay", dir + "/w"}, {"bisect", dir + "/w"}, {"report", dir + "/w", "--html", dir + "/w.html"}} {
		if s := runOK(exitDiverged, args...); !strings.Contains(s, first) {
			t.Errorf("%v: %s", args, s)
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "w.html")); err != nil || !bytes.Contains(b, []byte("model: <b>DeepSeek-V4.1</b>")) {
		t.Errorf("report page does not name the model: %v", err)
	}
	s = runOK(exitOK, "fault", "--in", dir+"/p", "--out", dir+"/pf", "--fault", "topk-off-by-one@10,5")
	if !strings.Contains(s, "changed: p10/L5: index_sel") {
		t.Errorf("fault --in native: %s", s)
	}
	if s := runOK(exitDiverged, "replay", dir+"/pf"); !strings.Contains(s, "first divergence: decode step 10, layer 5, stage index_sel") ||
		!strings.Contains(s, `hypothesis "topk-off-by-one"`) {
		t.Errorf("replay fault --in native copy: %s", s)
	}
	if err := os.WriteFile(dir+"/map.json", []byte(v41OfficialMap), 0o644); err != nil {
		t.Fatal(err)
	}
	if s := runOK(exitOK, "replay", "--map", dir+"/map.json", goldenTestdata("v41-tiny")); !strings.Contains(s, "470 stages compared: 470 pass") {
		t.Errorf("replay --map golden: %s", s)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"replay", "--mode", "chained", dir + "/n"}, "--mode chained: not implemented for DeepSeek-V4.1 dumps"},
		{[]string{"replay", "--policy", "hf-eager", dir + "/n"}, "--policy hf-eager: DeepSeek-V4.1 has one numerics policy"},
		{[]string{"replay", "--request", "A", dir + "/n"}, `no stage records for request "A"`},
		{[]string{"replay", "--weights", dir + "/nothing", dir + "/n"}, "nothing: no such file or directory"},
		{[]string{"replay", "--request", "A", goldenTestdata("v41-tiny")}, "holds one request"},
		{[]string{"synth", "--config", "v41-tiny", "--format", "npz", "--out", dir + "/x"}, `--format "npz": official, native or native-pages`},
		{[]string{"synth", "--format", "official", "--out", dir + "/x"}, "a V4 synthetic dump is native only"},
	} {
		s := runOK(exitError, c.args...)
		if strings.Count(s, "\n") != 1 || !strings.Contains(s, c.want) {
			t.Errorf("%v: %q, want %q", c.args, s, c.want)
		}
	}
}
