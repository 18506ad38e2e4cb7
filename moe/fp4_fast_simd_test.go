package moe

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"sparsemla/quant"
)

// fp4Case is a weight and an activation for the FP4 kernel tests.
type fp4Case struct {
	name string
	w    *FP4Weight
	x    []float32
	// inRange: every row's block factors are inside the kernel's exact range
	// (no row may take fp4Row).
	inRange bool
}

func fp4Cases(t *testing.T) []fp4Case {
	rng := rand.New(rand.NewPCG(31, 32))
	mk := func(rows, cols int, code func(r, k int) uint8, scale func(r, b int) uint8) *FP4Weight {
		packed := make([]uint8, rows*cols/2)
		sc := make([]uint8, rows*cols/FP4Block)
		for r := 0; r < rows; r++ {
			for k := 0; k < cols; k++ {
				packed[(r*cols+k)/2] |= code(r, k) << (4 * uint(k&1))
			}
			for b := 0; b < cols/FP4Block; b++ {
				sc[r*cols/FP4Block+b] = scale(r, b)
			}
		}
		w, err := NewFP4Weight(packed, sc, rows, cols)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	// x whose every 128-block has amax 448: activation scale 1 (ea = 0), so
	// a row's factor exponent field is its scale byte
	unitX := func(cols int) []float32 {
		x := randBF16(rng, cols, 100)
		for b := 0; b < cols; b += 128 {
			x[b+5] = 448
		}
		return x
	}
	// codes ±6 and ±0.5 mixed: block sums up to 32·448·6 with 2^-10 parts,
	// where the fp32 sum order matters
	worst := func(r, k int) uint8 { return [4]uint8{7, 15, 1, 9}[rng.IntN(4)] }
	// x spanning the E4M3 range inside each block: qx has E4M3 subnormals
	wide := func(cols int) []float32 {
		x := make([]float32, cols)
		for i := range x {
			x[i] = quant.BF16Round(float32(math.Ldexp(rng.Float64()+0.5, -rng.IntN(24)) * float64(1-2*rng.IntN(2))))
		}
		return x
	}
	var cs []fp4Case
	cs = append(cs, fp4Case{"checkpoint/2048x4096", randFP4(rng, 2048, 4096), randBF16(rng, 4096, 1), true})
	cs = append(cs, fp4Case{"checkpoint/100x512", randFP4(rng, 100, 512), randBF16(rng, 512, 0.01), true})
	cs = append(cs, fp4Case{"checkpoint/64x384 (Go rows: 12 scale blocks)", randFP4(rng, 64, 384), randBF16(rng, 384, 1), true})
	cs = append(cs, fp4Case{"worst-codes/64x1024", mk(64, 1024, worst, func(r, b int) uint8 { return uint8(11 + rng.IntN(227)) }), unitX(1024), true})
	cs = append(cs, fp4Case{"every-code/32x512", mk(32, 512, func(r, k int) uint8 { return uint8((r + k) & 15) }, func(r, b int) uint8 { return uint8(120 + b) }), wide(512), true})
	cs = append(cs, fp4Case{"subnormal-qx/96x1536", mk(96, 1536, func(r, k int) uint8 { return uint8(rng.IntN(16)) }, func(r, b int) uint8 { return uint8(100 + rng.IntN(40)) }), wide(1536), true})
	// scale bytes at and across the range bounds (10/11, 237/238), the
	// extremes 0, 1, 254 and the NaN byte 255: those rows run fp4Row
	edge := []uint8{0, 1, 10, 11, 12, 236, 237, 238, 254, 255}
	cs = append(cs, fp4Case{"edge-scales/128x512", mk(128, 512, worst, func(r, b int) uint8 {
		if r%4 == 0 {
			return edge[(r/4+b)%len(edge)]
		}
		return uint8(11 + rng.IntN(227))
	}), unitX(512), false})
	every := make([]uint8, 0, 256)
	for s := 0; s < 256; s++ {
		every = append(every, uint8(s))
	}
	cs = append(cs, fp4Case{"every-scale/256x1024", mk(256, 1024, func(r, k int) uint8 { return uint8(rng.IntN(16)) }, func(r, b int) uint8 { return every[(r*32+b)%256] }), unitX(1024), false})
	return cs
}

// TestFP4LinearAsmBitIdentical: FP4LinearFast on the AVX2 kernel and on the
// pure-Go rows returns the bits of the reference FP4Linear at GOMAXPROCS 1,
// 2 and 16: checkpoint weights, codes that make the fp32 block sums round
// (±6 with ±0.5), every code, activations with E4M3-subnormal qx, every
// scale byte and the bytes at the kernel's range bounds (those rows run the
// Go rows: counted). In-range weights take the kernel for every row.
func TestFP4LinearAsmBitIdentical(t *testing.T) {
	if !HasFP4Assembly() {
		t.Log("no AVX2/FMA here: only the pure-Go rows are compared")
	}
	defer func(u bool, p int) { UseFP4Assembly = u; runtime.GOMAXPROCS(p) }(UseFP4Assembly, runtime.GOMAXPROCS(0))
	for _, c := range fp4Cases(t) {
		want := make([]float32, c.w.Rows)
		FP4Linear(want, c.x, c.w)
		for _, asm := range []bool{true, false} {
			if asm && !HasFP4Assembly() {
				continue
			}
			for _, procs := range []int{1, 2, 16} {
				UseFP4Assembly = asm
				runtime.GOMAXPROCS(procs)
				rows0, fb0 := fp4AsmRows.Load(), fp4AsmFallbackRows.Load()
				got := make([]float32, c.w.Rows)
				FP4LinearFast(got, c.x, c.w)
				for n := range want {
					if math.Float32bits(got[n]) != math.Float32bits(want[n]) {
						t.Fatalf("%s asm=%v GOMAXPROCS %d: row %d = %v (%#x), reference %v (%#x)",
							c.name, asm, procs, n, got[n], math.Float32bits(got[n]), want[n], math.Float32bits(want[n]))
					}
				}
				rows, fb := fp4AsmRows.Load()-rows0, fp4AsmFallbackRows.Load()-fb0
				if !asm {
					if rows+fb != 0 {
						t.Fatalf("%s: the pure-Go path ran the kernel", c.name)
					}
					continue
				}
				full := int64(c.w.Rows / fp4Group * fp4Group)
				if c.w.Cols%512 != 0 { // the kernel needs 16 scale blocks per row
					full = 0
				}
				switch {
				case rows+fb != full:
					t.Fatalf("%s GOMAXPROCS %d: the kernel saw %d rows, want %d", c.name, procs, rows+fb, full)
				case full == 0:
				case c.inRange && fb != 0:
					t.Fatalf("%s GOMAXPROCS %d: %d in-range rows ran fp4Row", c.name, procs, fb)
				case !c.inRange && fb == 0:
					t.Fatalf("%s GOMAXPROCS %d: no row left the kernel's range", c.name, procs)
				}
			}
		}
	}
}

// TestFP4AsmNoSubnormals runs the kernel with MXCSR's denormals-are-zero and
// flush-to-zero bits set on its thread: a subnormal operand or result
// anywhere in the kernel would change an output, yet every in-range case
// still matches the reference (computed without them).
func TestFP4AsmNoSubnormals(t *testing.T) {
	if !HasFP4Assembly() {
		t.Skip("no AVX2/FMA")
	}
	defer func(u bool, p int) { UseFP4Assembly = u; runtime.GOMAXPROCS(p) }(UseFP4Assembly, runtime.GOMAXPROCS(1))
	UseFP4Assembly = true
	for _, c := range fp4Cases(t) {
		if !c.inRange {
			continue
		}
		want := make([]float32, c.w.Rows)
		FP4Linear(want, c.x, c.w)
		qx := make([]float32, len(c.x))
		sx := make([]float32, len(c.x)/128)
		quant.QuantizeActFP8(qx, sx, c.x, 128)
		sa := make([]float32, c.w.Cols/FP4Block)
		for b := range sa {
			sa[b] = sx[b*FP4Block/128]
		}
		ea, ok := fp4ActExponents(qx, sa)
		if !ok {
			t.Fatalf("%s: activation outside the kernel's range", c.name)
		}
		got := make([]float32, c.w.Rows)
		func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			old := fp4GetMXCSR()
			fp4SetMXCSR(old | 0x8040) // FTZ | DAZ
			defer fp4SetMXCSR(old)
			fp4LinearAsm(got, qx, sa, ea, c.w)
		}()
		for n := range want[:c.w.Rows/fp4Group*fp4Group] {
			if math.Float32bits(got[n]) != math.Float32bits(want[n]) {
				t.Fatalf("%s with DAZ/FTZ: row %d = %v, reference %v", c.name, n, got[n], want[n])
			}
		}
	}
	_ = fmt.Sprint
}
