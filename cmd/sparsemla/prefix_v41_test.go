package main

import (
	"strings"
	"testing"
)

// TestPrefixV41: prefix with a DeepSeek-V4.1 config resumes with V4.1's
// rules: compress ratios only at the KV sources (layers 2 and 5 of
// v41-tiny, r = 2 and 1), no ratio-4 halo, index keys one per r tokens of
// the key-owning sources (at 8 tokens: 8 from layer 5's r = 1), the open
// r = 2 group's state.
func TestPrefixV41(t *testing.T) {
	code, out, e := rpRun("prefix", "--config", "v41-tiny", "--json", "../../testdata/prefixcheck/vllm-kv-events.msgpack")
	if code != exitDiverged {
		t.Fatalf("exit %d: %s", code, e)
	}
	for _, want := range []string{`"compress_ratios": [
      0,
      0,
      2,
      0,
      0,
      1,
      0,
      0
    ]`, `"at": 8,
        "window_from": 0,
        "state_from": 8,
        "index_keys": 8,
        "ratio4_halo": false`} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out[:min(len(out), 2000)])
		}
	}
}
