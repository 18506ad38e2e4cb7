package attention

import (
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"sparsemla/quant"
)

// eachPath runs f with the assembly kernels in their AVX-512 forms (when this
// machine has them; the FP8 kernels' rows with a subnormal code both ways,
// DEC64V where the CPU has VBMI and DEC64Z), in their AVX2 forms, and with
// the pure-Go lane loops, at
// GOMAXPROCS 1, 2 and 16 (the work split of the fast paths depends on it; the
// results must not).
func eachPath(t *testing.T, f func(t *testing.T)) {
	t.Helper()
	old, old512, oldProcs, oldVBMI := UseAssembly, UseAVX512, runtime.GOMAXPROCS(0), fp8VBMI
	defer func() { UseAssembly, UseAVX512, fp8VBMI = old, old512, oldVBMI; runtime.GOMAXPROCS(oldProcs) }()
	for _, path := range []string{"avx512", "avx512-dec64z", "asm", "go"} {
		if strings.HasPrefix(path, "avx512") && !HasAVX512() {
			t.Log("no AVX-512 on this machine/build: its kernels not run")
			continue
		}
		// avx512: DEC64V where the CPU has VBMI (else DEC64Z: the next
		// form is then the same and is skipped)
		fp8VBMI = boolByte(hasVBMI && path == "avx512")
		if path == "avx512-dec64z" && !hasVBMI {
			continue
		}
		if path == "asm" && !HasAssembly() {
			t.Log("no AVX2 kernels on this machine/build: testing the pure-Go path only")
			continue
		}
		for _, procs := range []int{1, 2, 16} {
			UseAssembly, UseAVX512 = path != "go", strings.HasPrefix(path, "avx512")
			runtime.GOMAXPROCS(procs)
			t.Run(fmt.Sprintf("%s/P%d", path, procs), f)
		}
	}
}

func sameBits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	bad := 0
	for i := range got {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			if bad < 5 {
				t.Errorf("%s[%d] = %g (%08x), reference %g (%08x)", what, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%s: %d of %d values differ from the reference", what, bad, len(got))
	}
}

func bf16Vec(rng *rand.Rand, n int, sd float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = quant.BF16Round(float32(rng.NormFloat64() * sd))
	}
	return v
}

// randFP8 makes an FP8 weight whose 128×128 blocks have scales spread over
// several binades (so the per-block factors matter).
func randFP8(rng *rand.Rand, rows, cols int) *FP8Weight {
	W := make([]float32, rows*cols)
	for n := 0; n < rows; n++ {
		for k := 0; k < cols; k++ {
			blk := (n/128)*7 + k/128
			W[n*cols+k] = quant.BF16Round(float32(rng.NormFloat64() * math.Ldexp(1, blk%9-6)))
		}
	}
	return QuantizeFP8Weight(W, rows, cols)
}

func TestFP8PanelsEqualFP8Linear(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	cases := []struct{ rows, cols int }{{64, 128}, {200, 384}, {512, 1024}, {1, 256}}
	ws := make([]*FP8Weight, len(cases))
	for i, c := range cases {
		ws[i] = randFP8(rng, c.rows, c.cols)
	}
	xs := make([][]float32, len(cases))
	for i, c := range cases {
		xs[i] = bf16Vec(rng, c.cols, 3)
		xs[i][5] = 0
		if c.cols > 200 {
			for k := 128; k < 256; k++ { // a block of tiny activations: small block scale
				xs[i][k] *= 1e-6
			}
		}
	}
	eachPath(t, func(t *testing.T) {
		for i, w := range ws {
			want := make([]float32, w.Rows)
			FP8Linear(want, xs[i], w)
			p := PackFP8Weight(w)
			if !p.exact {
				t.Fatalf("case %d: ordinary weight not marked exact", i)
			}
			got := make([]float32, w.Rows)
			p.Linear(got, xs[i])
			sameBits(t, "y", got, want)
		}
	})
}

// TestFP8WidenAllCodes: the kernels' widening of every finite E4M3 code is
// E4M3·2^-104 exactly and a normal fp32 value (or ±0) — never an fp32
// subnormal — in Go (fp8WidenBits) and in the assembly (fp8Widen64AVX2).
func TestFP8WidenAllCodes(t *testing.T) {
	normal, zero := 0, 0
	for c := 0; c < 256; c++ {
		if c&0x7f == 0x7f {
			continue // NaN codes never reach the kernels (FP8Panels.exact)
		}
		got := fp8WidenBits(uint8(c))
		want := math.Float32bits(quant.DecodeE4M3(uint8(c)) * 0x1p-104)
		if got != want {
			t.Errorf("code %#02x: widened to %08x, want %08x (E4M3·2^-104)", c, got, want)
		}
		switch e := got >> 23 & 0xff; {
		case got&0x7fffffff == 0:
			zero++
		case e == 0 || e == 0xff:
			t.Errorf("code %#02x: widened to %08x, not a normal fp32 value", c, got)
		default:
			normal++
		}
	}
	if normal != 252 || zero != 2 {
		t.Errorf("%d normal and %d zero widenings, want 252 and 2", normal, zero)
	}
	if !HasAssembly() {
		t.Skip("no AVX2 kernels on this machine/build")
	}
	codes := make([]uint8, 256)
	for c := range codes {
		codes[c] = uint8(c)
	}
	// also in a scrambled order: every lane position sees every code
	rng := rand.New(rand.NewPCG(20, 21))
	perm := append([]uint8(nil), codes...)
	rng.Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
	for _, cs := range [][]uint8{codes, perm} {
		v := make([]float32, 256)
		for i := 0; i < 256; i += 64 {
			var stored [PanelRows]uint8 // as PackFP8 stores a row with a subnormal code
			for l := range stored {
				stored[fp8StoredLane(true, l)] = cs[i+l]
			}
			fp8Widen64AVX2(&v[i], &stored[0])
		}
		for i := range cs {
			// v is in the kernels' lane layout: position i of each 64 holds row fp8LaneRow[i%64]
			c := cs[i/64*64+int(fp8LaneRow[i%64])]
			if c&0x7f != 0x7f && math.Float32bits(v[i]) != fp8WidenBits(c) {
				t.Errorf("lane %d, code %#02x: assembly widened to %08x, want %08x", i%64, c, math.Float32bits(v[i]), fp8WidenBits(c))
			}
		}
	}
}

// codesWeight makes an FP8 weight from codes drawn by code(n, k) and random
// scales 2^[-12, -7] (a checkpoint's range).
func codesWeight(rng *rand.Rand, rows, cols int, code func(n, k int) uint8) *FP8Weight {
	codes := make([]uint8, rows*cols)
	for n := 0; n < rows; n++ {
		for k := 0; k < cols; k++ {
			codes[n*cols+k] = code(n, k)
		}
	}
	scale := make([]uint8, ((rows+127)/128)*((cols+127)/128))
	for i := range scale {
		scale[i] = uint8(127 - 12 + rng.IntN(6))
	}
	return NewFP8Weight(codes, scale, rows, cols)
}

// TestFP8PanelsAllCodes: weights that use all 254 finite codes (in every
// lane, in every position), uniform random codes, the worst case — every
// code an E4M3 subnormal (±m·2^-9) — blocks with an outlier and a
// checkpoint-like weight give the reference's bits in both forms (Linear
// and LinearPlain), through both widenings (rows with and without
// subnormal codes), with the block split of small weights (GOMAXPROCS 16)
// and without.
func TestFP8PanelsAllCodes(t *testing.T) {
	rng := rand.New(rand.NewPCG(22, 23))
	finite := func(c uint8) uint8 {
		if c&0x7f == 0x7f {
			return c ^ 1
		}
		return c
	}
	type wcase struct {
		name string
		w    *FP8Weight
	}
	var cases []wcase
	for _, sh := range []struct{ rows, cols int }{{256, 1024}, {200, 384}, {64, 4096}, {1, 256}} {
		cases = append(cases,
			wcase{fmt.Sprintf("all codes %dx%d", sh.rows, sh.cols), codesWeight(rng, sh.rows, sh.cols, func(n, k int) uint8 { return finite(uint8(n*37 + k)) })},
			wcase{fmt.Sprintf("uniform %dx%d", sh.rows, sh.cols), codesWeight(rng, sh.rows, sh.cols, func(n, k int) uint8 { return finite(uint8(rng.Uint32())) })},
			wcase{fmt.Sprintf("subnormal %dx%d", sh.rows, sh.cols), codesWeight(rng, sh.rows, sh.cols, func(n, k int) uint8 { return uint8(rng.IntN(8)) | uint8(rng.IntN(2))<<7 })})
	}
	// a realistic weight with one outlier per 128×128 block: most codes of
	// the block are then subnormal
	ow := make([]float32, 256*512)
	for i := range ow {
		ow[i] = quant.BF16Round(float32(rng.NormFloat64() * 0.01))
		if i%(128*128+3) == 7 {
			ow[i] = 40
		}
	}
	cases = append(cases, wcase{"outlier blocks", QuantizeFP8Weight(ow, 256, 512)})
	// a checkpoint-like weight (normal samples, block scales): most panel
	// rows hold no subnormal code and take the plain widening
	cases = append(cases, wcase{"checkpoint", randFP8(rng, 256, 1024)})
	var flagged, rows int
	for _, c := range cases {
		for _, w := range PackFP8Weight(c.w).Sub {
			flagged += bits.OnesCount64(w)
		}
		rows += (c.w.Rows + PanelRows - 1) / PanelRows * c.w.Cols
	}
	if flagged == 0 || flagged == rows {
		t.Fatalf("%d of %d panel rows flagged: both widenings must be exercised", flagged, rows)
	}
	xs := map[int][]float32{}
	for _, c := range cases {
		if xs[c.w.Cols] == nil {
			xs[c.w.Cols] = bf16Vec(rng, c.w.Cols, 2)
		}
	}
	eachPath(t, func(t *testing.T) {
		for _, c := range cases {
			p := PackFP8Weight(c.w)
			if !p.exact {
				t.Fatalf("%s: not marked exact", c.name)
			}
			x := xs[c.w.Cols]
			want, got := make([]float32, c.w.Rows), make([]float32, c.w.Rows)
			FP8Linear(want, x, c.w)
			p.Linear(got, x)
			sameBits(t, c.name+": Linear", got, want)
			BF16Linear(want, x, c.w.W, c.w.Rows, c.w.Cols)
			p.LinearPlain(got, x)
			sameBits(t, c.name+": LinearPlain", got, want)
		}
	})
}

// TestFP8PanelsNoSubnormals runs the FP8 kernels with the thread's MXCSR set
// to denormals-are-zero and flush-to-zero: any fp32 subnormal a kernel read
// (a subnormal code widened to a subnormal fp32, in a row routed to the wrong
// widening) or produced (a product or partial sum) would then change the
// result. Every output must still be the reference's, computed normally.
// Both forms, the block split (job with 16 workers, run on this thread) and
// every weight of TestFP8PanelsAllCodes' kind are covered.
func TestFP8PanelsNoSubnormals(t *testing.T) {
	if !HasAssembly() {
		t.Skip("no AVX2 kernels on this machine/build")
	}
	rng := rand.New(rand.NewPCG(24, 25))
	ws := []*FP8Weight{
		codesWeight(rng, 256, 1024, func(n, k int) uint8 { return uint8(rng.IntN(8)) | uint8(rng.IntN(2))<<7 }),
		codesWeight(rng, 128, 4096, func(n, k int) uint8 {
			if c := uint8(rng.Uint32()); c&0x7f != 0x7f {
				return c
			}
			return 1
		}),
		randFP8(rng, 256, 1024),
	}
	x := bf16Vec(rng, 4096, 2)
	old, old512, oldVBMI := UseAssembly, UseAVX512, fp8VBMI
	defer func() { UseAssembly, UseAVX512, fp8VBMI = old, old512, oldVBMI }()
	UseAssembly = true
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for _, form := range []string{"avx512-vbmi", "avx512", "avx2"} {
		z := form != "avx2"
		if z && !HasAVX512() || form == "avx512-vbmi" && !hasVBMI {
			t.Logf("no %s on this CPU: its FP8 kernels not run", form)
			continue
		}
		UseAVX512, fp8VBMI = z, boolByte(form == "avx512-vbmi")
		for i, w := range ws {
			xw := x[:w.Cols]
			want, wantPlain := make([]float32, w.Rows), make([]float32, w.Rows)
			FP8Linear(want, xw, w)
			BF16Linear(wantPlain, xw, w.W, w.Rows, w.Cols)
			qx, sx := make([]float32, w.Cols), make([]float32, w.Cols/ActBlock)
			quant.QuantizeActFP8(qx, sx, xw, ActBlock)
			p := PackFP8Weight(w)
			got, split, plain := make([]float32, w.Rows), make([]float32, w.Rows), make([]float32, w.Rows)
			csr := getMXCSR()
			setMXCSR(csr | 0x8040) // FTZ | DAZ
			j := p.job(got, qx, sx, nil, 1)
			j.run(0, j.items())
			js := p.job(split, qx, sx, nil, 16)
			js.run(0, js.items())
			jp := p.job(plain, xw, nil, nil, 1)
			jp.run(0, jp.items())
			setMXCSR(csr)
			if !j.asm || !jp.asm || js.ng < 2 || j.avx512 != z || js.avx512 != z || jp.avx512 != z {
				t.Fatalf("weight %d: the kernels did not run (asm %v %v, AVX-512 %v %v %v, want %v, groups %d)", i, j.asm, jp.asm, j.avx512, js.avx512, jp.avx512, z, js.ng)
			}
			js.release()
			what := fmt.Sprintf("weight %d (AVX-512 %v)", i, z)
			sameBits(t, what+" Linear", got, want)
			sameBits(t, what+" Linear, blocks split", split, want)
			sameBits(t, what+" LinearPlain", plain, wantPlain)
		}
	}
}

// TestQuantizeActFast: the fast activation quantiser (assembly and Go) gives
// quant.QuantizeActFP8's bits on every float32 magnitude up to 2^9 on a
// grid of 2^8 bit patterns (and the midpoints of the E4M3 grid ± 1 ulp),
// and on random blocks at block scales from 2^-120 to 2^120 with zeros,
// signed zeros, subnormals, infinities and NaNs.
func TestQuantizeActFast(t *testing.T) {
	var cases [][]float32
	var names []string
	check := func(what string, x []float32) { cases, names = append(cases, x), append(names, what) }
	// element rounding: blocks whose largest value is 448 (scale 1), the
	// other 127 values the grid points, midpoints and their neighbours
	var vals []float32
	for b := uint32(0); b <= 0x44000000; b += 1 << 8 {
		vals = append(vals, math.Float32frombits(b))
	}
	for c := 0; c < 0x7f; c++ {
		lo, hi := quant.DecodeE4M3(uint8(c)), quant.DecodeE4M3(uint8(c+1))
		m := (lo + hi) / 2
		vals = append(vals, m, math.Nextafter32(m, 0), math.Nextafter32(m, 1000))
	}
	x := make([]float32, 0, len(vals)/127*128+128)
	for i, v := range vals {
		if i%127 == 0 {
			x = append(x, 448)
		}
		if i%2 == 1 {
			v = -v
		}
		x = append(x, v)
	}
	for len(x)%ActBlock != 0 {
		x = append(x, 0)
	}
	check("grid", x)
	rng := rand.New(rand.NewPCG(26, 27))
	for _, e := range []int{-120, -101, -100, -40, -9, -1, 0, 3, 50, 100, 101, 120} {
		x := make([]float32, 8*ActBlock)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * math.Ldexp(1, e))
		}
		x[3], x[4], x[5] = 0, float32(math.Copysign(0, -1)), 1e-45
		x[ActBlock+7] = float32(math.Inf(-1))
		x[2*ActBlock+9] = float32(math.NaN())
		for i := 3 * ActBlock; i < 4*ActBlock; i++ {
			x[i] = math.Float32frombits(rng.Uint32() & 0x807fffff) // subnormals
		}
		check(fmt.Sprintf("random 2^%d", e), x)
	}
	eachPath(t, func(t *testing.T) {
		for i, x := range cases {
			want, got := make([]float32, len(x)), make([]float32, len(x))
			ws, gs := make([]float32, len(x)/ActBlock), make([]float32, len(x)/ActBlock)
			quant.QuantizeActFP8(want, ws, x, ActBlock)
			xs := make([]float32, len(x))
			quantizeActFast(got, gs, xs, x)
			sameBits(t, names[i]+": q", got, want)
			sameBits(t, names[i]+": s", gs, ws)
			for k := range want {
				want[k] *= 0x1p100
			}
			sameBits(t, names[i]+": xs", xs, want)
		}
	})
}

// TestFP8PanelsSpecial: NaN codes, extreme scales and non-finite activations
// take the reference loop and still agree bit for bit.
func TestFP8PanelsSpecial(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	nan := randFP8(rng, 128, 256)
	nan.Codes[77*256+3] = 0x7f
	quant.DequantFP8Weight(nan.W, nan.Codes, nan.Scale, 128, 256)
	big := randFP8(rng, 128, 256)
	big.Scale[1] = 127 + 110 // 2^110: outside the kernel's proven range
	quant.DequantFP8Weight(big.W, big.Codes, big.Scale, 128, 256)
	x := bf16Vec(rng, 256, 1)
	xinf := append([]float32(nil), x...)
	xinf[9] = float32(math.Inf(1))
	eachPath(t, func(t *testing.T) {
		for _, c := range []struct {
			name string
			w    *FP8Weight
			x    []float32
		}{{"nan code", nan, x}, {"big scale", big, x}, {"inf x", randFP8(rand.New(rand.NewPCG(5, 5)), 128, 256), xinf}} {
			want := make([]float32, c.w.Rows)
			FP8Linear(want, c.x, c.w)
			got := make([]float32, c.w.Rows)
			PackFP8Weight(c.w).Linear(got, c.x)
			sameBits(t, c.name, got, want)
		}
	})
	if PackFP8Weight(nan).exact || PackFP8Weight(big).exact {
		t.Fatal("a NaN code or an extreme scale left the weight marked exact")
	}
}

func TestPanelsEqualLinears(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 7))
	const rows, cols = 130, 300
	bf := bf16Vec(rng, rows*cols, 0.05)
	f32 := make([]float32, rows*cols)
	for i := range f32 {
		f32[i] = float32(rng.NormFloat64() * 0.05) // not bf16 values: stored fp32
	}
	x := bf16Vec(rng, cols, 1)
	xf := make([]float32, cols)
	for i := range xf {
		xf[i] = float32(rng.NormFloat64())
	}
	eachPath(t, func(t *testing.T) {
		for _, W := range [][]float32{bf, f32} {
			p := PackPanels(W, rows, cols)
			if (p.BF16 != nil) != (&W[0] == &bf[0]) {
				t.Fatal("PackPanels chose the wrong storage")
			}
			for _, in := range [][]float32{x, xf} {
				want, got := make([]float32, rows), make([]float32, rows)
				F32Linear(want, in, W, rows, cols)
				p.Dot(got, in)
				sameBits(t, "Dot", got, want)
				BF16Linear(want, in, W, rows, cols)
				p.Linear(got, in)
				sameBits(t, "Linear", got, want)
			}
		}
	})
}

func TestWoAPanelsEqualWoA(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	const G, R, gd = 4, 128, 256
	bf := bf16Vec(rng, G*R*gd, 0.05) // not FP8-representable: bf16 panels
	fp8 := randFP8(rng, G*R, gd).W   // dequantised FP8, as convert.py makes wo_a: FP8 panels
	o := bf16Vec(rng, G*gd, 1)
	oOdd := append([]float32(nil), o...) // a non-bf16 input: the FP8 path must fall back
	oOdd[3] = 1.0000001
	oTiny := append([]float32(nil), o...) // a value whose scaled copy leaves the kernel range
	oTiny[7] = 0x1p-120
	if w := PackWoA(bf, G, R, gd); w.FP8 != nil {
		t.Fatal("random bf16 wo_a packed as FP8")
	}
	if w := PackWoA(fp8, G, R, gd); w.FP8 == nil || w.Bytes() != int64(G*R*gd+G*((R+127)/128)*(gd/128)+G*8*((R+63)/64)*(gd/64)) {
		t.Fatal("FP8-derived wo_a not packed as FP8 codes")
	}
	eachPath(t, func(t *testing.T) {
		for _, woa := range [][]float32{bf, fp8} {
			p := PackWoA(woa, G, R, gd)
			for _, in := range [][]float32{o, oOdd, oTiny} {
				want, got := make([]float32, G*R), make([]float32, G*R)
				WoA(want, in, woa, G, R)
				p.WoA(got, in)
				sameBits(t, "u", got, want)
			}
		}
	})
}

func TestEncodeFP8Blocks(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 13))
	w := randFP8(rng, 200, 256)
	codes, scale, ok := EncodeFP8Blocks(w.W, 200, 256)
	if !ok {
		t.Fatal("an FP8-derived weight did not re-encode")
	}
	dq := make([]float32, len(w.W))
	quant.DequantFP8Weight(dq, codes, scale, 200, 256)
	sameBits(t, "dequantised", dq, w.W)
	w.W[5] = quant.BF16Round(w.W[5] * 1.01) // one bf16 value off the E4M3 grid
	if _, _, ok := EncodeFP8Blocks(w.W, 200, 256); ok && quant.E4M3(w.W[5]) != w.W[5] {
		t.Fatal("a value off the E4M3 grid re-encoded")
	}
}

func TestSparseAttnFastEqualsReference(t *testing.T) {
	defer PoisonBufPools(PoisonBufPools(true)) // a pooled value read before it is written: NaN
	eachPath(t, func(t *testing.T) {
		for _, c := range []struct{ heads, rows, L int }{{64, 700, 640}, {4, 300, 150}, {70, 200, 64}, {8, 50, 13}, {13, 90, 77}} {
			q, kv, idx, sink := attnCase(uint64(c.heads*c.L), c.heads, c.rows, c.L)
			if c.L > 20 {
				// −1 entries between valid keys too: the kernel's groups of
				// four keys skip them, whatever the goroutine split
				for i := 1; i < c.L; i += 7 {
					idx[i] = -1
				}
			}
			want, got := make([]float32, len(q)), make([]float32, len(q))
			lw := SparseAttn(want, q, kv, 512, idx, sink, 0.044194173)
			lg := SparseAttnFast(got, q, kv, 512, idx, sink, 0.044194173)
			sameBits(t, "o", got, want)
			sameBits(t, "lse", lg, lw)
		}
	})
}

// scoreRef is indexer.IndexQK + IndexScore (the indexer imports this package,
// so the engine tests compare against the indexer itself as well).
func scoreRef(iq, icache, w []float32, heads, hd int) []float32 {
	tc := len(icache) / hd
	score := make([]float32, tc)
	for j := range score {
		var sum float32
		for h := 0; h < heads; h++ {
			d := quant.BF16Round(dot(iq[h*hd:(h+1)*hd], icache[j*hd:(j+1)*hd]))
			sum += quant.BF16Round(max(d, 0) * w[h])
		}
		score[j] = quant.BF16Round(sum)
	}
	return score
}

func TestIndexScoresFastEqualsReference(t *testing.T) {
	defer PoisonBufPools(PoisonBufPools(true)) // a pooled value read before it is written: NaN
	rng := rand.New(rand.NewPCG(10, 11))
	const hd = 128
	mk := func(heads, tc int) (iq, ic, w []float32) {
		iq, ic, w = bf16Vec(rng, heads*hd, 1), bf16Vec(rng, tc*hd, 1), bf16Vec(rng, heads, 0.1)
		quant.FQ4(iq, 32)
		quant.FQ4(ic, 32)
		return
	}
	iq64, ic64, w64 := mk(64, 1000)
	iq4, ic4, w4 := mk(4, 77)
	// non-finite rows: a NaN key, a huge key (inf dot products)
	icNaN := append([]float32(nil), ic64...)
	icNaN[5*hd+3] = float32(math.NaN())
	for k := 0; k < hd; k++ {
		icNaN[9*hd+k] = 3e38
	}
	defer func(old, oldVNNI bool) { UseAVX512, UseVNNI = old, oldVNNI }(UseAVX512, UseVNNI)
	for _, z := range []int{0, 1, 2} { // AVX2, AVX-512 fp32, AVX-512 with VNNI (where the CPU has them)
		if z > 0 && !hasAVX512 {
			t.Log("no AVX-512 on this CPU: indexTerms64AVX512 not run")
			continue
		}
		if z == 2 && !hasVNNI {
			t.Log("no AVX-512 VNNI on this CPU: indexTerms64VNNI not run")
			continue
		}
		UseAVX512, UseVNNI = z > 0, z == 2
		eachPath(t, func(t *testing.T) {
			for _, c := range []struct {
				iq, ic, w []float32
				heads     int
			}{{iq64, ic64, w64, 64}, {iq4, ic4, w4, 4}, {iq64, icNaN, w64, 64}, {iq64, ic64[:0], w64, 64},
				// the kernel's groups of 8 rows with a last group of 5, and only a short group
				{iq64, ic64[:997*hd], w64, 64}, {iq64, ic64[:5*hd], w64, 64}} {
				want := scoreRef(c.iq, c.ic, c.w, c.heads, hd)
				got := make([]float32, len(want))
				IndexScoresFast(got, c.iq, c.ic, c.w, c.heads, hd)
				sameBits(t, fmt.Sprintf("score (kernels %d)", z), got, want)
			}
		})
	}
}

func TestIndexQKFastEqualsReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 15))
	for _, heads := range []int{64, 4, 70} {
		iq, ic := bf16Vec(rng, heads*128, 1), bf16Vec(rng, 300*128, 1)
		want := make([]float32, heads*300)
		for h := 0; h < heads; h++ {
			BF16Linear(want[h*300:(h+1)*300], iq[h*128:(h+1)*128], ic, 300, 128)
		}
		eachPath(t, func(t *testing.T) {
			got := make([]float32, len(want))
			IndexQKFast(got, iq, ic, heads, 128)
			sameBits(t, "qk", got, want)
		})
	}
}

// TestLinearSharedEqualsLinear: several FP8 weights on one activation
// (LinearShared: one quantisation, one parallel loop over every weight's
// items, the small ones split by blocks) give each weight's FP8Linear bits,
// assembly and Go, GOMAXPROCS 1, 2 and 16 — V4-Flash's wq_a and wkv shapes
// and an odd-sized pair.
func TestLinearSharedEqualsLinear(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, shapes := range [][][2]int{{{1024, 4096}, {512, 4096}}, {{200, 384}, {64, 384}, {1, 384}}} {
		cols := shapes[0][1]
		ws := make([]*FP8Weight, len(shapes))
		ps := make([]*FP8Panels, len(shapes))
		for i, sh := range shapes {
			ws[i] = randFP8(rng, sh[0], sh[1])
			ps[i] = PackFP8Weight(ws[i])
		}
		x := bf16Vec(rng, cols, 3)
		for k := 128; k < 256; k++ { // a block of tiny activations
			x[k] *= 1e-6
		}
		eachPath(t, func(t *testing.T) {
			ys := make([][]float32, len(ws))
			for i, w := range ws {
				ys[i] = make([]float32, w.Rows)
			}
			LinearShared(ps, ys, x)
			for i, w := range ws {
				want := make([]float32, w.Rows)
				FP8Linear(want, x, w)
				sameBits(t, fmt.Sprintf("y[%d] of %v", i, shapes), ys[i], want)
			}
		})
	}
}

// TestFP8PanelsPartlyProven: a weight whose second row block's factors
// 2^(e+20)·s_b are out of the kernels' proven range (and the first's in it)
// on a weight split into block groups at GOMAXPROCS 16 (4 panels of 1024
// columns): the second row block's panels take the reference loop, the
// first's the kernels, with the reference's bits at every GOMAXPROCS and in
// every form (at 16 the split panels' groups run on several goroutines,
// all reading the one check of the call).
func TestFP8PanelsPartlyProven(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	w := randFP8(rng, 256, 1024)
	for b := 8; b < 16; b++ { // row block 1: 2^60, so x_b = 1 makes 2^81
		w.Scale[b] = 127 + 60
	}
	quant.DequantFP8Weight(w.W, w.Codes, w.Scale, 256, 1024)
	p := PackFP8Weight(w)
	x := make([]float32, 1024)
	for k := range x {
		x[k] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	for b := range 8 {
		x[b*128+7] = 896 // each block's amax: s_b = 2
	}
	want := make([]float32, 256)
	FP8Linear(want, x, w)
	eachPath(t, func(t *testing.T) {
		got := make([]float32, 256)
		r0 := ReferencePanels()
		p.Linear(got, x)
		sameBits(t, "y", got, want)
		wantRef := int64(4) // the pure-Go path: every panel
		if useAsm() {
			wantRef = 2 // row block 1's panels
		}
		if ref := ReferencePanels() - r0; ref != wantRef {
			t.Errorf("%d panels took the reference loop, want %d of 4", ref, wantRef)
		}
		// LinearShared: the same weight twice, one quantised x for both
		ys := [][]float32{make([]float32, 256), make([]float32, 256)}
		LinearShared([]*FP8Panels{p, p}, ys, x)
		sameBits(t, "LinearShared y[0]", ys[0], want)
		sameBits(t, "LinearShared y[1]", ys[1], want)
	})
}

// TestFP8PanelsFactorRange: the kernels scale each block sum back by
// 2^(e+20)·s_b (e the weight block's scale exponent, s_b the activation
// block's); they take a weight whose factor exponent e+20+x_b is at most 80
// and leave one at 81 to the reference loop, with the same bits either way.
func TestFP8PanelsFactorRange(t *testing.T) {
	if !useAsm() {
		t.Skip("no AVX2")
	}
	rng := rand.New(rand.NewPCG(7, 8))
	w := randFP8(rng, 128, 256)
	for i := range w.Scale {
		w.Scale[i] = 127 + 60 // 2^60: with x_b = 0 the factor is 2^80
	}
	quant.DequantFP8Weight(w.W, w.Codes, w.Scale, 128, 256)
	p := PackFP8Weight(w)
	for _, c := range []struct {
		xb  int  // the activation blocks' scale exponent
		ref bool // the factor is out of the kernels' proven range
	}{{-2, false}, {0, false}, {1, true}, {3, true}} {
		x := make([]float32, 256)
		for k := range x {
			x[k] = quant.BF16Round(float32(rng.NormFloat64()))
		}
		x[5], x[200] = 448*quant.Pow2(c.xb), -448*quant.Pow2(c.xb) // each block's amax: s_b = 2^xb
		want, got := make([]float32, 128), make([]float32, 128)
		FP8Linear(want, x, w)
		r0 := ReferencePanels()
		p.Linear(got, x)
		sameBits(t, fmt.Sprintf("x_b %d", c.xb), got, want)
		if took := ReferencePanels() > r0; took != c.ref {
			t.Errorf("x_b %d (factor 2^%d): reference loop taken %v, want %v", c.xb, 80+c.xb, took, c.ref)
		}
	}
}

// TestLoadRead: the benchmarks' vector-load read (loadReadAVX2 through
// loadRead) reads every byte: a single set bit anywhere in a zero buffer,
// for lengths around its 256-byte step, shows in the result's byte i%8.
func TestLoadRead(t *testing.T) {
	if !useAsm() {
		t.Skip("no AVX2 loads on this machine/build")
	}
	for _, n := range []int{1, 255, 256, 257, 512, 4096 + 37, 1 << 16} {
		v := make([]byte, n)
		if got := loadRead(v); got != 0 {
			t.Fatalf("len %d, all zero: %#x", n, got)
		}
		for _, i := range []int{0, n / 3, n / 2, n - 256, n - 1} {
			if i < 0 || i >= n {
				continue
			}
			for bit := range 8 {
				v[i] = 1 << bit
				if got := loadRead(v); got&(0xff<<(8*(i%8))) == 0 {
					t.Fatalf("len %d: byte %d = %#x not seen (%#x)", n, i, v[i], got)
				}
				v[i] = 0
			}
		}
	}
}
