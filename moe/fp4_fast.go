package moe

import (
	"runtime"
	"sync"

	"sparsemla/attention"
	"sparsemla/quant"
)

// fp4Pairs holds the two E2M1 values of every packed byte: [b][0] the low
// nibble (even column), [b][1] the high nibble (odd column).
var fp4Pairs = func() (t [256][2]float32) {
	for b := range t {
		t[b][0] = quant.DecodeE2M1(uint8(b) & 0xf)
		t[b][1] = quant.DecodeE2M1(uint8(b) >> 4)
	}
	return t
}()

// fp4FastMinRows is the smallest weight that FP4LinearFast splits across
// goroutines.
const fp4FastMinRows = 64

// FP4LinearFast computes exactly FP4Linear (the same bits), on the
// checkpoint's row-major codes (no repacked copy). With AVX2 and FMA
// (UseFP4Assembly) it runs fp4Rows32AVX2 — 32 output rows in SIMD lanes,
// every lane summing its row in the reference's order — on weights whose
// rows hold a multiple of 16 scale blocks (cols % 512 == 0); a row whose
// block factors leave the range where one exact power-of-two scaling equals
// the reference's two (fp4_fast_simd.go; never for checkpoint scales) runs
// the Go row loop. Otherwise (no AVX2, -tags purego, other shapes, a
// non-finite activation) the Go loops run: the codes decoded a byte at a
// time through a 256-entry table of value pairs, four output rows side by
// side. Rows are split across GOMAXPROCS goroutines; every output row
// performs the reference's fp32 operations in the reference's order (inner
// 32-column sums k ascending, block sums b ascending), so the result does
// not depend on GOMAXPROCS. No fp32 subnormal is formed on the kernel's
// path: products E4M3 × E2M1 are ≥ 2^-10, block sums multiples of 2^-10,
// scaled sums multiples of 2^-126 (TestFP4AsmNoSubnormals runs it with
// denormals-are-zero and flush-to-zero).
func FP4LinearFast(y, x []float32, w *FP4Weight) {
	if len(x) != w.Cols || len(y) != w.Rows || w.Cols%attention.ActBlock != 0 {
		panic("moe: FP4LinearFast shape mismatch")
	}
	qx := make([]float32, len(x))
	sx := make([]float32, len(x)/attention.ActBlock)
	quant.QuantizeActFP8(qx, sx, x, attention.ActBlock)
	// One scale per 32 columns: the activation's (per 128) repeated.
	nb := w.Cols / FP4Block
	sa := make([]float32, nb)
	for b := range sa {
		sa[b] = sx[b*FP4Block/attention.ActBlock]
	}
	if UseFP4Assembly && hasFP4Asm && w.Rows >= fp4Group && nb%16 == 0 {
		if ea, ok := fp4ActExponents(qx, sa); ok {
			fp4LinearAsm(y, qx, sa, ea, w)
			return
		}
	}
	workers := runtime.GOMAXPROCS(0)
	if w.Rows < fp4FastMinRows || workers < 2 {
		fp4Rows(y, qx, sa, w, 0, w.Rows)
		return
	}
	chunk := (w.Rows + workers - 1) / workers
	var wg sync.WaitGroup
	for lo := 0; lo < w.Rows; lo += chunk {
		hi := min(lo+chunk, w.Rows)
		wg.Add(1)
		go func() {
			defer wg.Done()
			fp4Rows(y, qx, sa, w, lo, hi)
		}()
	}
	wg.Wait()
}

// fp4Rows computes rows lo … hi-1 of FP4Linear from the quantised
// activation qx and the per-32 activation scales sa. Four rows run side by
// side, each with its own accumulators (independent dependency chains for
// the CPU to overlap), each in the reference's order.
func fp4Rows(y, qx, sa []float32, w *FP4Weight, lo, hi int) {
	n := lo
	for ; n+4 <= hi; n += 4 {
		fp4Rows4(y[n:n+4:n+4], qx, sa, w, n)
	}
	for ; n < hi; n++ {
		fp4Row(y, qx, sa, w, n)
	}
}

// fp4Row computes row n.
func fp4Row(y, qx, sa []float32, w *FP4Weight, n int) {
	nb := w.Cols / FP4Block
	const half = FP4Block / 2
	codes := w.Packed[n*w.Cols/2 : (n+1)*w.Cols/2]
	scales := w.Scale[n*nb : (n+1)*nb]
	var acc float32
	for b := 0; b < nb; b++ {
		c := codes[b*half : (b+1)*half : (b+1)*half]
		q := qx[b*FP4Block : (b+1)*FP4Block : (b+1)*FP4Block]
		var blk float32
		for i, byt := range c {
			p := &fp4Pairs[byt]
			blk += float32(q[2*i] * p[0])
			blk += float32(q[2*i+1] * p[1])
		}
		acc += float32(float32(blk*sa[b]) * quant.DecodeUE8M0(scales[b]))
	}
	y[n] = quant.BF16Round(acc)
}

// fp4Rows4 computes rows n … n+3 into y[0:4], interleaved.
func fp4Rows4(y, qx, sa []float32, w *FP4Weight, n int) {
	nb := w.Cols / FP4Block
	const half = FP4Block / 2
	rb := w.Cols / 2
	c0 := w.Packed[n*rb : (n+1)*rb]
	c1 := w.Packed[(n+1)*rb : (n+2)*rb]
	c2 := w.Packed[(n+2)*rb : (n+3)*rb]
	c3 := w.Packed[(n+3)*rb : (n+4)*rb]
	s := w.Scale[n*nb : (n+4)*nb]
	var a0, a1, a2, a3 float32
	for b := 0; b < nb; b++ {
		q := qx[b*FP4Block : (b+1)*FP4Block : (b+1)*FP4Block]
		o := b * half
		var b0, b1, b2, b3 float32
		for i := 0; i < half; i++ {
			qe, qo := q[2*i], q[2*i+1]
			p0, p1, p2, p3 := &fp4Pairs[c0[o+i]], &fp4Pairs[c1[o+i]], &fp4Pairs[c2[o+i]], &fp4Pairs[c3[o+i]]
			b0 += float32(qe * p0[0])
			b1 += float32(qe * p1[0])
			b2 += float32(qe * p2[0])
			b3 += float32(qe * p3[0])
			b0 += float32(qo * p0[1])
			b1 += float32(qo * p1[1])
			b2 += float32(qo * p2[1])
			b3 += float32(qo * p3[1])
		}
		a := sa[b]
		a0 += float32(float32(b0*a) * quant.DecodeUE8M0(s[b]))
		a1 += float32(float32(b1*a) * quant.DecodeUE8M0(s[nb+b]))
		a2 += float32(float32(b2*a) * quant.DecodeUE8M0(s[2*nb+b]))
		a3 += float32(float32(b3*a) * quant.DecodeUE8M0(s[3*nb+b]))
	}
	y[0], y[1], y[2], y[3] = quant.BF16Round(a0), quant.BF16Round(a1), quant.BF16Round(a2), quant.BF16Round(a3)
}
