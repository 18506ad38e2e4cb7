package kvcache

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"sparsemla/quant"
)

// slowDecode is an independent element-by-element decoder written from the
// layout tables (Locate's inverse): value (e, d) from its own bytes only.
func slowDecode(f Format, page []byte, e, d int) float32 {
	P := f.P
	bf16At := func(off int) float32 { return quant.BF16ToF32(binary.LittleEndian.Uint16(page[off:])) }
	f32At := func(off int) float32 { return math.Float32frombits(binary.LittleEndian.Uint32(page[off:])) }
	switch f.Layout {
	case LayoutV4Model1:
		if d >= Model1Nope {
			return bf16At(e*Model1DataBytes + Model1Nope + 2*(d-Model1Nope))
		}
		s := quant.DecodeUE8M0(page[P*Model1DataBytes+e*Model1ScaleBytes+d/Model1Tile])
		return quant.BF16Round(quant.DecodeE4M3(page[e*Model1DataBytes+d]) * s)
	case LayoutV32:
		base := e * V32EntryBytes
		if d >= V32Nope {
			return bf16At(base + V32Nope + 4*V32Tiles + 2*(d-V32Nope))
		}
		return quant.BF16Round(quant.DecodeE4M3(page[base+d]) * f32At(base+V32Nope+4*(d/V32Tile)))
	case LayoutIndexerFP8:
		return quant.BF16Round(quant.DecodeE4M3(page[e*IndexerDim+d]) * f32At(P*IndexerDim+4*e))
	case LayoutIndexerMXFP4:
		b := page[e*IndexerDim/2+d/2]
		c := b & 0xf
		if d%2 == 1 {
			c = b >> 4
		}
		return quant.BF16Round(quant.DecodeE2M1(c) * quant.DecodeUE8M0(page[P*IndexerDim/2+4*e+d/MXFP4Block]))
	}
	return bf16At(e*2*f.Dim + 2*d)
}

// fuzzDecode: any bytes decode without panicking, every value equals the
// element-by-element decoder, and every fault points at a byte of its entry
// whose Location Locate agrees with. p picks the page size (1..5 entries).
func fuzzDecode(f *testing.F, l Layout) {
	fm := testFormat(l, 2)
	page := make([]byte, fm.PageBytes())
	fm.EncodePage(page, make([]float32, 2*fm.Dim), RefScaling(l))
	f.Add(uint8(1), append([]byte(nil), page...))
	fm.EncodePage(page, randRows(rand.New(rand.NewPCG(1, 1)), 2, fm.Dim), RefScaling(l))
	f.Add(uint8(1), append([]byte(nil), page...))
	for j := range page {
		page[j] = uint8(j * 37)
	}
	f.Add(uint8(1), page)
	f.Add(uint8(0), []byte{0xFF, 0x7F, 0x80})
	f.Fuzz(func(t *testing.T, p uint8, data []byte) {
		fm := testFormat(l, int(p)%5+1)
		page := make([]byte, fm.PageBytes())
		copy(page, data)
		dst := make([]float32, fm.P*fm.Dim)
		faults := fm.DecodePage(dst, page)
		for e := 0; e < fm.P; e++ {
			for d := 0; d < fm.Dim; d++ {
				got, want := dst[e*fm.Dim+d], slowDecode(fm, page, e, d)
				if !sameBits(got, want) && !(got != got && want != want) {
					t.Fatalf("%v entry %d dim %d: DecodePage %g (%#x), element decoder %g (%#x)", fm, e, d, got, math.Float32bits(got), want, math.Float32bits(want))
				}
			}
		}
		for _, flt := range faults {
			if flt.Offset < 0 || flt.Offset >= len(page) || flt.Loc != fm.Locate(flt.Offset) || flt.Count < 1 {
				t.Fatalf("fault %+v inconsistent with the page", flt)
			}
			if flt.Loc.Field != FieldPagePad && flt.Entry != flt.Loc.Entry {
				t.Fatalf("fault %+v names entry %d, its byte is in entry %d", flt, flt.Entry, flt.Loc.Entry)
			}
		}
	})
}

func FuzzDecodeModel1(f *testing.F)       { fuzzDecode(f, LayoutV4Model1) }
func FuzzDecodeV32(f *testing.F)          { fuzzDecode(f, LayoutV32) }
func FuzzDecodeIndexerFP8(f *testing.F)   { fuzzDecode(f, LayoutIndexerFP8) }
func FuzzDecodeIndexerMXFP4(f *testing.F) { fuzzDecode(f, LayoutIndexerMXFP4) }
func FuzzDecodeBF16(f *testing.F)         { fuzzDecode(f, LayoutBF16) }

// FuzzRadixOps interprets the input as an operation sequence on the radix
// cache and its model (see radixRun.step) and checks every invariant after
// each operation and the zero accounting at the end.
func FuzzRadixOps(f *testing.F) {
	f.Add([]byte{0})
	f.Add([]byte{1, 0, 12, 0, 1, 0, 1, 2, 2, 1, 5, 0, 1, 0, 1, 9, 3, 8, 5})
	f.Add([]byte("insert match lock evict windows unlock: a longer seed drives more steps"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		r := newRadixRun(t, 1+int(data[0])%3)
		pos := 1
		next := func(n int) int {
			if n <= 1 || pos >= len(data) {
				return 0
			}
			v := int(data[pos]) % n
			pos++
			return v
		}
		for steps := 0; pos < len(data) && steps < 400; steps++ {
			r.step(next)
		}
		r.releaseAll()
	})
}
