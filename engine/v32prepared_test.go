package engine

import (
	"fmt"
	"math"
	"runtime"
	"testing"

	"sparsemla/attention"
)

// v32RunAll runs steps p0 … p0+n-1 of the whole V3.2 model (both layers
// chained through x_in / res_in, each carrying its own state from the same
// synthetic start) and returns every stage value and the final states.
func v32RunAll(t *testing.T, cfg *Config, ws []*LayerWeights, p0 int64, n int) map[string]Tensor {
	t.Helper()
	all := map[string]Tensor{}
	ropes := make([]*RopeTable, len(ws))
	states := make([]*LayerState, len(ws))
	for l, w := range ws {
		ropes[l] = LayerRope(cfg, l, int(p0)+n)
		states[l] = SyntheticState(cfg, w, ropes[l], p0, 11)
	}
	for p := p0; p < p0+int64(n); p++ {
		seeds := map[string]Tensor{"x_in": SyntheticInput(cfg, p, 11)}
		for l, w := range ws {
			ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Rope: ropes[l]}
			hook := func(def StageDef, in map[string]Tensor, out Tensor) (Tensor, error) {
				all[fmt.Sprintf("%d/%d/%s", p, l, def.Name)] = out
				return out, nil
			}
			out, next, err := RunLayerHooked(ctx, seeds, states[l], hook)
			if err != nil {
				t.Fatal(err)
			}
			states[l] = next
			seeds = map[string]Tensor{"x_in": out["ffn_out"], "res_in": out["h_mid"]}
		}
	}
	for l, st := range states {
		for name, v := range st.StateTensors() {
			all[fmt.Sprintf("state/%d/%s", l, name)] = v
		}
	}
	return all
}

// TestV32PreparedEqualsReference: the whole V3.2 model (attention, dense
// MLP, MoE, head) on the prepared FP8 linears gives every stage value and
// the final caches bit for bit as the reference loops, over decode steps
// that select (p ≥ index_topk), with the assembly kernels and the pure-Go
// lanes, at GOMAXPROCS 1, 2 and 16; no packed FP8 panel falls back to the
// reference loop on these checkpoint-like weights; Kernels names the path.
func TestV32PreparedEqualsReference(t *testing.T) {
	cfg, made, _ := v32WholeModel(t, 21)
	ref := v32RunAll(t, cfg, made, 17, 3)
	prep := make([]*LayerWeights, len(made))
	refM := &Model{Cfg: cfg, Weights: map[int]*LayerWeights{}}
	prepM := &Model{Cfg: cfg, Weights: map[int]*LayerWeights{}}
	for l, w := range made {
		c := *w
		PrepareLayer(cfg, &c)
		if c.Fast == nil || len(c.Fast.src) == 0 {
			t.Fatalf("layer %d: PrepareLayer packed nothing", l)
		}
		prep[l] = &c
		refM.Weights[l], prepM.Weights[l] = w, &c
	}
	if refM.Kernels() != KernelsReference || prepM.Kernels() != KernelsPrepared {
		t.Fatalf("Kernels: reference model %q, prepared %q", refM.Kernels(), prepM.Kernels())
	}
	old, procs := attention.UseAssembly, runtime.GOMAXPROCS(0)
	defer func() { attention.UseAssembly = old; runtime.GOMAXPROCS(procs) }()
	for _, asm := range []bool{true, false} {
		if asm && !attention.HasAssembly() {
			continue
		}
		for _, n := range []int{1, 2, 16} {
			attention.UseAssembly = asm
			runtime.GOMAXPROCS(n)
			r0 := attention.ReferencePanels()
			got := v32RunAll(t, cfg, prep, 17, 3)
			if d := attention.ReferencePanels() - r0; asm && d != 0 {
				t.Errorf("asm %v GOMAXPROCS %d: %d FP8 panels ran the reference loop", asm, n, d)
			}
			if len(got) != len(ref) {
				t.Fatalf("asm %v GOMAXPROCS %d: %d values, the reference %d", asm, n, len(got), len(ref))
			}
			for k, a := range ref {
				b, ok := got[k]
				if !ok || len(a.F) != len(b.F) || len(a.I) != len(b.I) {
					t.Fatalf("asm %v GOMAXPROCS %d: %s missing or of another shape", asm, n, k)
				}
				for i := range a.F {
					if math.Float32bits(a.F[i]) != math.Float32bits(b.F[i]) {
						t.Fatalf("asm %v GOMAXPROCS %d: %s[%d] = %g, the reference %g", asm, n, k, i, b.F[i], a.F[i])
					}
				}
				for i := range a.I {
					if a.I[i] != b.I[i] {
						t.Fatalf("asm %v GOMAXPROCS %d: %s[%d] = %d, the reference %d", asm, n, k, i, b.I[i], a.I[i])
					}
				}
			}
		}
	}
	for _, k := range []string{"17/0/q_a", "17/0/ffn_out", "19/1/moe_indices", "19/1/ffn_out", "19/1/logits", "state/1/latent_cache"} {
		if _, ok := ref[k]; !ok {
			t.Fatalf("%s not computed", k)
		}
	}
}

// BenchmarkV32WholeStep is one decode step of the whole v32-tiny model
// (both layers, attention + dense MLP / MoE + head) on the reference loops
// and on the prepared FP8 linears.
func BenchmarkV32WholeStep(b *testing.B) {
	cfg, _ := Preset("v32-tiny")
	const p = 17
	for _, prepared := range []bool{false, true} {
		ws := make([]*LayerWeights, cfg.NLayers)
		ropes := make([]*RopeTable, cfg.NLayers)
		states := make([]*LayerState, cfg.NLayers)
		for l := range ws {
			ws[l] = RandomLayerWeights(cfg, l, 3)
			ws[l].V32.FFN = RandomV32FFNWeights(cfg, l, 3)
			if prepared {
				PrepareLayer(cfg, ws[l])
			}
			ropes[l] = LayerRope(cfg, l, p+1)
			states[l] = SyntheticState(cfg, ws[l], ropes[l], p, 3)
		}
		x := SyntheticInput(cfg, p, 3)
		b.Run(map[bool]string{false: "reference", true: "prepared"}[prepared], func(b *testing.B) {
			for b.Loop() {
				seeds := map[string]Tensor{"x_in": x}
				for l, w := range ws {
					ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Rope: ropes[l]}
					out, _, err := RunLayer(ctx, seeds, states[l])
					if err != nil {
						b.Fatal(err)
					}
					seeds = map[string]Tensor{"x_in": out["ffn_out"], "res_in": out["h_mid"]}
				}
			}
		})
	}
}
