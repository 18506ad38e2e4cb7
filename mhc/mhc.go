package mhc

import (
	"math"

	"sparsemla/quant"
)

// Site holds the parameters of one hc_pre site of a block: hc_attn_* or
// hc_ffn_* (Block.__init__, R-M:648-670), all fp32.
type Site struct {
	Mult  int       // hc_mult (4)
	Dim   int       // model width dim
	Fn    []float32 // hc_*_fn [(2+Mult)*Mult][Mult*Dim]
	Base  []float32 // hc_*_base [(2+Mult)*Mult]
	Scale []float32 // hc_*_scale [3]: pre, post, comb

	// Packed holds hc_*_fn instead of Fn (Fn nil) after UsePacked: the
	// prepared path's packed copy, read row by row by the reference loop.
	Packed Rows
}

// Rows is a weight [rows][cols] read one row at a time (attention.Panels,
// the fast path's packed form): Row writes row n's fp32 values to dst.
type Rows interface {
	Row(dst []float32, n int)
}

// UsePacked makes p (hc_*_fn [(2+Mult)·Mult][Mult·Dim], packed from Fn) the
// site's only copy of fn: Fn is dropped and HCPre / Site.Mixes read the
// rows from p, the same values and sums.
func (s *Site) UsePacked(p Rows) { s.Fn, s.Packed = nil, p }

// Mixes is Mixes(mixes, h, fn, normEps) on the site's fn (Fn, or its rows
// from Packed: the same bits).
func (s *Site) Mixes(mixes, h []float32, normEps float32) {
	if s.Packed == nil {
		Mixes(mixes, h, s.Fn, normEps)
		return
	}
	row := make([]float32, len(h))
	mixesRows(mixes, h, func(r int) []float32 { s.Packed.Row(row, r); return row }, normEps)
}

// NMixes returns the number of mixes of a block site, (2+hc)·hc (24 for hc = 4).
func NMixes(hc int) int { return (2 + hc) * hc }

// Check panics with an "mhc: …" message when the parameter shapes do not
// agree with Mult and Dim (callers validate files first).
func (s *Site) Check() {
	m := NMixes(s.Mult)
	fn := len(s.Fn) == m*s.Mult*s.Dim || (s.Fn == nil && s.Packed != nil)
	if s.Mult <= 0 || s.Dim <= 0 || !fn || len(s.Base) != m || len(s.Scale) != 3 {
		panic("mhc: Site parameter shapes do not match hc_mult and dim")
	}
}

// Pre is the result of hc_pre for one sub-layer.
type Pre struct {
	Mixes []float32 // [(2+hc)·hc] input of hc_split_sinkhorn
	Pre   []float32 // [hc] collapse weights
	Post  []float32 // [hc] weights of the sub-layer output in hc_post
	Comb  []float32 // [hc][hc] Sinkhorn-normalised stream mixing (row j read, column k written)
	X     []float32 // [dim] bf16 collapse, input of the sub-layer's RMSNorm (attn_norm_in / ffn_norm_in)
}

// HCPre is Block.hc_pre (R-M:716-724) for one token: h [hc][dim] (bf16
// values) →
//
//	mixes           = Mixes(h, fn)
//	pre, post, comb = SplitSinkhorn(mixes, scale, base)
//	x               = Collapse(h, pre)
//
// normEps is norm_eps (the RMS of hc_pre uses norm_eps, not hc_eps), eps and
// iters are hc_eps and hc_sinkhorn_iters.
func (s *Site) HCPre(h []float32, normEps, eps float32, iters int) Pre {
	s.Check()
	hc := s.Mult
	p := Pre{
		Mixes: make([]float32, NMixes(hc)),
		Pre:   make([]float32, hc),
		Post:  make([]float32, hc),
		Comb:  make([]float32, hc*hc),
		X:     make([]float32, s.Dim),
	}
	s.Mixes(p.Mixes, h, normEps)
	SplitSinkhorn(p.Pre, p.Post, p.Comb, p.Mixes, s.Scale, s.Base, hc, iters, eps)
	Collapse(p.X, h, p.Pre)
	return p
}

// Mixes is the first half of hc_pre and hc_head (R-M:719-721, R-M:785-787):
//
//	hf       = f32(flatten(h))                     [n = hc·dim]
//	ρ        = rsqrt( (Σ_c hf_c²) / n + normEps )
//	mixes[r] = f32( Σ_c fn[r][c] · hf_c ) · ρ      r < len(mixes)
//
// h [n] holds bf16 values, fn [len(mixes)][n] fp32. Both sums are fp32 in
// ascending index order, every product rounded (torch op by op; the GPU's
// GEMM sums in another order, see the package doc).
func Mixes(mixes, h, fn []float32, normEps float32) {
	n := len(h)
	if n == 0 || len(fn) != len(mixes)*n {
		panic("mhc: Mixes shape mismatch")
	}
	mixesRows(mixes, h, func(r int) []float32 { return fn[r*n : (r+1)*n] }, normEps)
}

// mixesRows is Mixes with fn's row r given by row(r).
func mixesRows(mixes, h []float32, row func(r int) []float32, normEps float32) {
	n := len(h)
	if n == 0 {
		panic("mhc: Mixes shape mismatch")
	}
	var ss float32
	for _, v := range h {
		ss += float32(v * v)
	}
	rho := rsqrt(ss/float32(n) + normEps)
	for r := range mixes {
		row := row(r)
		if len(row) != n {
			panic("mhc: Mixes shape mismatch")
		}
		var acc float32
		for c, v := range h {
			acc += float32(row[c] * v)
		}
		mixes[r] = acc * rho
	}
}

// SplitSinkhorn is hc_split_sinkhorn (R-K hc_split_sinkhorn_kernel, the
// torch port the golden ran): from mixes [(2+hc)·hc],
//
//	pre_j   = sigmoid(mixes[j]·s0 + base[j]) + eps                    j < hc
//	post_j  = 2 · sigmoid(mixes[hc+j]·s1 + base[hc+j])
//	C[j][k] = mixes[2hc + j·hc + k]·s2 + base[2hc + j·hc + k]
//	C       = C[j][k] = exp(C[j][k] - max_k C[j][k]); C = C / rowsum(C) + eps
//	C       = C / (colsum(C) + eps)
//	repeat iters-1 times: C = C / (rowsum(C) + eps); C = C / (colsum(C) + eps)
//
// with s = scale [3], base [(2+hc)·hc]. Every op is one fp32 rounding (no FMA);
// row and column sums run in ascending index order. comb is written [hc][hc].
func SplitSinkhorn(pre, post, comb, mixes, scale, base []float32, hc, iters int, eps float32) {
	if hc <= 0 || len(mixes) != NMixes(hc) || len(base) != len(mixes) || len(scale) != 3 ||
		len(pre) != hc || len(post) != hc || len(comb) != hc*hc || iters < 1 {
		panic("mhc: SplitSinkhorn shape mismatch")
	}
	for j := 0; j < hc; j++ {
		pre[j] = Sigmoid(float32(mixes[j]*scale[0])+base[j]) + eps
		post[j] = 2 * Sigmoid(float32(mixes[hc+j]*scale[1])+base[hc+j])
	}
	for i := range comb {
		comb[i] = float32(mixes[2*hc+i]*scale[2]) + base[2*hc+i]
	}
	// Row softmax, then + eps.
	for j := 0; j < hc; j++ {
		row := comb[j*hc : (j+1)*hc]
		m := row[0]
		for _, v := range row[1:] {
			m = max(m, v)
		}
		for k := range row {
			row[k] = exp32(row[k] - m)
		}
		sum := rowSum(row)
		for k := range row {
			row[k] = row[k]/sum + eps
		}
	}
	colNormalize(comb, hc, eps)
	for it := 1; it < iters; it++ {
		for j := 0; j < hc; j++ {
			row := comb[j*hc : (j+1)*hc]
			d := rowSum(row) + eps
			for k := range row {
				row[k] /= d
			}
		}
		colNormalize(comb, hc, eps)
	}
}

// rowSum is Σ_k row[k] in fp32, k ascending.
func rowSum(row []float32) float32 {
	var s float32
	for _, v := range row {
		s += v
	}
	return s
}

// colNormalize divides every column k of comb [hc][hc] by (Σ_j comb[j][k] + eps),
// the column sum in fp32, j ascending.
func colNormalize(comb []float32, hc int, eps float32) {
	for k := 0; k < hc; k++ {
		var s float32
		for j := 0; j < hc; j++ {
			s += comb[j*hc+k]
		}
		d := s + eps
		for j := 0; j < hc; j++ {
			comb[j*hc+k] /= d
		}
	}
}

// Collapse is the weighted sum back to one stream of hc_pre and hc_head
// (R-M:723, R-M:790):
//
//	x[i] = bf16( Σ_j f32(pre_j · h[j][i]) )      fp32 sum, j = 0 .. hc-1 ascending
//
// h [hc][dim] holds bf16 values, pre [hc] fp32, x [dim] receives bf16 values.
func Collapse(x, h, pre []float32) {
	hc, dim := len(pre), len(x)
	if hc == 0 || len(h) != hc*dim {
		panic("mhc: Collapse shape mismatch")
	}
	for i := range x {
		var s float32
		for j := 0; j < hc; j++ {
			s += float32(pre[j] * h[j*dim+i])
		}
		x[i] = quant.BF16Round(s)
	}
}

// Transpose returns the hc×hc matrix comb with rows and columns swapped:
// t[k][j] = comb[j][k] (the comb-transposed hypotheses and faults).
func Transpose(comb []float32, hc int) []float32 {
	t := make([]float32, hc*hc)
	for j := 0; j < hc; j++ {
		for k := 0; k < hc; k++ {
			t[k*hc+j] = comb[j*hc+k]
		}
	}
	return t
}

// Post is Block.hc_post (R-M:726-729): the sub-layer output a [dim] (bf16)
// written back into the streams with the residual h [hc][dim] (bf16, the
// sub-layer's input streams):
//
//	out[j][i] = bf16( f32(post_j · a[i]) + Σ_k f32(comb[k][j] · h[k][i]) )
//
// The residual sum runs over k ascending in fp32 and is added last, as torch
// evaluates `post·a + sum(comb·h, dim=2)`. out [hc][dim] receives bf16 values
// and must not alias h.
func Post(out, a, h, post, comb []float32) {
	hc, dim := len(post), len(a)
	if hc == 0 || len(h) != hc*dim || len(out) != hc*dim || len(comb) != hc*hc {
		panic("mhc: Post shape mismatch")
	}
	for j := 0; j < hc; j++ {
		for i := 0; i < dim; i++ {
			var r float32
			for k := 0; k < hc; k++ {
				r += float32(comb[k*hc+j] * h[k*dim+i])
			}
			out[j*dim+i] = quant.BF16Round(float32(post[j]*a[i]) + r)
		}
	}
}

// HeadPre is the weight rule of ParallelHead.hc_head (R-M:788):
//
//	pre_j = sigmoid(mixes_j · scale + base_j) + eps      j < hc
//
// mixes, base and pre [hc], scale = hc_head_scale[0], eps = hc_eps. There is
// no post, no comb and no Sinkhorn at the head.
func HeadPre(pre, mixes, base []float32, scale, eps float32) {
	if len(mixes) != len(pre) || len(base) != len(pre) {
		panic("mhc: HeadPre shape mismatch")
	}
	for j, m := range mixes {
		pre[j] = Sigmoid(float32(m*scale)+base[j]) + eps
	}
}

// Expand is the start of the streams (Transformer.forward, R-M:880-881,
// `h.unsqueeze(2).repeat(1, 1, hc_mult, 1)`): the embedding e [dim] copied
// into each of the hc streams of h [hc][dim].
func Expand(h, e []float32, hc int) {
	if len(h) != hc*len(e) {
		panic("mhc: Expand shape mismatch")
	}
	for j := 0; j < hc; j++ {
		copy(h[j*len(e):], e)
	}
}

// Sigmoid is torch.sigmoid on fp32: f32(1 / f32(1 + f32(exp(-v)))), each op
// one fp32 rounding, exp correctly rounded.
func Sigmoid(v float32) float32 {
	return 1 / (1 + exp32(-v))
}

func exp32(x float32) float32 { return float32(math.Exp(float64(x))) }

// rsqrt is f32(1/sqrt(v)), correctly rounded (CUDA's rsqrtf is within 2 ulp).
func rsqrt(v float32) float32 { return float32(1 / math.Sqrt(float64(v))) }
