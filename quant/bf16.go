package quant

import (
	"math"

	"github.com/x448/float16"
)

// CanonicalNaN is the fp32 NaN that CUDA arithmetic and CUDA's fp16 → fp32
// conversion return (sign clear, all payload bits set). Functions here that
// stand for a GPU multiply or widening return it, so NaN results are the same
// bits on every CPU (Go's own float arithmetic keeps platform-specific payloads).
const CanonicalNaN uint32 = 0x7fffffff

// BF16NaN is the bfloat16 NaN torch's CUDA cast fp32 → bf16 returns for every NaN
// input (cvt.rn.bf16.f32: canonical NaN, sign and payload dropped).
const BF16NaN uint16 = 0x7fff

// F16NaN is the binary16 NaN torch's CUDA cast fp32 → fp16 returns for every NaN.
const F16NaN uint16 = 0x7fff

// BF16Bits rounds f to bfloat16 and returns its bit pattern: the spec's bf16(v)
// (§0.2), the rounding point after every linear, norm, RoPE and attention output.
//
// Round to nearest, ties to even, exactly as torch's tensor.to(torch.bfloat16) on
// CUDA (checked on every golden input, testdata/quant): fp32 subnormals round like
// any other value, magnitudes from 0x7F7F8000 (halfway to 2^128) up become ±inf,
// and every NaN becomes BF16NaN (0x7FFF, sign dropped). torch's CPU cast agrees
// except on NaN (it returned 0xFFFF for the NaNs inspected).
func BF16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return BF16NaN
	}
	// Add 0x7fff plus the lsb of the kept half: rounds to nearest, ties to even.
	// A carry into the exponent is the correct overflow to the next binade or inf.
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// BF16ToF32 widens a bfloat16 bit pattern to fp32: a 16-bit shift, exact, NaN
// payloads kept (as torch's .float() on CUDA).
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// BF16Round is the spec's bf16(v): f rounded to the nearest bfloat16, as fp32.
func BF16Round(f float32) float32 { return BF16ToF32(BF16Bits(f)) }

// BF16RoundSlice applies BF16Round to every element of v in place.
func BF16RoundSlice(v []float32) {
	for i, x := range v {
		v[i] = BF16Round(x)
	}
}

// BF16Next returns the bf16 value n steps (ulps) away from the bf16 value f along
// the ordered bf16 line (negative n goes down). Used to express tolerances.
func BF16Next(f float32, n int) float32 {
	return BF16ToF32(orderedToBF16(bf16ToOrdered(BF16Bits(f)) + int32(n)))
}

// BF16ULPDistance counts the bf16 values between a and b after rounding each to
// bf16: 0 when they round to the same value, 1 for neighbours. +0 and -0 are 0
// apart. NaN against anything gives math.MaxInt32.
func BF16ULPDistance(a, b float32) int32 {
	if a != a || b != b {
		if a != a && b != b {
			return 0
		}
		return math.MaxInt32
	}
	d := bf16ToOrdered(BF16Bits(a)) - bf16ToOrdered(BF16Bits(b))
	if d < 0 {
		d = -d
	}
	return d
}

// bf16ToOrdered maps bf16 bits to an integer line where adjacent values differ by
// one and -0 == +0.
func bf16ToOrdered(h uint16) int32 {
	if h&0x8000 != 0 {
		return -int32(h & 0x7fff)
	}
	return int32(h)
}

func orderedToBF16(o int32) uint16 {
	if o < 0 {
		return uint16(-o) | 0x8000
	}
	return uint16(o)
}

// F16Bits rounds f to IEEE binary16 and returns its bits, as torch's
// tensor.to(torch.float16) on CUDA: round to nearest even (through
// github.com/x448/float16) with subnormals on the 2^-24 grid, overflow from 65520
// up to ±inf, and every NaN to F16NaN (0x7FFF). The spec uses fp16 nowhere; it is
// here for dumps from engines that store fp16.
func F16Bits(f float32) uint16 {
	if f != f {
		return F16NaN
	}
	return uint16(float16.Fromfloat32(f))
}

// F16ToF32 widens a binary16 bit pattern to fp32 exactly, as torch's .float() on
// CUDA: every NaN code becomes CanonicalNaN (sign and payload dropped).
func F16ToF32(h uint16) float32 {
	if h&0x7c00 == 0x7c00 && h&0x03ff != 0 {
		return math.Float32frombits(CanonicalNaN)
	}
	return float16.Float16(h).Float32()
}

// F16Round rounds f to the nearest binary16 value, returned as fp32.
func F16Round(f float32) float32 { return F16ToF32(F16Bits(f)) }
