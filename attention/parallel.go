package attention

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// parallelFor runs f over [0, n) in contiguous chunks on the caller and up
// to workers−1 helpers of a process-wide worker pool (workers =
// min(GOMAXPROCS, n)); no helper when work is small. Each goroutine owns a
// lane, a contiguous 1/workers of the indices (the caller lane 0, the k-th
// helper to join lane k), and takes it from its front in chunks of
// n/(32·workers) (at least one index), in index order; one whose lane is
// empty steals the back half (at least a chunk) of the lane with the most
// left, until none has any. So a goroutine walks one contiguous range of a
// weight in address order, starting afresh only when it steals, and a
// goroutine the OS delays — or a helper that never comes — has its lane
// taken from the back by the others, holding the call up by at most a
// chunk.
//
// (Until round 16 the chunks were guided: every goroutine took 1/(2·workers)
// of the indices still left from one shared counter, so each chunk started
// where another goroutine's had ended. Each such start costs the core a
// ramp of its hardware prefetcher: a 2 MiB read a call on the 2-core Zen 5
// VM took 43-47 µs in 128 KiB pieces and 36-37 µs in two 1 MiB halves, and
// the goroutines' busy time grew with the number of chunks, about 1-1.5 µs
// a chunk. Alternated in one process, lanes took the wq_a GEMV from
// 91.7-104.8 to 87.6-101.5 µs a call and that 2 MiB read from 49.8-51.4 to
// 47.4-48.6 µs; bench/README.md, round 16.) Callers only write disjoint
// outputs per index and compute each index the same way whoever runs it,
// so results do not depend on the split or the number of goroutines.
//
// The pool's workers are long-lived goroutines (started once, GOMAXPROCS−1
// of them): after a job they spin for poolSpinNs (spinUntil) — unless more
// calls are in flight than half the Ps (crowded) — before they park. A
// decode step is a chain of GEMVs of 20-700 µs each; starting fresh
// goroutines for each one (the previous form of this function) woke parked
// OS threads one after the other for every call, and a parked thread takes
// an OS wake-up (140 µs median on the GPU host's VM) to join. Spinning
// workers join the next call within a microsecond. They join without a
// lock (the job list is an immutable snapshot, a helper slot is taken by
// compare-and-swap): a mutex that 15 workers reach at once puts most of
// them to sleep on its semaphore, the very wake-up cost the pool avoids.
//
// Concurrent calls (a layer's four branches, a model step's layers) all sit
// in the pool's job list; a free worker joins the listed job with the
// fewest helpers, so no call is left to its caller alone while another has
// every helper (a process-wide budget tried before did that: the first
// call took all helpers until it ended), and each caller always works on
// its own job, so a call finishes even when every worker is busy
// elsewhere (nested calls included).
func parallelFor(n int, work int, f func(lo, hi int)) {
	procs := runtime.GOMAXPROCS(0)
	workers := min(procs, n)
	if workers <= 1 || work < 1<<16 {
		f(0, n)
		return
	}
	helpersStarted.Add(int64(workers - 1))
	j := newPoolJob(f, n, workers)
	// spin only when every P can have a core: with GOMAXPROCS above the
	// CPUs the process may use, a spinning worker takes CPU time from the
	// goroutines doing the work
	if spin := procs <= numCPU; thePool.spin.Load() != spin {
		thePool.spin.Store(spin)
	}
	if thePool.procs.Load() != int32(procs) {
		thePool.procs.Store(int32(procs))
	}
	thePool.calls.Add(1)
	thePool.submit(j, workers-1)
	trace(evListed)
	j.loop(0)
	trace(evLaneEnd)
	// close the job to new helpers (it is dropped from the list at the next
	// submit), then wait for those still on a chunk: they finish within a
	// chunk's time, so spin briefly before blocking
	joined := j.state.Or(jobClosed) &^ jobClosed
	if !spinUntil(func() bool { return j.done.Load() == joined }, nil) {
		<-j.fin
	}
	trace(evWaitEnd)
	thePool.calls.Add(-1)
}

// poolEvent is a point in a parallel call's life that poolTrace reports.
type poolEvent int

const (
	evQuantised poolEvent = iota // FP8Panels.Linear: the activation is quantised (caller)
	evListed                     // the job is listed for the pool's helpers (caller)
	evJoined                     // a helper joined the job (each helper)
	evLaneEnd                    // the caller found no index left to take
	evHelperEnd                  // a helper found no index left to take (each helper)
	evWaitEnd                    // the last helper has finished: the call returns (caller)
	poolEvents
)

// poolTrace, when set, is called at each poolEvent of every parallel call,
// on the goroutine the event happens on (so it must be safe for concurrent
// use). Only BenchmarkFP8CallTimeline sets it, to show where a small GEMV's
// time goes; unset, each event costs one atomic load.
var poolTrace atomic.Pointer[func(poolEvent)]

// trace reports ev to poolTrace when it is set.
func trace(ev poolEvent) {
	if f := poolTrace.Load(); f != nil {
		(*f)(ev)
	}
}

// ParallelFor is parallelFor for the packages above attention (the engine's
// per-head stages): f(lo, hi) over chunks of [0, n) on the worker pool, work
// the call's cost in multiply-add-sized units (below 2^16, no helper). f must
// write only its own indices' outputs and compute each index the same way
// whoever runs it.
func ParallelFor(n int, work int, f func(lo, hi int)) { parallelFor(n, work, f) }

// poolSpinNs is how long (ns) an idle pool worker keeps looking for a job
// before it parks (and a caller polls for its helpers before it blocks).
var poolSpinNs = func() *atomic.Int64 {
	var v atomic.Int64
	v.Store(int64(50 * time.Microsecond))
	return &v
}()

// SetPoolSpin sets how long the fast paths' idle pool workers spin looking
// for the next parallel call before they park (default 50 µs), and returns
// the previous value. It changes no result, only speed: a parked worker
// takes an OS wake-up to join the next call (about 140 µs median, 340 µs at
// the 90th percentile on the GPU host's Firecracker VM), a spinning one
// joins within a microsecond but holds its core meanwhile.
func SetPoolSpin(d time.Duration) time.Duration {
	return time.Duration(poolSpinNs.Swap(int64(d)))
}

// numCPU is the number of CPUs the process may use (its affinity at start).
var numCPU = runtime.NumCPU()

// spinUntil polls cond for up to poolSpinNs (not at all when the pool's
// spin flag is off, or once stop, when given, reports true) and reports
// whether cond became true. It polls in a plain loop (an atomic load every
// iteration) and never yields: a runtime.Gosched per iteration (the first
// form) made 15 idle workers hammer the scheduler's global run queue lock,
// and one every 2048 iterations (the second) still cost each call at 16
// threads ≈ 25 µs of workers joining late (GPU host: wq_a 59 → 85 % of the
// streaming read, wkv 41 → 71 % without it). A spinning worker holds its P
// at most poolSpinNs, and not at all while crowded.
func spinUntil(cond, stop func() bool) bool {
	if !thePool.spin.Load() || (stop != nil && stop()) {
		return cond()
	}
	t0 := time.Now()
	for i := 1; ; i++ {
		if cond() {
			return true
		}
		if i%2048 == 0 {
			if time.Since(t0) > time.Duration(poolSpinNs.Load()) || (stop != nil && stop()) {
				return false
			}
		}
	}
}

// crowded reports whether more parallel calls are in flight than half the
// Ps: their callers then keep the Ps busy, and an idle worker that spins
// would only hold a P one of them needs (a V4-Flash model step running 16
// layers at once at GOMAXPROCS 16 took 76-79 ms with workers that park at
// once, 79-84 ms with a 50 µs spin, on the GPU host), so it parks instead.
// With fewer — a chain of GEMVs, a layer's four branches — an idle worker
// spins, to join the next call without an OS wake-up.
func (p *workPool) crowded() bool { return 2*p.calls.Load() > p.procs.Load() }

// jobClosed is the bit of poolJob.state set once the caller has taken its
// last chunk: no helper joins after it.
const jobClosed = 1 << 30

// poolJob is one parallelFor call.
type poolJob struct {
	f     func(lo, hi int)
	chunk int64           // what a goroutine takes from its lane's front
	lanes []atomic.Uint64 // [workers] each lane's indices not yet taken, [front, back) (packLane)
	cap   int32           // most helpers the call asks for
	state atomic.Int32    // helpers joined, | jobClosed once closed
	done  atomic.Int32    // helpers finished
	fin   chan struct{}   // closed by the last helper to finish once the job is closed
}

// newPoolJob is the job of f over [0, n) in workers lanes: lane w is
// [w·n/workers, (w+1)·n/workers).
func newPoolJob(f func(lo, hi int), n, workers int) *poolJob {
	j := &poolJob{f: f, chunk: int64(max(1, n/(32*workers))), lanes: make([]atomic.Uint64, workers), cap: int32(workers - 1), fin: make(chan struct{})}
	for w := range workers {
		j.lanes[w].Store(packLane(int64(w*n/workers), int64((w+1)*n/workers)))
	}
	return j
}

// packLane packs a lane's range [front, back) into one word (front in the
// low 32 bits), so that its owner and a thief claim from it by one
// compare-and-swap; n < 2^31 (parallelFor's n is an int of items: weight
// panels, heads, rows).
func packLane(front, back int64) uint64 { return uint64(front) | uint64(back)<<32 }

// unpackLane is packLane's inverse.
func unpackLane(v uint64) (front, back int64) { return int64(v & 0xffffffff), int64(v >> 32) }

// loop runs lane's indices from its front, then steals from the other
// lanes until every index is taken.
func (j *poolJob) loop(lane int) {
	for {
		lo, hi, ok := j.takeFront(lane)
		if !ok {
			break
		}
		j.f(int(lo), int(hi))
	}
	for {
		lo, hi, ok := j.steal()
		if !ok {
			return
		}
		j.f(int(lo), int(hi))
	}
}

// takeFront claims the next chunk at the front of lane's range.
func (j *poolJob) takeFront(lane int) (lo, hi int64, ok bool) {
	l := &j.lanes[lane]
	for {
		v := l.Load()
		f, b := unpackLane(v)
		if f >= b {
			return 0, 0, false
		}
		e := min(b, f+j.chunk)
		if l.CompareAndSwap(v, packLane(e, b)) {
			return f, e, true
		}
	}
}

// steal claims the back half (at least a chunk) of the lane with the most
// indices left (false: every index is taken).
func (j *poolJob) steal() (lo, hi int64, ok bool) {
	for {
		best, most := -1, int64(0)
		var bv uint64
		for i := range j.lanes {
			v := j.lanes[i].Load()
			if f, b := unpackLane(v); b-f > most {
				best, most, bv = i, b-f, v
			}
		}
		if best < 0 {
			return 0, 0, false
		}
		f, b := unpackLane(bv)
		s := max(f, b-max(j.chunk, most/2))
		if j.lanes[best].CompareAndSwap(bv, packLane(f, s)) {
			return s, b, true
		}
	}
}

// hasWork reports whether some lane has an index not yet taken (read by a
// worker looking for a job, not on a chunk's path).
func (j *poolJob) hasWork() bool {
	for i := range j.lanes {
		if f, b := unpackLane(j.lanes[i].Load()); f < b {
			return true
		}
	}
	return false
}

// join takes a helper slot of j and returns its lane (false: closed, full
// or every index taken).
func (j *poolJob) join() (int, bool) {
	for {
		s := j.state.Load()
		if s&jobClosed != 0 || s >= j.cap || !j.hasWork() {
			return 0, false
		}
		if j.state.CompareAndSwap(s, s+1) {
			return int(s) + 1, true
		}
	}
}

// leave ends a helper's part; the last one out of a closed job wakes the
// caller if it blocks.
func (j *poolJob) leave() {
	d := j.done.Add(1)
	if s := j.state.Load(); s&jobClosed != 0 && d == s&^jobClosed {
		close(j.fin)
	}
}

// workPool is the process-wide pool of helper goroutines.
type workPool struct {
	// jobs lists the calls in flight: an immutable snapshot, replaced by
	// compare-and-swap; a closed job stays listed (take skips it) until the
	// next submit drops it, so that a call's end costs no list update
	jobs    atomic.Pointer[[]*poolJob]
	gen     atomic.Int64 // jobs submitted
	spin    atomic.Bool  // idle workers and waiting callers spin (GOMAXPROCS ≤ CPUs)
	calls   atomic.Int32 // parallel calls in flight
	procs   atomic.Int32 // GOMAXPROCS at the latest call
	started atomic.Int32 // workers started
	parked  atomic.Int32 // workers parked on cond, or about to check gen and park
	mu      sync.Mutex   // guards starting workers, and cond
	cond    sync.Cond
}

var thePool = func() *workPool {
	p := &workPool{}
	p.cond.L = &p.mu
	return p
}()

// submit lists j (dropping the closed jobs), starts workers up to want,
// and wakes parked ones. Only when a worker must be started or woken does
// it take the lock. (The list was updated under the lock at each call's
// start and again at its end, to retire the call: on the 2-core Zen 5 VM
// the retiring took ≈ 0.9 µs of a 44 µs wkv call, closing the job takes ≈
// 0.05 µs; the listing takes ≈ 0.8 µs either way, most of it the spinning
// helpers' cache lines changing hands.)
func (p *workPool) submit(j *poolJob, want int) {
	for {
		old := p.jobs.Load()
		var list []*poolJob
		if old != nil {
			list = make([]*poolJob, 0, len(*old)+1)
			for _, o := range *old {
				if o.state.Load()&jobClosed == 0 {
					list = append(list, o)
				}
			}
		}
		list = append(list, j)
		if p.jobs.CompareAndSwap(old, &list) {
			break
		}
	}
	p.gen.Add(1)
	// a worker adds itself to parked before it checks gen (worker), and
	// this checks parked after gen moved: either the worker sees the new
	// gen and does not park, or this sees it parked and wakes it
	if int(p.started.Load()) < want || p.parked.Load() > 0 {
		p.mu.Lock()
		for int(p.started.Load()) < want {
			p.started.Add(1)
			go p.worker()
		}
		for range min(int(p.parked.Load()), want) {
			p.cond.Signal()
		}
		p.mu.Unlock()
	}
}

// take joins the listed job with indices left and the fewest helpers, and
// returns it with the helper's lane (nil when none takes a helper).
func (p *workPool) take() (*poolJob, int) {
	for {
		list := p.jobs.Load()
		if list == nil {
			return nil, 0
		}
		var best *poolJob
		bh := int32(0)
		for _, j := range *list {
			s := j.state.Load()
			if s&jobClosed != 0 || s >= j.cap || !j.hasWork() {
				continue
			}
			if best == nil || s < bh {
				best, bh = j, s
			}
		}
		if best == nil {
			return nil, 0
		}
		if lane, ok := best.join(); ok {
			return best, lane
		}
	}
}

// worker runs jobs; when no listed job takes a helper (a job's helper
// count only grows until it closes, so only a new submission can change
// that) it spins poolSpin waiting for one, then parks.
func (p *workPool) worker() {
	for {
		seen := p.gen.Load()
		if j, lane := p.take(); j != nil {
			trace(evJoined)
			j.loop(lane)
			trace(evHelperEnd)
			j.leave()
			continue
		}
		if spinUntil(func() bool { return p.gen.Load() != seen }, p.crowded) {
			continue
		}
		p.mu.Lock()
		p.parked.Add(1)
		if p.gen.Load() == seen {
			p.cond.Wait()
		}
		p.parked.Add(-1)
		p.mu.Unlock()
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
