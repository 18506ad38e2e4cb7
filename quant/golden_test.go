package quant

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"testing"
)

// goldenPath is the file written by capture/golden/quant_golden.py on a CUDA GPU
// (see testdata/quant/README.md).
const goldenPath = "../testdata/quant/golden.bin.gz"

const goldenMagic = "SMQGOLD\x01"

// goldenRecord is one named array of the golden file: size bytes per element.
type goldenRecord struct {
	size int
	data []byte
}

func (r goldenRecord) len() int { return len(r.data) / r.size }

func (r goldenRecord) u8(i int) uint8   { return r.data[i] }
func (r goldenRecord) u16(i int) uint16 { return binary.LittleEndian.Uint16(r.data[2*i:]) }
func (r goldenRecord) u32(i int) uint32 { return binary.LittleEndian.Uint32(r.data[4*i:]) }

// readGolden parses the golden file format:
//
//	magic "SMQGOLD\x01", u32 record count, then per record
//	u16 name length, name, u8 element size (1, 2, 4), u32 element count, data
//
// all little-endian, the whole stream gzip-compressed. Every length is checked
// against the bytes that remain before it is used.
func readGolden(path string) (map[string]goldenRecord, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	// The decompressed file is ~2 MB; refuse anything far larger.
	b, err := io.ReadAll(io.LimitReader(zr, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(b) < len(goldenMagic)+4 || !bytes.Equal(b[:len(goldenMagic)], []byte(goldenMagic)) {
		return nil, fmt.Errorf("%s: not a quant golden file (bad magic); regenerate with capture/golden/quant_golden.py", path)
	}
	off := len(goldenMagic)
	n := int(binary.LittleEndian.Uint32(b[off:]))
	off += 4
	recs := make(map[string]goldenRecord)
	for i := 0; i < n; i++ {
		if len(b)-off < 2 {
			return nil, fmt.Errorf("%s: record %d at offset %d: truncated name length", path, i, off)
		}
		nl := int(binary.LittleEndian.Uint16(b[off:]))
		off += 2
		if len(b)-off < nl+5 {
			return nil, fmt.Errorf("%s: record %d at offset %d: truncated header", path, i, off)
		}
		name := string(b[off : off+nl])
		off += nl
		size := int(b[off])
		cnt := int(binary.LittleEndian.Uint32(b[off+1:]))
		off += 5
		if size != 1 && size != 2 && size != 4 {
			return nil, fmt.Errorf("%s: record %q at offset %d: element size %d", path, name, off, size)
		}
		if cnt > (len(b)-off)/size {
			return nil, fmt.Errorf("%s: record %q at offset %d: %d elements of %d bytes exceed the %d bytes left", path, name, off, cnt, size, len(b)-off)
		}
		recs[name] = goldenRecord{size: size, data: b[off : off+cnt*size]}
		off += cnt * size
	}
	if off != len(b) {
		return nil, fmt.Errorf("%s: %d trailing bytes after %d records", path, len(b)-off, n)
	}
	return recs, nil
}

var goldenCache map[string]goldenRecord

func golden(t *testing.T) map[string]goldenRecord {
	t.Helper()
	if goldenCache == nil {
		g, err := readGolden(goldenPath)
		if err != nil {
			t.Fatal(err)
		}
		goldenCache = g
		if m, ok := g["meta"]; ok {
			t.Logf("golden: %s", m.data)
		}
	}
	return goldenCache
}

func rec(t *testing.T, name string, size int) goldenRecord {
	t.Helper()
	r, ok := golden(t)[name]
	if !ok {
		t.Fatalf("golden file lacks record %q", name)
	}
	if r.size != size {
		t.Fatalf("golden record %q: element size %d, want %d", name, r.size, size)
	}
	return r
}

// mismatches reports the first few differences and fails the test if there is any.
type mismatches struct {
	t    *testing.T
	name string
	n    int
}

func (m *mismatches) add(format string, args ...any) {
	m.n++
	if m.n <= 8 {
		m.t.Errorf("%s: "+format, append([]any{m.name}, args...)...)
	}
}

func (m *mismatches) done(total int) {
	if m.n > 8 {
		m.t.Errorf("%s: %d of %d differ in all", m.name, m.n, total)
	}
}

func TestGoldenCasts(t *testing.T) {
	in := rec(t, "cast/in", 4)
	cases := []struct {
		name string
		size int
		got  func(float32) uint32
	}{
		{"cast/bf16", 2, func(f float32) uint32 { return uint32(BF16Bits(f)) }},
		{"cast/f16", 2, func(f float32) uint32 { return uint32(F16Bits(f)) }},
		{"cast/e4m3fn", 1, func(f float32) uint32 { return uint32(EncodeE4M3(f)) }},
		{"cast/e5m2", 1, func(f float32) uint32 { return uint32(EncodeE5M2(f)) }},
		{"cast/e8m0fnu", 1, func(f float32) uint32 { return uint32(CastUE8M0(f)) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want := rec(t, c.name, c.size)
			if want.len() != in.len() {
				t.Fatalf("%d outputs for %d inputs", want.len(), in.len())
			}
			m := mismatches{t: t, name: c.name}
			for i := 0; i < in.len(); i++ {
				var w uint32
				switch c.size {
				case 1:
					w = uint32(want.u8(i))
				case 2:
					w = uint32(want.u16(i))
				}
				if g := c.got(math.Float32frombits(in.u32(i))); g != w {
					m.add("input %#08x: got %#x, torch %#x", in.u32(i), g, w)
				}
			}
			m.done(in.len())
		})
	}
}

func TestGoldenDecode(t *testing.T) {
	cases := []struct {
		name string
		n    int
		got  func(uint16) float32
	}{
		{"decode/e4m3fn", 256, func(c uint16) float32 { return DecodeE4M3(uint8(c)) }},
		{"decode/e5m2", 256, func(c uint16) float32 { return DecodeE5M2(uint8(c)) }},
		{"decode/e8m0fnu", 256, func(c uint16) float32 { return DecodeUE8M0(uint8(c)) }},
		{"decode/f16", 65536, F16ToF32},
		{"decode/bf16", 65536, BF16ToF32},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want := rec(t, c.name, 4)
			if want.len() != c.n {
				t.Fatalf("%d codes, want %d", want.len(), c.n)
			}
			m := mismatches{t: t, name: c.name}
			for i := 0; i < c.n; i++ {
				if g := math.Float32bits(c.got(uint16(i))); g != want.u32(i) {
					m.add("code %#x: got %#08x, torch %#08x", i, g, want.u32(i))
				}
			}
			m.done(c.n)
		})
	}
}

// bf16Slice widens a record of bf16 bit patterns to fp32.
func bf16Slice(r goldenRecord) []float32 {
	v := make([]float32, r.len())
	for i := range v {
		v[i] = BF16ToF32(r.u16(i))
	}
	return v
}

func compareBF16(t *testing.T, name string, got []float32, want goldenRecord) {
	t.Helper()
	if len(got) != want.len() {
		t.Fatalf("%s: %d values, torch has %d", name, len(got), want.len())
	}
	m := mismatches{t: t, name: name}
	for i, g := range got {
		if b := BF16Bits(g); b != want.u16(i) || BF16ToF32(b) != g {
			m.add("element %d: got %#04x (%g), torch %#04x (%g)", i, b, g, want.u16(i), BF16ToF32(want.u16(i)))
		}
	}
	m.done(len(got))
}

func TestGoldenFQ8(t *testing.T) {
	in := bf16Slice(rec(t, "fq8/in", 2))
	v := append([]float32(nil), in...)
	FQ8(v, 64)
	compareBF16(t, "FQ8(v, 64)", v, rec(t, "fq8/out", 2))

	codes := make([]uint8, len(in))
	scales := make([]uint8, len(in)/64)
	QuantizeFP8(codes, scales, in, 64, ScaleCeil2, FP8AmaxFloor)
	compareBytes(t, "QuantizeFP8 codes", codes, rec(t, "qfp8/codes", 1))
	compareBytes(t, "QuantizeFP8 scales", scales, rec(t, "qfp8/scales", 1))

	q := make([]float32, len(in))
	s := make([]float32, len(in)/128)
	QuantizeActFP8(q, s, in, 128)
	wq, ws := rec(t, "act/codes", 1), rec(t, "act/scales", 4)
	m := mismatches{t: t, name: "QuantizeActFP8"}
	for i := range q {
		if math.Float32bits(q[i]) != math.Float32bits(DecodeE4M3(wq.u8(i))) {
			m.add("element %d: got %g, torch code %#02x", i, q[i], wq.u8(i))
		}
	}
	for b := range s {
		if math.Float32bits(s[b]) != ws.u32(b) {
			m.add("block %d: scale %g, torch %g", b, s[b], math.Float32frombits(ws.u32(b)))
		}
	}
	m.done(len(q) + len(s))
}

func compareBytes(t *testing.T, name string, got []uint8, want goldenRecord) {
	t.Helper()
	if len(got) != want.len() {
		t.Fatalf("%s: %d bytes, torch has %d", name, len(got), want.len())
	}
	m := mismatches{t: t, name: name}
	for i, g := range got {
		if g != want.u8(i) {
			m.add("byte %d: got %#02x, torch %#02x", i, g, want.u8(i))
		}
	}
	m.done(len(got))
}

func TestGoldenFQ4(t *testing.T) {
	in := bf16Slice(rec(t, "fq4/in", 2))
	v := append([]float32(nil), in...)
	FQ4(v, 32)
	compareBF16(t, "FQ4(v, 32)", v, rec(t, "fq4/out", 2))

	packed := make([]uint8, len(in)/2)
	scales := make([]uint8, len(in)/32)
	QuantizeFP4(packed, scales, in, 32, ScaleCeil2, FP4AmaxFloor)
	compareBytes(t, "QuantizeFP4 packed", packed, rec(t, "qfp4/packed", 1))
	compareBytes(t, "QuantizeFP4 scales", scales, rec(t, "qfp4/scales", 1))
}

// TestGoldenHadamard checks the butterfly bit for bit against the same butterfly
// run by torch on the GPU, and both Go forms against F.linear with the Sylvester
// matrix (cuBLAS fp32, its own summation order): there they may differ in the
// last bit before the bf16 rounding, which must stay rare and within one bf16 ulp.
func TestGoldenHadamard(t *testing.T) {
	in := bf16Slice(rec(t, "had/in", 2))
	fly := append([]float32(nil), in...)
	ref := make([]float32, len(in))
	for r := 0; r < len(in); r += 128 {
		Hadamard(fly[r : r+128])
		HadamardRef(ref[r:r+128], in[r:r+128])
	}
	compareBF16(t, "Hadamard vs torch butterfly", fly, rec(t, "had/butterfly", 2))

	lin := bf16Slice(rec(t, "had/linear", 2))
	for _, c := range []struct {
		name string
		got  []float32
	}{{"Hadamard", fly}, {"HadamardRef", ref}} {
		diff := 0
		for i, w := range lin {
			if d := BF16ULPDistance(c.got[i], w); d > 1 {
				t.Errorf("%s vs F.linear: element %d: got %g, torch %g (%d bf16 ulps)", c.name, i, c.got[i], w, d)
			} else if d == 1 {
				diff++
			}
		}
		t.Logf("%s vs F.linear on CUDA: %d of %d outputs one bf16 ulp apart, the rest identical", c.name, diff, len(lin))
		if diff*1000 > len(lin) {
			t.Errorf("%s vs F.linear: %d of %d outputs differ, more than 1 in 1000", c.name, diff, len(lin))
		}
	}
}

func TestGoldenWeightDequant(t *testing.T) {
	const rows, cols = 130, 260
	codes := rec(t, "wdq/codes", 1).data
	scale := rec(t, "wdq/scale", 1).data
	sinvRec := rec(t, "wdq/scale_inv", 4)
	sinv := make([]float32, sinvRec.len())
	for i := range sinv {
		sinv[i] = math.Float32frombits(sinvRec.u32(i))
	}
	for _, c := range []struct {
		name string
		run  func(dst []float32)
		want goldenRecord
	}{
		{"DequantFP8Weight", func(dst []float32) { DequantFP8Weight(dst, codes, scale, rows, cols) }, rec(t, "wdq/out", 4)},
		{"DequantFP8WeightInv", func(dst []float32) { DequantFP8WeightInv(dst, codes, sinv, rows, cols) }, rec(t, "wdq/out_inv", 4)},
	} {
		dst := make([]float32, rows*cols)
		c.run(dst)
		m := mismatches{t: t, name: c.name}
		for i, g := range dst {
			if math.Float32bits(g) != c.want.u32(i) {
				m.add("[%d, %d] code %#02x: got %#08x, torch %#08x", i/cols, i%cols, codes[i], math.Float32bits(g), c.want.u32(i))
			}
		}
		m.done(len(dst))
	}
}

func TestGoldenScaleRules(t *testing.T) {
	amax := rec(t, "scale/amax", 4)
	for _, q := range []struct {
		name        string
		qmax, floor float32
	}{{"e4m3", E4M3Max, FP8AmaxFloor}, {"e2m1", E2M1Max, FP4AmaxFloor}} {
		for r := ScaleCeil2; r <= ScaleRoundLog2; r++ {
			name := fmt.Sprintf("scale/%s_%s", r, q.name)
			want := rec(t, name, 2)
			m := mismatches{t: t, name: name}
			for i := 0; i < amax.len(); i++ {
				a := math.Float32frombits(amax.u32(i))
				if g, w := BlockScaleExp(r, a, q.qmax, q.floor), int(int16(want.u16(i))); g != w {
					m.add("amax %g (%#08x): exponent %d, torch %d", a, amax.u32(i), g, w)
				}
			}
			m.done(amax.len())
		}
	}
}
