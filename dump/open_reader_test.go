package dump

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
)

// openBoth opens b as the file dir/name with Open and from memory with
// OpenReaderAt under the same name; it fails the test unless both give the
// same error, or the same index.
func openBoth(t *testing.T, dir, name string, b []byte) (*Dump, error) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	fd, ferr := Open(p)
	md, merr := OpenReaderAt(p, bytes.NewReader(b), int64(len(b)))
	if fmt.Sprint(ferr) != fmt.Sprint(merr) {
		t.Fatalf("%d bytes: Open: %v; OpenReaderAt: %v", len(b), ferr, merr)
	}
	if ferr != nil {
		return nil, merr
	}
	defer fd.Close()
	if fd.Path != md.Path || fd.Format != md.Format || !reflect.DeepEqual(fd.Header, md.Header) ||
		!reflect.DeepEqual(fd.Prefix, md.Prefix) || !reflect.DeepEqual(fd.Incomplete, md.Incomplete) ||
		len(fd.Entries) != len(md.Entries) {
		t.Fatalf("%d bytes: Open and OpenReaderAt index differently: %+v / %+v", len(b), fd, md)
	}
	for i := range fd.Entries {
		fe, me := fd.Entries[i], md.Entries[i]
		fe.src, me.src = 0, 0
		if !reflect.DeepEqual(fe, me) {
			t.Fatalf("entry %d: %+v / %+v", i, fe, me)
		}
		fr, ferr := fd.Read(&fd.Entries[i])
		mr, merr := md.Read(&md.Entries[i])
		if ferr != nil || merr != nil || !reflect.DeepEqual(fr, mr) {
			t.Fatalf("entry %d: read %v / %v", i, ferr, merr)
		}
	}
	return md, nil
}

// TestOpenReaderAt: a dump opened from memory is the dump Open reads from
// the file (index, header, prefix hits, records), and Close leaves the
// caller's reader alone.
func TestOpenReaderAt(t *testing.T) {
	recs := keyed()
	b := writeNative(t, recs, PrefixHit{Request: "r1", Source: "r0", Tokens: 12})
	d, err := openBoth(t, t.TempDir(), "a.smd", b)
	if err != nil {
		t.Fatal(err)
	}
	if d.Format != "native" || len(d.Entries) != len(recs) || len(d.Prefix) != 1 || len(d.Incomplete) != 0 {
		t.Fatalf("format %s, %d entries, %d prefix hits, incomplete %v", d.Format, len(d.Entries), len(d.Prefix), d.Incomplete)
	}
	for i := range recs {
		r, err := d.Get(recs[i].Key, recs[i].Kind)
		if err != nil {
			t.Fatal(err)
		}
		sameRecord(t, &r, &recs[i])
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d, err = OpenReaderAt("mem", bytes.NewReader(b), int64(len(b)))
	if err != nil || d.Path != "mem" || d.Entries[0].File != "mem" {
		t.Fatalf("named mem: %v", err)
	}
}

// TestOpenReaderAtHostile: cut at every byte and every claim case give the
// error Open gives for the same bytes in a file (same message, same name;
// TestNativeBadInput checks its table the same way), allocating nothing
// near a claim; a size the reader cannot back is refused, a failing read
// is an error.
func TestOpenReaderAtHostile(t *testing.T) {
	dir := t.TempDir()
	b := writeNative(t, keyed()[:4])
	for n := 0; n < len(b); n++ {
		d, err := openBoth(t, dir, "t.smd", b[:n])
		if err == nil && len(d.Incomplete) != 1 {
			t.Fatalf("cut at %d of %d: accepted as complete", n, len(b))
		}
	}
	for name, c := range claimCases() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, err := OpenReaderAt("claim.smd", bytes.NewReader(c), int64(len(c)))
		runtime.ReadMemStats(&after)
		if err == nil || !strings.Contains(err.Error(), "claim.smd: record ") || !strings.Contains(err.Error(), "msgpack") {
			t.Errorf("%s: error %v does not name the file, record and cause", name, err)
		}
		if a := after.TotalAlloc - before.TotalAlloc; a > 16<<20 {
			t.Errorf("%s: allocated %d MiB", name, a>>20)
		}
		if _, err := openBoth(t, dir, "claim.smd", c); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// A frame claiming 1 TiB of data behind a size that says the bytes
	// are there: the size is checked against the reader first.
	hdr := frame(t, map[string]any{"t": "header", "header": map[string]any{}}, nil)
	big := frame(t, map[string]any{"t": "tensor", "stage": "q", "kind": "stage", "dtype": "u8", "shape": []int{1 << 40}, "nbytes": 1 << 40, "step": 3, "layer": 0}, nil)
	lie := bytes.Join([][]byte{fileHeader(1), hdr, big}, nil)
	_, err := OpenReaderAt("lie.smd", bytes.NewReader(lie), int64(len(lie))+1<<40)
	if err == nil || !strings.Contains(err.Error(), "lie.smd: size 1099511627") || !strings.Contains(err.Error(), "last byte") {
		t.Errorf("a size past the reader's end: %v", err)
	}
	if _, err := OpenReaderAt("lie.smd", bytes.NewReader(lie), int64(len(lie))); err == nil || !strings.Contains(err.Error(), "exceeds") {
		t.Errorf("1 TiB claimed in %d bytes: %v", len(lie), err)
	}
	if _, err := OpenReaderAt("neg.smd", bytes.NewReader(lie), -1); err == nil || !strings.Contains(err.Error(), "negative size") {
		t.Errorf("negative size: %v", err)
	}
	// A reader that fails in the middle (as a file whose read fails):
	// an error naming the dump and the record, as for a file.
	_, err = OpenReaderAt("broken.smd", failingReader{b, 100}, int64(len(b)))
	if err == nil || !strings.Contains(err.Error(), "broken.smd: record 0 at offset 12: truncated frame meta") {
		t.Errorf("failing reader: %v", err)
	}
	_, err = OpenReaderAt("broken.smd", failingReader{b, int64(len(b)) - 1}, int64(len(b)))
	if err == nil || !strings.Contains(err.Error(), "last byte cannot be read: device error") {
		t.Errorf("failing reader at the last byte: %v", err)
	}
}

// failingReader serves b's bytes, failing every read that covers offset
// at.
type failingReader struct {
	b  []byte
	at int64
}

func (f failingReader) ReadAt(p []byte, off int64) (int, error) {
	end := min(off+int64(len(p)), int64(len(f.b)))
	if off <= f.at && f.at < end {
		return copy(p, f.b[off:f.at]), errors.New("device error")
	}
	if off >= int64(len(f.b)) {
		return 0, io.EOF
	}
	n := copy(p, f.b[off:end])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}
