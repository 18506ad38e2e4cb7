package engine

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/metrics"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// Benchmarks of the prepared (fast) decode path at the real V4-Flash dims with
// random weights and caches generated here (nothing large is committed):
//
//	go test ./engine -run '^$' -bench 'Prepared|TopKFast|FastStages' -count 5
//	SPARSEMLA_BENCH_BIG=1 go test ./engine -run '^$' -bench 'PreparedModelStep|PreparedLayerStep' -benchtime 5x -count 5 -timeout 60m
//
// Each step benchmark reports ms/step, GB/s (packed weight bytes + the cache
// bytes the step reads) and GFLOP/s (2 per multiply-add of the linears, the
// indexer scoring and the attention). The 1M-token cases and the whole
// 43-layer step need SPARSEMLA_BENCH_BIG=1 (≈ 9 GiB for 43 layers at 64K).

func benchBig() bool { return os.Getenv("SPARSEMLA_BENCH_BIG") == "1" }

// fastRand fills a []float32 with bf16 values ±2^[lo, lo+3) quickly (random
// bits, not normal samples: enough for timing, never NaN or infinite).
func fastRand(rng *rand.Rand, n, lo int) []float32 {
	v := make([]float32, n)
	for i := 0; i < n; i += 4 {
		u := rng.Uint64()
		for j := 0; j < 4 && i+j < n; j++ {
			h := uint32(u >> (16 * j))
			exp := uint32(127+lo) + (h>>7)&3
			v[i+j] = math.Float32frombits((h&0x8000)<<16 | exp<<23 | (h&0x7f)<<16)
		}
	}
	return v
}

// FP8 code distributions of the step benchmarks (randPackedFP8):
//   - checkpoint (the default, what users run): each 128×128 block holds
//     normal samples quantised with the block's own scale, as
//     QuantizeFP8Weight and a real checkpoint do — the block's largest
//     magnitude in the top E4M3 binade, almost no subnormal code;
//   - uniform: uniformly random finite codes (5.5 % E4M3 subnormals, a
//     subnormal code in 97 % of the 64-code panel rows), what the
//     benchmarks drew before: a worse case for the kernels' widening.
var stepDists = []string{"checkpoint", "uniform"}

// normCodeTabs[f] maps 16 random bits u to the E4M3 code of
// Φ⁻¹((u+½)/2^16)·(224·2^(f/16))/Φ⁻¹(1−2^-17): a standard normal sample
// (tails at ±4.3σ, as the largest of a block's 16384 samples) scaled so
// that the block's largest magnitude falls in (224, 448] — the code a
// block quantiser with scale 2^ceil(log2(amax/448)) gives it. 16 levels
// of the per-block ratio amax/scale; one table lookup per code keeps the
// 5 GiB of the 43-layer step quick to generate.
var normCodeTabs = sync.OnceValue(func() *[16][1 << 16]uint8 {
	var t [16][1 << 16]uint8
	top := math.Sqrt2 * math.Erfinv(1-1.0/(1<<16))
	for f := range t {
		amax := 224 * math.Exp2(float64(f+1)/16)
		for u := range t[f] {
			v := math.Sqrt2 * math.Erfinv(2*(float64(u)+0.5)/(1<<16)-1)
			t[f][u] = quant.EncodeE4M3(float32(v / top * amax))
		}
	}
	return &t
})

// randPackedFP8 is a packed FP8 weight [rows, cols] with codes of
// distribution dist (stepDists) and block scales near 2^-12 (what FP8
// checkpoints hold for these widths).
func randPackedFP8(rng *rand.Rand, dist string, rows, cols int) *attention.FP8Panels {
	var codes, scale []uint8
	switch dist {
	case "uniform":
		codes = make([]uint8, rows*cols)
		for i := 0; i < len(codes); i += 8 {
			u := rng.Uint64()
			for j := 0; j < 8 && i+j < len(codes); j++ {
				c := uint8(u >> (8 * j))
				if c&0x7f == 0x7f {
					c ^= 1
				}
				codes[i+j] = c
			}
		}
		scale = fp8BenchScales(rng, rows, cols)
	case "checkpoint":
		codes, scale = checkpointFP8(rng, rows, cols)
	default:
		panic("randPackedFP8: unknown distribution " + dist)
	}
	return attention.PackFP8(codes, scale, rows, cols)
}

// checkpointFP8 is an FP8 weight [rows, cols] (row-major E4M3 codes and
// 128×128 UE8M0 block scales) with the "checkpoint" distribution of
// randPackedFP8.
func checkpointFP8(rng *rand.Rand, rows, cols int) (codes, scale []uint8) {
	codes = make([]uint8, rows*cols)
	tabs := normCodeTabs()
	bc := cols / 128
	lv := make([]uint8, ((rows+127)/128)*bc) // per block: its amax/scale level
	for i := range lv {
		lv[i] = uint8(rng.IntN(16))
	}
	for r := 0; r < rows; r++ {
		for b := 0; b < bc; b++ {
			tab := &tabs[lv[(r/128)*bc+b]]
			row := codes[r*cols+b*128 : r*cols+b*128+128]
			for k := 0; k < 128; k += 4 {
				u := rng.Uint64()
				row[k], row[k+1], row[k+2], row[k+3] = tab[uint16(u)], tab[uint16(u>>16)], tab[uint16(u>>32)], tab[uint16(u>>48)]
			}
		}
	}
	return codes, fp8BenchScales(rng, rows, cols)
}

// fp8BenchScales are block scales near 2^-12 (what FP8 checkpoints hold for
// these widths).
func fp8BenchScales(rng *rand.Rand, rows, cols int) []uint8 {
	scale := make([]uint8, ((rows+127)/128)*(cols/128))
	for i := range scale {
		scale[i] = uint8(127 - 12 + rng.IntN(3))
	}
	return scale
}

// benchLayer makes a prepared layer of the real dims with random weights and
// a random state of ctx tokens (next position = ctx+1, a step that emits no
// compressed row, so the step can be repeated on the same state).
func benchLayer(cfg *Config, dist string, layer, ctx int, seed uint64) (*PreparedLayer, *LayerState, *RopeTable, []float32, int64) {
	rng := rand.New(rand.NewPCG(seed, uint64(layer)))
	r := cfg.Ratio(layer)
	H, D, dim := cfg.NHeads, cfg.HeadDim, cfg.Dim
	gd := H * D / cfg.OGroups
	p := &PreparedLayer{Layer: layer, Ratio: r,
		WqA: randPackedFP8(rng, dist, cfg.QLoraRank, dim), WqB: randPackedFP8(rng, dist, H*D, cfg.QLoraRank),
		Wkv: randPackedFP8(rng, dist, D, dim), WoB: randPackedFP8(rng, dist, dim, cfg.OGroups*cfg.OLoraRank),
		QNorm: fastRand(rng, cfg.QLoraRank, -1), KVNorm: fastRand(rng, D, -1), AttnSink: fastRand(rng, H, -1),
	}
	// wo_a: the checkpoint's FP8, dequantised to bf16 by convert.py, re-encoded
	// by PackWoA as codes + scales (as Prepare does for real weights)
	woa := &attention.WoAPanels{Groups: cfg.OGroups, Rank: cfg.OLoraRank}
	for g := 0; g < cfg.OGroups; g++ {
		woa.FP8 = append(woa.FP8, randPackedFP8(rng, dist, cfg.OLoraRank, gd))
	}
	p.WoA = woa
	cmp := func(d int, rotate bool) (*attention.Compressor, *attention.Panels, *attention.Panels) {
		w := Coff(r) * d
		c := &attention.Compressor{Ratio: r, HeadDim: d, Dim: dim, Rotate: rotate, Eps: float32(cfg.NormEps),
			Wkv: fastRand(rng, w*dim, -8), Wgate: fastRand(rng, w*dim, -8), Ape: fastRand(rng, r*w, -2), Norm: fastRand(rng, d, -1)}
		return c, attention.PackPanels(c.Wkv, w, dim), attention.PackPanels(c.Wgate, w, dim)
	}
	pos := int64(ctx + 1)
	st := NewLayerState(cfg, layer)
	st.Next = pos
	st.KV = fastRand(rng, cfg.WindowSize*D, -1)
	fillState := func(cs *attention.CompressorState) {
		copy(cs.KV, fastRand(rng, len(cs.KV), -1))
		copy(cs.Score, fastRand(rng, len(cs.Score), -1))
	}
	if r > 0 {
		p.Compressor, p.CmpWkv, p.CmpWgate = cmp(D, false)
		st.KV = append(st.KV, fastRand(rng, int(pos/int64(r))*D, -1)...)
		fillState(st.Cmp)
	}
	if r == 4 {
		ix := &indexer.Indexer{NHeads: cfg.IndexNHeads, HeadDim: cfg.IndexHeadDim, TopK: cfg.IndexTopK}
		ix.Compressor, p.ICmpWkv, p.ICmpWgate = cmp(cfg.IndexHeadDim, true)
		p.Indexer = ix
		p.IWqB = randPackedFP8(rng, dist, cfg.IndexNHeads*cfg.IndexHeadDim, cfg.QLoraRank)
		p.IWeightsProj = attention.PackPanels(fastRand(rng, cfg.IndexNHeads*dim, -8), cfg.IndexNHeads, dim)
		// index keys on the FP4 grid, as the row path (Had → FQ4) leaves them
		st.ICache = fastRand(rng, st.Rows()*cfg.IndexHeadDim, -1)
		quant.FQ4(st.ICache, 32)
		fillState(st.ICmp)
	}
	return p, st, sharedRope(cfg, layer, ctx+2), fastRand(rng, dim, -1), pos
}

var ropeCache sync.Map // (r > 0, T) → *RopeTable

// sharedRope is the layer's RoPE table, shared by layers with the same
// parameters (SWA layers use one, r > 0 layers another).
func sharedRope(cfg *Config, layer, T int) *RopeTable {
	key := fmt.Sprint(cfg.Ratio(layer) > 0, T)
	if t, ok := ropeCache.Load(key); ok {
		return t.(*RopeTable)
	}
	t := LayerRope(cfg, layer, T)
	ropeCache.Store(key, t)
	return t
}

// stepCost is the arithmetic (FLOP, 2 per multiply-add) and the bytes a
// prepared step of layer p reads from weights and caches with Tc compressed
// rows and an index list of L entries.
func stepCost(cfg *Config, p *PreparedLayer, tc int) (flop, bytes float64) {
	bytes = float64(p.PackedBytes())
	var macs float64
	for _, w := range []*attention.FP8Panels{p.WqA, p.WqB, p.Wkv, p.WoB, p.IWqB} {
		if w != nil {
			macs += float64(w.Rows * w.Cols)
		}
	}
	macs += float64(p.WoA.MACs())
	for _, w := range []*attention.Panels{p.CmpWkv, p.CmpWgate, p.IWeightsProj, p.ICmpWkv, p.ICmpWgate} {
		if w != nil {
			macs += float64(w.Rows * w.Cols)
		}
	}
	L := cfg.WindowSize
	switch p.Ratio {
	case 4:
		macs += float64(cfg.IndexNHeads * cfg.IndexHeadDim * tc)
		bytes += float64(4 * cfg.IndexHeadDim * tc)
		L += min(cfg.IndexTopK, tc)
	case 128:
		L += tc
	}
	macs += float64(2 * cfg.NHeads * cfg.HeadDim * L)
	bytes += float64(4 * cfg.HeadDim * L)
	return 2 * macs, bytes
}

// stepClock measures the CPU time of a benchmark's timed loop: the
// process's (getrusage), the Go scheduler's (runtime/metrics) and the
// machine's (/proc/stat).
type stepClock struct {
	cpu0, busy0, steal0 float64
	user0, total0       float64
	ok, sysOK           bool
}

// startStepClock runs a GC (the Go scheduler's CPU classes are brought up to
// date at GC time), resets the benchmark timer and starts the clocks: call
// it right before the timed loop.
func startStepClock(b *testing.B) stepClock {
	var c stepClock
	c.user0, c.total0 = goCPU()
	b.ResetTimer()
	c.cpu0, c.ok = processCPU()
	c.busy0, c.steal0, c.sysOK = systemCPU()
	return c
}

// goCPU is the Go scheduler's estimate of the time its Ps have spent
// running goroutines (/cpu/classes/user:cpu-seconds: wall time of Ps that had
// work, whether or not the OS ran their threads) and of all Ps' time
// (/cpu/classes/total: GOMAXPROCS × wall), after a GC brings them up to date.
func goCPU() (user, total float64) {
	runtime.GC()
	s := []metrics.Sample{{Name: "/cpu/classes/user:cpu-seconds"}, {Name: "/cpu/classes/total:cpu-seconds"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64 || s[1].Value.Kind() != metrics.KindFloat64 {
		return 0, 0
	}
	return s[0].Value.Float64(), s[1].Value.Float64()
}

// reportStep reports ms/step, GB/s and GFLOP/s of the timed loop, and from
// the process CPU time cpu-ms/step (what the step costs, whatever the load)
// and cores (CPU seconds per wall second: how many cores the step kept busy,
// at most GOMAXPROCS). Three more figures per wall second tell why cores is
// below GOMAXPROCS:
//   - procs: Ps that had a goroutine to run, as the Go scheduler counts them
//     (runtime/metrics). procs ≪ GOMAXPROCS: the step left the cores idle
//     (too little parallel work, a serial stage, a lock); procs ≈ GOMAXPROCS
//     with cores ≪ procs: the goroutines were ready but the OS did not run
//     their threads (other processes, a CPU quota, the hypervisor);
//   - syscores: every process's busy CPU time on the machine (/proc/stat),
//     this one included: syscores − cores is other work;
//   - stealcores: time the hypervisor ran something else while a virtual
//     CPU wanted to run (/proc/stat steal).
func reportStep(b *testing.B, c stepClock, flop, bytes float64) {
	wall := b.Elapsed().Seconds()
	s := wall / float64(b.N)
	b.ReportMetric(s*1e3, "ms/step")
	b.ReportMetric(bytes/s/1e9, "GB/s")
	b.ReportMetric(flop/s/1e9, "GFLOP/s")
	if cpu, ok := processCPU(); ok && c.ok {
		per := (cpu - c.cpu0) / float64(b.N)
		b.ReportMetric(per*1e3, "cpu-ms/step")
		b.ReportMetric(per/s, "cores")
	}
	busy, steal, ok := systemCPU()
	b.StopTimer()
	if ok && c.sysOK {
		b.ReportMetric((busy-c.busy0)/wall, "syscores")
		b.ReportMetric((steal-c.steal0)/wall, "stealcores")
	}
	if u, tot := goCPU(); tot > c.total0 {
		// the share of all Ps' time that ran goroutines, times GOMAXPROCS
		b.ReportMetric(float64(runtime.GOMAXPROCS(0))*(u-c.user0)/(tot-c.total0), "procs")
	}
}

// BenchmarkPreparedLayerStep: one decode step of an SWA (layer 0), CSA (layer
// 2) and HCA (layer 3) layer at contexts 4K and 64K (1M with
// SPARSEMLA_BENCH_BIG=1), with checkpoint-like FP8 codes (KIND/ctx=N) and
// uniformly random ones (uniform/KIND/ctx=N). Only the CSA indexer grows with
// the context (linearly in Tc = ctx/4); the rest is flat (HCA reads ctx/128
// rows).
func BenchmarkPreparedLayerStep(b *testing.B) {
	cfg, _ := Preset("flash")
	ctxs := []int{4096, 65536}
	if benchBig() {
		ctxs = append(ctxs, 1<<20)
	}
	for _, dist := range stepDists {
		for _, layer := range []int{0, 2, 3} {
			for _, ctx := range ctxs {
				b.Run(distPrefix(dist)+fmt.Sprintf("%s/ctx=%d", cfg.LayerKind(layer), ctx), func(b *testing.B) {
					p, st, rope, x, pos := benchLayer(cfg, dist, layer, ctx, 1)
					flop, bytes := stepCost(cfg, p, st.Rows())
					c := startStepClock(b)
					for b.Loop() {
						st.Next = pos
						if _, err := p.Step(cfg, rope, st, x, pos); err != nil {
							b.Fatal(err)
						}
					}
					reportStep(b, c, flop, bytes)
				})
			}
		}
	}
}

// BenchmarkPreparedStepPhases is BenchmarkPreparedLayerStep's CSA and HCA
// steps at 64K (checkpoint-like codes) with the wall time of each phase of
// PreparedLayer.Step (phaseClock) reported per step, in µs: the phases in
// sequence (wq_a+wkv, branches, attn, wo_a, wo_b; they add up to about the
// step), the concurrent branches inside "branches" (branch.q: wq_b and the
// query's norm and RoPE; branch.kv; branch.indexer; branch.compressor) and
// the indexer's phases in order (indexer.wq_b … indexer.topk). It shows which
// phase keeps a step from scaling with GOMAXPROCS: run one -cpu value per
// process (golang/go#49980).
func BenchmarkPreparedStepPhases(b *testing.B) {
	cfg, _ := Preset("flash")
	for _, layer := range []int{2, 3} {
		b.Run(fmt.Sprintf("%s/ctx=65536", cfg.LayerKind(layer)), func(b *testing.B) {
			p, st, rope, x, pos := benchLayer(cfg, "checkpoint", layer, 65536, 1)
			var mu sync.Mutex
			sum := map[string]time.Duration{}
			phaseClock = func(phase string, d time.Duration) {
				mu.Lock()
				sum[phase] += d
				mu.Unlock()
			}
			defer func() { phaseClock = nil }()
			for b.Loop() {
				st.Next = pos
				if _, err := p.Step(cfg, rope, st, x, pos); err != nil {
					b.Fatal(err)
				}
			}
			phaseClock = nil
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "step-µs")
			for phase, d := range sum {
				b.ReportMetric(float64(d.Microseconds())/float64(b.N), phase+"-µs")
			}
		})
	}
}

// distPrefix names the sub-benchmarks of a code distribution: none for
// checkpoint (the default, the names bench/gpuhost.sh selects), "uniform/".
func distPrefix(dist string) string {
	if dist == "checkpoint" {
		return ""
	}
	return dist + "/"
}

// BenchmarkPreparedModelStep is the whole 43-layer attention-path step of
// V4-Flash (each layer with its own input, as in a replay) at context 4K and
// 64K, all layers' weights prepared once and kept (SPARSEMLA_BENCH_BIG=1),
// with checkpoint-like FP8 codes (ctx=N) and uniformly random ones
// (uniform/ctx=N). Target at 64K: ≤ 75 ms at 16 threads, ≤ 0.45 s at 2. It
// also reports the memory of the packed weights (GiB) and the heap in use.
func BenchmarkPreparedModelStep(b *testing.B) {
	if !benchBig() {
		b.Skip("set SPARSEMLA_BENCH_BIG=1 (≈ 9 GiB)")
	}
	cfg, _ := Preset("flash")
	for _, dist := range stepDists {
		for _, ctx := range []int{4096, 65536} {
			b.Run(distPrefix(dist)+fmt.Sprintf("ctx=%d", ctx), func(b *testing.B) {
				n := cfg.NLayers
				m := &PreparedModel{Cfg: cfg, Layers: make([]*PreparedLayer, n), Rope: make([]*RopeTable, n)}
				states, xs := make([]*LayerState, n), make([][]float32, n)
				var g errgroup.Group
				g.SetLimit(runtime.GOMAXPROCS(0))
				for l := 0; l < n; l++ {
					g.Go(func() error {
						m.Layers[l], states[l], m.Rope[l], xs[l], _ = benchLayer(cfg, dist, l, ctx, 2)
						return nil
					})
				}
				g.Wait()
				pos := int64(ctx + 1)
				var flop, bytes float64
				var packed int64
				for l, p := range m.Layers {
					f, by := stepCost(cfg, p, states[l].Rows())
					flop, bytes, packed = flop+f, bytes+by, packed+p.PackedBytes()
				}
				runtime.GC()
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				ref0 := attention.ReferencePanels()
				c := startStepClock(b)
				for b.Loop() {
					for _, st := range states {
						st.Next = pos
					}
					if _, err := m.Step(states, xs, pos); err != nil {
						b.Fatal(err)
					}
				}
				reportStep(b, c, flop, bytes)
				b.ReportMetric(float64(packed)/(1<<30), "packedGiB")
				b.ReportMetric(float64(ms.HeapInuse)/(1<<30), "heapGiB")
				b.ReportMetric(float64(attention.ReferencePanels()-ref0)/float64(b.N), "refpanels/step")
			})
		}
	}
	ropeCache.Clear()
}

// BenchmarkPreparedReplaySteps replays N consecutive decode steps of a CSA
// layer (context 4K, growing, emitting every 4th step) on one prepared layer:
// the weights are packed once, so the time per step stays flat in N.
func BenchmarkPreparedReplaySteps(b *testing.B) {
	cfg, _ := Preset("flash")
	p, st0, _, x, pos0 := benchLayer(cfg, "checkpoint", 2, 4096, 3)
	rope := LayerRope(cfg, 2, 4096+2+64)
	for _, n := range []int{1, 4, 16, 64} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			// the steps keep their own clock, the state's clone left out of
			// it, rather than B.StopTimer/StartTimer around the clone: each
			// stops the world (runtime.ReadMemStats) and slows what runs
			// after it (attention.BenchmarkTimerStopCost)
			var steps time.Duration
			for b.Loop() {
				st := st0.Clone()
				t0 := time.Now()
				for i := 0; i < n; i++ {
					if _, err := p.Step(cfg, rope, st, x, pos0+int64(i)); err != nil {
						b.Fatal(err)
					}
				}
				steps += time.Since(t0)
			}
			b.ReportMetric(float64(steps.Nanoseconds())/float64(b.N), "ns/op")
			b.ReportMetric(steps.Seconds()/float64(b.N)/float64(n)*1e3, "ms/step")
		})
	}
}

// BenchmarkTopKFast: top-512 of Tc scores, radix selection vs indexer.TopK
// (a sort of all Tc rows).
func BenchmarkTopKFast(b *testing.B) {
	tcs := []int{1024, 16384}
	if benchBig() {
		tcs = append(tcs, 262144)
	}
	for _, tc := range tcs {
		rng := rand.New(rand.NewPCG(9, 9))
		score := fastRand(rng, tc, -2)
		for i := range score {
			if i%3 == 0 {
				score[i] = 0 // ReLU zeros: many ties
			}
		}
		b.Run(fmt.Sprintf("fast/Tc=%d", tc), func(b *testing.B) {
			for b.Loop() {
				topKFast(score, 512)
			}
		})
		b.Run(fmt.Sprintf("indexer.TopK/Tc=%d", tc), func(b *testing.B) {
			for b.Loop() {
				indexer.TopK(score, 512)
			}
		})
	}
}

// BenchmarkFastStages times the small stages of a step at the V4-Flash dims:
// RoPE of the 64 query heads, the main compressor step with its projections
// (r = 4, d = 512) at an emitting position, and HeadRMS.
func BenchmarkFastStages(b *testing.B) {
	cfg, _ := Preset("flash")
	p, st, rope, x, _ := benchLayer(cfg, "checkpoint", 2, 4096, 4)
	q := fastRand(rand.New(rand.NewPCG(1, 1)), cfg.NHeads*cfg.HeadDim, -1)
	b.Run("rope_q", func(b *testing.B) {
		for b.Loop() {
			for h := 0; h < cfg.NHeads; h++ {
				rope.Apply(q[h*cfg.HeadDim+cfg.NopeDim():(h+1)*cfg.HeadDim], 4097)
			}
		}
	})
	b.Run("head_rms", func(b *testing.B) {
		for b.Loop() {
			attention.HeadRMS(q, cfg.HeadDim, 1e-6)
		}
	})
	b.Run("compressor_step", func(b *testing.B) {
		c := p.Compressor
		for b.Loop() {
			a, g := make([]float32, c.Width()), make([]float32, c.Width())
			p.CmpWkv.Dot(a, x)
			p.CmpWgate.Dot(g, x)
			s := st.Cmp.Clone()
			c.StepFrom(s, a, g, 4099, rope)
		}
	})
}

// SPARSEMLA_POOL_SPIN_US=N sets how long the fast paths' idle pool workers
// spin (attention.SetPoolSpin), to compare on one machine.
func init() {
	if v, err := strconv.Atoi(os.Getenv("SPARSEMLA_POOL_SPIN_US")); err == nil {
		attention.SetPoolSpin(time.Duration(v) * time.Microsecond)
	}
	// SPARSEMLA_AVX512=0 keeps the index scoring on its AVX2 kernel
	if os.Getenv("SPARSEMLA_AVX512") == "0" {
		attention.UseAVX512 = false
	}
	// SPARSEMLA_VNNI=0 keeps every index key on the fp32 kernel
	if os.Getenv("SPARSEMLA_VNNI") == "0" {
		attention.UseVNNI = false
	}
}
