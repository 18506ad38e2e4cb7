package attribute

import (
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
)

// blockCase is one stage of the whole layer on the official golden: its
// call (the dumped inputs) and the GPU's dumped value.
type blockCase struct {
	p     int64
	l     int
	call  *Call
	gpu   engine.Tensor
	exact bool // the reference reproduces the GPU bit for bit
}

// blockCases reads official-v4-tiny's steps 3..7 and returns every stage
// around the attention sub-layer that has hypotheses (router, experts,
// hyper-connections, hc_post, head), computed from its dumped inputs.
func blockCases(t *testing.T) []blockCase {
	t.Helper()
	dir := filepath.Join("..", "testdata", "official-v4-tiny")
	cfg, err := engine.LoadConfig(filepath.Join(dir, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	ws, err := dump.OpenSafetensors(filepath.Join(dir, "weights.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	hw, err := engine.LoadHeadWeights(cfg, ws)
	if err != nil {
		t.Fatal(err)
	}
	var out []blockCase
	for l := 0; l < cfg.NLayers; l++ {
		w, err := engine.LoadLayerWeights(cfg, l, ws)
		if err != nil {
			t.Fatal(err)
		}
		if w.Block, err = engine.LoadBlockWeights(cfg, l, ws); err != nil {
			t.Fatal(err)
		}
		for _, p := range []int64{3, 4, 5, 6, 7} {
			cur := goldenTensors(t, filepath.Join(dir, fmt.Sprintf("step_%d.safetensors", p)))
			get := func(n string) (engine.Tensor, bool) {
				if b, ok := strings.CutPrefix(n, engine.GlobalPrefix); ok {
					v, ok := cur[b]
					return v, ok
				}
				v, ok := cur[fmt.Sprintf("L%d.%s", l, n)]
				return v, ok
			}
			ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Head: hw}
			attn := map[string]bool{}
			for _, def := range engine.Stages(cfg, l, p) {
				attn[def.Name] = true // TestAttributeGoldenNoFalseClaim's
			}
			for _, def := range engine.BlockStages(cfg, l, p, w, hw) {
				if attn[def.Name] || len(Hypotheses(def.Name)) == 0 {
					continue
				}
				gpu, ok := get(def.Name)
				if def.Global {
					gpu, ok = cur[def.Name]
				}
				if !ok {
					t.Fatalf("L%d p%d: the golden lacks %s", l, p, def.Name)
				}
				in := map[string]engine.Tensor{}
				for _, n := range def.Inputs {
					v, ok := get(n)
					if !ok {
						t.Fatalf("L%d p%d %s: the golden lacks input %s", l, p, def.Name, n)
					}
					in[n] = v
				}
				ref, err := def.Compute(ctx, in)
				if err != nil {
					t.Fatalf("L%d p%d %s: %v", l, p, def.Name, err)
				}
				c := &Call{Ctx: ctx, Def: def, In: in, Ref: ref, Get: get}
				out = append(out, blockCase{p: p, l: l, call: c, gpu: gpu, exact: distance("", "", ref, gpu).Exact})
			}
		}
	}
	return out
}

// TestBlockHypotheses: on the clean official golden no hypothesis of a
// stage of the whole step reproduces the GPU where the reference does not
// (no false claim); each hypothesis that runs, taken as the GPU's value, is
// named as reproducing it bit for bit; and each of the listed ones differs
// from the reference somewhere (it can be told apart).
func TestBlockHypotheses(t *testing.T) {
	cases := blockCases(t)
	ran, differed := map[string]bool{}, map[string]bool{}
	stages := map[string]bool{}
	for _, bc := range cases {
		name := bc.call.Def.Name
		stages[name] = true
		v := Attribute(bc.call, bc.gpu)
		for _, h := range v.Exact {
			if !bc.exact {
				t.Errorf("L%d p%d %s: hypothesis %q reproduces the clean GPU value and the reference does not", bc.l, bc.p, name, h)
			}
		}
		if v.Best != nil && !v.Best.Exact && v.Best.MaxULP > 1 {
			t.Errorf("L%d p%d %s: %q is closer to the clean GPU than the reference (%+v vs %+v)", bc.l, bc.p, name, v.Best.Name, *v.Best, v.Reference)
		}
		for _, h := range Hypotheses(name) {
			key := name + "/" + h.Name
			got, err := safeRun(h, bc.call)
			if err != nil {
				continue
			}
			ran[key] = true
			hv := Attribute(bc.call, got)
			if hv.Best == nil || !hv.Best.Exact || !slices.Contains(hv.Exact, h.Name) {
				t.Errorf("L%d p%d %s: GPU computed as %q, attributed %+v", bc.l, bc.p, name, h.Name, hv.Best)
				continue
			}
			if !hv.Reference.Exact {
				differed[key] = true
				if !strings.Contains(hv.Text(), fmt.Sprintf("%q", h.Name)) {
					t.Errorf("%s: text %q does not name it", key, hv.Text())
				}
			}
		}
	}
	for _, s := range []string{"moe_indices", "moe_weights", "ffn_out", "hc_attn_comb", "hc_ffn_pre", "hc_ffn_post", "h_mid", "h_out", "logits"} {
		if !stages[s] {
			t.Errorf("no golden case of stage %s", s)
		}
	}
	var never []string
	for k := range ran {
		if !differed[k] {
			never = append(never, k)
		}
	}
	sort.Strings(never)
	t.Logf("never differ from the reference on the golden: %v", never)
	for _, must := range []string{
		"moe_indices/hash-row-next", "moe_indices/hash-row-prev", "moe_indices/topk-on-hash-layer", "moe_indices/no-selection-bias",
		"moe_weights/weights-unnormalised", "moe_weights/weights-no-route-scale", "moe_weights/weights-with-bias",
		"ffn_out/fp4-nibble-swap", "ffn_out/fp4-scale-per-128", "ffn_out/shared-gate-up-swapped", "ffn_out/no-shared-expert",
		"hc_attn_comb/sinkhorn-no-eps", "hc_ffn_comb/sinkhorn-one-fewer", "hc_ffn_pre/pre-no-sigmoid", "hc_ffn_post/post-no-sigmoid",
		"hc_ffn_post/post-no-factor-2", "h_mid/hc-post-comb-transposed", "h_out/hc-post-unmixed", "h_out/hc-post-no-post-weights",
		"logits/head-no-final-norm", "logits/head-norm-no-weight", "logits/hc-head-mean", "logits/hc-head-stream-0",
	} {
		if !ran[must] {
			t.Errorf("%s never ran on the golden", must)
		} else if !differed[must] {
			t.Errorf("%s never differs from the reference", must)
		}
	}
}
