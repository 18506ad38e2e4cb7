package prefixcheck

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"sparsemla/kvcache"
)

// v4FlashSchedule is DeepSeek-V4-Flash's cache schedule: window 128, ratios
// [0, 0, 4, 128, 4, 128, …] over 43 layers.
func v4FlashSchedule() kvcache.Schedule {
	r := []int{0, 0}
	for len(r) < 43 {
		if len(r)%2 == 0 {
			r = append(r, 4)
		} else {
			r = append(r, 128)
		}
	}
	return kvcache.Schedule{Window: 128, Ratios: r}
}

// benchWorkload yields n requests of 4096 tokens: 32 system prompts of 1024
// tokens; half the requests branch from one of the last 512 (sharing 1024 to
// 3071 tokens, any alignment), the rest only share a system prompt. The
// recorded hit is what a correct engine with an unbounded cache would reuse
// (the shared length rounded down to the page), so the 1M-token cache's
// evictions show up as evicted-page warnings.
type benchWorkload struct {
	rng     *rand.Rand
	prompts [][]int32
	recent  [][]int32
	ids     []string
	n       int
	page    int
}

func newBenchWorkload(page int) *benchWorkload {
	w := &benchWorkload{rng: rand.New(rand.NewPCG(19, 1)), page: page}
	for i := 0; i < 32; i++ {
		p := make([]int32, 1024)
		for j := range p {
			p[j] = int32(w.rng.IntN(1 << 17))
		}
		w.prompts = append(w.prompts, p)
	}
	return w
}

func (w *benchWorkload) next() Request {
	const L, ring = 4096, 512
	s := make([]int32, L)
	shared, src := 1024, ""
	if len(w.recent) > 0 && w.rng.IntN(2) == 0 {
		k := w.rng.IntN(len(w.recent))
		shared = 1024 + w.rng.IntN(2048)
		copy(s, w.recent[k][:shared])
		src = w.ids[k]
	} else {
		copy(s, w.prompts[w.rng.IntN(len(w.prompts))])
	}
	for i := shared; i < L; i++ {
		s[i] = int32(w.rng.IntN(1 << 17))
	}
	id := "r" + strconv.Itoa(w.n)
	w.n++
	q := Request{ID: id, Tokens: s}
	if src != "" {
		q.Hit = &Hit{Tokens: shared / w.page * w.page, Source: src}
	}
	if len(w.recent) < ring {
		w.recent, w.ids = append(w.recent, s), append(w.ids, id)
	} else {
		k := w.rng.IntN(ring)
		w.recent[k], w.ids[k] = s, id
	}
	return q
}

// cpuTime is the process's user + system CPU time (all threads, the GC's
// included): on a shared, loaded machine a steadier figure than wall time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func vmHWM() float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}

// BenchmarkGroundTruth100k runs the correct cache (page 256, V4-Flash
// schedule, 1M-token capacity, LRU) over 100k requests of 4096 tokens and
// reports the time per request and the peak heap (sampled every 1000
// requests) and peak RSS. Retain 1024: the token streams of the last 1024
// requests are kept (all of them would be 1.6 GB of int32). Run it alone:
//
//	go test -run X -bench GroundTruth100k -benchtime 1x ./prefixcheck
func BenchmarkGroundTruth100k(b *testing.B) {
	benchGroundTruth(b, 100_000)
}

// BenchmarkGroundTruth10k is the same with 10k requests (a quicker look).
func BenchmarkGroundTruth10k(b *testing.B) {
	benchGroundTruth(b, 10_000)
}

func benchGroundTruth(b *testing.B, n int) {
	const page = 256
	cfg := Config{PageSize: page, Schedule: v4FlashSchedule(), Capacity: 1 << 20, Retain: 1024, Brief: true}
	for b.Loop() {
		runtime.GC()
		w := newBenchWorkload(page)
		r, err := NewRunner(cfg, Trace{Input: "bench", HitsRecorded: true})
		if err != nil {
			b.Fatal(err)
		}
		var peak uint64
		var ms runtime.MemStats
		cpu0 := cpuTime()
		start := time.Now()
		for i := 0; i < n; i++ {
			q := w.next()
			if _, err := r.Add(&q); err != nil {
				b.Fatal(err)
			}
			if i%1000 == 999 {
				runtime.ReadMemStats(&ms)
				peak = max(peak, ms.HeapAlloc)
			}
		}
		el := time.Since(start)
		cpu := cpuTime() - cpu0
		rep := r.Report()
		b.ReportMetric(float64(el.Nanoseconds())/float64(n), "ns/request")
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(n), "cpu-ns/request")
		b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
		b.ReportMetric(vmHWM(), "peak-RSS-MiB")
		b.ReportMetric(float64(rep.Summary.Agree), "agree")
		b.ReportMetric(float64(rep.Summary.Warn), "warn")
		b.ReportMetric(float64(rep.Summary.Diverged), "diverged")
		if u := r.cache.Usage(); u.Tokens > cfg.Capacity {
			b.Fatalf("cache holds %d tokens, capacity %d", u.Tokens, cfg.Capacity)
		}
	}
}

// benchRun runs tr through a Runner per iteration and reports the CPU time
// per run (cpu-ns/op: steadier than wall time on a shared machine).
// reinsert inserts a snapshot at every page end of every request, as Add did
// before it left out those the cache holds (Runner.reinsertSnaps).
func benchRun(b *testing.B, tr *Trace, cfg Config, reinsert bool, check func(*Report) error) {
	var cpu time.Duration
	for b.Loop() {
		cpu0 := cpuTime()
		r, err := NewRunner(cfg, *tr)
		if err != nil {
			b.Fatal(err)
		}
		r.reinsertSnaps = reinsert
		for i := range tr.Requests {
			if _, err := r.Add(&tr.Requests[i]); err != nil {
				b.Fatal(err)
			}
		}
		rep := r.Report()
		cpu += cpuTime() - cpu0
		if err := check(rep); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
}

// BenchmarkRunEventChain runs the correct cache (V4-Flash schedule) over the
// trace of a KV-event chain of 2,800 one-token blocks (chainStream: page 1,
// every request one token longer than the one before, so request i matches
// the i tokens of the one before and adds one), ResumeAtEndOnly off and on,
// as Add inserts snapshots (new) and with every snapshot inserted again
// (reinsert). The trace is built once; only the run is timed.
func BenchmarkRunEventChain(b *testing.B) {
	batches, err := DecodeEvents(chainStream(2800, false), "chain")
	if err != nil {
		b.Fatal(err)
	}
	tr, err := EventsTrace(batches, "chain", EventsOptions{})
	if err != nil {
		b.Fatal(err)
	}
	for _, atEnd := range []bool{false, true} {
		for _, reinsert := range []bool{false, true} {
			name := "atEnd=" + strconv.FormatBool(atEnd) + "/new"
			if reinsert {
				name = "atEnd=" + strconv.FormatBool(atEnd) + "/reinsert"
			}
			b.Run(name, func(b *testing.B) {
				cfg := Config{PageSize: tr.PageSize, Schedule: v4FlashSchedule(), ResumeAtEndOnly: atEnd, Brief: true}
				benchRun(b, tr, cfg, reinsert, func(rep *Report) error {
					if rep.Summary.Requests != 2800 {
						return fmt.Errorf("%d requests", rep.Summary.Requests)
					}
					return nil
				})
			})
		}
	}
}

// BenchmarkRunMultiTurn runs the correct cache (page 16, V4-Flash schedule)
// over 16 interleaved conversations of 64 turns: each turn resends the
// conversation so far and adds 200 to 1,000 tokens (up to ~38k tokens, ~2,400
// pages, all but the last turn's matched); new and reinsert as in
// BenchmarkRunEventChain.
func BenchmarkRunMultiTurn(b *testing.B) {
	const page, convs, turns = 16, 16, 64
	rng := rand.New(rand.NewPCG(5, 7))
	var reqs []Request
	hist := make([][]int32, convs)
	for t := 0; t < turns; t++ {
		for c := 0; c < convs; c++ {
			prev := len(hist[c])
			for range 200 + rng.IntN(800) {
				hist[c] = append(hist[c], int32(rng.IntN(1<<17)))
			}
			q := Request{ID: "c" + strconv.Itoa(c) + "t" + strconv.Itoa(t), Tokens: hist[c][:len(hist[c]):len(hist[c])]}
			if t > 0 {
				q.Hit = &Hit{Tokens: prev / page * page, Source: "c" + strconv.Itoa(c) + "t" + strconv.Itoa(t-1)}
			}
			reqs = append(reqs, q)
		}
	}
	tr := &Trace{Input: "multiturn", PageSize: page, HitsRecorded: true, Requests: reqs}
	cfg := Config{PageSize: page, Schedule: v4FlashSchedule(), Brief: true}
	for _, reinsert := range []bool{false, true} {
		name := "new"
		if reinsert {
			name = "reinsert"
		}
		b.Run(name, func(b *testing.B) {
			benchRun(b, tr, cfg, reinsert, func(rep *Report) error {
				if rep.Summary.Diverged != 0 || rep.Summary.Agree != len(reqs) {
					return fmt.Errorf("summary %+v", rep.Summary)
				}
				return nil
			})
		})
	}
}
