//go:build linux

package engine

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/head"
	"sparsemla/mhc"
	"sparsemla/moe"
	"sparsemla/quant"
)

// BenchmarkWholeStep is one whole 43-layer V4-Flash decode step at context
// 65,536 on the prepared path (PreparedWhole.Step: embedding, per layer
// hc_pre, attention, hc_post, hc_pre, router, 6 routed FP4 experts + the
// shared FP8 expert, hc_post; the head), SPARSEMLA_BENCH_BIG=1:
//
//	SPARSEMLA_BENCH_BIG=1 go test ./engine -run '^$' -bench WholeStep -benchtime 3x -timeout 60m
//
// The MoE and block weights come from a safetensors checkpoint written to a
// temporary directory (SPARSEMLA_BENCH_DIR, else the test's temp dir) with
// V4-Flash's real layout and logical size (43 layers × 256 routed experts,
// ≈ 139 GiB): the routed experts the step routes to are written (normal
// samples, bf16, quantised to FP4 with per-32 UE8M0 scales by
// quant.QuantizeFP4, as a checkpoint is), every other expert is a hole of the
// sparse file. The layers are loaded by LoadBlockWeightsWith(LazyExperts)
// with one ExpertCache for all layers at the default budget
// (Config.ExpertCacheBytes, 3.3 GiB): each routed expert is read from the
// file when the step first routes to it and kept in the cache, as a replay
// does; each block is then PrepareBlock'ed and Compact'ed (hc_*_fn and the
// gate as panels only, as a prepared load holds them). embed.weight is in
// the same file (bf16, only the token's row written) and read row by row
// (CheckpointEmbedding, as LoadHeadWeightsWith(LazyEmbed) does). The
// attention weights and caches are benchLayer's (checkpoint-like FP8
// codes, 64K context) with the compressor projections as bf16 panels only
// (PreparedLayer.CompactCompressors, as LoadLayerWeightsPrepared leaves
// them); the head is RandomHead packed to bf16 panels and its fp32 weight
// dropped (LoadHeadWeights' form).
//
// Setup: the routing is not known before the step runs, so a first step runs
// with a source that writes each expert into the file the first time it is
// routed to and then reads it back through the checkpoint reader; the caches
// are then emptied, and a "cold" step reads every routed expert from the
// file (reported as cold-ms); the timed steps find them in the caches. Every
// step must give the first step's logits bit for bit (the same weights read
// back, the same routing). It reports ms/step, the per-part split of one
// extra step (ms of hc = hc_pre/norms/hc_post, attn, gate, routed, shared,
// head), the bytes a step reads (GB) and the process's peak RSS: peakRSS-GiB
// (VmHWM since the process started, the setup included) and stepRSS-GiB
// (VmHWM reset after the setup through /proc/self/clear_refs: what the steps
// and the weights they hold need). It runs at GOGC = wholeStepGOGC (10): with
// ≈ 11 GiB live, the default 100 lets the heap reach twice that. Every
// weight is held in the form the real loaders leave it in; what is not
// read from a checkpoint is the attention weights and the head (generated
// in their loaded form, the same sizes).
func BenchmarkWholeStep(b *testing.B) {
	if !benchBig() {
		b.Skip("set SPARSEMLA_BENCH_BIG=1 (≈ 12 GiB of memory, ≈ 4.5 GiB of disk)")
	}
	const needMem, needDisk = 13 << 30, 6 << 30
	if avail, ok := memAvailable(); ok && avail < needMem {
		b.Skipf("MemAvailable is %.1f GiB, the whole step needs ≈ %d GiB", float64(avail)/(1<<30), needMem>>30)
	}
	dir := os.Getenv("SPARSEMLA_BENCH_DIR")
	if dir == "" {
		dir = b.TempDir()
	} else if dir, _ = os.MkdirTemp(dir, "wholestep"); dir != "" {
		defer os.RemoveAll(dir)
	}
	if err := checkSparseDisk(dir, needDisk); err != nil {
		b.Skip(err)
	}
	// ≈ 10 GiB of live weights: at the default GOGC = 100 the heap would
	// grow to twice that between collections
	defer debug.SetGCPercent(debug.SetGCPercent(wholeStepGOGC))
	cfg, _ := Preset("flash")
	const ctx, seed = 65536, 2
	pos, tok := int64(ctx+1), int64(4242)
	n := cfg.NLayers

	t0 := time.Now()
	m := &PreparedWhole{Cfg: cfg, Attn: &PreparedModel{Cfg: cfg, Layers: make([]*PreparedLayer, n), Rope: make([]*RopeTable, n)},
		Blocks: make([]*PreparedBlock, n)}
	// the head first, while its fp32 form (2 GiB, dropped once packed) is
	// the only large thing in memory
	hd := RandomHead(cfg, seed)
	m.Head = PrepareHead(hd)
	hd.Weight = nil // the bf16 panels are the head's only copy (as LoadHeadWeights keeps it)
	runtime.GC()
	states := make([]*LayerState, n)
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for l := 0; l < n; l++ {
		g.Go(func() error {
			p, st, rope, _, _ := benchLayer(cfg, "checkpoint", l, ctx, seed)
			// what LoadLayerWeightsPrepared keeps: the compressor
			// projections as their bf16 panels only
			p.CompactCompressors()
			m.Attn.Layers[l], states[l], m.Attn.Rope[l] = p, st, rope
			return nil
		})
	}
	g.Wait()
	runtime.GC()
	tAttn := time.Since(t0)

	t0 = time.Now()
	path := filepath.Join(dir, "flash-moe.safetensors")
	ck, err := writeFlashMoECheckpoint(path, cfg, seed)
	if err != nil {
		b.Fatal(err)
	}
	defer ck.f.Close()
	if err := ck.writeEmbedRow(cfg, seed, tok); err != nil {
		b.Fatal(err)
	}
	st, err := dump.OpenSafetensors(path)
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	// the embedding as LoadHeadWeightsWith(LazyEmbed) loads it: the row
	// of the token read from the file at each step
	if m.Embed, err = (weightReader{st}).lazyEmbedding(cfg.VocabSize, cfg.Dim); err != nil {
		b.Fatal(err)
	}
	// one expert cache for all layers, the default budget
	cache := NewExpertCache(cfg.ExpertCacheBytes())
	srcs := make([]moe.ExpertSource, n)
	for l := 0; l < n; l++ {
		bw, err := LoadBlockWeightsWith(cfg, l, st, BlockLoadOptions{LazyExperts: true, Cache: cache})
		if err != nil {
			b.Fatal(err)
		}
		srcs[l] = bw.MoE.Source
		bw.MoE.Source = &writingExperts{ck: ck, layer: l, inter: cfg.MoEInterDim, dim: cfg.Dim, seed: seed, inner: srcs[l], done: map[int]bool{}}
		m.Blocks[l] = PrepareBlock(cfg, bw)
		// a prepared block's form: hc_*_fn and the gate as panels only
		m.Blocks[l].Compact()
	}
	tLoad := time.Since(t0)
	resetStates := func() {
		for _, s := range states {
			s.Next = pos
		}
	}

	// the routing step: writes the experts it routes to, reads them back
	t0 = time.Now()
	resetStates()
	first, err := m.Step(states, tok, pos)
	if err != nil {
		b.Fatal(err)
	}
	tRoute := time.Since(t0)
	written := int64(0)
	for l := 0; l < n; l++ {
		written += int64(len(m.Blocks[l].Block.MoE.Source.(*writingExperts).done))
		m.Blocks[l].Block.MoE.Source = srcs[l]
	}
	cache.Reset()
	if err := ck.f.Sync(); err != nil {
		b.Fatal(err)
	}
	disk, logical := fileBlocks(path)
	b.Logf("setup: attention %v, checkpoint + load %v, routing step %v; %d routed experts written, checkpoint %.1f GiB logical, %.2f GiB on disk; expert cache budget %.2f GiB",
		tAttn.Round(time.Second), tLoad.Round(time.Second), tRoute.Round(time.Second), written, float64(logical)/(1<<30), float64(disk)/(1<<30), float64(cache.Budget())/(1<<30))
	same := func(what string, s *WholeStep) {
		if k := bitsEqual(s.Logits, first.Logits); k != -1 || s.Token != first.Token {
			b.Fatalf("%s: logits differ from the routing step's at %d (token %d vs %d)", what, k, s.Token, first.Token)
		}
	}
	runtime.GC()
	debug.FreeOSMemory()
	hwmSetup, _ := procStatus("VmHWM")
	resetPeakRSS()

	// cold: every routed expert read from the checkpoint through the cache
	t0 = time.Now()
	resetStates()
	cold, err := m.Step(states, tok, pos)
	if err != nil {
		b.Fatal(err)
	}
	tCold := time.Since(t0)
	same("cold step", cold)

	// one step timed part by part
	resetStates()
	parts, err := timedWholeStep(m, states, tok, pos)
	if err != nil {
		b.Fatal(err)
	}
	same("timed-parts step", parts.out)

	var bytes int64
	for l := 0; l < n; l++ {
		bytes += m.Attn.Layers[l].PackedBytes() + m.Blocks[l].PackedBytes() + 6*cfg.ExpertBytes()/int64(cfg.NRoutedExperts)
		_, by := stepCost(cfg, m.Attn.Layers[l], states[l].Rows())
		bytes += int64(by) - m.Attn.Layers[l].PackedBytes()
	}
	bytes += m.Head.W.Bytes() + m.Head.Fn.Bytes()
	c := startStepClock(b)
	for b.Loop() {
		resetStates()
		s, err := m.Step(states, tok, pos)
		if err != nil {
			b.Fatal(err)
		}
		same("step", s)
	}
	reportStep(b, c, 0, float64(bytes))
	hwm, _ := procStatus("VmHWM")
	b.ReportMetric(float64(tCold.Milliseconds()), "cold-ms")
	for _, p := range []struct {
		name string
		d    time.Duration
	}{{"hc", parts.hc}, {"attn", parts.attn}, {"gate", parts.gate}, {"routed", parts.routed}, {"shared", parts.shared}, {"head", parts.head}} {
		b.ReportMetric(float64(p.d.Microseconds())/1e3, p.name+"-ms")
	}
	b.ReportMetric(float64(bytes)/1e9, "GB")
	b.ReportMetric(float64(max(hwm, hwmSetup))/(1<<30), "peakRSS-GiB")
	b.ReportMetric(float64(hwm)/(1<<30), "stepRSS-GiB")
	ropeCache.Clear()
}

// wholeStepGOGC is the GC percentage BenchmarkWholeStep runs at.
const wholeStepGOGC = 10

// wholeParts is one step of PreparedWhole.Step timed part by part.
type wholeParts struct {
	hc, attn, gate, routed, shared, head time.Duration
	out                                  *WholeStep
}

// timedWholeStep is PreparedWhole.Step with a clock around each part (the
// same calls in the same order, MoE.Combine spelled out to time the routed
// and the shared experts apart); its logits are checked against Step's.
func timedWholeStep(m *PreparedWhole, states []*LayerState, tok, pos int64) (*wholeParts, error) {
	cfg := m.Cfg
	p := &wholeParts{out: &WholeStep{}}
	clock := time.Now()
	lap := func(d *time.Duration) {
		now := time.Now()
		*d += now.Sub(clock)
		clock = now
	}
	hc, dim := cfg.HCMult, cfg.Dim
	e := make([]float32, dim)
	if err := m.Embed.Row(e, tok); err != nil {
		return nil, err
	}
	h := make([]float32, hc*dim)
	mhc.Expand(h, e, hc)
	for l := range m.Attn.Layers {
		b := m.Blocks[l].Block
		x, post, comb := m.hcPre(b.AttnSite, m.Blocks[l].AttnFn, b.AttnNorm, h)
		lap(&p.hc)
		y, err := m.Attn.Layers[l].Step(cfg, m.Attn.Rope[l], states[l], x, pos)
		if err != nil {
			return nil, err
		}
		lap(&p.attn)
		hmid := make([]float32, len(h))
		mhc.Post(hmid, y, h, post, comb)
		f, post, comb := m.hcPre(b.FFNSite, m.Blocks[l].FFNFn, b.FFNNorm, hmid)
		lap(&p.hc)
		g := &b.MoE.Gate
		s := make([]float32, g.Experts)
		m.Blocks[l].Gate.Dot(s, f)
		moe.ApplyScoreFunc(s, g.Func)
		r, err := g.RouteScores(s, tok)
		if err != nil {
			return nil, err
		}
		lap(&p.gate)
		acc, out := make([]float32, dim), make([]float32, dim)
		for ex := 0; ex < g.Experts; ex++ {
			slot := -1
			for t, id := range r.Indices {
				if int(id) == ex {
					slot = t
				}
			}
			if slot < 0 {
				continue
			}
			w, err := b.MoE.Source.Expert(ex)
			if err != nil {
				return nil, err
			}
			w.ForwardFast(out, f, r.Weights[slot], b.MoE.SwigluLimit)
			for i, v := range out {
				acc[i] += v
			}
		}
		lap(&p.routed)
		b.MoE.Shared.ForwardFast(out, f)
		for i, v := range out {
			acc[i] += v
		}
		lap(&p.shared)
		for i, v := range acc {
			out[i] = quant.BF16Round(v)
		}
		hout := make([]float32, len(h))
		mhc.Post(hout, out, hmid, post, comb)
		h = hout
		lap(&p.hc)
	}
	hd := m.Head.Head
	mixes, pre := make([]float32, hc), make([]float32, hc)
	mixesFast(mixes, h, m.Head.Fn, hd.NormEps)
	mhc.HeadPre(pre, mixes, hd.HCBase, hd.HCScale, hd.HCEps)
	x, normed := make([]float32, dim), make([]float32, dim)
	mhc.Collapse(x, h, pre)
	attention.RMSNorm(normed, x, hd.Norm, hd.NormEps)
	p.out.Logits = make([]float32, hd.Vocab)
	m.Head.W.Dot(p.out.Logits, normed)
	p.out.Token = head.Greedy(p.out.Logits)
	lap(&p.head)
	return p, nil
}

// writingExperts is the routing step's expert source: the first time layer
// l's expert e is asked for, it is generated (genFP4Expert) and written into
// the checkpoint file; then it is read back through the checkpoint reader.
type writingExperts struct {
	ck                *sparseCkpt
	layer, dim, inter int
	seed              uint64
	inner             moe.ExpertSource
	mu                sync.Mutex
	done              map[int]bool
}

func (w *writingExperts) Expert(e int) (*moe.Expert, error) {
	w.mu.Lock()
	if !w.done[e] {
		pre := fmt.Sprintf("layers.%d.ffn.experts.%d.", w.layer, e)
		for i, sh := range [][2]int{{w.inter, w.dim}, {w.dim, w.inter}, {w.inter, w.dim}} {
			packed, scale := genFP4(w.seed, w.layer, e, i, sh[0], sh[1])
			name := pre + fmt.Sprintf("w%d", i+1)
			if err := w.ck.write(name+".weight", packed); err != nil {
				w.mu.Unlock()
				return nil, err
			}
			if err := w.ck.write(name+".scale", scale); err != nil {
				w.mu.Unlock()
				return nil, err
			}
		}
		w.done[e] = true
		if len(w.done)%3 == 0 {
			// the generated bytes are garbage once written: collect them
			// before they pile up above the weights (setup's peak RSS)
			runtime.GC()
		}
	}
	w.mu.Unlock()
	return w.inner.Expert(e)
}

// normTab[u] is Φ⁻¹((u+½)/2^16): a standard normal sample from 16 random
// bits (tails at ±4.3σ).
var normTab = sync.OnceValue(func() *[1 << 16]float32 {
	var t [1 << 16]float32
	for u := range t {
		t[u] = float32(math.Sqrt2 * math.Erfinv(2*(float64(u)+0.5)/(1<<16)-1))
	}
	return &t
})

// normals fills v with bf16(sd · N(0,1)) samples.
func normals(rng *rand.Rand, v []float32, sd float32) {
	t := normTab()
	for i := 0; i < len(v); i += 4 {
		u := rng.Uint64()
		for j := 0; j < 4 && i+j < len(v); j++ {
			v[i+j] = quant.BF16Round(t[uint16(u>>(16*j))] * sd)
		}
	}
}

// genFP4 is routed expert e's weight i (w1, w2, w3) of layer l: bf16(N(0,1)
// /sqrt(cols)) quantised to FP4 per 32 columns (ceil-2 UE8M0 scales, RNE
// codes: quant.QuantizeFP4), rows split across the cores, each 64-row chunk
// from its own stream (the same bytes at any GOMAXPROCS).
func genFP4(seed uint64, l, e, i, rows, cols int) (packed, scale []uint8) {
	packed = make([]uint8, rows*cols/2)
	scale = make([]uint8, rows*cols/moe.FP4Block)
	sd := float32(1 / math.Sqrt(float64(cols)))
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	const chunk = 64
	for r0 := 0; r0 < rows; r0 += chunk {
		g.Go(func() error {
			rng := rand.New(rand.NewPCG(seed^0xf4f4, uint64(l)<<40|uint64(e)<<24|uint64(i)<<20|uint64(r0)))
			v := make([]float32, chunk*cols)
			normals(rng, v, sd)
			quant.QuantizeFP4(packed[r0*cols/2:(r0+chunk)*cols/2], scale[r0*cols/moe.FP4Block:(r0+chunk)*cols/moe.FP4Block], v, moe.FP4Block, quant.ScaleCeil2, quant.FP4AmaxFloor)
			return nil
		})
	}
	g.Wait()
	return packed, scale
}

// sparseCkpt is a safetensors file laid out in full (header, every tensor's
// place) whose tensors are written one by one; what is never written stays a
// hole of the sparse file (reads as zeros, takes no disk).
type sparseCkpt struct {
	f    *os.File
	base int64
	off  map[string][2]int64 // name → offset in the data area, size
}

type ckptTensor struct {
	name  string
	dtype dump.DType
	shape []int
	size  int64
}

func createSparseCkpt(path string, ts []ckptTensor) (*sparseCkpt, error) {
	hdr := map[string]any{}
	c := &sparseCkpt{off: map[string][2]int64{}}
	var off int64
	for _, t := range ts {
		hdr[t.name] = map[string]any{"dtype": t.dtype.SafetensorsName(), "shape": t.shape, "data_offsets": []int64{off, off + t.size}}
		c.off[t.name] = [2]int64{off, t.size}
		off += t.size
	}
	js, err := json.Marshal(hdr)
	if err != nil {
		return nil, err
	}
	js = append(js, bytes.Repeat([]byte(" "), (8-len(js)%8)%8)...)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, err
	}
	c.f, c.base = f, 8+int64(len(js))
	var lb [8]byte
	binary.LittleEndian.PutUint64(lb[:], uint64(len(js)))
	if _, err := f.Write(append(lb[:], js...)); err != nil {
		return nil, err
	}
	return c, f.Truncate(c.base + off)
}

func (c *sparseCkpt) write(name string, data []byte) error {
	o, ok := c.off[name]
	if !ok || int64(len(data)) != o[1] {
		return fmt.Errorf("sparse checkpoint: %s: %d bytes, the header has %v", name, len(data), o)
	}
	_, err := c.f.WriteAt(data, c.base+o[0])
	return err
}

// writeEmbedRow writes row tok of embed.weight: RandomEmbedding(cfg,
// seed)'s row, as bf16 bytes.
func (c *sparseCkpt) writeEmbedRow(cfg *Config, seed uint64, tok int64) error {
	e := make([]float32, cfg.Dim)
	if err := RandomEmbedding(cfg, seed).Row(e, tok); err != nil {
		return err
	}
	o := c.off["embed.weight"]
	row := make([]byte, 2*cfg.Dim)
	for i, x := range e {
		binary.LittleEndian.PutUint16(row[2*i:], uint16(math.Float32bits(x)>>16))
	}
	_, err := c.f.WriteAt(row, c.base+o[0]+2*int64(cfg.Dim)*tok)
	return err
}

// writeFlashMoECheckpoint lays out the block parameters of every V4-Flash
// layer in the checkpoint's names, dtypes and shapes, and writes all of them
// but the routed experts: hc_{attn,ffn}_{fn,base,scale} fp32, attn_norm /
// ffn_norm bf16, ffn.gate.weight bf16, gate.bias fp32 (tid2eid int32 on the
// hash layers), the shared expert FP8 with 128×128 UE8M0 scales
// (checkpoint-like codes), each routed expert's w1/w2/w3 as U8 FP4 pairs
// and UE8M0 per-32 scales (holes until written), and embed.weight bf16
// [vocab, dim] (a hole but the rows writeEmbedRow writes).
func writeFlashMoECheckpoint(path string, cfg *Config, seed uint64) (*sparseCkpt, error) {
	hc, dim, E, inter, k := cfg.HCMult, cfg.Dim, cfg.NRoutedExperts, cfg.MoEInterDim, cfg.NActivatedExperts
	nm := mhc.NMixes(hc)
	var ts []ckptTensor
	add := func(name string, dt dump.DType, shape ...int) {
		size := int64(dt.Bits() / 8)
		for _, s := range shape {
			size *= int64(s)
		}
		ts = append(ts, ckptTensor{name, dt, shape, size})
	}
	for l := 0; l < cfg.NLayers; l++ {
		p := fmt.Sprintf("layers.%d.", l)
		for _, side := range []string{"attn", "ffn"} {
			add(p+"hc_"+side+"_fn", dump.F32, nm, hc*dim)
			add(p+"hc_"+side+"_base", dump.F32, nm)
			add(p+"hc_"+side+"_scale", dump.F32, 3)
			add(p+side+"_norm.weight", dump.BF16, dim)
		}
		add(p+"ffn.gate.weight", dump.BF16, E, dim)
		if cfg.HashLayer(l) {
			add(p+"ffn.gate.tid2eid", dump.I32, cfg.VocabSize, k)
		} else {
			add(p+"ffn.gate.bias", dump.F32, E)
		}
		for i, sh := range [][2]int{{inter, dim}, {dim, inter}, {inter, dim}} {
			n := fmt.Sprintf("%sffn.shared_experts.w%d.", p, i+1)
			add(n+"weight", dump.E4M3, sh[0], sh[1])
			add(n+"scale", dump.E8M0, fp8Scale(sh[0], sh[1])...)
		}
		for e := 0; e < E; e++ {
			for i, sh := range [][2]int{{inter, dim}, {dim, inter}, {inter, dim}} {
				n := fmt.Sprintf("%sffn.experts.%d.w%d.", p, e, i+1)
				add(n+"weight", dump.U8, sh[0], sh[1]/2)
				add(n+"scale", dump.E8M0, sh[0], sh[1]/moe.FP4Block)
			}
		}
	}
	add("embed.weight", dump.BF16, cfg.VocabSize, dim) // a hole until writeEmbedRow
	c, err := createSparseCkpt(path, ts)
	if err != nil {
		return nil, err
	}
	f32b := func(v []float32) []byte {
		out := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(x))
		}
		return out
	}
	bf16b := func(v []float32) []byte {
		out := make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(out[2*i:], uint16(math.Float32bits(quant.BF16Round(x))>>16))
		}
		return out
	}
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for l := 0; l < cfg.NLayers; l++ {
		g.Go(func() error {
			rng := rand.New(rand.NewPCG(seed^0xb10c, uint64(l)))
			p := fmt.Sprintf("layers.%d.", l)
			vec := func(n int, mean, sd float32) []float32 {
				v := make([]float32, n)
				t := normTab()
				for i := range v {
					v[i] = mean + sd*t[rng.IntN(1<<16)]
				}
				return v
			}
			w := map[string][]byte{}
			for _, side := range []string{"attn", "ffn"} {
				w[p+"hc_"+side+"_fn"] = f32b(vec(nm*hc*dim, 0, float32(0.1/math.Sqrt(float64(hc*dim)))))
				w[p+"hc_"+side+"_base"] = f32b(vec(nm, 0, 0.1))
				w[p+"hc_"+side+"_scale"] = f32b(vec(3, 0.5, 0.1))
				w[p+side+"_norm.weight"] = bf16b(vec(dim, 1, 0.1))
			}
			gw := make([]float32, E*dim)
			normals(rng, gw, float32(1/math.Sqrt(float64(dim))))
			w[p+"ffn.gate.weight"] = bf16b(gw)
			if cfg.HashLayer(l) {
				ids := make([]byte, 4*cfg.VocabSize*k)
				for t := 0; t < cfg.VocabSize; t++ {
					for i, e := range rng.Perm(E)[:k] {
						binary.LittleEndian.PutUint32(ids[4*(t*k+i):], uint32(e))
					}
				}
				w[p+"ffn.gate.tid2eid"] = ids
			} else {
				w[p+"ffn.gate.bias"] = f32b(vec(E, 0, 0.1))
			}
			for i, sh := range [][2]int{{inter, dim}, {dim, inter}, {inter, dim}} {
				n := fmt.Sprintf("%sffn.shared_experts.w%d.", p, i+1)
				codes, scale := checkpointFP8(rng, sh[0], sh[1])
				w[n+"weight"], w[n+"scale"] = codes, scale
			}
			for name, data := range w {
				if err := c.write(name, data); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return c, g.Wait()
}

// memAvailable is /proc/meminfo's MemAvailable in bytes.
func memAvailable() (int64, bool) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err == nil
		}
	}
	return 0, false
}

// procStatus is a "kB" field of /proc/self/status in bytes (VmHWM, VmRSS).
func procStatus(field string) (int64, bool) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err == nil
		}
	}
	return 0, false
}

// resetPeakRSS resets the process's VmHWM to its current RSS (Linux:
// "5" > /proc/self/clear_refs).
func resetPeakRSS() { os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) }

// checkSparseDisk says why dir cannot hold the benchmark's checkpoint: less
// than need bytes free, or a file system without sparse files (a 1 GiB hole
// that takes disk).
func checkSparseDisk(dir string, need int64) error {
	var s syscall.Statfs_t
	if err := syscall.Statfs(dir, &s); err != nil {
		return fmt.Errorf("statfs %s: %v", dir, err)
	}
	if free := int64(s.Bavail) * int64(s.Bsize); free < need {
		return fmt.Errorf("%s has %.1f GiB free, the checkpoint needs ≈ %.1f GiB (set SPARSEMLA_BENCH_DIR)", dir, float64(free)/(1<<30), float64(need)/(1<<30))
	}
	p := filepath.Join(dir, "sparse-probe")
	f, err := os.Create(p)
	if err != nil {
		return err
	}
	defer os.Remove(p)
	defer f.Close()
	if err := f.Truncate(1 << 30); err != nil {
		return err
	}
	if _, err := f.WriteAt([]byte{1}, 1<<29); err != nil {
		return err
	}
	if disk, _ := fileBlocks(p); disk > 64<<20 {
		return fmt.Errorf("%s: no sparse files (a 1 GiB hole takes %d MiB)", dir, disk>>20)
	}
	return nil
}

// fileBlocks is a file's disk use and logical size in bytes.
func fileBlocks(path string) (disk, size int64) {
	var s syscall.Stat_t
	if syscall.Stat(path, &s) != nil {
		return -1, -1
	}
	return s.Blocks * 512, s.Size
}

// TestWholeStepFromSparseCheckpoint runs BenchmarkWholeStep's machinery on
// a small V4-Flash-shaped model: the block weights written into a sparse
// checkpoint, loaded with LazyExperts, the routed experts written when the
// step first routes to them and read back through the checkpoint reader;
// PreparedWhole.Step on them gives the bits of RunLayer on the reference
// loops with every expert loaded at once from the same file (the unrouted
// ones are holes: zero codes), two steps in a row, and the experts read
// back are the bytes written.
func TestWholeStepFromSparseCheckpoint(t *testing.T) {
	cfg := smallFlash(t)
	cfg.NLayers, cfg.CompressRatios, cfg.NHashLayers = 4, flashRatios(4), 2
	cfg.VocabSize, cfg.NRoutedExperts, cfg.MoEInterDim = 300, 16, 512
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	const seed, start = 5, 300
	n := cfg.NLayers
	path := filepath.Join(t.TempDir(), "moe.safetensors")
	ck, err := writeFlashMoECheckpoint(path, cfg, seed)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.f.Close()
	st, err := dump.OpenSafetensors(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for tok := int64(11); tok <= 12; tok++ {
		if err := ck.writeEmbedRow(cfg, seed, tok); err != nil {
			t.Fatal(err)
		}
	}
	m := &PreparedWhole{Cfg: cfg, Attn: &PreparedModel{Cfg: cfg, Layers: make([]*PreparedLayer, n), Rope: make([]*RopeTable, n)},
		Blocks: make([]*PreparedBlock, n), Head: PrepareHead(RandomHead(cfg, seed))}
	// the embedding read from the file, one expert cache for every layer
	// holding 5 experts (a step routes 4·k: evictions across layers)
	if m.Embed, err = (weightReader{st}).lazyEmbedding(cfg.VocabSize, cfg.Dim); err != nil {
		t.Fatal(err)
	}
	cache := NewExpertCache(5 * cfg.ExpertBytes() / int64(cfg.NRoutedExperts))
	ws := make([]*LayerWeights, n)
	states := make([]*LayerState, n)
	writers := make([]*writingExperts, n)
	for l := 0; l < n; l++ {
		ws[l] = RandomLayerWeights(cfg, l, seed)
		m.Attn.Layers[l] = Prepare(cfg, ws[l])
		m.Attn.Rope[l] = LayerRope(cfg, l, start+3)
		states[l] = SyntheticState(cfg, ws[l], m.Attn.Rope[l], start, seed)
		bw, err := LoadBlockWeightsWith(cfg, l, st, BlockLoadOptions{LazyExperts: true, Cache: cache})
		if err != nil {
			t.Fatal(err)
		}
		writers[l] = &writingExperts{ck: ck, layer: l, inter: cfg.MoEInterDim, dim: cfg.Dim, seed: seed, inner: bw.MoE.Source, done: map[int]bool{}}
		bw.MoE.Source = writers[l]
		m.Blocks[l] = PrepareBlock(cfg, bw)
		m.Blocks[l].Compact()
	}
	refStates := make([]*LayerState, n)
	for l := range states {
		refStates[l] = states[l].Clone()
	}
	var fast []*WholeStep
	for i := 0; i < 2; i++ {
		s, err := m.Step(states, int64(11+i), start+int64(i))
		if err != nil {
			t.Fatal(err)
		}
		fast = append(fast, s)
	}
	// the reference, every expert read at load from the file as written
	hw := &HeadWeights{Embed: RandomEmbedding(cfg, seed), Head: RandomHead(cfg, seed)}
	for l := 0; l < n; l++ {
		if ws[l].Block, err = LoadBlockWeights(cfg, l, st); err != nil {
			t.Fatal(err)
		}
		for e := range writers[l].done {
			p, sc := genFP4(seed, l, e, 1, cfg.Dim, cfg.MoEInterDim)
			w2 := ws[l].Block.MoE.Experts[e].W2
			if !bytes.Equal(w2.Packed, p) || !bytes.Equal(w2.Scale, sc) {
				t.Fatalf("layer %d expert %d: w2 read back differs from the bytes written", l, e)
			}
		}
		if len(writers[l].done) == 0 {
			t.Fatalf("layer %d: no expert routed", l)
		}
	}
	for i := 0; i < 2; i++ {
		pos, tok := start+int64(i), int64(11+i)
		var h Tensor
		for l := 0; l < n; l++ {
			ctx := &StepContext{Cfg: cfg, Layer: l, Pos: pos, W: ws[l], Rope: m.Attn.Rope[l], Head: hw}
			seeds := map[string]Tensor{GlobalPrefix + "tok": FromI(KindI64, []int64{tok}, 1)}
			if l > 0 {
				seeds["h_in"] = h
			}
			out, next, err := RunLayer(ctx, seeds, refStates[l])
			if err != nil {
				t.Fatal(err)
			}
			refStates[l], h = next, out["h_out"]
			for j, e := range fast[i].Indices[l] {
				if int64(e) != out["moe_indices"].I[j] {
					t.Fatalf("step %d layer %d: moe_indices %v, reference %v", pos, l, fast[i].Indices[l], out["moe_indices"].I)
				}
			}
			if l == n-1 {
				if k := bitsEqual(fast[i].Logits, out["logits"].F); k != -1 {
					t.Fatalf("step %d: logits differ from the reference at %d", pos, k)
				}
			}
		}
	}
}
