package quant

import "math"

// WeightBlock is the edge of the square FP8 weight scale blocks (128x128).
const WeightBlock = 128

// DequantFP8Weight expands an FP8 E4M3 weight [rows, cols] with UE8M0 block
// scales [ceil(rows/128), ceil(cols/128)] (checkpoint `.scale`, torch
// float8_e8m0fnu bytes) to fp32: W[n,k] = E4M3(w[n,k]) · 2^(scale[n/128, k/128]-127).
// The product is exact. dst needs rows·cols elements.
func DequantFP8Weight(dst []float32, w []uint8, scale []uint8, rows, cols int) {
	sc := (cols + WeightBlock - 1) / WeightBlock
	if len(w) != rows*cols || len(dst) < rows*cols || len(scale) != ((rows+WeightBlock-1)/WeightBlock)*sc {
		panic("quant: DequantFP8Weight shape mismatch")
	}
	for n := 0; n < rows; n++ {
		srow := scale[(n/WeightBlock)*sc : (n/WeightBlock+1)*sc]
		for k, c := range w[n*cols : (n+1)*cols] {
			dst[n*cols+k] = mulCUDA(e4m3Table[c], DecodeUE8M0(srow[k/WeightBlock]))
		}
	}
}

// DequantFP8WeightInv is DequantFP8Weight for Hugging Face checkpoints whose block
// scales are fp32 `weight_scale_inv` values (multiplied, despite the name).
func DequantFP8WeightInv(dst []float32, w []uint8, scaleInv []float32, rows, cols int) {
	sc := (cols + WeightBlock - 1) / WeightBlock
	if len(w) != rows*cols || len(dst) < rows*cols || len(scaleInv) != ((rows+WeightBlock-1)/WeightBlock)*sc {
		panic("quant: DequantFP8WeightInv shape mismatch")
	}
	for n := 0; n < rows; n++ {
		srow := scaleInv[(n/WeightBlock)*sc : (n/WeightBlock+1)*sc]
		for k, c := range w[n*cols : (n+1)*cols] {
			dst[n*cols+k] = mulCUDA(e4m3Table[c], srow[k/WeightBlock])
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
