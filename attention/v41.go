package attention

import (
	"math"

	"sparsemla/quant"
)

// This file holds the V4.1 ("CSA2") attention primitives that differ from V4
// (spec §11; V41-M = the official DeepSeek-V4.1-Flash inference/model.py at
// revision dba1be0a, read through a vendored copy): the window index list with
// its −1 padding first, the r = 1 / r = 2 compressor without ape or overlap
// that returns the pre-RoPE latent, the compressed-KV row (RoPE, then FP4 with
// E4M3 block-16 scales over all dims), the window K quantiser (FQ8 over all
// dims in blocks of 32), and FP8 linears with 32×32 weight blocks and
// activation blocks of 32.

// V41Block is V4.1's FP8 block edge: 32×32 weight blocks, activations per 32
// (model.py `fp8_block_size = 32`), the window-K FQ8 block and the FP4 block
// of the index keys.
const V41Block = 32

// V41WindowIdx is V4.1's get_window_topk_idxs at decode (start_pos = p > 0):
//
//	oldest = p mod win + 1
//	idx    = [oldest, …, win−1, 0, …, oldest−1]   then every entry > p → −1
//
// For p ≥ win−1 that is V4's list (WindowIdx: oldest → newest, all valid).
// While the ring is filling (p < win−1) the win−p−1 unfilled slots come FIRST
// as −1, followed by 0 … p — V4 puts them last. The list has win entries.
func V41WindowIdx(p int64, win int) []int32 {
	if p <= 0 || win <= 0 {
		panic("attention: V41WindowIdx needs a decode position p > 0")
	}
	oldest := int(p%int64(win)) + 1
	idx := make([]int32, 0, win)
	for i := oldest; i < win; i++ {
		idx = append(idx, int32(i))
	}
	for i := 0; i < oldest; i++ {
		idx = append(idx, int32(i))
	}
	for i, v := range idx {
		if int64(v) > p {
			idx[i] = -1
		}
	}
	return idx
}

// V41FQ8Window is V4.1's window-K quantiser (Attention._window_kv,
// `act_quant(kv, 32, "ue8m0", …, True)`): FQ8 over ALL head_dim dims, the RoPE
// tail included, in blocks of 32, in place. V4 quantises only the nope dims in
// blocks of 64.
func V41FQ8Window(k []float32) { quant.FQ8(k, V41Block) }

// V41FQ4KV is V4.1's compressed-KV quantiser (`fp4_act_quant(latent, 16, True,
// scale_dtype=float8_e4m3fn)` after the RoPE): FP4 E2M1 with an E4M3 scale per
// 16 dims over ALL dims (quant.FQ4E4M3), in place.
func V41FQ4KV(row []float32) { quant.FQ4E4M3(row, quant.FP4E4M3Block) }

// V41Compressor is V4.1's Compressor (V41-M): no ape, no overlap, ratio 1 or 2.
//
//	r = 1: latent = RMSNorm_norm( BF16Lin(Wkv, x) )        Wkv bf16 [d, dim], no gate, no state
//	r = 2: a_t = Wkv · f32(x_t), b_t = Wgate · f32(x_t)    fp32 weights [d, dim]
//	       state kv/score fp32 [2][d], slot t mod 2 (score initialised to −∞)
//	       at (t+1) mod 2 = 0: latent = RMSNorm_norm( bf16( Σ_s softmax_s(score)[c] · kv[s][c] ) )
//
// The latent is returned before RoPE: the source layer derives its index keys
// from it, then rotates and quantises it into the compressed cache
// (V41KVRow).
type V41Compressor struct {
	Ratio   int       // 1 or 2
	HeadDim int       // d = 512
	Dim     int       // model dim
	Wkv     []float32 // [d*dim]: bf16 values (r = 1) or fp32 (r = 2)
	Wgate   []float32 // [d*dim] fp32 (r = 2); nil for r = 1
	Norm    []float32 // [d] fp32
	Eps     float32   // rms_norm_eps (1e-20 in V4.1-Flash)
}

// V41CompressorState is the open group of an r = 2 compressor: KV and Score
// fp32 [Ratio][HeadDim], slot t mod r holding token t.
type V41CompressorState struct {
	KV, Score []float32
}

// NewState returns the start state: kv = 0, score = −∞ (nil for r = 1).
func (c *V41Compressor) NewState() *V41CompressorState {
	if c.Ratio == 1 {
		return nil
	}
	n := c.Ratio * c.HeadDim
	st := &V41CompressorState{KV: make([]float32, n), Score: make([]float32, n)}
	for i := range st.Score {
		st.Score[i] = float32(math.Inf(-1))
	}
	return st
}

// Clone returns a deep copy (nil for nil).
func (st *V41CompressorState) Clone() *V41CompressorState {
	if st == nil {
		return nil
	}
	return &V41CompressorState{KV: append([]float32(nil), st.KV...), Score: append([]float32(nil), st.Score...)}
}

// Emits reports whether token pos completes a group: (pos+1) mod r = 0
// (always for r = 1).
func (c *V41Compressor) Emits(pos int64) bool { return (pos+1)%int64(c.Ratio) == 0 }

// Project is the r = 2 projections a = Wkv·f32(x), b = Wgate·f32(x) (fp32 [d]
// each; F32Linear, k ascending).
func (c *V41Compressor) Project(a, b, x []float32) {
	if c.Ratio != 2 {
		panic("attention: V41Compressor.Project on an r = 1 compressor (it has no gate)")
	}
	F32Linear(a, x, c.Wkv, c.HeadDim, c.Dim)
	F32Linear(b, x, c.Wgate, c.HeadDim, c.Dim)
}

// Ingest stores (a, b) of token pos in slot pos mod r.
func (c *V41Compressor) Ingest(st *V41CompressorState, a, b []float32, pos int64) {
	d := c.HeadDim
	s := int(pos % int64(c.Ratio))
	copy(st.KV[s*d:(s+1)*d], a)
	copy(st.Score[s*d:(s+1)*d], b)
}

// Pool is the pooled row of a complete group, per channel c:
//
//	m = max_s score[s][c];  p_s = exp(score[s][c] − m) / Σ_s' exp(score[s'][c] − m)
//	dst[c] = bf16( Σ_s kv[s][c] · p_s )            fp32, s ascending
//
// (`(kv_state * score_state.softmax(dim=1)).sum(dim=1)` then `.to(bf16)`).
func (c *V41Compressor) Pool(dst []float32, st *V41CompressorState) {
	d, r := c.HeadDim, c.Ratio
	p := make([]float32, r)
	for ch := 0; ch < d; ch++ {
		m := float32(math.Inf(-1))
		for s := 0; s < r; s++ {
			m = max(m, st.Score[s*d+ch])
		}
		var sum float32
		for s := 0; s < r; s++ {
			p[s] = exp32(st.Score[s*d+ch] - m)
			sum += p[s]
		}
		var acc float32
		for s := 0; s < r; s++ {
			acc += float32(st.KV[s*d+ch] * (p[s] / sum))
		}
		dst[ch] = quant.BF16Round(acc)
	}
}

// Latent1 is the r = 1 latent of one token: RMSNorm_norm(BF16Lin(Wkv, x)), bf16 [d].
func (c *V41Compressor) Latent1(dst, x []float32) {
	if c.Ratio != 1 {
		panic("attention: V41Compressor.Latent1 on an r = 2 compressor")
	}
	raw := make([]float32, c.HeadDim)
	BF16Linear(raw, x, c.Wkv, c.HeadDim, c.Dim)
	RMSNorm(dst, raw, c.Norm, c.Eps)
}

// Normed is the last step of an r = 2 latent: RMSNorm_norm(pooled), bf16 [d].
func (c *V41Compressor) Normed(dst, pooled []float32) { RMSNorm(dst, pooled, c.Norm, c.Eps) }

// V41KVRow is the compressed-cache row j of a latent (Attention._compress_kv):
//
//	row = latent with RoPE(last 64 dims, pos j·r);  row = FQ4E4M3(row, 16) over all dims
//
// dst and latent are [d]; dst may alias latent.
func V41KVRow(dst, latent []float32, j int64, r int, rope *RopeTable) {
	if len(dst) != len(latent) || len(latent) < RopeDims {
		panic("attention: V41KVRow length mismatch")
	}
	copy(dst, latent)
	rope.ApplyRope(dst[len(dst)-RopeDims:], j*int64(r), false)
	V41FQ4KV(dst)
}

// V41FP8Weight is an FP8 E4M3 weight [Rows, Cols] with one UE8M0 scale per
// 32×32 block (V4.1's checkpoint layout, `fp8_block_size = 32`), and its exact
// fp32 dequantisation W[n,k] = E4M3(code) · 2^(scale[n/32, k/32] − 127).
type V41FP8Weight struct {
	Rows, Cols int
	Codes      []uint8   // [Rows*Cols]
	Scale      []uint8   // [ceil(Rows/32)*ceil(Cols/32)] UE8M0 bytes
	W          []float32 // [Rows*Cols]
}

// NewV41FP8Weight wraps checkpoint codes and 32×32 block scales and
// dequantises them exactly. It panics on a length mismatch.
func NewV41FP8Weight(codes, scale []uint8, rows, cols int) *V41FP8Weight {
	br, bc := (rows+V41Block-1)/V41Block, (cols+V41Block-1)/V41Block
	if rows <= 0 || cols <= 0 || len(codes) != rows*cols || len(scale) != br*bc {
		panic("attention: NewV41FP8Weight shape mismatch")
	}
	w := &V41FP8Weight{Rows: rows, Cols: cols, Codes: codes, Scale: scale, W: make([]float32, rows*cols)}
	for n := 0; n < rows; n++ {
		for k := 0; k < cols; k++ {
			w.W[n*cols+k] = quant.DecodeE4M3(codes[n*cols+k]) * quant.DecodeUE8M0(scale[(n/V41Block)*bc+k/V41Block])
		}
	}
	return w
}

// QuantizeV41FP8Weight turns fp32 values W [rows, cols] into a V41FP8Weight per
// 32×32 block as the checkpoint does: s = ceil2(f32(max(amax,1e-4)·f32(1/448))),
// code = E4M3(clamp(W/s, ±448)). Used for synthetic weights.
func QuantizeV41FP8Weight(W []float32, rows, cols int) *V41FP8Weight {
	if len(W) != rows*cols {
		panic("attention: QuantizeV41FP8Weight shape mismatch")
	}
	br, bc := (rows+V41Block-1)/V41Block, (cols+V41Block-1)/V41Block
	codes, scale := make([]uint8, rows*cols), make([]uint8, br*bc)
	for bi := 0; bi < br; bi++ {
		for bj := 0; bj < bc; bj++ {
			var amax float32
			for n := bi * V41Block; n < min(rows, (bi+1)*V41Block); n++ {
				for k := bj * V41Block; k < min(cols, (bj+1)*V41Block); k++ {
					amax = max(amax, abs32(W[n*cols+k]))
				}
			}
			e := quant.BlockScaleExp(quant.ScaleCeil2, amax, quant.E4M3Max, quant.FP8AmaxFloor)
			scale[bi*bc+bj] = uint8(e + 127)
			s := quant.Pow2(e)
			for n := bi * V41Block; n < min(rows, (bi+1)*V41Block); n++ {
				for k := bj * V41Block; k < min(cols, (bj+1)*V41Block); k++ {
					codes[n*cols+k] = quant.EncodeE4M3(min(max(W[n*cols+k]/s, -quant.E4M3Max), quant.E4M3Max))
				}
			}
		}
	}
	return NewV41FP8Weight(codes, scale, rows, cols)
}

// V41FP8Linear is V4.1's `linear()` with an FP8 weight: the bf16 activation x
// [Cols] is quantised per 32 columns (quant.QuantizeActFP8 with B = 32), then
//
//	y[n] = bf16( Σ_b ( Σ_{k∈b} qx[k]·W[n,k] ) · s_b )
//
// inner sums over one 32-block in fp32 (k ascending), the outer sum in a
// separate fp32 accumulator — V4's accumulation form (FP8Linear) with V4.1's
// block. [I]: the V4.1 fp8_gemm kernel's accumulation order was not read;
// a GPU's differs in the last fp32 bits before the bf16 rounding.
func V41FP8Linear(y, x []float32, w *V41FP8Weight) {
	if len(x) != w.Cols || len(y) != w.Rows || w.Cols%V41Block != 0 {
		panic("attention: V41FP8Linear shape mismatch")
	}
	qx := make([]float32, len(x))
	sx := make([]float32, len(x)/V41Block)
	quant.QuantizeActFP8(qx, sx, x, V41Block)
	for n := range y {
		row := w.W[n*w.Cols : (n+1)*w.Cols]
		var acc float32
		for b, s := range sx {
			var blk float32
			for k := b * V41Block; k < (b+1)*V41Block; k++ {
				blk += float32(qx[k] * row[k])
			}
			acc += float32(blk * s)
		}
		y[n] = quant.BF16Round(acc)
	}
}

// V41SparseAttn is sparse_attn for V4.1's index lists. V4.1 puts the −1 of a
// filling window FIRST (V41WindowIdx), so for p < 63 the first chunks of 64
// hold no key; SparseAttn's kernel order would then compute exp(−∞ − (−∞)) =
// NaN. This reference follows the definition of §7 (a −1 entry contributes
// nothing): leading chunks made only of −1 are skipped, which leaves the
// chunking of the rest — and every other bit — as SparseAttn computes it.
// [U] Whether the V4.1 TileLang kernel guards such a chunk was not read
// (spec §12 item 5); a GPU NaN there is reported as a divergence.
func V41SparseAttn(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) (lse []float32) {
	skip := 0
	for skip+AttnChunk <= len(idx) {
		empty := true
		for _, j := range idx[skip : skip+AttnChunk] {
			if j >= 0 {
				empty = false
				break
			}
		}
		if !empty {
			break
		}
		skip += AttnChunk
	}
	return SparseAttn(o, q, kv, d, idx[skip:], sink, scale)
}
