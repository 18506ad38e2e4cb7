package engine

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// smallFlash is V4-Flash with the widths that only cost memory shrunk (dim,
// q_lora_rank, o_lora_rank, top-k) and the ones the kernels specialise on kept
// (64 heads × 512, indexer 64 × 128, window 128), so the assembly paths run.
func smallFlash(t testing.TB) *Config {
	cfg, _ := Preset("flash")
	cfg.Dim, cfg.QLoraRank, cfg.OLoraRank, cfg.IndexTopK = 512, 256, 128, 24
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// eachFastPath runs f with the assembly kernels in their AVX-512 forms (when
// available), in their AVX2 forms, and with the pure-Go lane loops, at
// GOMAXPROCS 1, 2 and 16 (16: the FP8 products split their blocks among
// goroutines and share the pool's workers).
func eachFastPath(t *testing.T, f func(t *testing.T)) {
	old, old512, procs := attention.UseAssembly, attention.UseAVX512, runtime.GOMAXPROCS(0)
	defer func() { attention.UseAssembly, attention.UseAVX512 = old, old512; runtime.GOMAXPROCS(procs) }()
	for _, path := range []string{"avx512", "asm", "go"} {
		if path != "go" && !attention.HasAssembly() || path == "avx512" && !attention.HasAVX512() {
			continue
		}
		for _, n := range []int{1, 2, 16} {
			attention.UseAssembly, attention.UseAVX512 = path != "go", path == "avx512"
			runtime.GOMAXPROCS(n)
			t.Run(fmt.Sprintf("%s/P%d", path, n), f)
		}
	}
}

func bitsEqual(a, b []float32) int {
	if len(a) != len(b) {
		return -2
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i
		}
	}
	return -1
}

// TestPreparedStepEqualsRunStep runs several consecutive decode steps of an
// SWA, a CSA and an HCA layer with PreparedLayer.Step and with RunStep (the
// reference) from the same synthetic state, across emitting steps of both
// compressors, and requires y and every state tensor to agree bit for bit.
// The pooled scratch buffers are poisoned (attention.PoisonBufPools): a
// value read before the step writes it is a NaN, not a stale value.
func TestPreparedStepEqualsRunStep(t *testing.T) {
	defer attention.PoisonBufPools(attention.PoisonBufPools(true))
	cfg := smallFlash(t)
	type layerCase struct {
		layer int
		start int64
		steps int
	}
	cases := []layerCase{{0, 300, 3}, {2, 509, 6}, {3, 380, 4}} // CSA: emits at 511, 515 (and Tc > top-k); HCA: emits at 383
	if testing.Short() {
		cases = []layerCase{{2, 510, 3}, {3, 382, 2}}
	}
	for _, c := range cases {
		w := RandomLayerWeights(cfg, c.layer, 7)
		rope := LayerRope(cfg, c.layer, int(c.start)+c.steps+1)
		p := Prepare(cfg, w)
		st0 := SyntheticState(cfg, w, rope, c.start, 3)
		// the reference chain, once
		type refStep struct {
			y     []float32
			state map[string]Tensor
		}
		var want []refStep
		st := st0.Clone()
		for i := 0; i < c.steps; i++ {
			pos := c.start + int64(i)
			out, next, err := RunStep(&StepContext{Cfg: cfg, Layer: c.layer, Pos: pos, W: w, Rope: rope}, SyntheticInput(cfg, pos, 9), st)
			if err != nil {
				t.Fatal(err)
			}
			want = append(want, refStep{out["y"].F, next.StateTensors()})
			st = next
		}
		eachFastPath(t, func(t *testing.T) {
			st := st0.Clone()
			for i, ref := range want {
				pos := c.start + int64(i)
				y, err := p.Step(cfg, rope, st, SyntheticInput(cfg, pos, 9).F, pos)
				if err != nil {
					t.Fatal(err)
				}
				if k := bitsEqual(y, ref.y); k != -1 {
					t.Fatalf("layer %d step %d: y differs from RunStep at %d", c.layer, pos, k)
				}
				got := st.StateTensors()
				for name, wt := range ref.state {
					if k := bitsEqual(got[name].F, wt.F); k != -1 || !slices.Equal(got[name].Shape, wt.Shape) {
						t.Fatalf("layer %d step %d: state %s differs from RunStep (at %d, shape %v vs %v)", c.layer, pos, name, k, got[name].Shape, wt.Shape)
					}
				}
			}
		})
	}
}

func TestPreparedStepErrors(t *testing.T) {
	cfg, _ := Preset("tiny")
	w := RandomLayerWeights(cfg, 1, 1)
	rope := LayerRope(cfg, 1, 64)
	p := Prepare(cfg, w)
	st := SyntheticState(cfg, w, rope, 20, 1)
	x := SyntheticInput(cfg, 20, 1).F
	for _, c := range []struct {
		name string
		st   *LayerState
		x    []float32
		pos  int64
	}{
		{"short x", st, x[:10], 20},
		{"wrong position", st, x, 21},
		{"past the rope table", NewLayerState(cfg, 1), x, 64},
		{"wrong layer state", NewLayerState(cfg, 2), x, 20},
	} {
		if _, err := p.Step(cfg, rope, c.st.Clone(), c.x, c.pos); err == nil {
			t.Errorf("%s: no error", c.name)
		}
	}
	// the tiny model (4 heads: the kernels' padded-lane and reference paths) agrees too
	ref, _, err := RunStep(&StepContext{Cfg: cfg, Layer: 1, Pos: 20, W: w, Rope: rope}, SyntheticInput(cfg, 20, 1), st)
	if err != nil {
		t.Fatal(err)
	}
	y, err := p.Step(cfg, rope, st.Clone(), x, 20)
	if err != nil {
		t.Fatal(err)
	}
	if k := bitsEqual(y, ref["y"].F); k != -1 {
		t.Fatalf("tiny layer 1: y differs at %d", k)
	}
}

func TestTopKFastEqualsTopK(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 2))
	for _, n := range []int{0, 1, 7, 600, 20000} {
		for _, kind := range []string{"normal", "ties", "special"} {
			s := make([]float32, n)
			for i := range s {
				switch kind {
				case "normal":
					s[i] = quant.BF16Round(float32(rng.NormFloat64()))
				case "ties":
					s[i] = float32(rng.IntN(5)) / 4
				default:
					s[i] = []float32{0, float32(math.Copysign(0, -1)), float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), -1, 3e38}[rng.IntN(7)]
				}
			}
			for _, k := range []int{0, min(1, n), n / 3, n} {
				want, _ := indexer.TopK(s, k)
				if got := topKFast(s, k); !slices.Equal(got, want) {
					t.Fatalf("n=%d %s k=%d: topKFast differs from indexer.TopK", n, kind, k)
				}
			}
		}
	}
}

// TestIndexScoresFastEqualsIndexer checks the attention package's fused
// scoring against the indexer's own reference stages.
func TestIndexScoresFastEqualsIndexer(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	const heads, hd, tc = 64, 128, 700
	v := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = quant.BF16Round(float32(rng.NormFloat64()))
		}
		return x
	}
	iq, ic, w := v(heads*hd), v(tc*hd), v(heads)
	qk := make([]float32, heads*tc)
	want, got := make([]float32, tc), make([]float32, tc)
	indexer.IndexQK(qk, iq, ic, heads, hd)
	indexer.IndexScore(want, qk, w)
	eachFastPath(t, func(t *testing.T) {
		attention.IndexScoresFast(got, iq, ic, w, heads, hd)
		if k := bitsEqual(got, want); k != -1 {
			t.Fatalf("score differs from indexer.IndexScore at %d", k)
		}
	})
}

// TestStagesFastEqualReference runs RunStep (every stage of the graph, as the
// replays do) with and without prepared weights (W.Fast) and requires every
// stage tensor to agree bit for bit, at emitting and non-emitting steps.
func TestStagesFastEqualReference(t *testing.T) {
	cfg := smallFlash(t)
	for _, c := range []struct {
		layer int
		pos   int64
	}{{0, 200}, {2, 510}, {2, 511}, {3, 383}} {
		w := RandomLayerWeights(cfg, c.layer, 11)
		rope := LayerRope(cfg, c.layer, int(c.pos)+1)
		st := SyntheticState(cfg, w, rope, c.pos, 2)
		x := SyntheticInput(cfg, c.pos, 4)
		ctx := &StepContext{Cfg: cfg, Layer: c.layer, Pos: c.pos, W: w, Rope: rope}
		want, _, err := RunStep(ctx, x, st)
		if err != nil {
			t.Fatal(err)
		}
		PrepareLayer(cfg, w)
		eachFastPath(t, func(t *testing.T) {
			got, _, err := RunStep(ctx, x, st)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(want) {
				t.Fatalf("%d stages, reference %d", len(got), len(want))
			}
			for name, wt := range want {
				g := got[name]
				if k := bitsEqual(g.F, wt.F); k != -1 || !slices.Equal(g.I, wt.I) {
					t.Fatalf("layer %d step %d: stage %s differs from the reference (float index %d)", c.layer, c.pos, name, k)
				}
			}
		})
		w.Fast = nil
	}
}
