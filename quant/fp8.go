package quant

import "math"

// E4M3Max is the largest finite FP8 E4M3FN value.
const E4M3Max = 448

// E5M2Max is the largest finite FP8 E5M2 value.
const E5M2Max = 57344

// NaN bit patterns torch's CUDA decode returns (c10 Float8 conversions, checked
// on every code in testdata/quant).
const (
	// E4M3NaNBits is the fp32 of E4M3FN code 0x7F; code 0xFF gives it with the
	// sign bit set (c10 builds it from bits, without float arithmetic).
	E4M3NaNBits uint32 = 0x7ff00000
	// E5M2NaNBits is the fp32 of every E5M2 NaN code with the sign clear: the
	// canonical CUDA NaN (c10 widens through an fp32 multiply) with the code's
	// sign OR-ed back in, so 0xFD..0xFF give 0xFFFFFFFF.
	E5M2NaNBits uint32 = 0x7fffffff
)

// Decode tables: every code's fp32 value, NaN bits included.
var (
	e4m3Table [256]float32
	e5m2Table [256]float32
)

func init() {
	for c := 0; c < 256; c++ {
		sign := uint32(c&0x80) << 24
		// E4M3FN: only S.1111.111 is NaN; no infinities.
		if c&0x7f == 0x7f {
			e4m3Table[c] = math.Float32frombits(sign | E4M3NaNBits)
		} else {
			e4m3Table[c] = math.Float32frombits(sign | math.Float32bits(decodeMinifloat(c&0x7f, 3, 7)))
		}
		// E5M2: exponent 31 is inf (mantissa 0) or NaN.
		switch {
		case c&0x7f == 0x7c:
			e5m2Table[c] = math.Float32frombits(sign | 0x7f800000)
		case c&0x7c == 0x7c:
			e5m2Table[c] = math.Float32frombits(sign | E5M2NaNBits)
		default:
			e5m2Table[c] = math.Float32frombits(sign | math.Float32bits(decodeMinifloat(c&0x7f, 2, 15)))
		}
	}
}

// DecodeE4M3 returns the value of an FP8 E4M3FN code (0x7F and 0xFF are NaN).
func DecodeE4M3(c uint8) float32 { return e4m3Table[c] }

// DecodeE5M2 returns the value of an FP8 E5M2 code.
func DecodeE5M2(c uint8) float32 { return e5m2Table[c] }

// EncodeE4M3 rounds f to FP8 E4M3FN (nearest, ties to even) as torch 2.11 casts
// fp32 to torch.float8_e4m3fn on CUDA: magnitudes that round above 448 (f > 464)
// and ±inf become NaN (0x7F with f's sign), NaN stays NaN. It does not saturate.
func EncodeE4M3(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	if b&0x7fffffff >= 0x7f800000 {
		return sign | 0x7f
	}
	c := roundMinifloat(b, 3, 7)
	if c >= 0x7f {
		return sign | 0x7f
	}
	return sign | uint8(c)
}

// EncodeE4M3Sat is EncodeE4M3 with satfinite behaviour (cvt.rn.satfinite.e4m3x2):
// magnitudes beyond 448, infinities included, become ±448; NaN stays NaN.
func EncodeE4M3Sat(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	if b&0x7fffffff > 0x7f800000 {
		return sign | 0x7f
	}
	if b&0x7fffffff == 0x7f800000 {
		return sign | 0x7e
	}
	c := roundMinifloat(b, 3, 7)
	if c >= 0x7f {
		return sign | 0x7e
	}
	return sign | uint8(c)
}

// EncodeE5M2 rounds f to FP8 E5M2 (nearest, ties to even) as torch casts to
// torch.float8_e5m2: overflow rounds to ±inf as IEEE does, NaN becomes 0x7F/0xFF.
func EncodeE5M2(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	switch a := b & 0x7fffffff; {
	case a > 0x7f800000:
		return sign | 0x7f
	case a == 0x7f800000:
		return sign | 0x7c
	}
	c := roundMinifloat(b, 2, 15)
	if c >= 0x7c {
		return sign | 0x7c
	}
	return sign | uint8(c)
}

// E4M3 is the spec's E4M3(v): f rounded to the FP8 E4M3FN grid, as fp32.
func E4M3(f float32) float32 { return e4m3Table[EncodeE4M3(f)] }

// E5M2 is f rounded to the FP8 E5M2 grid, as fp32.
func E5M2(f float32) float32 { return e5m2Table[EncodeE5M2(f)] }
