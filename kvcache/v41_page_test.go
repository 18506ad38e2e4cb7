package kvcache

import (
	"fmt"
	"strings"
	"testing"
)

// TestV41RowLocate: every byte of each V4.1 row layout maps to its field
// and dims (codes: one dim per FP8 byte, two per packed FP4 byte; scales:
// their block), and CompareRows names the first differing byte.
func TestV41RowLocate(t *testing.T) {
	for _, c := range []struct {
		r         V41Row
		off       int
		want      string
		parseBack bool
	}{
		{V41WindowFP8, 0, "code byte 0 (dim 0)", true},
		{V41WindowFP8, 511, "code byte 511 (dim 511)", true},
		{V41WindowFP8, 512 + 15, "scale byte 15 (dims 480…511)", true},
		{V41KVFP4, 255, "code byte 255 (dims 510, 511)", true},
		{V41KVFP4, 256 + 31, "scale byte 31 (dims 496…511)", true},
		{V41IndexFP4, 63, "code byte 63 (dims 126, 127)", true},
		{V41IndexFP4, 64 + 3, "scale byte 3 (dims 96…127)", true},
	} {
		if got := c.r.Locate(c.off).String(); got != c.want {
			t.Errorf("%s byte %d: %s, want %s", c.r, c.off, got, c.want)
		}
		r, err := ParseV41Row(c.r.String())
		if err != nil || r != c.r {
			t.Errorf("ParseV41Row(%s) = %v, %v", c.r, r, err)
		}
		a := make([]byte, c.r.RowBytes())
		b := make([]byte, c.r.RowBytes())
		if d := c.r.CompareRows(a, b); d != nil {
			t.Errorf("equal rows: %v", d)
		}
		b[c.off] = 1
		b[c.r.RowBytes()-1] ^= 2
		d := c.r.CompareRows(a, b)
		if d == nil || d.Offset != c.off || !strings.HasPrefix(d.String(), c.want) {
			t.Errorf("%s: %v", c.r, d)
		}
	}
	if _, err := ParseV41Row("v4-model1"); err == nil {
		t.Error("ParseV41Row accepted a V4 layout")
	}
}

// TestScheduleIndexRatios: V4.1's key-owning layers need n div r index keys
// (IndexRatios), their compressors the open group only (no halo).
func TestScheduleIndexRatios(t *testing.T) {
	s := Schedule{Window: 4, Ratios: []int{0, 2, 1}, IndexRatios: []int{0, 2, 0}}
	nd := s.Needs(7)
	if nd.IndexKeys != 3 || nd.Compressed[2] != 3 || nd.Compressed[1] != 7 || nd.StateFrom != 6 || nd.WindowFrom != 3 {
		t.Errorf("Needs(7) = %+v", nd)
	}
	s.IndexRatios = []int{0, 2, 1}
	if nd := s.Needs(7); nd.IndexKeys != 7 {
		t.Errorf("index keys of an r = 1 owner: %d, want 7", nd.IndexKeys)
	}
}

// TestParseLayoutLongID: a layout id is read from a dump (a page record's
// meta, up to 1 MiB): an unknown one is quoted in the error with at most 64
// of its bytes, and a short one whole, as before.
func TestParseLayoutLongID(t *testing.T) {
	long := strings.Repeat("\x1bx", 1<<19)
	_, err1 := ParseLayout(long)
	_, err2 := ParseV41Row(long)
	for _, err := range []error{err1, err2} {
		if err == nil || len(err.Error()) > 400 || !strings.Contains(err.Error(), `"\x1bx\x1bx`) || !strings.Contains(err.Error(), "… (1048576 bytes)") {
			t.Errorf("%d-byte id: error of %d bytes: %.300q", len(long), len(fmt.Sprint(err)), fmt.Sprint(err))
		}
	}
	if _, err := ParseLayout("fp9-sideways"); err == nil || err.Error() != `kvcache: unknown layout id "fp9-sideways" (want v4-model1, v32, indexer-fp8, indexer-mxfp4 or bf16)` {
		t.Errorf("short id: %v", err)
	}
	if _, err := ParseV41Row("v4-model1"); err == nil || err.Error() != `kvcache: unknown V4.1 row layout "v4-model1" (want v41-window-fp8, v41-kv-fp4 or v41-index-fp4)` {
		t.Errorf("short id: %v", err)
	}
}
