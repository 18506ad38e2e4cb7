package kvcache

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"sparsemla/quant"
)

var allLayouts = []Layout{LayoutBF16, LayoutV4Model1, LayoutV32, LayoutIndexerFP8, LayoutIndexerMXFP4}

func testFormat(l Layout, P int) Format {
	dim := 0
	if l == LayoutBF16 {
		dim = 96
	}
	return MustFormat(l, dim, P)
}

// randRows returns n bf16 rows of width dim whose blocks span many magnitudes
// (including all-zero blocks and blocks below the amax floors).
func randRows(rng *rand.Rand, n, dim int) []float32 {
	v := make([]float32, n*dim)
	for i := range v {
		blockScale := math.Pow(10, float64((i/32)%13-6))
		if (i/32)%11 == 0 {
			blockScale = 0
		}
		v[i] = quant.BF16Round(float32(rng.NormFloat64() * blockScale))
	}
	return v
}

func TestLayoutIDs(t *testing.T) {
	for _, l := range allLayouts {
		got, err := ParseLayout(l.String())
		if err != nil || got != l {
			t.Errorf("ParseLayout(%q) = %v, %v", l.String(), got, err)
		}
	}
	if _, err := ParseLayout("fp8_ds_mla"); err == nil {
		t.Error("unknown layout id accepted")
	}
	if _, err := NewFormat(LayoutV4Model1, 576, 64); err == nil {
		t.Error("v4-model1 accepted a 576-wide entry")
	}
	if _, err := NewFormat(LayoutBF16, 0, 64); err == nil {
		t.Error("bf16 accepted width 0")
	}
}

// The page sizes of tools-and-formats.md §2.2 (MODEL1 padding to 576 bytes).
func TestModel1PageBytes(t *testing.T) {
	for _, c := range []struct{ P, bytes int }{{1, 1152}, {2, 1728}, {16, 9792}, {64, 37440}, {128, 74880}, {256, 149760}} {
		if got := MustFormat(LayoutV4Model1, 0, c.P).PageBytes(); got != c.bytes {
			t.Errorf("P=%d: PageBytes %d, want %d", c.P, got, c.bytes)
		}
	}
	for l, want := range map[Layout]int{LayoutV4Model1: 584, LayoutV32: 656, LayoutIndexerFP8: 132, LayoutIndexerMXFP4: 68} {
		if got := MustFormat(l, 0, 1).EntryBytes(); got != want {
			t.Errorf("%v entry %d bytes, want %d", l, got, want)
		}
	}
}

// Every byte of a page has exactly one location, and locations are distinct.
func TestLocateBijective(t *testing.T) {
	for _, l := range allLayouts {
		for _, P := range []int{1, 2, 5} {
			f := testFormat(l, P)
			seen := map[Location]int{}
			for off := 0; off < f.PageBytes(); off++ {
				loc := f.Locate(off)
				if loc.Field == FieldPagePad {
					continue
				}
				if prev, dup := seen[loc]; dup {
					t.Fatalf("%v: offsets %d and %d both map to %v", f, prev, off, loc)
				}
				seen[loc] = off
				if loc.Entry < 0 || loc.Entry >= P {
					t.Fatalf("%v: offset %d in entry %d", f, off, loc.Entry)
				}
			}
			if len(seen) != P*f.EntryBytes() {
				t.Fatalf("%v: %d located bytes, want %d", f, len(seen), P*f.EntryBytes())
			}
		}
	}
}

// expectedRoundTrip is what decode(encode(row)) must give under the reference
// scaling: the spec's fake quantisers FQ8/FQ4 on the quantised dims, bf16 on the rest.
func expectedRoundTrip(l Layout, row []float32) []float32 {
	w := append([]float32(nil), row...)
	quant.BF16RoundSlice(w)
	switch l {
	case LayoutV4Model1:
		quant.FQ8(w[:Model1Nope], Model1Tile)
	case LayoutV32:
		quant.FQ8(w[:V32Nope], V32Tile)
	case LayoutIndexerFP8:
		quant.FQ8(w, IndexerDim)
	case LayoutIndexerMXFP4:
		quant.FQ4(w, MXFP4Block)
	}
	return w
}

func TestRoundTripRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, l := range allLayouts {
		for _, P := range []int{1, 3, 64} {
			f := testFormat(l, P)
			page := make([]byte, f.PageBytes())
			rows := randRows(rng, P, f.Dim)
			f.EncodePage(page, rows, RefScaling(l))
			got := make([]float32, P*f.Dim)
			if fs := f.DecodePage(got, page); len(fs) != 0 {
				t.Fatalf("%v: faults on an encoder's page: %v", f, fs[0])
			}
			for e := 0; e < P; e++ {
				want := expectedRoundTrip(l, rows[e*f.Dim:(e+1)*f.Dim])
				for i, w := range want {
					if !sameBits(got[e*f.Dim+i], w) {
						t.Fatalf("%v entry %d dim %d: decoded %g, fake-quantised %g", f, e, i, got[e*f.Dim+i], w)
					}
				}
			}
			// Encoding the decoded values again gives the same values (FQ8/FQ4 are
			// idempotent on values). The bytes may differ: a block whose |max|
			// rounded down to exactly qmax/2·s is re-encoded with scale s/2.
			again := make([]byte, f.PageBytes())
			f.EncodePage(again, got, RefScaling(l))
			got2 := make([]float32, P*f.Dim)
			f.DecodePage(got2, again)
			for i := range got {
				if !sameBits(got2[i], got[i]) {
					t.Fatalf("%v entry %d dim %d: re-encoding changed %g to %g", f, i/f.Dim, i%f.Dim, got[i], got2[i])
				}
			}
		}
	}
}

// Engines' scale rules change bytes, not the decoded values of reference FQ8
// rows (spec §8.1), for every rule that floors |max| before dividing (reference,
// vLLM, SGLang). FlashMLA's test quantiser floors amax/448 at 1e-4 instead, so
// every block with |max| < 448·1e-4 = 0.0448 gets scale 2^-13 or coarser and
// loses the low bits of its small values.
func TestFQ8RowsLosslessUnderEveryRule(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	f := MustFormat(LayoutV4Model1, 0, 16)
	rows := randRows(rng, 16, 512)
	for e := 0; e < 16; e++ {
		quant.FQ8(rows[e*512:e*512+448], 64)
	}
	decode := func(sc Scaling) []float32 {
		page := make([]byte, f.PageBytes())
		f.EncodePage(page, rows, sc)
		got := make([]float32, len(rows))
		f.DecodePage(got, page)
		return got
	}
	for _, sc := range []Scaling{RefFP8, VLLMFP8, SGLangFP8} {
		got := decode(sc)
		for i := range rows {
			if got[i] != rows[i] {
				t.Fatalf("rule %v floor %g: entry %d dim %d: %g → %g", sc.Rule, sc.Floor, i/512, i%512, rows[i], got[i])
			}
		}
	}
	got := decode(FlashMLAFP8)
	lossy, lossyBig := 0, 0
	for b := 0; b < len(rows)/64; b++ {
		if b%8 == 7 { // rope dims 448..511 are stored as bf16
			continue
		}
		blk, dec := rows[b*64:(b+1)*64], got[b*64:(b+1)*64]
		for i := range blk {
			if blk[i] != dec[i] {
				lossy++
				if absMax(blk) >= 0.0448 {
					lossyBig++
				}
				break
			}
		}
	}
	if lossy == 0 || lossyBig != 0 {
		t.Fatalf("FlashMLA rule: %d lossy blocks, %d of them with |max| >= 0.0448; want some, none", lossy, lossyBig)
	}
}

// corrupt builds a one-entry-per-case page, applies mutate and checks the
// first fault's kind and offset.
func TestFaults(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	type tc struct {
		name   string
		layout Layout
		mutate func(f Format, page []byte) int // returns the offset the fault must name
		kind   FaultKind
		sev    Severity
	}
	m1 := func(P, e, tile int) int { return P*Model1DataBytes + e*Model1ScaleBytes + tile }
	cases := []tc{
		{"model1 scale NaN", LayoutV4Model1, func(f Format, p []byte) int { o := m1(f.P, 1, 3); p[o] = 0xFF; return o }, FaultScaleNaN, Error},
		{"model1 scale range", LayoutV4Model1, func(f Format, p []byte) int { o := m1(f.P, 2, 0); p[o] = 1; return o }, FaultScaleRange, Error},
		{"model1 codes zeroed under a scale", LayoutV4Model1, func(f Format, p []byte) int {
			clear(p[6*Model1Tile : 7*Model1Tile])
			return m1(f.P, 0, 6)
		}, FaultScaleLoose, Error},
		{"model1 NaN code", LayoutV4Model1, func(f Format, p []byte) int { o := 1*Model1DataBytes + 130; p[o] = 0xFF; return o }, FaultCodeNaN, Error},
		{"model1 rope inf", LayoutV4Model1, func(f Format, p []byte) int {
			o := 2*Model1DataBytes + Model1Nope + 2*7
			binary.LittleEndian.PutUint16(p[o:], 0x7F80)
			return o
		}, FaultNonFinite, Error},
		{"model1 pad", LayoutV4Model1, func(f Format, p []byte) int { o := m1(f.P, 1, 7); p[o] = 0x5A; return o }, FaultPadNonZero, Warn},
		{"model1 page pad", LayoutV4Model1, func(f Format, p []byte) int { o := len(p) - 3; p[o] = 1; return o }, FaultPadNonZero, Warn},
		{"v32 scale not pow2", LayoutV32, func(f Format, p []byte) int {
			o := V32EntryBytes + V32Nope + 8
			binary.LittleEndian.PutUint32(p[o:], math.Float32bits(0.3))
			return o
		}, FaultScaleNotPow2, Error},
		{"v32 scale negative", LayoutV32, func(f Format, p []byte) int {
			o := V32Nope + 4
			binary.LittleEndian.PutUint32(p[o:], math.Float32bits(-1))
			return o
		}, FaultScaleRange, Error},
		{"indexer-fp8 scale NaN", LayoutIndexerFP8, func(f Format, p []byte) int {
			o := f.P*IndexerDim + 4*2
			binary.LittleEndian.PutUint32(p[o:], 0x7FC00000)
			return o
		}, FaultScaleNaN, Error},
		{"indexer-fp8 NaN code", LayoutIndexerFP8, func(f Format, p []byte) int { o := IndexerDim + 5; p[o] = 0x7F; return o }, FaultCodeNaN, Error},
		{"indexer-mxfp4 scale NaN", LayoutIndexerMXFP4, func(f Format, p []byte) int { o := f.P*IndexerDim/2 + 4 + 2; p[o] = 0xFF; return o }, FaultScaleNaN, Error},
		{"indexer-mxfp4 codes zeroed under a scale", LayoutIndexerMXFP4, func(f Format, p []byte) int {
			clear(p[2*IndexerDim/2+16 : 2*IndexerDim/2+32])
			return f.P*IndexerDim/2 + 8 + 1
		}, FaultScaleLoose, Error},
		{"bf16 NaN", LayoutBF16, func(f Format, p []byte) int {
			o := 2*f.Dim + 10
			binary.LittleEndian.PutUint16(p[o:], 0xFFC1)
			return o
		}, FaultNonFinite, Error},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := testFormat(c.layout, 3)
			page := make([]byte, f.PageBytes())
			rows := make([]float32, 3*f.Dim)
			for i := range rows {
				rows[i] = quant.BF16Round(float32(rng.NormFloat64()))
			}
			f.EncodePage(page, rows, RefScaling(c.layout))
			off := c.mutate(f, page)
			fs := f.DecodePage(make([]float32, 3*f.Dim), page)
			if len(fs) != 1 {
				t.Fatalf("want exactly one fault, got %d: %v", len(fs), fs)
			}
			got := fs[0]
			if got.Kind != c.kind || got.Severity != c.sev || got.Offset != off {
				t.Fatalf("got %v, want %v (severity %d) at offset %d", got, c.kind, c.sev, off)
			}
			if got.Loc != f.Locate(off) || (got.Entry != got.Loc.Entry) {
				t.Fatalf("fault location %v / entry %d inconsistent with Locate %v", got.Loc, got.Entry, f.Locate(off))
			}
			if !strings.Contains(got.String(), c.kind.String()) {
				t.Fatalf("String() %q does not name the kind", got.String())
			}
		})
	}
}

func TestComparePages(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	f := MustFormat(LayoutV4Model1, 0, 4)
	a := make([]byte, f.PageBytes())
	f.EncodePage(a, randRows(rng, 4, 512), RefFP8)
	b := append([]byte(nil), a...)
	if d := f.ComparePages(b, a); d != nil {
		t.Fatalf("equal pages: %v", d)
	}
	// Pad bytes differ: masked.
	b[4*Model1DataBytes+2*Model1ScaleBytes+7] = 0x5A
	b[len(b)-1] = 0x11
	if d := f.ComparePages(b, a); d != nil {
		t.Fatalf("pad-only difference reported: %v", d)
	}
	// A rope byte of entry 2 and a scale of entry 3.
	ropeOff := 2*Model1DataBytes + Model1Nope + 2*5 + 1
	b[ropeOff] ^= 0x40
	b[4*Model1DataBytes+3*Model1ScaleBytes+1] ^= 1
	d := f.ComparePages(b, a)
	if d == nil {
		t.Fatal("difference not found")
	}
	want := Location{Entry: 2, Field: FieldRope, Index: Model1Nope + 5, Byte: 1}
	if d.Offset != ropeOff || d.Loc != want || d.Bytes != 2 || d.Entries != 2 || d.Masked != 2 {
		t.Fatalf("got %+v, want first at %d %v, 2 bytes in 2 entries, 2 masked", d, ropeOff, want)
	}
}

// The word-at-a-time decoders give the reference loops' values and faults on
// clean, corrupted and random pages of every layout.
func TestFastDecodeMatchesReference(t *testing.T) {
	if e4m3Hi != e4m3Half {
		t.Fatalf("e4m3Hi %#x, code of 224 is %#x", e4m3Hi, e4m3Half)
	}
	rng := rand.New(rand.NewPCG(13, 14))
	defer func() { fastDecode = true }()
	for _, l := range allLayouts {
		for _, P := range []int{1, 7} {
			f := testFormat(l, P)
			for trial := 0; trial < 20; trial++ {
				page := make([]byte, f.PageBytes())
				f.EncodePage(page, randRows(rng, P, f.Dim), RefScaling(l))
				switch trial % 3 {
				case 1: // a few corrupted bytes
					for k := 0; k < 1+trial%5; k++ {
						page[rng.IntN(len(page))] = uint8(rng.IntN(256))
					}
				case 2: // random bytes
					for i := range page {
						page[i] = uint8(rng.IntN(256))
					}
				}
				var got, want []float32
				var gotF, wantF Faults
				for _, fast := range []bool{true, false} {
					fastDecode = fast
					dst := make([]float32, P*f.Dim)
					fs := f.DecodePage(dst, page)
					if fast {
						got, gotF = dst, fs
					} else {
						want, wantF = dst, fs
					}
				}
				for i := range want {
					if !sameBits(got[i], want[i]) {
						t.Fatalf("%v trial %d value %d: fast %g, reference %g", f, trial, i, got[i], want[i])
					}
				}
				if len(gotF) != len(wantF) {
					t.Fatalf("%v trial %d: fast %d faults, reference %d", f, trial, len(gotF), len(wantF))
				}
				for i := range wantF {
					if gotF[i] != wantF[i] {
						t.Fatalf("%v trial %d fault %d: fast %v, reference %v", f, trial, i, gotF[i], wantF[i])
					}
				}
			}
		}
	}
}

// Pages of the same values under two scale rules differ in bytes but not in
// values; CompareValues tells the two apart.
func TestCompareValues(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 16))
	f := MustFormat(LayoutV4Model1, 0, 8)
	rows := randRows(rng, 8, 512)
	for e := 0; e < 8; e++ {
		quant.FQ8(rows[e*512:e*512+448], 64)
	}
	a, b := make([]byte, f.PageBytes()), make([]byte, f.PageBytes())
	f.EncodePage(a, rows, RefFP8)
	f.EncodePage(b, rows, SGLangFP8)
	if f.ComparePages(a, b) == nil {
		t.Fatal("rules with different floors gave identical bytes; test rows lack floored blocks")
	}
	if d := f.CompareValues(a, b); d != nil {
		t.Fatalf("same values reported different: %v", d)
	}
	b[3*Model1DataBytes+100] ^= 0x01
	d := f.CompareValues(b, a)
	if d == nil || d.Entry != 3 || d.Dim != 100 || d.Values != 1 || d.Entries != 1 {
		t.Fatalf("%+v", d)
	}
}

// For bf16 block maxima the scale rules of spec §9.4 differ only through their
// floors: |max|/448 of a bf16 value is either exactly a power of two or at
// least ~2^-8 (relative) away from one, so ceil2-from-bits, log2+ceil after a
// division and log2+ceil after a multiply by f32(1/448) agree on every
// positive finite bf16 value whose block is not floored. Checked exhaustively.
func TestScaleRulesAgreeOnBF16Maxima(t *testing.T) {
	inv := float32(1.0 / 448)
	n := 0
	for h := uint16(1); h < 0x7f80; h++ {
		a := quant.BF16ToF32(h)
		if a < 0.0448 { // every floor (1e-4 on amax, 1e-4 on amax/448) is inactive above this
			continue
		}
		ref := quant.BlockScaleExp(quant.ScaleCeil2, a, 448, 1e-4)
		div := quant.BlockScaleExp(quant.ScaleLog2Ceil, a, 448, 1e-4)
		fm := quant.BlockScaleExp(quant.ScaleFlashMLA, a, 448, 1e-4)
		mul := int(math.Ceil(float64(float32(math.Log2(float64(a * inv)))))) // vLLM's Triton expression
		if ref != div || ref != fm || ref != mul {
			t.Fatalf("bf16 %#04x = %g: ceil2 %d, log2ceil %d, flashmla %d, vllm %d", h, a, ref, div, fm, mul)
		}
		n++
	}
	if n < 16000 {
		t.Fatalf("only %d values checked", n)
	}
}
