package quant

import "math"

// WeightBlock is the edge of the square FP8 weight scale blocks (128x128).
const WeightBlock = 128

// DequantFP8Weight expands an FP8 E4M3 weight w [rows, cols] (row-major, one code
// per byte) with UE8M0 block scales scale [ceil(rows/128), ceil(cols/128)] (the
// checkpoint's `.scale`, raw torch float8_e8m0fnu bytes) to fp32, as
// `w.float() * scale.float()` broadcast over the 128x128 blocks (§3.2):
//
//	dst[n, k] = E4M3(w[n, k]) · 2^(scale[n/128, k/128] - 127)
//
// The product is exact unless it overflows (code 448 with byte 0xFE gives inf);
// NaN codes and NaN scale bytes give CanonicalNaN, as on CUDA. The edge blocks of
// a dimension that is not a multiple of 128 are partial. dst needs rows·cols
// elements. This is how convert.py turns `wo_a` into bf16 (every finite result
// fits bf16 exactly).
func DequantFP8Weight(dst []float32, w []uint8, scale []uint8, rows, cols int) {
	sc := (cols + WeightBlock - 1) / WeightBlock
	if rows < 0 || cols < 0 || len(w) != rows*cols || len(dst) < rows*cols || len(scale) != ((rows+WeightBlock-1)/WeightBlock)*sc {
		panic("quant: DequantFP8Weight shape mismatch")
	}
	for n := 0; n < rows; n++ {
		srow := scale[(n/WeightBlock)*sc : (n/WeightBlock+1)*sc]
		wrow := w[n*cols : (n+1)*cols]
		out := dst[n*cols : (n+1)*cols]
		for kb, b := range srow {
			s := DecodeUE8M0(b)
			lo, hi := kb*WeightBlock, min((kb+1)*WeightBlock, cols)
			blk := out[lo:hi]
			for k, c := range wrow[lo:hi] {
				blk[k] = mulCUDA(e4m3Table[c], s)
			}
		}
	}
}

// DequantFP8WeightInv is DequantFP8Weight for Hugging Face checkpoints whose block
// scales are fp32 `weight_scale_inv` values (multiplied, despite the name):
// dst[n, k] = f32(E4M3(w[n, k]) · scaleInv[n/128, k/128]), rounded to nearest even.
func DequantFP8WeightInv(dst []float32, w []uint8, scaleInv []float32, rows, cols int) {
	sc := (cols + WeightBlock - 1) / WeightBlock
	if rows < 0 || cols < 0 || len(w) != rows*cols || len(dst) < rows*cols || len(scaleInv) != ((rows+WeightBlock-1)/WeightBlock)*sc {
		panic("quant: DequantFP8WeightInv shape mismatch")
	}
	for n := 0; n < rows; n++ {
		srow := scaleInv[(n/WeightBlock)*sc : (n/WeightBlock+1)*sc]
		wrow := w[n*cols : (n+1)*cols]
		out := dst[n*cols : (n+1)*cols]
		for kb, s := range srow {
			lo, hi := kb*WeightBlock, min((kb+1)*WeightBlock, cols)
			blk := out[lo:hi]
			for k, c := range wrow[lo:hi] {
				blk[k] = mulCUDA(e4m3Table[c], s)
			}
		}
	}
}

// mulCUDA is the fp32 product a·b as a CUDA multiply returns it: IEEE round to
// nearest even, and CanonicalNaN for any NaN result (x86 and arm64 would keep or
// make other NaN payloads).
func mulCUDA(a, b float32) float32 {
	r := a * b
	if r != r {
		return math.Float32frombits(CanonicalNaN)
	}
	return r
}
