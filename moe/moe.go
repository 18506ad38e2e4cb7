package moe

import (
	"fmt"

	"sparsemla/quant"
)

// MoE is the FFN of one layer (MoE, R-M:619-687).
type MoE struct {
	Gate Gate
	// Experts [E] are the routed experts held in memory. An entry may be nil:
	// Source then supplies it when a token is routed to it (a checkpoint read
	// lazily; without a Source a nil expert is an error).
	Experts []*Expert
	Source  ExpertSource
	Shared  *Shared
	// SwigluLimit is f32(swiglu_limit), applied to the routed experts only
	// (0: no clamp).
	SwigluLimit float32
	// Fast runs the routed experts on FP4LinearFast and the shared expert on
	// its FP8 panels when it has them (Shared.ForwardFast): the same bits as
	// the reference loops, several times faster.
	Fast bool
}

// ExpertSource supplies routed experts on demand (MoE.Source). It must be
// safe for concurrent use: replays compute several layers and steps at once.
type ExpertSource interface {
	Expert(e int) (*Expert, error)
}

// expert returns routed expert e from Experts or the Source.
func (m *MoE) expert(e int) (*Expert, error) {
	if e < len(m.Experts) && m.Experts[e] != nil {
		return m.Experts[e], nil
	}
	if m.Source != nil {
		return m.Source.Expert(e)
	}
	return nil, fmt.Errorf("moe: routed expert %d has no weights", e)
}

// Result is one token's MoE: the route and the output.
type Result struct {
	Route
	Out []float32 // [dim] bf16 ffn_out
}

// Forward is MoE.forward for one token: x [dim] is the ffn_norm output (bf16
// values), tok the token id (hash routing).
//
//	route = Gate.Route(x, tok)
//	Out   = Combine(x, route.Indices, route.Weights)
func (m *MoE) Forward(x []float32, tok int64) (Result, error) {
	r, err := m.Gate.Route(x, tok)
	if err != nil {
		return Result{Route: r}, err
	}
	out, err := m.Combine(x, r.Indices, r.Weights)
	return Result{Route: r, Out: out}, err
}

// expertSlots checks a routing (indices and weights [k], every index in
// [0, experts)) and returns, for each expert id e, the slot t whose
// indices[t] = e, or −1 when e is not routed to. An expert id filling two
// slots keeps the later slot (see Combine).
func expertSlots(indices []int32, weights []float32, experts int) ([]int, error) {
	if len(indices) != len(weights) {
		return nil, fmt.Errorf("moe: %d routing indices but %d weights", len(indices), len(weights))
	}
	return routeSlots(indices, experts)
}

// routeSlots is expertSlots without weights.
func routeSlots(indices []int32, experts int) ([]int, error) {
	for t, id := range indices {
		if id < 0 || int(id) >= experts {
			return nil, fmt.Errorf("moe: routing index %d (slot %d) outside [0, %d)", id, t, experts)
		}
	}
	slots := make([]int, experts)
	for e := range slots {
		slots[e] = -1
	}
	for t, id := range indices {
		slots[id] = t
	}
	return slots, nil
}

// Combine is the expert half of MoE.forward (R-M:672-687) for given routing
// indices and weights [k]:
//
//	y = 0 (fp32)
//	for e = 0 .. E-1 ascending, for each slot t with indices[t] = e:  y += Expert_e(x, weights[t])
//	y += Shared(x)
//	out = bf16(y)
//
// The experts are visited in expert-id order, not slot order (the official
// loop `for i in range(E)`). If one expert id fills two slots, the official
// `y[idx] += …` indexes the same row twice and only one of the two
// contributions survives (which one is unspecified on CUDA); the reference
// keeps the later slot's. An index outside [0, E) or a routed expert without
// weights (neither in Experts nor from Source) is an error.
func (m *MoE) Combine(x []float32, indices []int32, weights []float32) ([]float32, error) {
	slots, err := expertSlots(indices, weights, m.Gate.Experts)
	if err != nil {
		return nil, err
	}
	var shared func(out []float32)
	if m.Shared != nil {
		shared = func(out []float32) {
			if m.Fast {
				m.Shared.ForwardFast(out, x)
			} else {
				m.Shared.Forward(out, x)
			}
		}
	}
	return combineSum(len(x), slots, func(out []float32, e, slot int) error {
		ex, err := m.expert(e)
		if err != nil {
			return err
		}
		if m.Fast {
			ex.ForwardFast(out, x, weights[slot], m.SwigluLimit)
		} else {
			ex.Forward(out, x, weights[slot], m.SwigluLimit)
		}
		return nil
	}, shared)
}

// CombineOutputs is Combine's sum from the experts' outputs computed
// already: expert [k][dim] holds the routed experts' outputs in slot order
// (slot t is expert indices[t]), shared [dim] the shared expert's. Experts
// are added in expert-id order, an expert id filling two slots keeping the
// later slot, the shared expert last, then one bf16 rounding — Combine's
// order exactly. An index outside [0, experts) is an error.
func CombineOutputs(indices []int32, expert, shared []float32, experts int) ([]float32, error) {
	dim := len(shared)
	if len(expert) != len(indices)*dim {
		return nil, fmt.Errorf("moe: %d expert outputs for %d slots of %d", len(expert), len(indices), dim)
	}
	slots, err := routeSlots(indices, experts)
	if err != nil {
		return nil, err
	}
	return combineSum(dim, slots, func(out []float32, _, slot int) error {
		copy(out, expert[slot*dim:(slot+1)*dim])
		return nil
	}, func(out []float32) { copy(out, shared) })
}

// combineSum is the arithmetic of every Combine (V4's, CombineWith's,
// V4.1's) for the expert slots of expertSlots:
//
//	y = 0 (fp32)
//	for e ascending with slots[e] ≥ 0:  y += routed(e, slots[e])
//	y += shared()          (when shared is not nil)
//	out = bf16(y)
//
// routed and shared write their expert's output [dim] into out; routed's
// error (an expert without weights) ends the sum.
func combineSum(dim int, slots []int, routed func(out []float32, e, slot int) error, shared func(out []float32)) ([]float32, error) {
	y := make([]float32, dim)
	out := make([]float32, dim)
	for e, slot := range slots {
		if slot < 0 {
			continue
		}
		if err := routed(out, e, slot); err != nil {
			return nil, err
		}
		for i, v := range out {
			y[i] += v
		}
	}
	if shared != nil {
		shared(out)
		for i, v := range out {
			y[i] += v
		}
	}
	for i, v := range y {
		out[i] = quant.BF16Round(v)
	}
	return out, nil
}
