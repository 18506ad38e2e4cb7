package moe

import "sparsemla/attention"

// Pack keeps the shared expert's FP8 weights only as attention.FP8Panels
// (FP8Weight.UsePanels: one copy of the codes, in the fast kernels' layout;
// the reference FP8Linear then dequantises its rows from the panels, the same
// values). ForwardFast runs on them.
func (s *Shared) Pack() {
	for _, w := range []*attention.FP8Weight{s.W1, s.W2, s.W3} {
		if !packed(w) {
			w.UsePanels(attention.PackFP8Weight(w))
		}
	}
}

// packed reports whether w holds its codes only as panels (Pack).
func packed(w *attention.FP8Weight) bool { return w.Codes == nil && w.W == nil }

// ForwardFast is Forward with the three FP8 GEMVs on the panels of a packed
// shared expert (FP8Panels.Linear = FP8Linear bit for bit): the same bits.
// An unpacked expert runs Forward.
func (s *Shared) ForwardFast(out, x []float32) {
	if !packed(s.W1) || !packed(s.W2) || !packed(s.W3) {
		s.Forward(out, x)
		return
	}
	g := make([]float32, s.W1.Rows)
	u := make([]float32, s.W3.Rows)
	attention.PackFP8Weight(s.W1).Linear(g, x)
	attention.PackFP8Weight(s.W3).Linear(u, x)
	h := make([]float32, len(g))
	SwiGLU(h, g, u, 0, 0, false)
	attention.PackFP8Weight(s.W2).Linear(out, h)
}
