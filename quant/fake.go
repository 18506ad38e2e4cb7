package quant

import (
	"encoding/binary"
	"math"
)

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

// absMax returns max_i |v_i| in fp32, NaN if any v_i is NaN (like torch's amax).
// With the sign bit cleared, fp32 bit patterns order like the magnitudes they
// encode and every NaN pattern lies above +inf, so an integer max does it.
func absMax(v []float32) float32 {
	var a uint32
	for _, x := range v {
		a = max(a, math.Float32bits(x)&^(1<<31))
	}
	return math.Float32frombits(a)
}

func clamp(x, lo, hi float32) float32 { return min(max(x, lo), hi) }

// blockScale returns the power-of-two scale s = 2^x of a block and its inverse
// 1/s. Dividing by s and multiplying by 1/s give the same fp32 result (both are
// the exact quotient rounded once), so the fast loops multiply. ok is false when
// 1/s is not an fp32 power of two (x outside [-126, 126]); callers then divide.
func blockScale(x int) (s, inv float32, ok bool) {
	if x < -126 || x > 126 {
		return float32(math.Ldexp(1, x)), 0, false
	}
	return Pow2(x), Pow2(-x), true
}

// FQ8 is the spec's FP8 fake quantisation FQ8(v, B) (§3.3), in place, on each
// contiguous block of B elements (bf16 values held as fp32):
//
//	a    = max(max_i |v_i|, 1e-4)
//	s    = ceil2(f32(a · f32(1/448)))
//	v'_i = bf16( E4M3(clamp(v_i / s, -448, 448)) · s )
//
// Used on window K dims 0..447 and main compressed rows dims 0..447 (B = 64),
// where the reference kernel (R-K act_quant_kernel, inplace) rounds K to FP8 and
// back before it is cached. len(v) must be a multiple of B. fq8Ref is the literal
// transcription; this form multiplies by 1/s (same bits, tested).
func FQ8(v []float32, B int) {
	if B <= 0 || len(v)%B != 0 {
		panic("quant: FQ8 length not a multiple of the block")
	}
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		s, inv, ok := blockScale(BlockScaleExp(ScaleCeil2, absMax(blk), E4M3Max, FP8AmaxFloor))
		if !ok {
			fq8Ref(blk, B)
			continue
		}
		for i, x := range blk {
			// E4M3(clamp(x/s, ±448))·s; the bf16 rounding is exact (4 significant bits
			// times s ≥ 2^-22), so it is left out here and kept in fq8Ref.
			blk[i] = e4m3Table[EncodeE4M3Sat(x*inv)] * s
		}
	}
}

// fq8Ref is FQ8 written exactly as the spec's formula (division, reference
// rounding): the reference for FQ8's fast loop.
func fq8Ref(v []float32, B int) {
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		a := max(absMax(blk), FP8AmaxFloor)
		s := Ceil2(a * InvE4M3Max)
		for i, x := range blk {
			q := DecodeE4M3(encodeE4M3Ref(clamp(x/s, -E4M3Max, E4M3Max)))
			blk[i] = BF16Round(q * s)
		}
	}
}

// FQ4 is the spec's FP4 fake quantisation FQ4(v, B) (§3.4), in place, on each
// contiguous block of B elements:
//
//	a    = max(max_i |v_i|, 6·2^-126)
//	s    = ceil2(f32(a · f32(1/6)))
//	v'_i = bf16( E2M1(clamp(v_i / s, -6, 6)) · s )
//
// Used on indexer queries and keys after the Hadamard, B = 32 (R-K
// fp4_quant_kernel, inplace). fq4Ref is the literal transcription.
func FQ4(v []float32, B int) {
	if B <= 0 || len(v)%B != 0 {
		panic("quant: FQ4 length not a multiple of the block")
	}
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		s, inv, ok := blockScale(BlockScaleExp(ScaleCeil2, absMax(blk), E2M1Max, FP4AmaxFloor))
		if !ok {
			fq4Ref(blk, B)
			continue
		}
		for i, x := range blk {
			// E2M1(clamp(x/s, ±6))·s (EncodeE2M1 saturates: the clamp); the bf16
			// rounding is exact (2 significant bits times s ≥ 2^-126), kept in fq4Ref.
			blk[i] = e2m1Table[EncodeE2M1(x*inv)] * s
		}
	}
}

// fq4Ref is FQ4 written exactly as the spec's formula: the reference for FQ4.
func fq4Ref(v []float32, B int) {
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		a := max(absMax(blk), FP4AmaxFloor)
		s := Ceil2(a * InvE2M1Max)
		for i, x := range blk {
			q := DecodeE2M1(encodeE2M1Ref(clamp(x/s, -E2M1Max, E2M1Max)))
			blk[i] = BF16Round(q * s)
		}
	}
}

// scaleByte returns the UE8M0 byte of the scale 2^x, UE8M0NaN outside [-127, 127].
func scaleByte(x int) uint8 {
	if x < -127 || x > 127 {
		return UE8M0NaN
	}
	return uint8(x + 127)
}

// QuantizeFP8 is a real block quantisation to E4M3 codes with one UE8M0 scale
// byte per block of B elements, the storage form of FQ8 (FlashMLA MODEL1 KV rows:
// B = 64): for block b, s = 2^x with x = BlockScaleExp(rule, amax, 448, floor),
//
//	codes[i]  = EncodeE4M3(clamp(v_i / s, -448, 448))
//	scales[b] = x + 127
//
// With rule ScaleCeil2 and floor FP8AmaxFloor, DecodeE4M3(codes[i])·s equals FQ8's
// output (its bf16 rounding is exact). codes needs len(v) bytes, scales len(v)/B.
// A block whose exponent leaves [-127, 127] gets scale byte 0xFF (NaN).
func QuantizeFP8(codes, scales []uint8, v []float32, B int, rule ScaleRule, floor float32) {
	if B <= 0 || len(v)%B != 0 || len(codes) < len(v) || len(scales) < len(v)/B {
		panic("quant: QuantizeFP8 length mismatch")
	}
	for b := 0; b < len(v)/B; b++ {
		blk := v[b*B : (b+1)*B]
		out := codes[b*B : (b+1)*B]
		x := BlockScaleExp(rule, absMax(blk), E4M3Max, floor)
		scales[b] = scaleByte(x)
		s, inv, ok := blockScale(x)
		for i, f := range blk {
			if ok {
				f *= inv
			} else {
				f /= s
			}
			out[i] = EncodeE4M3Sat(f) // = EncodeE4M3(clamp(f, ±448))
		}
	}
}

// DequantizeFP8 is the inverse of QuantizeFP8:
//
//	dst[i] = DecodeE4M3(codes[i]) · DecodeUE8M0(scales[i/B])
//
// exact for every finite result; NaN codes or a NaN scale give CanonicalNaN, as
// the CUDA multiply does. dequantizeFP8Ref is the per-element form; this one
// checks each block for NaN codes first (eight at a time) and multiplies
// without a per-element check when there are none, which is every block of a
// healthy cache.
func DequantizeFP8(dst []float32, codes, scales []uint8, B int) {
	if B <= 0 || len(codes)%B != 0 || len(dst) < len(codes) || len(scales) < len(codes)/B {
		panic("quant: DequantizeFP8 length mismatch")
	}
	for b := 0; b < len(codes)/B; b++ {
		src := codes[b*B : (b+1)*B]
		out := dst[b*B : (b+1)*B]
		if scales[b] == UE8M0NaN || hasE4M3NaN(src) {
			dequantizeFP8Ref(out, src, scales[b:b+1], B)
			continue
		}
		s := DecodeUE8M0(scales[b])
		for i, c := range src {
			out[i] = e4m3Table[c] * s // finite × power of two: never NaN
		}
	}
}

// hasE4M3NaN reports whether any code is 0x7F or 0xFF. It tests eight codes per
// step: with the sign bits cleared, a byte is 0x7F exactly when adding 1 to it
// sets its bit 7.
func hasE4M3NaN(codes []uint8) bool {
	const lo7, hi = 0x7f7f7f7f7f7f7f7f, 0x8080808080808080
	i := 0
	for ; i+8 <= len(codes); i += 8 {
		w := binary.LittleEndian.Uint64(codes[i:]) & lo7
		if (w+0x0101010101010101)&hi != 0 {
			return true
		}
	}
	for ; i < len(codes); i++ {
		if codes[i]&0x7f == 0x7f {
			return true
		}
	}
	return false
}

// dequantizeFP8Ref is DequantizeFP8 element by element, every product through
// mulCUDA: the reference for the fast loop.
func dequantizeFP8Ref(dst []float32, codes, scales []uint8, B int) {
	for i, c := range codes {
		dst[i] = mulCUDA(e4m3Table[c], DecodeUE8M0(scales[i/B]))
	}
}

// QuantizeFP4 is a real block quantisation to E2M1 codes with one UE8M0 scale per
// block of B elements (MXFP4: B = 32), packed two codes per byte (low nibble =
// even index): s = 2^x, x = BlockScaleExp(rule, amax, 6, floor),
// code_i = EncodeE2M1(clamp(v_i / s, -6, 6)). packed needs len(v)/2 bytes,
// scales len(v)/B; B must be even.
func QuantizeFP4(packed, scales []uint8, v []float32, B int, rule ScaleRule, floor float32) {
	if B <= 0 || len(v)%B != 0 || B%2 != 0 || len(packed) < len(v)/2 || len(scales) < len(v)/B {
		panic("quant: QuantizeFP4 length mismatch")
	}
	for b := 0; b < len(v)/B; b++ {
		blk := v[b*B : (b+1)*B]
		out := packed[b*B/2 : (b+1)*B/2]
		x := BlockScaleExp(rule, absMax(blk), E2M1Max, floor)
		scales[b] = scaleByte(x)
		s, inv, ok := blockScale(x)
		for i := range out {
			lo, hi := blk[2*i], blk[2*i+1]
			if ok {
				lo, hi = lo*inv, hi*inv
			} else {
				lo, hi = lo/s, hi/s
			}
			out[i] = EncodeE2M1(lo) | EncodeE2M1(hi)<<4 // EncodeE2M1 saturates: the clamp
		}
	}
}

// DequantizeFP4 is the inverse of QuantizeFP4: dst gets 2·len(packed) values,
// dst[i] = E2M1(code_i) · DecodeUE8M0(scales[i/B]); a NaN scale gives CanonicalNaN.
func DequantizeFP4(dst []float32, packed, scales []uint8, B int) {
	n := 2 * len(packed)
	if B <= 0 || B%2 != 0 || n%B != 0 || len(dst) < n || len(scales) < n/B {
		panic("quant: DequantizeFP4 length mismatch")
	}
	for b := 0; b < n/B; b++ {
		s := DecodeUE8M0(scales[b])
		src := packed[b*B/2 : (b+1)*B/2]
		out := dst[b*B : (b+1)*B]
		for i, p := range src {
			out[2*i] = mulCUDA(DecodeE2M1(p&0xf), s)
			out[2*i+1] = mulCUDA(DecodeE2M1(p>>4), s)
		}
	}
}

// QuantizeActFP8 is the activation quantiser in front of every FP8 linear (§3.2,
// R-K act_quant with scale_fmt ue8m0, not in place): per block of B (= 128)
// elements,
//
//	a   = max(max_i |x_i|, 1e-4)
//	s_b = ceil2(f32(a · f32(1/448)))
//	q_i = E4M3(clamp(x_i / s_b, -448, 448))
//
// It writes the E4M3 values (as fp32) into q and the block scales into s; the
// linear then computes Σ_b s_b · S_w · Σ_k q_k·W_k.
func QuantizeActFP8(q, s []float32, x []float32, B int) {
	if B <= 0 || len(x)%B != 0 || len(q) < len(x) || len(s) < len(x)/B {
		panic("quant: QuantizeActFP8 length mismatch")
	}
	for b := 0; b < len(x)/B; b++ {
		blk := x[b*B : (b+1)*B]
		out := q[b*B : (b+1)*B]
		sc, inv, ok := blockScale(BlockScaleExp(ScaleCeil2, absMax(blk), E4M3Max, FP8AmaxFloor))
		s[b] = sc
		for i, f := range blk {
			if ok {
				f *= inv
			} else {
				f /= sc
			}
			out[i] = e4m3Table[EncodeE4M3Sat(f)] // = E4M3(clamp(f, ±448))
		}
	}
}
