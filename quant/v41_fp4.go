package quant

import "math"

// V4.1 ("CSA2") quantisers (spec §11 items 3-5; V41-M Attention._compress_kv and
// V41-K fp4_act_quant). The compressed KV of V4.1 is FP4 E2M1 over all 512 dims
// in blocks of 16 with an E4M3 (not power-of-two) scale per block; the window K
// is FQ8 over all dims in blocks of 32 (FQ8(v, 32)); the index keys and queries
// are FQ4(v, 32) with UE8M0 scales (FQ4). Only the E4M3-scaled FP4 is new here.

// FP4E4M3AmaxFloor is the floor 6·2^-9 on a block's |max| before the E4M3 scale
// of FQ4E4M3: the smallest scale is then 2^-9, the smallest E4M3 subnormal.
const FP4E4M3AmaxFloor float32 = 6 * 0x1p-9

// FP4E4M3Block is the block length of V4.1's compressed-KV quantiser (16).
const FP4E4M3Block = 16

// FP4E4M3Scale is the E4M3 scale of one FQ4E4M3 block with |max| amax:
//
//	s = E4M3_satfinite( f32( max(amax, 6·2^-9) / 6 ) )
//
// (V41-K: `(amax.clamp_min(6·2^-9) / 6).clamp_max(448).to(float8_e4m3fn)`, the
// kernel's cvt.rn.satfinite), returned as its E4M3 code. The division is a real
// fp32 division, not a multiplication by f32(1/6) (the UE8M0 form multiplies).
// A NaN amax gives the NaN code 0x7F.
func FP4E4M3Scale(amax float32) uint8 {
	return EncodeE4M3Sat(max(amax, FP4E4M3AmaxFloor) / E2M1Max)
}

// FQ4E4M3 is V4.1's fake quantisation of the compressed KV (fp4_act_quant(latent,
// 16, True, scale_dtype=float8_e4m3fn)), in place, on each contiguous block of B
// elements of a bf16 vector (held as fp32):
//
//	s    = E4M3(FP4E4M3Scale(max_i |v_i|))        an E4M3 value, not a power of two
//	v'_i = bf16( E2M1(clamp(v_i / s, -6, 6)) · s )
//
// v_i / s is an fp32 division (s is no power of two, so it differs from a
// multiplication by 1/s). The product E2M1·E4M3 has at most 6 significant bits
// and lies in [2^-10, 2688], so the bf16 rounding is exact. B is 16 in V4.1.
// len(v) must be a multiple of B.
func FQ4E4M3(v []float32, B int) {
	if B <= 0 || len(v)%B != 0 {
		panic("quant: FQ4E4M3 length not a multiple of the block")
	}
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		s := DecodeE4M3(FP4E4M3Scale(absMax(blk)))
		for i, x := range blk {
			blk[i] = BF16Round(DecodeE2M1(EncodeE2M1(clamp(x/s, -E2M1Max, E2M1Max))) * s)
		}
	}
}

// QuantizeFP4E4M3 stores v (a multiple of B values) as V4.1's FP4 cache stores a
// compressed KV row: E2M1 codes packed two per byte, the even index in the low
// nibble (packed, len(v)/2 bytes), and one E4M3 scale code per block (scales,
// len(v)/B bytes), with the scale rule of FQ4E4M3. For a v already on the
// FQ4E4M3 grid, DequantizeFP4E4M3 gives v back bit for bit (the scale is
// recomputed from the same amax).
func QuantizeFP4E4M3(packed, scales []uint8, v []float32, B int) {
	if B <= 0 || B%2 != 0 || len(v)%B != 0 || len(packed) != len(v)/2 || len(scales) != len(v)/B {
		panic("quant: QuantizeFP4E4M3 length mismatch")
	}
	codes := make([]uint8, len(v))
	for b := 0; b < len(v)/B; b++ {
		blk := v[b*B : (b+1)*B]
		sc := FP4E4M3Scale(absMax(blk))
		scales[b] = sc
		s := DecodeE4M3(sc)
		for i, x := range blk {
			codes[b*B+i] = EncodeE2M1(clamp(x/s, -E2M1Max, E2M1Max))
		}
	}
	PackFP4(packed, codes)
}

// DequantizeFP4E4M3 is the inverse of QuantizeFP4E4M3:
// dst[i] = E2M1(code_i) · E4M3(scales[i div B]), exact in fp32 (and in bf16).
// A NaN scale code gives NaN values for its block.
func DequantizeFP4E4M3(dst []float32, packed, scales []uint8, B int) {
	if B <= 0 || B%2 != 0 || len(dst) != 2*len(packed) || len(dst)%B != 0 || len(scales) != len(dst)/B {
		panic("quant: DequantizeFP4E4M3 length mismatch")
	}
	for i := range dst {
		c := packed[i/2]
		if i%2 == 1 {
			c >>= 4
		}
		s := DecodeE4M3(scales[i/B])
		if s != s {
			dst[i] = math.Float32frombits(CanonicalNaN)
			continue
		}
		dst[i] = DecodeE2M1(c) * s
	}
}
