package moe

import (
	"fmt"
	"math/rand/v2"

	"sparsemla/attention"
)

// The DeepSeek-V4.1 MoE (Gate, Expert, MoE of V41-M = the official
// inference/model.py at revision dba1be0a, docs/v41.md). One token, x [dim]
// the ffn_norm output (bf16 values):
//
//	l      = W_g · f32(x)                               [E] fp32 GEMV (linear(x.float(), weight.float()))
//	l      = l / gate_temp                              fp32 (CUDA: l · f32(1/f32(gate_temp)), see V41Gate.Scores)
//	s      = softmax(l) | sigmoid(l) | sqrt(softplus(l))           score_func
//	idx    = topk(s + bias, k)                          [k] (always a bias; no hash layers in V4.1)
//	w      = s[idx];  w = w / (Σ_t w_t + 1e-20)          only when norm_topk_prob and k > 1 — for softmax too
//	w      = w · route_scale                            [k] fp32
//	y      = bf16( Σ_{e in idx, ascending e} Expert_e(x, w_e) + Shared(x) )    fp32 sum
//
// Every expert is Expert.forward with swiglu_limit — the shared expert TOO
// (V4's shared expert has no clamp):
//
//	g = f32(w1(x)), u = f32(w3(x))                      bf16 GEMM outputs widened
//	u = clamp(u, ±limit); g = min(g, limit)             limit > 0
//	h = bf16([w ·] silu(g) · u);  out = w2(h)           bf16
//
// The routed experts' weights are FP4 E2M1 with a UE8M0 scale per 32
// columns; their input is quantised to FP8 per 32 columns (V4: per 128) —
// `linear()` calls act_quant(x, fp8_block_size = 32) for FP4 and FP8
// weights alike. The shared expert is FP8 with 32×32 weight blocks
// (attention.V41FP8Linear). The gate's bias_vl (vision models, image-span
// tokens) is not modelled: V41MoE.Forward refuses image tokens.

// NewV41FP4Weight wraps checkpoint bytes as NewFP4Weight does, with V4.1's
// constraint: Cols a multiple of 32 (the activation block and the weight
// scale block are both 32; V4 needs 128).
func NewV41FP4Weight(packed, scale []uint8, rows, cols int) (*FP4Weight, error) {
	if rows <= 0 || cols <= 0 || cols%FP4Block != 0 {
		return nil, fmt.Errorf("moe: V4.1 FP4 weight [%d, %d]: columns must be a positive multiple of %d", rows, cols, FP4Block)
	}
	if len(packed) != rows*cols/2 || len(scale) != rows*cols/FP4Block {
		return nil, fmt.Errorf("moe: V4.1 FP4 weight [%d, %d]: %d code bytes and %d scale bytes, want %d and %d",
			rows, cols, len(packed), len(scale), rows*cols/2, rows*cols/FP4Block)
	}
	return &FP4Weight{Rows: rows, Cols: cols, Packed: packed, Scale: scale}, nil
}

// V41FP4Linear is V4.1's `linear()` with an FP4 weight (act_quant(x, 32,
// ue8m0) + fp4_gemm with act_block_size = 32): x [Cols] (bf16 values) is
// quantised per 32 columns (quant.QuantizeActFP8, B = 32: qx = E4M3(x/s_a),
// s_a a power of two), then
//
//	y[n] = bf16( Σ_b f32( f32( Σ_{k∈b} qx[k]·E2M1(code[n][k]) ) · s_a[b] · s_w[n][b] ) )
//
// over the 32-column blocks b, the inner sum in fp32 k ascending, the scaled
// block sums in a second fp32 accumulator b ascending (FP4Linear's form with
// V4.1's activation block). [U] the V4.1 fp4_gemm kernel's accumulation
// order was not read. y has Rows elements.
func V41FP4Linear(y, x []float32, w *FP4Weight) {
	fp4LinearAct(y, x, w, FP4Block, "V41FP4Linear")
}

// V41Gate is the V4.1 router of one layer (Gate of V41-M).
type V41Gate struct {
	Experts    int       // n_routed_experts E
	TopK       int       // n_activated_experts k
	Dim        int       // model width
	Func       ScoreFunc // score_func
	Temp       float32   // f32(gate_temp)
	NormTopK   bool      // norm_topk_prob
	RouteScale float32   // f32(route_scale)
	Weight     []float32 // gate.weight [E][dim], bf16 values (widened to fp32)
	Bias       []float32 // gate.bias [E] fp32, for the selection only
}

// Check returns an error when the parameter shapes disagree.
func (g *V41Gate) Check() error {
	if g.Experts <= 0 || g.TopK <= 0 || g.TopK > g.Experts || g.Dim <= 0 || len(g.Weight) != g.Experts*g.Dim {
		return fmt.Errorf("moe: V4.1 gate: %d experts top-%d over dim %d with %d weight values", g.Experts, g.TopK, g.Dim, len(g.Weight))
	}
	if len(g.Bias) != g.Experts {
		return fmt.Errorf("moe: V4.1 gate: bias has %d values, want %d", len(g.Bias), g.Experts)
	}
	if !(g.Temp > 0) {
		return fmt.Errorf("moe: V4.1 gate: gate_temp %g is not positive", g.Temp)
	}
	return nil
}

// Scores is the first half of the V4.1 Gate.forward for one token:
//
//	l[e] = Σ_i f32(x[i]) · W_g[e][i]        fp32, i ascending (attention.F32Linear)
//	l[e] = l[e] · f32(1 / temp)             the `/ self.gate_temp`
//	s    = score_func(l)                     ApplyScoreFunc
//
// `scores / gate_temp` divides a CUDA fp32 tensor by a Python scalar, which
// torch's div kernel evaluates as a multiplication by the fp32 reciprocal
// of the scalar; for gate_temp = 1 (and every power of two) both forms are
// the same bits. [I] testdata/v41-tiny-whole (gate_temp 0.7) does not
// separate the two forms (docs/v41.md).
func (g *V41Gate) Scores(s, x []float32) {
	if len(x) != g.Dim || len(s) != g.Experts {
		panic("moe: V41Gate.Scores shape mismatch")
	}
	attention.F32Linear(s, x, g.Weight, g.Experts, g.Dim)
	if g.Temp != 1 {
		inv := 1 / g.Temp
		for e := range s {
			s[e] *= inv
		}
	}
	ApplyScoreFunc(s, g.Func)
}

// Route is the V4.1 Gate.forward for one text token:
//
//	s       = Scores(x)
//	indices = TopK(s + bias, k)                  (torch.topk: descending; lower id first among ties here)
//	w_t     = s[indices_t]
//	w_t     = w_t / (Σ_t w_t + 1e-20)            when norm_topk_prob and k > 1 (sum t ascending, fp32)
//	w_t     = w_t · route_scale
func (g *V41Gate) Route(x []float32) (Route, error) {
	if err := g.Check(); err != nil {
		return Route{}, err
	}
	s := make([]float32, g.Experts)
	g.Scores(s, x)
	return g.RouteScores(s), nil
}

// RouteScores is Route from scores s [E] = Scores(x).
func (g *V41Gate) RouteScores(s []float32) Route {
	r := Route{Scores: s, Select: make([]float32, g.Experts)}
	for e, v := range s {
		r.Select[e] = v + g.Bias[e]
	}
	r.Indices, r.Tie = TopK(r.Select, g.TopK)
	r.Weights = V41RouteWeights(s, r.Indices, g.NormTopK, g.RouteScale)
	return r
}

// V41RouteWeights is the V4.1 weight rule: the chosen experts' original
// scores, divided by (their fp32 sum + 1e-20) when norm and k > 1 — for
// every score_func, softmax included (V4 skips softmax) — times
// route_scale. An index outside scores panics.
func V41RouteWeights(scores []float32, indices []int32, norm bool, routeScale float32) []float32 {
	w := make([]float32, len(indices))
	for t, e := range indices {
		w[t] = scores[e]
	}
	if norm && len(w) > 1 {
		var sum float32
		for _, v := range w {
			sum += v
		}
		sum += 1e-20
		for t := range w {
			w[t] /= sum
		}
	}
	for t := range w {
		w[t] *= routeScale
	}
	return w
}

// V41Expert is one routed V4.1 expert: w1, w3 [inter][dim] and w2
// [dim][inter], FP4 with UE8M0 scales per 32.
type V41Expert struct {
	W1, W2, W3 *FP4Weight
}

// Forward is Expert.forward for one token with routing weight w and
// limit = swiglu_limit: g = V41FP4Linear(w1, x), u = V41FP4Linear(w3, x),
// h = SwiGLU(g, u, limit, w), out = V41FP4Linear(w2, h) [dim] bf16.
func (e *V41Expert) Forward(out, x []float32, w, limit float32) {
	g, u := make([]float32, e.W1.Rows), make([]float32, e.W3.Rows)
	V41FP4Linear(g, x, e.W1)
	V41FP4Linear(u, x, e.W3)
	h := make([]float32, len(g))
	SwiGLU(h, g, u, limit, w, true)
	V41FP4Linear(out, h, e.W2)
}

// Map returns the expert with f applied to each weight.
func (e *V41Expert) Map(f func(*FP4Weight) *FP4Weight) *V41Expert {
	return &V41Expert{W1: f(e.W1), W2: f(e.W2), W3: f(e.W3)}
}

// V41Shared is the V4.1 shared expert (MoE.shared_experts): FP8 weights with
// 32×32 blocks, Expert.forward WITH swiglu_limit and without a weight.
type V41Shared struct {
	W1, W2, W3 *attention.V41FP8Weight
}

// Forward is the shared expert for one token: g = V41FP8Linear(w1, x),
// u = V41FP8Linear(w3, x), h = SwiGLU(g, u, limit, unweighted), out =
// V41FP8Linear(w2, h).
func (s *V41Shared) Forward(out, x []float32, limit float32) {
	g, u := make([]float32, s.W1.Rows), make([]float32, s.W3.Rows)
	attention.V41FP8Linear(g, x, s.W1)
	attention.V41FP8Linear(u, x, s.W3)
	h := make([]float32, len(g))
	SwiGLU(h, g, u, limit, 0, false)
	attention.V41FP8Linear(out, h, s.W2)
}

// GateUpSwapped is the shared expert with w1 and w3 exchanged.
func (s *V41Shared) GateUpSwapped() *V41Shared { return &V41Shared{W1: s.W3, W2: s.W2, W3: s.W1} }

// V41MoE is the FFN of one V4.1 layer (MoE of V41-M).
type V41MoE struct {
	Gate    V41Gate
	Experts []*V41Expert // [E]
	Shared  *V41Shared
	// SwigluLimit is f32(swiglu_limit), applied to the routed AND the shared
	// experts (0: no clamp).
	SwigluLimit float32
	// SharedLimit is the limit the shared expert uses: SwigluLimit unless a
	// variant says otherwise (NoSharedClamp).
	SharedLimit float32
}

// Forward is MoE.forward for one token: x [dim] the ffn_norm output (bf16
// values); image is whether the token lies in an image span, which V4.1
// routes with gate.bias_vl — not modelled, so an image token is an error.
func (m *V41MoE) Forward(x []float32, image bool) (Result, error) {
	if image {
		return Result{}, fmt.Errorf("moe: V4.1 image-span tokens route with gate.bias_vl, which the reference does not model")
	}
	r, err := m.Gate.Route(x)
	if err != nil {
		return Result{Route: r}, err
	}
	out, err := m.Combine(x, r.Indices, r.Weights)
	return Result{Route: r, Out: out}, err
}

// Combine is the expert half of the V4.1 MoE.forward for given indices and
// weights [k]:
//
//	y = 0 (fp32)
//	for e = 0 .. E-1 ascending, for the slot t with indices[t] = e:  y += Expert_e(x, weights[t])
//	y += Shared(x)
//	out = bf16(y)
//
// (V4's Combine with V4.1's experts; one expert filling two slots keeps the
// later slot's contribution, as Combine does.) An index outside [0, E) or a
// routed expert without weights is an error.
func (m *V41MoE) Combine(x []float32, indices []int32, weights []float32) ([]float32, error) {
	slots, err := expertSlots(indices, weights, m.Gate.Experts)
	if err != nil {
		return nil, err
	}
	var shared func(out []float32)
	if m.Shared != nil {
		shared = func(out []float32) { m.Shared.Forward(out, x, m.SharedLimit) }
	}
	return combineSum(len(x), slots, func(out []float32, e, slot int) error {
		if e >= len(m.Experts) || m.Experts[e] == nil {
			return fmt.Errorf("moe: routed expert %d has no weights", e)
		}
		m.Experts[e].Forward(out, x, weights[slot], m.SwigluLimit)
		return nil
	}, shared)
}

// WithRouted returns a copy of m whose routed experts ids are replaced by f
// of them (the others as they are); m is not changed.
func (m *V41MoE) WithRouted(ids []int32, f func(*V41Expert) *V41Expert) (*V41MoE, error) {
	c := *m
	c.Experts = append([]*V41Expert(nil), m.Experts...)
	for _, e := range ids {
		if e < 0 || int(e) >= len(m.Experts) || m.Experts[e] == nil {
			return nil, fmt.Errorf("moe: routing index %d has no routed expert", e)
		}
		c.Experts[e] = f(m.Experts[e])
	}
	return &c, nil
}

// ClampActs reports whether the swiglu_limit clamp changes any routed
// expert's gate or up among ids for x (it acts: some g > limit or |u| >
// limit), with the largest gate and |up| seen.
func (m *V41MoE) ClampActs(x []float32, ids []int32) (acts bool, gmax, umax float32) {
	lim := m.SwigluLimit
	for _, e := range ids {
		if e < 0 || int(e) >= len(m.Experts) || m.Experts[e] == nil {
			continue
		}
		w := m.Experts[e]
		g, u := make([]float32, w.W1.Rows), make([]float32, w.W3.Rows)
		V41FP4Linear(g, x, w.W1)
		V41FP4Linear(u, x, w.W3)
		for i := range g {
			au := max(u[i], -u[i])
			if lim > 0 && (g[i] > lim || au > lim) {
				acts = true
			}
			gmax, umax = max(gmax, g[i]), max(umax, au)
		}
	}
	return acts, gmax, umax
}

// RandomV41FP4Weight draws a [rows][cols] FP4 weight: random E2M1 codes and
// UE8M0 scales 2^(e−127) with e ∈ [120, 124] (magnitudes ~ 0.008 … 0.4 per
// unit code), from r. For tests and synthetic models, not a checkpoint's
// distribution.
func RandomV41FP4Weight(r *rand.Rand, rows, cols int) *FP4Weight {
	p := make([]uint8, rows*cols/2)
	for i := range p {
		p[i] = uint8(r.UintN(256))
	}
	s := make([]uint8, rows*cols/FP4Block)
	for i := range s {
		s[i] = uint8(120 + r.UintN(5))
	}
	return &FP4Weight{Rows: rows, Cols: cols, Packed: p, Scale: s}
}
