package prefixcheck

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"sparsemla/dump"
)

// writeTokFile writes a safetensors file holding one "tok" tensor (i64 [1])
// with the given __metadata__.
func writeTokFile(t *testing.T, path string, tok int64, meta map[string]string) {
	t.Helper()
	hdr := map[string]any{"tok": map[string]any{"dtype": "I64", "shape": []int{1}, "data_offsets": []int{0, 8}}}
	if meta != nil {
		hdr["__metadata__"] = meta
	}
	h, err := json.Marshal(hdr)
	if err != nil {
		t.Fatal(err)
	}
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
	b = append(b, h...)
	b = binary.LittleEndian.AppendUint64(b, uint64(tok))
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// A safetensors dump (one directory per request, step_<P>.safetensors with
// a tok tensor) whose prefix hits are given as sparsemla.prefix metadata
// (dump/FORMAT.md, "Request and prefix-cache metadata for foreign dumps"):
// testdata/prefixcheck/safetensors-hits, written by this test with -update
// (and checked byte for byte against what it writes).
func TestFromSafetensorsDumpWithRecordedHits(t *testing.T) {
	dir := filepath.Join(fixtureDir, "safetensors-hits")
	tmp := t.TempDir()
	streams := [][2]string{{"r0", "abcdefgh"}, {"r1", "abcdefxy"}, {"r2", "abcdxyzw"}}
	hits := `[{"request": "r1", "source": "r0", "tokens": 4}, {"request": "r2", "source": "r0", "tokens": 8}]`
	for _, s := range streams {
		for p, c := range s[1] {
			meta := map[string]string{"sparsemla.request": s[0]}
			if p == 0 && s[0] == "r2" {
				meta["sparsemla.prefix"] = hits
			}
			rel := filepath.Join(s[0], "step_"+strconv.Itoa(p)+".safetensors")
			writeTokFile(t, filepath.Join(tmp, rel), int64(c), meta)
			if *update {
				writeTokFile(t, filepath.Join(dir, rel), int64(c), meta)
			}
			want, _ := os.ReadFile(filepath.Join(tmp, rel))
			if got, err := os.ReadFile(filepath.Join(dir, rel)); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("%s differs from what the test writes (rerun with -update): %v", rel, err)
			}
		}
	}
	d, err := dump.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	tr, err := FromDump(d)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: 4, Schedule: testCfg.Schedule})
	if err != nil {
		t.Fatal(err)
	}
	checkWants(t, rep, []want{
		{"r0", StatusAgree, "", "", ""},
		{"r1", StatusAgree, KindMissedHit, CauseAlignment, `shares 6 tokens with request "r0"`},
		{"r2", StatusDiverged, KindHitTooLong, "", "token 4 is 120 here, 101 there"},
	})
}
