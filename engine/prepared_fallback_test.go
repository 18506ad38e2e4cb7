package engine

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"

	"sparsemla/attention"
)

// The FP8 kernels fall back to the reference loop (same bits, ~20× slower)
// for inputs outside their proven range. These tests check that checkpoint
// weights with the activations a real step feeds them never do, so that a
// range check made too strict shows up as a failure instead of a slow step.

// requireKernels skips when the FP8 products run the reference loop anyway
// (no AVX2, -tags purego, or UseAssembly off).
func requireKernels(t *testing.T) {
	t.Helper()
	if !attention.HasAssembly() || !attention.UseAssembly {
		t.Skip("no AVX2 kernels: every FP8 product runs the reference loop")
	}
}

// TestFP8ReferenceFallbackCounted checks that ReferencePanels counts a
// fallback (so the tests below can fail): a weight whose scale byte is
// outside the kernels' range runs the reference for each of its panels.
func TestFP8ReferenceFallbackCounted(t *testing.T) {
	requireKernels(t)
	rng := rand.New(rand.NewPCG(1, 2))
	codes, scale := make([]uint8, 256*512), make([]uint8, 2*4)
	for i := range codes {
		codes[i] = normCodeTabs()[8][uint16(rng.Uint32())]
	}
	for i := range scale {
		scale[i] = 127 - 12
	}
	x := fastRand(rng, 512, -1)
	y := make([]float32, 256)
	r0 := attention.ReferencePanels()
	attention.PackFP8(codes, scale, 256, 512).Linear(y, x)
	if d := attention.ReferencePanels() - r0; d != 0 {
		t.Fatalf("checkpoint codes: %d panels ran the reference loop", d)
	}
	scale[0] = 127 + 120 // 2^120: outside the kernels' range
	r0 = attention.ReferencePanels()
	attention.PackFP8(codes, scale, 256, 512).Linear(y, x)
	if d := attention.ReferencePanels() - r0; d != 4 {
		t.Fatalf("scale 2^120: %d panels counted as reference, want 4", d)
	}
}

// TestPreparedStepNoReferenceFallback runs prepared steps on checkpoint-like
// weights — RandomLayerWeights through Prepare (wo_a re-encoded as FP8), at
// the small test dims, and the step benchmarks' V4-Flash layers — and
// requires that no FP8 panel took the reference loop, at GOMAXPROCS 1 and 2.
func TestPreparedStepNoReferenceFallback(t *testing.T) {
	requireKernels(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	cfg := smallFlash(t)
	for _, layer := range []int{0, 2, 3} {
		w := RandomLayerWeights(cfg, layer, 11)
		pos := int64(515)
		rope := LayerRope(cfg, layer, int(pos)+2)
		p := Prepare(cfg, w)
		if p.WoA.FP8 == nil {
			t.Fatalf("layer %d: wo_a was not re-encoded as FP8", layer)
		}
		st0 := SyntheticState(cfg, w, rope, pos, 5)
		for _, procs := range []int{1, 2} {
			runtime.GOMAXPROCS(procs)
			st := st0.Clone()
			r0 := attention.ReferencePanels()
			for i := range int64(2) {
				if _, err := p.Step(cfg, rope, st, SyntheticInput(cfg, pos+i, 3).F, pos+i); err != nil {
					t.Fatal(err)
				}
			}
			if d := attention.ReferencePanels() - r0; d != 0 {
				t.Errorf("small dims, layer %d, GOMAXPROCS %d: %d FP8 panels ran the reference loop", layer, procs, d)
			}
		}
	}
	if testing.Short() {
		return
	}
	flash, _ := Preset("flash")
	for _, layer := range []int{2, 3} { // CSA, HCA: every FP8 weight of a layer
		p, st, rope, x, pos := benchLayer(flash, "checkpoint", layer, 4096, 1)
		runtime.GOMAXPROCS(2)
		r0 := attention.ReferencePanels()
		if _, err := p.Step(flash, rope, st, x, pos); err != nil {
			t.Fatal(err)
		}
		if d := attention.ReferencePanels() - r0; d != 0 {
			t.Errorf("V4-Flash dims, layer %d: %d FP8 panels ran the reference loop", layer, d)
		}
	}
}

// TestGoldenLinearsNoReferenceFallback feeds official-v4-tiny's checkpoint
// weights (prepared) the GPU's own inputs of every FP8 linear at every
// dumped step — x (wq_a, wkv), cq (wq_b, indexer wq_b), o_inv (wo_a), u
// (wo_b) — and requires the kernels' outputs to equal the reference linears
// bit for bit with no panel taking the reference loop.
func TestGoldenLinearsNoReferenceFallback(t *testing.T) {
	requireKernels(t)
	g := openGoldenTiny(t)
	cfg := g.cfg
	for l, w := range g.w {
		p := Prepare(cfg, w)
		if p.WoA.FP8 == nil {
			t.Fatalf("L%d: wo_a was not re-encoded as FP8", l)
		}
		for _, P := range g.steps {
			in := func(name string) []float32 {
				v, ok := g.tensor(t, stepFile(P), fmt.Sprintf("L%d.%s", l, name))
				if !ok {
					t.Fatalf("P=%d L%d: %s missing", P, l, name)
				}
				return v.F
			}
			x, cq, oinv, u := in("x"), in("cq"), in("o_inv"), in("u")
			type lin struct {
				name string
				p    *attention.FP8Panels
				w    *attention.FP8Weight
				x    []float32
			}
			lins := []lin{{"wq_a", p.WqA, w.WqA, x}, {"wkv", p.Wkv, w.Wkv, x}, {"wq_b", p.WqB, w.WqB, cq}, {"wo_b", p.WoB, w.WoB, u}}
			if w.Indexer != nil {
				lins = append(lins, lin{"indexer.wq_b", p.IWqB, w.Indexer.WqB, cq})
			}
			r0 := attention.ReferencePanels()
			for _, c := range lins {
				got, want := make([]float32, c.p.Rows), make([]float32, c.p.Rows)
				c.p.Linear(got, c.x)
				attention.FP8Linear(want, c.x, c.w)
				if k := bitsEqual(got, want); k != -1 {
					t.Fatalf("P=%d L%d %s: kernel differs from FP8Linear at %d", P, l, c.name, k)
				}
			}
			got, want := make([]float32, cfg.OGroups*cfg.OLoraRank), make([]float32, cfg.OGroups*cfg.OLoraRank)
			p.WoA.WoA(got, oinv)
			attention.WoA(want, oinv, w.WoA, cfg.OGroups, cfg.OLoraRank)
			if k := bitsEqual(got, want); k != -1 {
				t.Fatalf("P=%d L%d wo_a: kernel differs from WoA at %d", P, l, k)
			}
			if d := attention.ReferencePanels() - r0; d != 0 {
				t.Errorf("P=%d L%d: %d FP8 panels ran the reference loop on the checkpoint's inputs", P, l, d)
			}
		}
	}
}

// TestPreparedStepSplitIndependentOfCodes: a prepared V4-Flash CSA-layer step
// at GOMAXPROCS 2 starts the same number of helper goroutines
// (attention.ParallelHelpers) on checkpoint-like FP8 codes as on uniformly
// random ones, and more than one per FP8 weight: the work split depends on
// the shapes and GOMAXPROCS, never on the code values (issue 15 measured the
// 43-layer step on checkpoint-like codes with 2 cores busy at 16 threads).
func TestPreparedStepSplitIndependentOfCodes(t *testing.T) {
	requireKernels(t)
	if testing.Short() {
		t.Skip("V4-Flash dims")
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(2)
	flash, _ := Preset("flash")
	helpers := map[string]int64{}
	for _, dist := range stepDists {
		p, st, rope, x, pos := benchLayer(flash, dist, 2, 4096, 1)
		h0 := attention.ParallelHelpers()
		if _, err := p.Step(flash, rope, st, x, pos); err != nil {
			t.Fatal(err)
		}
		helpers[dist] = attention.ParallelHelpers() - h0
	}
	t.Logf("helper goroutines of one CSA step at GOMAXPROCS 2: %v", helpers)
	// wq_a, wq_b, wkv, indexer wq_b, wo_a, wo_b: at least one helper each
	if c, u := helpers["checkpoint"], helpers["uniform"]; c != u || c < 6 {
		t.Errorf("helper goroutines of one CSA step at GOMAXPROCS 2: checkpoint codes %d, uniform codes %d (want equal, ≥ 6)", c, u)
	}
}
