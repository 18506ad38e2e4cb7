package moe

import (
	"math"
	"runtime"
	"sync"
	"sync/atomic"

	"sparsemla/quant"
)

// UseFP4Assembly selects the AVX2 FP4 kernel when the CPU has it (the
// default). Set it to false to run the pure-Go loops (the same bits).
var UseFP4Assembly = hasFP4Asm

// HasFP4Assembly reports whether the AVX2 FP4 kernel can run here.
func HasFP4Assembly() bool { return hasFP4Asm }

// fp4AsmRows and fp4AsmFallbackRows count the rows the assembly kernel
// computed and those it handed to fp4Row (tests).
var fp4AsmRows, fp4AsmFallbackRows atomic.Int64

// fp4Group is the number of rows the assembly kernel computes at once.
const fp4Group = 32

// Exponent-field bounds of the block factor 2^(ew + ea - 127) within which
// the kernel's single scaling equals the reference's two (blk·s_a, then
// ·s_w) and nothing leaves the normal range: a block sum is 0 or a multiple
// of 2^-10 below 2^17 in magnitude (E4M3 × E2M1 products: ≥ 2^-10, ≤ 2688,
// 32 of them), so both scaled values stay in [2^-126, 2^127) when
// -116 ≤ ea ≤ 110 and 11 ≤ ew + ea ≤ 237; and every partial sum of the
// row accumulator is then a multiple of 2^-126 (never subnormal).
const (
	fp4MinF, fp4MaxF   = 11, 237
	fp4MinEA, fp4MaxEA = -116, 110
)

// fp4ActExponents returns the exponents of the per-32 activation scales sa
// (powers of two) when every one is a normal power of two within
// [fp4MinEA, fp4MaxEA] and every qx is finite; ok false sends the call to
// the pure-Go rows.
func fp4ActExponents(qx, sa []float32) (ea []int32, ok bool) {
	for _, v := range qx {
		if v-v != 0 { // NaN or ±Inf
			return nil, false
		}
	}
	ea = make([]int32, len(sa))
	for b, s := range sa {
		bits := math.Float32bits(s)
		e := int32(bits>>23&0xff) - 127
		if bits&0x807fffff != 0 || e < fp4MinEA || e > fp4MaxEA {
			return nil, false
		}
		ea[b] = e
	}
	return ea, true
}

// fp4LinearAsm computes FP4LinearFast's rows with the AVX2 kernel in
// groups of 32 rows split across GOMAXPROCS goroutines; a row whose block
// factors leave the kernel's exact range (fp4MinF … fp4MaxF, a NaN scale
// byte) and the rows after the last whole group run fp4Row. Every row is
// the reference's arithmetic whoever computes it.
func fp4LinearAsm(y, qx, sa []float32, ea []int32, w *FP4Weight) {
	nb := w.Cols / FP4Block
	groups := w.Rows / fp4Group
	rb := w.Cols / 2
	idx := make([]int32, 2*fp4Group)
	for r := 0; r < fp4Group; r++ {
		idx[r] = int32(r * rb)
		idx[fp4Group+r] = int32(r * nb)
	}
	run := func(g0, g1 int) {
		var acc [fp4Group]float32
		var stat [3 * fp4Group]int32
		var tmp [256]uint32
		for gi := g0; gi < g1; gi++ {
			n := gi * fp4Group
			acc = [fp4Group]float32{}
			for r := 0; r < fp4Group; r++ {
				stat[r], stat[fp4Group+r], stat[2*fp4Group+r] = math.MaxInt32, math.MinInt32, math.MinInt32
			}
			fp4Rows32(&acc[0], &w.Packed[n*rb], &w.Scale[n*nb], &idx[0], &qx[0], &ea[0], &stat[0], nb, &tmp)
			fallback := 0
			for r := 0; r < fp4Group; r++ {
				if stat[r] < fp4MinF || stat[fp4Group+r] > fp4MaxF || stat[2*fp4Group+r] == quant.UE8M0NaN {
					fp4Row(y, qx, sa, w, n+r)
					fallback++
					continue
				}
				y[n+r] = quant.BF16Round(acc[r])
			}
			fp4AsmRows.Add(int64(fp4Group - fallback))
			fp4AsmFallbackRows.Add(int64(fallback))
		}
	}
	workers := min(runtime.GOMAXPROCS(0), groups)
	if workers < 2 {
		run(0, groups)
	} else {
		var wg sync.WaitGroup
		for i := 0; i < workers; i++ {
			g0, g1 := groups*i/workers, groups*(i+1)/workers
			wg.Add(1)
			go func() {
				defer wg.Done()
				run(g0, g1)
			}()
		}
		wg.Wait()
	}
	for n := groups * fp4Group; n < w.Rows; n++ {
		fp4Row(y, qx, sa, w, n)
	}
}
