package kvcache

import (
	"encoding/binary"
	"math"
)

// Word-at-a-time decoders, used by DecodePage when fastDecode is true. They
// compute exactly what the per-value reference loops in codec.go compute (the
// same table lookups and products); only the fault checks are done on 8 bytes
// at once, and a block that may hold a fault is re-checked by the reference
// loop to name the offending byte. TestFastDecodeMatchesReference runs both.
var fastDecode = true

const (
	lanes8  = 0x0101010101010101
	highs8  = 0x8080808080808080
	e4m3Hi  = 0x76 // code of 224 (= e4m3Half): half the E4M3 range
	lanes16 = 0x0001000100010001
	highs16 = 0x8000800080008000
	bf16Exp = 0x7f807f807f807f80
)

// fp8Fast writes dst[i] = E4M3(codes[i])·s and reports whether any code is a
// NaN code (low 7 bits 0x7F) and whether any reaches 224 (low 7 bits ≥ 0x76).
func fp8Fast(dst []float32, codes []byte, s float32) (nan, half bool) {
	var nanAcc, halfAcc uint64
	i := 0
	for ; i+8 <= len(codes); i += 8 {
		w := binary.LittleEndian.Uint64(codes[i:])
		m := w &^ highs8 // each byte ≤ 0x7F, so the adds below never carry across bytes
		nanAcc |= m + lanes8
		halfAcc |= m + (0x80-e4m3Hi)*lanes8
		d := dst[i : i+8 : i+8]
		d[0] = e4m3Value[uint8(w)] * s
		d[1] = e4m3Value[uint8(w>>8)] * s
		d[2] = e4m3Value[uint8(w>>16)] * s
		d[3] = e4m3Value[uint8(w>>24)] * s
		d[4] = e4m3Value[uint8(w>>32)] * s
		d[5] = e4m3Value[uint8(w>>40)] * s
		d[6] = e4m3Value[uint8(w>>48)] * s
		d[7] = e4m3Value[uint8(w>>56)] * s
	}
	for ; i < len(codes); i++ {
		c := codes[i]
		dst[i] = e4m3Value[c] * s
		nan = nan || c&0x7f == 0x7f
		half = half || c&0x7f >= e4m3Hi
	}
	return nan || nanAcc&highs8 != 0, half || halfAcc&highs8 != 0
}

// bf16Fast widens little-endian bf16 values and reports whether any is NaN or
// ±inf (exponent bits all ones).
func bf16Fast(dst []float32, src []byte) (bad bool) {
	n := len(src) / 2
	var acc uint64
	i := 0
	for ; i+4 <= n; i += 4 {
		w := binary.LittleEndian.Uint64(src[2*i:])
		x := (w & bf16Exp) ^ bf16Exp // a lane is zero iff that value is non-finite
		acc |= (x - lanes16) &^ x & highs16
		d := dst[i : i+4 : i+4]
		d[0] = math.Float32frombits(uint32(w) << 16)
		d[1] = math.Float32frombits(uint32(w>>16) << 16)
		d[2] = math.Float32frombits(uint32(w>>32) << 16)
		d[3] = math.Float32frombits(uint32(w>>48) << 16)
	}
	for ; i < n; i++ {
		h := uint16(src[2*i]) | uint16(src[2*i+1])<<8
		dst[i] = math.Float32frombits(uint32(h) << 16)
		bad = bad || h&0x7f80 == 0x7f80
	}
	return bad || acc != 0
}

// e2m1Pair holds the two E2M1 values of every packed byte (low nibble first)
// and e2m1PairMag the larger magnitude code (0..7) of the two.
var (
	e2m1Pair    [256][2]float32
	e2m1PairMag [256]uint8
)

func init() {
	for b := 0; b < 256; b++ {
		e2m1Pair[b] = [2]float32{e2m1Value[b&0xf], e2m1Value[b>>4]}
		e2m1PairMag[b] = max(uint8(b)&7, uint8(b>>4)&7)
	}
}

// fp4Fast writes the 2·len(packed) values of a block times s and returns the
// largest magnitude code.
func fp4Fast(dst []float32, packed []byte, s float32) (maxMag uint8) {
	dst = dst[: 2*len(packed) : 2*len(packed)]
	for i, b := range packed {
		p := &e2m1Pair[b]
		dst[2*i] = p[0] * s
		dst[2*i+1] = p[1] * s
		maxMag = max(maxMag, e2m1PairMag[b])
	}
	return maxMag
}

// model1EntryFast decodes one v4-model1 entry (data: its 576 data bytes,
// scl: its 8 scale bytes) into dst [512] in one pass when the entry is
// clean — every scale byte in [FP8ScaleExpMin, FP8ScaleExpMax] with an
// exponent that needs no bf16 rounding (exactExp), no NaN code, no loose
// scale, a zero pad byte, a finite rope — and reports whether it was. The
// values are the per-tile path's (e4m3Value[c]·2^x, exact); for an entry
// that is not clean it returns false (dst partly written) and the caller
// decodes the entry again with the per-tile path, which names the faults.
func model1EntryFast(dst []float32, data, scl []byte) bool {
	if len(dst) < Model1Nope+Model1Rope || len(data) < Model1DataBytes || len(scl) < Model1ScaleBytes || scl[Model1Tiles] != 0 {
		return false
	}
	for t := 0; t < Model1Tiles; t++ {
		b := scl[t]
		x := int(b) - 127
		if x < FP8ScaleExpMin || x > FP8ScaleExpMax || !exactExp(x) { // 0xFF (NaN) is x = 128
			return false
		}
		s := math.Float32frombits(uint32(b) << 23) // 2^x, normal
		nan, half := fp8Tile64((*[Model1Tile]float32)(dst[t*Model1Tile:]), (*[Model1Tile]byte)(data[t*Model1Tile:]), s)
		if nan || (x > FP8FlooredExpMax && !half) {
			return false
		}
	}
	return !bf16Fast(dst[Model1Nope:Model1Nope+Model1Rope], data[Model1Nope:Model1DataBytes])
}

// fp8Tile64 is fp8Fast on one 64-code tile (fixed sizes: no bounds checks;
// the codes are read as words for the checks and as bytes for the table).
func fp8Tile64(dst *[Model1Tile]float32, codes *[Model1Tile]byte, s float32) (nan, half bool) {
	var nanAcc, halfAcc uint64
	for i := 0; i < Model1Tile; i += 8 {
		c := (*[8]byte)(codes[i : i+8])
		m := binary.LittleEndian.Uint64(c[:]) &^ highs8
		nanAcc |= m + lanes8
		halfAcc |= m + (0x80-e4m3Hi)*lanes8
		d := (*[8]float32)(dst[i : i+8])
		d[0] = e4m3Value[c[0]] * s
		d[1] = e4m3Value[c[1]] * s
		d[2] = e4m3Value[c[2]] * s
		d[3] = e4m3Value[c[3]] * s
		d[4] = e4m3Value[c[4]] * s
		d[5] = e4m3Value[c[5]] * s
		d[6] = e4m3Value[c[6]] * s
		d[7] = e4m3Value[c[7]] * s
	}
	return nanAcc&highs8 != 0, halfAcc&highs8 != 0
}
