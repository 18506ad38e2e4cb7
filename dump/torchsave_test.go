package dump

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// zoo.pt was written by torch.save on the GPU host (testdata/dump/pt/README.md);
// zoo_expect.json holds each tensor's dtype, shape and contiguous bytes as
// torch itself printed them.
func TestTorchSaveZoo(t *testing.T) {
	d, err := Open("../testdata/dump/pt/zoo.pt")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Format != "pt" {
		t.Fatalf("format %q", d.Format)
	}
	var want map[string]struct {
		DType string `json:"dtype"`
		Shape []int  `json:"shape"`
		Bytes []int  `json:"bytes"`
	}
	b, err := os.ReadFile("../testdata/dump/pt/zoo_expect.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	dtypes := map[string]DType{"torch.bfloat16": BF16, "torch.float16": F16, "torch.float32": F32, "torch.float64": F64,
		"torch.int8": I8, "torch.int16": I16, "torch.int32": I32, "torch.int64": I64, "torch.uint8": U8, "torch.bool": Bool,
		"torch.float8_e4m3fn": E4M3, "torch.float8_e5m2": E5M2, "torch.float8_e8m0fnu": E8M0, "torch.uint16": U16,
		"torch.uint32": U32, "torch.uint64": U64, "torch.float4_e2m1fn_x2": FP4}
	seen := 0
	for i := range d.Entries {
		e := &d.Entries[i]
		w, ok := want[e.Stage]
		if !ok {
			t.Errorf("unexpected tensor %q", e.Stage)
			continue
		}
		seen++
		if dtypes[w.DType] != e.DType {
			t.Errorf("%s: dtype %s, want %s", e.Stage, e.DType, w.DType)
		}
		shape := w.Shape
		if e.DType == FP4 {
			shape = append([]int(nil), shape...)
			shape[len(shape)-1] *= 2
		}
		if len(shape) != len(e.Shape) || (len(shape) > 0 && !equalInts(shape, e.Shape)) {
			t.Errorf("%s: shape %v, want %v", e.Stage, e.Shape, shape)
		}
		r, err := d.Read(e)
		if err != nil {
			t.Errorf("%s: %v", e.Stage, err)
			continue
		}
		wb := make([]byte, len(w.Bytes))
		for j, v := range w.Bytes {
			wb[j] = byte(v)
		}
		if !bytes.Equal(r.Data, wb) {
			t.Errorf("%s: bytes %v, want %v", e.Stage, r.Data, wb)
		}
	}
	if seen != len(want) {
		t.Errorf("read %d tensors, want %d", seen, len(want))
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestTorchSaveValueMeta(t *testing.T) {
	d, err := Open("../testdata/dump/pt/value_meta.pt")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if len(d.Entries) != 1 {
		t.Fatalf("%d entries", len(d.Entries))
	}
	e := d.Entries[0]
	if e.Name != "x" || e.DType != I32 || e.Meta["step"] != "1" || e.Meta["nested.1"] != "2.5" {
		t.Fatalf("entry %+v meta %v", e, e.Meta)
	}
}

// rezip rewrites a torch.save zip with one member's bytes replaced.
func rezip(t *testing.T, src, member string, repl func([]byte) []byte) string {
	t.Helper()
	zr, err := zip.OpenReader(src)
	if err != nil {
		t.Fatal(err)
	}
	defer zr.Close()
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, f := range zr.File {
		b, err := readMember(f, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if f.Name == member {
			b = repl(b)
		}
		w, err := zw.CreateHeader(&zip.FileHeader{Name: f.Name, Method: zip.Store})
		if err != nil {
			t.Fatal(err)
		}
		w.Write(b)
	}
	zw.Close()
	p := filepath.Join(t.TempDir(), "x.pt")
	if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// A .pt naming any global outside the allow-list (here os.system through a
// GLOBAL opcode) must fail before anything is constructed.
func TestTorchSaveRefusesGlobals(t *testing.T) {
	cases := map[string]func([]byte) []byte{
		"os.system": func(b []byte) []byte {
			return bytes.Replace(b, []byte("ctorch._utils\n_rebuild_tensor_v2\n"), []byte("cos\nsystem\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n"), 1)
		},
		"builtins.eval": func(b []byte) []byte {
			return bytes.Replace(b, []byte("ccollections\nOrderedDict\n"), []byte("cbuiltins\neval\n\n\n\n\n\n\n\n\n\n\n\n"), 1)
		},
		"claimed length": func(b []byte) []byte {
			i := bytes.IndexByte(b, 'X')
			c := append([]byte(nil), b...)
			c[i+1], c[i+2], c[i+3], c[i+4] = 0xff, 0xff, 0xff, 0x7f
			return c
		},
		"no stop": func(b []byte) []byte { return b[:len(b)-1] },
	}
	for name, f := range cases {
		p := rezip(t, "../testdata/dump/pt/bare_tensor.pt", "bare_tensor/data.pkl", f)
		_, err := Open(p)
		if err == nil {
			t.Errorf("%s: opened", name)
			continue
		}
		if name == "os.system" && !strings.Contains(err.Error(), "os.system") {
			t.Errorf("%s: %v", name, err)
		}
		t.Logf("%s: %v", name, err)
	}
	// a storage claiming more bytes than its member holds
	p := rezip(t, "../testdata/dump/pt/bare_tensor.pt", "bare_tensor/data/0", func(b []byte) []byte { return b[:2] })
	if _, err := Open(p); err == nil || !strings.Contains(err.Error(), "member holds 2 bytes") {
		t.Errorf("short storage: %v", err)
	}
}

// An unsupported zip (no data.pkl, no .npy) and a non-dump file fail.
func TestUnsupportedFilesFail(t *testing.T) {
	dir := t.TempDir()
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	w, _ := zw.Create("readme.txt")
	w.Write([]byte("hello"))
	zw.Close()
	for name, data := range map[string][]byte{"a.pt": buf.Bytes(), "b.zip": buf.Bytes(), "c.bin": []byte("\x80\x02garbage")} {
		p := filepath.Join(dir, name)
		os.WriteFile(p, data, 0o644)
		if d, err := Open(p); err == nil {
			t.Errorf("%s: opened with %d entries", name, len(d.Entries))
		}
	}
}

// FuzzTorchSave: any bytes as the pickle of a torch.save zip must fail or
// decode, never panic or allocate by claim.
func FuzzTorchSave(f *testing.F) {
	for _, n := range []string{"bare_tensor", "value_meta", "zoo"} {
		zr, err := zip.OpenReader("../testdata/dump/pt/" + n + ".pt")
		if err != nil {
			f.Fatal(err)
		}
		for _, m := range zr.File {
			if strings.HasSuffix(m.Name, "data.pkl") {
				b, _ := readMember(m, 1<<20)
				f.Add(b)
			}
		}
		zr.Close()
	}
	f.Fuzz(func(t *testing.T, pkl []byte) {
		if err := scanPickle(pkl); err != nil {
			return
		}
		var buf bytes.Buffer
		zw := zip.NewWriter(&buf)
		w, _ := zw.CreateHeader(&zip.FileHeader{Name: "f/data.pkl", Method: zip.Store})
		w.Write(pkl)
		w, _ = zw.CreateHeader(&zip.FileHeader{Name: "f/data/0", Method: zip.Store})
		w.Write(make([]byte, 64))
		zw.Close()
		readTorchSave(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "fuzz")
	})
}

// A storage member whose central-directory record claims 1 GiB (past the end
// of the file, and not what the pickle says) fails at open; nothing is
// allocated for the claim.
func TestTorchSaveMemberPastEOF(t *testing.T) {
	b, err := os.ReadFile("../testdata/dump/pt/bare_tensor.pt")
	if err != nil {
		t.Fatal(err)
	}
	zr, err := zip.NewReader(bytes.NewReader(b), int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	var st *zip.File
	for _, f := range zr.File {
		if strings.HasSuffix(f.Name, "/data/0") {
			st = f
		}
	}
	// the member's size fields in its central directory record
	cd := bytes.LastIndex(b, []byte("PK\x01\x02"))
	for i := cd; i >= 0; i = bytes.LastIndex(b[:i], []byte("PK\x01\x02")) {
		nl := int(b[i+28]) | int(b[i+29])<<8
		if string(b[i+46:i+46+nl]) == st.Name {
			c := append([]byte(nil), b...)
			binary.LittleEndian.PutUint32(c[i+20:], 1<<30)
			binary.LittleEndian.PutUint32(c[i+24:], 1<<30)
			p := filepath.Join(t.TempDir(), "big.pt")
			os.WriteFile(p, c, 0o644)
			if _, err := Open(p); err == nil {
				t.Fatal("opened a member claiming 1 GiB")
			} else {
				t.Log(err)
			}
			return
		}
		if i == 0 {
			break
		}
	}
	t.Fatal("central directory record not found")
}

// torchZipOf wraps a pickle as the data.pkl of a torch.save zip.
func torchZipOf(pkl []byte) []byte {
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	w, _ := zw.CreateHeader(&zip.FileHeader{Name: "f/data.pkl", Method: zip.Store})
	w.Write(pkl)
	zw.Close()
	return buf.Bytes()
}

// Pickles whose memo makes a container hold itself or name another one
// many times fail at once, with an error that does not print the
// containers. A dict holding itself as a persistent id once overflowed the
// stack while its error was formatted (FuzzTorchSave found it, kept in
// testdata/fuzz/FuzzTorchSave); 40 nested tuples that each hold the one
// before twice (2^40 values from 290 bytes) never ended.
func TestTorchSaveSharedContainers(t *testing.T) {
	// d = {}; d["k"] = d; then d as a persistent id
	self := []byte("\x80\x02}q\x00(X\x01\x00\x00\x00kh\x00uh\x00Q.")
	dag := []byte{0x80, 0x02, ']', 'q', 0}
	for i := 0; i < 40; i++ {
		dag = append(dag, 'h', byte(i), 'h', byte(i), 0x86, 'q', byte(i+1))
	}
	dag = append(dag, '.')
	for _, c := range []struct {
		name string
		pkl  []byte
		want string
	}{
		{"a dict holding itself, as a persistent id", self, "persistent id a dict of 1 entry is not a storage tuple"},
		{"2^40 values named through the memo", dag, "the pickle's containers hold more than"},
	} {
		b := torchZipOf(c.pkl)
		_, err := readTorchSave(bytes.NewReader(b), int64(len(b)), "hostile.pt")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
	}
}
