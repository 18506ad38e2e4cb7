package quant

import "math"

// roundMinifloat rounds the magnitude of the finite fp32 value with bits b (sign
// ignored) to a minifloat with m mantissa bits, exponent bias bias and smallest
// normal exponent emin = 1-bias, round to nearest, ties to even. It returns the
// unsigned code ((biased exponent)<<m | mantissa) as an int that may exceed the
// format's range: the caller decides between saturation, infinity and NaN.
//
// The rounding is done on the integer significand, so it is exact for every input:
//
//	s  = 1.mantissa (24 bits), e = unbiased exponent of |f|
//	q  = RNE(s / 2^shift), shift = 23 - m + max(0, emin - e)
//	code = (e + bias) << m + q - 2^m    (normal)      or  q  (subnormal)
//
// A carry out of the mantissa (q == 2^(m+1)) lands in the exponent by the addition.
func roundMinifloat(b uint32, m, bias int) int {
	e32 := int(b>>23) & 0xff
	if e32 == 0 {
		return 0 // fp32 zero or subnormal (< 2^-126): far below any code we produce
	}
	e := e32 - 127
	s := uint64(b&0x7fffff | 1<<23)
	emin := 1 - bias
	shift := 23 - m
	sub := e < emin
	if sub {
		shift += emin - e
		if shift > 40 {
			shift = 40 // s < 2^24 ≤ half: rounds to 0
		}
	}
	q := s >> uint(shift)
	rem := s & (1<<uint(shift) - 1)
	half := uint64(1) << uint(shift-1)
	if rem > half || (rem == half && q&1 == 1) {
		q++
	}
	if sub {
		return int(q) // q == 2^m is exactly the smallest normal code
	}
	return (e+bias)<<uint(m) + int(q) - 1<<uint(m)
}

// decodeMinifloat returns the value of the unsigned code c (no sign bit) of a
// minifloat with m mantissa bits and exponent bias bias, ignoring special codes.
func decodeMinifloat(c, m, bias int) float32 {
	e := c >> uint(m)
	man := c & (1<<uint(m) - 1)
	if e == 0 {
		return float32(math.Ldexp(float64(man), 1-bias-m))
	}
	return float32(math.Ldexp(float64(man|1<<uint(m)), e-bias-m))
}
