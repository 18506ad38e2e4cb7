package dump

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/dump/native/all_dtypes.smd")

const goWritten = "../testdata/dump/native/all_dtypes.smd"

// TestNativeGoldenBytes pins the native format: the writer must produce the
// committed file byte for byte (run with -update after a deliberate format
// change, and bump Version if old readers would misread it). The same file
// is read by capture/tests/gpu_smoke.py to check the Python reader.
func TestNativeGoldenBytes(t *testing.T) {
	got := writeNative(t, keyed(), PrefixHit{Request: "r1", Source: "r0", Tokens: 12})
	if *update {
		if err := os.MkdirAll(filepath.Dir(goWritten), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(goWritten, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(goWritten)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("writer output (%d bytes) differs from %s (%d bytes): the native format changed", len(got), goWritten, len(want))
	}
	d, err := Open(goWritten)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for _, r := range keyed() {
		got, err := d.Get(r.Key, r.Kind)
		if err != nil {
			t.Fatal(err)
		}
		sameRecord(t, &got, &r)
		checkDecoded(t, &got)
	}
}
