package attention

import (
	"math"
	"runtime"
	"sync"
	"sync/atomic"

	"sparsemla/quant"
)

// FP8Panels is an FP8 weight [Rows, Cols] (E4M3 codes, UE8M0 128×128 block
// scales) repacked for the fast FP8Linear: Codes is [ceil(Rows/64)][Cols][64]
// (rows past Rows are zero padding), Scale is the checkpoint's
// [ceil(Rows/128)][Cols/128] bytes. One byte per weight: no fp32 copy is kept.
type FP8Panels struct {
	Rows, Cols int
	Codes      []uint8
	Scale      []uint8
	// Sub flags the panel rows that hold a nonzero E4M3 subnormal code
	// (low 7 bits 0x01-0x07): bit k%64 of Sub[pi·Cols/64 + k/64] for row k
	// of panel pi. The kernels widen flagged rows through the subnormal-safe
	// decode and the others through the plain shift (0.2 % of the codes'
	// bytes). A flagged row stores its 64 codes in the decode's order
	// (fp8StoredLane), the others in row order.
	Sub []uint64
	// exact reports that the kernel's factoring (block sums of
	// (qx·2^84)·(E4M3·2^-104) = (qx·2^100)·(E4M3·2^-120), scaled by
	// 2^(e+20)·s_b at the block end)
	// provably equals the reference: no NaN code, every scale exponent e in
	// [-90, 100] (the per-call checks then bound the factors).
	exact bool
}

// PackFP8 repacks checkpoint codes [rows, cols] and scale bytes into panels.
// cols must be a multiple of 128 (as FP8Linear requires).
func PackFP8(codes, scale []uint8, rows, cols int) *FP8Panels {
	cb := cols / ActBlock
	if rows <= 0 || cols <= 0 || cols%ActBlock != 0 || len(codes) != rows*cols || len(scale) != ((rows+127)/128)*cb {
		panic("attention: PackFP8 shape mismatch")
	}
	np := (rows + PanelRows - 1) / PanelRows
	p := &FP8Panels{Rows: rows, Cols: cols, Codes: make([]uint8, np*cols*PanelRows), Scale: append([]uint8(nil), scale...), exact: true}
	for _, b := range scale {
		if e := int(b) - 127; b == quant.UE8M0NaN || e < -90 || e > 100 {
			p.exact = false
		}
	}
	p.Sub = make([]uint64, np*cols/64)
	var nan atomic.Bool
	parallelFor(np, rows*cols, func(lo, hi int) {
		for pi := lo; pi < hi; pi++ {
			dst := p.Codes[pi*cols*PanelRows : (pi+1)*cols*PanelRows]
			for l := 0; l < PanelRows && pi*PanelRows+l < rows; l++ {
				row := codes[(pi*PanelRows+l)*cols : (pi*PanelRows+l+1)*cols]
				for k, c := range row {
					dst[k*PanelRows+l] = c
				}
			}
			// flag the panel's rows with a subnormal code (its own words of
			// Sub) and store their codes in the decode's order
			sub := p.Sub[pi*cols/64 : (pi+1)*cols/64]
			for k := range cols {
				row := dst[k*PanelRows : (k+1)*PanelRows : (k+1)*PanelRows]
				for _, c := range row {
					if c&0x7f == 0x7f { // E4M3 NaN: the kernels' bit trick would read it as a number
						nan.Store(true)
					}
					if c&0x78 == 0 && c&0x07 != 0 {
						sub[k/64] |= 1 << (k % 64)
					}
				}
				if sub[k/64]>>(k%64)&1 != 0 {
					var r [PanelRows]uint8
					copy(r[:], row)
					for l, c := range r {
						row[fp8StoredLane(true, l)] = c
					}
				}
			}
		}
	})
	if nan.Load() {
		p.exact = false
	}
	return p
}

// PackFP8Weight repacks an FP8Weight (its codes and scales; W is not used).
// A weight that keeps only its panels (UsePanels) returns them.
func PackFP8Weight(w *FP8Weight) *FP8Panels {
	if w.Codes == nil && w.panels != nil {
		return w.panels
	}
	return PackFP8(w.Codes, w.Scale, w.Rows, w.Cols)
}

// fp8StoredLane is the byte of a 64-code panel row that holds the code of
// panel row l (a lane): l itself in a row without subnormal codes; in a row
// with one (sub), l with its qwords 1 and 2 of each 32 swapped — the order
// in which the assembly's DEC32 reads them, whose per-128-bit-lane byte
// unpacks then give rows 0-15 and 16-31 without a cross-lane permute. It is
// its own inverse.
func fp8StoredLane(sub bool, l int) int {
	if !sub {
		return l
	}
	switch l % 32 / 8 {
	case 1:
		return l + 8
	case 2:
		return l - 8
	}
	return l
}

// code returns the E4M3 code of panel row l of panel pi (weight row
// 64·pi+l), column k, wherever its panel row's order (fp8StoredLane) put it.
func (p *FP8Panels) code(pi, k, l int) uint8 {
	sub := p.Sub[pi*p.Cols/64+k/64]>>(k%64)&1 != 0
	return p.Codes[(pi*p.Cols+k)*PanelRows+fp8StoredLane(sub, l)]
}

// rowCodes copies the codes of row n [Cols] out of the panels into dst.
func (p *FP8Panels) rowCodes(dst []uint8, n int) {
	pi, l := n/PanelRows, n%PanelRows
	for k := range dst[:p.Cols] {
		dst[k] = p.code(pi, k, l)
	}
}

// Bytes is the memory the packed weight holds.
func (p *FP8Panels) Bytes() int64 { return int64(len(p.Codes) + len(p.Scale) + 8*len(p.Sub)) }

// The FP8 kernels never form an fp32 subnormal, whatever the codes (Intel
// cores slow down 7-14× on subnormal operands): a panel row (64 codes, one k)
// that holds a nonzero E4M3 subnormal code (FP8Panels.Sub) widens every code
// c to v(c) = E4M3(c)·2^-104 (fp8WidenBits), normal for every finite code (or
// ±0); any other row, whose codes are all normal or zero, widens by the plain
// shift to E4M3(c)·2^-120 (normal or ±0) with x scaled by a further 2^16.
// Both give the same products, so the path of a row changes no bit; the
// subnormal-safe decode costs about 1.3-1.4× the plain one in cache (Zen 3),
// so a weight made of subnormal codes (the worst case) runs at most that much
// slower than a checkpoint's, where almost no row holds one. The activation side is
// scaled so that the products are the reference's, times a power of two:
const (
	fp8WidenExp = -104 // v(c) = E4M3(c)·2^fp8WidenExp
	// FP8Linear: the kernels take x = qx·2^100, the scale of the plain-shift
	// rows (v = E4M3·2^-120), and multiply it by 2^-16 for the rows with a
	// subnormal code, so x·v = qx·E4M3·2^-20 on both (the common rows save
	// a multiply per row)
	fp8ActExp = 100
	// fp8ActScale is 2^fp8ActExp: xs = qx·fp8ActScale (exact)
	fp8ActScale = float32(1 << fp8ActExp)
)

// fp8DTab is the table of fp8WidenBits: the field of code magnitude t is
// t + fp8DTab[min(t, 8)] — m+128−K[m] for the subnormal magnitudes m < 8
// (m·2^-113 normalised, K = {128, 17, 10, 7, 4, 3, 2, 1}; m = 0 gives the
// field 0, ±0), t+128 for the normal ones.
var fp8DTab = [16]uint8{0, 111, 118, 121, 124, 125, 126, 127, 128}

// fp8WidenBits is the fp32 bit pattern the assembly (DEC32) gives code c in
// a row with a subnormal code, computed the same way: the field
// exponent·8+mantissa is t + T[min(t, 8)] for t = c&0x7F (VPMINUB, a
// 16-entry VPSHUFB table), the sign goes to bit 31. For every code but the
// NaN codes it is E4M3(c)·2^-104 exactly (TestFP8WidenAllCodes).
func fp8WidenBits(c uint8) uint32 {
	t := uint32(c & 0x7f)
	f := (t + uint32(fp8DTab[min(t, 8)])) & 0xff // VPADDB
	h := uint32(c>>7) << 3
	return (h<<8 | f) << 20
}

// quantizeActFast is quant.QuantizeActFP8(q, s, x, ActBlock), the same bits,
// faster (AVX2: absMaxBitsAVX2, quantBlockAVX2; else quantBlockFast): it runs once per FP8Linear call on the caller's goroutine,
// before the GEMV is split, so at 16 threads its cost counts against the
// small weights. Per 128-block: amax as the reference takes it (the largest
// magnitude's bits), s = 2^e, e = BlockScaleExp(ScaleCeil2, amax, 448,
// 1e-4), then each q = E4M3(clamp(x·2^-e, ±448)) rounded in place —
// magnitudes from 2^-6 keep 3 mantissa bits (round to nearest even on the
// bits), smaller ones go to the 2^-9 grid (an fp32 add of 2^14 rounds them)
// — the values quant.DecodeE4M3(quant.EncodeE4M3Sat(f)) gives. A block with
// a non-finite value or a scale outside 2^±100 takes quant.QuantizeActFP8.
// xs gets q·2^100 (fp8ActExp), the kernels' pre-scaled activation.
func quantizeActFast(q, s, xs, x []float32) {
	for b := range len(x) / ActBlock {
		blk := x[b*ActBlock : (b+1)*ActBlock : (b+1)*ActBlock]
		out := q[b*ActBlock : (b+1)*ActBlock : (b+1)*ActBlock]
		sc := xs[b*ActBlock : (b+1)*ActBlock : (b+1)*ActBlock]
		var am uint32
		if useAsm() {
			am = absMaxBitsAVX2(&blk[0], ActBlock)
		} else {
			for _, v := range blk {
				am = max(am, math.Float32bits(v)&0x7fffffff)
			}
		}
		e := 0
		if am < 0x7f800000 {
			e = quant.BlockScaleExp(quant.ScaleCeil2, math.Float32frombits(am), quant.E4M3Max, quant.FP8AmaxFloor)
		}
		if am >= 0x7f800000 || e < -100 || e > 100 {
			quant.QuantizeActFP8(out, s[b:b+1], blk, ActBlock)
			for i, v := range out {
				sc[i] = v * fp8ActScale
			}
			continue
		}
		s[b] = quant.Pow2(e)
		if useAsm() {
			quantBlockAVX2(&out[0], &sc[0], &blk[0], quant.Pow2(-e), ActBlock)
		} else {
			quantBlockFast((*[ActBlock]float32)(out), (*[ActBlock]float32)(sc), (*[ActBlock]float32)(blk), quant.Pow2(-e))
		}
	}
}

// quantBlockFast rounds one block of quantizeActFast: out[i] =
// E4M3(clamp(x[i]·inv, ±448)) as fp32, on the bits (no calls in the loop),
// and xs[i] = out[i]·2^100 (exact: the kernels' pre-scaled activation).
func quantBlockFast(out, xs, x *[ActBlock]float32, inv float32) {
	for i, v := range x {
		bits := math.Float32bits(v * inv)
		ab := min(bits&0x7fffffff, 0x43e00000) // |f| clamped to 448
		r := (ab + 0x7ffff + (ab>>20)&1) &^ 0xfffff
		if ab < 0x3c800000 { // |f| < 2^-6: the subnormal grid, step 2^-9
			r = math.Float32bits((math.Float32frombits(ab) + 0x1p14) - 0x1p14)
		}
		out[i] = math.Float32frombits(r | bits&0x80000000)
		xs[i] = out[i] * fp8ActScale
	}
}

// Linear is FP8Linear on the packed weight, bit-identical to it at any
// GOMAXPROCS: x [Cols] bf16 values, y [Rows] bf16 results,
//
//	y[n] = bf16( Σ_b ( Σ_{k∈b} qx[k]·W[n,k] ) · s_b ).
//
// The assembly computes each block sum of (qx·2^100)·(E4M3·2^-120) (or, for
// a row with a subnormal code, (qx·2^84)·(E4M3·2^-104): the same
// products) and multiplies it by the power of two 2^(e+20)·s_b at the block
// end: every product is qx·E4M3·2^-20 exactly (a
// normal multiple of 2^-38), every partial block sum a multiple of 2^-38
// below 2^5 (normal), every block term in [2^-118, 2^85], so the block sums are the reference's times a
// power of two and the block terms are the reference's exactly. The terms
// are added in block order onto +0, as the reference does; a small weight
// has its blocks split among goroutines (fp8Terms64AVX2) and the terms added
// in order afterwards (sumTerms64AVX2), the same sums. Weights or
// activations outside that range (NaN codes, extreme scales, non-finite x)
// take the reference loop.
func (p *FP8Panels) Linear(y, x []float32) {
	if len(x) != p.Cols || len(y) != p.Rows {
		panic("attention: FP8Panels.Linear shape mismatch")
	}
	a := getActScratch(len(x))
	quantizeActFast(a.qx, a.sx, a.xs, x)
	trace(evQuantised)
	j := p.job(y, a.qx, a.sx, a.xs, runtime.GOMAXPROCS(0))
	parallelFor(j.items(), p.Rows*p.Cols, j.run)
	j.release()
	actPool.Put(a)
}

// actScratch is one call's quantised activation: qx (E4M3 values), its
// block scales sx and the kernels' pre-scaled copy xs = qx·2^100. Calls take
// it from actPool and return it: a decode step makes thousands of GEMV
// calls, and allocating these per call (3 × 16 KiB for a 4096-wide x) cost
// 15-18 % of a cache-resident call's CPU time in malloc and GC assists.
type actScratch struct{ qx, xs, sx []float32 }

var actPool sync.Pool

// getActScratch returns scratch for an activation of n values (contents
// undefined: quantizeActFast writes every element).
func getActScratch(n int) *actScratch {
	a, _ := actPool.Get().(*actScratch)
	if a == nil {
		a = new(actScratch)
	}
	a.qx, a.xs, a.sx = grow(a.qx, n), grow(a.xs, n), grow(a.sx, n/ActBlock)
	return a
}

// grow returns s resized to n, reusing its array when it is large enough
// (the elements are not cleared: callers write each before reading it).
func grow[T any](s []T, n int) []T {
	if cap(s) >= n {
		return s[:n]
	}
	return make([]T, n)
}

// LinearShared computes ys[i] = FP8Linear(x, ps[i]) for weights that read
// the same activation x (wq_a and wkv of a layer both read the attention
// input): x is quantised once (the same qx and block scales each Linear
// call would compute) and every weight's work items run in one parallel
// loop, so two small GEMVs make one call's worth of work instead of two
// fork/joins. Each item is computed exactly as Linear computes it, so the
// bits are Linear's at any GOMAXPROCS.
func LinearShared(ps []*FP8Panels, ys [][]float32, x []float32) {
	if len(ps) != len(ys) {
		panic("attention: LinearShared: weights and outputs differ in number")
	}
	for i, p := range ps {
		if len(x) != p.Cols || len(ys[i]) != p.Rows {
			panic("attention: LinearShared shape mismatch")
		}
	}
	a := getActScratch(len(x))
	defer actPool.Put(a)
	qx, sx, xs := a.qx, a.sx, a.xs
	quantizeActFast(qx, sx, xs, x)
	procs := runtime.GOMAXPROCS(0)
	jobs, first := make([]*fp8Job, len(ps)), make([]int, len(ps)+1)
	work := 0
	for i, p := range ps {
		jobs[i] = p.job(ys[i], qx, sx, xs, procs)
		first[i+1] = first[i] + jobs[i].items()
		work += p.Rows * p.Cols
	}
	parallelFor(first[len(ps)], work, func(lo, hi int) {
		for i := lo; i < hi; {
			w := 0
			for first[w+1] <= i {
				w++
			}
			end := min(hi, first[w+1])
			jobs[w].run(i-first[w], end-first[w])
			i = end
		}
	})
	for _, j := range jobs {
		j.release()
	}
}

// LinearPlain is BF16Linear on the packed weight — a bf16 GEMM without
// activation quantisation, for wo_a, which convert.py dequantises from FP8 to
// bf16 (PackWoA re-encodes it losslessly) — bit-identical:
//
//	y[n] = bf16( Σ_k x[k]·W[n,k] )     fp32, k ascending
//
// The assembly runs the whole row as one sum of x[k]·2^(e_b+104) (the block's
// scale moved onto x, exactly) times v(code) = E4M3·2^-104 (rows without
// subnormal codes: x[k]·2^(e_b+120) times E4M3·2^-120): each product is
// the reference's x[k]·W[n,k] exactly (x bf16, W E4M3-valued: ≤ 12
// significant bits). The per-call checks keep every product ≥ 2^-115 in
// magnitude, so the products and all partial sums are multiples of 2^-126
// (never subnormal). Inputs where that cannot be proven take the reference
// loop.
func (p *FP8Panels) LinearPlain(y, x []float32) {
	if len(x) != p.Cols || len(y) != p.Rows {
		panic("attention: FP8Panels.LinearPlain shape mismatch")
	}
	p.apply(y, x, nil)
}

// apply computes y from the activation x: with sx, FP8Linear's blockwise form
// (x = qx, the quantised activation, s_b = sx[b]); with sx == nil,
// LinearPlain's single sum.
func (p *FP8Panels) apply(y, x, sx []float32) {
	j := p.job(y, x, sx, nil, runtime.GOMAXPROCS(0))
	parallelFor(j.items(), p.Rows*p.Cols, j.run)
	j.release()
}

// fp8Job is one product of an FP8Panels weight, checked once, computed item
// by item (run), so that several products can share one parallelFor. An
// item is a panel, or, when the weight has too few panels for the
// goroutines (ng > 1, blockwise form only), a group of its 128-column blocks.
type fp8Job struct {
	p        *FP8Panels
	y, x, sx []float32
	xs       []float32 // blockwise, assembly: x·2^fp8ActExp
	np, cb   int
	asm      bool
	avx512   bool           // asm in the kernels' AVX-512 forms (useAVX512)
	scl      []float32      // [row block][cb] the kernel's per-block factors
	ok       []bool         // [row block] the kernel's factoring is proven there
	ng       int            // block groups per panel
	terms    []float32      // [np][cb][64] block terms when ng > 1
	left     []atomic.Int32 // [np] groups of each panel still running
	lo, hi   []float64      // plain: each block's smallest nonzero and largest |x|
	xsBuf    []float32      // xs when the caller has none
}

// fp8LaneRow is the FP8 kernels' output layout: their y[p] (and block
// terms t[b][p]) is the panel's row fp8LaneRow[p] = 16(a/2) + 2i + a%2
// for p = 8a + i — accumulator 2g holds the even rows of the 16-row group
// g, accumulator 2g+1 the odd ones (kernels_fast_amd64.s, "Lane layout").
var fp8LaneRow = func() (r [PanelRows]uint8) {
	for p := range r {
		a, i := p/8, p%8
		r[p] = uint8(16*(a/2) + 2*i + a%2)
	}
	return r
}()

// jobPool holds released jobs with their per-call arrays (scl, ok, terms,
// left, lo, hi), so that a GEMV call allocates nothing once it is warm.
var jobPool sync.Pool

// job checks one product (xs: x·2^100 when the caller has it, else nil).
func (p *FP8Panels) job(y, x, sx, xs []float32, workers int) *fp8Job {
	cb := p.Cols / ActBlock
	nrb := (p.Rows + 127) / 128
	j, _ := jobPool.Get().(*fp8Job)
	if j == nil {
		j = new(fp8Job)
	}
	*j = fp8Job{p: p, y: y, x: x, sx: sx, xs: xs, np: (p.Rows + PanelRows - 1) / PanelRows, cb: cb, asm: useAsm() && p.exact, ng: 1,
		scl: j.scl, ok: j.ok, terms: j.terms, left: j.left, lo: j.lo, hi: j.hi, xsBuf: j.xsBuf}
	j.asm = j.asm && len(p.Sub) == j.np*p.Cols/64
	if sx != nil {
		j.asm = j.asm && normalPow2s(sx)
	} else if j.asm {
		// plain: the smallest nonzero and the largest |x| of each 128-block,
		// so that x[k]·2^(e_b+104) is checked per block, not per element
		j.lo, j.hi = grow(j.lo, cb), grow(j.hi, cb)
		lo, hi := j.lo, j.hi
		for b := range cb {
			var ok bool
			lo[b], hi[b], ok = plainBlockRange(x[b*ActBlock : (b+1)*ActBlock])
			j.asm = j.asm && ok
		}
	}
	if !j.asm {
		return j
	}
	j.avx512 = useAVX512()
	j.scl, j.ok = grow(j.scl, nrb*cb), grow(j.ok, nrb)
	if sx != nil {
		// block sums of (qx·2^84)·(E4M3·2^-104) = qx·E4M3·2^-20 (multiples
		// of 2^-38, |sum| < 2^5), scaled back by 2^(e+20)·s_b: terms in
		// [2^-118, 2^85]. s_b = ±2^x_b (normalPow2s) and e in [-90, 100]
		// (exact), so the factor is ±2^(e+20+x_b), a normal float exactly
		// when that exponent is: the range is tested on the exponents (the
		// float test, |Pow2(e+20)·s_b| in float64 against 2^±80, cost
		// 2.4 µs a call for indexer.wq_b's 512 blocks)
		for rb := range nrb {
			srow, scl := p.Scale[rb*cb:(rb+1)*cb], j.scl[rb*cb:(rb+1)*cb]
			ok := true
			for b, c := range srow {
				e := int(c) - 127
				f := e + 20 + int(math.Float32bits(sx[b])>>23&0xff) - 127
				ok = ok && f >= -80 && f <= 80
				scl[b] = quant.Pow2(e+20) * sx[b]
			}
			j.ok[rb] = ok
		}
	} else {
		for rb := range nrb {
			srow, scl := p.Scale[rb*cb:(rb+1)*cb], j.scl[rb*cb:(rb+1)*cb]
			ok := true
			for b := 0; ok && b < cb; b++ {
				// x[k]·2^(e+104) and, for the rows without subnormal codes
				// (v = E4M3·2^-120), x[k]·2^(e+120) must be normal, and every
				// product x·W at least 2^-115 (x·2^(e+104) times the smallest
				// nonzero v, 2^-113): |x·2^(e+104)| in [2^-2, 2^110]
				e := int(srow[b]) - 127
				ok = e+120 <= 127
				if ok {
					scl[b] = quant.Pow2(e - fp8WidenExp)
					f := float64(scl[b])
					ok = j.hi[b] == 0 || (j.lo[b]*f >= 0x1p-2 && j.hi[b]*f <= 0x1p110)
				}
			}
			j.ok[rb] = ok
		}
	}
	if sx != nil {
		if j.xs == nil { // Linear passes quantizeActFast's xs
			j.xsBuf = grow(j.xsBuf, len(x))
			j.xs = j.xsBuf
			for k, v := range x {
				j.xs[k] = v * fp8ActScale // exact: qx is an E4M3 value
			}
		}
		// a weight with fewer than 4 panels per goroutine has its blocks
		// split too, in groups of at least 4 blocks (32 KiB of codes), into
		// about 8 items per goroutine. (Below 8 panels per goroutine, the
		// rule until round 8, split wkv's 8 panels at 2 threads: on a
		// 2-core Zen 5 that took 70-74 µs a call against 57-62 µs unsplit.)
		if workers > 1 && p.Rows*p.Cols >= 1<<16 && j.np < 4*workers {
			j.ng = max(1, min(cb/4, (8*workers+j.np-1)/j.np))
		}
		if j.ng > 1 {
			j.terms = grow(j.terms, j.np*cb*PanelRows)
			j.left = grow(j.left, j.np)
			for i := range j.left {
				j.left[i].Store(int32(j.ng))
			}
		}
	}
	return j
}

// items is the number of work items of run.
func (j *fp8Job) items() int { return j.np * j.ng }

// release returns the job, with its arrays, to jobPool; j must not be used
// after it.
func (j *fp8Job) release() {
	j.p, j.y, j.x, j.sx, j.xs = nil, nil, nil, nil, nil
	jobPool.Put(j)
}

// run computes the work items ilo … ihi−1.
func (j *fp8Job) run(ilo, ihi int) {
	p, y, cb := j.p, j.y, j.cb
	var tmp [PanelRows]float32
	for i := ilo; i < ihi; i++ {
		pi, g := i/j.ng, i%j.ng
		n0 := pi * PanelRows
		rb := n0 / 128
		panel := p.Codes[pi*p.Cols*PanelRows : (pi+1)*p.Cols*PanelRows]
		if !j.asm || !j.ok[rb] {
			if g == 0 {
				j.reference(pi)
			}
			continue
		}
		scl := j.scl[rb*cb : (rb+1)*cb]
		sub := p.Sub[pi*p.Cols/64 : (pi+1)*p.Cols/64]
		switch {
		case j.sx == nil && j.avx512:
			fp8PlainPanel64AVX512(&tmp[0], &panel[0], &j.x[0], &scl[0], &sub[0], cb)
		case j.sx == nil:
			fp8PlainPanel64AVX2(&tmp[0], &panel[0], &j.x[0], &scl[0], &sub[0], cb)
		case j.ng == 1 && j.avx512:
			fp8Panel64AVX512(&tmp[0], &panel[0], &j.xs[0], &scl[0], &sub[0], cb)
		case j.ng == 1:
			fp8Panel64AVX2(&tmp[0], &panel[0], &j.xs[0], &scl[0], &sub[0], cb)
		default:
			b0, b1 := g*cb/j.ng, (g+1)*cb/j.ng
			switch {
			case b1 > b0 && j.avx512:
				fp8Terms64AVX512(&j.terms[(pi*cb+b0)*PanelRows], &panel[b0*ActBlock*PanelRows], &j.xs[b0*ActBlock], &scl[b0], &sub[b0*ActBlock/64], b1-b0)
			case b1 > b0:
				fp8Terms64AVX2(&j.terms[(pi*cb+b0)*PanelRows], &panel[b0*ActBlock*PanelRows], &j.xs[b0*ActBlock], &scl[b0], &sub[b0*ActBlock/64], b1-b0)
			}
			if j.left[pi].Add(-1) != 0 {
				continue // another group of this panel adds the terms
			}
			sumTerms64AVX2(&tmp[0], &j.terms[pi*cb*PanelRows], cb)
		}
		for l, r := range fp8LaneRow {
			if n0+int(r) < p.Rows {
				y[n0+int(r)] = quant.BF16Round(tmp[l])
			}
		}
	}
}

// referencePanels counts the panels FP8Panels products computed with the
// reference loop (ReferencePanels).
var referencePanels atomic.Int64

// ReferencePanels is the number of 64-row panels that FP8Panels.Linear,
// LinearPlain and WoAPanels.WoA have computed with the reference loop
// instead of the kernels since the process started (inputs outside the
// kernels' proven range: NaN codes, extreme scales or activations). The bits
// are the same either way, but the reference is ~20× slower: a test or a
// benchmark whose inputs the kernels cover checks that it does not grow.
func ReferencePanels() int64 { return referencePanels.Load() }

// reference computes the rows of panel pi with the reference loops on the
// rows' exact dequantisation.
func (j *fp8Job) reference(pi int) {
	referencePanels.Add(1)
	p, x, sx, y, cb := j.p, j.x, j.sx, j.y, j.cb
	n0 := pi * PanelRows
	rb := n0 / 128
	srow := p.Scale[rb*cb : (rb+1)*cb]
	row, codes := make([]float32, p.Cols), make([]uint8, p.Cols)
	for l := 0; l < PanelRows && n0+l < p.Rows; l++ {
		p.rowCodes(codes, n0+l)
		quant.DequantFP8Weight(row, codes, srow, 1, p.Cols)
		if sx == nil {
			y[n0+l] = quant.BF16Round(dot(x, row))
			continue
		}
		var acc float32
		for b, s := range sx {
			var blk float32
			for k := b * ActBlock; k < (b+1)*ActBlock; k++ {
				blk += float32(x[k] * row[k])
			}
			acc += float32(blk * s)
		}
		y[n0+l] = quant.BF16Round(acc)
	}
}

// EncodeFP8Blocks re-encodes W [rows, cols] (cols a multiple of 128) as E4M3
// codes with one UE8M0 scale per 128×128 block, when that is lossless: every
// W[n,k] equals E4M3(code)·2^(scale−127) exactly (true of wo_a, which
// convert.py dequantises from the checkpoint's FP8). Each block takes the
// smallest scale 2^e with amax ≤ 448·2^e. ok is false when some value is not
// representable.
func EncodeFP8Blocks(W []float32, rows, cols int) (codes, scale []uint8, ok bool) {
	if rows <= 0 || cols <= 0 || cols%ActBlock != 0 || len(W) != rows*cols {
		panic("attention: EncodeFP8Blocks shape mismatch")
	}
	br, bc := (rows+127)/128, cols/128
	codes, scale = make([]uint8, rows*cols), make([]uint8, br*bc)
	for bi := 0; bi < br; bi++ {
		for bj := 0; bj < bc; bj++ {
			var amax float32
			for n := bi * 128; n < min(rows, bi*128+128); n++ {
				for _, v := range W[n*cols+bj*128 : n*cols+bj*128+128] {
					if v != v || math.IsInf(float64(v), 0) {
						return nil, nil, false
					}
					amax = max(amax, abs32(v))
				}
			}
			e := 0
			if amax > 0 {
				e = quant.Ceil2Exp(amax / quant.E4M3Max)
			}
			if e < -126 || e > 126 || quant.Pow2(e)*quant.E4M3Max < amax {
				return nil, nil, false
			}
			scale[bi*bc+bj] = uint8(e + 127)
			s := quant.Pow2(e)
			for n := bi * 128; n < min(rows, bi*128+128); n++ {
				for k := bj * 128; k < bj*128+128; k++ {
					v := W[n*cols+k]
					c := quant.EncodeE4M3(v / s)
					if quant.DecodeE4M3(c)*s != v || v/s*s != v {
						return nil, nil, false
					}
					codes[n*cols+k] = c
				}
			}
		}
	}
	// the reference dequantisation must give back W bit for bit
	dq := make([]float32, rows*cols)
	quant.DequantFP8Weight(dq, codes, scale, rows, cols)
	for i, v := range dq {
		if math.Float32bits(v) != math.Float32bits(W[i]) {
			return nil, nil, false
		}
	}
	return codes, scale, true
}

// plainBlockRange returns the smallest nonzero magnitude (+Inf when there
// is none) and the largest magnitude of the values v, and whether every v
// is a bf16 value (quant.BF16Round(v) == v: low 16 bits zero, not NaN). On
// the bits: magnitudes of non-NaN fp32 values order as their bit patterns,
// and a NaN's are above +Inf's, so with a = bits & 0x7FFFFFFF the range is
// min(a−1)+1 (a zero wraps to the largest value) and max a, and there is a
// NaN exactly when max a > 0x7F800000. An integer loop (≈ 10× faster than
// the float64 form), 8 lanes at a time in assembly (plainRangeAVX2: the
// scalar loop over wo_a's 8 × 4096 inputs took ≈ 30 µs a call, serially
// before the parallel part); the result is used only when every v passed.
func plainBlockRange(v []float32) (lo, hi float64, ok bool) {
	var lom, him, low uint32
	if useAsm() && len(v) > 0 && len(v)%8 == 0 {
		lom, him, low = plainRangeAVX2(&v[0], len(v))
	} else {
		lom, him, low = plainRangeGo(v)
	}
	lo = math.Inf(1)
	if lom != math.MaxUint32 {
		lo = float64(math.Float32frombits(lom + 1))
	}
	return lo, float64(math.Float32frombits(him)), low&0xffff == 0 && him <= 0x7f800000
}

// plainRangeGo is plainRangeAVX2 in Go: lom = min(a−1), him = max a, low =
// OR a over a = bits(v[i]) & 0x7FFFFFFF.
func plainRangeGo(v []float32) (lom, him, low uint32) {
	lom = math.MaxUint32
	for _, f := range v {
		a := math.Float32bits(f) & 0x7fffffff
		low |= a
		lom = min(lom, a-1)
		him = max(him, a)
	}
	return lom, him, low
}

func isNormal(f float32) bool {
	e := math.Float32bits(f) >> 23 & 0xff
	return e != 0 && e != 0xff
}

// normalPow2s reports whether every s is a finite, normal power of two.
func normalPow2s(s []float32) bool {
	for _, v := range s {
		if !isNormal(v) || math.Float32bits(v)&0x7fffff != 0 {
			return false
		}
	}
	return true
}
