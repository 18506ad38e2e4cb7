package moe

import (
	"fmt"
	"math"

	"sparsemla/attention"
)

// ScoreFunc is ModelArgs.score_func: how the gate turns logits into scores.
type ScoreFunc string

const (
	Softmax      ScoreFunc = "softmax"      // s = softmax(logits) over the experts
	Sigmoid      ScoreFunc = "sigmoid"      // s = sigmoid(logits)
	SqrtSoftplus ScoreFunc = "sqrtsoftplus" // s = sqrt(softplus(logits)) (V4)
)

// ParseScoreFunc returns the ScoreFunc of a config's score_func. The official
// Gate.forward treats every value other than "softmax" and "sigmoid" as
// sqrtsoftplus; here an unknown name is an error.
func ParseScoreFunc(s string) (ScoreFunc, error) {
	switch f := ScoreFunc(s); f {
	case Softmax, Sigmoid, SqrtSoftplus:
		return f, nil
	}
	return "", fmt.Errorf("moe: unknown score_func %q (want softmax, sigmoid or sqrtsoftplus)", s)
}

// Gate is the router of one layer (Gate, R-M:552-594).
type Gate struct {
	Experts    int       // n_routed_experts E
	TopK       int       // n_activated_experts k
	Dim        int       // model width
	Func       ScoreFunc // score_func
	RouteScale float32   // f32(route_scale)
	Weight     []float32 // gate.weight [E][dim], bf16 values (the model widens it to fp32)
	// Bias [E] (fp32) shifts the scores for the selection only; nil on hash
	// layers.
	Bias []float32
	// TID2EID [vocab][k] are the expert ids of each token on the hash layers
	// (layer < n_hash_layers); nil elsewhere.
	TID2EID []int32
	// Packed holds gate.weight instead of Weight (Weight nil) after
	// UsePanels: the prepared path's bf16 panels, read row by row by
	// Scores.
	Packed *attention.Panels
}

// UsePanels makes p (gate.weight [E][dim] packed from Weight) the gate's
// only copy of its weight: Weight is dropped and Scores reads each row from
// p, the same values and sums.
func (g *Gate) UsePanels(p *attention.Panels) {
	if p.Rows != g.Experts || p.Cols != g.Dim {
		panic("moe: Gate.UsePanels: the panels are not this gate's shape")
	}
	g.Weight, g.Packed = nil, p
}

// Hash reports whether the gate routes by token id (tid2eid) instead of top-k.
func (g *Gate) Hash() bool { return g.TID2EID != nil }

// Check panics with a "moe: …" message when the parameter shapes disagree.
func (g *Gate) Check() {
	w := len(g.Weight) == g.Experts*g.Dim || (g.Weight == nil && g.Packed != nil && g.Packed.Rows == g.Experts && g.Packed.Cols == g.Dim)
	if g.Experts <= 0 || g.TopK <= 0 || g.TopK > g.Experts || g.Dim <= 0 || !w {
		panic("moe: Gate shape mismatch")
	}
	if g.Bias != nil && len(g.Bias) != g.Experts {
		panic("moe: Gate bias length mismatch")
	}
	if g.TID2EID != nil && len(g.TID2EID)%g.TopK != 0 {
		panic("moe: Gate tid2eid is not [vocab][k]")
	}
}

// Route is the router's decision for one token.
type Route struct {
	Scores  []float32 // [E] original scores (after the score function, before the bias)
	Select  []float32 // [E] the scores top-k ranked: Scores + Bias (= Scores on hash layers)
	Indices []int32   // [k] expert ids, in the order the official code returns them
	Weights []float32 // [k] routing weights (normalised unless softmax, × route_scale)
	// Tie is true when the k-th and (k+1)-th ranked Select values are equal,
	// so the selected SET depends on the tie rule (never on hash layers).
	Tie bool
}

// Scores is the first half of Gate.forward (R-M:575-581) for one token:
//
//	l[e] = Σ_i f32(x[i]) · f32(W_g[e][i])      fp32 GEMV, i ascending
//	s[e] = softmax(l)[e] | sigmoid(l[e]) | sqrt(softplus(l[e]))
//
// x [dim] holds bf16 values (the ffn_norm output); s has E elements.
func (g *Gate) Scores(s, x []float32) {
	g.Check()
	if len(x) != g.Dim || len(s) != g.Experts {
		panic("moe: Gate.Scores shape mismatch")
	}
	if g.Packed != nil {
		// F32Linear row by row, each row widened from the panels
		row := make([]float32, g.Dim)
		for e := range s {
			g.Packed.Row(row, e)
			attention.F32Linear(s[e:e+1], x, row, 1, g.Dim)
		}
	} else {
		attention.F32Linear(s, x, g.Weight, g.Experts, g.Dim)
	}
	ApplyScoreFunc(s, g.Func)
}

// ApplyScoreFunc applies a score function to the gate logits l in place, as
// torch evaluates it on fp32:
//
//	softmax:      m = max_e l_e;  p_e = exp(l_e - m);  s_e = p_e / Σ_e p_e   (sum e ascending)
//	sigmoid:      s_e = 1 / (1 + exp(-l_e))
//	sqrtsoftplus: s_e = sqrt(softplus(l_e)), softplus(v) = v if v > 20 else log1p(exp(v))
//
// each op one fp32 rounding (exp, log1p and sqrt correctly rounded).
func ApplyScoreFunc(l []float32, f ScoreFunc) {
	switch f {
	case Softmax:
		m := float32(math.Inf(-1))
		for _, v := range l {
			m = max(m, v)
		}
		var sum float32
		for e, v := range l {
			l[e] = exp32(v - m)
			sum += l[e]
		}
		for e := range l {
			l[e] /= sum
		}
	case Sigmoid:
		for e, v := range l {
			l[e] = 1 / (1 + exp32(-v))
		}
	case SqrtSoftplus:
		for e, v := range l {
			l[e] = sqrt32(Softplus(v))
		}
	default:
		panic("moe: unknown score function " + string(f))
	}
}

// Softplus is torch's F.softplus(v) (beta 1, threshold 20) on fp32:
// v when v > 20, else log1p(exp(v)) with exp rounded to fp32 first.
func Softplus(v float32) float32 {
	if v > 20 {
		return v
	}
	return float32(math.Log1p(float64(exp32(v))))
}

// Route is Gate.forward (R-M:574-594) for one token with id tok:
//
//	s       = Scores(x)                             original scores
//	sel     = s + bias                              (bias nil: sel = s)
//	indices = tid2eid[tok]  (hash layer)  |  TopK(sel, k)
//	w_t     = s[indices_t]
//	w_t     = w_t / Σ_t w_t                         unless softmax; sum t ascending
//	w_t     = w_t · route_scale
//
// It returns an error when a hash layer's token id is outside tid2eid or an
// expert id there is outside [0, E) (outside input: tokens and tables come
// from dumps and checkpoints).
func (g *Gate) Route(x []float32, tok int64) (Route, error) {
	s := make([]float32, g.Experts)
	g.Scores(s, x)
	return g.RouteScores(s, tok)
}

// RouteScores is Route from the scores s [E] = Scores(x) computed elsewhere
// (the prepared path's GEMV, the same bits): the selection, the hash lookup
// and the weights. s becomes Route.Scores.
func (g *Gate) RouteScores(s []float32, tok int64) (Route, error) {
	if len(s) != g.Experts {
		panic("moe: Gate.RouteScores shape mismatch")
	}
	r := Route{Scores: s}
	if g.Hash() {
		vocab := int64(len(g.TID2EID) / g.TopK)
		if tok < 0 || tok >= vocab {
			return r, fmt.Errorf("moe: token id %d outside tid2eid [%d][%d]", tok, vocab, g.TopK)
		}
		r.Select = r.Scores
		r.Indices = append([]int32(nil), g.TID2EID[tok*int64(g.TopK):(tok+1)*int64(g.TopK)]...)
		for t, e := range r.Indices {
			if e < 0 || int(e) >= g.Experts {
				return r, fmt.Errorf("moe: tid2eid[%d][%d] = %d outside [0, %d)", tok, t, e, g.Experts)
			}
		}
	} else {
		r.Select = r.Scores
		if g.Bias != nil {
			r.Select = make([]float32, g.Experts)
			for e, v := range r.Scores {
				r.Select[e] = v + g.Bias[e]
			}
		}
		r.Indices, r.Tie = TopK(r.Select, g.TopK)
	}
	r.Weights = RouteWeights(r.Scores, r.Indices, g.Func, g.RouteScale)
	return r, nil
}

// RouteWeights is the weight rule of Gate.forward (R-M:589-593): the
// original scores of the chosen experts, divided by their sum unless the
// score function is softmax (sum in slot order, fp32), times route_scale.
// An index outside scores panics (Route validates them).
func RouteWeights(scores []float32, indices []int32, f ScoreFunc, routeScale float32) []float32 {
	w := make([]float32, len(indices))
	for t, e := range indices {
		w[t] = scores[e]
	}
	if f != Softmax {
		var sum float32
		for _, v := range w {
			sum += v
		}
		for t := range w {
			w[t] /= sum
		}
	}
	for t := range w {
		w[t] *= routeScale
	}
	return w
}

// TopK returns the indices of the k largest values of s in descending value
// order (torch.topk, largest, sorted). Among equal values the lower index
// comes first: CUDA's torch.topk does not specify an order among ties, so a
// tie among the selected changes only the order, and a tie at the k-th place
// (reported as tie) can change the selected set. NaN ranks above every
// number, as in torch.topk.
func TopK(s []float32, k int) (idx []int32, tie bool) {
	if k <= 0 || k > len(s) {
		panic("moe: TopK k outside [1, len(s)]")
	}
	chosen := make([]bool, len(s))
	idx = make([]int32, 0, k)
	for len(idx) < k {
		best := -1
		for e, v := range s {
			if !chosen[e] && (best < 0 || above(v, s[best])) {
				best = e
			}
		}
		chosen[best] = true
		idx = append(idx, int32(best))
	}
	last := s[idx[k-1]]
	for e, v := range s {
		if !chosen[e] && !above(last, v) {
			tie = true
		}
	}
	return idx, tie
}

// above reports whether a ranks strictly above b in torch.topk's order
// (NaN above everything).
func above(a, b float32) bool {
	if a != a {
		return b == b
	}
	return a > b
}

func exp32(x float32) float32  { return float32(math.Exp(float64(x))) }
func sqrt32(x float32) float32 { return float32(math.Sqrt(float64(x))) }
