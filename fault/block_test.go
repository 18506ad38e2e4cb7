package fault

import (
	"errors"
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/moe"
)

// TestRouterFaultTieAware: a router fault whose experts differ from the
// reference's only among near-equal candidates (score + bias within the
// replay's tie rule of the k-th) is refused as invisible — a replay calls
// that a tie, not a router bug; a clear gap is injected.
func TestRouterFaultTieAware(t *testing.T) {
	cfg, err := engine.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		bias float32
		tie  bool
	}{{1e-7, true}, {1e-2, false}} {
		// Experts 0 and 1 score the same; the bias makes 1 the choice, its
		// absence 0 (the lower id among equals).
		g := moe.Gate{Experts: 3, TopK: 1, Dim: 1, Func: moe.Sigmoid, RouteScale: 1,
			Weight: []float32{1, 1, 0}, Bias: []float32{0, c.bias, 0}}
		w := &engine.LayerWeights{Block: &engine.BlockWeights{MoE: &moe.MoE{Gate: g}}}
		ctx := &engine.StepContext{Cfg: cfg, Layer: 1, Pos: 7, W: w}
		in := map[string]engine.Tensor{"ffn_in": engine.FromF(engine.KindBF16, []float32{1}, 1)}
		ref := engine.FromI(engine.KindI64, []int64{1}, 1)
		j := newFaultInjector(Fault{Kind: RouterBias, Step: 7, Layer: 1}, 1, nil, cfg)
		bad, err := j.apply(ctx, ref, ref, in, true)
		if c.tie {
			if !errors.Is(err, ErrInvisible) || !strings.Contains(err.Error(), "a tie at the top-k boundary") {
				t.Errorf("bias %g: %v, want the tie refusal", c.bias, err)
			}
			continue
		}
		if err != nil || len(bad.I) != 1 || bad.I[0] != 0 {
			t.Errorf("bias %g: %v %v, want expert 0", c.bias, bad.I, err)
		}
	}
}
