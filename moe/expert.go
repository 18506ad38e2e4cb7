package moe

import (
	"math"

	"sparsemla/attention"
	"sparsemla/quant"
)

// Expert is one routed expert (Expert with dtype float4_e2m1fn_x2,
// R-M:597-616): w1, w3 [inter][dim] and w2 [dim][inter] in FP4.
type Expert struct {
	W1, W2, W3 *FP4Weight
}

// Shared is the shared expert (MoE.shared_experts, R-M:637-638): the same
// SwiGLU with FP8 weights (the model's default dtype), no swiglu_limit and no
// routing weight.
type Shared struct {
	W1, W2, W3 *attention.FP8Weight
}

// Forward is Expert.forward for one token: x [dim] (bf16 values), the routing
// weight w of this expert's slot, limit = swiglu_limit (0: no clamp); out
// [dim] receives bf16 values.
//
//	g = f32(FP4Linear(w1, x)),  u = f32(FP4Linear(w3, x))
//	h = SwiGLU(g, u, limit, w)
//	out = FP4Linear(w2, h)
func (e *Expert) Forward(out, x []float32, w, limit float32) {
	e.forward(out, x, w, limit, FP4Linear)
}

// ForwardFast is Forward with FP4LinearFast: the same bits.
func (e *Expert) ForwardFast(out, x []float32, w, limit float32) {
	e.forward(out, x, w, limit, FP4LinearFast)
}

func (e *Expert) forward(out, x []float32, w, limit float32, linear func(y, x []float32, w *FP4Weight)) {
	g := make([]float32, e.W1.Rows)
	u := make([]float32, e.W3.Rows)
	linear(g, x, e.W1)
	linear(u, x, e.W3)
	h := make([]float32, len(g))
	SwiGLU(h, g, u, limit, w, true)
	linear(out, h, e.W2)
}

// Forward is the shared expert's Expert.forward: FP8 linears, no clamp, no
// weight (R-M:637 "no swiglu_limit"):
//
//	h = bf16( silu(f32(w1(x))) · f32(w3(x)) ),  out = w2(h)
func (s *Shared) Forward(out, x []float32) {
	g := make([]float32, s.W1.Rows)
	u := make([]float32, s.W3.Rows)
	attention.FP8Linear(g, x, s.W1)
	attention.FP8Linear(u, x, s.W3)
	h := make([]float32, len(g))
	SwiGLU(h, g, u, 0, 0, false)
	attention.FP8Linear(out, h, s.W2)
}

// SwiGLU is the middle of Expert.forward (R-M:606-615), fp32 op by op, on the
// bf16 outputs g (w1) and u (w3):
//
//	u   = clamp(u, -limit, limit); g = min(g, limit)      only when limit > 0
//	v   = f32(silu(g) · u),  silu(g) = g / (1 + exp(-g))
//	v   = f32(w · v)                                      only when weighted
//	h   = bf16(v)                                         (x.to(dtype) before w2)
//
// NaN passes through the clamps (torch.clamp propagates NaN).
func SwiGLU(h, g, u []float32, limit, w float32, weighted bool) {
	if len(g) != len(u) || len(h) != len(g) {
		panic("moe: SwiGLU length mismatch")
	}
	for i := range h {
		gi, ui := g[i], u[i]
		if limit > 0 {
			ui = clampNaN(ui, -limit, limit)
			gi = clampNaN(gi, float32(math.Inf(-1)), limit)
		}
		v := float32(Silu(gi) * ui)
		if weighted {
			v = float32(w * v)
		}
		h[i] = quant.BF16Round(v)
	}
}

// Silu is torch's F.silu on fp32: v / (1 + exp(-v)), each op one rounding.
func Silu(v float32) float32 { return v / (1 + exp32(-v)) }

// clampNaN is torch.clamp(v, lo, hi) on fp32: NaN stays NaN.
func clampNaN(v, lo, hi float32) float32 {
	if v != v {
		return v
	}
	return min(max(v, lo), hi)
}
