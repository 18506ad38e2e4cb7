package attention

import (
	"math"

	"sparsemla/quant"
)

// Compressor is one learned gated-pooling compressor of a ratio>0 layer
// (mirrors `Compressor` in the official model.py, spec §5). The same code serves
//
//   - the main compressor (d = 512, Rotate = false): its rows become compressed
//     KV rows kv_cache[128 + j], dims 0..447 on the FQ8 grid;
//   - the indexer's compressor (d = 128, Rotate = true): its rows become index
//     keys icache[j], Hadamard-rotated and on the FQ4 grid.
//
// Row j pools the tokens of group j (tokens j·r … j·r+r−1), per channel, with a
// softmax over learned scores:
//
//	a_t = Wkv · f32(x_t)                    fp32 [coff·d]   (cmp_a)
//	b_t = Wgate · f32(x_t)                  fp32 [coff·d]   (cmp_b, without ape)
//	s_t = b_t + ape[t mod r]                fp32            (what score_state stores)
//	row_j[c] = Σ_e softmax_e(s_e[c]) · a_e[c]
//
// With r = 4 the groups overlap ("coff = 2"): the first d channels of a token
// (its "A half") feed the NEXT group's row, the last d channels (its "B half")
// its own group's row, so each row pools 8 entries, 4 of them from the previous
// group. This smooths the boundary between compressed rows. With r = 128 there is
// no overlap (coff = 1) and each row pools the 128 tokens of its group.
//
// Wkv and Wgate are stored bf16 in the checkpoint and used as fp32; ape is fp32.
type Compressor struct {
	Ratio   int     // r: 4 (overlapping, coff = 2) or 128 (coff = 1)
	HeadDim int     // d: 512 (main) or 128 (indexer)
	Dim     int     // model dim: the width of the attention input x
	Rotate  bool    // indexer compressor: Hadamard + FQ4 on all dims instead of FQ8 on dims 0..d-65
	Eps     float32 // eps of compressor.norm (1e-6)

	Wkv   []float32 // compressor.wkv.weight   [coff·d, Dim]
	Wgate []float32 // compressor.wgate.weight [coff·d, Dim]
	Ape   []float32 // compressor.ape          [r, coff·d]
	Norm  []float32 // compressor.norm.weight  [d]

	// panels hold wkv and wgate instead of Wkv and Wgate after UsePanels
	// (the prepared path's only copy, bf16 for checkpoint weights)
	pkv, pgate *Panels
}

// UsePanels makes the packed projections wkv and wgate [coff·d, Dim] the
// compressor's only copy of its weights: Wkv and Wgate are dropped (nil),
// and Project (the reference loop) reads each row from the panels, widened
// to the same fp32 values, with the same sums (F32Linear's order). The
// panels must hold this compressor's weights (the caller packed them from
// Wkv and Wgate).
func (c *Compressor) UsePanels(wkv, wgate *Panels) {
	w := c.Width()
	if wkv.Rows != w || wkv.Cols != c.Dim || wgate.Rows != w || wgate.Cols != c.Dim {
		panic("attention: Compressor.UsePanels: the panels are not this compressor's shape")
	}
	c.Wkv, c.Wgate, c.pkv, c.pgate = nil, nil, wkv, wgate
}

// Panels returns the packed projections UsePanels gave the compressor (nil
// before).
func (c *Compressor) Panels() (wkv, wgate *Panels) { return c.pkv, c.pgate }

// Weights returns wkv and wgate [coff·d, Dim] row-major fp32: Wkv and
// Wgate, or new copies unpacked from the panels (UsePanels).
func (c *Compressor) Weights() (wkv, wgate []float32) {
	if c.pkv == nil {
		return c.Wkv, c.Wgate
	}
	return c.pkv.RowMajor(), c.pgate.RowMajor()
}

// CompressorState is the decode state of one compressor (kv_state and
// score_state of model.py, spec §2.2), both fp32 [coff·r, coff·d] row-major:
//
//	r = 4:   rows 0..3 = the previous group's tokens, rows 4..7 = the current
//	         group's tokens (row 4 + p mod 4 is written at step p)
//	r = 128: row p mod 128 is written at step p
//
// A fresh sequence starts from KV = 0 and Score = −∞ ([Compressor.NewState]).
type CompressorState struct {
	KV    []float32 // kv_state    [coff·r, coff·d]
	Score []float32 // score_state [coff·r, coff·d], ape already added
}

// Coff is 2 for the overlapping ratio-4 compressor and 1 otherwise.
func (c *Compressor) Coff() int {
	if c.Ratio == 4 {
		return 2
	}
	return 1
}

// Width is coff·d, the width of a_t, b_t and of a state row.
func (c *Compressor) Width() int { return c.Coff() * c.HeadDim }

// StateRows is coff·r, the number of rows of kv_state and score_state.
func (c *Compressor) StateRows() int { return c.Coff() * c.Ratio }

// check panics when the parameters do not have the shapes the struct documents.
func (c *Compressor) check() {
	if c.Ratio <= 0 || c.HeadDim <= 0 || c.Dim <= 0 {
		panic("attention: compressor has bad dimensions")
	}
	w := c.Width()
	proj := len(c.Wkv) == w*c.Dim && len(c.Wgate) == w*c.Dim
	if c.pkv != nil {
		proj = c.Wkv == nil && c.Wgate == nil && c.pkv.Rows == w && c.pkv.Cols == c.Dim && c.pgate.Rows == w && c.pgate.Cols == c.Dim
	}
	if !proj || len(c.Ape) != c.Ratio*w || len(c.Norm) != c.HeadDim {
		panic("attention: compressor weight shape mismatch")
	}
}

func (c *Compressor) checkState(st *CompressorState) {
	n := c.StateRows() * c.Width()
	if len(st.KV) != n || len(st.Score) != n {
		panic("attention: compressor state shape mismatch")
	}
}

// NewState returns the state of a fresh sequence: kv_state = 0, score_state = −∞
// (model.py initialises its buffers this way once and never clears them; a
// replay must start from these values, spec §2.2 and §9.12).
func (c *Compressor) NewState() *CompressorState {
	c.check()
	n := c.StateRows() * c.Width()
	st := &CompressorState{KV: make([]float32, n), Score: make([]float32, n)}
	for i := range st.Score {
		st.Score[i] = float32(math.Inf(-1))
	}
	return st
}

// Clone returns a deep copy of the state.
func (st *CompressorState) Clone() *CompressorState {
	return &CompressorState{
		KV:    append([]float32(nil), st.KV...),
		Score: append([]float32(nil), st.Score...),
	}
}

// Emits reports whether the token at position pos completes a group, i.e.
// whether the step at pos emits compressed row pos div r: (pos+1) mod r == 0.
func (c *Compressor) Emits(pos int64) bool { return (pos+1)%int64(c.Ratio) == 0 }

// Project computes the two fp32 projections of one token (cmp_a / cmp_b):
//
//	a = Wkv · f32(x)       [coff·d]
//	b = Wgate · f32(x)     [coff·d]   (without ape)
//
// x is the bf16 attention input [Dim] (held as fp32, so f32(x) is x itself).
// Each output is a plain fp32 dot product summed in ascending k (spec §3.2:
// fp32 weights, fp32 GEMM; the GPU's cuBLAS order differs in the last bits).
func (c *Compressor) Project(a, b, x []float32) {
	c.check()
	w := c.Width()
	if len(a) != w || len(b) != w || len(x) != c.Dim {
		panic("attention: compressor Project length mismatch")
	}
	if c.pkv != nil {
		// the same loop as F32Linear, each weight row widened from the panels
		row := make([]float32, c.Dim)
		for n := 0; n < w; n++ {
			c.pkv.Row(row, n)
			a[n] = dot(x, row)
			c.pgate.Row(row, n)
			b[n] = dot(x, row)
		}
		return
	}
	F32Linear(a, x, c.Wkv, w, c.Dim)
	F32Linear(b, x, c.Wgate, w, c.Dim)
}

// stateRow is the state row that token pos is written to: r + pos mod r for the
// overlapping r = 4 compressor (the "current group" half), pos mod r otherwise.
func (c *Compressor) stateRow(pos int64) int {
	i := int(pos % int64(c.Ratio))
	if c.Coff() == 2 {
		return c.Ratio + i
	}
	return i
}

// Ingest stores token pos in the state (the first half of model.py's decode
// branch):
//
//	kv_state[row]    = a
//	score_state[row] = b + ape[pos mod r]      (fp32 add)
//
// with row = 4 + pos mod 4 (r = 4) or pos mod 128 (r = 128). a and b are cmp_a
// and cmp_b [coff·d]. It does not pool or shift: see [Compressor.Pool] and
// [Compressor.Shift], or [Compressor.Advance] for the whole state update.
func (c *Compressor) Ingest(st *CompressorState, a, b []float32, pos int64) {
	c.check()
	c.checkState(st)
	w := c.Width()
	if len(a) != w || len(b) != w || pos < 0 {
		panic("attention: compressor Ingest length mismatch")
	}
	c.store(st, c.stateRow(pos), a, b, int(pos%int64(c.Ratio)))
}

// store writes kv_state[row] = a and score_state[row] = b + ape[i] (fp32 add).
func (c *Compressor) store(st *CompressorState, row int, a, b []float32, i int) {
	w := c.Width()
	ape := c.Ape[i*w : (i+1)*w]
	copy(st.KV[row*w:(row+1)*w], a)
	score := st.Score[row*w : (row+1)*w]
	for k := range score {
		score[k] = b[k] + ape[k]
	}
}

// Pool computes the pooled row from a state that holds a complete group
// (cmp_pooled, spec §5), rounded to bf16 before the norm as model.py does
// (`self.norm(kv.to(dtype))`):
//
//	r = 128: entries e = 0..127:  (kv_state[e][c],   score_state[e][c])
//	r = 4:   entries e = 0..3:    (kv_state[e][c],   score_state[e][c])     A half of the previous group
//	         entries e = 4..7:    (kv_state[e][d+c], score_state[e][d+c])   B half of the current group
//
//	m      = max_e s_e[c]
//	p_e    = exp(s_e[c] − m) / Σ_e' exp(s_e'[c] − m)
//	dst[c] = bf16( Σ_e a_e[c] · p_e )                      c = 0..d-1
//
// All fp32, sums over e ascending. Entries with score −∞ (the previous group of
// row 0) get weight 0. dst is [d]. st must be the state after [Compressor.Ingest]
// of the group's last token and before [Compressor.Shift].
func (c *Compressor) Pool(dst []float32, st *CompressorState) {
	c.check()
	c.checkState(st)
	d, w := c.HeadDim, c.Width()
	if len(dst) != d {
		panic("attention: compressor Pool length mismatch")
	}
	rows := c.StateRows()
	// col(e) is the channel offset of entry e's half: the B half (d..2d-1) for the
	// current group's rows of the overlapping compressor.
	col := func(e int) int {
		if c.Coff() == 2 && e >= c.Ratio {
			return d
		}
		return 0
	}
	p := make([]float32, rows) // softmax weights of one channel
	for ch := 0; ch < d; ch++ {
		m := float32(math.Inf(-1))
		for e := 0; e < rows; e++ {
			m = max(m, st.Score[e*w+col(e)+ch])
		}
		var sum float32
		for e := 0; e < rows; e++ {
			p[e] = exp32(st.Score[e*w+col(e)+ch] - m)
			sum += p[e]
		}
		var acc float32
		for e := 0; e < rows; e++ {
			acc += float32(st.KV[e*w+col(e)+ch] * (p[e] / sum))
		}
		dst[ch] = quant.BF16Round(acc)
	}
}

// Shift moves the current group into the "previous group" rows after an
// emission of the overlapping r = 4 compressor:
//
//	kv_state[0..3] = kv_state[4..7];  score_state[0..3] = score_state[4..7]
//
// Rows 4..7 keep their values (each is rewritten before it is read again). It is
// a no-op for r = 128.
func (c *Compressor) Shift(st *CompressorState) {
	c.checkState(st)
	if c.Coff() != 2 {
		return
	}
	half := c.Ratio * c.Width()
	copy(st.KV[:half], st.KV[half:])
	copy(st.Score[:half], st.Score[half:])
}

// Advance is the whole state update of one decode step (state after from state
// before): [Compressor.Ingest] of (a, b) at pos, then [Compressor.Shift] if pos
// completes a group. It returns whether the step emits row pos div r; when it
// does, the caller that needs the row must [Compressor.Pool] between the two,
// which [Compressor.Step] does.
func (c *Compressor) Advance(st *CompressorState, a, b []float32, pos int64) bool {
	c.Ingest(st, a, b, pos)
	if !c.Emits(pos) {
		return false
	}
	c.Shift(st)
	return true
}

// PoolAt is the teacher-forced form of cmp_pooled: the pooled row of the step at
// pos (which must complete a group) computed from the state BEFORE the step and
// the step's own (a, b). prev is not modified.
func (c *Compressor) PoolAt(dst []float32, prev *CompressorState, a, b []float32, pos int64) {
	if !c.Emits(pos) {
		panic("attention: compressor PoolAt at a position that emits no row")
	}
	st := prev.Clone()
	c.Ingest(st, a, b, pos)
	c.Pool(dst, st)
}

// Normed applies compressor.norm to the bf16 pooled row (cmp_normed):
// dst = RMSNorm(pooled, norm, eps), bf16 [d] (spec §3.1).
func (c *Compressor) Normed(dst, pooled []float32) {
	if len(dst) != c.HeadDim || len(pooled) != c.HeadDim {
		panic("attention: compressor Normed length mismatch")
	}
	RMSNorm(dst, pooled, c.Norm, c.Eps)
}

// Roped rotates the last 64 dims of the normed row at the position of the
// group's first token, j·r (cmp_roped; model.py uses freqs_cis[p+1−r] at the
// emission step p = j·r + r − 1, spec §3.6). Dims 0..d-65 are copied.
func (c *Compressor) Roped(dst, normed []float32, j int64, rope *RopeTable) {
	if len(dst) != c.HeadDim || len(normed) != c.HeadDim || j < 0 || c.HeadDim < RopeDims {
		panic("attention: compressor Roped length mismatch")
	}
	copy(dst, normed)
	rope.ApplyRope(dst[c.HeadDim-RopeDims:], j*int64(c.Ratio), false)
}

// Had is the indexer compressor's rotation (icmp_had): dst = Had(roped), the
// scaled 128-point Walsh–Hadamard transform of spec §3.5, bf16 [d]. The rotation
// spreads outliers over all dims before the FP4 rounding; it is orthonormal, so
// q·k is unchanged up to that rounding.
func (c *Compressor) Had(dst, roped []float32) {
	if !c.Rotate {
		panic("attention: compressor Had on a main (non-rotating) compressor")
	}
	if len(dst) != c.HeadDim || len(roped) != c.HeadDim {
		panic("attention: compressor Had length mismatch")
	}
	copy(dst, roped)
	quant.Hadamard(dst)
}

// Quantize is the last stage of a row (cmp_row / icmp_row):
//
//	main:    dst = roped with dims 0..d-65 ← FQ8(·, 64); the rope dims stay bf16
//	indexer: dst = FQ4(had, 32) over all d dims
//
// in is cmp_roped (main) or icmp_had (indexer); dst is [d].
func (c *Compressor) Quantize(dst, in []float32) {
	if len(dst) != c.HeadDim || len(in) != c.HeadDim || c.HeadDim < RopeDims {
		panic("attention: compressor Quantize length mismatch")
	}
	copy(dst, in)
	if c.Rotate {
		quant.FQ4(dst, 32)
		return
	}
	quant.FQ8(dst[:c.HeadDim-RopeDims], 64)
}

// CompressorStep holds every intermediate of one compressor decode step, named
// after the dump stages (prefix cmp_ for the main compressor, icmp_ for the
// indexer's). The emission fields are nil when the step emits no row.
type CompressorStep struct {
	A, B    []float32 // cmp_a, cmp_b: fp32 [coff·d]; B without ape
	Emitted bool      // (pos+1) mod r == 0
	Row     int64     // j = pos div r, the row emitted (valid when Emitted)
	Pooled  []float32 // cmp_pooled: bf16 [d]
	Normed  []float32 // cmp_normed: bf16 [d]
	Roped   []float32 // cmp_roped:  bf16 [d]
	Had     []float32 // icmp_had:   bf16 [d] (indexer compressor only)
	Out     []float32 // cmp_row / icmp_row: bf16 [d], the row written to the cache
}

// Step runs one decode step of the compressor on the bf16 attention input x
// [Dim] of the token at pos (model.py `Compressor.forward` with start_pos = pos):
// Project, Ingest, and if the token completes group j = pos div r, Pool, Shift
// and the row's Normed → Roped → (Had) → Quantize. st is updated in place to the
// state after the step. rope is the layer's table (compressed rows use position
// j·r).
func (c *Compressor) Step(st *CompressorState, x []float32, pos int64, rope *RopeTable) CompressorStep {
	w := c.Width()
	a, b := make([]float32, w), make([]float32, w)
	c.Project(a, b, x)
	return c.StepFrom(st, a, b, pos, rope)
}

// StepFrom is [Compressor.Step] from the token's projections instead of x: a and
// b are cmp_a and cmp_b [coff·d] (b without ape), e.g. the GPU's own values
// when a replay separates the fp32 GEMMs from the state machine. The returned
// step holds a and b (not copied).
func (c *Compressor) StepFrom(st *CompressorState, a, b []float32, pos int64, rope *RopeTable) CompressorStep {
	out := CompressorStep{A: a, B: b}
	c.Ingest(st, a, b, pos)
	if !c.Emits(pos) {
		return out
	}
	out.Emitted = true
	out.Row = pos / int64(c.Ratio)
	out.Pooled = make([]float32, c.HeadDim)
	c.Pool(out.Pooled, st)
	c.Shift(st)
	c.finish(&out, rope)
	return out
}

// finish computes the per-row stages after the pool: norm, RoPE at Row·r,
// (Hadamard), quantisation.
func (c *Compressor) finish(s *CompressorStep, rope *RopeTable) {
	d := c.HeadDim
	s.Normed = make([]float32, d)
	c.Normed(s.Normed, s.Pooled)
	s.Roped = make([]float32, d)
	c.Roped(s.Roped, s.Normed, s.Row, rope)
	in := s.Roped
	if c.Rotate {
		s.Had = make([]float32, d)
		c.Had(s.Had, s.Roped)
		in = s.Had
	}
	s.Out = make([]float32, d)
	c.Quantize(s.Out, in)
}

// Prefill is the prefill hand-off of spec §2.4 (model.py's start_pos = 0
// branch): given the projections of the S prompt tokens, a and b fp32
// [S, coff·d] (b without ape, as [Compressor.Project] returns them), it returns
// a fresh state as it stands after the prefill and the rows of every complete
// group, rows[j] for j = 0 .. S div r − 1 (each with Pooled … Out filled; A and
// B are left nil). After the prefill:
//
//	rem = S mod r, cutoff = S − rem
//	state rows off+i (i < rem, off = r if r = 4 else 0) hold (a, b+ape[i]) of token cutoff+i
//	r = 4 and cutoff ≥ 4: rows 0..3 hold (a, b+ape) of tokens cutoff−4 … cutoff−1
//
// Each row pools exactly the entries decode would: group j's tokens (B half for
// r = 4) and, for r = 4, the A half of group j−1 (none for j = 0).
func (c *Compressor) Prefill(a, b []float32, S int, rope *RopeTable) (*CompressorState, []CompressorStep) {
	c.check()
	w, r := c.Width(), c.Ratio
	if S < 0 || len(a) != S*w || len(b) != S*w {
		panic("attention: compressor Prefill length mismatch")
	}
	// Group j is pooled from a scratch state laid out exactly as decode's state at
	// the emission step, so prefill and decode share one pooling definition.
	var rows []CompressorStep
	for j := 0; j < S/r; j++ {
		scratch := c.NewState()
		if c.Coff() == 2 && j > 0 {
			for i := 0; i < r; i++ { // the previous group's tokens, rows 0..3
				t := (j-1)*r + i
				c.store(scratch, i, a[t*w:(t+1)*w], b[t*w:(t+1)*w], i)
			}
		}
		for t := j * r; t < (j+1)*r; t++ {
			c.Ingest(scratch, a[t*w:(t+1)*w], b[t*w:(t+1)*w], int64(t))
		}
		s := CompressorStep{Emitted: true, Row: int64(j), Pooled: make([]float32, c.HeadDim)}
		c.Pool(s.Pooled, scratch)
		c.finish(&s, rope)
		rows = append(rows, s)
	}
	st := c.NewState()
	rem := S % r
	cutoff := S - rem
	if c.Coff() == 2 && cutoff >= r {
		for i := 0; i < r; i++ { // the last complete group, rows 0..3
			t := cutoff - r + i
			c.store(st, i, a[t*w:(t+1)*w], b[t*w:(t+1)*w], i)
		}
	}
	for t := cutoff; t < S; t++ {
		c.Ingest(st, a[t*w:(t+1)*w], b[t*w:(t+1)*w], int64(t))
	}
	return st, rows
}
