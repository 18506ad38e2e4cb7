package attention

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// parallelFor runs f over [0, n) in contiguous chunks that the caller and
// min(GOMAXPROCS, n)−1 helper goroutines, started for this call, take from a
// shared counter (so a goroutine the OS delays does not hold the others up),
// no helper when work is small. Every call gets its own helpers, also when
// other calls run concurrently (the branches of a layer step, the layers of
// a model step): the Go scheduler shares the cores among all of them. (A
// process-wide budget of GOMAXPROCS−1 helpers, tried before, starved
// concurrent calls: the first call took every helper and a long call that
// started meanwhile — the indexer's scoring, the 32 MiB wq_b — ran on its
// caller alone or with one helper to its end, so a CSA-layer step at 16
// threads was no faster than at 4.) Callers only write disjoint outputs per
// index and compute each index the same way whoever runs it, so results do
// not depend on the split or the number of goroutines.
func parallelFor(n int, work int, f func(lo, hi int)) {
	workers := min(runtime.GOMAXPROCS(0), n)
	if workers <= 1 || work < 1<<16 {
		f(0, n)
		return
	}
	chunk := max(1, n/(8*workers))
	var next atomic.Int64
	loop := func() {
		for {
			lo := int(next.Add(int64(chunk))) - chunk
			if lo >= n {
				return
			}
			f(lo, min(n, lo+chunk))
		}
	}
	var wg sync.WaitGroup
	helpersStarted.Add(int64(workers - 1))
	for range workers - 1 {
		wg.Go(loop)
	}
	loop()
	wg.Wait()
}

// helpersStarted counts the helper goroutines parallelFor has started since
// the process began (ParallelHelpers).
var helpersStarted atomic.Int64

// ParallelHelpers is the number of helper goroutines the fast paths'
// parallel loops have started since the process began: the tests check that
// a product on checkpoint-like weights spreads over as many goroutines as one
// on any other codes (the split depends on the shapes and GOMAXPROCS only).
func ParallelHelpers() int64 { return helpersStarted.Load() }
