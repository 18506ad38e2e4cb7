package engine

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// BlockWeightRecords are layer l's block parameters (BlockWeights: mHC,
// norms, gate, routed FP4 experts, FP8 shared expert) as checkpoint records
// named like the official state_dict, the inverse of LoadBlockWeights:
//
//	layers.L.hc_{attn,ffn}_fn    F32 [(2+hc)·hc, hc·dim]
//	layers.L.hc_{attn,ffn}_base  F32 [(2+hc)·hc]
//	layers.L.hc_{attn,ffn}_scale F32 [3]
//	layers.L.{attn,ffn}_norm.weight          F32 [dim]
//	layers.L.ffn.gate.weight                 BF16 [E, dim]
//	layers.L.ffn.gate.bias                   F32 [E]       (score layers)
//	layers.L.ffn.gate.tid2eid                I32 [vocab, k] (hash layers)
//	layers.L.ffn.experts.E.w{1,2,3}.weight   U8 [out, in/2] (float4_e2m1fn_x2: low nibble = even column)
//	layers.L.ffn.experts.E.w{1,2,3}.scale    U8 [out, in/32] (UE8M0)
//	layers.L.ffn.shared_experts.w{1,2,3}.weight E4M3 [out, in], .scale U8 [⌈out/128⌉, ⌈in/128⌉]
//
// Every routed expert is read (from Experts or the MoE's Source).
func BlockWeightRecords(cfg *Config, layer int, b *BlockWeights) ([]dump.Record, error) {
	pre := fmt.Sprintf("layers.%d.", layer)
	var out []dump.Record
	f32 := func(name string, v []float32, shape ...int) {
		out = append(out, dump.Record{Name: pre + name, DType: dump.F32, Shape: shape, Data: f32Bytes(v)})
	}
	hc, dim := cfg.HCMult, cfg.Dim
	nm := mhc.NMixes(hc)
	for _, s := range []struct {
		side string
		site *mhc.Site
	}{{"attn", b.AttnSite}, {"ffn", b.FFNSite}} {
		f32("hc_"+s.side+"_fn", s.site.Fn, nm, hc*dim)
		f32("hc_"+s.side+"_base", s.site.Base, nm)
		f32("hc_"+s.side+"_scale", s.site.Scale, 3)
	}
	f32("attn_norm.weight", b.AttnNorm, dim)
	f32("ffn_norm.weight", b.FFNNorm, dim)
	m := b.MoE
	g := &m.Gate
	out = append(out, dump.Record{Name: pre + "ffn.gate.weight", DType: dump.BF16, Shape: []int{g.Experts, g.Dim}, Data: bf16Bytes(g.Weight)})
	if g.Hash() {
		ids := make([]int64, len(g.TID2EID))
		for i, e := range g.TID2EID {
			ids[i] = int64(e)
		}
		out = append(out, dump.Record{Name: pre + "ffn.gate.tid2eid", DType: dump.I32, Shape: []int{len(ids) / g.TopK, g.TopK}, Data: i32Bytes(ids)})
	} else {
		f32("ffn.gate.bias", g.Bias, g.Experts)
	}
	all := make([]int32, g.Experts)
	for e := range all {
		all[e] = int32(e)
	}
	ex, err := m.WithRouted(all, func(e *moe.Expert) *moe.Expert { return e })
	if err != nil {
		return nil, fmt.Errorf("engine: layer %d: %w", layer, err)
	}
	fp4 := func(name string, w *moe.FP4Weight) {
		out = append(out,
			dump.Record{Name: pre + name + ".weight", DType: dump.U8, Shape: []int{w.Rows, w.Cols / 2}, Data: append([]byte(nil), w.Packed...)},
			dump.Record{Name: pre + name + ".scale", DType: dump.U8, Shape: []int{w.Rows, w.Cols / moe.FP4Block}, Data: append([]byte(nil), w.Scale...)})
	}
	for e, x := range ex.Experts {
		p := fmt.Sprintf("ffn.experts.%d.", e)
		fp4(p+"w1", x.W1)
		fp4(p+"w2", x.W2)
		fp4(p+"w3", x.W3)
	}
	fp8 := func(name string, w *attention.FP8Weight) {
		out = append(out,
			dump.Record{Name: pre + name + ".weight", DType: dump.E4M3, Shape: []int{w.Rows, w.Cols}, Data: append([]byte(nil), w.CodesRowMajor()...)},
			dump.Record{Name: pre + name + ".scale", DType: dump.U8, Shape: fp8Scale(w.Rows, w.Cols), Data: append([]byte(nil), w.Scale...)})
	}
	if m.Shared != nil {
		fp8("ffn.shared_experts.w1", m.Shared.W1)
		fp8("ffn.shared_experts.w2", m.Shared.W2)
		fp8("ffn.shared_experts.w3", m.Shared.W3)
	}
	return out, nil
}

// HeadWeightRecords are the parameters outside the layers (HeadWeights) as
// checkpoint records with official names, the inverse of LoadHeadWeights:
// embed.weight BF16 [vocab, dim] (every row read from the Embedding),
// hc_head_fn F32 [hc, hc·dim], hc_head_base F32 [hc], hc_head_scale F32 [1],
// norm.weight F32 [dim], head.weight F32 [vocab, dim]. The head must hold its
// fp32 table (Weight, as RandomHead makes it), not panels only.
func HeadWeightRecords(cfg *Config, hw *HeadWeights) ([]dump.Record, error) {
	h := hw.Head
	if h == nil || hw.Embed == nil || h.Weight == nil {
		return nil, fmt.Errorf("engine: HeadWeightRecords needs the embedding and the head's fp32 table")
	}
	V, dim, hc := cfg.VocabSize, cfg.Dim, cfg.HCMult
	emb := make([]float32, V*dim)
	for t := 0; t < V; t++ {
		if err := hw.Embed.Row(emb[t*dim:(t+1)*dim], int64(t)); err != nil {
			return nil, fmt.Errorf("engine: embed.weight: %w", err)
		}
	}
	rec := func(name string, dt dump.DType, data []byte, shape ...int) dump.Record {
		return dump.Record{Name: name, DType: dt, Shape: shape, Data: data}
	}
	return []dump.Record{
		rec("embed.weight", dump.BF16, bf16Bytes(emb), V, dim),
		rec("hc_head_fn", dump.F32, f32Bytes(h.HCFn), hc, hc*dim),
		rec("hc_head_base", dump.F32, f32Bytes(h.HCBase), hc),
		rec("hc_head_scale", dump.F32, f32Bytes([]float32{h.HCScale}), 1),
		rec("norm.weight", dump.F32, f32Bytes(h.Norm), dim),
		rec("head.weight", dump.F32, f32Bytes(h.Weight), V, dim),
	}, nil
}
