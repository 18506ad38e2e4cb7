package dump

import (
	"bytes"
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sparsemla/quant"
)

const goldenDir = "../testdata/dump/official-v4-tiny"

// TestSafetensorsGoldenStep checks invariants the official dump guarantees
// (README.txt of official-v4-tiny): step_3 has pos = 3; the window K row of
// the step is stored in kv_cache slot P mod 128; the indexer's return value is
// index_topk + 128 and equals the compressed tail of topk_idxs.
func TestSafetensorsGoldenStep(t *testing.T) {
	s, err := OpenSafetensors(filepath.Join(goldenDir, "step_3.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Metadata["pos"] != "3" {
		t.Errorf("metadata pos = %q, want 3", s.Metadata["pos"])
	}
	pos, _, err := s.Int64("pos")
	if err != nil || len(pos) != 1 || pos[0] != 3 {
		t.Fatalf("pos = %v, %v; want [3]", pos, err)
	}
	kv, shape, err := s.Float32("L0.kv")
	if err != nil || !slices.Equal(shape, []int{512}) {
		t.Fatalf("L0.kv: %v %v", shape, err)
	}
	cache, cshape, err := s.Float32("L0.kv_cache")
	if err != nil || !slices.Equal(cshape, []int{128, 512}) {
		t.Fatalf("L0.kv_cache: %v %v", cshape, err)
	}
	if !slices.Equal(kv, cache[3*512:4*512]) {
		t.Errorf("L0.kv differs from kv_cache row 3")
	}
	topk, _, err := s.Int64("L1.index_topk")
	if err != nil {
		t.Fatal(err)
	}
	sel, _, err := s.Int64("L1.index_sel")
	if err != nil {
		t.Fatal(err)
	}
	idx, ishape, err := s.Int64("L1.topk_idxs") // I32 on disk
	if err != nil || !slices.Equal(ishape, []int{129}) {
		t.Fatalf("L1.topk_idxs: %v %v", ishape, err)
	}
	for i := range topk {
		if sel[i] != topk[i]+128 || idx[128+i] != sel[i] {
			t.Errorf("index_sel[%d] = %d, index_topk = %d, topk_idxs[128+%d] = %d", i, sel[i], topk[i], i, idx[128+i])
		}
	}
	// bf16 values decode exactly: every value is an fp32 with 16 zero low bits.
	for i, v := range kv {
		if quant.BF16Round(v) != v {
			t.Fatalf("L0.kv[%d] = %v is not a bf16 value", i, v)
		}
	}
	if _, err := s.Read("nope"); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("missing tensor: err = %v", err)
	}
}

// TestSafetensorsGoldenWeights decodes an FP8 weight and its raw UE8M0 scale
// bytes and checks the generation rule of the README: the block scale is
// pow2ceil(amax/448), so every dequantised block's amax lies in (224, 448]
// times the scale... i.e. the largest |code value| of a block is in (224, 448].
func TestSafetensorsGoldenWeights(t *testing.T) {
	s, err := OpenSafetensors(filepath.Join(goldenDir, "weights.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	w, wshape, err := s.Float32("layers.0.attn.wq_a.weight")
	if err != nil || !slices.Equal(wshape, []int{128, 256}) {
		t.Fatalf("wq_a.weight: %v %v", wshape, err)
	}
	sc, sshape, err := s.Int64("layers.0.attn.wq_a.scale")
	if err != nil || !slices.Equal(sshape, []int{1, 2}) {
		t.Fatalf("wq_a.scale: %v %v", sshape, err)
	}
	for b := 0; b < 2; b++ {
		var amax float32
		for r := 0; r < 128; r++ {
			for c := b * 128; c < (b+1)*128; c++ {
				amax = max(amax, float32(math.Abs(float64(w[r*256+c]))))
			}
		}
		if amax <= 224 || amax > 448 {
			t.Errorf("block %d: amax of E4M3 codes = %v, want in (224, 448]", b, amax)
		}
		if s := quant.DecodeUE8M0(uint8(sc[b])); !(s > 0) || s > 1 {
			t.Errorf("block %d: scale %v not a small power of two", b, s)
		}
	}
}

// sampleRecords returns one record of every dtype with hand-checkable bytes.
func sampleRecords() []Record {
	le := binary.LittleEndian
	f32 := make([]byte, 12)
	for i, v := range []float32{1.5, -2, float32(math.Inf(1))} {
		le.PutUint32(f32[4*i:], math.Float32bits(v))
	}
	f64 := make([]byte, 16)
	le.PutUint64(f64, math.Float64bits(0.25))
	le.PutUint64(f64[8:], math.Float64bits(-3))
	bf := make([]byte, 4)
	le.PutUint16(bf, quant.BF16Bits(3.5))
	le.PutUint16(bf[2:], quant.BF16Bits(-0.125))
	f16 := make([]byte, 4)
	le.PutUint16(f16, quant.F16Bits(65504))
	le.PutUint16(f16[2:], quant.F16Bits(-1))
	i32 := make([]byte, 8)
	le.PutUint32(i32, uint32(0xFFFFFFFF)) // -1
	le.PutUint32(i32[4:], 130)
	i64 := make([]byte, 8)
	le.PutUint64(i64, uint64(1)<<40)
	i16 := make([]byte, 2)
	le.PutUint16(i16, 0x8000) // -32768
	return []Record{
		{Name: "f32", DType: F32, Shape: []int{3}, Data: f32},
		{Name: "f64", DType: F64, Shape: []int{2}, Data: f64},
		{Name: "bf16", DType: BF16, Shape: []int{1, 2}, Data: bf},
		{Name: "f16", DType: F16, Shape: []int{2}, Data: f16},
		{Name: "e4m3", DType: E4M3, Shape: []int{3}, Data: []byte{0x7E, 0x38, 0xB8}}, // 448, 1, -1
		{Name: "e5m2", DType: E5M2, Shape: []int{2}, Data: []byte{0x3C, 0x7C}},       // 1, +inf
		{Name: "e8m0", DType: E8M0, Shape: []int{2}, Data: []byte{127, 130}},         // 1, 8
		{Name: "fp4", DType: FP4, Shape: []int{4}, Data: []byte{0x92, 0x07}},         // 1, -0.5, 6, 0
		{Name: "i8", DType: I8, Shape: []int{2}, Data: []byte{0xFF, 5}},
		{Name: "i16", DType: I16, Shape: []int{1}, Data: i16},
		{Name: "i32", DType: I32, Shape: []int{2}, Data: i32},
		{Name: "i64", DType: I64, Shape: []int{}, Data: i64},
		{Name: "u8", DType: U8, Shape: []int{2}, Data: []byte{0xFF, 0}},
		{Name: "bool", DType: Bool, Shape: []int{1}, Data: []byte{1}},
		{Name: "empty", DType: BF16, Shape: []int{4, 0}, Data: []byte{}},
	}
}

// sampleWant is what sampleRecords decode to (floats, then ints).
var sampleWant = map[string][]float64{
	"f32":   {1.5, -2, math.Inf(1)},
	"f64":   {0.25, -3},
	"bf16":  {3.5, -0.125},
	"f16":   {65504, -1},
	"e4m3":  {448, 1, -1},
	"e5m2":  {1, math.Inf(1)},
	"e8m0":  {1, 8},
	"fp4":   {1, -0.5, 6, 0},
	"i8":    {-1, 5},
	"i16":   {-32768},
	"i32":   {-1, 130},
	"i64":   {1 << 40},
	"u8":    {255, 0},
	"bool":  {1},
	"empty": {},
}

func checkDecoded(t *testing.T, r *Record) {
	t.Helper()
	want, ok := sampleWant[r.Name]
	if !ok {
		t.Fatalf("unexpected record %q", r.Name)
	}
	var got []float64
	if r.DType.IsFloat() {
		v, err := r.Float32()
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range v {
			got = append(got, float64(x))
		}
		if _, err := r.Int64(); err == nil {
			t.Errorf("%s: Int64 of a float dtype succeeded", r.Name)
		}
	} else {
		v, err := r.Int64()
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range v {
			got = append(got, float64(x))
		}
		if _, err := r.Float32(); err == nil {
			t.Errorf("%s: Float32 of an integer dtype succeeded", r.Name)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("%s: got %v, want %v", r.Name, got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("%s[%d] = %v, want %v", r.Name, i, got[i], want[i])
		}
	}
}

func TestSafetensorsRoundTrip(t *testing.T) {
	recs := sampleRecords()
	var buf bytes.Buffer
	if err := WriteSafetensors(&buf, recs, map[string]string{"who": "test"}); err != nil {
		t.Fatal(err)
	}
	s, err := NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "mem")
	if err != nil {
		t.Fatal(err)
	}
	if s.Metadata["who"] != "test" || len(s.Entries) != len(recs) {
		t.Fatalf("metadata %v, %d entries", s.Metadata, len(s.Entries))
	}
	for _, want := range recs {
		r, err := s.Read(want.Name)
		if err != nil {
			t.Fatal(err)
		}
		if r.DType != want.DType || !slices.Equal(r.Shape, want.Shape) || !bytes.Equal(r.Data, want.Data) {
			t.Errorf("%s: got %s %v %x, want %s %v %x", want.Name, r.DType, r.Shape, r.Data, want.DType, want.Shape, want.Data)
		}
		checkDecoded(t, &r)
	}
}

// stFile builds a safetensors file from a raw header and a data area.
func stFile(hdr string, data int) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(hdr)))
	b = append(b, hdr...)
	return append(b, make([]byte, data)...)
}

func TestSafetensorsBadInput(t *testing.T) {
	cases := []struct {
		name string
		file []byte
		want string
	}{
		{"short", []byte{1, 2, 3}, "shorter than the 8-byte"},
		{"header past end", binary.LittleEndian.AppendUint64(nil, 1000), "exceeds the file"},
		{"huge header", binary.LittleEndian.AppendUint64(nil, 1<<62), "exceeds the"},
		{"bad json", stFile("{", 0), "header JSON"},
		{"unknown dtype", stFile(`{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}`, 1), `unknown dtype "Q7"`},
		{"past data", stFile(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 2), "outside the 2-byte data area"},
		{"count mismatch", stFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, 4), "needs 8 bytes"},
		{"negative dim", stFile(`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}}`, 0), "negative"},
		{"overflow", stFile(`{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}`, 0), "overflows"},
		{"overlap", stFile(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}`, 3), "overlaps"},
		{"no shape", stFile(`{"a":{"dtype":"U8","data_offsets":[0,0]}}`, 0), "missing shape"},
		{"bad metadata", stFile(`{"__metadata__":{"a":1}}`, 0), "__metadata__"},
		{"duplicate", stFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, 2), `duplicate tensor name "a"`},
		{"not an object", stFile(`[1, 2]`, 0), "want a JSON object"},
	}
	for _, c := range cases {
		_, err := NewSafetensors(bytes.NewReader(c.file), int64(len(c.file)), "bad.safetensors")
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "bad.safetensors") {
			t.Errorf("%s: err = %v, want it to name the file and contain %q", c.name, err, c.want)
		}
	}
}

func TestSafetensorsTruncatedRead(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "t.safetensors")
	var buf bytes.Buffer
	if err := WriteSafetensors(&buf, sampleRecords()[:1], nil); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, buf.Bytes()[:buf.Len()-1], 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenSafetensors(p); err == nil || !strings.Contains(err.Error(), "outside") {
		t.Errorf("truncated file: err = %v", err)
	}
}

func FuzzSafetensorsHeader(f *testing.F) {
	var buf bytes.Buffer
	if err := WriteSafetensors(&buf, sampleRecords(), map[string]string{"k": "v"}); err != nil {
		f.Fatal(err)
	}
	f.Add(buf.Bytes())
	f.Add(stFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, 4))
	f.Add(stFile(`{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}`, 2))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := NewSafetensors(bytes.NewReader(b), int64(len(b)), "fuzz")
		if err != nil {
			return
		}
		for _, n := range s.Names() {
			r, err := s.Read(n)
			if err != nil {
				t.Fatalf("header accepted but read failed: %v", err)
			}
			if err := r.Check(); err != nil {
				t.Fatalf("header accepted but record invalid: %v", err)
			}
			if _, err := r.Stats(); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// A truncated file cuts off several tensors: the error names the first of
// them in file order, the same on every run (the header is decoded into a
// map, whose iteration order varies).
func TestSafetensorsTruncatedErrorDeterministic(t *testing.T) {
	hdr := []byte(`{"z":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},` +
		`"b":{"dtype":"F32","shape":[4],"data_offsets":[16,32]},` +
		`"a":{"dtype":"F32","shape":[4],"data_offsets":[32,48]},` +
		`"c":{"dtype":"F32","shape":[4],"data_offsets":[48,64]}}`)
	var first string
	for run := 0; run < 50; run++ {
		_, err := ParseSafetensorsHeader(hdr, 20)
		if err == nil {
			t.Fatal("a header past the data area was accepted")
		}
		if run == 0 {
			first = err.Error()
			if !strings.Contains(first, `tensor "b"`) {
				t.Fatalf("error %q: want the first tensor cut off, \"b\"", first)
			}
		} else if err.Error() != first {
			t.Fatalf("run %d: %q, run 0: %q", run, err, first)
		}
	}
}
