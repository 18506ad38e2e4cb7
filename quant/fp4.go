package quant

import "math"

// E2M1Max is the largest FP4 E2M1 value.
const E2M1Max = 6

// e2m1Values are the magnitudes of the eight non-negative FP4 E2M1 codes.
var e2m1Values = [8]float32{0, 0.5, 1, 1.5, 2, 3, 4, 6}

// DecodeE2M1 returns the value of a 4-bit FP4 E2M1 code (bit 3 = sign).
func DecodeE2M1(c uint8) float32 {
	v := e2m1Values[c&7]
	if c&8 != 0 {
		return -v
	}
	return v
}

// EncodeE2M1 rounds f to FP4 E2M1 (nearest, ties to the even code: 0.25→0,
// 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4) and returns the 4-bit code.
// Magnitudes beyond 6 and ±inf saturate to ±6 (cvt.rn.satfinite.e2m1x2); NaN,
// which FP4 cannot hold, becomes +0 by the same PTX rule's absence: callers
// clamp first, as every use in the spec does.
func EncodeE2M1(f float32) uint8 {
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

// E2M1 is the spec's E2M1(v): f rounded to the FP4 grid, as fp32.
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
