package quant

import (
	"flag"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

var exhaustive = flag.Bool("quant.exhaustive", false, "check the fast encoders against the references on all 2^32 fp32 inputs (minutes)")

func f32(b uint32) float32  { return math.Float32frombits(b) }
func bits(f float32) uint32 { return math.Float32bits(f) }

// next returns the fp32 neighbour of the finite f towards +inf (up) or 0.
func next(f float32, up bool) float32 {
	return float32(math.Nextafter32(f, float32(math.Inf(map[bool]int{true: 1, false: -1}[up]))))
}

// encoder is one rounding function under test, named for failure messages.
type encoder struct {
	name string
	enc  func(float32) uint8
}

var (
	e4m3Encoders = []encoder{{"EncodeE4M3", EncodeE4M3}, {"encodeE4M3Ref", encodeE4M3Ref}, {"EncodeE4M3Sat", EncodeE4M3Sat}}
	e5m2Encoders = []encoder{{"EncodeE5M2", EncodeE5M2}, {"encodeE5M2Ref", encodeE5M2Ref}}
	e2m1Encoders = []encoder{{"EncodeE2M1", EncodeE2M1}, {"encodeE2M1Ref", encodeE2M1Ref}}
)

// checkGrid checks an encoder on a format's grid: positive finite codes
// 0..top in value order, their negatives (sign bit sb), every code's own value
// and every halfway point between neighbours (ties to the even code) with its
// fp32 neighbours on either side.
func checkGrid(t *testing.T, e encoder, dec func(uint8) float32, top, sb uint8) {
	t.Helper()
	for c := uint8(0); c <= top; c++ {
		for _, s := range []uint8{0, sb} {
			v := dec(c | s)
			if g := e.enc(v); g != c|s {
				t.Errorf("%s(%g) = %#x, want its own code %#x", e.name, v, g, c|s)
			}
			if c == top {
				continue
			}
			w := dec((c + 1) | s)
			mid := (v + w) / 2 // exact: the grids have few mantissa bits
			even := c
			if c&1 == 1 {
				even = c + 1
			}
			if g := e.enc(mid); g != even|s {
				t.Errorf("%s(%g) (halfway %g..%g) = %#x, want the even code %#x", e.name, mid, v, w, g, even|s)
			}
			if g := e.enc(next(mid, s != 0)); g != c|s {
				t.Errorf("%s(just below halfway %g) = %#x, want %#x", e.name, mid, g, c|s)
			}
			if g := e.enc(next(mid, s == 0)); g != (c+1)|s {
				t.Errorf("%s(just above halfway %g) = %#x, want %#x", e.name, mid, g, (c+1)|s)
			}
		}
	}
}

func TestE4M3AllCodes(t *testing.T) {
	for c := 0; c < 256; c++ {
		v := DecodeE4M3(uint8(c))
		if c&0x7f == 0x7f {
			if want := uint32(c&0x80)<<24 | E4M3NaNBits; bits(v) != want {
				t.Errorf("DecodeE4M3(%#x) bits %#08x, want NaN %#08x", c, bits(v), want)
			}
		} else if c&0x7f != 0 && c&0x7f != 0x7e && !(math.Abs(float64(v)) > math.Abs(float64(DecodeE4M3(uint8(c-1))))) {
			t.Errorf("DecodeE4M3 not increasing in magnitude at %#x", c)
		}
		for _, e := range e4m3Encoders {
			if g := e.enc(v); g != uint8(c) {
				t.Errorf("%s(DecodeE4M3(%#x) = %g) = %#x", e.name, c, v, g)
			}
		}
	}
	// Hand-checked values: 448 = 1.75·2^8, smallest normal 2^-6, smallest subnormal 2^-9.
	for _, tc := range []struct {
		c uint8
		v float32
	}{{0x7e, 448}, {0xfe, -448}, {0x08, 0x1p-6}, {0x01, 0x1p-9}, {0x07, 7 * 0x1p-9}, {0x38, 1}, {0x3c, 1.5}} {
		if v := DecodeE4M3(tc.c); v != tc.v {
			t.Errorf("DecodeE4M3(%#x) = %g, want %g", tc.c, v, tc.v)
		}
	}
	if bits(DecodeE4M3(0x80)) != 0x80000000 {
		t.Errorf("DecodeE4M3(0x80) is not -0")
	}
	for _, e := range e4m3Encoders {
		checkGrid(t, e, DecodeE4M3, 0x7e, 0x80)
	}
}

func TestE5M2AllCodes(t *testing.T) {
	for c := 0; c < 256; c++ {
		v := DecodeE5M2(uint8(c))
		sign := uint32(c&0x80) << 24
		switch {
		case c&0x7f == 0x7c:
			if bits(v) != sign|0x7f800000 {
				t.Errorf("DecodeE5M2(%#x) = %g, want inf", c, v)
			}
		case c&0x7f > 0x7c:
			if bits(v) != sign|E5M2NaNBits {
				t.Errorf("DecodeE5M2(%#x) bits %#08x, want %#08x", c, bits(v), sign|E5M2NaNBits)
			}
			for _, e := range e5m2Encoders {
				if g := e.enc(v); g != uint8(c&0x80|0x7f) {
					t.Errorf("%s(NaN code %#x) = %#x, want %#x", e.name, c, g, c&0x80|0x7f)
				}
			}
			continue
		}
		for _, e := range e5m2Encoders {
			if g := e.enc(v); g != uint8(c) {
				t.Errorf("%s(DecodeE5M2(%#x) = %g) = %#x", e.name, c, v, g)
			}
		}
	}
	for _, tc := range []struct {
		c uint8
		v float32
	}{{0x7b, 57344}, {0x04, 0x1p-14}, {0x01, 0x1p-16}, {0x3c, 1}} {
		if v := DecodeE5M2(tc.c); v != tc.v {
			t.Errorf("DecodeE5M2(%#x) = %g, want %g", tc.c, v, tc.v)
		}
	}
	for _, e := range e5m2Encoders {
		checkGrid(t, e, DecodeE5M2, 0x7b, 0x80)
	}
}

func TestE2M1AllCodes(t *testing.T) {
	want := []float32{0, 0.5, 1, 1.5, 2, 3, 4, 6}
	for c := uint8(0); c < 16; c++ {
		v := DecodeE2M1(c)
		w := want[c&7]
		if c&8 != 0 {
			w = -w
		}
		if v != w || math.Signbit(float64(v)) != (c&8 != 0) {
			t.Errorf("DecodeE2M1(%#x) = %g, want %g", c, v, w)
		}
		if DecodeE2M1(c|0xf0) != v {
			t.Errorf("DecodeE2M1(%#x) reads the high nibble", c|0xf0)
		}
		for _, e := range e2m1Encoders {
			if g := e.enc(v); g != c {
				t.Errorf("%s(%g) = %#x, want %#x", e.name, v, g, c)
			}
		}
	}
	// The spec's tie list (§0.2): 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4.
	ties := map[float32]float32{0.25: 0, 0.75: 1, 1.25: 1, 1.75: 2, 2.5: 2, 3.5: 4, 5: 4}
	for x, w := range ties {
		for _, e := range e2m1Encoders {
			if g := DecodeE2M1(e.enc(x)); g != w {
				t.Errorf("%s(%g) = %g, want %g", e.name, x, g, w)
			}
			if g := DecodeE2M1(e.enc(-x)); g != -w {
				t.Errorf("%s(%g) = %g, want %g", e.name, -x, g, -w)
			}
		}
	}
	for _, e := range e2m1Encoders {
		checkGrid(t, e, DecodeE2M1, 7, 8)
	}
}

func TestBF16AllHalfways(t *testing.T) {
	// Every finite bf16 h: its own value, the fp32 halfway to h+1 (ties to even),
	// and that halfway's fp32 neighbours. h = 0x7F7F goes to inf (0x7F80).
	for h := uint32(0); h < 0x7f80; h++ {
		for _, s := range []uint32{0, 0x8000} {
			if g := BF16Bits(f32((h | s) << 16)); g != uint16(h|s) {
				t.Fatalf("BF16Bits(bf16 %#04x) = %#04x", h|s, g)
			}
			mid := (h|s)<<16 | 0x8000
			even := h
			if h&1 == 1 {
				even = h + 1
			}
			if g := BF16Bits(f32(mid)); g != uint16(even|s) {
				t.Fatalf("BF16Bits(%#08x) = %#04x, want the even %#04x", mid, g, even|s)
			}
			if g := BF16Bits(f32(mid - 1)); g != uint16(h|s) {
				t.Fatalf("BF16Bits(%#08x) = %#04x, want %#04x", mid-1, g, h|s)
			}
			if g := BF16Bits(f32(mid + 1)); g != uint16((h+1)|s) {
				t.Fatalf("BF16Bits(%#08x) = %#04x, want %#04x", mid+1, g, (h+1)|s)
			}
		}
	}
}

func TestF16AllHalfways(t *testing.T) {
	for h := uint16(0); h < 0x7c00; h++ {
		for _, s := range []uint16{0, 0x8000} {
			v := F16ToF32(h | s)
			if g := F16Bits(v); g != h|s {
				t.Fatalf("F16Bits(%g) = %#04x, want %#04x", v, g, h|s)
			}
			w := float32(65536) // above the largest finite value 65504: overflow
			if h < 0x7bff {
				w = F16ToF32(h + 1)
			}
			if s != 0 {
				w = -w
			}
			mid := (v + w) / 2
			even := h
			if h&1 == 1 {
				even = h + 1
			}
			if g := F16Bits(mid); g != even|s {
				t.Fatalf("F16Bits(%g) = %#04x, want the even %#04x", mid, g, even|s)
			}
			if g := F16Bits(next(mid, s != 0)); g != h|s {
				t.Fatalf("F16Bits(just inside %g) = %#04x, want %#04x", mid, g, h|s)
			}
			if g := F16Bits(next(mid, s == 0)); g != (h+1)|s {
				t.Fatalf("F16Bits(just outside %g) = %#04x, want %#04x", mid, g, (h+1)|s)
			}
		}
	}
}

// TestEdgeCases covers ranges, subnormals, signed zeros, infinities and NaNs; the
// NaN outputs are the ones torch 2.11 returns on CUDA (golden file).
func TestEdgeCases(t *testing.T) {
	inf := float32(math.Inf(1))
	nan := f32(0x7fc00000)
	negNaN := f32(0xffa12345)
	type c8 struct {
		in   float32
		want uint8
	}
	for _, tc := range []struct {
		name  string
		enc   func(float32) uint8
		cases []c8
	}{
		{"EncodeE4M3", EncodeE4M3, []c8{
			{448, 0x7e}, {464, 0x7e}, {next(464, true), 0x7f}, {479.99, 0x7f}, {480, 0x7f}, {1e30, 0x7f},
			{inf, 0x7f}, {-inf, 0xff}, {nan, 0x7f}, {negNaN, 0xff}, {0, 0}, {f32(0x80000000), 0x80},
			{0x1p-10, 0}, {next(0x1p-10, true), 1}, {3 * 0x1p-10, 2}, {7.5 * 0x1p-9, 8}, {-0x1p-11, 0x80},
			{f32(1), 0}, {f32(0x807fffff), 0x80},
		}},
		{"EncodeE4M3Sat", EncodeE4M3Sat, []c8{
			{448, 0x7e}, {464.5, 0x7e}, {1e30, 0x7e}, {inf, 0x7e}, {-inf, 0xfe}, {nan, 0x7f}, {negNaN, 0xff}, {f32(0x80000000), 0x80},
		}},
		{"EncodeE5M2", EncodeE5M2, []c8{
			{57344, 0x7b}, {61440, 0x7c}, {next(61440, false), 0x7b}, {65536, 0x7c}, {1e10, 0x7c}, {inf, 0x7c},
			{-inf, 0xfc}, {nan, 0x7f}, {negNaN, 0xff}, {0x1p-17, 0}, {next(0x1p-17, true), 1}, {f32(0x80000000), 0x80},
		}},
		{"EncodeE2M1", EncodeE2M1, []c8{
			{6, 7}, {7, 7}, {1e30, 7}, {inf, 7}, {-inf, 0xf}, {nan, 0}, {negNaN, 0}, {f32(0x80000000), 8}, {-0.1, 8}, {0.2, 0},
		}},
		{"CastUE8M0", CastUE8M0, []c8{
			{1, 127}, {1.5, 128}, {next(1.5, false), 127}, {1.75, 128}, {0.75, 127}, {-3, 129}, {0, 0}, {f32(0x80000000), 0},
			{f32(0x00400000), 0}, {f32(0x00400001), 1}, {f32(0x00600000), 1}, {f32(0x00200000), 0}, {float32(math.Sqrt2), 127},
			{0x1p127, 254}, {f32(0x7f400000), 255}, {inf, 255}, {nan, 255}, {-inf, 255},
		}},
	} {
		for _, c := range tc.cases {
			if g := tc.enc(c.in); g != c.want {
				t.Errorf("%s(%g, bits %#08x) = %#x, want %#x", tc.name, c.in, bits(c.in), g, c.want)
			}
		}
	}
	type c16 struct {
		in   uint32
		want uint16
	}
	for _, c := range []c16{
		{0x7f7f7fff, 0x7f7f}, {0x7f7f8000, 0x7f80}, {0x7f7e8000, 0x7f7e}, {0x7f7fffff, 0x7f80}, {0x7f800000, 0x7f80},
		{0xff800000, 0xff80}, {0x7fc00000, BF16NaN}, {0xffc00000, BF16NaN}, {0x7f800001, BF16NaN}, {0xffffffff, BF16NaN},
		{0x00008000, 0}, {0x00018000, 2}, {0x00008001, 1}, {0x80000000, 0x8000}, {0x80008000, 0x8000},
	} {
		if g := BF16Bits(f32(c.in)); g != c.want {
			t.Errorf("BF16Bits(%#08x) = %#04x, want %#04x", c.in, g, c.want)
		}
	}
	for _, c := range []struct {
		in   float32
		want uint16
	}{
		{65504, 0x7bff}, {65519.996, 0x7bff}, {65520, 0x7c00}, {-65520, 0xfc00}, {0x1p-24, 1}, {0x1p-25, 0},
		{next(0x1p-25, true), 1}, {f32(0x80000000), 0x8000}, {nan, F16NaN}, {negNaN, F16NaN}, {-inf, 0xfc00},
	} {
		if g := F16Bits(c.in); g != c.want {
			t.Errorf("F16Bits(%g) = %#04x, want %#04x", c.in, g, c.want)
		}
	}
	for _, h := range []uint16{0x7c01, 0x7e00, 0xfe00, 0xffff} {
		if g := bits(F16ToF32(h)); g != CanonicalNaN {
			t.Errorf("F16ToF32(%#04x) bits %#08x, want %#08x", h, g, CanonicalNaN)
		}
	}
}

func TestUE8M0(t *testing.T) {
	for b := 0; b < 256; b++ {
		s := DecodeUE8M0(uint8(b))
		switch b {
		case 0xff:
			if bits(s) != UE8M0NaNBits {
				t.Errorf("DecodeUE8M0(0xFF) bits %#08x", bits(s))
			}
			continue
		case 0:
			if bits(s) != 0x00400000 {
				t.Errorf("DecodeUE8M0(0) = %g, want 2^-127", s)
			}
		}
		if float64(s) != math.Ldexp(1, b-127) {
			t.Errorf("DecodeUE8M0(%d) = %g, want 2^%d", b, s, b-127)
		}
		if g, ok := EncodeUE8M0(s); !ok || g != uint8(b) {
			t.Errorf("EncodeUE8M0(2^%d) = %d, %v", b-127, g, ok)
		}
		if g := CastUE8M0(s); g != uint8(b) {
			t.Errorf("CastUE8M0(2^%d) = %d", b-127, g)
		}
	}
	for _, s := range []float32{0, -1, 3, 1.5, float32(math.Inf(1)), f32(0x7fc00000), 0x1p-128} {
		if g, ok := EncodeUE8M0(s); ok || g != UE8M0NaN {
			t.Errorf("EncodeUE8M0(%g) = %#x, %v; want 0xFF, false", s, g, ok)
		}
	}
	// CastUE8M0 rounds the linear mantissa: up from 1.5 (ties up for normals).
	r := rand.New(rand.NewPCG(5, 6))
	for range 10000 {
		f := f32(r.Uint32()&0x7fffffff | 0x00800000)
		if f >= 0x1p127*1.5 || f != f {
			continue
		}
		_, e := math.Frexp(float64(f)) // f = m·2^e, m in [0.5, 1)
		lo := math.Ldexp(1, e-1)
		want := e - 1 + 127
		if float64(f) >= 1.5*lo {
			want++
		}
		if g := CastUE8M0(f); int(g) != want {
			t.Fatalf("CastUE8M0(%g) = %d, want %d", f, g, want)
		}
	}
}

func TestCeil2(t *testing.T) {
	for k := -126; k <= 127; k++ {
		p := float32(math.Ldexp(1, k))
		if g := Ceil2(p); g != p {
			t.Errorf("Ceil2(2^%d) = %g", k, g)
		}
		if Pow2(k) != p {
			t.Errorf("Pow2(%d) = %g", k, Pow2(k))
		}
		if k < 127 {
			if g := Ceil2(next(p, true)); g != 2*p {
				t.Errorf("Ceil2(2^%d + ulp) = %g, want 2^%d", k, g, k+1)
			}
		}
	}
	if Pow2(-127) != 0 || math.Signbit(float64(Pow2(-127))) {
		t.Errorf("Pow2(-127) = %g, want +0 (the bit trick)", Pow2(-127))
	}
	r := rand.New(rand.NewPCG(7, 8))
	for range 100000 {
		f := f32(r.Uint32()%0x7f000000 + 0x00800000) // positive normal below 2^127
		frac, e := math.Frexp(float64(f))
		want := e - 1
		if frac != 0.5 {
			want = e
		}
		if g := Ceil2Exp(f); g != want {
			t.Fatalf("Ceil2Exp(%g) = %d, want %d", f, g, want)
		}
	}
}

func TestBlockScaleExp(t *testing.T) {
	bf16Above := func(f float32) float32 { return BF16Next(f, 1) }
	for _, tc := range []struct {
		rule             ScaleRule
		amax, qmax, flor float32
		want             int
		why              string
	}{
		{ScaleCeil2, 448, E4M3Max, FP8AmaxFloor, 0, "448·f32(1/448) rounds to exactly 1"},
		{ScaleCeil2, bf16Above(448), E4M3Max, FP8AmaxFloor, 1, "just above 448 needs scale 2"},
		{ScaleCeil2, 448 * 0x1p-20, E4M3Max, FP8AmaxFloor, -20, "448·2^k gives 2^k"},
		{ScaleCeil2, 0, E4M3Max, FP8AmaxFloor, -22, "zero block: ceil2(1e-4/448) = 2^-22"},
		{ScaleFlashMLA, 0, E4M3Max, FP8AmaxFloor, -13, "FlashMLA floors amax/448 at 1e-4: 2^-13 (spec §14)"},
		{ScaleLog2Ceil, 0, E4M3Max, FP8AmaxFloor, -22, "log2(1e-4/448) = -22.09"},
		{ScaleCeil2, 6, E2M1Max, FP4AmaxFloor, 0, "6·f32(1/6) rounds to exactly 1"},
		{ScaleCeil2, 0, E2M1Max, FP4AmaxFloor, -126, "zero block: floor 6·2^-126 gives 2^-126"},
		{ScaleRoundLog2, 448 * 1.4, E4M3Max, FP8AmaxFloor, 0, "log2(1.4) = 0.49 rounds to 0"},
		{ScaleRoundLog2, 448 * 1.5, E4M3Max, FP8AmaxFloor, 1, "log2(1.5) = 0.58 rounds to 1"},
	} {
		if g := BlockScaleExp(tc.rule, tc.amax, tc.qmax, tc.flor); g != tc.want {
			t.Errorf("BlockScaleExp(%v, %g, %g) = %d, want %d (%s)", tc.rule, tc.amax, tc.qmax, g, tc.want, tc.why)
		}
	}
	for r := ScaleCeil2; r <= ScaleRoundLog2; r++ {
		if g, ok := ParseScaleRule(r.String()); !ok || g != r {
			t.Errorf("ParseScaleRule(%q) = %v, %v", r.String(), g, ok)
		}
	}
	if _, ok := ParseScaleRule("nearest"); ok {
		t.Errorf("ParseScaleRule accepted an unknown name")
	}
}

// sweep calls f on every fp32 bit pattern when -quant.exhaustive is set, and
// otherwise on a strided sample of all of them plus both signs of each.
func sweep(f func(b uint32)) {
	if *exhaustive {
		for b := uint64(0); b < 1<<32; b++ {
			f(uint32(b))
		}
		return
	}
	for b := uint32(0); b < 1<<31-4099; b += 4099 {
		f(b)
		f(b | 0x80000000)
	}
}

// TestFastEncodersMatchReferences holds the fast (FPU and integer-add) encoders
// equal to the significand-rounding references.
func TestFastEncodersMatchReferences(t *testing.T) {
	bad := 0
	sweep(func(b uint32) {
		x := f32(b)
		c := clamp(x, -E4M3Max, E4M3Max)
		if g, w := EncodeE4M3(x), encodeE4M3Ref(x); g != w {
			bad++
			if bad < 8 {
				t.Errorf("EncodeE4M3(%#08x) = %#x, reference %#x", b, g, w)
			}
		}
		if g, w := EncodeE4M3Sat(x), encodeE4M3Ref(c); g != w {
			bad++
			if bad < 8 {
				t.Errorf("EncodeE4M3Sat(%#08x) = %#x, reference of the clamped value %#x", b, g, w)
			}
		}
		if g, w := EncodeE5M2(x), encodeE5M2Ref(x); g != w {
			bad++
			if bad < 8 {
				t.Errorf("EncodeE5M2(%#08x) = %#x, reference %#x", b, g, w)
			}
		}
		if g, w := EncodeE2M1(x), encodeE2M1Ref(x); g != w {
			bad++
			if bad < 8 {
				t.Errorf("EncodeE2M1(%#08x) = %#x, reference %#x", b, g, w)
			}
		}
	})
	if bad > 0 {
		t.Errorf("%d mismatches in all", bad)
	}
}

// edgeBlocks returns bf16 test data in blocks of B: random values at many scales,
// blocks whose |max| sits on qmax·2^k and one bf16 step either side, zero and
// signed-zero blocks, blocks below the amax floor, and huge blocks.
func edgeBlocks(B int, qmax float32, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 99))
	var v []float32
	add := func(scale float32, amax float32) {
		blk := make([]float32, B)
		for i := range blk {
			blk[i] = BF16Round(float32(r.NormFloat64()) * scale)
		}
		if amax != 0 {
			blk[r.IntN(B)] = amax
		}
		v = append(v, blk...)
	}
	for k := -30; k <= 30; k += 3 {
		add(float32(math.Ldexp(1, k)), 0)
		for d := -1; d <= 1; d++ {
			add(float32(math.Ldexp(0.1, k)), BF16Next(qmax*float32(math.Ldexp(1, k)), d))
		}
	}
	v = append(v, make([]float32, B)...)
	neg := make([]float32, B)
	for i := range neg {
		neg[i] = float32(math.Copysign(0, -1))
	}
	v = append(v, neg...)
	add(1e-7, 0)
	add(1e-39, 0)
	add(1e37, 0)
	return v
}

func TestFQ8MatchesReference(t *testing.T) {
	for _, B := range []int{64, 128, 32} {
		in := edgeBlocks(B, E4M3Max, uint64(B))
		fast := append([]float32(nil), in...)
		ref := append([]float32(nil), in...)
		FQ8(fast, B)
		fq8Ref(ref, B)
		for i := range in {
			if bits(fast[i]) != bits(ref[i]) {
				t.Fatalf("B=%d element %d (in %g): FQ8 %g, reference %g", B, i, in[i], fast[i], ref[i])
			}
			if BF16Round(fast[i]) != fast[i] {
				t.Fatalf("FQ8 output %g is not a bf16 value", fast[i])
			}
		}
		// Real quantisation decodes to the same values.
		codes := make([]uint8, len(in))
		scales := make([]uint8, len(in)/B)
		QuantizeFP8(codes, scales, in, B, ScaleCeil2, FP8AmaxFloor)
		dq := make([]float32, len(in))
		DequantizeFP8(dq, codes, scales, B)
		q := make([]float32, len(in))
		s := make([]float32, len(in)/B)
		QuantizeActFP8(q, s, in, B)
		for i := range in {
			if bits(dq[i]) != bits(ref[i]) {
				t.Fatalf("B=%d element %d: DequantizeFP8(QuantizeFP8) %g, FQ8 %g", B, i, dq[i], ref[i])
			}
			if bits(q[i]*s[i/B]) != bits(ref[i]) {
				t.Fatalf("B=%d element %d: QuantizeActFP8 q·s = %g, FQ8 %g", B, i, q[i]*s[i/B], ref[i])
			}
		}
	}
}

func TestFQ4MatchesReference(t *testing.T) {
	for _, B := range []int{32, 16} {
		in := edgeBlocks(B, E2M1Max, uint64(B))
		fast := append([]float32(nil), in...)
		ref := append([]float32(nil), in...)
		FQ4(fast, B)
		fq4Ref(ref, B)
		packed := make([]uint8, len(in)/2)
		scales := make([]uint8, len(in)/B)
		QuantizeFP4(packed, scales, in, B, ScaleCeil2, FP4AmaxFloor)
		dq := make([]float32, len(in))
		DequantizeFP4(dq, packed, scales, B)
		for i := range in {
			if bits(fast[i]) != bits(ref[i]) {
				t.Fatalf("B=%d element %d (in %g): FQ4 %g, reference %g", B, i, in[i], fast[i], ref[i])
			}
			if bits(dq[i]) != bits(ref[i]) {
				t.Fatalf("B=%d element %d: DequantizeFP4(QuantizeFP4) %g, FQ4 %g", B, i, dq[i], ref[i])
			}
		}
	}
}

// TestQuantizeWideScales runs the quantisers where 1/s is not an fp32 power of
// two (no floor, so a zero block gets s = 2^-127), the divide fallback.
func TestQuantizeWideScales(t *testing.T) {
	v := make([]float32, 64)
	codes := make([]uint8, 64)
	scales := make([]uint8, 1)
	QuantizeFP8(codes, scales, v, 64, ScaleCeil2, 0)
	if scales[0] != 0 {
		t.Errorf("zero block without floor: scale byte %d, want 0 (2^-127)", scales[0])
	}
	for i, c := range codes {
		if c != 0 {
			t.Fatalf("code %d = %#x, want 0", i, c)
		}
	}
	v[3] = 0x1p-130
	QuantizeFP8(codes, scales, v, 64, ScaleCeil2, 0)
	dq := make([]float32, 64)
	DequantizeFP8(dq, codes, scales, 64)
	// amax·f32(1/448) is an fp32 subnormal: ceil2 from its bits gives 2^-126.
	if scales[0] != 1 || dq[3] != 0x1p-130 {
		t.Errorf("2^-130 in a block without floor: scale byte %d (want 1), dequantised %g", scales[0], dq[3])
	}
}

func TestPackFP4(t *testing.T) {
	codes := []uint8{1, 2, 0xf, 0x8, 7, 0}
	packed := make([]uint8, 3)
	PackFP4(packed, codes)
	if want := []uint8{0x21, 0x8f, 0x07}; string(packed) != string(want) {
		t.Errorf("PackFP4 = % x, want % x (even index in the low nibble)", packed, want)
	}
	back := make([]uint8, 6)
	UnpackFP4(back, packed)
	if string(back) != string(codes) {
		t.Errorf("UnpackFP4 = % x, want % x", back, codes)
	}
}

func TestHadamard(t *testing.T) {
	// A one-hot input e_j gives column j of W times the scale: ±f32(128^-0.5) in bf16.
	for _, j := range []int{0, 1, 77, 127} {
		v := make([]float32, 128)
		v[j] = 1
		Hadamard(v)
		for i, x := range v {
			w := BF16Round(HadamardScale128)
			if popcount(i&j)%2 == 1 {
				w = -w
			}
			if x != w {
				t.Fatalf("Had(e_%d)[%d] = %g, want %g", j, i, x, w)
			}
		}
	}
	// The butterfly and the row sums agree to one bf16 ulp. Applying the transform
	// twice returns the input to within the two bf16 roundings: the first adds an
	// error e with |e_j| ≤ 2^-9·|y_j|, which the orthonormal second transform maps to
	// a vector of the same norm, ≤ 2^-9·‖y‖ = 2^-9·‖v‖ per element; the second
	// rounding adds ≤ 2^-9·|out_i|. The check allows twice each term.
	r := rand.New(rand.NewPCG(9, 10))
	for range 200 {
		v := make([]float32, 128)
		for i := range v {
			v[i] = BF16Round(float32(r.NormFloat64()))
		}
		fly := append([]float32(nil), v...)
		Hadamard(fly)
		ref := make([]float32, 128)
		HadamardRef(ref, v)
		twice := append([]float32(nil), fly...)
		Hadamard(twice)
		var norm float64
		for _, x := range v {
			norm += float64(x) * float64(x)
		}
		bound := math.Ldexp(math.Sqrt(norm), -8)
		for i := range v {
			if d := BF16ULPDistance(fly[i], ref[i]); d > 1 {
				t.Fatalf("Hadamard vs HadamardRef at %d: %g vs %g", i, fly[i], ref[i])
			}
			if math.Abs(float64(twice[i]-v[i])) > bound+math.Ldexp(math.Abs(float64(v[i])), -8) {
				t.Fatalf("Had(Had(v))[%d] = %g, v = %g", i, twice[i], v[i])
			}
		}
	}
	for n := 1; n <= 1024; n *= 2 {
		if g, w := hadamardScale(n), float32(1/math.Sqrt(float64(n))); g != w {
			t.Errorf("hadamardScale(%d) = %g, want f32(%d^-0.5) = %g", n, g, n, w)
		}
	}
	if bits(HadamardScale128) != 0x3db504f3 {
		t.Errorf("HadamardScale128 bits %#08x, want 0x3DB504F3 (spec §1)", bits(HadamardScale128))
	}
}

func TestConstants(t *testing.T) {
	for _, c := range []struct {
		name string
		got  float32
		want uint32
	}{{"InvE4M3Max", InvE4M3Max, 0x3b124925}, {"InvE2M1Max", InvE2M1Max, 0x3e2aaaab}, {"FP4AmaxFloor", FP4AmaxFloor, 0x01c00000}} {
		if bits(c.got) != c.want {
			t.Errorf("%s bits %#08x, want %#08x", c.name, bits(c.got), c.want)
		}
	}
}

func TestBF16Helpers(t *testing.T) {
	if g := BF16Next(1, 1); g != 1+0x1p-7 {
		t.Errorf("BF16Next(1, 1) = %g", g)
	}
	if g := BF16Next(0, -1); bits(g) != 0x80010000 {
		t.Errorf("BF16Next(0, -1) bits %#08x, want the smallest negative subnormal", bits(g))
	}
	if d := BF16ULPDistance(0, f32(0x80000000)); d != 0 {
		t.Errorf("+0 and -0 are %d apart", d)
	}
	if d := BF16ULPDistance(-0x1p-133, 0x1p-133); d != 2 {
		t.Errorf("the two smallest subnormals are %d apart, want 2", d)
	}
	if d := BF16ULPDistance(f32(0x7fc00000), 1); d != math.MaxInt32 {
		t.Errorf("NaN distance %d", d)
	}
}

func TestPanics(t *testing.T) {
	for name, f := range map[string]func(){
		"FQ8":              func() { FQ8(make([]float32, 65), 64) },
		"FQ4":              func() { FQ4(make([]float32, 31), 32) },
		"QuantizeFP8":      func() { QuantizeFP8(make([]uint8, 10), make([]uint8, 1), make([]float32, 64), 64, ScaleCeil2, 1e-4) },
		"QuantizeFP4":      func() { QuantizeFP4(make([]uint8, 16), make([]uint8, 1), make([]float32, 33), 33, ScaleCeil2, 1e-4) },
		"Hadamard":         func() { Hadamard(make([]float32, 100)) },
		"DequantFP8Weight": func() { DequantFP8Weight(make([]float32, 4), make([]uint8, 4), nil, 2, 2) },
		"PackFP4":          func() { PackFP4(make([]uint8, 1), make([]uint8, 3)) },
	} {
		func() {
			defer func() {
				r := recover()
				if s, ok := r.(string); !ok || !strings.HasPrefix(s, "quant: ") {
					t.Errorf("%s: panic %v, want a \"quant: \" message", name, r)
				}
			}()
			f()
		}()
	}
}

// TestDequantizeFP8MatchesReference checks the fast block loop (NaN codes found
// eight at a time) against the per-element reference, NaN codes and NaN scales
// included, with block sizes that leave a tail of fewer than eight codes.
func TestDequantizeFP8MatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, B := range []int{64, 7, 128, 1} {
		codes := make([]uint8, 40*B)
		scales := make([]uint8, 40)
		for i := range codes {
			codes[i] = uint8(r.IntN(256)) &^ 0x01 // even: never 0x7F/0xFF
		}
		for b := range scales {
			scales[b] = uint8(100 + r.IntN(50))
			switch b % 5 {
			case 1: // one NaN code at a position that moves through the block
				codes[b*B+(b*3)%B] |= 0x7f
			case 2:
				scales[b] = UE8M0NaN
			case 3:
				scales[b] = uint8(r.IntN(256))
			}
		}
		fast := make([]float32, len(codes))
		ref := make([]float32, len(codes))
		DequantizeFP8(fast, codes, scales, B)
		dequantizeFP8Ref(ref, codes, scales, B)
		for i := range codes {
			if bits(fast[i]) != bits(ref[i]) {
				t.Fatalf("B=%d element %d (code %#x, scale %d): %#08x, reference %#08x", B, i, codes[i], scales[i/B], bits(fast[i]), bits(ref[i]))
			}
		}
	}
	for n := 1; n <= 20; n++ {
		for p := 0; p < n; p++ {
			codes := make([]uint8, n)
			for i := range codes {
				codes[i] = 0x7e | uint8(i&1)<<7
			}
			if hasE4M3NaN(codes) {
				t.Fatalf("hasE4M3NaN true without NaN codes (n=%d)", n)
			}
			codes[p] = 0x7f | uint8(p&1)<<7
			if !hasE4M3NaN(codes) {
				t.Fatalf("hasE4M3NaN missed the NaN code at %d of %d", p, n)
			}
		}
	}
}
