package dump

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// maxErrLen bounds an error about a hostile input: however long the names
// or shapes it holds, one error stays one readable line.
const maxErrLen = 1 << 10

// checkBounded fails the test unless err is shorter than maxErrLen and
// contains every one of want (the file, the offset, what is wrong).
func checkBounded(t *testing.T, what string, err error, want ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error", what)
		return
	}
	msg := err.Error()
	if len(msg) >= maxErrLen {
		t.Errorf("%s: error of %d bytes (want < %d): %.300s…", what, len(msg), maxErrLen, msg)
		return
	}
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("%s: error %q does not contain %q", what, msg, w)
		}
	}
}

// dimsJSON is a JSON list of n ones.
func dimsJSON(n int) string {
	return "[" + strings.TrimSuffix(strings.Repeat("1,", n), ",") + "]"
}

// TestSafetensorsErrorsBounded: a header's tensor names, dtypes, shapes,
// numbers and strings are echoed at most 64 bytes or 8 dimensions long, and
// the error still names the file and the tensor.
func TestSafetensorsErrorsBounded(t *testing.T) {
	long := strings.Repeat("n", 1<<20)
	cases := []struct {
		name string
		file []byte
		want []string
	}{
		{"long name, unknown dtype", stFile(`{"`+long+`":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}`, 1), []string{`tensor "nnnn`, `(1048576 bytes): unknown dtype "Q7"`}},
		{"long dtype", stFile(`{"a":{"dtype":"`+long+`","shape":[1],"data_offsets":[0,1]}}`, 1), []string{`tensor "a": unknown dtype "nnn`, "(1048576 bytes)"}},
		{"long name, missing shape", stFile(`{"`+long+`":{"dtype":"U8","data_offsets":[0,0]}}`, 0), []string{"missing shape"}},
		{"long name, outside", stFile(`{"`+long+`":{"dtype":"U8","shape":[9],"data_offsets":[0,9]}}`, 2), []string{"outside the 2-byte data area"}},
		{"long names, overlap", stFile(`{"a`+long+`":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b`+long+`":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}`, 3), []string{"overlaps tensor"}},
		{"long name, duplicate", stFile(`{"`+long+`":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"`+long+`":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, 2), []string{"duplicate tensor name", "(1048576 bytes)"}},
		{"long name, bad entry", stFile(`{"`+long+`":[1]}`, 0), []string{"cannot unmarshal"}},
		{"many dims", stFile(`{"a":{"dtype":"U8","shape":`+dimsJSON(300000)+`,"data_offsets":[0,2]}}`, 2), []string{`tensor "a": shape [1 1 1 1 1 1 1 1 …] (300000 dims) U8 needs 1 bytes`}},
		{"many dims overflow", stFile(`{"a":{"dtype":"U8","shape":[4611686018427387904,4`+strings.Repeat(",1", 300000)+`],"data_offsets":[0,0]}}`, 0), []string{"(300002 dims): element count overflows"}},
		{"long number", stFile(`{"a":{"dtype":"U8","shape":[`+strings.Repeat("9", 1<<20)+`],"data_offsets":[0,0]}}`, 0), []string{`tensor "a": json: cannot unmarshal number 999`, "(1048576 bytes)"}},
		{"a string", stFile(`"`+long+`"`, 0), []string{"want a JSON object, got nnn", "(1048576 bytes)"}},
	}
	for _, c := range cases {
		_, err := NewSafetensors(bytes.NewReader(c.file), int64(len(c.file)), "bad.safetensors")
		checkBounded(t, c.name, err, append([]string{"dump: bad.safetensors: safetensors: "}, c.want...)...)
	}
}

// npyV2 is a v2 .npy file (4-byte header length) of the header dict and
// data bytes.
func npyV2(dict string, data int) []byte {
	b := []byte("\x93NUMPY\x02\x00")
	b = binary.LittleEndian.AppendUint32(b, uint32(len(dict)))
	return append(append(b, dict...), make([]byte, data)...)
}

// TestNpyErrorsBounded: an .npy header's descr, shape dimensions and shape
// are echoed bounded, with the offset; an .npz member's name too, with the
// archive and the member's index.
func TestNpyErrorsBounded(t *testing.T) {
	long := strings.Repeat("x", 900000)
	ones := strings.Repeat("1,", 400000)
	cases := []struct {
		name string
		file []byte
		want []string
	}{
		{"long descr", npyV2("{'descr': '"+long+"', 'fortran_order': False, 'shape': (2,), }", 8), []string{`npy: offset 12: unsupported descr "xxx`, "(900000 bytes) (little-endian"}},
		{"long dimension", npyV2("{'descr': '<f4', 'fortran_order': False, 'shape': (2, "+long+"), }", 8), []string{`npy: offset 12: bad shape dimension "xxx`, "(900000 bytes)"}},
		{"many dims", npyV2("{'descr': '<f4', 'fortran_order': False, 'shape': ("+ones+"), }", 8), []string{"npy: shape [1 1 1 1 1 1 1 1 …] (400000 dims) <f4 needs 4 data bytes at offset"}},
	}
	for _, c := range cases {
		_, err := ParseNpyHeader(bytes.NewReader(c.file), int64(len(c.file)))
		checkBounded(t, c.name, err, c.want...)
	}

	// An .npz whose one member has a 65000-byte name and a bad magic.
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	w, err := zw.CreateHeader(&zip.FileHeader{Name: strings.Repeat("m", 65000) + ".npy", Method: zip.Store})
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte("NOTNUMPY\x01\x00\x00\x00"))
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	zr, err := zip.NewReader(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		t.Fatal(err)
	}
	_, err = listNpz(zr, bytes.NewReader(buf.Bytes()), int64(buf.Len()), "bad.npz")
	checkBounded(t, "npz member name", err, `dump: bad.npz: member 0 "mmm`, "(65004 bytes): npy: offset 0: bad magic")
}

// TestTorchSaveErrorsBounded: a pickle's global names, storage keys and
// view sizes are echoed bounded, and the error still names the file, the
// pickle and the offset.
func TestTorchSaveErrorsBounded(t *testing.T) {
	long := strings.Repeat("m", 1<<20)
	global := append([]byte("\x80\x02c"+long+"\n"), "x"+long+"\n."...)
	key := append([]byte{0x80, 2, '}', 'q', 0}, ptStr("x")...)
	view := ptViewOps(4, []int{2}, []int{1})
	view = bytes.Replace(view, ptStr("0"), ptStr(long), 1)
	key = append(append(key, view...), 's', '.')
	neg := make([]int, 64)
	for i := range neg {
		neg[i] = -1 << 31
	}
	negative := append([]byte{0x80, 2, '}', 'q', 0}, ptStr("x")...)
	negative = append(append(negative, ptViewOps(4, neg, neg)...), 's', '.')
	storage := make([]byte, 16)
	for _, c := range []struct {
		name string
		zip  []byte
		want []string
	}{
		{"long global", torchZip(global), []string{"dump: hostile.pt: f/data.pkl: offset 2: pickle names global mmm", "(1048576 bytes).xmmm", "(1048577 bytes), which a tensor file may not name"}},
		{"long storage key", torchZip(key, storage), []string{"dump: hostile.pt: f/data.pkl: ", "storage mmm", "(1048576 bytes): no member f/data/mmm"}},
		{"64 negative dims", torchZip(negative, storage), []string{"dump: hostile.pt: f/data.pkl: ", "negative size [-2147483648 -2147483648 -2147483648 -2147483648 -2147483648 -2147483648 -2147483648 -2147483648 …] (64 dims) or stride"}},
	} {
		_, _, err := readTorchSave(bytes.NewReader(c.zip), int64(len(c.zip)), "hostile.pt")
		checkBounded(t, c.name, err, c.want...)
	}
}

// TestNativeErrorsBounded: a native frame's stage, kind, dtype, frame type
// and shape are echoed bounded, with the file, the record and the offset.
func TestNativeErrorsBounded(t *testing.T) {
	long := strings.Repeat("s", 500000)
	stage := strings.Repeat("s", MaxKeyString) // the longest a stage may be
	hdr := frame(t, map[string]any{"t": "header", "header": map[string]any{}}, nil)
	tensor := func(m map[string]any, data []byte) []byte {
		base := map[string]any{"t": "tensor", "stage": "q", "kind": "stage", "dtype": "bf16", "shape": []int{2}, "nbytes": 4, "step": 3, "layer": 0}
		for k, v := range m {
			base[k] = v
		}
		return frame(t, base, data)
	}
	ones := make([]int, 200000)
	for i := range ones {
		ones[i] = 1
	}
	data := []byte{1, 2, 3, 4}
	at := "dump: bad.smd: record 1 at offset 34: "
	for _, c := range []struct {
		name string
		file []byte
		want []string
	}{
		{"long stage, bad dtype", bytes.Join([][]byte{fileHeader(1), hdr, tensor(map[string]any{"stage": stage, "dtype": "q3"}, data)}, nil), []string{at + "sss", `(1024 bytes): unknown dtype "q3"`}},
		{"stage over the bound", bytes.Join([][]byte{fileHeader(1), hdr, tensor(map[string]any{"stage": long}, data)}, nil), []string{at + `stage name "sss`, `(500000 bytes) is over 1024 bytes`}},
		{"request over the bound", bytes.Join([][]byte{fileHeader(1), hdr, tensor(map[string]any{"request": stage + "r"}, data)}, nil), []string{at + `request name "sss`, `(1025 bytes) is over 1024 bytes`}},
		{"prefix source over the bound", bytes.Join([][]byte{fileHeader(1), hdr, frame(t, map[string]any{"t": "prefix", "prefix": map[string]any{"request": "r1", "source": long, "tokens": 4}}, nil)}, nil), []string{at + `prefix frame: source name "sss`, `(500000 bytes) is over 1024 bytes`}},
		{"long dtype", bytes.Join([][]byte{fileHeader(1), hdr, tensor(map[string]any{"dtype": long}, data)}, nil), []string{at + `q: unknown dtype "sss`}},
		{"long kind", bytes.Join([][]byte{fileHeader(1), hdr, tensor(map[string]any{"kind": long}, data)}, nil), []string{at + `q: unknown kind "sss`}},
		{"long frame type", bytes.Join([][]byte{fileHeader(1), hdr, frame(t, map[string]any{"t": long}, nil)}, nil), []string{at + `unknown frame type "sss`}},
		{"many dims", bytes.Join([][]byte{fileHeader(1), hdr, tensor(map[string]any{"shape": ones}, data)}, nil), []string{at + "q: shape [1 1 1 1 1 1 1 1 …] (200000 dims) bf16 needs 2 bytes, frame says 4"}},
		{"long stage, duplicate", bytes.Join([][]byte{fileHeader(1), hdr, tensor(map[string]any{"stage": stage}, data), tensor(map[string]any{"stage": stage}, data)}, nil), []string{"dump: bad.smd: ", "duplicate", "(1024 bytes)"}},
	} {
		_, err := OpenReaderAt("bad.smd", bytes.NewReader(c.file), int64(len(c.file)))
		checkBounded(t, c.name, err, c.want...)
	}
}

// TestConfigErrorsBounded: name maps, sidecars, config.json and a
// checkpoint index echo their strings, unknown fields, numbers and regexps
// bounded, and still name the file and the field.
func TestConfigErrorsBounded(t *testing.T) {
	long := strings.Repeat("z", 1<<20)
	_, err := ParseNameMap([]byte(`{"files":[{"file":"x","kind":"`+long+`","rules":[]}]}`), "m.json")
	checkBounded(t, "name map kind", err, `dump: name map m.json: files[0]: unknown kind "zzz`, "(1048576 bytes)")
	_, err = ParseNameMap([]byte(`{"files":[{"file":"x","rules":[{"match":"x","dtype":"`+long+`"}]}]}`), "m.json")
	checkBounded(t, "name map dtype", err, `dump: name map m.json: files[0].rules[0]: unknown dtype "zzz`)
	_, err = ParseNameMap([]byte(`{"files":[{"file":"(`+long+`","rules":[]}]}`), "m.json")
	checkBounded(t, "name map regexp", err, "dump: name map m.json: files[0].file: error parsing regexp: missing closing ): `(zzz", "(1048577 bytes)`")
	_, err = ParseNameMap([]byte(`{"files":[{"file":"(?P<`+long+`>x)","rules":[]}]}`), "m.json")
	checkBounded(t, "name map capture group", err, `dump: name map m.json: files[0].file: unknown capture group "zzz`)
	_, err = ParseNameMap([]byte(`{"files":[],"`+long+`":1}`), "m.json")
	checkBounded(t, "name map unknown field", err, `dump: name map m.json: json: unknown field "zzz`)
	_, err = ParseNameMap([]byte(`{"files":[{"file":"x","rules":[{"match":"x","layer":`+strings.Repeat("9", 1<<20)+`}]}]}`), "m.json")
	checkBounded(t, "name map number", err, "dump: name map m.json: json: cannot unmarshal number 999", "(1048576 bytes) into Go struct field")
	var k Key
	err = applyCaptures(&k, regexp.MustCompile(`(?P<step>.*)`), []string{long, long})
	checkBounded(t, "capture", err, `capture step = "zzz`)

	_, err = ParseSidecar([]byte(`{"version":1,"prefix":[{"request":"`+long+`","source":"`+long+`","tokens":1}]}`), "s.json")
	checkBounded(t, "sidecar request", err, `dump: sidecar s.json: prefix: [0]: request "zzz`, "reuses its own prefix")
	_, err = ParseSidecar([]byte(`{"version":1,"files":[{"file":"[`+long+`"}]}`), "s.json")
	checkBounded(t, "sidecar regexp", err, "dump: sidecar s.json: files[0].file: error parsing regexp")
	_, err = ParseSidecar([]byte(`{"version":1,"prefix":[{"`+long+`":1}]}`), "s.json")
	checkBounded(t, "sidecar prefix field", err, `dump: sidecar s.json: prefix: json: unknown field "zzz`)

	_, err = ModelArgsFromHF([]byte(`{"model_type":"` + long + `"}`))
	checkBounded(t, "hf model_type", err, `dump: hf config: model_type "zzz`, "want deepseek_v4")

	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), []byte(`{"weight_map":{"`+long+`":"`+long+`"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = OpenCheckpoint(dir)
	checkBounded(t, "checkpoint shard", err, "model.safetensors.index.json: tensor \"zzz", "is not a .safetensors file name")
}

// Every format's keys pass indexKeys, which refuses a request or stage name
// over MaxKeyString (a foreign dump's stage comes from a name map's capture
// of a tensor name); the writer refuses to write one.
func TestKeyStringsBounded(t *testing.T) {
	long := strings.Repeat("n", MaxKeyString+1)
	d := &Dump{Entries: []Entry{{Key: Key{Request: "r0", Step: 3, Stage: long}, File: "a.safetensors", Record: 2, Offset: 80, Name: "model.layers.0." + long}},
		byKey: map[entryID]int{}}
	checkBounded(t, "foreign stage", d.indexKeys(), `dump: a.safetensors: record 2 (model.layers.0.nnn`, `at offset 80: stage name "nnn`, "(1025 bytes) is over 1024 bytes")
	w, err := NewWriter(io.Discard, Header{})
	if err != nil {
		t.Fatal(err)
	}
	err = w.Write(&Record{Key: Key{Request: long, Step: 3, Stage: "q"}, DType: BF16, Shape: []int{1}, Data: []byte{0, 0}})
	checkBounded(t, "writer", err, `request name "nnn`, "(1025 bytes) is over 1024 bytes")
	checkBounded(t, "writer prefix", w.WritePrefix(PrefixHit{Request: "r1", Source: long, Tokens: 4}), `dump: prefix hit: source name "nnn`)
}
