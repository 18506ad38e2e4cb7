package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"sparsemla/engine"
)

type entry struct {
	Name  string `json:"name"`
	DType string `json:"dtype"` // "u8", "f32"
	Shape []int  `json:"shape"`
	File  string `json:"file"`
}

type manifest struct {
	Pos         int64   `json:"pos"`
	Layer       int     `json:"layer"`
	Eps         float64 `json:"eps"`
	Scale       float32 `json:"softmax_scale"`
	IndexScale  float32 `json:"index_weight_scale"`
	Window      int     `json:"window"`
	TopK        int     `json:"topk"`
	Tensors     []entry `json:"tensors"`
	GoMedianMs  float64 `json:"go_median_ms"`
	GoRuns      []float64
	GoRefMs     float64 `json:"go_reference_ms"`
	GOMAXPROCS  int     `json:"gomaxprocs"`
	PackedBytes int64   `json:"packed_bytes"`
}

func main() {
	out := flag.String("out", "/tmp/csastep", "directory for the inputs, y and timing.json")
	ctx := flag.Int("ctx", 65536, "context length (tokens before the decoded one)")
	runs := flag.Int("runs", 20, "timed steps (median reported)")
	ref := flag.Bool("ref", true, "also time the reference RunStep once")
	serve := flag.Bool("serve", false, "then answer \"run T N\" lines on stdin (bench/torch_step.py --go-server)")
	flag.Parse()
	if err := run(*out, *ctx, *runs, *ref, *serve); err != nil {
		fmt.Fprintln(os.Stderr, "csastep:", err)
		os.Exit(2)
	}
}

func run(dir string, ctx, runs int, ref, serve bool) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b := newBench(dir, ctx)
	if err := b.writeInputs(); err != nil {
		return err
	}
	y, err := b.timeSteps(runs)
	if err != nil {
		return err
	}
	if ref {
		if err := b.checkReference(y); err != nil {
			return err
		}
	}
	out, err := json.MarshalIndent(b.m, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), out, 0o644); err != nil {
		return err
	}
	if !serve {
		return nil
	}
	return b.serve(slices.Clone(y))
}

// bench is one CSA layer's decode step: its weights, the state it starts
// from, its input, the prepared path, and the manifest of what was written.
type bench struct {
	dir   string
	cfg   *engine.Config
	layer int
	pos   int64
	w     *engine.LayerWeights
	rope  *engine.RopeTable
	st0   *engine.LayerState // the state every step starts from
	st    *engine.LayerState // the state a step runs on
	x     []float32
	p     *engine.PreparedLayer
	m     manifest
}

// newBench generates V4-Flash layer 2's weights and a ctx-token state.
func newBench(dir string, ctx int) *bench {
	cfg, _ := engine.Preset("flash")
	const layer = 2
	pos := int64(ctx + 1) // (pos+1) mod 4 ≠ 0: no compressed row is emitted, so the step repeats on one state
	fmt.Printf("generating V4-Flash layer %d (CSA) weights and a %d-token state …\n", layer, ctx)
	w := engine.RandomLayerWeights(cfg, layer, 1)
	rope := engine.LayerRope(cfg, layer, int(pos)+1)
	st0 := engine.SyntheticState(cfg, w, rope, pos, 1)
	x := engine.SyntheticInput(cfg, pos, 1).F
	p := engine.Prepare(cfg, w)
	m := manifest{Pos: pos, Layer: layer, Eps: cfg.NormEps, Scale: cfg.SoftmaxScale(), IndexScale: cfg.IndexWeightScale(),
		Window: cfg.WindowSize, TopK: cfg.IndexTopK, GOMAXPROCS: runtime.GOMAXPROCS(0), PackedBytes: p.PackedBytes()}
	return &bench{dir: dir, cfg: cfg, layer: layer, pos: pos, w: w, rope: rope, st0: st0, x: x, p: p, m: m}
}

// put writes one tensor as raw little-endian bytes and lists it in the manifest.
func (b *bench) put(name string, v any, shape ...int) error {
	e := entry{Name: name, Shape: shape, File: name + ".bin"}
	switch v.(type) {
	case []uint8:
		e.DType = "u8"
	case []float32:
		e.DType = "f32"
	}
	f, err := os.Create(filepath.Join(b.dir, e.File))
	if err != nil {
		return err
	}
	if err := binary.Write(f, binary.LittleEndian, v); err != nil {
		f.Close()
		return err
	}
	b.m.Tensors = append(b.m.Tensors, e)
	return f.Close()
}

// writeInputs writes the step's weights, caches, compressor states, x and
// RoPE cos/sin.
func (b *bench) writeInputs() error {
	cfg, w, st0, pos := b.cfg, b.w, b.st0, b.pos
	H, D, dim := cfg.NHeads, cfg.HeadDim, cfg.Dim
	ix := w.Indexer
	c, ic := w.Compressor, ix.Compressor
	cosSin := func(tbl []float32) []float32 { return tbl[pos*32 : (pos+1)*32] }
	for _, t := range []struct {
		name  string
		v     any
		shape []int
	}{
		{"wq_a.codes", w.WqA.Codes, []int{cfg.QLoraRank, dim}}, {"wq_a.scale", w.WqA.Scale, []int{cfg.QLoraRank / 128, dim / 128}},
		{"wq_b.codes", w.WqB.Codes, []int{H * D, cfg.QLoraRank}}, {"wq_b.scale", w.WqB.Scale, []int{H * D / 128, cfg.QLoraRank / 128}},
		{"wkv.codes", w.Wkv.Codes, []int{D, dim}}, {"wkv.scale", w.Wkv.Scale, []int{D / 128, dim / 128}},
		{"wo_b.codes", w.WoB.Codes, []int{dim, cfg.OGroups * cfg.OLoraRank}}, {"wo_b.scale", w.WoB.Scale, []int{dim / 128, cfg.OGroups * cfg.OLoraRank / 128}},
		{"wo_a", w.WoA, []int{cfg.OGroups * cfg.OLoraRank, H * D / cfg.OGroups}},
		{"q_norm", w.QNorm, []int{cfg.QLoraRank}}, {"kv_norm", w.KVNorm, []int{D}}, {"attn_sink", w.AttnSink, []int{H}},
		{"cmp.wkv", c.Wkv, []int{c.Width(), dim}}, {"cmp.wgate", c.Wgate, []int{c.Width(), dim}}, {"cmp.ape", c.Ape, []int{c.Ratio, c.Width()}},
		{"idx.wq_b.codes", ix.WqB.Codes, []int{ix.NHeads * ix.HeadDim, cfg.QLoraRank}}, {"idx.wq_b.scale", ix.WqB.Scale, []int{ix.NHeads * ix.HeadDim / 128, cfg.QLoraRank / 128}},
		{"idx.weights_proj", ix.WeightsProj, []int{ix.NHeads, dim}},
		{"icmp.wkv", ic.Wkv, []int{ic.Width(), dim}}, {"icmp.wgate", ic.Wgate, []int{ic.Width(), dim}}, {"icmp.ape", ic.Ape, []int{ic.Ratio, ic.Width()}},
		{"kv_cache", st0.KV, []int{len(st0.KV) / D, D}}, {"icache", st0.ICache, []int{len(st0.ICache) / 128, 128}},
		{"cmp_kv_state", st0.Cmp.KV, []int{8, c.Width()}}, {"cmp_score_state", st0.Cmp.Score, []int{8, c.Width()}},
		{"icmp_kv_state", st0.ICmp.KV, []int{8, ic.Width()}}, {"icmp_score_state", st0.ICmp.Score, []int{8, ic.Width()}},
		{"x", b.x, []int{dim}}, {"cos", cosSin(b.rope.Cos), []int{32}}, {"sin", cosSin(b.rope.Sin), []int{32}},
	} {
		if err := b.put(t.name, t.v, t.shape...); err != nil {
			return err
		}
	}
	return nil
}

// step runs the prepared step once from the starting state and times it (ms).
func (b *bench) step() ([]float32, float64, error) {
	st, st0 := b.st, b.st0
	copy(st.Cmp.KV, st0.Cmp.KV)
	copy(st.Cmp.Score, st0.Cmp.Score)
	copy(st.ICmp.KV, st0.ICmp.KV)
	copy(st.ICmp.Score, st0.ICmp.Score)
	st.Next = b.pos
	t0 := time.Now()
	yy, err := b.p.Step(b.cfg, b.rope, st, b.x, b.pos)
	return yy, float64(time.Since(t0).Nanoseconds()) / 1e6, err
}

// timeSteps runs 3 untimed and runs timed steps of the prepared path, each
// from the same state; the garbage of the generation is collected first so
// that no GC cycle overlaps them. It writes and returns the last y.
func (b *bench) timeSteps(runs int) ([]float32, error) {
	runtime.GC()
	var y []float32
	b.st = b.st0.Clone()
	for i := 0; i < 3+runs; i++ {
		yy, ms, err := b.step()
		if err != nil {
			return nil, err
		}
		if i >= 3 {
			b.m.GoRuns = append(b.m.GoRuns, ms)
		}
		y = yy
	}
	b.m.GoMedianMs = median(b.m.GoRuns)
	if err := b.put("y_go", y, b.cfg.Dim); err != nil {
		return nil, err
	}
	fmt.Printf("sparsemla prepared step: median %.1f ms over %d runs [%.1f-%.1f] (GOMAXPROCS %d, packed weights %.0f MiB)\n",
		b.m.GoMedianMs, runs, slices.Min(b.m.GoRuns), slices.Max(b.m.GoRuns), b.m.GOMAXPROCS, float64(b.m.PackedBytes)/(1<<20))
	return y, nil
}

// checkReference times the reference RunStep once, checks that its y is
// bit-identical to the prepared step's y and writes its top-k indices.
func (b *bench) checkReference(y []float32) error {
	cfg := b.cfg
	t0 := time.Now()
	out, _, err := engine.RunStep(&engine.StepContext{Cfg: cfg, Layer: b.layer, Pos: b.pos, W: b.w, Rope: b.rope}, engine.FromF(engine.KindBF16, b.x, cfg.Dim), b.st0)
	if err != nil {
		return err
	}
	b.m.GoRefMs = float64(time.Since(t0).Microseconds()) / 1e3
	same := true
	for i, v := range out["y"].F {
		same = same && math.Float32bits(v) == math.Float32bits(y[i])
	}
	fmt.Printf("sparsemla reference RunStep: %.0f ms (y bit-identical to the prepared step: %v)\n", b.m.GoRefMs, same)
	if !same {
		return fmt.Errorf("the prepared step and the reference disagree")
	}
	idx := out["topk_idxs"].I
	f := make([]float32, len(idx))
	for i, v := range idx {
		f[i] = float32(v)
	}
	return b.put("topk_idxs", f, len(f))
}

// serve answers "run T N" lines on stdin (see the command's doc); y0 is the
// first steps' y.
func (b *bench) serve(y0 []float32) error {
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var threads, n int
		if in.Text() == "quit" {
			return nil
		}
		if _, err := fmt.Sscanf(in.Text(), "run %d %d", &threads, &n); err != nil || threads < 1 || n < 1 {
			return fmt.Errorf("serve: bad command %q (want \"run THREADS STEPS\" or \"quit\")", in.Text())
		}
		runtime.GOMAXPROCS(threads)
		runtime.GC()
		r := struct {
			Threads  int       `json:"threads"`
			Ms       []float64 `json:"ms"`
			SameBits bool      `json:"same_bits"`
		}{Threads: threads, SameBits: true}
		for i := 0; i < 1+n; i++ {
			yy, ms, err := b.step()
			if err != nil {
				return err
			}
			if i > 0 {
				r.Ms = append(r.Ms, ms)
			}
			for k, v := range yy {
				r.SameBits = r.SameBits && math.Float32bits(v) == math.Float32bits(y0[k])
			}
		}
		out, err := json.Marshal(r)
		if err != nil {
			return err
		}
		fmt.Println(string(out))
	}
	return in.Err()
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}
