package attribute

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"sparsemla/engine"
)

// stepCase is one synthetic decode step of one layer: every stage's value
// (the reference chain), the state before it, and its context.
type stepCase struct {
	ctx  *engine.StepContext
	x    engine.Tensor
	prev map[string]engine.Tensor
	out  map[string]engine.Tensor
}

var (
	synthOnce  sync.Once
	synthCases []stepCase
	synthErr   error
)

// synthSteps makes the synthetic steps once per test binary.
func synthSteps(t *testing.T) []stepCase {
	t.Helper()
	synthOnce.Do(func() { synthCases, synthErr = makeSynthSteps() })
	if synthErr != nil {
		t.Fatal(synthErr)
	}
	return synthCases
}

func makeSynthSteps() ([]stepCase, error) {
	cfg, err := engine.Preset("tiny")
	if err != nil {
		return nil, err
	}
	var cases []stepCase
	for l := 0; l < cfg.NLayers; l++ {
		w := engine.RandomLayerWeights(cfg, l, 7)
		rope := engine.LayerRope(cfg, l, 160)
		for _, p := range []int64{7, 131} {
			if cfg.Ratio(l) == 128 && p == 7 {
				continue
			}
			st := engine.SyntheticState(cfg, w, rope, p, 11)
			x := engine.SyntheticInput(cfg, p, 11)
			ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Rope: rope}
			out, _, err := engine.RunStep(ctx, x, st)
			if err != nil {
				return nil, fmt.Errorf("layer %d step %d: %w", l, p, err)
			}
			cases = append(cases, stepCase{ctx: ctx, x: x, prev: st.StateTensors(), out: out})
		}
	}
	return cases, nil
}

// call builds the Call of stage def in case sc: the stage's inputs from the
// chain's values, Get over every value of the step and the state before it.
func (sc stepCase) call(def engine.StageDef) *Call {
	all := map[string]engine.Tensor{"x": sc.x}
	for n, v := range sc.prev {
		all[engine.PrevPrefix+n] = v
	}
	for n, v := range sc.out {
		all[n] = v
	}
	in := map[string]engine.Tensor{}
	for _, n := range def.Inputs {
		in[n] = all[n]
	}
	return &Call{Ctx: sc.ctx, Def: def, In: in, Ref: sc.out[def.Name], Get: func(n string) (engine.Tensor, bool) {
		v, ok := all[n]
		return v, ok
	}}
}

// Every hypothesis that runs, taken as the GPU's value, is named by
// Attribute as reproducing it bit for bit; hypotheses that give the same
// tensor are listed together. Across the synthetic steps, every hypothesis
// of the required list differs from the reference at least once (else it
// could never be told apart).
func TestAttributeNamesEachHypothesis(t *testing.T) {
	cases := synthSteps(t)
	differed := map[string]bool{}
	ran := map[string]bool{}
	for _, sc := range cases {
		for _, def := range engine.Stages(sc.ctx.Cfg, sc.ctx.Layer, sc.ctx.Pos) {
			c := sc.call(def)
			for _, h := range Hypotheses(def.Name) {
				key := def.Name + "/" + h.Name
				gpu, err := safeRun(h, c)
				if err != nil {
					continue
				}
				ran[key] = true
				v := Attribute(c, gpu)
				if v == nil || v.Best == nil || !v.Best.Exact || !slices.Contains(v.Exact, h.Name) {
					t.Errorf("layer %d step %d %s: GPU computed as %q, attributed %+v", sc.ctx.Layer, sc.ctx.Pos, def.Name, h.Name, v.Best)
					continue
				}
				if !v.Reference.Exact {
					differed[key] = true
					if !strings.Contains(v.Text(), h.Name) {
						t.Errorf("%s: text %q does not name it", key, v.Text())
					}
				}
			}
		}
	}
	var never []string
	for k := range ran {
		if !differed[k] {
			never = append(never, k)
		}
	}
	sort.Strings(never)
	for _, k := range never {
		t.Logf("never differs from the reference on the synthetic steps: %s", k)
	}
	for _, must := range []string{
		"o/bf16-logits", "o/bf16-softmax", "o/bf16-logits-softmax", "o/no-sink", "o/splitk-no-sink", "o/splitk-unscaled-split-1",
		"o/splitk-base-e", "o/neg-index-last-row", "kv/no-fq8", "kv/fq8-scale-floor2", "kv/fq8-all-dims", "q_a/weight-only-fp8",
		"kv_raw/weight-only-fp8", "cq/hf-rmsnorm", "iq_had/no-hadamard", "iq/no-fq4", "iq/fp8-instead-of-fq4", "index_score/fp32-scorer",
		"cmp_a/bf16-gemm", "kv_roped/rope-neox", "kv_roped/rope-position p-1", "kv_roped/rope-table: bf16 inv_freq", "q/rope-table: bf16 inv_freq",
		"kv_cache/window-slot p-1", "kv_cache/window-slot p+1", "kv_cache/window-not-written", "kv_cache/compressed-row-not-written",
		"topk_idxs/v4.1-window-order", "o_inv/no-inverse-rope", "cmp_normed/fp32-pooled-norm", "icmp_had/no-hadamard",
	} {
		if !ran[must] {
			t.Errorf("%s never ran on the synthetic steps", must)
		} else if !differed[must] {
			t.Errorf("%s never differs from the reference", must)
		}
	}
}

// The reference itself is never attributed to a hypothesis, and a value no
// hypothesis explains gets the closest one only when it is closer than the
// reference.
func TestAttributeReferenceAndNoise(t *testing.T) {
	sc := synthSteps(t)[2] // layer 1 (r = 4), step 7
	for _, def := range engine.Stages(sc.ctx.Cfg, sc.ctx.Layer, sc.ctx.Pos) {
		c := sc.call(def)
		v := Attribute(c, c.Ref)
		if v == nil {
			continue
		}
		if !v.Reference.Exact {
			t.Fatalf("%s: the reference is not exact against itself", def.Name)
		}
		for _, m := range v.Tried {
			if m.Exact && v.Best != nil && v.Best.Name == m.Name {
				// a hypothesis equal to the reference on this data may match; it is reported, fine
				continue
			}
		}
		if def.Name == "o" && c.Ref.Kind.IsFloat() {
			noisy := c.Ref.Clone()
			for i := range noisy.F {
				noisy.F[i] = -noisy.F[i]
			}
			v := Attribute(c, noisy)
			if v.Best != nil && v.Best.Exact {
				t.Fatalf("o negated is attributed exactly to %q", v.Best.Name)
			}
			if v.Best != nil && !closer(*v.Best, v.Reference) {
				t.Fatalf("best %+v is not closer than the reference %+v", v.Best, v.Reference)
			}
		}
	}
}

// TestAttributeV32: on synthetic V3.2 steps every hypothesis that runs on a
// V3.2 stage is named when the GPU computes it, and the four forms of the
// demo code before 8631a81 differ from the reference (so a GPU running that
// code is told apart and named).
func TestAttributeV32(t *testing.T) {
	cfg, _ := engine.Preset("v32-tiny")
	differed := map[string]bool{}
	for l := 0; l < cfg.NLayers; l++ {
		w := engine.RandomLayerWeights(cfg, l, 7)
		rope := engine.LayerRope(cfg, l, 64)
		for _, p := range []int64{9, 30} {
			st := engine.SyntheticState(cfg, w, rope, p, 11)
			x := engine.SyntheticInput(cfg, p, 11)
			ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Rope: rope}
			out, _, err := engine.RunStep(ctx, x, st)
			if err != nil {
				t.Fatal(err)
			}
			sc := stepCase{ctx: ctx, x: x, prev: st.StateTensors(), out: out}
			for _, def := range engine.Stages(cfg, l, p) {
				c := sc.call(def)
				for _, h := range Hypotheses(def.Name) {
					gpu, err := safeRun(h, c)
					if err != nil {
						continue
					}
					v := Attribute(c, gpu)
					if v == nil || v.Best == nil || !v.Best.Exact || !slices.Contains(v.Exact, h.Name) {
						t.Errorf("layer %d step %d %s: GPU computed as %q, attributed %+v", l, p, def.Name, h.Name, v.Best)
					}
					if !v.Reference.Exact {
						differed[def.Name+"/"+h.Name] = true
					}
				}
			}
		}
	}
	for _, must := range []string{"iq_roped/v32-indexer-rope-interleaved", "ik_roped/v32-indexer-rope-interleaved",
		"iw_raw/v32-weights-proj-bf16", "kv_fq8/v32-latent-bf16", "o_latent/v32-fp32-scores"} {
		if !differed[must] {
			t.Errorf("%s never differs from the reference on the V3.2 steps", must)
		}
	}
}

// A cache-write hypothesis at no decode position (a record of step -1)
// says what it needs instead of panicking in the window write (safeRun
// would turn the panic into the skip "kvcache: window write shape
// mismatch", which names nothing the user can check).
func TestCacheWriteNeedsPosition(t *testing.T) {
	sc := synthSteps(t)[0]
	ctx := *sc.ctx
	ctx.Pos = -1
	sc.ctx = &ctx
	for _, def := range engine.Stages(ctx.Cfg, ctx.Layer, 7) {
		if def.Name != "kv_cache" {
			continue
		}
		for _, h := range cacheWriteHypotheses() {
			_, err := h.run(sc.call(def))
			if err == nil || !strings.Contains(err.Error(), "needs a decode position ≥ 0 and a window (position -1") {
				t.Errorf("%s: %v", h.Name, err)
			}
		}
		return
	}
	t.Fatal("no kv_cache stage")
}
