// Command csastep times one V4-Flash CSA-layer decode step (layer 2, real
// dims, context 65,536 tokens) with sparsemla's prepared fast path and writes
// the step's exact inputs (FP8 codes + scales, bf16/fp32 weights, caches,
// compressor states, x, RoPE cos/sin) and its output y to a directory, so that
// bench/torch_step.py can time the same step in PyTorch on the same inputs.
// bench/compare.sh runs both.
//
//	go run ./bench/csastep -out /tmp/csastep [-ctx 65536] [-runs 20]
//
// It prints the median step time and writes manifest.json beside the inputs.
//
// With -serve it then stays up for bench/torch_step.py --go-server, which
// interleaves sparsemla's and PyTorch's runs: each line "run T N" on stdin
// sets GOMAXPROCS to T, runs one untimed and N timed steps from the same
// state and answers one JSON line {"threads", "ms", "same_bits"} (same_bits:
// y is bit-identical to the first step's y, whatever T); "quit" ends it.
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
	put := func(name string, v any, shape ...int) error {
		e := entry{Name: name, Shape: shape, File: name + ".bin"}
		switch v.(type) {
		case []uint8:
			e.DType = "u8"
		case []float32:
			e.DType = "f32"
		}
		f, err := os.Create(filepath.Join(dir, e.File))
		if err != nil {
			return err
		}
		if err := binary.Write(f, binary.LittleEndian, v); err != nil {
			f.Close()
			return err
		}
		m.Tensors = append(m.Tensors, e)
		return f.Close()
	}
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
		{"x", x, []int{dim}}, {"cos", cosSin(rope.Cos), []int{32}}, {"sin", cosSin(rope.Sin), []int{32}},
	} {
		if err := put(t.name, t.v, t.shape...); err != nil {
			return err
		}
	}

	// timed steps of the prepared path, each from the same state; the garbage
	// of the generation is collected first so that no GC cycle overlaps them
	runtime.GC()
	var y []float32
	st := st0.Clone()
	step := func() ([]float32, float64, error) {
		copy(st.Cmp.KV, st0.Cmp.KV)
		copy(st.Cmp.Score, st0.Cmp.Score)
		copy(st.ICmp.KV, st0.ICmp.KV)
		copy(st.ICmp.Score, st0.ICmp.Score)
		st.Next = pos
		t0 := time.Now()
		yy, err := p.Step(cfg, rope, st, x, pos)
		return yy, float64(time.Since(t0).Nanoseconds()) / 1e6, err
	}
	for i := 0; i < 3+runs; i++ {
		yy, ms, err := step()
		if err != nil {
			return err
		}
		if i >= 3 {
			m.GoRuns = append(m.GoRuns, ms)
		}
		y = yy
	}
	m.GoMedianMs = median(m.GoRuns)
	if err := put("y_go", y, dim); err != nil {
		return err
	}
	fmt.Printf("sparsemla prepared step: median %.1f ms over %d runs [%.1f-%.1f] (GOMAXPROCS %d, packed weights %.0f MiB)\n",
		m.GoMedianMs, runs, slices.Min(m.GoRuns), slices.Max(m.GoRuns), m.GOMAXPROCS, float64(m.PackedBytes)/(1<<20))
	if ref {
		t0 := time.Now()
		out, _, err := engine.RunStep(&engine.StepContext{Cfg: cfg, Layer: layer, Pos: pos, W: w, Rope: rope}, engine.FromF(engine.KindBF16, x, dim), st0)
		if err != nil {
			return err
		}
		m.GoRefMs = float64(time.Since(t0).Microseconds()) / 1e3
		same := true
		for i, v := range out["y"].F {
			same = same && math.Float32bits(v) == math.Float32bits(y[i])
		}
		fmt.Printf("sparsemla reference RunStep: %.0f ms (y bit-identical to the prepared step: %v)\n", m.GoRefMs, same)
		if !same {
			return fmt.Errorf("the prepared step and the reference disagree")
		}
		idx := out["topk_idxs"].I
		f := make([]float32, len(idx))
		for i, v := range idx {
			f[i] = float32(v)
		}
		if err := put("topk_idxs", f, len(f)); err != nil {
			return err
		}
	}
	b, err := json.MarshalIndent(m, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), b, 0o644); err != nil {
		return err
	}
	if !serve {
		return nil
	}
	y0 := slices.Clone(y)
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
			yy, ms, err := step()
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
		b, err := json.Marshal(r)
		if err != nil {
			return err
		}
		fmt.Println(string(b))
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
