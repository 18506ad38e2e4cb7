package engine

import (
	"fmt"
	"math"

	"sparsemla/attention"
	"sparsemla/head"
	"sparsemla/mhc"
	"sparsemla/moe"
)

// PreparedBlock is one layer's block weights (BlockWeights) with the GEMVs
// around the attention packed for the fast kernels: the two hc_pre mixes
// (hc_attn_fn, hc_ffn_fn: fp32 panels) and the gate (ffn.gate.weight, bf16
// panels); the shared expert keeps its FP8 codes as panels only
// (moe.Shared.Pack). Its arithmetic is BlockStages', bit for bit
// (TestPreparedWholeStepEqualsRunLayer).
type PreparedBlock struct {
	Block         *BlockWeights
	AttnFn, FFNFn *attention.Panels
	Gate          *attention.Panels
}

// PrepareBlock packs b's GEMVs (PreparedBlock) and its shared expert
// (moe.Shared.Pack, in place: b's reference loops then read the same codes
// from the panels). The fp32 hc_*_fn and gate weights of b are kept (the
// reference stages read them) unless Compact drops them; a block already
// compact keeps its panels.
func PrepareBlock(cfg *Config, b *BlockWeights) *PreparedBlock {
	hc, dim := cfg.HCMult, cfg.Dim
	nm := mhc.NMixes(hc)
	fn := func(s *mhc.Site) *attention.Panels {
		if p, ok := s.Packed.(*attention.Panels); ok && s.Fn == nil {
			return p
		}
		return attention.PackPanels(s.Fn, nm, hc*dim)
	}
	p := &PreparedBlock{Block: b, AttnFn: fn(b.AttnSite), FFNFn: fn(b.FFNSite), Gate: b.MoE.Gate.Packed}
	if b.MoE.Gate.Weight != nil || p.Gate == nil {
		p.Gate = attention.PackPanels(b.MoE.Gate.Weight, b.MoE.Gate.Experts, dim)
	}
	if b.MoE.Shared != nil {
		b.MoE.Shared.Pack()
	}
	return p
}

// Compact makes the panels the block's only copy of hc_attn_fn, hc_ffn_fn
// and gate.weight (mhc.Site.UsePacked, moe.Gate.UsePanels): the fp32
// copies are dropped (≈ 7 MiB a V4-Flash layer) and the reference stages
// read the rows from the panels, the same bits.
func (p *PreparedBlock) Compact() {
	b := p.Block
	b.AttnSite.UsePacked(p.AttnFn)
	b.FFNSite.UsePacked(p.FFNFn)
	b.MoE.Gate.UsePanels(p.Gate)
}

// PackedBytes is the memory of the block's packed GEMV weights (the shared
// expert's panels included).
func (p *PreparedBlock) PackedBytes() int64 {
	n := p.AttnFn.Bytes() + p.FFNFn.Bytes() + p.Gate.Bytes()
	if s := p.Block.MoE.Shared; s != nil {
		for _, w := range []*attention.FP8Weight{s.W1, s.W2, s.W3} {
			n += attention.PackFP8Weight(w).Bytes()
		}
	}
	return n
}

// PreparedHead is the head with its GEMVs packed: hc_head_fn (fp32 panels)
// and head.weight (bf16 panels: 2 bytes per weight, the checkpoint's dtype).
// Head's fp32 Weight may be dropped (nil) once packed: Step reads only the
// panels.
type PreparedHead struct {
	Head  *head.Head
	Fn, W *attention.Panels
}

// PrepareHead packs h's GEMVs (PreparedHead); a head loaded with its
// weight as panels (LoadHeadWeights) keeps them.
func PrepareHead(h *head.Head) *PreparedHead {
	p := &PreparedHead{Head: h, Fn: attention.PackPanels(h.HCFn, h.Mult, h.Mult*h.Dim), W: h.Panels}
	if h.Weight != nil {
		p.W = attention.PackPanels(h.Weight, h.Vocab, h.Dim)
	}
	return p
}

// PreparedWhole is the whole model on the fast path: every layer's attention
// (Attn: PreparedModel's layers and RoPE tables) and block, the embedding and
// the head. Step is one whole decode step from the token to the logits.
type PreparedWhole struct {
	Cfg    *Config
	Attn   *PreparedModel
	Blocks []*PreparedBlock
	Embed  head.Embedding
	Head   *PreparedHead
}

// WholeStep is what PreparedWhole.Step returns: the last layer's output
// streams, the logits and the greedy token, with each layer's routing.
type WholeStep struct {
	HOut    []float32 // [hc][dim] bf16, the last layer's h_out
	Logits  []float32 // [vocab] fp32
	Token   int
	Indices [][]int32 // [layer][k] moe_indices
}

// Step is one whole decode step at position pos of token tok: layer by
// layer, in order, BlockStages' arithmetic on the fast kernels, each layer's
// state advanced in place (PreparedLayer.Step):
//
//	h      = Expand(embed[tok])
//	per layer l:  x = attn_norm(hc_pre(h)); y = attention(x); h = hc_post(y)
//	              f = ffn_norm(hc_pre(h)); route; h = hc_post(Σ experts + shared)
//	logits = head · norm(hc_head(h)),  token = argmax
//
// The same bits as RunLayer on the reference loops, layer after layer, and
// the logits stage (TestPreparedWholeStepEqualsRunLayer).
func (m *PreparedWhole) Step(states []*LayerState, tok, pos int64) (*WholeStep, error) {
	cfg := m.Cfg
	n := len(m.Attn.Layers)
	if len(states) != n || len(m.Blocks) != n || len(m.Attn.Rope) != n {
		return nil, fmt.Errorf("engine: prepared whole step: %d layers, %d blocks, %d states", n, len(m.Blocks), len(states))
	}
	hc, dim := cfg.HCMult, cfg.Dim
	e := make([]float32, dim)
	if err := m.Embed.Row(e, tok); err != nil {
		return nil, err
	}
	h := make([]float32, hc*dim)
	mhc.Expand(h, e, hc)
	out := &WholeStep{Indices: make([][]int32, n)}
	for l := 0; l < n; l++ {
		var err error
		if h, out.Indices[l], err = m.layer(l, states[l], h, tok, pos); err != nil {
			return nil, err
		}
	}
	out.HOut = h
	hd := m.Head.Head
	mixes, pre := make([]float32, hc), make([]float32, hc)
	mixesFast(mixes, h, m.Head.Fn, hd.NormEps)
	mhc.HeadPre(pre, mixes, hd.HCBase, hd.HCScale, hd.HCEps)
	x, normed := make([]float32, dim), make([]float32, dim)
	mhc.Collapse(x, h, pre)
	attention.RMSNorm(normed, x, hd.Norm, hd.NormEps)
	out.Logits = make([]float32, hd.Vocab)
	m.Head.W.Dot(out.Logits, normed)
	out.Token = head.Greedy(out.Logits)
	return out, nil
}

// layer is one whole layer of Step: from the input streams h [hc][dim] to
// h_out, with the routing indices.
func (m *PreparedWhole) layer(l int, st *LayerState, h []float32, tok, pos int64) ([]float32, []int32, error) {
	cfg := m.Cfg
	pb := m.Blocks[l]
	b := pb.Block
	x, post, comb := m.hcPre(b.AttnSite, pb.AttnFn, b.AttnNorm, h)
	y, err := m.Attn.Layers[l].Step(cfg, m.Attn.Rope[l], st, x, pos)
	if err != nil {
		return nil, nil, err
	}
	hmid := make([]float32, len(h))
	mhc.Post(hmid, y, h, post, comb)
	f, post, comb := m.hcPre(b.FFNSite, pb.FFNFn, b.FFNNorm, hmid)
	g := &b.MoE.Gate
	s := make([]float32, g.Experts)
	pb.Gate.Dot(s, f)
	moe.ApplyScoreFunc(s, g.Func)
	r, err := g.RouteScores(s, tok)
	if err != nil {
		return nil, nil, fmt.Errorf("engine: layer %d step %d: moe_indices: %w", l, pos, err)
	}
	mo := *b.MoE
	mo.Fast = true
	ffn, err := mo.Combine(f, r.Indices, r.Weights)
	if err != nil {
		return nil, nil, fmt.Errorf("engine: layer %d step %d: ffn_out: %w", l, pos, err)
	}
	hout := make([]float32, len(h))
	mhc.Post(hout, ffn, hmid, post, comb)
	return hout, r.Indices, nil
}

// hcPre is one site's hc_pre and norm (the stages hc_*_mixes … x / ffn_in):
// it returns the normed sub-layer input and the site's post and comb.
func (m *PreparedWhole) hcPre(s *mhc.Site, fn *attention.Panels, norm, h []float32) (x, post, comb []float32) {
	cfg := m.Cfg
	hc := cfg.HCMult
	mixes := make([]float32, mhc.NMixes(hc))
	mixesFast(mixes, h, fn, float32(cfg.NormEps))
	pre, post, comb := make([]float32, hc), make([]float32, hc), make([]float32, hc*hc)
	mhc.SplitSinkhorn(pre, post, comb, mixes, s.Scale, s.Base, hc, cfg.HCSinkhornIters, float32(cfg.HCEps))
	in := make([]float32, cfg.Dim)
	mhc.Collapse(in, h, pre)
	x = make([]float32, cfg.Dim)
	attention.RMSNorm(x, in, norm, float32(cfg.NormEps))
	return x, post, comb
}

// mixesFast is mhc.Mixes with the GEMV on panels (Panels.Dot = F32Linear:
// each mix Σ_c fn[r][c]·h_c in fp32, c ascending, the products fn·h and
// h·fn being the same rounding), then the same ρ.
func mixesFast(mixes, h []float32, fn *attention.Panels, normEps float32) {
	var ss float32
	for _, v := range h {
		ss += float32(v * v)
	}
	rho := float32(1 / math.Sqrt(float64(ss/float32(len(h))+normEps)))
	fn.Dot(mixes, h)
	for r := range mixes {
		mixes[r] *= rho
	}
}
