package attention

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"sparsemla/quant"
)

// Benchmarks of the fast kernels at the V4-Flash dims (dim 4096, q_lora_rank
// 1024, 64 heads × 512, o_groups 8 × o_lora_rank 1024, indexer 64 × 128).
// Each reports GB/s of weight (or cache) bytes read and GFLOP/s (2 per
// multiply-add) beside ns/op. Weights are generated here; several copies are
// cycled so that the working set (≥ 256 MiB) exceeds the caches and the bytes
// really come from memory:
//
//	go test ./attention -run '^$' -bench 'StreamRead|FP8Panels|Panels|SparseAttnFast|IndexScoresFast' -count 5

// streamBuf is a 512 MiB buffer for the streaming-read baseline.
var streamBuf []byte

// BenchmarkStreamRead is the memory bandwidth baseline: a plain sequential
// read of 512 MiB, on one goroutine and on GOMAXPROCS goroutines (disjoint
// parts), three ways: "sum" adds the buffer as uint64 words in a plain Go
// loop (its speed can be bound by the loop, not the memory), "scan" is
// bytes.IndexByte looking for a byte that is not there (the runtime's vector
// loop), "load" ORs it in 32-byte vector loads (loadReadAVX2: nothing but
// the loads; 4-6 % faster than scan on the 2-core Zen 5 VM, bench/README.md
// round 17). The FP8 GEMV target is ≥ 80 % of the parallel figure: the FP8
// benchmarks report the ratio to scan as %stream (the figure of every round
// so far) and to load as %load (the stricter one).
func BenchmarkStreamRead(b *testing.B) {
	getStreamBuf()
	sum := func(v []byte) uint64 {
		var s0, s1, s2, s3 uint64
		for i := 0; i+32 <= len(v); i += 32 {
			s0 += binary.LittleEndian.Uint64(v[i:])
			s1 += binary.LittleEndian.Uint64(v[i+8:])
			s2 += binary.LittleEndian.Uint64(v[i+16:])
			s3 += binary.LittleEndian.Uint64(v[i+24:])
		}
		return s0 + s1 + s2 + s3
	}
	for _, how := range []string{"sum", "scan", "load"} {
		f := map[string]func([]byte) uint64{"sum": sum, "scan": scanRead, "load": loadRead}[how]
		for _, par := range []bool{false, true} {
			b.Run(how+map[bool]string{false: "/1core", true: "/allcores"}[par], func(b *testing.B) {
				if how == "load" && !useAsm() {
					b.Skip("no AVX2 loads on this machine/build")
				}
				var sink uint64
				for b.Loop() {
					if !par {
						sink += f(streamBuf)
						continue
					}
					n := runtime.GOMAXPROCS(0)
					var g errgroup.Group
					part := make([]uint64, n)
					for w := 0; w < n; w++ {
						g.Go(func() error {
							part[w] = f(streamBuf[w*len(streamBuf)/n : (w+1)*len(streamBuf)/n])
							return nil
						})
					}
					g.Wait()
					for _, s := range part {
						sink += s
					}
				}
				b.ReportMetric(float64(len(streamBuf))*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
				_ = sink
			})
		}
	}
}

// copiesFor returns how many copies of an n-byte weight make ≥ 256 MiB.
func copiesFor(n int) int { return max(1, (256<<20+n-1)/n) }

// flashFP8 lists the FP8 attention weights of a V4-Flash layer [rows, cols].
var flashFP8 = []struct {
	name       string
	rows, cols int
}{
	{"wq_a", 1024, 4096}, {"wq_b", 64 * 512, 1024}, {"wkv", 512, 4096}, {"wo_b", 4096, 8 * 1024}, {"indexer.wq_b", 64 * 128, 1024},
}

// randCodes makes a packed FP8 weight from uniformly random finite codes
// (5.5 % of them E4M3 subnormals) and scales near 2^-8 (no fp32 copy, so
// that hundreds of MiB are cheap to make).
func randCodes(rng *rand.Rand, rows, cols int) *FP8Panels {
	codes := make([]uint8, rows*cols)
	for i := range codes {
		c := uint8(rng.Uint32())
		if c&0x7f == 0x7f {
			c ^= 1
		}
		codes[i] = c
	}
	return PackFP8(codes, benchScales(rng, rows, cols), rows, cols)
}

func benchScales(rng *rand.Rand, rows, cols int) []uint8 {
	scale := make([]uint8, ((rows+127)/128)*(cols/128))
	for i := range scale {
		scale[i] = uint8(127 - 12 + rng.IntN(4))
	}
	return scale
}

// Code distributions of the FP8 benchmarks:
//   - checkpoint: what a checkpoint holds — each 128×128 block of normal
//     samples (σ = 0.02·2^[-1, 1] per block) quantised with its own scale
//     2^ceil(log2(amax/448)), as QuantizeFP8Weight does (almost no subnormal
//     codes);
//   - uniform: uniformly random finite codes (5.5 % subnormal), what the
//     benchmarks used before;
//   - subnormal: the worst case, every code one of the 16 E4M3 subnormals
//     (±m·2^-9), as in a block dominated by one outlier.
var fp8Dists = []string{"checkpoint", "uniform", "subnormal"}

// distCodes makes row-major codes [rows, cols] of distribution dist and
// their block scales.
func distCodes(rng *rand.Rand, dist string, rows, cols int) (codes, scale []uint8) {
	codes = make([]uint8, rows*cols)
	switch dist {
	case "uniform":
		for i := range codes {
			if c := uint8(rng.Uint32()); c&0x7f != 0x7f {
				codes[i] = c
			} else {
				codes[i] = c ^ 1
			}
		}
		return codes, benchScales(rng, rows, cols)
	case "subnormal":
		for i := range codes {
			codes[i] = uint8(rng.Uint32()) & 0x87
		}
		return codes, benchScales(rng, rows, cols)
	}
	br, bc := (rows+127)/128, cols/128
	scale = make([]uint8, br*bc)
	blk := make([]float32, 128*128)
	for bi := 0; bi < br; bi++ {
		for bj := 0; bj < bc; bj++ {
			sd := 0.02 * math.Exp2(2*rng.Float64()-1)
			nr := min(rows, bi*128+128) - bi*128
			var amax float32
			for i := range blk[:nr*128] {
				blk[i] = float32(rng.NormFloat64() * sd)
				amax = max(amax, abs32(blk[i]))
			}
			e := quant.Ceil2Exp(amax / quant.E4M3Max)
			scale[bi*bc+bj] = uint8(e + 127)
			s := quant.Pow2(e)
			for r := 0; r < nr; r++ {
				for k := 0; k < 128; k++ {
					codes[(bi*128+r)*cols+bj*128+k] = quant.EncodeE4M3(blk[r*128+k] / s)
				}
			}
		}
	}
	return codes, scale
}

// benchWeights caches one packed weight per (distribution, shape); copies
// share its scales and copy its codes.
var benchWeights sync.Map

// fp8Copies returns enough distinct copies of a packed weight of dist
// (≥ 256 MiB in all) that each call reads from memory, not the caches.
func fp8Copies(dist string, rows, cols int) []*FP8Panels {
	key := fmt.Sprint(dist, rows, cols)
	v, ok := benchWeights.Load(key)
	if !ok {
		rng := rand.New(rand.NewPCG(uint64(len(dist)), uint64(rows*cols)))
		codes, scale := distCodes(rng, dist, rows, cols)
		v, _ = benchWeights.LoadOrStore(key, PackFP8(codes, scale, rows, cols))
	}
	p := v.(*FP8Panels)
	ws := make([]*FP8Panels, copiesFor(rows*cols))
	ws[0] = p
	for i := 1; i < len(ws); i++ {
		c := *p
		c.Codes = append([]uint8(nil), p.Codes...)
		ws[i] = &c
	}
	return ws
}

// getStreamBuf returns the 512 MiB streaming-read buffer (no zero byte).
func getStreamBuf() []byte {
	if streamBuf == nil {
		streamBuf = make([]byte, 512<<20)
		for i := range streamBuf {
			streamBuf[i] = byte(i%251) | 1
		}
	}
	return streamBuf
}

// streamGBs is this process's all-core streaming read at the current
// GOMAXPROCS now: the median of 3 parallel scans of 512 MiB (the runtime's
// vector loop, as BenchmarkStreamRead/scan/allcores).
func streamGBs() float64 {
	buf := getStreamBuf()
	var rates []float64
	for range 3 {
		t0 := time.Now()
		streamSegment(buf, 0, len(buf))
		rates = append(rates, float64(len(buf))/time.Since(t0).Seconds()/1e9)
	}
	slices.Sort(rates)
	return rates[1]
}

// streamSegment reads buf[off:off+n] (wrapping at the end) on GOMAXPROCS
// goroutines, disjoint parts, with the runtime's vector scan.
func streamSegment(buf []byte, off, n int) {
	procs := runtime.GOMAXPROCS(0)
	var g errgroup.Group
	for w := 0; w < procs; w++ {
		g.Go(func() error {
			lo, hi := off+w*n/procs, off+(w+1)*n/procs
			for lo < hi {
				a := lo % len(buf)
				e := min(len(buf), a+hi-lo)
				bytes.IndexByte(buf[a:e], 0)
				lo += e - a
			}
			return nil
		})
	}
	g.Wait()
}

// streamWindow is how many weight bytes a benchmark reads between two
// streaming-read samples (streamPair): 64 MiB, and 8 MiB per thread above 8
// threads, so that a window's reading takes milliseconds.
func streamWindow() int64 { return max(64<<20, int64(runtime.GOMAXPROCS(0))<<23) }

// poolStream reads buf[off:off+n] (wrapping at the end) with parallelFor
// in 256 KiB items — the pool the GEMVs run on, so that the streaming read
// and the calls it is paired with start their helpers alike.
func poolStream(buf []byte, off, n int) { poolReadItems(buf, off, n, 256<<10, scanRead) }

// poolLoad is poolStream with vector loads (loadRead) instead of the scan.
func poolLoad(buf []byte, off, n int) { poolReadItems(buf, off, n, 256<<10, loadRead) }

// scanRead is the streaming read's scan: bytes.IndexByte for a byte the
// buffer does not hold.
func scanRead(v []byte) uint64 { return uint64(bytes.IndexByte(v, 0) + 1) }

// loadRead ORs every byte of v into the byte i%8 of a word (byte i of v),
// its multiple of 256 bytes with loadReadAVX2 (AVX2 only), the rest in Go.
func loadRead(v []byte) uint64 {
	n := len(v) &^ 255
	var r uint64
	if n > 0 {
		r = loadReadAVX2(&v[0], n)
	}
	for i := n; i < len(v); i++ {
		r |= uint64(v[i]) << (8 * (i % 8))
	}
	return r
}

// poolReadItems reads buf[off:off+n] (wrapping at the end) with read, in
// items of the given size, on the worker pool. (Neither read can be
// dropped by the compiler: one is assembly, the other the runtime's.)
func poolReadItems(buf []byte, off, n, item int, read func([]byte) uint64) {
	items := (n + item - 1) / item
	parallelFor(items, n, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			a := (off + i*item) % len(buf)
			e := min(len(buf), a+min(item, n-i*item))
			read(buf[a:e])
		}
	})
}

// streamPair measures a GEMV benchmark against the streaming read in
// alternating windows: after every streamWindow() weight bytes read by the
// calls (timed), the same number of bytes is read from a 512 MiB buffer on
// the same worker pool (poolStream, timed too); each window gives the ratio
// (stream time)/(calls' time). Where the CPU has AVX2, as many bytes more
// are then read with vector loads (poolLoad, the next part of the buffer)
// for a second ratio, %load. On a machine shared with other work the load
// moves both figures of a window alike, so the median ratio holds where a
// GB/s figure and a separately measured stream read (the previous form of
// %stream) moved 3-10× between runs.
//
// The pair keeps its own clock of the calls' time (ns/op and GB/s are
// reported from it) instead of stopping the benchmark's timer around the
// stream read: B.StopTimer and B.StartTimer each call runtime.ReadMemStats,
// which stops the world, and what ran after it was slower (the first call
// after one waited 20-70 µs for its helper, against 5-15 µs later). wkv at
// 2 threads on the 2-core Zen 5 VM took 62-71 µs a call with a
// Stop/StartTimer pair every 32 calls against 52-57 µs without
// (BenchmarkTimerStopCost, five processes), and the stream read after the
// pair was slowed more than the calls, so %stream came out higher than it
// is (four alternated processes: wkv 71 against 69 %, wq_a 81 against 76
// %). A decode step stops no world between its GEMVs (no GC runs with the
// weights live).
type streamPair struct {
	b       *testing.B
	perCall int64 // weight bytes one call reads
	n       int64 // bytes read by calls in the current window
	t0      time.Time
	calls   time.Duration // the calls' time in the windows already closed
	off     int
	ratios  []float64
	rates   []float64 // GB/s of each window's streaming read
	lratios []float64 // the same with the vector-load read (poolLoad)
	lrates  []float64
}

// newStreamPair starts the pairing; call tick after every call in b.Loop
// and report after it.
func newStreamPair(b *testing.B, perCall int64) *streamPair {
	getStreamBuf()
	return &streamPair{b: b, perCall: perCall, t0: time.Now()}
}

// tick counts one call and, at the end of a window, takes its sample.
func (s *streamPair) tick() {
	s.n += s.perCall
	if s.n < streamWindow() {
		return
	}
	tg := time.Since(s.t0)
	s.calls += tg
	r, g := s.window(poolStream, tg)
	s.ratios, s.rates = append(s.ratios, r), append(s.rates, g)
	if useAsm() {
		r, g := s.window(poolLoad, tg)
		s.lratios, s.lrates = append(s.lratios, r), append(s.lrates, g)
	}
	s.n = 0
	s.t0 = time.Now()
}

// window reads the window's bytes with read from the buffer's next part and
// returns the ratio of its time to the calls' time tg, and its GB/s.
func (s *streamPair) window(read func(buf []byte, off, n int), tg time.Duration) (ratio, gbs float64) {
	t0 := time.Now()
	read(streamBuf, s.off, int(s.n))
	d := time.Since(t0)
	s.off = (s.off + int(s.n)) % len(streamBuf)
	return d.Seconds() / tg.Seconds(), float64(s.n) / d.Seconds() / 1e9
}

// report writes ns/op and GB/s of weight bytes from the calls' own clock
// (the stream reads left out), GFLOP/s (2 per multiply-add),
// %stream (the median window ratio; with no complete window, the ratio to
// a stream read measured after the loop), stream-GB/s (the windows' median
// streaming read) and pairs (the windows).
func (s *streamPair) report(macs int64) {
	b := s.b
	sec := (s.calls + time.Since(s.t0)).Seconds() / float64(b.N)
	b.ReportMetric(sec*1e9, "ns/op")
	gbs := float64(s.perCall) / sec / 1e9
	b.ReportMetric(gbs, "GB/s")
	b.ReportMetric(2*float64(macs)/sec/1e9, "GFLOP/s")
	if len(s.ratios) == 0 {
		st := streamGBs()
		b.ReportMetric(100*gbs/st, "%stream")
		b.ReportMetric(st, "stream-GB/s")
		b.ReportMetric(0, "pairs")
		return
	}
	b.ReportMetric(100*median(s.ratios), "%stream")
	b.ReportMetric(median(s.rates), "stream-GB/s")
	b.ReportMetric(float64(len(s.ratios)), "pairs")
	if len(s.lratios) > 0 {
		b.ReportMetric(100*median(s.lratios), "%load")
		b.ReportMetric(median(s.lrates), "load-GB/s")
	}
}

// median of v (v is reordered).
func median(v []float64) float64 {
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// BenchmarkTimerStopCost is why streamPair keeps its own clock: the wkv
// GEMV (checkpoint codes) with nothing between the calls (plain), and with a
// B.StopTimer/B.StartTimer pair every 32 calls (stoptimer, what streamPair
// did before) — the stopped time is not counted, yet ns/op rises: each pair
// stops the world twice (runtime.ReadMemStats) and the calls after it are
// slower.
func BenchmarkTimerStopCost(b *testing.B) {
	for _, mode := range []string{"plain", "stoptimer"} {
		b.Run(mode, func(b *testing.B) {
			ws := fp8Copies("checkpoint", 512, 4096)
			rng := rand.New(rand.NewPCG(1, 512))
			x := bf16Vec(rng, 4096, 1)
			y := make([]float32, 512)
			i := 0
			for b.Loop() {
				ws[i%len(ws)].Linear(y, x)
				if i++; mode == "stoptimer" && i%32 == 0 {
					b.StopTimer()
					b.StartTimer()
				}
			}
		})
	}
}

// BenchmarkStreamReadPerCall is the streaming read done the way a GEMV of
// the same size reads its weight: n bytes a call (2, 4 and 6 MiB: wkv, wq_a,
// wq_a + wkv) through the same worker pool, in items of at most 256 KiB and
// at least 8 per goroutine, cycling through the 512 MiB buffer, paired with
// the window streaming read as the GEMVs are (%stream). It is what a GEMV of
// that size would reach if its kernel cost nothing: the fork/join, the
// helpers' start and the last item's imbalance, paid once per call, are in
// it, and the 64 MiB windows pay them once per window.
func BenchmarkStreamReadPerCall(b *testing.B) {
	for _, n := range []int{2 << 20, 4 << 20, 6 << 20} {
		b.Run(fmt.Sprint(n>>20, "MiB"), func(b *testing.B) {
			buf := getStreamBuf()
			item := min(256<<10, max(4<<10, n/(8*runtime.GOMAXPROCS(0))&^(4<<10-1)))
			off := len(buf) / 2 // away from the windows' start
			sp := newStreamPair(b, int64(n))
			for b.Loop() {
				poolReadItems(buf, off, n, item, scanRead)
				off = (off + n) % len(buf)
				sp.tick()
			}
			sp.report(0)
		})
	}
}

// BenchmarkFP8PanelsLinear: FP8Linear on the packed V4-Flash weights, for
// each code distribution (fp8Dists). The kernels' speed must not depend on
// it. Compare thread counts one process each (with Go 1.26 the first entry
// of a -cpu list does not set GOMAXPROCS for a b.Loop benchmark):
//
//	go test ./attention -run '^$' -bench 'FP8Panels' -cpu 2 -count 5
func BenchmarkFP8PanelsLinear(b *testing.B) {
	for _, dist := range fp8Dists {
		for _, w := range flashFP8 {
			b.Run(dist+"/"+w.name, func(b *testing.B) {
				ws := fp8Copies(dist, w.rows, w.cols)
				rng := rand.New(rand.NewPCG(1, uint64(w.rows)))
				x := bf16Vec(rng, w.cols, 1)
				y := make([]float32, w.rows)
				i := 0
				sp := newStreamPair(b, int64(w.rows*w.cols))
				for b.Loop() {
					ws[i%len(ws)].Linear(y, x)
					i++
					sp.tick()
				}
				sp.report(int64(w.rows * w.cols))
			})
		}
	}
}

// BenchmarkFP8PanelsLinearShared: V4-Flash's wq_a and wkv (both read the
// attention input) in one LinearShared call, as PreparedLayer.Step runs them
// — compare with the two FP8PanelsLinear figures.
func BenchmarkFP8PanelsLinearShared(b *testing.B) {
	for _, dist := range fp8Dists {
		b.Run(dist+"/wq_a+wkv", func(b *testing.B) {
			qa, kv := fp8Copies(dist, 1024, 4096), fp8Copies(dist, 512, 4096)
			rng := rand.New(rand.NewPCG(1, 4096))
			x := bf16Vec(rng, 4096, 1)
			ys := [][]float32{make([]float32, 1024), make([]float32, 512)}
			i := 0
			sp := newStreamPair(b, 1536*4096)
			for b.Loop() {
				LinearShared([]*FP8Panels{qa[i%len(qa)], kv[i%len(kv)]}, ys, x)
				i++
				sp.tick()
			}
			sp.report(1536 * 4096)
		})
	}
}

// BenchmarkFP8CallTimeline is where a small GEMV's time goes: wkv and wq_a
// (checkpoint codes) called one after another as in FP8PanelsLinear, with
// poolTrace timing each call's points (poolEvent) from its start. Reported,
// each the median over the calls (µs):
//
//	call-µs    the whole call
//	quant-µs   start → activation quantised (scratch, quantizeActFast)
//	list-µs    quantised → job listed (the job's checks, listing)
//	join-µs    listed → the last helper to join joined (a helper can join
//	           before the caller reports listed, so a call's span can be < 0)
//	lanes-µs   listed → the later of the caller's and the helpers' lanes ran dry
//	spread-µs  |caller's lane end − last helper's lane end| (imbalance)
//	wait-µs    the later lane end → the call sees its last helper done
//	helpers    helpers that joined (mean), alone-% calls that none joined
//
// join-µs, spread-µs and wait-µs are over the calls some helper joined.
// The clock reads add a little to each call; call-µs is not a rate to
// compare with FP8PanelsLinear's.
//
//	go test ./attention -run '^$' -bench FP8CallTimeline -cpu 16
func BenchmarkFP8CallTimeline(b *testing.B) {
	for _, w := range flashFP8 {
		if w.name != "wkv" && w.name != "wq_a" {
			continue
		}
		b.Run("checkpoint/"+w.name, func(b *testing.B) {
			ws := fp8Copies("checkpoint", w.rows, w.cols)
			rng := rand.New(rand.NewPCG(1, uint64(w.rows)))
			x := bf16Vec(rng, w.cols, 1)
			y := make([]float32, w.rows)
			var tl callTimeline
			f := tl.record
			poolTrace.Store(&f)
			defer poolTrace.Store(nil)
			var m timelineMedians
			i := 0
			for b.Loop() {
				tl.start()
				ws[i%len(ws)].Linear(y, x)
				i++
				m.add(&tl, time.Since(tl.t0))
			}
			m.report(b)
		})
	}
}

// callTimeline is one call's poolEvent times, ns from t0 (−1: not seen);
// the helpers' events keep the latest helper's time.
type callTimeline struct {
	t0     time.Time
	at     [poolEvents]atomic.Int64
	joined atomic.Int32
}

// start resets the timeline before a call (set before the call lists its
// job, so the helpers that join it see t0).
func (c *callTimeline) start() {
	for i := range c.at {
		c.at[i].Store(-1)
	}
	c.joined.Store(0)
	c.t0 = time.Now()
}

// record is the poolTrace hook.
func (c *callTimeline) record(ev poolEvent) {
	t := time.Since(c.t0).Nanoseconds()
	if ev != evJoined && ev != evHelperEnd {
		c.at[ev].Store(t)
		return
	}
	if ev == evJoined {
		c.joined.Add(1)
	}
	for {
		o := c.at[ev].Load()
		if o >= t || c.at[ev].CompareAndSwap(o, t) {
			return
		}
	}
}

// timelineMedians collects the calls' spans (µs) for BenchmarkFP8CallTimeline.
type timelineMedians struct {
	call, quant, list, join, lanes, spread, wait []float64
	helpers, alone                               int
}

func (m *timelineMedians) add(c *callTimeline, total time.Duration) {
	at := func(ev poolEvent) float64 { return float64(c.at[ev].Load()) / 1e3 }
	m.call = append(m.call, float64(total.Nanoseconds())/1e3)
	if at(evQuantised) < 0 || at(evListed) < 0 {
		return // no parallel call (one thread)
	}
	m.quant = append(m.quant, at(evQuantised))
	m.list = append(m.list, at(evListed)-at(evQuantised))
	n := int(c.joined.Load())
	m.helpers += n
	if n == 0 {
		m.alone++
		m.lanes = append(m.lanes, at(evLaneEnd)-at(evListed))
		return
	}
	end := max(at(evLaneEnd), at(evHelperEnd))
	m.join = append(m.join, at(evJoined)-at(evListed))
	m.lanes = append(m.lanes, end-at(evListed))
	m.spread = append(m.spread, math.Abs(at(evHelperEnd)-at(evLaneEnd)))
	m.wait = append(m.wait, at(evWaitEnd)-end)
}

func (m *timelineMedians) report(b *testing.B) {
	b.ReportMetric(median(m.call), "call-µs")
	for _, r := range []struct {
		v    []float64
		unit string
	}{{m.quant, "quant-µs"}, {m.list, "list-µs"}, {m.join, "join-µs"}, {m.lanes, "lanes-µs"}, {m.spread, "spread-µs"}, {m.wait, "wait-µs"}} {
		if len(r.v) > 0 {
			b.ReportMetric(median(r.v), r.unit)
		}
	}
	if n := len(m.quant); n > 0 {
		b.ReportMetric(float64(m.helpers)/float64(n), "helpers")
		b.ReportMetric(100*float64(m.alone)/float64(n), "alone-%")
	}
}

// BenchmarkFP8PanelsInCache: the FP8 kernel's own speed, without the memory:
// FP8Linear on one [256, 2048] weight (512 KiB, cache-resident) per code
// distribution, on the benchmark's goroutine locked to its thread (run with
// -cpu 1) — what one core can widen and multiply, to compare with its share
// of the streaming read. GB/s-cpu divides by the thread's CPU time (Linux),
// which a machine shared with other work does not inflate.
func BenchmarkFP8PanelsInCache(b *testing.B) {
	for _, dist := range fp8Dists {
		b.Run(dist, func(b *testing.B) {
			rng := rand.New(rand.NewPCG(5, 6))
			codes, scale := distCodes(rng, dist, 256, 2048)
			p := PackFP8(codes, scale, 256, 2048)
			x := bf16Vec(rng, 2048, 1)
			y := make([]float32, 256)
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			c0, ok := threadCPU()
			n := 0
			for b.Loop() {
				p.Linear(y, x)
				n++
			}
			c1, _ := threadCPU()
			s := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(256*2048/s/1e9, "GB/s")
			if ok && c1 > c0 {
				b.ReportMetric(256*2048*float64(n)/(c1-c0)/1e9, "GB/s-cpu")
			}
		})
	}
}

// BenchmarkFP8PanelsWoA: wo_a in its prepared form (8 groups of [1024, 4096]
// FP8 codes, the bf16 GEMM run by LinearPlain), as PackWoA makes it from the
// checkpoint's weights, for each code distribution.
func BenchmarkFP8PanelsWoA(b *testing.B) {
	const G, R, gd = 8, 1024, 4096
	for _, dist := range fp8Dists {
		b.Run(dist, func(b *testing.B) {
			ws := make([]*WoAPanels, copiesFor(G*R*gd))
			grp := fp8Copies(dist, R, gd)
			for i := range ws {
				ws[i] = &WoAPanels{Groups: G, Rank: R}
				for g := 0; g < G; g++ {
					ws[i].FP8 = append(ws[i].FP8, grp[(i*G+g)%len(grp)])
				}
			}
			rng := rand.New(rand.NewPCG(3, 3))
			o := bf16Vec(rng, G*gd, 1)
			u := make([]float32, G*R)
			i := 0
			sp := newStreamPair(b, G*R*gd)
			for b.Loop() {
				ws[i%len(ws)].WoA(u, o)
				i++
				sp.tick()
			}
			sp.report(G * R * gd)
		})
	}
}

// BenchmarkFP8LinearReference is the scalar reference FP8Linear on the two
// largest weights, for the speed-up.
func BenchmarkFP8LinearReference(b *testing.B) {
	for _, w := range flashFP8[1:2] {
		b.Run(w.name, func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, uint64(w.rows)))
			p := randCodes(rng, w.rows, w.cols)
			fw := NewFP8Weight(unpack(p), p.Scale, w.rows, w.cols)
			x := bf16Vec(rng, w.cols, 1)
			y := make([]float32, w.rows)
			for b.Loop() {
				FP8Linear(y, x, fw)
			}
			s := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(2*float64(w.rows*w.cols)/s/1e9, "GFLOP/s")
		})
	}
}

// unpack returns the row-major codes of a packed weight.
func unpack(p *FP8Panels) []uint8 {
	codes := make([]uint8, p.Rows*p.Cols)
	for n := 0; n < p.Rows; n++ {
		for k := 0; k < p.Cols; k++ {
			codes[n*p.Cols+k] = p.Codes[(n/PanelRows*p.Cols+k)*PanelRows+n%PanelRows]
		}
	}
	return codes
}

// BenchmarkPanels: the bf16 / fp32 linears of a layer — wo_a (8 groups of
// [1024, 4096], bf16), weights_proj [64, 4096] (bf16), the compressor
// projections wkv + wgate [1024, 4096] (r = 4), [512, 4096] (r = 128) and
// [256, 4096] (indexer), stored bf16 (lossless for checkpoint weights).
func BenchmarkPanels(b *testing.B) {
	for _, w := range []struct {
		name       string
		rows, cols int
	}{{"wo_a", 8 * 1024, 4096}, {"weights_proj", 64, 4096}, {"cmp_r4.wkv", 1024, 4096}, {"cmp_r128.wkv", 512, 4096}, {"icmp.wkv", 256, 4096}} {
		b.Run(w.name, func(b *testing.B) {
			rng := rand.New(rand.NewPCG(2, uint64(w.rows)))
			ws := make([]*Panels, copiesFor(2*w.rows*w.cols))
			for i := range ws {
				ws[i] = PackPanels(bf16Vec(rng, w.rows*w.cols, 0.02), w.rows, w.cols)
			}
			x := bf16Vec(rng, w.cols, 1)
			y := make([]float32, w.rows)
			i := 0
			for b.Loop() {
				ws[i%len(ws)].Linear(y, x)
				i++
			}
			s := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(float64(ws[0].Bytes())/s/1e9, "GB/s")
			b.ReportMetric(2*float64(w.rows*w.cols)/s/1e9, "GFLOP/s")
		})
	}
}

// BenchmarkSparseAttnFast: 64 heads × 512 over an index list of 128 window
// rows + 512 compressed rows (a CSA or HCA layer at 64K context), fast and
// reference.
func BenchmarkSparseAttnFast(b *testing.B) {
	for _, fast := range []bool{true, false} {
		b.Run(map[bool]string{true: "fast", false: "reference"}[fast], func(b *testing.B) {
			q, kv, idx, sink := attnCase(3, 64, 128+16384, 640)
			o := make([]float32, len(q))
			for b.Loop() {
				if fast {
					SparseAttnFast(o, q, kv, 512, idx, sink, 0.044194173)
				} else {
					SparseAttn(o, q, kv, 512, idx, sink, 0.044194173)
				}
			}
			s := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(2*2*64*640*512/s/1e9, "GFLOP/s")
		})
	}
}

// BenchmarkIndexScoresFast: index_qk + index_score over Tc = ctx/4 index keys
// (64 heads × 128), the part of a CSA step that grows with the context. 1M
// context (Tc = 262,144, 128 MiB of keys) only with SPARSEMLA_BENCH_BIG=1.
func BenchmarkIndexScoresFast(b *testing.B) {
	ctxs := []int{4096, 65536}
	if os.Getenv("SPARSEMLA_BENCH_BIG") == "1" {
		ctxs = append(ctxs, 1<<20)
	}
	for _, ctx := range ctxs {
		tc := ctx / 4
		b.Run(fmt.Sprintf("ctx=%d", ctx), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(4, 4))
			iq, ic, w := bf16Vec(rng, 64*128, 1), bf16Vec(rng, tc*128, 1), bf16Vec(rng, 64, 0.1)
			// FP4-rounded per 32, as the V4 indexer's query and keys are
			// (the integer products need that form; SPARSEMLA_VNNI=0
			// keeps the fp32 kernel)
			quant.FQ4(iq, 32)
			quant.FQ4(ic, 32)
			score := make([]float32, tc)
			var keys *IndexKeys
			if os.Getenv("SPARSEMLA_INDEX_KEYS") != "0" {
				keys = new(IndexKeys) // kept between calls, as the engine's layer state does
			}
			for b.Loop() {
				IndexScoresKeys(score, iq, ic, keys, w, 64, 128)
			}
			s := b.Elapsed().Seconds() / float64(b.N)
			flop := 2 * 64 * 128 * float64(tc)
			b.ReportMetric(flop/s/1e9, "GFLOP/s")
			b.ReportMetric(flop/s/1e9/float64(runtime.GOMAXPROCS(0)), "GFLOP/s/core")
			b.ReportMetric(4*128*float64(tc)/s/1e9, "GB/s")
		})
	}
}

// BenchmarkQuantizeAct: the activation quantisation every FP8 GEMV call
// runs serially before its parallel part (quantizeActFast, 4096 values, as
// for wq_a and wkv) — its time is a fixed cost of each call.
func BenchmarkQuantizeAct(b *testing.B) {
	rng := rand.New(rand.NewPCG(7, 8))
	x := bf16Vec(rng, 4096, 1)
	q, xs, s := make([]float32, 4096), make([]float32, 4096), make([]float32, 4096/ActBlock)
	for b.Loop() {
		quantizeActFast(q, s, xs, x)
	}
}
