package engine

import (
	"fmt"
	"maps"

	"sparsemla/mhc"
	"sparsemla/moe"
)

// Known alternative computations of the V4.1 whole step's block stages —
// decode bugs and V4 habits — each the reference's stage with one thing
// changed. The replay tries them on a divergent stage (V41Hypotheses) and
// fault injection writes them (fault.V41BlockFault), so that an injected
// fault is named by its own hypothesis.
//
//	moe_expert_out  fp4-nibble-swap         routed experts read the even column from the HIGH nibble
//	                fp4-scale-per-128       routed experts' UE8M0 scales indexed per 128 columns (k/128), not 32
//	                no-swiglu-clamp         routed experts without the swiglu_limit clamp
//	moe_shared_out  shared-no-swiglu-clamp  the shared expert without the clamp (V4's shared expert has none)
//	                shared-gate-up-swapped  the shared expert with w1 and w3 exchanged
//	moe_indices  no-selection-bias       top-k of the scores without gate.bias
//	moe_weights  weights-unnormalised    the chosen scores × route_scale, no division by their sum
//	h_mid, h_out hc-post-comb-transposed hc_post with comb transposed
//	hc_*_post    post-no-sigmoid         post = 2·(mixes·scale + base)
//	attn_norm_in v4-own-pre-mix          the collapse with this site's own hc_attn_pre (V4's order; V4.1 pipelines)
//	logits       head-no-final-norm      logits = head · f32(head_in), the final norm skipped
func v41BlockHypotheses(stage string) []V41Hypothesis {
	switch stage {
	case "moe_expert_out":
		return []V41Hypothesis{
			{"fp4-nibble-swap", "the routed experts' FP4 codes read with the even column from the HIGH nibble (float4_e2m1fn_x2 keeps it in the low one)", v41RoutedVariant((*moe.FP4Weight).NibbleSwapped)},
			{"fp4-scale-per-128", "the routed experts' UE8M0 scales indexed per 128 columns (k/128) instead of per 32", v41RoutedVariant((*moe.FP4Weight).ScalePer128)},
			{"no-swiglu-clamp", "the routed experts without the swiglu_limit clamp (up to ±limit, gate ≤ limit)", v41ExpertVariant(func(m *moe.V41MoE) error {
				if m.SwigluLimit <= 0 {
					return fmt.Errorf("the model has no swiglu_limit")
				}
				m.SwigluLimit = 0
				return nil
			})},
		}
	case "moe_shared_out":
		return []V41Hypothesis{
			{"shared-no-swiglu-clamp", "the shared expert without the swiglu_limit clamp (V4's shared expert has none; V4.1's has it)", v41SharedVariant(func(m *moe.V41MoE) error {
				if m.SharedLimit <= 0 {
					return fmt.Errorf("the model has no swiglu_limit")
				}
				m.SharedLimit = 0
				return nil
			})},
			{"shared-gate-up-swapped", "the shared expert with w1 (gate) and w3 (up) exchanged", v41SharedVariant(func(m *moe.V41MoE) error {
				if m.Shared == nil {
					return fmt.Errorf("no shared expert")
				}
				m.Shared = m.Shared.GateUpSwapped()
				return nil
			})},
		}
	case "moe_indices":
		return []V41Hypothesis{{"no-selection-bias", "top-k of the scores without the selection bias (gate.bias)", V41IndicesNoBias}}
	case "moe_weights":
		return []V41Hypothesis{
			{"weights-unnormalised", "the chosen experts' scores × route_scale without the division by their sum", v41WeightsRule(false)},
		}
	case "h_mid":
		return []V41Hypothesis{{"hc-post-comb-transposed", "hc_post with comb transposed (out_k = post_k·y + Σ_j comb[k][j]·h_in[j])", V41PostTransposed("attn", "h_in", "y")}}
	case "h_out":
		return []V41Hypothesis{{"hc-post-comb-transposed", "hc_post with comb transposed (out_k = post_k·ffn_out + Σ_j comb[k][j]·h_mid[j])", V41PostTransposed("ffn", "h_mid", "ffn_out")}}
	case "hc_attn_post", "hc_ffn_post":
		side := stage[3 : len(stage)-5]
		return []V41Hypothesis{{"post-no-sigmoid", "post = 2·(mixes[hc:2hc]·scale[1] + base[hc:2hc]), the sigmoid left out", V41PostNoSigmoid(side)}}
	case "attn_norm_in":
		return []V41Hypothesis{{"v4-own-pre-mix", "the attention input collapsed with this site's own hc_attn_pre (V4's order) instead of the incoming pre_mix_in", func(c *V41Context, in map[string]Tensor) (Tensor, error) {
			if c.W == nil || c.W.Block == nil {
				return Tensor{}, fmt.Errorf("no block weights")
			}
			t, err := v41HCMixes("attn", "h_in")(c.Cfg, c.W.Block, in)
			if err != nil {
				return Tensor{}, err
			}
			pre, err := v41HCSplit("attn", "pre")(c.Cfg, c.W.Block, map[string]Tensor{"hc_attn_mixes": t})
			if err != nil {
				return Tensor{}, err
			}
			return v41Collapse("h_in", "pre")(c.Cfg, nil, map[string]Tensor{"h_in": in["h_in"], "pre": pre})
		}}}
	case "logits":
		return []V41Hypothesis{{"head-no-final-norm", "logits = head · f32(head_in): the final RMSNorm (norm.weight) skipped", V41LogitsNoNorm}}
	}
	return nil
}

// v41ExpertVariant is moe_expert_out with the layer's MoE changed by f (on
// a copy).
func v41ExpertVariant(f func(*moe.V41MoE) error) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return v41Variant(f, V41ExpertOutWith)
}

// v41SharedVariant is moe_shared_out with the layer's MoE changed by f.
func v41SharedVariant(f func(*moe.V41MoE) error) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return v41Variant(f, V41SharedOutWith)
}

func v41Variant(f func(*moe.V41MoE) error, stage func(*V41Context, *moe.V41MoE, map[string]Tensor) (Tensor, error)) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return func(c *V41Context, in map[string]Tensor) (Tensor, error) {
		m, err := v41MoEOf(c)
		if err != nil {
			return Tensor{}, err
		}
		v := *m
		if err := f(&v); err != nil {
			return Tensor{}, err
		}
		return stage(c, &v, in)
	}
}

// v41RoutedVariant is moe_expert_out with every routed expert in
// moe_indices read through f.
func v41RoutedVariant(f func(*moe.FP4Weight) *moe.FP4Weight) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return func(c *V41Context, in map[string]Tensor) (Tensor, error) {
		m, err := v41MoEOf(c)
		if err != nil {
			return Tensor{}, err
		}
		idx, err := v41Routed(m, in)
		if err != nil {
			return Tensor{}, err
		}
		bad, err := m.WithRouted(idx, func(e *moe.V41Expert) *moe.V41Expert { return e.Map(f) })
		if err != nil {
			return Tensor{}, err
		}
		return V41ExpertOutWith(c, bad, in)
	}
}

// V41IndicesNoBias is moe_indices as top-k of the plain scores (no bias).
func V41IndicesNoBias(c *V41Context, in map[string]Tensor) (Tensor, error) {
	m, s, err := v41Scores(c, in)
	if err != nil {
		return Tensor{}, err
	}
	top, _ := moe.TopK(s, m.Gate.TopK)
	idx := make([]int64, len(top))
	for i, e := range top {
		idx[i] = int64(e)
	}
	return FromI(KindI64, idx, len(idx)), nil
}

// v41WeightsRule is moe_weights with the division on (norm) or off.
func v41WeightsRule(norm bool) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return func(c *V41Context, in map[string]Tensor) (Tensor, error) {
		m, s, err := v41Scores(c, in)
		if err != nil {
			return Tensor{}, err
		}
		idx, err := v41Routed(m, in)
		if err != nil {
			return Tensor{}, err
		}
		w := moe.V41RouteWeights(s, idx, norm, m.Gate.RouteScale)
		return FromF(KindF32, w, len(w)), nil
	}
}

// V41WeightsUnnormalised is the weights-unnormalised moe_weights.
func V41WeightsUnnormalised(c *V41Context, in map[string]Tensor) (Tensor, error) {
	return v41WeightsRule(false)(c, in)
}

// V41PostTransposed is hc_post of a site with comb transposed.
func V41PostTransposed(side, residual, sub string) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return func(c *V41Context, in map[string]Tensor) (Tensor, error) {
		hc, name := c.Cfg.HCMult, "hc_"+side+"_comb"
		comb, err := inF(in, name, hc*hc)
		if err != nil {
			return Tensor{}, err
		}
		t := maps.Clone(in)
		t[name] = FromF(KindF32, mhc.Transpose(comb, hc), hc, hc)
		return hcPost(c.Cfg, side, residual, sub, t)
	}
}

// V41PostNoSigmoid is hc_<side>_post without the sigmoid.
func V41PostNoSigmoid(side string) func(*V41Context, map[string]Tensor) (Tensor, error) {
	return func(c *V41Context, in map[string]Tensor) (Tensor, error) {
		if c.W == nil || c.W.Block == nil {
			return Tensor{}, fmt.Errorf("no block weights")
		}
		hc := c.Cfg.HCMult
		mixes, err := inF(in, "hc_"+side+"_mixes", mhc.NMixes(hc))
		if err != nil {
			return Tensor{}, err
		}
		s := v41SiteOf(c.W.Block, side)
		post := make([]float32, hc)
		for j := range post {
			post[j] = 2 * (float32(mixes[hc+j]*s.Scale[1]) + s.Base[hc+j])
		}
		return FromF(KindF32, post, hc), nil
	}
}

// V41LogitsNoNorm is logits = head · f32(head_in) (no final norm).
func V41LogitsNoNorm(c *V41Context, in map[string]Tensor) (Tensor, error) {
	hi, ok := in["head_in"]
	if !ok {
		return Tensor{}, fmt.Errorf("missing input head_in")
	}
	return v41Logits(c.Cfg, c.Head, map[string]Tensor{"head_x": hi})
}
