package attribute

import (
	"errors"
	"fmt"

	"sparsemla/engine"
	"sparsemla/moe"
)

// V3.2 hypotheses of the stages outside the attention (engine.V32BlockStages):
// the grouped router (moe_indices, moe_weights), the MoE's shared expert and
// the dense MLP (ffn_out) and the head (logits), each the stage recomputed
// from its own inputs with one known bug. Where a bug is the same as one of
// V4's (hypotheses_block.go) the name is V4's with the prefix "v32-"
// ("v32-no-selection-bias", "v32-weights-unnormalised",
// "v32-shared-gate-up-swapped", "v32-head-no-final-norm"): V4's run on V4
// weights only and these on V3.2 weights only (the other is skipped).

var errNotV32FFN = errors.New("a V3.2 hypothesis; the layer has no V3.2 FFN weights")

func init() {
	add("moe_indices",
		v32Route("v32-no-selection-bias", "grouped routing with the selection bias (e_score_correction_bias) left out, the group score still the top-2 sum",
			func(g *moe.Gate, s []float32, cfg *engine.Config) ([]int32, error) {
				if g.Bias == nil {
					return nil, errors.New("the gate has no bias")
				}
				return moe.V32RouteNoBias(g, s, cfg.NExpertGroups, cfg.NLimitedGroups), nil
			}),
		v32Route("v32-topk-ignoring-groups", "top-k of score + bias over all experts, the group limit (n_limited_groups of n_expert_groups) ignored",
			func(g *moe.Gate, s []float32, cfg *engine.Config) ([]int32, error) {
				if cfg.NExpertGroups <= 1 || cfg.NLimitedGroups >= cfg.NExpertGroups {
					return nil, errors.New("the router keeps every group")
				}
				top, _ := moe.TopK(moe.V32Select(g, s), g.TopK)
				return top, nil
			}),
		v32Route("v32-group-max-with-bias", "each group scored by its maximum (the bias-free rule, V2's group_limited_greedy) although the gate has a bias (V3: the top-2 sum of score + bias)",
			func(g *moe.Gate, s []float32, cfg *engine.Config) ([]int32, error) {
				if g.Bias == nil || cfg.NExpertGroups <= 1 {
					return nil, errors.New("no biased grouped routing")
				}
				return moe.V32RouteGroupMax(g, s, cfg.NExpertGroups, cfg.NLimitedGroups), nil
			}))
	add("moe_weights",
		v32Weights("v32-weights-unnormalised", "the chosen scores × route_scale, not divided by their sum",
			func(g *moe.Gate, s []float32, idx []int32) ([]float32, error) {
				if g.Func == moe.Softmax {
					return nil, errors.New("softmax gates do not normalise")
				}
				return moe.RouteWeights(s, idx, moe.Softmax, g.RouteScale), nil
			}),
		v32Weights("v32-weights-no-route-scale", "the chosen scores divided by their sum, without × route_scale",
			func(g *moe.Gate, s []float32, idx []int32) ([]float32, error) {
				if g.RouteScale == 1 {
					return nil, errors.New("route_scale is 1")
				}
				return moe.RouteWeights(s, idx, g.Func, 1), nil
			}),
		v32Weights("v32-weights-with-bias", "the weights taken from score + bias (the bias is for the choice only)",
			func(g *moe.Gate, s []float32, idx []int32) ([]float32, error) {
				if g.Bias == nil {
					return nil, errors.New("the gate has no bias")
				}
				return moe.RouteWeights(moe.V32Select(g, s), idx, g.Func, g.RouteScale), nil
			}))
	add("ffn_out",
		v32MoEVariant("v32-shared-gate-up-swapped", "the shared expert with w1 (gate) and w3 (up) exchanged",
			func(f *engine.V32FFNWeights) *engine.V32MLP { return f.Shared.GateUpSwapped() }),
		v32MoEVariant("v32-no-shared-expert", "the routed experts only, the shared expert left out",
			func(f *engine.V32FFNWeights) *engine.V32MLP { return nil }),
		Hypothesis{Name: "v32-dense-gate-up-swapped", Desc: "the dense MLP with w1 (gate) and w3 (up) exchanged",
			run: func(c *Call) (engine.Tensor, error) {
				f, err := v32FFNOf(c)
				if err != nil {
					return engine.Tensor{}, err
				}
				if f.Dense == nil {
					return engine.Tensor{}, errors.New("not a dense layer")
				}
				x, err := inF(c, "ffn_in")
				if err != nil {
					return engine.Tensor{}, err
				}
				out := make([]float32, len(x))
				f.Dense.GateUpSwapped().Forward(out, x)
				return like(c, out)
			}})
	add("logits",
		v32Head("v32-head-no-final-norm", "the head on the residual sum bf16(ffn_out + h_mid) without the final RMSNorm (norm.weight)",
			func(c *Call, f *engine.V32FFNWeights, x, res []float32) engine.Tensor {
				return engine.V32HeadNoNorm(f, x, res)
			}),
		v32Head("v32-head-norm-no-weight", "the final RMSNorm without its weight norm.weight",
			func(c *Call, f *engine.V32FFNWeights, x, res []float32) engine.Tensor {
				return engine.V32HeadNormNoWeight(f, x, res, float32(c.Ctx.Cfg.NormEps))
			}))
}

func v32FFNOf(c *Call) (*engine.V32FFNWeights, error) {
	if !c.Ctx.Cfg.V32() || c.Ctx.W == nil || c.Ctx.W.V32 == nil || c.Ctx.W.V32.FFN == nil {
		return nil, errNotV32FFN
	}
	return c.Ctx.W.V32.FFN, nil
}

// v32Gate returns the layer's gate and its scores s [E] of ffn_in.
func v32Gate(c *Call) (*engine.V32FFNWeights, *moe.Gate, []float32, []float32, error) {
	f, err := v32FFNOf(c)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	if f.Gate == nil {
		return nil, nil, nil, nil, errors.New("not a MoE layer")
	}
	x, err := inF(c, "ffn_in")
	if err != nil {
		return nil, nil, nil, nil, err
	}
	if len(x) != f.Gate.Dim {
		return nil, nil, nil, nil, fmt.Errorf("ffn_in has %d values, the gate %d", len(x), f.Gate.Dim)
	}
	s := make([]float32, f.Gate.Experts)
	f.Gate.Scores(s, x)
	return f, f.Gate, x, s, nil
}

// v32Routed returns the stage's moe_indices as expert ids of g.
func v32Routed(c *Call, g *moe.Gate) ([]int32, error) {
	t, ok := c.get("moe_indices")
	if !ok || t.Kind.IsFloat() {
		return nil, errors.New("needs moe_indices, which is not available")
	}
	idx := make([]int32, len(t.I))
	for i, e := range t.I {
		if e < 0 || e >= int64(g.Experts) {
			return nil, fmt.Errorf("moe_indices[%d] = %d is not an expert", i, e)
		}
		idx[i] = int32(e)
	}
	return idx, nil
}

func v32Route(name, desc string, choose func(g *moe.Gate, s []float32, cfg *engine.Config) ([]int32, error)) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		_, g, _, s, err := v32Gate(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		ids, err := choose(g, s, c.Ctx.Cfg)
		if err != nil {
			return engine.Tensor{}, err
		}
		return idsLike(c, ids)
	}}
}

func v32Weights(name, desc string, weigh func(g *moe.Gate, s []float32, idx []int32) ([]float32, error)) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		_, g, _, s, err := v32Gate(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		idx, err := v32Routed(c, g)
		if err != nil {
			return engine.Tensor{}, err
		}
		w, err := weigh(g, s, idx)
		if err != nil {
			return engine.Tensor{}, err
		}
		return like(c, w)
	}}
}

// v32MoEVariant is ffn_out of the MoE with the dumped route and the shared
// expert replaced (nil: left out).
func v32MoEVariant(name, desc string, shared func(f *engine.V32FFNWeights) *engine.V32MLP) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		f, g, x, _, err := v32Gate(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		idx, err := v32Routed(c, g)
		if err != nil {
			return engine.Tensor{}, err
		}
		w, err := inF(c, "moe_weights")
		if err != nil {
			return engine.Tensor{}, err
		}
		if len(w) != len(idx) {
			return engine.Tensor{}, fmt.Errorf("moe_weights has %d values, moe_indices %d", len(w), len(idx))
		}
		out := make([]float32, len(x))
		engine.V32MoE(out, x, moe.Route{Indices: idx, Weights: w}, f.Experts, shared(f))
		return like(c, out)
	}}
}

func v32Head(name, desc string, logits func(c *Call, f *engine.V32FFNWeights, x, res []float32) engine.Tensor) Hypothesis {
	return Hypothesis{Name: name, Desc: desc, run: func(c *Call) (engine.Tensor, error) {
		f, err := v32FFNOf(c)
		if err != nil {
			return engine.Tensor{}, err
		}
		if f.Head == nil {
			return engine.Tensor{}, errors.New("the model has no head weights")
		}
		x, err := inF(c, "ffn_out")
		if err != nil {
			return engine.Tensor{}, err
		}
		res, err := inF(c, "h_mid")
		if err != nil {
			return engine.Tensor{}, err
		}
		if len(x) != len(res) || len(x) != c.Ctx.Cfg.Dim {
			return engine.Tensor{}, fmt.Errorf("ffn_out / h_mid have %d / %d values, dim is %d", len(x), len(res), c.Ctx.Cfg.Dim)
		}
		t := logits(c, f, x, res)
		return like(c, t.F)
	}}
}
