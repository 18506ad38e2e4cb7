package quant

import "math"

// Constants of the reference quantisers (spec §1, derived constants).
const (
	// FP8AmaxFloor is the floor on a block's |max| before the FP8 scale (1e-4).
	FP8AmaxFloor float32 = 1e-4
	// FP4AmaxFloor is the floor 6·2^-126 on a block's |max| before the FP4 scale.
	FP4AmaxFloor float32 = 6 * 0x1p-126
	// InvE4M3Max is f32(1/448), bits 0x3B124925.
	InvE4M3Max float32 = 1.0 / 448
	// InvE2M1Max is f32(1/6), bits 0x3E2AAAAB.
	InvE2M1Max float32 = 1.0 / 6
)

// absMax returns max_i |v_i| in fp32 (NaN-propagating like torch's amax).
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

func clamp(x, lo, hi float32) float32 { return min(max(x, lo), hi) }

// FQ8 is the spec's FP8 fake quantisation FQ8(v, B) (§3.3), in place, on each
// contiguous block of B elements (bf16 values held as fp32):
//
//	a    = max(max_i |v_i|, 1e-4)
//	s    = ceil2(f32(a · f32(1/448)))
//	v'_i = bf16( E4M3(clamp(v_i / s, -448, 448)) · s )
//
// Used on window K dims 0..447 and main compressed rows dims 0..447 (B = 64).
// len(v) must be a multiple of B.
func FQ8(v []float32, B int) {
	if len(v)%B != 0 {
		panic("quant: FQ8 length not a multiple of the block")
	}
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		s := Pow2(BlockScaleExp(ScaleCeil2, absMax(blk), E4M3Max, FP8AmaxFloor))
		for i, x := range blk {
			blk[i] = BF16Round(E4M3(clamp(x/s, -E4M3Max, E4M3Max)) * s)
		}
	}
}

// FQ4 is the spec's FP4 fake quantisation FQ4(v, B) (§3.4), in place:
//
//	a    = max(max_i |v_i|, 6·2^-126)
//	s    = ceil2(f32(a · f32(1/6)))
//	v'_i = bf16( E2M1(clamp(v_i / s, -6, 6)) · s )
//
// Used on indexer queries and keys after the Hadamard, B = 32.
func FQ4(v []float32, B int) {
	if len(v)%B != 0 {
		panic("quant: FQ4 length not a multiple of the block")
	}
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		s := Pow2(BlockScaleExp(ScaleCeil2, absMax(blk), E2M1Max, FP4AmaxFloor))
		for i, x := range blk {
			blk[i] = BF16Round(E2M1(clamp(x/s, -E2M1Max, E2M1Max)) * s)
		}
	}
}

// QuantizeFP8 is a real block quantisation to E4M3 codes with one UE8M0 scale
// byte per block of B elements: for block b, s = 2^BlockScaleExp(rule, amax, 448,
// floor), codes[i] = EncodeE4M3(clamp(v_i/s, ±448)), scales[b] = 127 + log2 s.
// With rule ScaleCeil2 and floor 1e-4 the decoded values equal FQ8's before its
// final bf16 rounding (which is exact for them). codes needs len(v) bytes, scales
// len(v)/B. A block whose exponent leaves [-127, 127] gets scale byte 0xFF.
func QuantizeFP8(codes, scales []uint8, v []float32, B int, rule ScaleRule, floor float32) {
	if len(v)%B != 0 || len(codes) < len(v) || len(scales) < len(v)/B {
		panic("quant: QuantizeFP8 length mismatch")
	}
	for b := 0; b < len(v)/B; b++ {
		blk := v[b*B : (b+1)*B]
		x := BlockScaleExp(rule, absMax(blk), E4M3Max, floor)
		s := float32(math.Ldexp(1, x))
		if x < -127 || x > 127 {
			scales[b] = UE8M0NaN
		} else {
			scales[b] = uint8(x + 127)
		}
		for i, f := range blk {
			codes[b*B+i] = EncodeE4M3(clamp(f/s, -E4M3Max, E4M3Max))
		}
	}
}

// DequantizeFP8 is the inverse of QuantizeFP8: dst[i] = E4M3(codes[i]) · 2^(scales[i/B]-127).
func DequantizeFP8(dst []float32, codes, scales []uint8, B int) {
	if len(codes)%B != 0 || len(dst) < len(codes) || len(scales) < len(codes)/B {
		panic("quant: DequantizeFP8 length mismatch")
	}
	for b := 0; b < len(codes)/B; b++ {
		s := DecodeUE8M0(scales[b])
		for i, c := range codes[b*B : (b+1)*B] {
			dst[b*B+i] = mulCUDA(e4m3Table[c], s)
		}
	}
}

// QuantizeFP4 is a real block quantisation to E2M1 codes with one UE8M0 scale per
// block of B elements (MXFP4: B = 32), packed two codes per byte (low nibble =
// even index). packed needs len(v)/2 bytes, scales len(v)/B.
func QuantizeFP4(packed, scales []uint8, v []float32, B int, rule ScaleRule, floor float32) {
	if len(v)%B != 0 || B%2 != 0 || len(packed) < len(v)/2 || len(scales) < len(v)/B {
		panic("quant: QuantizeFP4 length mismatch")
	}
	for b := 0; b < len(v)/B; b++ {
		blk := v[b*B : (b+1)*B]
		x := BlockScaleExp(rule, absMax(blk), E2M1Max, floor)
		s := float32(math.Ldexp(1, x))
		if x < -127 || x > 127 {
			scales[b] = UE8M0NaN
		} else {
			scales[b] = uint8(x + 127)
		}
		for i := 0; i < B; i += 2 {
			lo := EncodeE2M1(clamp(blk[i]/s, -E2M1Max, E2M1Max))
			hi := EncodeE2M1(clamp(blk[i+1]/s, -E2M1Max, E2M1Max))
			packed[(b*B+i)/2] = lo | hi<<4
		}
	}
}

// DequantizeFP4 is the inverse of QuantizeFP4: dst gets 2·len(packed) values.
func DequantizeFP4(dst []float32, packed, scales []uint8, B int) {
	n := 2 * len(packed)
	if n%B != 0 || len(dst) < n || len(scales) < n/B {
		panic("quant: DequantizeFP4 length mismatch")
	}
	for i, p := range packed {
		s := DecodeUE8M0(scales[2*i/B])
		dst[2*i] = mulCUDA(DecodeE2M1(p&0xf), s)
		dst[2*i+1] = mulCUDA(DecodeE2M1(p>>4), s)
	}
}

// QuantizeActFP8 is the activation quantiser in front of every FP8 linear (§3.2,
// R-K act_quant, non-inplace): per block of B (=128) elements,
// a = max(amax, 1e-4), s = ceil2(f32(a·f32(1/448))), q_i = E4M3(clamp(x_i/s, ±448)).
// It writes the E4M3 values (as fp32) into q and the block scales into s.
func QuantizeActFP8(q, s []float32, x []float32, B int) {
	if len(x)%B != 0 || len(q) < len(x) || len(s) < len(x)/B {
		panic("quant: QuantizeActFP8 length mismatch")
	}
	for b := 0; b < len(x)/B; b++ {
		blk := x[b*B : (b+1)*B]
		sc := Pow2(BlockScaleExp(ScaleCeil2, absMax(blk), E4M3Max, FP8AmaxFloor))
		s[b] = sc
		for i, f := range blk {
			q[b*B+i] = E4M3(clamp(f/sc, -E4M3Max, E4M3Max))
		}
	}
}
