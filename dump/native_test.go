package dump

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// keyed gives sampleRecords distinct keys of every kind.
func keyed() []Record {
	recs := sampleRecords()
	for i := range recs {
		recs[i].Key = Key{Request: "r0", Step: 5 + i%3, Layer: i%4 - 1, Stage: recs[i].Name}
		recs[i].Kind = Kind(i % int(numKinds))
	}
	recs[4].Page = &PageInfo{Layout: LayoutV4Model1, PageID: 7, BlockSize: 64, BlockTable: []int{7, 3}}
	return recs
}

var testHeader = Header{
	ModelArgs:      `{"dim": 256, "compress_ratios": [0, 4, 128, 4]}`,
	CompressRatios: []int{0, 4, 128, 4},
	DTypePolicy:    map[string]string{"activations": "bf16"},
	Producer:       map[string]string{"engine": "test"},
	User:           map[string]string{"note": "x"},
}

func writeNative(t testing.TB, recs []Record, prefix ...PrefixHit) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := NewWriter(&buf, testHeader)
	if err != nil {
		t.Fatal(err)
	}
	for i := range recs {
		if err := w.Write(&recs[i]); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range prefix {
		if err := w.WritePrefix(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func sameRecord(t *testing.T, got, want *Record) {
	t.Helper()
	if got.Key != want.Key || got.Kind != want.Kind || got.Name != want.Name || got.DType != want.DType ||
		!slices.Equal(got.Shape, want.Shape) || !bytes.Equal(got.Data, want.Data) {
		t.Errorf("got %s %s %q %s %v %x, want %s %s %q %s %v %x", got.Key, got.Kind, got.Name, got.DType, got.Shape, got.Data,
			want.Key, want.Kind, want.Name, want.DType, want.Shape, want.Data)
	}
	if (got.Page == nil) != (want.Page == nil) || got.Page != nil && (got.Page.Layout != want.Page.Layout || !slices.Equal(got.Page.BlockTable, want.Page.BlockTable)) {
		t.Errorf("%s: page %+v, want %+v", want.Key, got.Page, want.Page)
	}
}

func TestNativeRoundTrip(t *testing.T) {
	recs := keyed()
	hit := PrefixHit{Request: "r1", Source: "r0", Tokens: 12}
	b := writeNative(t, recs, hit)

	// Streaming reader.
	sr, err := NewStreamReader(bytes.NewReader(b), "mem")
	if err != nil {
		t.Fatal(err)
	}
	if sr.Header.ModelArgs != testHeader.ModelArgs || sr.Header.Version != Version || sr.Header.Producer["engine"] != "test" {
		t.Errorf("header %+v", sr.Header)
	}
	for i := 0; ; i++ {
		r, err := sr.Next()
		if err == io.EOF {
			if i != len(recs) {
				t.Errorf("read %d records, want %d", i, len(recs))
			}
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		sameRecord(t, &r, &recs[i])
		checkDecoded(t, &r)
	}
	if p := sr.Prefix(); len(p) != 1 || p[0] != hit {
		t.Errorf("prefix hits %+v", p)
	}

	// Indexed reader on a file, and on a directory of two files.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "a.smd"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(dir, "a.smd"), dir} {
		d, err := Open(p)
		if err != nil {
			t.Fatal(err)
		}
		if d.Format != "native" || len(d.Entries) != len(recs) || len(d.Prefix) != 1 || len(d.Incomplete) != 0 {
			t.Fatalf("%s: format %s, %d entries, %d prefix", p, d.Format, len(d.Entries), len(d.Prefix))
		}
		for i := range recs {
			r, err := d.Get(recs[i].Key, recs[i].Kind)
			if err != nil {
				t.Fatal(err)
			}
			sameRecord(t, &r, &recs[i])
		}
		d.Close()
	}
	// A second file with other records joins the index; one with the same
	// records is a duplicate.
	more := keyed()
	for i := range more {
		more[i].Request = "r1"
	}
	if err := os.WriteFile(filepath.Join(dir, "b.smd"), writeNative(t, more), 0o644); err != nil {
		t.Fatal(err)
	}
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Entries) != 2*len(recs) {
		t.Errorf("directory: %d entries, want %d", len(d.Entries), 2*len(recs))
	}
	d.Close()
	if err := os.WriteFile(filepath.Join(dir, "c.smd"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "duplicate") {
		t.Errorf("duplicate across files: err = %v", err)
	}
}

func TestNativeWriterRejects(t *testing.T) {
	w, err := NewWriter(io.Discard, Header{})
	if err != nil {
		t.Fatal(err)
	}
	r := Record{Key: Key{Stage: "q", Step: 1}, DType: BF16, Shape: []int{3}, Data: make([]byte, 4)}
	if err := w.Write(&r); err == nil {
		t.Error("shape/bytes mismatch accepted")
	}
	r.Shape = []int{2}
	if err := w.Write(&r); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(&r); err == nil || !strings.Contains(err.Error(), "duplicate") {
		t.Errorf("duplicate: err = %v", err)
	}
}

// frame builds one raw frame from a meta map and data.
func frame(t testing.TB, meta map[string]any, data []byte) []byte {
	m, err := msgpack.Marshal(meta)
	if err != nil {
		t.Fatal(err)
	}
	b := binary.LittleEndian.AppendUint32(nil, uint32(len(m)))
	return append(append(b, m...), data...)
}

func fileHeader(v uint32) []byte { return binary.LittleEndian.AppendUint32([]byte(Magic), v) }

func TestNativeBadInput(t *testing.T) {
	hdr := frame(t, map[string]any{"t": "header", "header": map[string]any{}}, nil)
	tensor := func(m map[string]any, data []byte) []byte {
		base := map[string]any{"t": "tensor", "stage": "q", "kind": "stage", "dtype": "bf16", "shape": []int{2}, "nbytes": 4, "step": 3, "layer": 0}
		for k, v := range m {
			base[k] = v
		}
		return frame(t, base, data)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	good := tensor(nil, []byte{1, 2, 3, 4})
	cases := []struct {
		name string
		file []byte
		want string
	}{
		{"magic", cat([]byte("NOTADUMP\x01\x00\x00\x00"), hdr), "not a sparsemla dump"},
		{"version", cat(fileHeader(99), hdr), "format version 99"},
		{"short header", []byte("SPMLD"), "truncated file header"},
		{"no header frame", cat(fileHeader(1), good), "before the header frame"},
		{"meta length", cat(fileHeader(1), hdr, []byte{0xff, 0xff, 0xff, 0x7f}), "meta length"},
		{"data past end", cat(fileHeader(1), hdr, tensor(map[string]any{"shape": []int{1 << 20}, "nbytes": 2 << 20}, nil)), "exceeds"},
		{"shape vs nbytes", cat(fileHeader(1), hdr, tensor(map[string]any{"shape": []int{3}}, []byte{1, 2, 3, 4})), "needs 6 bytes"},
		{"overflow", cat(fileHeader(1), hdr, tensor(map[string]any{"shape": []int{1 << 40, 1 << 40}}, []byte{1, 2, 3, 4})), "overflows"},
		{"dtype", cat(fileHeader(1), hdr, tensor(map[string]any{"dtype": "q3"}, []byte{1, 2, 3, 4})), `unknown dtype "q3"`},
		{"kind", cat(fileHeader(1), hdr, tensor(map[string]any{"kind": "junk"}, []byte{1, 2, 3, 4})), `unknown kind`},
		{"frame type", cat(fileHeader(1), hdr, frame(t, map[string]any{"t": "what"}, nil)), "unknown frame type"},
		{"duplicate", cat(fileHeader(1), hdr, good, good), "duplicate"},
		{"truncated data", cat(fileHeader(1), hdr, good)[:len(cat(fileHeader(1), hdr, good))-1], "exceeds"},
		{"end count", cat(fileHeader(1), hdr, good, frame(t, map[string]any{"t": "end", "records": 2}, nil)), "end frame says 2"},
		{"after end", cat(fileHeader(1), hdr, frame(t, map[string]any{"t": "end"}, nil), good), "after the end frame"},
		{"bad msgpack", cat(fileHeader(1), hdr, []byte{3, 0, 0, 0, 0xc1, 0xc1, 0xc1}), "bad frame meta"},
	}
	dir := t.TempDir()
	for _, c := range cases {
		p := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_")+".smd")
		if err := os.WriteFile(p, c.file, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := Open(p)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), p) {
			t.Errorf("%s: Open err = %v, want the path and %q", c.name, err, c.want)
		}
		// From memory under the same name: the same message.
		if _, merr := OpenReaderAt(p, bytes.NewReader(c.file), int64(len(c.file))); merr == nil || err == nil || merr.Error() != err.Error() {
			t.Errorf("%s: OpenReaderAt err = %v, Open err = %v", c.name, merr, err)
		}
		// The stream reader must fail too (it cannot check sizes up front).
		serr := streamAll(c.file)
		if serr == nil {
			t.Errorf("%s: stream reader accepted bad input", c.name)
		}
	}
}

func streamAll(b []byte) error {
	_, err := streamComplete(b)
	return err
}

// streamComplete reads every record and reports whether the end frame was seen.
func streamComplete(b []byte) (bool, error) {
	sr, err := NewStreamReader(bytes.NewReader(b), "fuzz")
	if err != nil {
		return false, err
	}
	for {
		r, err := sr.Next()
		if errors.Is(err, io.EOF) {
			return sr.Complete(), nil
		}
		if err != nil {
			return false, err
		}
		if err := r.Check(); err != nil {
			return false, errors.New("record accepted but invalid: " + err.Error())
		}
	}
}

// TestNativeTruncatedEverywhere cuts a valid dump at every byte: each cut
// must be an error, or (at a frame boundary) a clean prefix of the records
// reported as incomplete; never a panic.
func TestNativeTruncatedEverywhere(t *testing.T) {
	b := writeNative(t, keyed()[:4])
	dir := t.TempDir()
	for n := 0; n < len(b); n++ {
		complete, err := streamComplete(b[:n])
		if err == nil && complete {
			t.Fatalf("cut at %d of %d: accepted as complete", n, len(b))
		}
		if n%3 != 0 && n > 64 {
			continue // the indexed reader (one file write each) on every third cut
		}
		p := filepath.Join(dir, "t.smd")
		if werr := os.WriteFile(p, b[:n], 0o644); werr != nil {
			t.Fatal(werr)
		}
		d, oerr := Open(p)
		if oerr == nil {
			if len(d.Incomplete) != 1 {
				t.Fatalf("cut at %d: index accepted it as complete", n)
			}
			d.Close()
		}
		if (err == nil) != (oerr == nil) {
			t.Fatalf("cut at %d: stream err %v, index err %v", n, err, oerr)
		}
	}
	if complete, err := streamComplete(b); err != nil || !complete {
		t.Errorf("whole file: complete %v, err %v", complete, err)
	}
}

func FuzzNative(f *testing.F) {
	f.Add(writeNative(f, keyed()))
	f.Add(writeNative(f, nil, PrefixHit{Request: "a", Source: "b", Tokens: 3}))
	f.Add(fileHeader(1))
	// Frames whose msgpack claims lengths the bytes do not back (arrays,
	// maps, strings, nesting): the fuzzer starts at the claim-length paths
	// of checkMsgpack and mutates the claims from there.
	for _, name := range slices.Sorted(maps.Keys(claimCases())) {
		if b := claimCases()[name]; len(b) < 4096 {
			f.Add(b)
		}
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		err := streamAll(b)
		if err != nil && strings.HasPrefix(err.Error(), "record accepted") {
			t.Fatal(err)
		}
		// The indexed reader must agree with the stream reader.
		p := filepath.Join(dir, "f.smd")
		if werr := os.WriteFile(p, b, 0o644); werr != nil {
			t.Fatal(werr)
		}
		d, oerr := Open(p)
		if (err == nil) != (oerr == nil) {
			t.Fatalf("stream err %v, index err %v", err, oerr)
		}
		if oerr != nil {
			return
		}
		defer d.Close()
		for i := range d.Entries {
			r, rerr := d.Read(&d.Entries[i])
			if rerr != nil {
				t.Fatalf("indexed entry unreadable: %v", rerr)
			}
			if cerr := r.Check(); cerr != nil {
				t.Fatalf("indexed record invalid: %v", cerr)
			}
		}
	})
}

// TestReadClaimedLies: a header claiming 1 TiB on a 10-byte stream fails
// after reading what is there, without allocating the claim.
func TestReadClaimedLies(t *testing.T) {
	got, err := readClaimed(bytes.NewReader(make([]byte, 10)), 1<<40)
	if err == nil || len(got) != 10 || cap(got) > claimChunk {
		t.Errorf("len %d cap %d err %v", len(got), cap(got), err)
	}
	want := bytes.Repeat([]byte{1, 2, 3}, claimChunk) // 3 chunks: grows in steps
	got, err = readClaimed(bytes.NewReader(want), int64(len(want)))
	if err != nil || !bytes.Equal(got, want) {
		t.Errorf("exact read: %d bytes, err %v", len(got), err)
	}
}

// TestCreateReplacesAtomically: Create writes a temporary file beside the
// path and Close renames it into place: an earlier file (or a symbolic link
// to someone else's file) at the path is replaced, never written through;
// Abort leaves the path as it was and no temporary behind.
func TestCreateReplacesAtomically(t *testing.T) {
	dir := t.TempDir()
	other := filepath.Join(dir, "other.smd")
	if err := os.WriteFile(other, []byte("someone else's"), 0o644); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "out.smd")
	if err := os.Symlink(other, p); err != nil {
		t.Fatal(err)
	}
	w, err := Create(p, Header{ModelArgs: "{}"})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "someone else's" {
		t.Fatal("path changed before Close")
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(other); string(b) != "someone else's" {
		t.Errorf("written through the link: %q", b)
	}
	if fi, err := os.Lstat(p); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("out.smd is not the new regular file: %v", err)
	}
	if d, err := Open(p); err != nil {
		t.Errorf("the new file does not open: %v", err)
	} else {
		d.Close()
	}
	w, err = Create(p, Header{ModelArgs: `{"x": 1}`})
	if err != nil {
		t.Fatal(err)
	}
	w.Abort()
	if err := w.Close(); err == nil {
		t.Error("Close after Abort succeeded")
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 2 {
		t.Errorf("left behind: %v", ents)
	}
	if d, err := Open(p); err != nil || d.Header.ModelArgs != "{}" {
		t.Errorf("Abort changed the earlier file: %v", err)
	} else {
		d.Close()
	}
}
