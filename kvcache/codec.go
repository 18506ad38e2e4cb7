package kvcache

import (
	"encoding/binary"
	"fmt"
	"math"

	"sparsemla/quant"
)

// Tables built once from quant: the value of every E4M3 code and every E2M1
// code, and the codes of half the largest value (224 and 3), used by the
// tightness check of FaultScaleLoose.
var (
	e4m3Value [256]float32
	e2m1Value [16]float32
	e4m3Half  = quant.EncodeE4M3(quant.E4M3Max / 2) // 0x76: 224
	e2m1Half  = quant.EncodeE2M1(quant.E2M1Max / 2) // 5: 3.0
)

func init() {
	for c := range e4m3Value {
		e4m3Value[c] = quant.DecodeE4M3(uint8(c))
	}
	for c := range e2m1Value {
		e2m1Value[c] = quant.DecodeE2M1(uint8(c))
	}
}

// exactExp reports whether multiplying any E4M3 or E2M1 value by 2^x is exact in
// bf16 (the product stays a normal fp32/bf16 number), so the decoder may skip
// the bf16 rounding. Smallest nonzero code 2^-9 (E4M3 subnormal), largest 448.
func exactExp(x int) bool { return x >= -126+9 && x <= 119 }

func checkPage(f Format, page []byte) {
	if len(page) != f.PageBytes() {
		panic("kvcache: page length does not match the format")
	}
}

// ---------------------------------------------------------------------------
// Encoding

// EncodeEntry writes row (Dim values, bf16 values held as fp32) as entry e of
// page, quantising with sc where the layout quantises:
//
//	v4-model1:     nope[i] = E4M3(clamp(row[i]/s_t, ±448)), s_t = 2^x_t per 64 dims,
//	               scale byte t = x_t+127; rope = bf16(row[448:512]); pad byte = 0
//	v32:           as v4-model1 with 128-dim tiles and fp32 scales 2^x_t; rope = row[512:576]
//	indexer-fp8:   one 128-dim block, fp32 scale 2^x
//	indexer-mxfp4: E2M1 codes per 32-dim block (low nibble = even dim), UE8M0 scales
//	bf16:          bf16(row[i]) little endian
//
// x_t = quant.BlockScaleExp(sc.Rule, amax_t, qmax, sc.Floor). A block whose
// exponent leaves [-127, 127] gets UE8M0 byte 0xFF (NaN), as quant.QuantizeFP8
// does. Encoding the reference's FQ8 rows with RefFP8 is lossless.
func (f Format) EncodeEntry(page []byte, e int, row []float32, sc Scaling) {
	checkPage(f, page)
	if e < 0 || e >= f.P || len(row) != f.Dim {
		panic("kvcache: EncodeEntry entry or row width out of range")
	}
	P := f.P
	switch f.Layout {
	case LayoutV4Model1:
		data := page[e*Model1DataBytes : (e+1)*Model1DataBytes]
		scl := page[P*Model1DataBytes+e*Model1ScaleBytes : P*Model1DataBytes+(e+1)*Model1ScaleBytes]
		quant.QuantizeFP8(data[:Model1Nope], scl[:Model1Tiles], row[:Model1Nope], Model1Tile, sc.Rule, sc.Floor)
		putBF16(data[Model1Nope:], row[Model1Nope:])
		scl[Model1Tiles] = 0
	case LayoutV32:
		ent := page[e*V32EntryBytes : (e+1)*V32EntryBytes]
		for t := 0; t < V32Tiles; t++ {
			x := encodeFP8Block(ent[t*V32Tile:(t+1)*V32Tile], row[t*V32Tile:(t+1)*V32Tile], sc)
			binary.LittleEndian.PutUint32(ent[V32Nope+4*t:], math.Float32bits(float32(math.Ldexp(1, x))))
		}
		putBF16(ent[V32Nope+4*V32Tiles:], row[V32Nope:])
	case LayoutIndexerFP8:
		x := encodeFP8Block(page[e*IndexerDim:(e+1)*IndexerDim], row, sc)
		binary.LittleEndian.PutUint32(page[P*IndexerDim+4*e:], math.Float32bits(float32(math.Ldexp(1, x))))
	case LayoutIndexerMXFP4:
		quant.QuantizeFP4(page[e*IndexerDim/2:(e+1)*IndexerDim/2], page[P*IndexerDim/2+4*e:P*IndexerDim/2+4*e+4],
			row, MXFP4Block, sc.Rule, sc.Floor)
	default:
		putBF16(page[e*2*f.Dim:(e+1)*2*f.Dim], row)
	}
}

// EncodePage writes rows (n·Dim values, n ≤ P) as entries 0..n-1 of page and
// zeroes everything else (later entries, pad bytes, page padding).
func (f Format) EncodePage(page []byte, rows []float32, sc Scaling) {
	checkPage(f, page)
	if len(rows)%f.Dim != 0 || len(rows)/f.Dim > f.P {
		panic("kvcache: EncodePage rows do not fit the page")
	}
	clear(page)
	for e := 0; e < len(rows)/f.Dim; e++ {
		f.EncodeEntry(page, e, rows[e*f.Dim:(e+1)*f.Dim], sc)
	}
}

// encodeFP8Block quantises blk to E4M3 codes with one power-of-two scale and
// returns its exponent (quant.QuantizeFP8 for a single block, fp32 scale).
func encodeFP8Block(codes []byte, blk []float32, sc Scaling) int {
	var scale [1]uint8
	quant.QuantizeFP8(codes, scale[:], blk, len(blk), sc.Rule, sc.Floor)
	return quant.BlockScaleExp(sc.Rule, absMax(blk), quant.E4M3Max, sc.Floor)
}

// absMax is max_i |v_i|, NaN-propagating (torch amax).
func absMax(v []float32) float32 {
	var a float32
	for _, x := range v {
		x = float32(math.Abs(float64(x)))
		if x > a || x != x {
			a = x
		}
	}
	return a
}

func putBF16(dst []byte, v []float32) {
	for i, x := range v {
		binary.LittleEndian.PutUint16(dst[2*i:], quant.BF16Bits(x))
	}
}

// ---------------------------------------------------------------------------
// Decoding

// DecodePage decodes every entry of page into dst (P·Dim values, bf16 values
// held as fp32, entry e at dst[e·Dim:]) and returns the structural faults found,
// in page order (entries first, page padding last). Decoding never stops at a
// fault: a NaN code decodes to NaN, a NaN scale to NaN values, exactly what a
// GPU kernel reading the same bytes gets.
//
//	v4-model1 / v32 nope: bf16(E4M3(code) · scale)   (exact for real scales)
//	rope / bf16 values:   the stored bf16
//	indexer-fp8:          bf16(E4M3(code) · scale)
//	indexer-mxfp4:        bf16(E2M1(code) · 2^(byte-127))
func (f Format) DecodePage(dst []float32, page []byte) Faults {
	checkPage(f, page)
	if len(dst) < f.P*f.Dim {
		panic("kvcache: DecodePage destination too short")
	}
	var faults Faults
	for e := 0; e < f.P; e++ {
		faults = f.decodeEntry(dst[e*f.Dim:(e+1)*f.Dim], page, e, faults)
	}
	if f.Layout == LayoutV4Model1 {
		start := f.P * Model1EntryBytes
		first, n := -1, 0
		for i, b := range page[start:] {
			if b != 0 {
				if first < 0 {
					first = start + i
				}
				n++
			}
		}
		if n > 0 {
			faults = append(faults, Fault{Kind: FaultPadNonZero, Severity: Warn, Entry: -1, Offset: first,
				Loc: f.Locate(first), Bits: uint32(page[first]), Count: n, Detail: "page padding is never read"})
		}
	}
	return faults
}

// DecodeEntry decodes entry e of page into dst (Dim values) and appends the
// faults found to faults.
func (f Format) DecodeEntry(dst []float32, page []byte, e int, faults Faults) Faults {
	checkPage(f, page)
	if e < 0 || e >= f.P || len(dst) < f.Dim {
		panic("kvcache: DecodeEntry entry or destination out of range")
	}
	return f.decodeEntry(dst[:f.Dim], page, e, faults)
}

func (f Format) decodeEntry(dst []float32, page []byte, e int, faults Faults) Faults {
	P := f.P
	switch f.Layout {
	case LayoutV4Model1:
		dataOff := e * Model1DataBytes
		sclOff := P*Model1DataBytes + e*Model1ScaleBytes
		data := page[dataOff : dataOff+Model1DataBytes]
		scl := page[sclOff : sclOff+Model1ScaleBytes]
		if fastDecode && model1EntryFast(dst, data, scl) {
			break // a clean entry: no faults
		}
		for t := 0; t < Model1Tiles; t++ {
			faults = decodeFP8Tile(dst[t*Model1Tile:(t+1)*Model1Tile], data[t*Model1Tile:(t+1)*Model1Tile],
				scl[t], f, e, dataOff+t*Model1Tile, sclOff+t, faults)
		}
		faults = decodeBF16(dst[Model1Nope:], data[Model1Nope:], f, e, dataOff+Model1Nope, faults)
		if scl[Model1Tiles] != 0 {
			off := sclOff + Model1Tiles
			faults = append(faults, Fault{Kind: FaultPadNonZero, Severity: Warn, Entry: e, Offset: off,
				Loc: f.Locate(off), Bits: uint32(scl[Model1Tiles]), Count: 1, Detail: "the 8th scale byte is never read"})
		}
	case LayoutV32:
		base := e * V32EntryBytes
		ent := page[base : base+V32EntryBytes]
		for t := 0; t < V32Tiles; t++ {
			soff := base + V32Nope + 4*t
			s, bad := checkF32Scale(binary.LittleEndian.Uint32(ent[V32Nope+4*t:]), f, e, soff, FP8ScaleExpMin, FP8ScaleExpMax)
			if bad != nil {
				faults = append(faults, *bad)
			}
			faults = decodeFP8Codes(dst[t*V32Tile:(t+1)*V32Tile], ent[t*V32Tile:(t+1)*V32Tile], s, bad == nil,
				f, e, base+t*V32Tile, soff, faults)
		}
		faults = decodeBF16(dst[V32Nope:], ent[V32Nope+4*V32Tiles:], f, e, base+V32Nope+4*V32Tiles, faults)
	case LayoutIndexerFP8:
		soff := P*IndexerDim + 4*e
		s, bad := checkF32Scale(binary.LittleEndian.Uint32(page[soff:]), f, e, soff, FP8ScaleExpMin, FP8ScaleExpMax)
		if bad != nil {
			faults = append(faults, *bad)
		}
		faults = decodeFP8Codes(dst, page[e*IndexerDim:(e+1)*IndexerDim], s, bad == nil, f, e, e*IndexerDim, soff, faults)
	case LayoutIndexerMXFP4:
		const half = IndexerDim / 2
		for t := 0; t < IndexerDim/MXFP4Block; t++ {
			soff := P*half + 4*e + t
			coff := e*half + t*MXFP4Block/2
			faults = decodeFP4Block(dst[t*MXFP4Block:(t+1)*MXFP4Block], page[coff:coff+MXFP4Block/2], page[soff],
				f, e, coff, soff, faults)
		}
	default:
		off := e * 2 * f.Dim
		faults = decodeBF16(dst, page[off:off+2*f.Dim], f, e, off, faults)
	}
	return faults
}

// decodeFP8Tile decodes one UE8M0-scaled tile of E4M3 codes after checking its
// scale byte b (at page offset soff).
func decodeFP8Tile(dst []float32, codes []byte, b byte, f Format, e, coff, soff int, faults Faults) Faults {
	x := int(b) - 127
	switch {
	case b == quant.UE8M0NaN:
		faults = append(faults, Fault{Kind: FaultScaleNaN, Entry: e, Offset: soff, Loc: f.Locate(soff), Bits: uint32(b),
			Count: 1, Detail: "UE8M0 0xFF is NaN: every value of the block decodes to NaN"})
	case x < FP8ScaleExpMin || x > FP8ScaleExpMax:
		faults = append(faults, Fault{Kind: FaultScaleRange, Entry: e, Offset: soff, Loc: f.Locate(soff), Bits: uint32(b),
			Count: 1, Detail: fmt.Sprintf("scale 2^%d is outside [2^%d, 2^%d], which no bf16 block produces", x, FP8ScaleExpMin, FP8ScaleExpMax)})
	}
	return decodeFP8Codes(dst, codes, quant.DecodeUE8M0(b), b != quant.UE8M0NaN && x >= FP8ScaleExpMin && x <= FP8ScaleExpMax,
		f, e, coff, soff, faults)
}

// decodeFP8Codes writes dst[i] = bf16(E4M3(codes[i])·s) and checks the codes:
// NaN codes, and (when the scale itself is sane) the tightness of the scale.
func decodeFP8Codes(dst []float32, codes []byte, s float32, scaleOK bool, f Format, e, coff, soff int, faults Faults) Faults {
	dst = dst[:len(codes)]
	var nan, half bool
	if fastDecode {
		nan, half = fp8Fast(dst, codes, s)
	} else {
		var maxMag uint8
		for i, c := range codes {
			dst[i] = e4m3Value[c] * s
			maxMag = max(maxMag, c&0x7f)
		}
		nan, half = maxMag == 0x7f, maxMag >= e4m3Half
	}
	x := scaleExp(s)
	if !exactExp(x) {
		quant.BF16RoundSlice(dst)
	}
	if nan {
		first, n := -1, 0
		for i, c := range codes {
			if c&0x7f == 0x7f {
				if first < 0 {
					first = i
				}
				n++
			}
		}
		off := coff + first
		faults = append(faults, Fault{Kind: FaultCodeNaN, Entry: e, Offset: off, Loc: f.Locate(off), Bits: uint32(codes[first]),
			Count: n, Detail: "E4M3 NaN code: no encoder writes it (values are clamped to ±448 first)"})
	} else if scaleOK && x > FP8FlooredExpMax && !half {
		var maxMag uint8
		for _, c := range codes {
			maxMag = max(maxMag, c&0x7f)
		}
		faults = append(faults, Fault{Kind: FaultScaleLoose, Entry: e, Offset: soff, Loc: f.Locate(soff), Bits: scaleBits(f, s),
			Count: 1, Detail: fmt.Sprintf("scale 2^%d but the block's largest |code| is %g < 224: the codes were not written with this scale",
				x, e4m3Value[maxMag])})
	}
	return faults
}

// decodeFP4Block decodes 32 packed E2M1 values with UE8M0 scale byte b.
func decodeFP4Block(dst []float32, packed []byte, b byte, f Format, e, coff, soff int, faults Faults) Faults {
	x := int(b) - 127
	scaleOK := true
	switch {
	case b == quant.UE8M0NaN:
		scaleOK = false
		faults = append(faults, Fault{Kind: FaultScaleNaN, Entry: e, Offset: soff, Loc: f.Locate(soff), Bits: uint32(b),
			Count: 1, Detail: "UE8M0 0xFF is NaN: every value of the block decodes to NaN"})
	case x < FP4ScaleExpMin || x > FP4ScaleExpMax:
		scaleOK = false
		faults = append(faults, Fault{Kind: FaultScaleRange, Entry: e, Offset: soff, Loc: f.Locate(soff), Bits: uint32(b),
			Count: 1, Detail: fmt.Sprintf("scale 2^%d is outside [2^%d, 2^%d], which no bf16 block produces", x, FP4ScaleExpMin, FP4ScaleExpMax)})
	}
	s := quant.DecodeUE8M0(b)
	var maxMag uint8
	if fastDecode {
		maxMag = fp4Fast(dst, packed, s)
	} else {
		for i, p := range packed {
			lo, hi := p&0xf, p>>4
			dst[2*i] = e2m1Value[lo] * s
			dst[2*i+1] = e2m1Value[hi] * s
			maxMag = max(maxMag, lo&7, hi&7)
		}
	}
	if !exactExp(x) {
		quant.BF16RoundSlice(dst[:2*len(packed)])
	}
	if scaleOK && x > FP4FlooredExpMax && maxMag < e2m1Half {
		faults = append(faults, Fault{Kind: FaultScaleLoose, Entry: e, Offset: soff, Loc: f.Locate(soff), Bits: uint32(b),
			Count: 1, Detail: fmt.Sprintf("scale 2^%d but the block's largest |code| is %g < 3: the codes were not written with this scale",
				x, e2m1Value[maxMag])})
	}
	return faults
}

// checkF32Scale validates an fp32 block scale (v32, indexer-fp8): it must be a
// positive finite power of two within the exponent bounds. It returns the scale
// value and, when it is not sane, the fault.
func checkF32Scale(bits uint32, f Format, e, soff, lo, hi int) (float32, *Fault) {
	s := math.Float32frombits(bits)
	fault := func(k FaultKind, detail string) *Fault {
		return &Fault{Kind: k, Entry: e, Offset: soff, Loc: f.Locate(soff), Bits: bits, Count: 1, Detail: detail}
	}
	switch {
	case s != s:
		return s, fault(FaultScaleNaN, "fp32 scale is NaN")
	case !(s > 0) || math.IsInf(float64(s), 0):
		return s, fault(FaultScaleRange, fmt.Sprintf("fp32 scale %g is not a positive finite number", s))
	case bits&0x7fffff != 0 || bits>>23 == 0:
		return s, fault(FaultScaleNotPow2, fmt.Sprintf("fp32 scale %g is not a normal power of two", s))
	}
	if x := int(bits>>23) - 127; x < lo || x > hi {
		return s, fault(FaultScaleRange, fmt.Sprintf("scale 2^%d is outside [2^%d, 2^%d], which no bf16 block produces", x, lo, hi))
	}
	return s, nil
}

// scaleExp is the binary exponent of a positive normal fp32 scale; for anything
// else it returns a value outside exactExp's range so the decoder rounds.
func scaleExp(s float32) int {
	b := math.Float32bits(s)
	if b&0x7fffff != 0 || b>>23 == 0 || b>>23 >= 0xff {
		return 1 << 20
	}
	return int(b>>23) - 127
}

func scaleBits(f Format, s float32) uint32 {
	if f.Layout == LayoutV4Model1 {
		return uint32(scaleExp(s) + 127)
	}
	return math.Float32bits(s)
}

// decodeBF16 widens little-endian bf16 values and reports the first non-finite
// one of the run (with the count).
func decodeBF16(dst []float32, src []byte, f Format, e, off int, faults Faults) Faults {
	n := len(src) / 2
	dst = dst[:n]
	if fastDecode && !bf16Fast(dst, src) {
		return faults
	}
	bad, first := 0, -1
	for i := range dst {
		h := uint16(src[2*i]) | uint16(src[2*i+1])<<8
		dst[i] = math.Float32frombits(uint32(h) << 16)
		if h&0x7f80 == 0x7f80 {
			if first < 0 {
				first = i
			}
			bad++
		}
	}
	if bad > 0 {
		o := off + 2*first
		h := uint32(src[2*first]) | uint32(src[2*first+1])<<8
		faults = append(faults, Fault{Kind: FaultNonFinite, Entry: e, Offset: o, Loc: f.Locate(o), Bits: h,
			Count: bad, Detail: "bf16 NaN or inf: no finite row produces it"})
	}
	return faults
}
