package engine

import (
	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/moe"
	"sparsemla/quant"
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
// dequantisation; on a prepared layer the absorbed einsum (q_absorbed) runs
// with its loops exchanged (v32AbsorbFast) and the value up-projection
// (o_v), weights_proj (iw_raw) and the head (logits) four rows at a time
// (v32RowsDot), each sum in the reference's order. The gate's fp32 GEMV,
// the indexer scores, the sparse MLA and the rest run the reference loops on
// both paths.
// The MoE of a prepared layer is V32MoE on the packed experts: only the
// routed experts and the shared one run, in ascending expert order.

// prepareV32 packs the FP8 weights of a V3.2 layer (see above). The packed
// weights are new memory; w keeps its own (the reference loops still run
// on them where a stage is computed without ctx, e.g. a diagnosis), unless
// loadV32LayerWeightsPrepared makes them the panels' only.
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

// loadV32LayerWeightsPrepared is LoadLayerWeightsPrepared of a V3.2 layer:
// the weights loaded and checked as LoadLayerWeights does, the FP8 linears
// packed (PrepareLayer), and then every packed weight keeps only its panels
// (FP8Weight.UsePanels: no codes, no fp32 copy; a reference loop that reads
// it — a diagnosis hypothesis, a fault injection — dequantises row by row
// from the panels, the same values). wkv_b keeps its fp32 values (its
// dequantisation is what decode reads).
func loadV32LayerWeightsPrepared(cfg *Config, layer int, st dump.WeightSource) (*LayerWeights, error) {
	lw, err := loadV32LayerWeights(cfg, layer, st)
	if err != nil {
		return nil, err
	}
	PrepareLayer(cfg, lw)
	for w, p := range lw.Fast.src {
		w.UsePanels(p)
	}
	return lw, nil
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

// v32AbsorbFast is attention.V32Absorb with the loops exchanged so that
// wkv_b streams row by row: acc[k] += f32(q[h][d] · wkv_b[h(nope+v)+d][k])
// for d ascending onto +0, each k's sum in the reference's order (the same
// products, no fused multiply-add), so the same bits.
func v32AbsorbFast(dst, q, wkvB []float32, H, nope, rope, v, c int) {
	if len(dst) != H*c || len(q) != H*(nope+rope) || len(wkvB) != H*(nope+v)*c {
		panic("engine: v32AbsorbFast shape mismatch")
	}
	acc := make([]float32, c)
	for h := 0; h < H; h++ {
		qh := q[h*(nope+rope) : h*(nope+rope)+nope]
		w := wkvB[h*(nope+v)*c:]
		clear(acc)
		for d, x := range qh {
			row := w[d*c : (d+1)*c]
			for k, wk := range row {
				acc[k] += float32(x * wk)
			}
		}
		for k, a := range acc {
			dst[h*c+k] = quant.BF16Round(a)
		}
	}
}

// v32RowsDot is y[n] = Σ_k x[k]·W[n·cols+k] (fp32, k ascending onto +0:
// attention.F32Linear's sums) for rows n, four rows at a time: four
// independent sums in flight, each in the reference's order, so the same
// bits.
func v32RowsDot(y, x, W []float32, rows, cols int) {
	if len(x) != cols || len(y) != rows || len(W) != rows*cols {
		panic("engine: v32RowsDot shape mismatch")
	}
	n := 0
	for ; n+4 <= rows; n += 4 {
		w0, w1, w2, w3 := W[n*cols:(n+1)*cols], W[(n+1)*cols:(n+2)*cols], W[(n+2)*cols:(n+3)*cols], W[(n+3)*cols:(n+4)*cols]
		var s0, s1, s2, s3 float32
		for k, xk := range x {
			s0 += float32(xk * w0[k])
			s1 += float32(xk * w1[k])
			s2 += float32(xk * w2[k])
			s3 += float32(xk * w3[k])
		}
		y[n], y[n+1], y[n+2], y[n+3] = s0, s1, s2, s3
	}
	for ; n < rows; n++ {
		var s float32
		for k, xk := range x {
			s += float32(xk * W[n*cols+k])
		}
		y[n] = s
	}
}

// v32ValueUpFast is attention.V32ValueUp on v32RowsDot: o_v[h][j] =
// bf16(Σ_k o_latent[h][k] · wkv_b[h(nope+v)+nope+j][k]).
func v32ValueUpFast(dst, oLat, wkvB []float32, H, nope, v, c int) {
	if len(dst) != H*v || len(oLat) != H*c || len(wkvB) != H*(nope+v)*c {
		panic("engine: v32ValueUpFast shape mismatch")
	}
	for h := 0; h < H; h++ {
		w := wkvB[(h*(nope+v)+nope)*c : (h*(nope+v)+nope+v)*c]
		out := dst[h*v : (h+1)*v]
		v32RowsDot(out, oLat[h*c:(h+1)*c], w, v, c)
		for j, s := range out {
			out[j] = quant.BF16Round(s)
		}
	}
}

// v32F32Lin is attention.F32Linear, on v32RowsDot when p is set.
func v32F32Lin(p *PreparedLayer, y, x, W []float32, rows, cols int) {
	if p != nil {
		v32RowsDot(y, x, W, rows, cols)
		return
	}
	attention.F32Linear(y, x, W, rows, cols)
}
