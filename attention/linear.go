package attention

import "sparsemla/quant"

// ActBlock is the block length of the activation quantiser in front of every FP8
// linear (ModelArgs block_size = 128).
const ActBlock = 128

// FP8Weight is an FP8 E4M3 weight [Rows, Cols] with one UE8M0 scale per 128×128
// block, as the checkpoint stores it (`.weight` codes, `.scale` bytes), plus its
// exact fp32 dequantisation W[n,k] = E4M3(code[n,k]) · 2^(scale[n/128,k/128]-127)
// made once at load (NewFP8Weight). A compact weight (NewFP8WeightCodes) has
// no W (nil): FP8Linear then dequantises one row at a time from the codes —
// the same exact values, a fifth of the memory (1 byte per weight instead
// of 5), slower. A weight whose packed copy is all that is kept (UsePanels)
// has neither W nor Codes and reads its rows from the panels.
type FP8Weight struct {
	Rows, Cols int
	Codes      []uint8   // [Rows*Cols] E4M3 codes; nil when the panels hold them (UsePanels)
	Scale      []uint8   // [ceil(Rows/128)*ceil(Cols/128)] UE8M0 bytes
	W          []float32 // [Rows*Cols] dequantised, exact; nil for a compact weight

	panels *FP8Panels // the codes, packed, when Codes is nil (UsePanels)
}

// UsePanels makes w keep only p, its packed copy (PackFP8Weight(w)): the
// codes and the fp32 dequantisation are dropped and rows are read from the
// panels (Row, FP8Linear, CodesRowMajor), the same values. It panics when p
// does not have w's shape and scales.
func (w *FP8Weight) UsePanels(p *FP8Panels) {
	if p.Rows != w.Rows || p.Cols != w.Cols || string(p.Scale) != string(w.Scale) {
		panic("attention: UsePanels: the panels are not this weight's")
	}
	w.Codes, w.W, w.Scale, w.panels = nil, nil, p.Scale, p
}

// CodesRowMajor returns the E4M3 codes [Rows*Cols] row-major: Codes, or a
// new unpacked copy of the panels' codes.
func (w *FP8Weight) CodesRowMajor() []uint8 {
	if w.Codes != nil || w.panels == nil {
		return w.Codes
	}
	c := make([]uint8, w.Rows*w.Cols)
	for n := 0; n < w.Rows; n++ {
		w.panels.rowCodes(c[n*w.Cols:(n+1)*w.Cols], n)
	}
	return c
}

// NewFP8Weight wraps checkpoint codes and scale bytes and dequantises them.
// It panics when the lengths do not match the shape (callers validate files first).
func NewFP8Weight(codes, scale []uint8, rows, cols int) *FP8Weight {
	w := &FP8Weight{Rows: rows, Cols: cols, Codes: codes, Scale: scale, W: make([]float32, rows*cols)}
	quant.DequantFP8Weight(w.W, codes, scale, rows, cols)
	return w
}

// NewFP8WeightCodes wraps checkpoint codes and scale bytes without
// dequantising them (a compact weight, W nil). It panics when the lengths do
// not match the shape.
func NewFP8WeightCodes(codes, scale []uint8, rows, cols int) *FP8Weight {
	if rows <= 0 || cols <= 0 || len(codes) != rows*cols || len(scale) != ((rows+127)/128)*((cols+127)/128) {
		panic("attention: NewFP8WeightCodes shape mismatch")
	}
	return &FP8Weight{Rows: rows, Cols: cols, Codes: codes, Scale: scale}
}

// Row returns row n of the dequantised weight W[n, :] [Cols]: a slice of W,
// or, for a compact weight, buf (len Cols) filled from the codes (or the
// panels, UsePanels) with quant.DequantFP8Weight (exactly the values W would
// hold).
func (w *FP8Weight) Row(n int, buf []float32) []float32 {
	if w.W != nil {
		return w.W[n*w.Cols : (n+1)*w.Cols]
	}
	bc := (w.Cols + 127) / 128
	rb := n / 128
	var codes []uint8
	if w.Codes != nil {
		codes = w.Codes[n*w.Cols : (n+1)*w.Cols]
	} else { // the panels hold them (UsePanels)
		codes = make([]uint8, w.Cols)
		w.panels.rowCodes(codes, n)
	}
	quant.DequantFP8Weight(buf[:w.Cols], codes, w.Scale[rb*bc:(rb+1)*bc], 1, w.Cols)
	return buf[:w.Cols]
}

// QuantizeFP8Weight turns fp32 values W [rows, cols] into an FP8Weight the way the
// checkpoint (and the golden's generator) does: per 128×128 block,
// s = ceil2(f32(max(amax,1e-4)·f32(1/448))), code = E4M3(clamp(W/s, ±448)).
// Used for synthetic weights.
func QuantizeFP8Weight(W []float32, rows, cols int) *FP8Weight {
	if len(W) != rows*cols {
		panic("attention: QuantizeFP8Weight shape mismatch")
	}
	br := (rows + quant.WeightBlock - 1) / quant.WeightBlock
	bc := (cols + quant.WeightBlock - 1) / quant.WeightBlock
	codes := make([]uint8, rows*cols)
	scale := make([]uint8, br*bc)
	dq := make([]float32, rows*cols)
	for bi := 0; bi < br; bi++ {
		for bj := 0; bj < bc; bj++ {
			var amax float32
			for n := bi * 128; n < min(rows, bi*128+128); n++ {
				for k := bj * 128; k < min(cols, bj*128+128); k++ {
					amax = max(amax, abs32(W[n*cols+k]))
				}
			}
			e := quant.BlockScaleExp(quant.ScaleCeil2, amax, quant.E4M3Max, quant.FP8AmaxFloor)
			scale[bi*bc+bj] = uint8(e + 127)
			s := quant.Pow2(e)
			for n := bi * 128; n < min(rows, bi*128+128); n++ {
				for k := bj * 128; k < min(cols, bj*128+128); k++ {
					c := quant.EncodeE4M3(min(max(W[n*cols+k]/s, -quant.E4M3Max), quant.E4M3Max))
					codes[n*cols+k] = c
					dq[n*cols+k] = quant.DecodeE4M3(c) * s // = DequantFP8Weight, exact
				}
			}
		}
	}
	return &FP8Weight{Rows: rows, Cols: cols, Codes: codes, Scale: scale, W: dq}
}

func abs32(x float32) float32 {
	if x < 0 {
		return -x
	}
	return x
}

// FP8Linear is `linear()` with an FP8 weight (spec §3.2, R-K act_quant +
// fp8_gemm): the bf16 activation x [Cols] is quantised per 128 columns
// (quant.QuantizeActFP8: qx = E4M3(x/s_b), s_b a power of two), then
//
//	y[n] = bf16( Σ_b ( Σ_{k∈b} qx[k]·W[n,k] ) · s_b )
//
// with the inner sum over one 128-block in fp32 (k ascending) and the outer sum
// across blocks in a separate fp32 accumulator, as the kernel does. W is the
// dequantised weight: its block scale is a power of two, so folding it into W
// gives the same fp32 block sums as scaling afterwards. y has Rows elements.
// A compact weight (W nil) is dequantised row by row (FP8Weight.Row).
func FP8Linear(y, x []float32, w *FP8Weight) {
	if len(x) != w.Cols || len(y) != w.Rows || w.Cols%ActBlock != 0 {
		panic("attention: FP8Linear shape mismatch")
	}
	qx := make([]float32, len(x))
	sx := make([]float32, len(x)/ActBlock)
	quant.QuantizeActFP8(qx, sx, x, ActBlock)
	var buf []float32
	if w.W == nil {
		buf = make([]float32, w.Cols)
	}
	for n := range y {
		row := w.Row(n, buf)
		var acc float32
		for b, s := range sx {
			var blk float32
			for k := b * ActBlock; k < (b+1)*ActBlock; k++ {
				blk += float32(qx[k] * row[k])
			}
			acc += float32(blk * s)
		}
		y[n] = quant.BF16Round(acc)
	}
}

// BF16Linear is F.linear with a bf16 weight (weights_proj) or a bf16 GEMM (wo_a):
//
//	y[n] = bf16( Σ_k x[k]·W[n,k] )     fp32 accumulation, k ascending
//
// x [cols] and W [rows, cols] hold bf16 values; y has rows elements.
func BF16Linear(y, x, W []float32, rows, cols int) {
	if len(x) != cols || len(y) != rows || len(W) != rows*cols {
		panic("attention: BF16Linear shape mismatch")
	}
	for n := range y {
		y[n] = quant.BF16Round(dot(x, W[n*cols:(n+1)*cols]))
	}
}

// F32Linear is an fp32 GEMM (compressor wkv / wgate, which the model keeps in
// fp32): y[n] = Σ_k x[k]·W[n,k], fp32, k ascending, no rounding to bf16.
func F32Linear(y, x, W []float32, rows, cols int) {
	if len(x) != cols || len(y) != rows || len(W) != rows*cols {
		panic("attention: F32Linear shape mismatch")
	}
	for n := range y {
		y[n] = dot(x, W[n*cols:(n+1)*cols])
	}
}

// dot is Σ_i a[i]·b[i] in fp32, i ascending (the reference summation order).
func dot(a, b []float32) float32 {
	var s float32
	for i, x := range a {
		s += float32(x * b[i]) // the conversion forbids FMA fusion
	}
	return s
}
