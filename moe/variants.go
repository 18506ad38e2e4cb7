package moe

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/quant"
)

// Decode variants: the weights a GPU kernel with a known decode bug
// effectively multiplies, as weights of the reference's own form, so that
// the reference loops (FP4Linear, attention.FP8Linear) compute exactly what
// the buggy kernel computes. Fault injection and the diagnoses' hypotheses
// share them. None changes its receiver.

// NibbleSwapped is w read with the two E2M1 codes of every byte exchanged:
// the even column taken from the HIGH nibble (float4_e2m1fn_x2 keeps it in
// the low one).
func (w *FP4Weight) NibbleSwapped() *FP4Weight {
	p := make([]uint8, len(w.Packed))
	for i, c := range w.Packed {
		p[i] = c<<4 | c>>4
	}
	return &FP4Weight{Rows: w.Rows, Cols: w.Cols, Packed: p, Scale: w.Scale}
}

// ScalePer128 is w read with its UE8M0 scales indexed per 128 columns (the
// FP8 weight block) instead of per FP4Block = 32: column k of row n is
// scaled by Scale[n][k/128] — the first quarter of the row's scale bytes,
// each applied to four 32-blocks:
//
//	W'[n][k] = E2M1(code[n][k]) · 2^(Scale[n][k/128] - 127)
//
// (a kernel reusing the FP8 scale indexing on the per-32 FP4 scale tensor).
func (w *FP4Weight) ScalePer128() *FP4Weight {
	nb := w.Cols / FP4Block
	s := make([]uint8, len(w.Scale))
	for n := 0; n < w.Rows; n++ {
		for b := 0; b < nb; b++ {
			s[n*nb+b] = w.Scale[n*nb+b*FP4Block/attention.ActBlock]
		}
	}
	return &FP4Weight{Rows: w.Rows, Cols: w.Cols, Packed: w.Packed, Scale: s}
}

// Map returns the expert with f applied to each of its three weights.
func (e *Expert) Map(f func(*FP4Weight) *FP4Weight) *Expert {
	return &Expert{W1: f(e.W1), W2: f(e.W2), W3: f(e.W3)}
}

// WithRouted returns a copy of m whose routed experts ids (each read from
// Experts or the Source) are replaced by f of them; the other experts are
// left out (Combine only reads routed ones). m is not changed.
func (m *MoE) WithRouted(ids []int32, f func(*Expert) *Expert) (*MoE, error) {
	c := *m
	c.Experts = make([]*Expert, m.Gate.Experts)
	c.Source = nil
	for _, e := range ids {
		if e < 0 || int(e) >= m.Gate.Experts {
			return nil, fmt.Errorf("moe: routing index %d outside [0, %d)", e, m.Gate.Experts)
		}
		ex, err := m.expert(int(e))
		if err != nil {
			return nil, err
		}
		c.Experts[e] = f(ex)
	}
	return &c, nil
}

// CombineWith is Combine with the shared expert's forward given: shared
// (nil: no shared expert) writes the shared expert's output for x into out.
// CombineWith(x, indices, weights, m.Shared.Forward) is Combine (tested):
// the same routed loop in expert-id order, fp32 sum, one bf16 rounding.
func (m *MoE) CombineWith(x []float32, indices []int32, weights []float32, shared func(out, x []float32)) ([]float32, error) {
	slots, err := expertSlots(indices, weights, m.Gate.Experts)
	if err != nil {
		return nil, err
	}
	var sh func(out []float32)
	if shared != nil {
		sh = func(out []float32) { shared(out, x) }
	}
	return combineSum(len(x), slots, func(out []float32, e, slot int) error {
		ex, err := m.expert(e)
		if err != nil {
			return err
		}
		ex.Forward(out, x, weights[slot], m.SwigluLimit)
		return nil
	}, sh)
}

// GateUpSwapped is the shared expert with w1 (gate) and w3 (up) exchanged:
// h = silu(w3·x) · (w1·x) — a checkpoint name map that swaps gate_proj and
// up_proj.
func (s *Shared) GateUpSwapped() *Shared { return &Shared{W1: s.W3, W2: s.W2, W3: s.W1} }

// ForwardClamped is the shared expert's forward with the routed experts'
// swiglu_limit clamp (up to ±limit, gate ≤ limit): what a GPU computes
// that applies swiglu_limit to the shared expert too (spec §12.1: the
// release-day model.py does not).
func (s *Shared) ForwardClamped(out, x []float32, limit float32) {
	g := make([]float32, s.W1.Rows)
	u := make([]float32, s.W3.Rows)
	attention.FP8Linear(g, x, s.W1)
	attention.FP8Linear(u, x, s.W3)
	h := make([]float32, len(g))
	SwiGLU(h, g, u, limit, 0, false)
	attention.FP8Linear(out, h, s.W2)
}

// ForwardActPerToken is the shared expert's forward with each FP8 GEMM's
// activation quantised with ONE scale per token (the whole row's amax)
// instead of one per 128 columns (act_quant's block): FP8LinearPerToken.
func (s *Shared) ForwardActPerToken(out, x []float32) {
	g := make([]float32, s.W1.Rows)
	u := make([]float32, s.W3.Rows)
	FP8LinearPerToken(g, x, s.W1)
	FP8LinearPerToken(u, x, s.W3)
	h := make([]float32, len(g))
	SwiGLU(h, g, u, 0, 0, false)
	FP8LinearPerToken(out, h, s.W2)
}

// FP8LinearPerToken is attention.FP8Linear with the activation scale taken
// over the whole row (qx = E4M3(x/s), s = ceil2(max(amax(x), 1e-4)/448),
// quant.QuantizeActFP8 with one block of Cols) — a per-token FP8 GEMM:
//
//	y[n] = bf16( Σ_b ( Σ_{k∈b} qx[k]·W[n,k] ) · s )
//
// the same 128-column block sums and fp32 accumulation as FP8Linear.
func FP8LinearPerToken(y, x []float32, w *attention.FP8Weight) {
	if len(x) != w.Cols || len(y) != w.Rows || w.Cols%attention.ActBlock != 0 {
		panic("moe: FP8LinearPerToken shape mismatch")
	}
	qx := make([]float32, len(x))
	sx := make([]float32, 1)
	quant.QuantizeActFP8(qx, sx, x, len(x))
	var buf []float32
	if w.W == nil {
		buf = make([]float32, w.Cols)
	}
	for n := range y {
		row := w.Row(n, buf)
		var acc float32
		for b := 0; b < w.Cols/attention.ActBlock; b++ {
			var blk float32
			for k := b * attention.ActBlock; k < (b+1)*attention.ActBlock; k++ {
				blk += float32(qx[k] * row[k])
			}
			acc += float32(blk * sx[0])
		}
		y[n] = quant.BF16Round(acc)
	}
}
