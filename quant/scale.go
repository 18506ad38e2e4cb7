package quant

import "math"

// UE8M0NaN is the UE8M0 (float8_e8m0fnu) NaN byte.
const UE8M0NaN = 0xFF

// UE8M0NaNBits is the fp32 torch decodes the UE8M0 NaN byte to (c10 returns the
// signalling pattern 0x7F800001, on CUDA as on the CPU).
const UE8M0NaNBits uint32 = 0x7f800001

// DecodeUE8M0 returns the scale 2^(b-127) of a UE8M0 byte, bit-exact with torch's
// float8_e8m0fnu → fp32: b = 0 gives 2^-127 (the fp32 subnormal 0x00400000),
// b = 0xFF gives NaN with bits UE8M0NaNBits.
func DecodeUE8M0(b uint8) float32 {
	switch b {
	case UE8M0NaN:
		return math.Float32frombits(UE8M0NaNBits)
	case 0:
		return math.Float32frombits(0x00400000)
	}
	return math.Float32frombits(uint32(b) << 23)
}

// EncodeUE8M0 returns the UE8M0 byte e+127 of a power of two s = 2^e, e in
// [-127, 127]: how the block scales of §3.2/§3.3 are stored (checkpoint `.scale`
// tensors, the 7 scale bytes of a FlashMLA MODEL1 KV row). ok is false when s is
// not such a power of two (zero, negative, NaN, inf or a value with mantissa
// bits); the byte is then UE8M0NaN. For powers of two it equals CastUE8M0.
func EncodeUE8M0(s float32) (b uint8, ok bool) {
	if !(s > 0) || math.IsInf(float64(s), 0) {
		return UE8M0NaN, false
	}
	frac, exp := math.Frexp(float64(s)) // s = frac * 2^exp, frac in [0.5, 1)
	if frac != 0.5 {
		return UE8M0NaN, false
	}
	e := exp - 1
	if e < -127 || e > 127 {
		return UE8M0NaN, false
	}
	return uint8(e + 127), true
}

// Ceil2Exp is the exponent of ceil2(t) computed from the fp32 bits as the
// reference kernel's fast_log2_ceil does:
//
//	Ceil2Exp(t) = e - 127 + [m ≠ 0]     (e = biased exponent, m = mantissa bits)
//
// For a positive normal t it is ceil(log2 t) exactly. The bit rule also gives
// -126 for every fp32 subnormal and -127 for zero (the quantisers' amax floors
// keep t normal).
func Ceil2Exp(t float32) int {
	b := math.Float32bits(t)
	e := int(b>>23) & 0xff
	m := b & 0x7fffff
	x := e - 127
	if m != 0 {
		x++
	}
	return x
}

// Pow2 is the reference kernel's fast_pow2: the fp32 whose bits are (x+127)<<23,
// i.e. 2^x for -126 ≤ x ≤ 127 (x = -127 gives +0, as the bit trick does). x must
// lie in [-127, 127].
func Pow2(x int) float32 { return math.Float32frombits(uint32(x+127) << 23) }

// Ceil2 is the spec's ceil2(t) (§0.2): the smallest power of two ≥ t for a
// positive normal fp32 t, computed from its bits (R-K fast_log2_ceil/fast_pow2).
// Every FP8/FP4 block scale of the reference is Ceil2(f32(amax · f32(1/qmax))).
func Ceil2(t float32) float32 { return Pow2(Ceil2Exp(t)) }

// ScaleRule selects how a block's power-of-two scale is derived from its absolute
// maximum. Engines differ (spec §9.4); the differences show near powers of two
// and for near-zero blocks.
type ScaleRule int

const (
	// ScaleCeil2 is the reference: s = ceil2(f32(max(amax, floor) · f32(1/qmax))),
	// exponent from the fp32 bits (R-K act_quant / fp4_quant).
	ScaleCeil2 ScaleRule = iota
	// ScaleLog2Ceil is vLLM's and SGLang's Triton writers:
	// s = 2^ceil(log2(max(amax, floor) / qmax)) with fp32 log2 and division.
	ScaleLog2Ceil
	// ScaleFlashMLA is FlashMLA's test quantiser: the floor is applied after the
	// division, s = 2^ceil(log2(max(amax/qmax, floor))).
	ScaleFlashMLA
	// ScaleRoundLog2 is SGLang's experimental MXFP4 codec:
	// s = 2^round(log2(max(amax, floor) / qmax)) (values can saturate).
	ScaleRoundLog2
)

// String names the rule as the CLI and dumps spell it.
func (r ScaleRule) String() string {
	switch r {
	case ScaleCeil2:
		return "ceil2"
	case ScaleLog2Ceil:
		return "log2ceil"
	case ScaleFlashMLA:
		return "flashmla"
	case ScaleRoundLog2:
		return "roundlog2"
	}
	return "unknown"
}

// ParseScaleRule is the inverse of ScaleRule.String.
func ParseScaleRule(s string) (ScaleRule, bool) {
	for r := ScaleCeil2; r <= ScaleRoundLog2; r++ {
		if r.String() == s {
			return r, true
		}
	}
	return 0, false
}

// BlockScaleExp returns the exponent x of the power-of-two scale s = 2^x that rule
// picks for a block with absolute maximum amax, quantised to a grid whose largest
// value is qmax (448 for E4M3, 6 for E2M1), with amax floor floor (1e-4 for FP8,
// 6·2^-126 for FP4 in the reference):
//
//	ScaleCeil2     x = Ceil2Exp(f32(max(amax, floor) · f32(1/qmax)))
//	ScaleLog2Ceil  x = ceil(log2f(f32(max(amax, floor) / qmax)))
//	ScaleFlashMLA  x = ceil(log2f(max(f32(amax / qmax), floor)))
//	ScaleRoundLog2 x = roundeven(log2f(f32(max(amax, floor) / qmax)))
//
// log2f is evaluated in float64 and rounded to fp32; on all 2,843 golden amax
// values it agrees with torch.log2 on CUDA for both formats. (Triton kernels
// that call an approximate lg2 were not checked.) The rules differ just above
// qmax·2^k, where the fp32 log2 of 2^k·(1+ε) rounds to exactly k and the log2
// rules pick half the reference scale, and for near-zero blocks, where the floor
// sits before or after the division (on the golden amax set, which is dense in
// such cases, log2ceil differs from ceil2 for 110 of 2,843 E4M3 blocks).
func BlockScaleExp(rule ScaleRule, amax, qmax, floor float32) int {
	switch rule {
	case ScaleLog2Ceil:
		a := max(amax, floor)
		return int(math.Ceil(float64(log2f(a / qmax))))
	case ScaleFlashMLA:
		a := max(amax/qmax, floor)
		return int(math.Ceil(float64(log2f(a))))
	case ScaleRoundLog2:
		a := max(amax, floor)
		return int(math.RoundToEven(float64(log2f(a / qmax))))
	}
	a := max(amax, floor)
	return Ceil2Exp(a * (1 / qmax))
}

// log2f is log2 evaluated in fp32 (the argument and result rounded to fp32).
func log2f(x float32) float32 { return float32(math.Log2(float64(x))) }

// CastUE8M0 is torch's fp32 → float8_e8m0fnu cast, x.to(torch.float8_e8m0fnu)
// (c10 fp8e8m0fnu_from_fp32_value), bit-exact on CUDA and on the CPU. It rounds,
// and not upwards: the biased fp32 exponent is kept and incremented when the
// mantissa is ≥ 1.5, i.e. round to nearest on the linear mantissa with ties
// (exactly 1.5·2^e) going up for normal inputs and down for fp32 subnormals
// (whose implied bit is 0). The sign is ignored (-3 → 4), zero and tiny values
// give 0x00 (2^-127), and ±inf, NaN and values from 1.5·2^127 up give 0xFF (NaN).
//
// So CastUE8M0(1.25) = 1 while Ceil2(1.25) = 2: casting an unrounded scale with
// torch is not the reference's ceil2. The reference only ever casts powers of
// two, where CastUE8M0 == EncodeUE8M0.
func CastUE8M0(f float32) uint8 {
	b := math.Float32bits(f)
	e := (b >> 23) & 0xff
	if e == 0xff {
		return UE8M0NaN
	}
	g := b&0x400000 != 0
	rs := b&0x3fffff != 0
	lsb := e > 0
	if g && (rs || lsb) {
		e++
	}
	return uint8(e)
}
