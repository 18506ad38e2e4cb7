package dump

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestOpenNativeDirWithWeights opens a directory as synth and fault write it
// (dump.smd beside weights.safetensors and config.json): it is the native
// dump, the weights are not records, and every command sees the same thing.
// Any other non-native file beside the .smd files is still refused.
func TestOpenNativeDirWithWeights(t *testing.T) {
	dir := t.TempDir()
	recs := keyed()
	if err := os.WriteFile(filepath.Join(dir, "dump.smd"), writeNative(t, recs), 0o644); err != nil {
		t.Fatal(err)
	}
	// The weights file's content does not matter: it is not indexed.
	for name, body := range map[string]string{WeightsFile: "not read as records", "config.json": `{"dim": 256}`} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if d.Format != "native" || len(d.Entries) != len(recs) {
		t.Errorf("format %q, %d entries; want native, %d", d.Format, len(d.Entries), len(recs))
	}
	for _, e := range d.Entries {
		if filepath.Base(e.File) != "dump.smd" {
			t.Errorf("entry %s from %s", e.Key, e.File)
		}
	}
	d.Close()

	if err := os.WriteFile(filepath.Join(dir, "step_3.safetensors"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "mixes native .smd files") {
		t.Errorf("a step safetensors file beside dump.smd: err %v, want the mixed-formats refusal", err)
	}
}
