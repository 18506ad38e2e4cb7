package moe

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/quant"
)

// FP4Block is the number of columns that share one UE8M0 weight scale
// (fp4_block_size = 32).
const FP4Block = 32

// FP4Weight is a routed-expert weight [Rows][Cols] as the checkpoint stores
// it: Packed [Rows][Cols/2] E2M1 codes, two per byte with the even column in
// the low nibble (float4_e2m1fn_x2), and Scale [Rows][Cols/32] UE8M0 bytes,
// W[n][k] = E2M1(code[n][k]) · 2^(Scale[n][k/32] - 127).
type FP4Weight struct {
	Rows, Cols int
	Packed     []uint8
	Scale      []uint8
}

// NewFP4Weight wraps checkpoint bytes; it returns an error when the lengths do
// not match the shape or Cols is not a multiple of 128 (the activation block).
func NewFP4Weight(packed, scale []uint8, rows, cols int) (*FP4Weight, error) {
	if rows <= 0 || cols <= 0 || cols%attention.ActBlock != 0 {
		return nil, fmt.Errorf("moe: FP4 weight [%d, %d]: columns must be a positive multiple of %d", rows, cols, attention.ActBlock)
	}
	if len(packed) != rows*cols/2 || len(scale) != rows*cols/FP4Block {
		return nil, fmt.Errorf("moe: FP4 weight [%d, %d]: %d code bytes and %d scale bytes, want %d and %d",
			rows, cols, len(packed), len(scale), rows*cols/2, rows*cols/FP4Block)
	}
	return &FP4Weight{Rows: rows, Cols: cols, Packed: packed, Scale: scale}, nil
}

// Dequant returns the exact fp32 value of the whole weight [Rows*Cols]
// (quant.DequantizeFP4 row by row): what the golden's torch port of fp4_gemm
// multiplies.
func (w *FP4Weight) Dequant() []float32 {
	out := make([]float32, w.Rows*w.Cols)
	for n := 0; n < w.Rows; n++ {
		w.dequantRow(out[n*w.Cols:(n+1)*w.Cols], n)
	}
	return out
}

func (w *FP4Weight) dequantRow(dst []float32, n int) {
	quant.DequantizeFP4(dst, w.Packed[n*w.Cols/2:(n+1)*w.Cols/2], w.Scale[n*w.Cols/FP4Block:(n+1)*w.Cols/FP4Block], FP4Block)
}

// FP4Linear is `linear()` with an FP4 weight (R-M:114-126; R-K act_quant +
// fp4_gemm_kernel): the bf16 activation x [Cols] is quantised to FP8 per 128
// columns (quant.QuantizeActFP8: qx = E4M3(x/s_a), s_a a power of two), then
//
//	y[n] = bf16( Σ_b f32( f32( Σ_{k∈b} qx[k]·E2M1(code[n][k]) ) · s_a[k/128] · s_w[n][b] ) )
//
// over the 32-column blocks b (the kernel's block_K = weight_group_size = 32):
// the inner sum in fp32, k ascending; the scaled block sums added in a second
// fp32 accumulator, b ascending. The scales are powers of two, so the scaling
// is exact. y has Rows elements.
func FP4Linear(y, x []float32, w *FP4Weight) {
	fp4LinearAct(y, x, w, attention.ActBlock, "FP4Linear")
}

// fp4LinearAct is FP4Linear with the activation quantised per actBlock
// columns (128 for V4, 32 for V4.1: V41FP4Linear; a multiple of FP4Block): block b's sum is scaled
// by s_a[b·32/actBlock]. name is the caller's, for the shape panic.
func fp4LinearAct(y, x []float32, w *FP4Weight, actBlock int, name string) {
	if len(x) != w.Cols || len(y) != w.Rows || w.Cols%actBlock != 0 {
		panic("moe: " + name + " shape mismatch")
	}
	qx := make([]float32, len(x))
	sx := make([]float32, len(x)/actBlock)
	quant.QuantizeActFP8(qx, sx, x, actBlock)
	nb := w.Cols / FP4Block
	for n := range y {
		codes := w.Packed[n*w.Cols/2 : (n+1)*w.Cols/2]
		scales := w.Scale[n*nb : (n+1)*nb]
		var acc float32
		for b := 0; b < nb; b++ {
			var blk float32
			for k := b * FP4Block; k < (b+1)*FP4Block; k++ {
				c := codes[k/2] >> (4 * uint(k&1)) // even column: low nibble
				blk += float32(qx[k] * quant.DecodeE2M1(c))
			}
			sa := sx[b*FP4Block/actBlock]
			acc += float32(float32(blk*sa) * quant.DecodeUE8M0(scales[b]))
		}
		y[n] = quant.BF16Round(acc)
	}
}
