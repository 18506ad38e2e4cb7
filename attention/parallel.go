package attention

import (
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// parallelFor runs f over [0, n) in contiguous chunks of about
// n/(8·workers) indices (workers = min(GOMAXPROCS, n)) that the caller and
// up to workers−1 helpers of a process-wide worker pool take from a shared
// counter (so a goroutine the OS delays does not hold the others up); no
// helper when work is small. Callers only write disjoint outputs per index
// and compute each index the same way whoever runs it, so results do not
// depend on the split or the number of goroutines.
//
// The pool's workers are long-lived goroutines (started once, GOMAXPROCS−1
// of them): after a job they spin for poolSpin, yielding the processor to
// any other runnable goroutine, before they park. A decode step is a chain
// of GEMVs of 20-700 µs each; starting fresh goroutines for each one (the
// previous form of this function) woke parked OS threads one after the
// other for every call — on the 16-core GPU host a ramp of tens of µs per
// call, which capped the small weights (wkv, wq_a) at 12-25 % of the
// streaming read. Spinning workers join the next call within a
// microsecond.
//
// Concurrent calls (a layer's four branches, a model step's layers) all sit
// in the pool's job list; a free worker joins the listed job with the
// fewest helpers, so no call is left to its caller alone while another has
// every helper (a process-wide budget tried before did that: the first
// call took all helpers until it ended), and each caller always works on
// its own job, so a call finishes even when every worker is busy
// elsewhere (nested calls included).
func parallelFor(n int, work int, f func(lo, hi int)) {
	workers := min(runtime.GOMAXPROCS(0), n)
	if workers <= 1 || work < 1<<16 {
		f(0, n)
		return
	}
	helpersStarted.Add(int64(workers - 1))
	j := &poolJob{f: f, n: int64(n), chunk: int64(max(1, n/(8*workers))), cap: int32(workers - 1)}
	thePool.submit(j, workers-1)
	j.loop()
	thePool.retire(j)
	// wait for the helpers still on a chunk: they finish within a chunk's
	// time, so spin briefly before blocking
	for i := 0; j.busy.Load() != 0; i++ {
		if i < 1000 {
			runtime.Gosched()
			continue
		}
		j.wg.Wait()
		break
	}
}

// poolSpin is how long an idle pool worker keeps looking for a job before
// it parks.
const poolSpin = 100 * time.Microsecond

// poolJob is one parallelFor call.
type poolJob struct {
	f        func(lo, hi int)
	n, chunk int64
	next     atomic.Int64 // first index not yet taken
	cap      int32        // most helpers the call asks for
	helpers  int32        // helpers joined (under pool.mu)
	busy     atomic.Int32 // helpers joined and not yet done
	wg       sync.WaitGroup
}

// loop takes chunks until none is left.
func (j *poolJob) loop() {
	for {
		lo := j.next.Add(j.chunk) - j.chunk
		if lo >= j.n {
			return
		}
		j.f(int(lo), int(min(j.n, lo+j.chunk)))
	}
}

// workPool is the process-wide pool of helper goroutines.
type workPool struct {
	mu      sync.Mutex
	cond    sync.Cond
	jobs    []*poolJob   // calls with chunks left (under mu)
	gen     atomic.Int64 // jobs submitted, read without the lock by spinning workers
	started int          // workers started (under mu)
	parked  int          // workers waiting on cond (under mu)
}

var thePool = func() *workPool {
	p := &workPool{}
	p.cond.L = &p.mu
	return p
}()

// submit lists j, starts workers up to want, and wakes parked ones.
func (p *workPool) submit(j *poolJob, want int) {
	p.mu.Lock()
	p.jobs = append(p.jobs, j)
	p.gen.Add(1)
	for p.started < want {
		p.started++
		go p.worker()
	}
	for range min(p.parked, want) {
		p.cond.Signal()
	}
	p.mu.Unlock()
}

// retire removes j from the list (its caller found no chunk left).
func (p *workPool) retire(j *poolJob) {
	p.mu.Lock()
	if i := slices.Index(p.jobs, j); i >= 0 {
		p.jobs = slices.Delete(p.jobs, i, i+1)
	}
	p.mu.Unlock()
}

// take joins the listed job with chunks left and the fewest helpers (nil
// when there is none), unlisting jobs whose chunks are all taken. Under mu.
func (p *workPool) take() *poolJob {
	var best *poolJob
	for i := 0; i < len(p.jobs); {
		j := p.jobs[i]
		if j.next.Load() >= j.n {
			p.jobs = slices.Delete(p.jobs, i, i+1)
			continue
		}
		if j.helpers < j.cap && (best == nil || j.helpers < best.helpers) {
			best = j
		}
		i++
	}
	if best != nil {
		best.helpers++
		best.busy.Add(1)
		best.wg.Add(1)
	}
	return best
}

// worker runs jobs; when no listed job takes a helper (a job's helper
// count only grows, so only a new submission can change that) it spins
// poolSpin waiting for one, yielding the processor, then parks.
func (p *workPool) worker() {
	p.mu.Lock()
	for {
		if j := p.take(); j != nil {
			p.mu.Unlock()
			j.loop()
			j.busy.Add(-1)
			j.wg.Done()
			p.mu.Lock()
			continue
		}
		seen := p.gen.Load()
		p.mu.Unlock()
		t0 := time.Now()
		for i := 1; p.gen.Load() == seen; i++ {
			if i%32 == 0 && time.Since(t0) > poolSpin {
				break
			}
			runtime.Gosched()
		}
		p.mu.Lock()
		if p.gen.Load() == seen {
			p.parked++
			p.cond.Wait()
			p.parked--
		}
	}
}

// helpersStarted counts the helpers parallelFor calls have asked the pool
// for since the process began (ParallelHelpers).
var helpersStarted atomic.Int64

// ParallelHelpers is the number of helpers the fast paths' parallel loops
// have asked for since the process began (workers−1 per parallel call,
// workers = min(GOMAXPROCS, items)): the tests check that a product on
// checkpoint-like weights spreads over as many goroutines as one on any
// other codes (the split depends on the shapes and GOMAXPROCS only).
func ParallelHelpers() int64 { return helpersStarted.Load() }
