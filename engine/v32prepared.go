package engine

import (
	"sparsemla/attention"
	"sparsemla/moe"
)

// The fast path of a V3.2 layer (PrepareLayer on a V3.2 config): every FP8
// linear the V3.2 decode runs through act_quant + fp8_gemm — the attention's
// wq_a, wq_b, wkv_a, wo, indexer.wq_b, indexer.wk and, with the FFN part,
// the dense MLP's, every routed expert's and the shared expert's w1, w2,
// w3 — is packed once into attention.FP8Panels, and the stages (q_a, q_b,
// kv_a, y, iq_b, ik_raw, ffn_out) run FP8Panels.Linear on them instead of
// attention.FP8Linear. Both compute
//
//	y[n] = bf16( Σ_b f32(Σ_{k in block b} qx[k]·E4M3[n,k]) · sx_b · s_{n,b} )
//
// with the same products and the same order of every sum, so the stages
// give the same bits at any GOMAXPROCS (TestV32PreparedEqualsReference);
// only the speed differs. wkv_b is not packed: decode reads its bf16
// dequantisation (the absorbed einsums). The fp32 GEMVs (weights_proj, the
// gate, the head) and everything else run the reference loops on both paths.
// The MoE of a prepared layer is V32MoE on the packed experts: only the
// routed experts and the shared one run, in ascending expert order.

// prepareV32 packs the FP8 weights of a V3.2 layer (see above). The packed
// weights are new memory; w keeps its own (the reference loops still run
// on them where a stage is computed without ctx, e.g. a diagnosis).
func prepareV32(w *LayerWeights) *PreparedLayer {
	v := w.V32
	p := &PreparedLayer{Layer: w.Layer, src: map[*attention.FP8Weight]*attention.FP8Panels{}}
	pack := func(ws ...*attention.FP8Weight) {
		for _, x := range ws {
			if x != nil && p.src[x] == nil {
				p.src[x] = attention.PackFP8Weight(x)
			}
		}
	}
	pack(v.WqA, v.WqB, v.WkvA, v.Wo, v.IWqB, v.IWk)
	if f := v.FFN; f != nil {
		for _, m := range append([]*V32MLP{f.Dense, f.Shared}, f.Experts...) {
			if m != nil {
				pack(m.W1, m.W2, m.W3)
			}
		}
	}
	return p
}

// v32Lin is y = FP8Lin(w, x): on the packed copy of w when the layer is
// prepared (p non-nil and holding w), else the reference loop.
func v32Lin(p *PreparedLayer, y, x []float32, w *attention.FP8Weight) {
	if p != nil {
		if pw := p.packedOf(w); pw != nil {
			pw.Linear(y, x)
			return
		}
	}
	attention.FP8Linear(y, x, w)
}

// forward is Forward with the linears of p (nil: the reference loops).
func (m *V32MLP) forward(out, x []float32, p *PreparedLayer) {
	inter := m.W1.Rows
	g, u := make([]float32, inter), make([]float32, inter)
	v32Lin(p, g, x, m.W1)
	v32Lin(p, u, x, m.W3)
	for i := range g {
		g[i] = bf16Silu(g[i], u[i])
	}
	v32Lin(p, out, g, m.W2)
}

// v32MoE is V32MoE with the linears of p (nil: the reference loops).
func v32MoE(out, x []float32, r moe.Route, experts []*V32MLP, shared *V32MLP, p *PreparedLayer) {
	y := make([]float32, len(out))
	eo := make([]float32, len(out))
	for e := range experts {
		for t, id := range r.Indices {
			if int(id) != e {
				continue
			}
			experts[e].forward(eo, x, p)
			for i, v := range eo {
				y[i] += v * r.Weights[t]
			}
		}
	}
	if shared == nil {
		clear(eo)
	} else {
		shared.forward(eo, x, p)
	}
	for i, v := range eo {
		out[i] = bf16Sum(y[i], v)
	}
}
