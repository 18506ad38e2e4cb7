package attention

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"sparsemla/quant"
)

// TestFP8ProductsSpreadOverGoroutines: an FP8 product (Linear, LinearPlain,
// WoA) on checkpoint-like codes starts as many helper goroutines as on
// uniform or all-subnormal codes — GOMAXPROCS−1 per call for a weight of
// the V4-Flash sizes, so more than one goroutine at GOMAXPROCS 2 — and none
// of its panels takes the reference loop. The split must depend on the
// shapes and GOMAXPROCS only, never on the code values (the 43-layer step
// on checkpoint-like codes was measured with only 2 cores busy at 16
// threads; this test rules out the code values as the cause).
func TestFP8ProductsSpreadOverGoroutines(t *testing.T) {
	if !HasAssembly() {
		t.Skip("no AVX2 kernels on this machine/build")
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	const rows, cols = 1024, 4096 // wq_a and one wo_a group of V4-Flash
	rng := rand.New(rand.NewPCG(31, 32))
	x := bf16Vec(rng, cols, 2)
	o := bf16Vec(rng, 8*cols, 0.5)
	counts := map[string]int64{}
	for _, dist := range fp8Dists {
		codes, scale := distCodes(rng, dist, rows, cols)
		p := PackFP8(codes, scale, rows, cols)
		woa := &WoAPanels{Groups: 8, Rank: rows}
		for range woa.Groups {
			woa.FP8 = append(woa.FP8, p)
		}
		y, u := make([]float32, rows), make([]float32, 8*rows)
		for _, procs := range []int{2, 16} {
			runtime.GOMAXPROCS(procs)
			for _, c := range []struct {
				name string
				f    func()
			}{
				{"Linear", func() { p.Linear(y, x) }},
				{"LinearPlain", func() { p.LinearPlain(y, x) }},
				{"WoA", func() { woa.WoA(u, o) }},
			} {
				r0, h0 := ReferencePanels(), ParallelHelpers()
				c.f()
				h, r := ParallelHelpers()-h0, ReferencePanels()-r0
				what := fmt.Sprintf("%s codes, %s, GOMAXPROCS %d", dist, c.name, procs)
				if r != 0 {
					t.Errorf("%s: %d panels ran the reference loop", what, r)
				}
				if h != int64(procs-1) {
					t.Errorf("%s: %d helper goroutines, want %d (one call, split over GOMAXPROCS)", what, h, procs-1)
				}
				key := fmt.Sprint(c.name, procs)
				if want, ok := counts[key]; ok && h != want {
					t.Errorf("%s: %d helper goroutines, %s codes gave %d", what, h, fp8Dists[0], want)
				}
				counts[key] = h
			}
		}
	}
}

// TestParallelForPool: the worker pool runs every index of every call
// exactly once — calls from many goroutines at once, calls nested in a
// chunk of another call, GOMAXPROCS changed between calls (1, 2, 16, 3) —
// and each call returns only when all its chunks are done.
func TestParallelForPool(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, procs := range []int{1, 2, 16, 3} {
		runtime.GOMAXPROCS(procs)
		const callers, n = 24, 1000
		errs := make(chan string, callers)
		for c := range callers {
			go func() {
				hits := make([]int32, n)
				inner := make([]int32, 7*n)
				parallelFor(n, 1<<20, func(lo, hi int) {
					for i := lo; i < hi; i++ {
						hits[i]++
						if i%97 == 0 { // a nested call inside a chunk
							parallelFor(7, 1<<20, func(lo, hi int) {
								for k := lo; k < hi; k++ {
									inner[7*i+k]++
								}
							})
						}
					}
				})
				for i, h := range hits {
					if h != 1 {
						errs <- fmt.Sprintf("GOMAXPROCS %d caller %d: index %d ran %d times", procs, c, i, h)
						return
					}
					for k := range 7 {
						if want := int32(0); i%97 == 0 && inner[7*i+k] != 1 || i%97 != 0 && inner[7*i+k] != want {
							errs <- fmt.Sprintf("GOMAXPROCS %d caller %d: nested index %d/%d ran %d times", procs, c, i, k, inner[7*i+k])
							return
						}
					}
				}
				errs <- ""
			}()
		}
		for range callers {
			if e := <-errs; e != "" {
				t.Error(e)
			}
		}
	}
}

// TestPoolJobLanes: a call's indices are run lane by lane — a goroutine
// takes its own lane from the front in chunks, in index order, and one
// whose lane is empty steals the back half (at least a chunk) of the lane
// with the most left — and every index exactly once. The caller alone runs
// a job of three lanes (its helpers never join), as when every pool worker
// is busy elsewhere, so the order is deterministic.
func TestPoolJobLanes(t *testing.T) {
	for _, c := range []struct{ n, workers int }{{300, 3}, {8, 2}, {64, 16}, {7, 3}, {1000, 4}} {
		var got [][2]int
		j := newPoolJob(func(lo, hi int) { got = append(got, [2]int{lo, hi}) }, c.n, c.workers)
		j.loop(0)
		// the model: lanes [w·n/W, (w+1)·n/W), chunk max(1, n/(32·W))
		chunk := max(1, c.n/(32*c.workers))
		front, back := make([]int, c.workers), make([]int, c.workers)
		for w := range c.workers {
			front[w], back[w] = w*c.n/c.workers, (w+1)*c.n/c.workers
		}
		var want [][2]int
		for front[0] < back[0] {
			e := min(back[0], front[0]+chunk)
			want = append(want, [2]int{front[0], e})
			front[0] = e
		}
		for {
			best, most := -1, 0
			for w := range c.workers {
				if back[w]-front[w] > most {
					best, most = w, back[w]-front[w]
				}
			}
			if best < 0 {
				break
			}
			s := max(front[best], back[best]-max(chunk, most/2))
			want = append(want, [2]int{s, back[best]})
			back[best] = s
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("n %d, %d lanes: chunks %v, want %v", c.n, c.workers, got, want)
		}
		seen := make([]int, c.n)
		for _, r := range got {
			for i := r[0]; i < r[1]; i++ {
				seen[i]++
			}
		}
		for i, k := range seen {
			if k != 1 {
				t.Errorf("n %d, %d lanes: index %d ran %d times", c.n, c.workers, i, k)
			}
		}
		if j.hasWork() {
			t.Errorf("n %d, %d lanes: indices left untaken after the loop", c.n, c.workers)
		}
		if _, ok := j.join(); ok {
			t.Errorf("n %d, %d lanes: a helper joined a job with every index taken", c.n, c.workers)
		}
	}
}

// TestPoolTrace: with poolTrace set, every parallel call reports its
// caller's points in order (listed, lane end, wait end; for an FP8 Linear,
// quantised first), each helper that joined reports its lane's end before
// the caller's wait ends, and no more helpers join than the call asks for.
// BenchmarkFP8CallTimeline's spans are built on these.
func TestPoolTrace(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(4))
	type rec struct {
		ev  poolEvent
		seq int64
	}
	var (
		mu   sync.Mutex
		recs []rec
		seq  atomic.Int64
	)
	f := func(ev poolEvent) {
		s := seq.Add(1)
		mu.Lock()
		recs = append(recs, rec{ev, s})
		mu.Unlock()
	}
	poolTrace.Store(&f)
	defer poolTrace.Store(nil)
	w := fp8Copies("checkpoint", 512, 4096)[0]
	x := bf16Vec(rand.New(rand.NewPCG(1, 2)), 4096, 1)
	y := make([]float32, 512)
	for call := range 200 {
		recs = recs[:0]
		if call%2 == 0 {
			w.Linear(y, x)
		} else {
			parallelFor(64, 1<<20, func(lo, hi int) {})
		}
		at := map[poolEvent][]int64{}
		for _, r := range recs {
			at[r.ev] = append(at[r.ev], r.seq)
		}
		for _, ev := range []poolEvent{evListed, evLaneEnd, evWaitEnd} {
			if len(at[ev]) != 1 {
				t.Fatalf("call %d: event %d seen %d times, want once: %v", call, ev, len(at[ev]), recs)
			}
		}
		order := []int64{at[evListed][0], at[evLaneEnd][0], at[evWaitEnd][0]}
		if call%2 == 0 {
			if len(at[evQuantised]) != 1 {
				t.Fatalf("call %d: quantised seen %d times, want once", call, len(at[evQuantised]))
			}
			order = append([]int64{at[evQuantised][0]}, order...)
		} else if len(at[evQuantised]) != 0 {
			t.Fatalf("call %d: a parallelFor that quantises nothing reported quantised", call)
		}
		if !slices.IsSorted(order) {
			t.Fatalf("call %d: the caller's events out of order: %v", call, recs)
		}
		if n := len(at[evJoined]); n != len(at[evHelperEnd]) || n > 3 {
			t.Fatalf("call %d: %d helpers joined, %d ended (at most 3 may join)", call, n, len(at[evHelperEnd]))
		}
		for _, s := range at[evHelperEnd] {
			if s > at[evWaitEnd][0] {
				t.Fatalf("call %d: a helper ended after the caller's wait: %v", call, recs)
			}
		}
	}
	// unset, nothing is reported
	poolTrace.Store(nil)
	recs = recs[:0]
	w.Linear(y, x)
	if len(recs) != 0 {
		t.Fatalf("poolTrace unset: %d events reported", len(recs))
	}
}

// TestPlainBlockRange: the bit-level range check of LinearPlain's inputs
// (plainRangeAVX2 and plainRangeGo) gives the float64 form's results (smallest nonzero and largest magnitude,
// every value bf16) on blocks with zeros, ±0, subnormals, infinities, NaN
// and values that are not bf16.
func TestPlainBlockRange(t *testing.T) {
	defer func(old bool) { UseAssembly = old }(UseAssembly)
	rng := rand.New(rand.NewPCG(7, 8))
	special := []float32{0, float32(math.Copysign(0, -1)), 0x1p-130, -0x1p-149, 0x1p127, float32(math.Inf(1)), float32(math.Inf(-1)),
		float32(math.NaN()), math.Float32frombits(0x7fc00000), math.Float32frombits(0xff800001), 1.0000001, -3, 0.5}
	for trial := range 3000 {
		v := make([]float32, ActBlock)
		for i := range v {
			switch rng.IntN(4) {
			case 0:
				v[i] = special[rng.IntN(len(special))]
			case 1:
				v[i] = 0
			default:
				v[i] = quant.BF16Round(float32(rng.NormFloat64() * math.Exp2(float64(rng.IntN(60)-30))))
			}
		}
		if trial%3 == 0 { // mostly clean blocks too
			for i := range v {
				if v[i] != v[i] || quant.BF16Round(v[i]) != v[i] {
					v[i] = 1
				}
			}
		}
		wlo, whi, wok := math.Inf(1), 0.0, true
		for _, f := range v {
			a := math.Abs(float64(f))
			wok = wok && quant.BF16Round(f) == f
			if a != 0 {
				wlo, whi = min(wlo, a), max(whi, a)
			}
		}
		for _, asm := range []bool{true, false} {
			if asm && !HasAssembly() {
				continue
			}
			UseAssembly = asm
			lo, hi, ok := plainBlockRange(v)
			if ok != wok || ok && (lo != wlo || hi != whi) {
				t.Fatalf("trial %d (assembly %v): plainBlockRange = %v %v %v, float form %v %v %v", trial, asm, lo, hi, ok, wlo, whi, wok)
			}
		}
	}
}

// BenchmarkParallelForRoundTrip: the fixed cost of one parallel call — 64
// items of ≈ 1 µs each (a small GEMV's split) over GOMAXPROCS goroutines,
// back to back, as a decode step's chain of GEMVs issues them (compare
// -cpu 1, -cpu 2 and -cpu 16, one process each: with Go 1.26 the first
// entry of a -cpu list does not set GOMAXPROCS for a b.Loop benchmark; the
// items alone take 64 µs on one core).
func BenchmarkParallelForRoundTrip(b *testing.B) {
	var sink [64]float64
	for b.Loop() {
		parallelFor(64, 1<<20, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				s := float64(i)
				for k := range 300 {
					s = s*0.999 + float64(k)
				}
				sink[i] = s
			}
		})
	}
}
