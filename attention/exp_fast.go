package attention

import "math/bits"

// expWindow is exp32x8AVX512's margin around a float32 rounding midpoint, in
// ulps of its float64 result: within it a lane is recomputed with math.Exp.
// The kernel is within 2^8 ulps of the exact value and math.Exp within one,
// so 2^14 leaves a margin of 2^6; a lane falls in it with probability 2^-14.
var expWindow int64 = 1 << 14

// expFast sets dst[i] = exp32(src[i]) = float32(math.Exp(float64(src[i])))
// for every i, bit for bit: with AVX-512, 64 values at a time in the
// kernel (exp32x8AVX512), the lanes it marks and the last len%8 values with
// exp32; without, all with exp32. len(dst) ≥ len(src).
func expFast(dst, src []float32) {
	n, i := len(src), 0
	if useAVX512() {
		for i+8 <= n {
			m := min(64, (n-i)&^7)
			bad := exp32x8AVX512(&dst[i], &src[i], m, expWindow)
			for ; bad != 0; bad &= bad - 1 {
				j := i + bits.TrailingZeros64(bad)
				dst[j] = exp32(src[j])
			}
			i += m
		}
	}
	for ; i < n; i++ {
		dst[i] = exp32(src[i])
	}
}
