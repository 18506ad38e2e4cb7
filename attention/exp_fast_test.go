package attention

import (
	"math"
	"os"
	"runtime"
	"sync"
	"testing"
)

// expCheck runs expFast over the float32 bit patterns lo, lo+step, … < hi
// (as 64-value slices) and reports the first values that differ from exp32.
func expCheck(t *testing.T, lo, hi, step uint64) (n int) {
	t.Helper()
	var mu sync.Mutex
	bad := 0
	var wg sync.WaitGroup
	workers := runtime.GOMAXPROCS(0)
	span := (hi - lo + uint64(workers) - 1) / uint64(workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(a, b uint64) {
			defer wg.Done()
			var src, dst [64]float32
			k, cnt := 0, 0
			flush := func() {
				expFast(dst[:k], src[:k])
				for i, x := range src[:k] {
					if math.Float32bits(dst[i]) != math.Float32bits(exp32(x)) {
						mu.Lock()
						if bad < 5 {
							t.Errorf("expFast(%g = %08x) = %08x, exp32 %08x", x, math.Float32bits(x), math.Float32bits(dst[i]), math.Float32bits(exp32(x)))
						}
						bad++
						mu.Unlock()
					}
				}
				cnt += k
				k = 0
			}
			// align a to the stride from lo
			if off := (a - lo) % step; off != 0 {
				a += step - off
			}
			for b2 := a; b2 < b && b2 < hi; b2 += step {
				src[k] = math.Float32frombits(uint32(b2))
				k++
				if k == len(src) {
					flush()
				}
			}
			flush()
			mu.Lock()
			n += cnt
			mu.Unlock()
		}(lo+uint64(w)*span, min(hi, lo+uint64(w+1)*span))
	}
	wg.Wait()
	if bad > 0 {
		t.Errorf("%d values differ", bad)
	}
	return n
}

// expFast is exp32 bit for bit: every float32 pattern (NaNs, infinities,
// subnormals, both signs) at a stride of 251 here (4099 with -short), all 2^32 of them with
// SPARSEMLA_EXHAUSTIVE=1 (about a minute of CPU per 10^9 values); the
// lanes the kernel marks (its window, the domain bounds) go through exp32
// — with a window of 2^29 every lane does, and the results still match.
func TestExpFast(t *testing.T) {
	if !HasAVX512() {
		t.Log("no AVX-512: expFast is exp32 itself")
	}
	step := uint64(251)
	if testing.Short() {
		step = 4099 // (the race run)
	}
	if os.Getenv("SPARSEMLA_EXHAUSTIVE") == "1" {
		step = 1
	}
	n := expCheck(t, 0, 1<<32, step)
	t.Logf("%d values", n)
	// the fallback plumbing: every lane marked
	w0 := expWindow
	defer func() { expWindow = w0 }()
	expWindow = 1 << 29
	expCheck(t, 0xc2000000, 0xc2b00000, 4099) // −32 … −88
	// special values, and lengths that are not multiples of 8; the first
	// two are the only float32 whose kernel result rounds differently from
	// math.Exp's (the exhaustive run without the window, Go 1.26, Zen 5):
	// the window must catch them
	expWindow = w0
	src := []float32{math.Float32frombits(0xbf81eadf), math.Float32frombits(0x4283070f), 0, -1, 0, 0, 0, 0, 0, float32(math.Copysign(0, -1)), 1, -1, 88, 88.7, 89, -87.3, -87.4, -103, -150,
		float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()), 1e-45, -1e-45, 3.4e38, -3.4e38, 0.5, -0.25, -7}
	for n := 0; n <= len(src); n++ {
		dst := make([]float32, n)
		expFast(dst, src[:n])
		for i := range dst {
			if math.Float32bits(dst[i]) != math.Float32bits(exp32(src[i])) {
				t.Errorf("n %d: expFast(%g) = %g, exp32 %g", n, src[i], dst[i], exp32(src[i]))
			}
		}
	}
}
