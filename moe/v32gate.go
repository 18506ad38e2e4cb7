package moe

import (
	"fmt"
	"math"
)

// GroupedRoute is the V3 / V3.2 Gate.forward (deepseek-ai/DeepSeek-V3.2-Exp
// inference/model.py at 8631a81, V32-M:687-709) for one token, from the
// scores s [E] = Scores(x) (the gate's ScoreFunc applied to the fp32 GEMV):
//
//	sel      = s + bias                               (bias nil: sel = s; fp32)
//	n_groups > 1:  sel viewed [G][E/G]
//	    group_g  = max_j sel[g,j]                      bias nil
//	             = sel[g,(1)] + sel[g,(2)]             with bias: the group's top-2 sum, fp32
//	    keep     = TopK(group, topk_groups)            every expert of another group → −∞
//	indices  = TopK(sel, k)
//	w_t      = s[indices_t] / Σ_t s[indices_t]        unless softmax (sum t ascending)
//	w_t      = w_t · f32(route_scale)
//
// The bias selects and never weights: the weights come from the unbiased
// scores. nGroups = n_expert_groups, topkGroups = n_limited_groups; the
// gate's TID2EID must be nil (V3 has no hash layers). Ties among groups
// take the lower group (TopK); Route.Tie reports a tie at the k-th expert.
func (g *Gate) GroupedRoute(s []float32, nGroups, topkGroups int) (Route, error) {
	if len(s) != g.Experts {
		panic("moe: Gate.GroupedRoute shape mismatch")
	}
	if g.Hash() {
		return Route{}, fmt.Errorf("moe: grouped routing has no hash layers (tid2eid set)")
	}
	if nGroups < 1 || g.Experts%nGroups != 0 || topkGroups < 1 || topkGroups > nGroups {
		return Route{}, fmt.Errorf("moe: grouped routing: %d experts in %d groups, top %d groups", g.Experts, nGroups, topkGroups)
	}
	if per := g.Experts / nGroups; nGroups > 1 && g.Bias != nil && per < 2 {
		return Route{}, fmt.Errorf("moe: grouped routing with bias needs ≥ 2 experts per group (top-2 sum), have %d", per)
	}
	if topkGroups*(g.Experts/nGroups) < g.TopK {
		return Route{}, fmt.Errorf("moe: grouped routing: top %d groups of %d experts hold fewer than %d experts", topkGroups, g.Experts/nGroups, g.TopK)
	}
	r := Route{Scores: s, Select: append([]float32(nil), s...)}
	if g.Bias != nil {
		for e := range r.Select {
			r.Select[e] = s[e] + g.Bias[e]
		}
	}
	if nGroups > 1 {
		GroupMask(r.Select, nGroups, topkGroups, g.Bias != nil)
	}
	r.Indices, r.Tie = TopK(r.Select, g.TopK)
	r.Weights = RouteWeights(r.Scores, r.Indices, g.Func, g.RouteScale)
	return r, nil
}

// GroupMask is the group limit of the V3 gate (V32-M:695-703) in place on
// sel [G·n]: each group's score is its maximum (top2 false: no bias) or the
// fp32 sum of its two largest values (top2 true: a bias is present, as
// scores.topk(2)[0].sum()), the topkGroups best groups are kept (TopK: lower
// group first among equal scores) and every value of the others becomes −∞.
func GroupMask(sel []float32, nGroups, topkGroups int, top2 bool) {
	n := len(sel) / nGroups
	group := make([]float32, nGroups)
	for gi := range group {
		top, _ := TopK(sel[gi*n:(gi+1)*n], min(2, n))
		group[gi] = sel[gi*n+int(top[0])]
		if top2 {
			group[gi] += sel[gi*n+int(top[1])]
		}
	}
	keep, _ := TopK(group, topkGroups)
	kept := make([]bool, nGroups)
	for _, gi := range keep {
		kept[gi] = true
	}
	for gi, k := range kept {
		if !k {
			for j := gi * n; j < (gi+1)*n; j++ {
				sel[j] = float32(math.Inf(-1))
			}
		}
	}
}

// V32Select is the selection score of the V3 gate before its group limit:
// sel = s + bias (fp32), or a copy of s when the gate has no bias.
func V32Select(g *Gate, s []float32) []float32 {
	sel := append([]float32(nil), s...)
	if g.Bias != nil {
		for e := range sel {
			sel[e] += g.Bias[e]
		}
	}
	return sel
}

// V32RouteNoBias is GroupedRoute's choice with the bias left out of the
// selection but the biased gate's group score kept (the top-2 sum, as the
// code path of a gate with a bias computes it): sel = s, GroupMask(sel,
// nGroups, topkGroups, top2 = true) when nGroups > 1, TopK(sel, k). What a
// GPU router that forgets to add e_score_correction_bias chooses.
func V32RouteNoBias(g *Gate, s []float32, nGroups, topkGroups int) []int32 {
	sel := append([]float32(nil), s...)
	if nGroups > 1 {
		GroupMask(sel, nGroups, topkGroups, true)
	}
	top, _ := TopK(sel, g.TopK)
	return top
}

// V32RouteGroupMax is GroupedRoute's choice with each group scored by its
// maximum although the gate has a bias (the bias-free rule, V2's
// group_limited_greedy) instead of the top-2 sum of score + bias.
func V32RouteGroupMax(g *Gate, s []float32, nGroups, topkGroups int) []int32 {
	sel := V32Select(g, s)
	if nGroups > 1 {
		GroupMask(sel, nGroups, topkGroups, false)
	}
	top, _ := TopK(sel, g.TopK)
	return top
}
