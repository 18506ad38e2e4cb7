package dump

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
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
		b := torchZip(pkl, make([]byte, 64))
		readTorchSave(bytes.NewReader(b), int64(len(b)), "fuzz")
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

// torchZip wraps a pickle as the data.pkl of a torch.save zip, with the
// storage members f/data/0, 1, … holding storages.
func torchZip(pkl []byte, storages ...[]byte) []byte {
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	w, _ := zw.CreateHeader(&zip.FileHeader{Name: "f/data.pkl", Method: zip.Store})
	w.Write(pkl)
	for k, st := range storages {
		w, _ = zw.CreateHeader(&zip.FileHeader{Name: "f/data/" + strconv.Itoa(k), Method: zip.Store})
		w.Write(st)
	}
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
		b := torchZip(c.pkl)
		_, _, err := readTorchSave(bytes.NewReader(b), int64(len(b)), "hostile.pt")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
	}
}

// ptStr is a pickle BINUNICODE opcode of s.
func ptStr(s string) []byte {
	return append(binary.LittleEndian.AppendUint32([]byte{'X'}, uint32(len(s))), s...)
}

// ptViewOps are the pickle opcodes that push
// torch._utils._rebuild_tensor_v2(storage, 0, size, stride) on a
// FloatStorage "0" of numel elements.
func ptViewOps(numel int, size, stride []int) []byte {
	p := []byte("ctorch._utils\n_rebuild_tensor_v2\n((")
	p = append(p, ptStr("storage")...)
	p = append(p, "ctorch\nFloatStorage\n"...)
	p = append(p, ptStr("0")...)
	p = append(p, ptStr("cpu")...)
	p = binary.LittleEndian.AppendUint32(append(p, 'J'), uint32(numel))
	p = append(p, 't', 'Q', 'K', 0)
	for _, v := range [][]int{size, stride} {
		p = append(p, '(')
		for _, x := range v {
			p = binary.LittleEndian.AppendUint32(append(p, 'J'), uint32(x))
		}
		p = append(p, 't')
	}
	return append(p, 't', 'R')
}

// A view that names a storage element more than once (a broadcast: stride
// 0 on a dimension of size > 1, or an overlapping as_strided window) is
// refused at open. The reader allocates a view's bytes by its shape: a
// 372-byte file viewing one float as (2^30, 2^30) with stride (0, 0) made
// Read panic in makeslice. Views that name each element once still read.
func TestTorchSaveOverlappingViews(t *testing.T) {
	// four float32 elements (their bytes are what a read must gather)
	storage := []byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0}
	for _, c := range []struct {
		name         string
		numel        int
		size, stride []int
		want         string // error, or "" for a view that reads
		shape        []int
		data         []byte
	}{
		{"2^60 floats from one", 1, []int{1 << 30, 1 << 30}, []int{0, 0}, "stride [0 0]) of storage 0 is broadcast (stride 0 on dimension 0 of size 1073741824)", nil, nil},
		{"expand(3, 4)", 4, []int{3, 4}, []int{0, 1}, "size [3 4], stride [0 1]) of storage 0 is broadcast (stride 0 on dimension 0 of size 3): expanded views are not read", nil, nil},
		{"as_strided window", 3, []int{2, 2}, []int{1, 1}, "overlaps itself (16 bytes of elements in a span of 12 bytes): overlapping views are not read", nil, nil},
		{"transpose", 4, []int{2, 2}, []int{1, 2}, "", []int{2, 2}, []byte{1, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0}},
		{"stride 0 on a dimension of size 1", 4, []int{1, 4}, []int{0, 1}, "", []int{1, 4}, storage},
		{"empty, stride 0", 4, []int{0, 5}, []int{0, 0}, "", []int{0, 5}, []byte{}},
	} {
		pkl := append([]byte{0x80, 2, '}', 'q', 0}, ptStr("x")...)
		pkl = append(append(pkl, ptViewOps(c.numel, c.size, c.stride)...), 's', '.')
		p := filepath.Join(t.TempDir(), "view.pt")
		if err := os.WriteFile(p, torchZip(pkl, storage[:4*c.numel]), 0o644); err != nil {
			t.Fatal(err)
		}
		d, err := Open(p)
		if c.want != "" {
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), p) {
				t.Errorf("%s: error %v, want one naming %s and containing %q", c.name, err, p, c.want)
			}
			if err == nil {
				d.Close()
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		r, err := d.Read(&d.Entries[0])
		d.Close()
		if err != nil || !equalInts(r.Shape, c.shape) || !bytes.Equal(r.Data, c.data) {
			t.Errorf("%s: read %v %v, %v; want %v %v", c.name, r.Shape, r.Data, err, c.shape, c.data)
		}
	}
}

// Integers wider than a tensor file needs are refused before gopickle
// decodes them (in time quadratic in their length: a 128 KiB LONG4 took
// 1.2 s, a 10 MiB one hours); int64-sized ones still decode.
func TestTorchSaveLongIntegers(t *testing.T) {
	long4 := func(n int) []byte {
		p := binary.LittleEndian.AppendUint32([]byte{0x80, 2, 0x8b}, uint32(n))
		return append(append(p, bytes.Repeat([]byte{0x11}, n)...), '.')
	}
	long1 := func(n int) []byte {
		return append(append([]byte{0x80, 2, 0x8a, byte(n)}, bytes.Repeat([]byte{0x7f}, n)...), '.')
	}
	for _, c := range []struct {
		name string
		pkl  []byte
		want string // "" when the pickle is accepted
	}{
		{"LONG4 of 128 KiB", long4(128 << 10), "pickle LONG4 at offset 2: an integer of 131072 bytes (a tensor file's integers fit in 8)"},
		{"LONG4 of 9 bytes", long4(9), "pickle LONG4 at offset 2: an integer of 9 bytes"},
		{"LONG1 of 255 bytes", long1(255), "pickle LONG1 at offset 2: an integer of 255 bytes"},
		{"LONG1 of 9 bytes", long1(9), "pickle LONG1 at offset 2: an integer of 9 bytes"},
		{"INT of 25 digits", []byte("(I1234567890123456789012345\nt."), "pickle INT at offset 1: an integer of 25 characters (a tensor file's integers fit in 24)"},
		{"LONG of 1000 digits", []byte("L" + strings.Repeat("9", 1000) + "L\n."), "pickle LONG at offset 0: an integer of 1001 characters"},
		{"LONG1 of 8 bytes", long1(8), ""},
		{"LONG4 of 8 bytes", long4(8), ""},
		{"INT bool", []byte("I01\n."), ""},
		{"LONG int64 min", []byte("L-9223372036854775808L\n."), ""},
	} {
		b := torchZip(c.pkl)
		_, _, err := readTorchSave(bytes.NewReader(b), int64(len(b)), "long.pt")
		if c.want == "" {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
		} else if err == nil || !strings.Contains(err.Error(), "long.pt: f/data.pkl: "+c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
	}
}

// ptKeyChain is a pickle whose value is a list of refs references to one
// chain of depth dicts, each holding the one before under the same key of
// keyLen bytes (memoized), the innermost holding leaf under it: every
// reference spells depth names of up to depth*(keyLen+1) bytes.
func ptKeyChain(keyLen, depth, refs int, leaf []byte) []byte {
	p := append([]byte{0x80, 2}, ptStr(strings.Repeat("k", keyLen))...)
	p = append(p, 'q', 0)
	p = append(append(p, leaf...), 'q', 1)
	for i := 1; i <= depth; i++ {
		p = append(p, '}', 'h', 0, 'h', byte(i), 's', 'q', byte(i+1))
	}
	p = append(p, ']', '(')
	for i := 0; i < refs; i++ {
		p = append(p, 'h', byte(depth+1))
	}
	return append(p, 'e', '.')
}

// The names of a pickle are charged to byte budgets set from the pickle's
// length: the dict keys the walk visits (hashing each), and the dotted names
// built from them. One dict chain named again and again under long keys
// built gigabytes of names (a 16 KiB key nested 62 deep, named a thousand
// times, took 38 s on a 21 KB file). The long name of an SGLang record,
// prefixed to each of many references to one tensor, is charged too.
func TestTorchSaveNameBudget(t *testing.T) {
	storage := make([]byte, 4)
	// {"value": [t, t, ...], "meta": {"name": <64 KiB>}}
	sglang := append([]byte{0x80, 2, '}', '('}, ptStr("value")...)
	sglang = append(append(sglang, ']', '('), ptViewOps(1, []int{1}, []int{1})...)
	sglang = append(sglang, 'q', 0)
	for i := 0; i < 100; i++ {
		sglang = append(sglang, 'h', 0)
	}
	sglang = append(append(sglang, 'e'), ptStr("meta")...)
	sglang = append(append(sglang, '}'), ptStr("name")...)
	sglang = append(append(sglang, ptStr(strings.Repeat("n", 64<<10))...), 's', 'u', '.')
	const keys, names = "the pickle's dict keys hold more than ", "the pickle's keys spell names of more than "
	for _, c := range []struct {
		name string
		pkl  []byte
		want string
	}{
		{"a 16 KiB key nested 62 deep, named 100 times", ptKeyChain(16<<10, 62, 100, []byte{'N'}), keys},
		{"a 64-byte key nested 62 deep, named 64 times", ptKeyChain(64, 62, 64, []byte{'N'}), names},
		{"a 64 KiB SGLang name on 100 tensors", sglang, names},
	} {
		p := filepath.Join(t.TempDir(), "names.pt")
		if err := os.WriteFile(p, torchZip(c.pkl, storage), 0o644); err != nil {
			t.Fatal(err)
		}
		d, err := Open(p)
		if err == nil {
			d.Close()
		}
		if err == nil || !strings.Contains(err.Error(), p+": ") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one naming the file and containing %q", c.name, err, c.want)
		}
	}
	// short keys nested as deep still read
	p := filepath.Join(t.TempDir(), "deep.pt")
	os.WriteFile(p, torchZip(ptKeyChain(8, 62, 4, ptViewOps(1, []int{1}, []int{1})), storage), 0o644)
	d, err := Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if len(d.Entries) != 4 || !strings.HasPrefix(d.Entries[3].Name, "3.kkkkkkkk.kkkkkkkk.") {
		t.Errorf("%d entries, last %q", len(d.Entries), d.Entries[len(d.Entries)-1].Name)
	}
}

// The set opcodes are refused while the pickle is scanned: a tensor file
// holds no set, and gopickle hashes each item added to one (one long
// string added to many sets is quadratic work).
func TestTorchSaveRefusesSets(t *testing.T) {
	for _, c := range []struct {
		pkl  []byte
		want string
	}{
		{append(append([]byte{0x80, 2, 0x8f, '('}, ptStr("a")...), 0x90, '.'), "pickle opcode 0x8f at offset 2 is not allowed in a tensor file"},
		{append(append([]byte{0x80, 2, '('}, ptStr("a")...), 0x91, '.'), "pickle opcode 0x91 at offset 9 is not allowed in a tensor file"},
	} {
		if err := scanPickle(c.pkl); err == nil || err.Error() != c.want {
			t.Errorf("% x: %v, want %q", c.pkl, err, c.want)
		}
	}
}

// A long string spelled once and pushed again through the memo (GET, DUP)
// is budgeted by scanPickle, which models the stack for it: gopickle hashes
// a string each time it is set as an OrderedDict key, so one 1 MiB key
// pushed a thousand times was a gigabyte hashed from a 1 MiB file. The model
// follows the string through POP and PUT. STACK_GLOBAL (protocol 4) is
// refused: its module and name come from the stack, past the allow-list.
func TestTorchSaveMemoStrings(t *testing.T) {
	long := func() []byte { // PROTO 2, BINUNICODE of 1 MiB
		p := []byte{0x80, 2, 'X'}
		p = binary.LittleEndian.AppendUint32(p, 1<<20)
		return append(p, bytes.Repeat([]byte{'k'}, 1<<20)...)
	}
	repeat := func(p []byte, op []byte, n int) []byte {
		for range n {
			p = append(p, op...)
		}
		return p
	}
	get := append(append(long(), 'q', 0, '0', '('), repeat(nil, []byte{'h', 0}, 1000)...)
	get = append(get, 'l', '.')
	dup := append(long(), '(')
	dup = append(repeat(dup[:len(dup)-1], []byte{'2'}, 1000), 'l', '.')
	// the string, then None, POP: the string is on top again, PUT, GETs
	popPut := append(append(long(), 'N', '0', 'q', 1, '0', '('), repeat(nil, []byte{'h', 1}, 1000)...)
	popPut = append(popPut, 'l', '.')
	few := append(append(long(), 'q', 0, '0', '('), repeat(nil, []byte{'h', 0}, 4)...)
	few = append(few, 'l', '.')
	const budget = "strings pushed again from the memo hold more than"
	for _, c := range []struct {
		name string
		pkl  []byte
		want string
	}{
		{"1000 GETs of a 1 MiB string", get, budget},
		{"1000 DUPs of a 1 MiB string", dup, budget},
		{"POP, then PUT and 1000 GETs", popPut, budget},
		{"4 GETs of a 1 MiB string", few, ""},
		{"STACK_GLOBAL", []byte("\x80\x04\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94."), "STACK_GLOBAL at offset"},
	} {
		err := scanPickle(c.pkl)
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}
