package head

import (
	"fmt"
	"math"

	"sparsemla/attention"
	"sparsemla/mhc"
)

// Embed is ParallelEmbedding.forward on one rank (F.embedding): e [dim]
// receives row tok of the table [vocab][dim] (bf16 values). A token id
// outside the vocabulary is an error (it comes from a dump).
func Embed(e, table []float32, tok int64) error {
	dim := len(e)
	if dim == 0 || len(table)%dim != 0 {
		panic("head: Embed shape mismatch")
	}
	vocab := int64(len(table) / dim)
	if tok < 0 || tok >= vocab {
		return fmt.Errorf("head: token id %d outside the vocabulary [0, %d)", tok, vocab)
	}
	copy(e, table[tok*int64(dim):(tok+1)*int64(dim)])
	return nil
}

// Embedding is the token embedding embed.weight [vocab][dim] as the step
// reads it: one row per token. Table holds a whole table; a large checkpoint
// may read rows on demand instead. Row must be safe for concurrent use.
type Embedding interface {
	Row(e []float32, tok int64) error
}

// Table is an embedding table held in memory: W [vocab][Dim] (bf16 values).
type Table struct {
	Dim int
	W   []float32
}

// Row implements Embedding with Embed.
func (t *Table) Row(e []float32, tok int64) error {
	if len(e) != t.Dim {
		return fmt.Errorf("head: embedding row of %d values, the table has dim %d", len(e), t.Dim)
	}
	return Embed(e, t.W, tok)
}

// BF16Table is an embedding table held in its checkpoint dtype: W
// [vocab][Dim] bf16 bit patterns (2 bytes a value instead of 4; Row widens
// a row exactly: the same values as a Table of the same weights).
type BF16Table struct {
	Dim int
	W   []uint16
}

// Row implements Embedding.
func (t *BF16Table) Row(e []float32, tok int64) error {
	if len(e) != t.Dim {
		return fmt.Errorf("head: embedding row of %d values, the table has dim %d", len(e), t.Dim)
	}
	if t.Dim == 0 || len(t.W)%t.Dim != 0 {
		panic("head: BF16Table shape mismatch")
	}
	vocab := int64(len(t.W) / t.Dim)
	if tok < 0 || tok >= vocab {
		return fmt.Errorf("head: token id %d outside the vocabulary [0, %d)", tok, vocab)
	}
	for i, b := range t.W[tok*int64(t.Dim) : (tok+1)*int64(t.Dim)] {
		e[i] = math.Float32frombits(uint32(b) << 16)
	}
	return nil
}

// Head holds the parameters of ParallelHead and the model's head collapse
// (Transformer.hc_head_*, norm, head), all fp32 but head.weight, which is
// Weight (fp32) or only Panels (bf16 storage, the same values).
type Head struct {
	Mult    int       // hc_mult
	Dim     int       // model width
	Vocab   int       // vocab_size
	HCFn    []float32 // hc_head_fn [hc][hc*dim]
	HCBase  []float32 // hc_head_base [hc]
	HCScale float32   // hc_head_scale[0]
	Norm    []float32 // norm.weight [dim]
	Weight  []float32 // head.weight [vocab][dim] (bf16 values, used as fp32); nil when Panels holds it
	// Panels is head.weight packed for attention's panel GEMV (bf16 storage
	// for bf16 values: half of Weight's memory). With Weight nil, Logits
	// runs Panels.Dot, which is F32Linear bit for bit.
	Panels  *attention.Panels
	NormEps float32 // norm_eps
	HCEps   float32 // hc_eps
}

// Check panics with a "head: …" message when the parameter shapes disagree.
func (hd *Head) Check() {
	if hd.Mult <= 0 || hd.Dim <= 0 || hd.Vocab <= 0 || len(hd.HCFn) != hd.Mult*hd.Mult*hd.Dim ||
		len(hd.HCBase) != hd.Mult || len(hd.Norm) != hd.Dim || !hd.weightShape() {
		panic("head: Head parameter shapes do not match hc_mult, dim and vocab")
	}
}

func (hd *Head) weightShape() bool {
	if hd.Weight == nil && hd.Panels != nil {
		return hd.Panels.Rows == hd.Vocab && hd.Panels.Cols == hd.Dim
	}
	return len(hd.Weight) == hd.Vocab*hd.Dim
}

// Output is one step's head: every intermediate and the logits.
type Output struct {
	Mixes  []float32 // [hc] (hc_head_fn · hf) · rsqrt(mean(hf²) + norm_eps)
	Pre    []float32 // [hc] sigmoid(mixes · scale + base) + hc_eps
	X      []float32 // [dim] bf16 collapse (hc_head output)
	Normed []float32 // [dim] bf16 final norm output
	Logits []float32 // [vocab] fp32
	Token  int       // argmax(Logits), lowest id among equal maxima
}

// Forward is ParallelHead.forward (R-M:773-782) for one token: h [hc][dim]
// (bf16 values, the last block's output streams) →
//
//	mixes  = mhc.Mixes(h, hc_head_fn)
//	pre    = mhc.HeadPre(mixes, hc_head_base, hc_head_scale)
//	x      = mhc.Collapse(h, pre)
//	x      = RMSNorm(x, norm)
//	logits = Logits(x)
func (hd *Head) Forward(h []float32) Output {
	hd.Check()
	if len(h) != hd.Mult*hd.Dim {
		panic("head: Forward input is not [hc][dim]")
	}
	o := Output{
		Mixes: make([]float32, hd.Mult), Pre: make([]float32, hd.Mult),
		X: make([]float32, hd.Dim), Normed: make([]float32, hd.Dim),
	}
	mhc.Mixes(o.Mixes, h, hd.HCFn, hd.NormEps)
	mhc.HeadPre(o.Pre, o.Mixes, hd.HCBase, hd.HCScale, hd.HCEps)
	mhc.Collapse(o.X, h, o.Pre)
	attention.RMSNorm(o.Normed, o.X, hd.Norm, hd.NormEps)
	o.Logits = hd.Logits(o.Normed)
	o.Token = Greedy(o.Logits)
	return o
}

// Logits is ParallelHead.get_logits (R-M:766-767): the fp32 GEMV
//
//	logits[v] = Σ_i f32(x[i]) · head[v][i]      fp32, i ascending
//
// of the normed x [dim] (bf16 values) with head.weight [vocab][dim]
// (F32Linear on Weight; Panels.Dot, the same bits, when only Panels holds it).
func (hd *Head) Logits(x []float32) []float32 {
	l := make([]float32, hd.Vocab)
	if hd.Weight == nil && hd.Panels != nil {
		hd.Panels.Dot(l, x)
		return l
	}
	attention.F32Linear(l, x, hd.Weight, hd.Vocab, hd.Dim)
	return l
}

// Greedy is the greedy token: the index of the largest logit, the lowest
// index among equal maxima (torch.argmax returns the first); NaN counts as
// the largest (torch.argmax on CUDA returns the first NaN). It returns -1
// for an empty slice.
func Greedy(logits []float32) int {
	best := -1
	for v, l := range logits {
		switch {
		case best < 0:
			best = v
		case math.IsNaN(float64(logits[best])):
		case l != l || l > logits[best]:
			best = v
		}
	}
	return best
}
