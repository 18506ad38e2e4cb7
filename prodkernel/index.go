package prodkernel

import (
	"fmt"
	"math"
	"slices"

	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/quant"
	"sparsemla/replay"
)

// IndexUnit is one (decode step, CSA layer) the indexer scoring kernels ran
// on: Tc compressed rows (Tc = (p+1) div 4 > 0).
type IndexUnit struct {
	Step  int64
	Layer int
	Tc    int
}

// IndexUnits lists the units of a kernels-index run under prefix ("iscore"
// or "iscore_fault"), in step then layer order, Tc from the reference's
// index_score.
func IndexUnits(src replay.Source, r *Run, prefix string) ([]IndexUnit, error) {
	var us []IndexUnit
	for _, p := range src.Steps() {
		for _, l := range src.Layers() {
			if !r.Has(fmt.Sprintf("%s.p%d.L%d.sglang_logits", prefix, p, l)) {
				continue
			}
			s, ok, err := src.Stage(p, l, "index_score")
			if err != nil || !ok {
				return nil, fmt.Errorf("prodkernel: step %d layer %d: no index_score (%v)", p, l, err)
			}
			us = append(us, IndexUnit{Step: p, Layer: l, Tc: len(s.F)})
		}
	}
	if len(us) == 0 {
		return nil, fmt.Errorf("prodkernel: %s: no %s units", r.Path, prefix)
	}
	return us, nil
}

// IndexScoreTol is the bound on |kernel − reference| for the score of each
// compressed row j of one unit:
//
//	S_j   = Σ_h |iw_h| · max(index_qk[h][j], 0)
//	tol_j = 2^-8·(1+2^-7)·S_j + 2^-8·|index_score_j| + 2^-20·max_j S_j
//
// The reference rounds each dot product d_hj to bf16, each ReLU·weight
// product to bf16 and the fp32 head sum to bf16 (spec §6; unit roundoff 2^-9
// each); a kernel fed the same q, k and weights exactly (kernels-index's
// inputs, checked by checkIndexInputs) computes all of it in fp32. To first
// order the reference's distance from the exact score is ≤ 2·2^-9·S_j +
// 2^-9·|score_j|; tol_j doubles the last term and adds the second-order and
// fp32 terms with room (docs/production-kernels.md has the measured ratio).
func IndexScoreTol(qk []float32, iw []float32, score []float32) []float64 {
	tc := len(score)
	s := indexMagnitude(qk, iw, tc)
	var smax float64
	for j := range tc {
		smax = math.Max(smax, s[j])
	}
	tol := make([]float64, tc)
	for j := range tc {
		tol[j] = 0x1p-8*(1+0x1p-7)*s[j] + 0x1p-8*math.Abs(float64(score[j])) + 0x1p-20*smax
	}
	return tol
}

// indexMagnitude is S_j = Σ_h |iw_h| · max(index_qk[h][j], 0) per row.
func indexMagnitude(qk, iw []float32, tc int) []float64 {
	s := make([]float64, tc)
	for j := range tc {
		for h := range iw {
			s[j] += math.Abs(float64(iw[h])) * math.Max(float64(qk[h*tc+j]), 0)
		}
	}
	return s
}

// indexCase is one unit to check: its tensor prefix in the run, its name in
// messages, the reference side.
type indexCase struct {
	base, unit string
	tc         int
	ref        *indexRef
	inputs     bool // the run stored the fed inputs and the reference is the golden's
}

func goldenIndexCases(src replay.Source, r *Run, prefix string, units []IndexUnit) ([]indexCase, error) {
	var cs []indexCase
	for _, u := range units {
		ref, err := loadIndexRef(src, u)
		if err != nil {
			return nil, err
		}
		base := fmt.Sprintf("%s.p%d.L%d.", prefix, u.Step, u.Layer)
		cs = append(cs, indexCase{base: base, unit: fmt.Sprintf("p%d L%d", u.Step, u.Layer), tc: u.Tc, ref: ref, inputs: r.Has(base + "q_fp8")})
	}
	return cs, nil
}

// IndexSynthCases are the synthetic units of kernels-index-synth (names
// s0, s1, …, as the harness's INDEX_SYNTH).
var IndexSynthCases = []string{"s0", "s1", "s2", "s3"}

// synthIndexCases builds the reference side of each synthetic unit from
// what the kernels were fed: iq = decode(q_fp8)·q_scale, icache =
// decode(k_fp8)·k_scale (both on the bf16 grid), iw (stored bf16; the fed
// weights must be iw·q_scale), then the reference's index_qk, index_score
// (indexer.IndexQK, IndexScore) and index_topk (indexer.TopK, k).
func synthIndexCases(r *Run, k int) ([]indexCase, error) {
	var cs []indexCase
	for _, name := range IndexSynthCases {
		base := "isynth." + name + "."
		qc, qs, err := r.Bytes(base + "q_fp8")
		if err != nil {
			return nil, err
		}
		kc, ks, err := r.Bytes(base + "k_fp8")
		if err != nil {
			return nil, err
		}
		var t [4]engine.Tensor
		for i, n := range []string{"q_scale", "k_scale", "weights", "iw"} {
			if t[i], err = r.Floats(base + n); err != nil {
				return nil, err
			}
		}
		if len(qs) != 2 || len(ks) != 2 || qs[1] != ks[1] || qs[1] == 0 || len(t[0].F) != qs[0] || len(t[1].F) != ks[0] || len(t[2].F) != qs[0] || len(t[3].F) != qs[0] {
			return nil, fmt.Errorf("prodkernel: %s: %s: q %v, k %v, scales %d/%d, weights %d, iw %d disagree", r.Path, base, qs, ks, len(t[0].F), len(t[1].F), len(t[2].F), len(t[3].F))
		}
		h, d, tc := qs[0], qs[1], ks[0]
		dec := func(codes []byte, scale []float32) []float32 {
			v := make([]float32, len(codes))
			for i, c := range codes {
				v[i] = quant.DecodeE4M3(c) * scale[i/d]
			}
			return v
		}
		ref := &indexRef{iq: engine.Tensor{Shape: []int{h, d}, F: dec(qc, t[0].F)}, icache: engine.Tensor{Shape: []int{tc, d}, F: dec(kc, t[1].F)}, iw: t[3]}
		for i := range h {
			if t[2].F[i] != t[3].F[i]*t[0].F[i] {
				return nil, fmt.Errorf("prodkernel: %s: %s: fed weight %d = %g, iw·q_scale = %g", r.Path, base, i, t[2].F[i], t[3].F[i]*t[0].F[i])
			}
		}
		ref.qk = engine.Tensor{Shape: []int{h, tc}, F: make([]float32, h*tc)}
		indexer.IndexQK(ref.qk.F, ref.iq.F, ref.icache.F, h, d)
		ref.score = engine.Tensor{Shape: []int{tc}, F: make([]float32, tc)}
		indexer.IndexScore(ref.score.F, ref.qk.F, ref.iw.F)
		ref.topk, _ = indexer.TopK(ref.score.F, min(k, tc))
		ref.tol = IndexScoreTol(ref.qk.F, ref.iw.F, ref.score.F)
		cs = append(cs, indexCase{base: base, unit: name, tc: tc, ref: ref})
	}
	return cs, nil
}

// indexRef is the reference side of one unit.
type indexRef struct {
	score, qk, iw, iq, icache engine.Tensor
	tol                       []float64
	topk                      []int64 // index_topk: rows, before the caller's + window
}

func loadIndexRef(src replay.Source, u IndexUnit) (*indexRef, error) {
	ref := &indexRef{}
	for _, x := range []struct {
		name string
		t    *engine.Tensor
	}{{"index_score", &ref.score}, {"index_qk", &ref.qk}, {"iw", &ref.iw}, {"iq", &ref.iq}, {"icache", &ref.icache}} {
		t, ok, err := src.Stage(u.Step, u.Layer, x.name)
		if err != nil || !ok {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no %s (%v)", u.Step, u.Layer, x.name, err)
		}
		*x.t = t
	}
	t, ok, err := src.Stage(u.Step, u.Layer, "index_topk")
	if err != nil || !ok {
		return nil, fmt.Errorf("prodkernel: step %d layer %d: no index_topk (%v)", u.Step, u.Layer, err)
	}
	ref.topk = t.I
	h := len(ref.iw.F)
	if h == 0 || len(ref.iq.F) == 0 || len(ref.score.F) != u.Tc || len(ref.qk.F) != h*u.Tc || len(ref.iq.F)%max(h, 1) != 0 || len(ref.icache.F) < u.Tc*(len(ref.iq.F)/max(h, 1)) {
		return nil, fmt.Errorf("prodkernel: step %d layer %d: index_score %v, index_qk %v, iw %v, iq %v, icache %v disagree", u.Step, u.Layer, ref.score.Shape, ref.qk.Shape, ref.iw.Shape, ref.iq.Shape, ref.icache.Shape)
	}
	ref.tol = IndexScoreTol(ref.qk.F, ref.iw.F, ref.score.F)
	return ref, nil
}

// IndexCheck is the result of holding the indexer scoring kernels' logits of
// every unit against the reference's index_score.
type IndexCheck struct {
	Kernel string
	Units  int
	// Inputs: the E4M3 codes and scales the kernel was fed decode exactly to
	// the reference's iq and icache rows, its weights to iw · q scale.
	Inputs, InputsExact int
	Rows, Within        int // rows < Tc compared, and those within IndexScoreTol
	// Tail: positions ≥ Tc of the kernel's logits holding the engine's fill
	// (SGLang 0, vLLM −inf), of TailN.
	TailN, Tail int
	Ratio       Dist // |kernel − reference| / tol_j
	Abs         Dist // |kernel − reference|
	// F32Exact: rows whose kernel score equals the fp32-scorer form
	// (indexer.IndexQKF32 + IndexScoreF32 over iq, icache, iw: no bf16
	// rounding anywhere) bit for bit; F32Rel the largest |kernel − fp32
	// form| / S_j (S_j = Σ_h |iw_h|·max(index_qk, 0), the magnitude the
	// summation order acts on).
	F32Exact int
	F32Rel   float64
	ULP      Dist // |kernel − reference| in bf16 ulps of the reference score
	First    []string
}

// Agrees says whether the inputs were exact, every score is within
// tolerance and every tail position holds the fill.
func (c *IndexCheck) Agrees() bool {
	return c.Rows > 0 && c.Within == c.Rows && c.InputsExact == c.Inputs && c.Tail == c.TailN
}

func (c *IndexCheck) mismatch(format string, a ...any) {
	if len(c.First) < 5 {
		c.First = append(c.First, fmt.Sprintf(format, a...))
	}
}

func (c *IndexCheck) String() string {
	s := fmt.Sprintf("%s: %d units, inputs exact %d/%d, scores within tolerance %d/%d, tail fill %d/%d; |err|/tol %v; |err| %v; bf16 ulps %v; fp32 form bit-exact %d/%d (max |diff|/S %.3g)",
		c.Kernel, c.Units, c.InputsExact, c.Inputs, c.Within, c.Rows, c.Tail, c.TailN, c.Ratio, c.Abs, c.ULP, c.F32Exact, c.Rows, c.F32Rel)
	for _, f := range c.First {
		s += "\n  " + f
	}
	return s
}

// checkIndexInputs checks one unit's fed inputs: decode(q_fp8)·q_scale = iq,
// decode(k_fp8)·k_scale = icache[:Tc], weights = iw · q_scale, bit for bit.
func checkIndexInputs(c *IndexCheck, r *Run, base, unit string, tc int, ref *indexRef) error {
	h := len(ref.iw.F)
	d := len(ref.iq.F) / h
	qc, _, err := r.Bytes(base + "q_fp8")
	if err != nil {
		return err
	}
	kc, _, err := r.Bytes(base + "k_fp8")
	if err != nil {
		return err
	}
	var sc [3]engine.Tensor
	for i, n := range []string{"q_scale", "k_scale", "weights"} {
		if sc[i], err = r.Floats(base + n); err != nil {
			return err
		}
	}
	if len(qc) != h*d || len(kc) != tc*d || len(sc[0].F) != h || len(sc[1].F) != tc || len(sc[2].F) != h {
		return fmt.Errorf("prodkernel: %s: %s inputs: q %d, k %d codes, scales %d/%d, weights %d for %d heads × %d, Tc %d", r.Path, base, len(qc), len(kc), len(sc[0].F), len(sc[1].F), len(sc[2].F), h, d, tc)
	}
	exact := func(codes []byte, scale []float32, want []float32, what string) {
		c.Inputs++
		for i, code := range codes {
			if quant.DecodeE4M3(code)*scale[i/d] != want[i] {
				c.mismatch("%s: fed %s element %d decodes to %g, reference %g", unit, what, i, quant.DecodeE4M3(code)*scale[i/d], want[i])
				return
			}
		}
		c.InputsExact++
	}
	exact(qc, sc[0].F, ref.iq.F, "q")
	exact(kc, sc[1].F, ref.icache.F[:tc*d], "k")
	c.Inputs++
	for i := range h {
		if sc[2].F[i] != ref.iw.F[i]*sc[0].F[i] {
			c.mismatch("%s: fed weight %d = %g, want iw·q_scale = %g", unit, i, sc[2].F[i], ref.iw.F[i]*sc[0].F[i])
			return nil
		}
	}
	c.InputsExact++
	return nil
}

// CheckIndexScores holds a scoring kernel's logits (name: "sglang_logits" or
// "vllm_logits") at every unit against the reference's index_score under
// IndexScoreTol, checks the tail positions ≥ Tc hold fill, and the fed
// inputs where the run stored them (checkIndexInputs). A row outside tolerance is named with its
// kernel/reference ratio; a power of two there is what a wrong scale (a K
// row's, or the q scale folded twice or not at all) gives.
func CheckIndexScores(src replay.Source, r *Run, prefix, name string, fill float32, units []IndexUnit) (*IndexCheck, error) {
	cs, err := goldenIndexCases(src, r, prefix, units)
	if err != nil {
		return nil, err
	}
	return checkIndexScores(r, name, fill, cs)
}

// CheckIndexSynthScores is CheckIndexScores on the synthetic units of
// kernels-index-synth, the reference computed from the fed inputs
// (synthIndexCases).
func CheckIndexSynthScores(r *Run, name string, fill float32) (*IndexCheck, error) {
	cs, err := synthIndexCases(r, 512)
	if err != nil {
		return nil, err
	}
	return checkIndexScores(r, name, fill, cs)
}

func checkIndexScores(r *Run, name string, fill float32, cs []indexCase) (*IndexCheck, error) {
	c := &IndexCheck{Kernel: name, Units: len(cs)}
	var ratio, abs, ulp []float64
	for _, ic := range cs {
		base, ref, tc := ic.base, ic.ref, ic.tc
		if ic.inputs {
			if err := checkIndexInputs(c, r, base, ic.unit, tc, ref); err != nil {
				return nil, err
			}
		}
		lg, err := r.Floats(base + name)
		if err != nil {
			return nil, err
		}
		if len(lg.F) < tc {
			return nil, fmt.Errorf("prodkernel: %s: %s%s has %d positions for Tc %d", r.Path, base, name, len(lg.F), tc)
		}
		h := len(ref.iw.F)
		d := len(ref.iq.F) / h
		qk32 := make([]float32, h*tc)
		indexer.IndexQKF32(qk32, ref.iq.F, ref.icache.F[:tc*d], h, d)
		f32 := make([]float32, tc)
		indexer.IndexScoreF32(f32, qk32, ref.iw.F)
		mag := indexMagnitude(ref.qk.F, ref.iw.F, tc)
		for j := range tc {
			if lg.F[j] == f32[j] {
				c.F32Exact++
			} else if mag[j] > 0 {
				c.F32Rel = math.Max(c.F32Rel, math.Abs(float64(lg.F[j]-f32[j]))/mag[j])
			} else {
				c.F32Rel = math.Inf(1)
			}
			k, want := float64(lg.F[j]), float64(ref.score.F[j])
			e := math.Abs(k - want)
			c.Rows++
			ratio = append(ratio, e/ref.tol[j])
			abs = append(abs, e)
			ulp = append(ulp, e/bf16ULP(ref.score.F[j]))
			if e <= ref.tol[j] {
				c.Within++
				continue
			}
			c.mismatch("%s row %d: kernel score %g, reference %g (×%.4g), |err| %.3g > tol %.3g%s", ic.unit, j, k, want, k/want, e, ref.tol[j], scaleHint(k, want))
		}
		for j := tc; j < len(lg.F); j++ {
			c.TailN++
			if v := lg.F[j]; v == fill || (math.IsInf(float64(fill), -1) && math.IsInf(float64(v), -1)) {
				c.Tail++
			} else {
				c.mismatch("%s position %d ≥ Tc %d: kernel logit %g, want the fill %g", ic.unit, j, tc, v, fill)
			}
		}
	}
	c.Ratio, c.Abs, c.ULP = newDist(ratio), newDist(abs), newDist(ulp)
	return c, nil
}

// scaleHint names a kernel/reference ratio that is a power of two.
func scaleHint(k, want float64) string {
	if want == 0 || k == 0 {
		return ""
	}
	q := k / want
	e := math.Round(math.Log2(math.Abs(q)))
	if e != 0 && math.Abs(q/math.Exp2(e)-1) < 0x1p-6 {
		return fmt.Sprintf(": the score scaled by 2^%d, as by a scale %d exponent(s) off (that row's K scale)", int(e), int(e))
	}
	return ""
}

// bf16ULP is the bf16 ulp at |f| (the smallest normal's for 0).
func bf16ULP(f float32) float64 {
	a := math.Abs(float64(f))
	if a < 0x1p-126 {
		return 0x1p-133
	}
	_, e := math.Frexp(a)
	return math.Exp2(float64(e - 8))
}

// TopKCheck is the result of holding a top-k kernel's index lists against
// the reference's selection, as sets.
type TopKCheck struct {
	Kernel string
	K      int
	Units  int
	// SameSet: units whose set is the reference's; TieSwap: units whose set
	// differs only in rows tied with the reference's k-th score (within the
	// score tolerance of both); Agree = SameSet + TieSwap when nothing else
	// failed.
	SameSet, TieSwap, Agree int
	// PagesChecked / PagesEqual: SGLang's page-index output, physical page
	// << 6 | row in page, against the page table it was given.
	PagesChecked, PagesEqual int
	// Replay: indexer.CompareSelection's verdicts (exact bf16 ties only, as
	// the replay judges a GPU's index_topk) over the reference's scores.
	Replay [3]int // Same, Tie, Diverged
	// ReplayFirst: the first Diverged verdict's reason.
	ReplayFirst string
	First       []string
}

func (c *TopKCheck) mismatch(format string, a ...any) {
	if len(c.First) < 5 {
		c.First = append(c.First, fmt.Sprintf(format, a...))
	}
}

// Agrees says whether every unit's list is a valid top-k and matches the
// reference up to boundary ties.
func (c *TopKCheck) Agrees() bool {
	return c.Units > 0 && c.Agree == c.Units && c.PagesEqual == c.PagesChecked
}

func (c *TopKCheck) String() string {
	s := fmt.Sprintf("%s (k %d): %d units, %d same set, %d differing only in boundary ties, %d agree; pages %d/%d; replay's exact-tie verdicts same %d, tie %d, diverged %d",
		c.Kernel, c.K, c.Units, c.SameSet, c.TieSwap, c.Agree, c.PagesEqual, c.PagesChecked, c.Replay[0], c.Replay[1], c.Replay[2])
	if c.ReplayFirst != "" {
		s += " (" + c.ReplayFirst + ")"
	}
	for _, f := range c.First {
		s += "\n  " + f
	}
	return s
}

// CheckIndexTopK holds a top-k kernel's list (name, e.g. "sglang_topk16.raw"
// or "vllm_topk16", k entries, −1 for none) at every unit, given the logits
// it selected from (scores, e.g. "sglang_logits"):
//
//  1. its shape: min(k, Tc) distinct rows in [0, Tc), the other entries −1;
//  2. a top-k of the kernel's own logits: no unselected row scores above a
//     selected one (equal scores may go either way); a violation is named,
//     and a selected row next to a better unselected one as an index off by
//     one;
//  3. against the reference (index_topk, or every row when k ≥ Tc): the
//     rows in one set only must all lie within the score tolerance of the
//     reference's k-th score (a boundary tie, spec §9.6).
//
// pages, when not empty, names SGLang's page-index output, checked exactly.
func CheckIndexTopK(src replay.Source, r *Run, prefix, name, scores, pages string, k int, units []IndexUnit) (*TopKCheck, error) {
	cs, err := goldenIndexCases(src, r, prefix, units)
	if err != nil {
		return nil, err
	}
	return checkIndexTopK(r, name, scores, pages, k, cs)
}

// CheckIndexSynthTopK is CheckIndexTopK on the synthetic units (k = 512),
// the reference's selection indexer.TopK of its own scores.
func CheckIndexSynthTopK(r *Run, name, scores, pages string) (*TopKCheck, error) {
	cs, err := synthIndexCases(r, 512)
	if err != nil {
		return nil, err
	}
	return checkIndexTopK(r, name, scores, pages, 512, cs)
}

func checkIndexTopK(r *Run, name, scores, pages string, k int, cs []indexCase) (*TopKCheck, error) {
	c := &TopKCheck{Kernel: name, K: k, Units: len(cs)}
	for _, ic := range cs {
		base, ref := ic.base, ic.ref
		tc := ic.tc
		sel, err := r.Ints(base + name)
		if err != nil {
			return nil, err
		}
		lg, err := r.Floats(base + scores)
		if err != nil {
			return nil, err
		}
		if len(sel) != k || len(lg.F) < tc {
			return nil, fmt.Errorf("prodkernel: %s: %s%s has %d entries (want %d), %s %d for Tc %d", r.Path, base, name, len(sel), k, scores, len(lg.F), tc)
		}
		unit := ic.unit
		if pages != "" {
			if ok, err := checkTopKPages(c, r, base, pages, unit, sel); err != nil {
				return nil, err
			} else if !ok {
				continue
			}
		}
		in := make([]bool, tc)
		n, bad := 0, false
		for i, v := range sel {
			switch {
			case v == -1:
			case v < 0 || v >= int64(tc) || in[v]:
				c.mismatch("%s: entry %d = %d is not a new row in [0, %d)", unit, i, v, tc)
				bad = true
			default:
				in[v] = true
				n++
			}
		}
		if !bad && n != min(k, tc) {
			c.mismatch("%s: %d rows selected, want min(k, Tc) = %d", unit, n, min(k, tc))
			bad = true
		}
		if bad {
			continue
		}
		// 2. a top-k of its own scores.
		lo, hi := -1, -1 // the lowest selected, the highest unselected
		for j := range tc {
			if in[j] && (lo < 0 || lg.F[j] < lg.F[lo]) {
				lo = j
			}
			if !in[j] && (hi < 0 || lg.F[j] > lg.F[hi]) {
				hi = j
			}
		}
		if lo >= 0 && hi >= 0 && lg.F[hi] > lg.F[lo] {
			// A selected neighbour of the best unselected row scoring below
			// it is the off-by-one's signature; else name the lowest.
			a, adj := lo, false
			for _, d := range []int{1, -1} {
				if n := hi + d; n >= 0 && n < tc && in[n] && lg.F[n] < lg.F[hi] {
					a, adj = n, true
					break
				}
			}
			msg := fmt.Sprintf("%s: not a top-%d of the kernel's own scores: unselected row %d scores %g above selected row %d (%g)", unit, k, hi, lg.F[hi], a, lg.F[a])
			if adj {
				msg += fmt.Sprintf(": an index off by one (row %d listed in place of row %d)", a, hi)
			}
			c.mismatch("%s", msg)
			continue
		}
		var rows []int64
		for j := range tc {
			if in[j] {
				rows = append(rows, int64(j))
			}
		}
		rd := indexer.CompareSelection(rows, ref.score.F, min(k, tc))
		c.Replay[rd.Verdict]++
		if rd.Verdict == indexer.Diverged && c.ReplayFirst == "" {
			c.ReplayFirst = unit + ": " + rd.Reason
		}
		// 3. against the reference, up to boundary ties.
		rset := make([]bool, tc)
		if k >= tc {
			for j := range rset {
				rset[j] = true
			}
		} else {
			if len(ref.topk) != k {
				return nil, fmt.Errorf("prodkernel: %s: index_topk has %d rows, kernel k %d", unit, len(ref.topk), k)
			}
			for _, j := range ref.topk {
				if j < 0 || j >= int64(tc) {
					return nil, fmt.Errorf("prodkernel: %s: index_topk row %d outside [0, %d)", unit, j, tc)
				}
				rset[j] = true
			}
		}
		if slices.Equal(in, rset) {
			c.SameSet++
			c.Agree++
			continue
		}
		kth := math.Inf(1) // the reference's k-th score
		kthRow := -1
		for j := range tc {
			if rset[j] && float64(ref.score.F[j]) < kth {
				kth, kthRow = float64(ref.score.F[j]), j
			}
		}
		tie := true
		for j := range tc {
			if in[j] == rset[j] {
				continue
			}
			if math.Abs(float64(ref.score.F[j])-kth) > ref.tol[j]+ref.tol[kthRow] {
				side := "selected by the kernel only"
				if rset[j] {
					side = "selected by the reference only"
				}
				c.mismatch("%s: row %d %s, reference score %g vs the k-th %g (row %d): beyond the score tolerance, not a boundary tie", unit, j, side, ref.score.F[j], kth, kthRow)
				tie = false
				break
			}
		}
		if tie {
			c.TieSwap++
			c.Agree++
		}
	}
	return c, nil
}

// checkTopKPages checks SGLang's page indices: for raw row j, page_table[j
// div 64] << 6 | j mod 64; −1 for −1.
func checkTopKPages(c *TopKCheck, r *Run, base, pages, unit string, sel []int64) (bool, error) {
	pg, err := r.Ints(base + pages)
	if err != nil {
		return false, err
	}
	tab, err := r.Ints(base + "page_table")
	if err != nil {
		return false, err
	}
	if len(pg) != len(sel) {
		return false, fmt.Errorf("prodkernel: %s: %s%s has %d entries, raw %d", r.Path, base, pages, len(pg), len(sel))
	}
	c.PagesChecked++
	for i, j := range sel {
		want := int64(-1)
		if j >= 0 {
			if j/64 >= int64(len(tab)) {
				c.mismatch("%s: raw row %d beyond the page table (%d pages)", unit, j, len(tab))
				return false, nil
			}
			want = tab[j/64]<<6 | j%64
		}
		if pg[i] != want {
			c.mismatch("%s: page index %d = %d for raw row %d, want %d", unit, i, pg[i], j, want)
			return false, nil
		}
	}
	c.PagesEqual++
	return true, nil
}
