package quant

import "math"

// E2M1Max is the largest FP4 E2M1 value.
const E2M1Max = 6

// e2m1Table holds the value of every 4-bit FP4 E2M1 code: bit 3 is the sign,
// bits 0..2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
var e2m1Table = [16]float32{
	0, 0.5, 1, 1.5, 2, 3, 4, 6,
	float32(math.Copysign(0, -1)), -0.5, -1, -1.5, -2, -3, -4, -6,
}

// DecodeE2M1 returns the value of a 4-bit FP4 E2M1 code (bit 3 = sign; the high
// nibble of c is ignored).
func DecodeE2M1(c uint8) float32 { return e2m1Table[c&0xf] }

// EncodeE2M1 rounds f to FP4 E2M1 and returns the 4-bit code (bit 3 = sign): the
// spec's E2M1 rounding (§0.2), nearest with ties to the even code: 0.25→0,
// 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4. Magnitudes beyond 6 and ±inf
// saturate to ±6 as PTX cvt.rn.satfinite.e2m1x2.f32 does. FP4 has no NaN: a NaN
// input gives +0 (every use in the spec clamps finite block values first, so this
// never occurs there). Neither torch nor the H200 can cast to FP4, so the ties
// rule is the spec's, checked against the threshold form the golden script uses.
func EncodeE2M1(f float32) uint8 {
	b := math.Float32bits(f)
	a := b & 0x7fffffff
	// Both roundings are computed and one is picked, so the compiler can use
	// conditional moves: the branch on |f| < 1 is unpredictable in a block.
	// Normal range [1, 6): rebias the exponent (127 → 1) and round the 22
	// dropped mantissa bits to nearest even.
	c := (a - (127-1)<<23 + 0x1fffff + (a>>22)&1) >> 22
	// Below 1: adding 2^22 (ulp 0.5) rounds to {0, 0.5, 1} (codes 0, 1, 2).
	if sub := math.Float32bits(math.Float32frombits(a)+0x1p22) - 0x4a800000; a < 0x3f800000 {
		c = sub
	}
	if a >= 0x40c00000 { // ≥ 6, inf
		c = 7
	}
	if a > 0x7f800000 { // NaN
		return 0
	}
	return uint8(b>>28)&0x8 | uint8(c)
}

// encodeE2M1Ref is the significand-rounding reference of EncodeE2M1.
func encodeE2M1Ref(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>28) & 0x8
	a := b & 0x7fffffff
	if a > 0x7f800000 {
		return 0
	}
	if a == 0x7f800000 {
		return sign | 7
	}
	c := roundMinifloat(b, 1, 1)
	if c > 7 {
		c = 7
	}
	return sign | uint8(c)
}

// E2M1 is the spec's E2M1(v) (§0.2): f rounded to the FP4 grid (EncodeE2M1),
// returned as fp32.
func E2M1(f float32) float32 { return DecodeE2M1(EncodeE2M1(f)) }

// PackFP4 packs 4-bit codes two per byte, the even index in the low nibble
// (torch float4_e2m1fn_x2, MXFP4 caches). dst must hold len(codes)/2 bytes and
// len(codes) must be even.
func PackFP4(dst []uint8, codes []uint8) {
	if len(codes)%2 != 0 || len(dst) < len(codes)/2 {
		panic("quant: PackFP4 length mismatch")
	}
	for i := 0; i < len(codes); i += 2 {
		dst[i/2] = codes[i]&0xf | codes[i+1]<<4
	}
}

// UnpackFP4 is the inverse of PackFP4: dst gets 2*len(src) codes.
func UnpackFP4(dst []uint8, src []uint8) {
	if len(dst) < 2*len(src) {
		panic("quant: UnpackFP4 length mismatch")
	}
	for i, b := range src {
		dst[2*i] = b & 0xf
		dst[2*i+1] = b >> 4
	}
}
