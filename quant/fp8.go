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

// DecodeE4M3 returns the exact fp32 value of an FP8 E4M3FN code, as torch's
// .float() on CUDA; the NaN codes 0x7F and 0xFF give E4M3NaNBits with the sign.
func DecodeE4M3(c uint8) float32 { return e4m3Table[c] }

// DecodeE5M2 returns the exact fp32 value of an FP8 E5M2 code, as torch's .float()
// on CUDA: 0x7C/0xFC are ±inf, the NaN codes give E5M2NaNBits with the sign.
func DecodeE5M2(c uint8) float32 { return e5m2Table[c] }

// EncodeE4M3 rounds f to FP8 E4M3FN, nearest with ties to even, and returns the
// code, bit-exact with torch's tensor.to(torch.float8_e4m3fn) on CUDA (c10
// fp8e4m3fn_from_fp32_value). It does not saturate: magnitudes that round above
// 448 (|f| > 464) and ±inf become NaN (0x7F with f's sign); NaN becomes 0x7F/0xFF
// with its sign. Values below 2^-6 round on the subnormal grid (step 2^-9);
// |f| ≤ 2^-10 gives ±0.
//
// This is the fast form of the rounding (the FPU rounds the subnormal range, an
// integer add rounds the normal range, as c10 does); encodeE4M3Ref spells out
// the rounding on the significand and the tests hold the two equal.
func EncodeE4M3(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	a := b & 0x7fffffff
	switch {
	case a >= 0x43f00000: // |f| ≥ 480 (rounds past 448), inf, NaN
		return sign | 0x7f
	case a < 0x3c800000: // |f| < 2^-6: adding 2^14 (ulp 2^-9) rounds to the subnormal grid
		return sign | uint8(math.Float32bits(math.Float32frombits(a)+0x1p14)-0x46800000)
	}
	// Rebias the exponent (127 → 7) and round the 20 dropped mantissa bits to
	// nearest even: add 0x7FFFF plus the lowest kept bit. 464 ≤ |f| < 480 carries
	// into 0x7F, which is NaN.
	a = a - (127-7)<<23 + 0x7ffff + (a>>20)&1
	return sign | uint8(a>>20)
}

// encodeE4M3Ref is EncodeE4M3 written as the rounding of the significand
// (roundMinifloat): the reference the fast form is tested against.
func encodeE4M3Ref(f float32) uint8 {
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

// EncodeE4M3Sat is EncodeE4M3 with satfinite behaviour (PTX
// cvt.rn.satfinite.e4m3x2.f32, used by CUDA kernels that convert with
// __NV_SATFINITE): magnitudes beyond 448, infinities included, become ±448; NaN
// stays NaN. For every input, EncodeE4M3Sat(x) == EncodeE4M3(clamp(x, -448, 448)),
// the spec's clamp-then-cast, which is how the quantisers use it. torch's own
// cast is EncodeE4M3.
func EncodeE4M3Sat(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	a := b & 0x7fffffff
	switch {
	case a >= 0x43e00000: // |f| ≥ 448, inf, NaN
		if a > 0x7f800000 {
			return sign | 0x7f
		}
		return sign | 0x7e
	case a < 0x3c800000:
		return sign | uint8(math.Float32bits(math.Float32frombits(a)+0x1p14)-0x46800000)
	}
	a = a - (127-7)<<23 + 0x7ffff + (a>>20)&1
	return sign | uint8(a>>20)
}

// EncodeE5M2 rounds f to FP8 E5M2, nearest with ties to even, bit-exact with
// torch's tensor.to(torch.float8_e5m2) on CUDA: magnitudes from 61440 (halfway to
// 2^16) up and ±inf become ±inf (0x7C/0xFC), NaN becomes 0x7F/0xFF with its sign.
// Subnormal step 2^-16.
func EncodeE5M2(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	switch a := b & 0x7fffffff; {
	case a > 0x7f800000:
		return sign | 0x7f
	case a >= 0x47800000: // |f| ≥ 2^16, inf
		return sign | 0x7c
	case a < 0x38800000: // |f| < 2^-14: adding 2^7 (ulp 2^-16) rounds to the subnormal grid
		return sign | uint8(math.Float32bits(math.Float32frombits(a)+0x1p7)-0x43000000)
	default:
		a = a - (127-15)<<23 + 0xfffff + (a>>21)&1
		return sign | uint8(a>>21)
	}
}

// encodeE5M2Ref is the significand-rounding reference of EncodeE5M2.
func encodeE5M2Ref(f float32) uint8 {
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

// E4M3 is the spec's E4M3(v) (§0.2): f rounded to the FP8 E4M3FN grid (EncodeE4M3),
// returned as fp32.
func E4M3(f float32) float32 { return e4m3Table[EncodeE4M3(f)] }

// E5M2 is f rounded to the FP8 E5M2 grid (EncodeE5M2), returned as fp32.
func E5M2(f float32) float32 { return e5m2Table[EncodeE5M2(f)] }
