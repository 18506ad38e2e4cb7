package replay

import (
	"fmt"
	"math"
	"strings"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/quant"
)

// DiagnoseInput is what Diagnose looks at: the failing stage, the reference and
// GPU values, and the inputs the reference computed it from.
type DiagnoseInput struct {
	Model  *engine.Model
	Src    Source
	Def    engine.StageDef
	Result StageResult
	Ref    engine.Tensor
	GPU    engine.Tensor
	In     map[string]engine.Tensor // the stage's inputs (dumped values in local mode)
	Own    map[string]engine.Tensor // the reference's own stage values at this step
	Mode   Mode
	Tol    *Tolerance // the policy in force (nil: the mode's default)
}

// Diagnose names the kind of a divergence and why, from the stage that failed
// and what its inputs looked like:
//
//   - upstream: an input of the stage had already diverged (propagated mode,
//     or an input that was itself out of tolerance);
//   - attention kernel: o (or lse) differs while q, the cache and the index
//     list matched; per head, and whether each bad head is a rescaling of the
//     reference (a normalisation / LSE error) or not (a split-K merge or
//     wrong-keys error);
//   - indexer selection: the scores matched but the top-k set did not (and not
//     inside a boundary tie); indexer scores: the scores themselves differ;
//   - FP8 cache: the FQ8 value of the window K differs (which 64-blocks, and
//     whether the GPU's block scale is the reference's ×2^k), or a cache row
//     not written at this step differs only in one block by a power of two
//     (a corrupted scale byte);
//   - compressor: a compressed row or compressor state differs, or the row due
//     at this emission step is missing from the cache (emitted late);
//   - prefix cache: cache rows not written at this step (positions before the
//     token) differ from this request's own rows of the previous step, and
//     equal another request's rows when the dump names a prefix hit;
//   - projection: a linear/norm/RoPE stage is out of tolerance.
func Diagnose(d DiagnoseInput) *Divergence {
	sr := d.Result
	div := &Divergence{Step: sr.Step, Layer: sr.Layer, Stage: sr.Stage, Mode: string(d.Mode), Inputs: sr.Inputs}
	defer func() {
		div.Text = fmt.Sprintf("first divergence: decode step %d, layer %d, stage %s — %s: %s", div.Step, div.Layer, div.Stage, div.Kind, div.Why)
		div.Hint = hints[div.Kind]
	}()
	if up := upstreamInput(d); up != "" {
		div.Kind, div.Why = KindUpstream, up
		return div
	}
	if sr.Metrics != nil && (sr.Metrics.GPUNaN != sr.Metrics.RefNaN || sr.Metrics.GPUInf != sr.Metrics.RefInf || len(sr.Metrics.NonFiniteRows) > 0) {
		div.Kind = stageKind(sr.Stage)
		div.Rows = sr.Metrics.NonFiniteRows
		div.Why = fmt.Sprintf("the GPU output has %d NaN and %d inf where the reference has %d and %d (leading-axis rows %v)",
			sr.Metrics.GPUNaN, sr.Metrics.GPUInf, sr.Metrics.RefNaN, sr.Metrics.RefInf, sr.Metrics.NonFiniteRows)
		if bad := nonFiniteInputs(d); bad != "" {
			div.Why += "; the reference inherits non-finite values from its input " + bad
		} else {
			div.Why += "; its inputs are finite and matched, so this stage made them"
		}
		return div
	}
	if sr.Reason != "" && (strings.HasPrefix(sr.Reason, "shape") || strings.HasPrefix(sr.Reason, "dtype")) && sr.Stage != "kv_cache" && sr.Stage != "topk_idxs" {
		div.Kind, div.Why = stageKind(sr.Stage), "GPU tensor has "+sr.Reason
		return div
	}
	switch sr.Stage {
	case "o", "lse":
		diagnoseAttention(d, div)
	case "index_topk", "index_sel":
		diagnoseSelection(d, div)
	case "kv", "cmp_row":
		diagnoseFQ8(d, div)
	case "kv_cache":
		diagnoseCache(d, div)
	case "topk_idxs":
		diagnoseIndexList(d, div)
	default:
		div.Kind = stageKind(sr.Stage)
		div.Why = fmt.Sprintf("%s; %s, so %s itself differs (%s)", sr.Reason, inputsPhrase(sr.Inputs), sr.Stage, orEq(sr.Equation))
	}
	return div
}

// inputsPhrase says how a stage's inputs compared: "its inputs (a, b)
// matched the reference", or which of them were not checked.
func inputsPhrase(ins []InputInfo) string {
	var names, unchecked []string
	for _, in := range ins {
		names = append(names, in.Name)
		if in.Status != "matched" {
			unchecked = append(unchecked, fmt.Sprintf("%s from %s %s", in.Name, in.From, in.Status))
		}
	}
	if len(unchecked) == 0 {
		return fmt.Sprintf("its inputs (%s) matched the reference", strings.Join(names, ", "))
	}
	return fmt.Sprintf("its inputs (%s) matched the reference or were not checked (%s)", strings.Join(names, ", "), strings.Join(unchecked, "; "))
}

func orEq(eq string) string {
	if eq == "" {
		return "see the stage's equation"
	}
	return eq
}

// stageKind is the diagnosis kind a stage belongs to by default.
func stageKind(stage string) string {
	switch {
	case stage == "o" || stage == "lse":
		return KindAttention
	case stage == "index_topk" || stage == "index_sel":
		return KindIndexer
	case stage == "index_score" || stage == "index_qk" || strings.HasPrefix(stage, "iq") || strings.HasPrefix(stage, "iw"):
		return KindIndexScore
	case stage == "kv":
		return KindFP8Cache
	case strings.HasPrefix(stage, "cmp_") || strings.HasPrefix(stage, "icmp_") || stage == "icache":
		return KindCompressor
	case stage == "kv_cache":
		return KindCache
	case stage == "topk_idxs":
		return KindIndexList
	}
	return KindProjection
}

// upstreamInput returns why the stage's inputs already differed, or "".
func upstreamInput(d DiagnoseInput) string {
	for _, in := range d.Result.Inputs {
		if in.Status == "diverged" {
			return fmt.Sprintf("its input %s (%s) was already out of tolerance", in.Name, in.From)
		}
	}
	if d.Mode != Propagated {
		return ""
	}
	// Propagated: compare the reference's own inputs with the dumped ones.
	tol := d.Tol
	if tol == nil {
		tol = PropagatedTolerance()
	}
	for _, name := range d.Def.Inputs {
		if strings.HasPrefix(name, "prev:") {
			continue
		}
		own, ok := d.Own[name]
		if !ok {
			continue
		}
		gpu, ok, err := d.Src.Stage(d.Result.Step, d.Result.Layer, name)
		if err != nil || !ok {
			continue
		}
		var sr StageResult
		sr.Stage = name
		JudgeStage(&sr, own, gpu, map[string]engine.Tensor{}, tol.For(name), JudgeContext{d.Model.GPURope, d.Model.Cfg.WindowSize})
		if sr.Status == StatusFail {
			return fmt.Sprintf("its input %s already differs between the reference chain and the dump (%s)", name, sr.Reason)
		}
	}
	return ""
}

// diagnoseAttention looks at o per head.
func diagnoseAttention(d DiagnoseInput, div *Divergence) {
	div.Kind = KindAttention
	ref, gpu := d.Ref, d.GPU
	if len(ref.Shape) != 2 || !engine.SameShape(ref.Shape, gpu.Shape) {
		div.Why = d.Result.Reason
		return
	}
	H, D := ref.Shape[0], ref.Shape[1]
	tol := DefaultTolerance().For(d.Result.Stage)
	var scaled, other []string
	for h := 0; h < H; h++ {
		r := engine.FromF(ref.Kind, ref.F[h*D:(h+1)*D], D)
		g := engine.FromF(gpu.Kind, gpu.F[h*D:(h+1)*D], D)
		m := CompareFloat(r, g, tol, true)
		if ok, _ := tol.Judge(m, true); ok {
			continue
		}
		div.Heads = append(div.Heads, h)
		if c, ok := rescaling(r.F, g.F); ok {
			scaled = append(scaled, fmt.Sprintf("head %d = %.6g × reference", h, c))
		} else {
			other = append(other, fmt.Sprintf("head %d cos_diff %.3g, max abs %.3g", h, m.CosDiff, m.MaxAbs))
		}
	}
	inputs := inputsPhrase(d.Result.Inputs)
	if line := indexListSummary(d); line != "" {
		div.Detail = append(div.Detail, line)
	}
	if why, lines, ok := diagnoseSplits(d, div.Heads); ok {
		div.Detail = append(div.Detail, lines...)
		if len(scaled) > 0 && len(other) == 0 {
			why += fmt.Sprintf("; heads %v are the reference times a constant: the combine's LSE or sink term is wrong", div.Heads)
			div.Detail = append(div.Detail, scaled...)
		} else {
			div.Detail = append(div.Detail, other...)
			div.Detail = append(div.Detail, scaled...)
		}
		div.Why = inputs + "; " + why
		return
	}
	switch {
	case len(div.Heads) == 0:
		div.Why = inputs + "; " + d.Result.Reason
	case len(other) == 0:
		div.Why = fmt.Sprintf("%s, but heads %v are the reference output times a constant: a normalisation error (wrong LSE or sink term in the softmax denominator / split-K combine)", inputs, div.Heads)
		div.Detail = scaled
	default:
		div.Why = fmt.Sprintf("%s, but heads %v differ and are not a rescaling of the reference: a split-K partial/merge error or wrong keys read", inputs, div.Heads)
		div.Detail = append(other, scaled...)
	}
}

// rescaling reports whether g ≈ c·r for one constant c ≠ 1 (to bf16 accuracy).
func rescaling(r, g []float32) (float64, bool) {
	var rg, rr float64
	for i := range r {
		rg += float64(r[i]) * float64(g[i])
		rr += float64(r[i]) * float64(r[i])
	}
	if rr == 0 {
		return 0, false
	}
	c := rg / rr
	if math.Abs(c-1) < 1e-3 {
		return c, false
	}
	var res, gg float64
	for i := range r {
		e := float64(g[i]) - c*float64(r[i])
		res += e * e
		gg += float64(g[i]) * float64(g[i])
	}
	return c, gg > 0 && res/gg < 1e-4
}

// diagnoseSelection explains a top-k set divergence with the scores.
func diagnoseSelection(d DiagnoseInput, div *Divergence) {
	div.Kind = KindIndexer
	set := d.Result.Set
	scoresOK := "the index scores are not in the dump"
	for _, in := range d.Result.Inputs {
		if in.Name == "index_score" {
			scoresOK = "the index scores matched the reference"
			if in.Status != "matched" {
				scoresOK = fmt.Sprintf("the index scores (%s, %s) were judged against the dump's own scores", in.From, in.Status)
			}
		}
	}
	if set == nil {
		div.Why = scoresOK + "; " + d.Result.Reason
		return
	}
	var sc []float32
	if s, ok := d.In["index_score"]; ok {
		sc = s.F
	}
	name := func(rows []int64) string {
		var p []string
		for _, j := range rows {
			if sc != nil && j >= 0 && int(j) < len(sc) {
				p = append(p, fmt.Sprintf("%d (score %g)", j, sc[j]))
			} else {
				p = append(p, fmt.Sprint(j))
			}
		}
		return strings.Join(p, ", ")
	}
	if defects := selectionDefects(d, len(sc)); defects != "" {
		// Not a set of rows at all: say so first, then what is left of it.
		div.Why = fmt.Sprintf("%s, but the GPU top-%d is not a set of %d valid rows, so not a boundary tie: %s", scoresOK, set.K, set.K, defects)
		if len(set.Extra) > 0 {
			div.Why += fmt.Sprintf("; rows the reference does not select: [%s]", name(set.Extra))
		}
		if len(set.Missing) > 0 {
			div.Why += fmt.Sprintf("; rows it left out: [%s]", name(set.Missing))
		}
		div.Why += fmt.Sprintf(" (recall %.3g, Jaccard %.3g): %s", set.Recall, set.Jaccard, d.Result.Reason)
	} else {
		div.Why = fmt.Sprintf("%s, but the GPU top-%d selected rows [%s] and left out [%s]; k-th score %g, not a boundary tie (recall %.3g, Jaccard %.3g): %s",
			scoresOK, set.K, name(set.Extra), name(set.Missing), float64(set.KthScore), set.Recall, set.Jaccard, d.Result.Reason)
	}
	for _, j := range set.Extra {
		div.Rows = append(div.Rows, int(j))
	}
}

// selectionDefects describes what makes the GPU's top-k list not a set of
// valid rows: rows named more than once (with their entries), rows outside
// 0 … tc−1 (tc = the number of index rows, 0 when unknown), and a length
// other than k; "" when there is none. Rows are index rows (index_sel has
// the window offset removed).
func selectionDefects(d DiagnoseInput, tc int) string {
	if d.GPU.Kind.IsFloat() {
		return ""
	}
	off := int64(0)
	if d.Result.Stage == "index_sel" {
		off = int64(d.Model.Cfg.WindowSize)
	}
	entries := map[int64][]int{}
	var order []int64
	var parts []string
	for i, v := range d.GPU.I {
		j := v - off
		if tc > 0 && (j < 0 || j >= int64(tc)) {
			parts = append(parts, fmt.Sprintf("entry %d names row %d, outside the %d index rows 0..%d", i, j, tc, tc-1))
			continue
		}
		if _, ok := entries[j]; !ok {
			order = append(order, j)
		}
		entries[j] = append(entries[j], i)
	}
	for _, j := range order {
		switch e := entries[j]; {
		case len(e) == 2:
			parts = append(parts, fmt.Sprintf("it names row %d twice (entries %d and %d)", j, e[0], e[1]))
		case len(e) > 2:
			parts = append(parts, fmt.Sprintf("it names row %d %d times (entries %v)", j, len(e), e))
		}
	}
	if set := d.Result.Set; set != nil && len(d.GPU.I) != set.K {
		parts = append(parts, fmt.Sprintf("it has %d entries, want k = min(index_topk, Tc) = %d", len(d.GPU.I), set.K))
	}
	return strings.Join(parts, "; ")
}

// FQ8Scale is the reference block scale of FQ8 (§3.3): ceil2(f32(a·f32(1/448)))
// with a = max(max|v|, 1e-4).
func FQ8Scale(v []float32) float32 {
	var a float32
	for _, x := range v {
		a = max(a, float32(math.Abs(float64(x))))
	}
	a = max(a, 1e-4)
	return quant.Ceil2(a * float32(1.0/448))
}

// FQ8With is FQ8 of one block with a given scale s.
func FQ8With(dst, v []float32, s float32) {
	for i, x := range v {
		q := quant.E4M3(min(max(x/s, -448), 448))
		dst[i] = quant.BF16Round(q * s)
	}
}

// diagnoseFQ8 finds which 64-blocks of an FQ8 stage differ and whether the GPU
// used the reference scale times a power of two.
func diagnoseFQ8(d DiagnoseInput, div *Divergence) {
	if d.Result.Stage == "kv" {
		div.Kind = KindFP8Cache
	} else {
		div.Kind = KindCompressor
	}
	inName := "kv_roped"
	if d.Result.Stage == "cmp_row" {
		inName = "cmp_roped"
	}
	in, ok := d.In[inName]
	ref, gpu := d.Ref, d.GPU
	if !ok || !engine.SameShape(ref.Shape, gpu.Shape) || len(in.F) != len(ref.F) {
		div.Why = d.Result.Reason
		return
	}
	const B = 64
	nope := len(ref.F) - 64 // RoPE dims are not quantised
	var lines []string
	tmp := make([]float32, B)
	for b := 0; b*B < nope; b++ {
		lo, hi := b*B, (b+1)*B
		same := true
		for i := lo; i < hi; i++ {
			if !equalValue(ref.F[i], gpu.F[i]) {
				same = false
				break
			}
		}
		if same {
			continue
		}
		div.Blocks = append(div.Blocks, b)
		s := FQ8Scale(in.F[lo:hi])
		found := false
		for _, k := range []int{1, -1, 2, -2} {
			s2 := s * float32(math.Ldexp(1, k))
			FQ8With(tmp, in.F[lo:hi], s2)
			eq := true
			for i := range tmp {
				if !equalValue(tmp[i], gpu.F[lo+i]) {
					eq = false
					break
				}
			}
			if eq {
				lines = append(lines, fmt.Sprintf("block %d (dims %d..%d): GPU scale 2^%d, reference ceil2(amax/448) = 2^%d", b, lo, hi-1,
					ScaleExp2(s2), ScaleExp2(s)))
				found = true
				break
			}
		}
		if !found {
			lines = append(lines, fmt.Sprintf("block %d (dims %d..%d): values differ and are not FQ8 with a power-of-two neighbour of the reference scale 2^%d", b, lo, hi-1, ScaleExp2(s)))
		}
	}
	div.Detail = lines
	what := "the FQ8 values written to the cache"
	if d.Result.Stage == "cmp_row" {
		what = "the compressed row's FQ8 values"
	}
	switch {
	case len(div.Blocks) == 0:
		div.Why = fmt.Sprintf("%s differ in the unquantised RoPE dims; %s", what, d.Result.Reason)
	case len(lines) > 0 && strings.Contains(lines[0], "GPU scale 2^"):
		div.Why = fmt.Sprintf("%s differ in 64-blocks %v: the GPU picked a block scale 2x away from ceil2(f32(amax·f32(1/448))) (scale rounded the other way, spec §9.4)", what, div.Blocks)
	default:
		div.Why = fmt.Sprintf("%s differ in 64-blocks %v (input %s matched)", what, div.Blocks, inName)
	}
}

func ScaleExp2(s float32) int {
	_, e := math.Frexp(float64(s))
	return e - 1
}

// diagnoseCache classifies the differing kv_cache rows.
func diagnoseCache(d DiagnoseInput, div *Divergence) {
	cfg := d.Model.Cfg
	p := d.Result.Step
	r := cfg.CompressRatios[d.Result.Layer]
	W := cfg.WindowSize
	ref, gpu := d.Ref, d.GPU
	slot := int(p % int64(W))
	emit := r > 0 && (p+1)%int64(r) == 0
	jrow := -1
	if emit {
		jrow = W + int(p/int64(r))
	}
	if !engine.SameShape(ref.Shape, gpu.Shape) {
		if len(ref.Shape) == 2 && len(gpu.Shape) == 2 && gpu.Shape[0] < ref.Shape[0] && emit {
			div.Kind = KindCompressor
			div.Rows = []int{jrow}
			div.Why = fmt.Sprintf("the GPU cache has %d rows, the reference %d: compressed row %d due at this emission step (p+1 = %d is a multiple of r = %d) was not written (emitted late?)",
				gpu.Shape[0], ref.Shape[0], jrow-W, p+1, r)
			return
		}
		div.Kind, div.Why = KindFP8Cache, "cache shape "+d.Result.Reason
		return
	}
	rows := RowDiff(ref, gpu, 0)
	div.Rows = rows
	if pd := pageDetail(d); pd != "" {
		div.Detail = append(div.Detail, pd)
	}
	D := ref.Shape[1]
	row := func(t engine.Tensor, i int) []float32 { return t.F[i*D : (i+1)*D] }
	var written, compressed, old []int
	for _, i := range rows {
		switch {
		case i == slot:
			written = append(written, i)
		case i == jrow:
			compressed = append(compressed, i)
		default:
			old = append(old, i)
		}
	}
	switch {
	case len(compressed) > 0 && allZero(row(gpu, jrow)):
		div.Kind = KindCompressor
		div.Why = fmt.Sprintf("compressed row %d (cache row %d) due at this emission step (p+1 = %d, r = %d) is all zeros in the GPU cache: the compressor did not emit it at its emission step (late?)",
			jrow-W, jrow, p+1, r)
	case len(compressed) > 0:
		div.Kind = KindCompressor
		div.Why = fmt.Sprintf("compressed row %d written at this step differs from cmp_row (cache row %d)", jrow-W, jrow)
	case len(written) > 0 && len(old) == 0:
		div.Kind = KindFP8Cache
		div.Why = fmt.Sprintf("window slot %d written at this step differs from kv (the value the step computed)", slot)
	case len(old) > 0:
		diagnoseOldRows(d, div, old, slot, W)
	default:
		div.Kind, div.Why = KindFP8Cache, d.Result.Reason
	}
}

func allZero(v []float32) bool {
	for _, x := range v {
		if x != 0 {
			return false
		}
	}
	return true
}

// diagnoseOldRows explains cache rows that changed although this step did not
// write them: a corrupted FP8 scale (one block off by a power of two), or a
// stale / foreign row (prefix cache).
func diagnoseOldRows(d DiagnoseInput, div *Divergence, old []int, slot, W int) {
	ref, gpu := d.Ref, d.GPU
	D := ref.Shape[1]
	p := d.Result.Step
	first := old[0]
	pos := rowPosition(first, slot, p, W, d.Model.Cfg.CompressRatios[d.Result.Layer])
	// One block off by an exact power of two: a scale byte.
	if b, k, ok := scaledBlock(ref.F[first*D:(first+1)*D], gpu.F[first*D:(first+1)*D]); ok && len(old) == 1 {
		div.Kind = KindFP8Cache
		div.Blocks = []int{b}
		e := ScaleExp2(FQ8Scale(ref.F[first*D+b*64 : first*D+b*64+64]))
		div.Why = fmt.Sprintf("cache row %d (%s), not written at this step, differs only in nope block %d (dims %d..%d), every value by exactly 2^%d: its UE8M0 scale byte reads 0x%02x instead of 0x%02x (a corrupted scale byte)",
			first, pos, b, b*64, b*64+63, k, 127+e+k, 127+e)
		return
	}
	div.Kind = KindPrefix
	why := fmt.Sprintf("cache rows %v (first: %s) were not written at this step but differ from this request's own rows after the previous step", old, pos)
	if ps, ok := d.Src.(PrefixSource); ok {
		if hit, ok := ps.PrefixHit(); ok {
			others := map[string]engine.Tensor{}
			if o, ok, _ := ps.OtherStage(hit.From, p, d.Result.Layer, "kv_cache"); ok {
				others[hit.From] = o
			}
			// The request's own rows: the reference value (previous step's
			// rows, which matched, plus this step's writes).
			line, err := verifyPrefix(d.Model.Cfg, d.Result.Layer, hit, gpu, ref, others)
			if err == nil && line != "" {
				div.Why = fmt.Sprintf("%s; prefix-cache hit of %d tokens from request %q: %s", why, hit.Tokens, hit.From, line)
				return
			}
		}
	}
	if ps, ok := d.Src.(PrefixSource); ok {
		if hit, ok := ps.PrefixHit(); ok {
			why += fmt.Sprintf("; the dump records a prefix-cache hit of %d tokens from request %q", hit.Tokens, hit.From)
			if o, ok, _ := ps.OtherStage(hit.From, p, d.Result.Layer, "kv_cache"); ok && len(o.F) >= (first+1)*D {
				if rowsEqual(o.F[first*D:(first+1)*D], gpu.F[first*D:(first+1)*D]) {
					why += fmt.Sprintf(", and row %d equals request %q's row: a stale page from that request", first, hit.From)
				}
			}
		}
	}
	div.Why = why
}

func rowsEqual(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !equalValue(a[i], b[i]) {
			return false
		}
	}
	return true
}

// rowPosition names a cache row: window slot s holds token p - ((p - s) mod W);
// compressed row 128+j covers tokens j·r .. j·r+r-1.
func rowPosition(row, slot int, p int64, W, r int) string {
	if row < W {
		back := int64((slot - row + W) % W)
		return fmt.Sprintf("window slot %d, token %d", row, p-back)
	}
	j := row - W
	return fmt.Sprintf("compressed row %d, tokens %d..%d", j, j*r, j*r+r-1)
}

// scaledBlock reports whether g differs from r in exactly one 64-block of the
// nope part, by one exact power-of-two factor 2^k.
func scaledBlock(r, g []float32) (block, k int, ok bool) {
	block = -1
	for b := 0; b*64 < len(r)-64; b++ {
		lo, hi := b*64, (b+1)*64
		if rowsEqual(r[lo:hi], g[lo:hi]) {
			continue
		}
		if block >= 0 {
			return 0, 0, false
		}
		block = b
		kk := math.MinInt
		for i := lo; i < hi; i++ {
			if r[i] == 0 && g[i] == 0 {
				continue
			}
			if r[i] == 0 || g[i] == 0 {
				return 0, 0, false
			}
			q := float64(g[i]) / float64(r[i])
			fr, e := math.Frexp(q)
			if fr != 0.5 {
				return 0, 0, false
			}
			if kk == math.MinInt {
				kk = e - 1
			} else if kk != e-1 {
				return 0, 0, false
			}
		}
		k = kk
	}
	if block < 0 || !rowsEqual(r[len(r)-64:], g[len(g)-64:]) {
		return 0, 0, false
	}
	return block, k, true
}

// diagnoseIndexList explains a differing topk_idxs list.
func diagnoseIndexList(d DiagnoseInput, div *Divergence) {
	W := d.Model.Cfg.WindowSize
	ref, gpu := d.Ref, d.GPU
	if len(ref.I) < W || len(gpu.I) < W {
		div.Kind, div.Why = KindIndexList, "the index list has "+d.Result.Reason
		return
	}
	for i := 0; i < W; i++ {
		if ref.I[i] != gpu.I[i] {
			div.Kind = KindIndexList
			div.Why = fmt.Sprintf("window part of the index list differs at entry %d: GPU %d, reference %d (ring order oldest to newest, -1 padding at the end, spec §4)", i, gpu.I[i], ref.I[i])
			if padFront(gpu.I[:W]) && !padFront(ref.I[:W]) {
				div.Why += "; the GPU puts the -1 padding first: the V4.1 window layout (spec §11 item 9) in a V4 model"
			}
			return
		}
	}
	r := d.Model.Cfg.Ratio(d.Result.Layer)
	switch r {
	case 0:
		div.Kind = KindIndexList
		div.Why = fmt.Sprintf("the index list of a window-only layer (ratio 0) is its %d window entries and nothing after them: %s", W, d.Result.Reason)
	case 4:
		div.Kind = KindIndexer
		div.Why = fmt.Sprintf("compressed part of the index list (%d + index_sel) differs: %s", W, d.Result.Reason)
	default:
		div.Kind = KindCompressor
		div.Why = fmt.Sprintf("compressed part of the index list differs (r = %d: %d + 0..Tc-1, Tc = (p+1) div %d = %d): %s", r, W, r, (d.Result.Step+1)/int64(r), d.Result.Reason)
	}
}

// indexListSummary describes the index list the attention read.
func indexListSummary(d DiagnoseInput) string {
	idx, ok := d.In["topk_idxs"]
	if !ok || idx.Kind.IsFloat() {
		return ""
	}
	W := d.Model.Cfg.WindowSize
	win, cmp := 0, 0
	var rows []int64
	for i, v := range idx.I {
		switch {
		case v < 0:
		case i < W:
			win++
		default:
			cmp++
			if len(rows) < 8 {
				rows = append(rows, v-int64(W))
			}
		}
	}
	s := fmt.Sprintf("index list: %d entries, %d valid window keys, %d compressed rows", len(idx.I), win, cmp)
	if cmp > 0 {
		s += fmt.Sprintf(" (first: %v)", rows)
	}
	return s
}

// diagnoseSplits uses split-K partials the dump holds beside o (stages
// split_bounds [S+1] = offsets into topk_idxs, o_split/<s> [H, D] and
// lse_split/<s> [H], FlashMLA's per-split output and base-2 LSE without the
// sink): each split is recomputed from the dumped q, kv_cache and its slice of
// the index list; if every split matches, the GPU's partials are merged the
// reference way (attention.MergePartials) to tell a combine bug from a split
// bug. ok is false when the dump has no partials.
func diagnoseSplits(d DiagnoseInput, heads []int) (why string, lines []string, ok bool) {
	p, l := d.Result.Step, d.Result.Layer
	bt, has, err := d.Src.Stage(p, l, "split_bounds")
	if err != nil || !has || bt.Kind.IsFloat() || len(bt.I) < 2 {
		return "", nil, false
	}
	q, okq := d.In["q"]
	kv, okk := d.In["kv_cache"]
	idx, oki := d.In["topk_idxs"]
	if !okq || !okk || !oki {
		return "", nil, false
	}
	for i := 1; i < len(bt.I); i++ {
		if bt.I[i] < bt.I[i-1] || bt.I[0] != 0 || bt.I[len(bt.I)-1] != int64(len(idx.I)) {
			return "", []string{fmt.Sprintf("split_bounds %v do not cover the %d-entry index list", bt.I, len(idx.I))}, false
		}
	}
	cfg := d.Model.Cfg
	H, D := cfg.NHeads, cfg.HeadDim
	ref := SplitPartials(cfg, q, kv, idx, bt.I)
	gpuParts := make([]attentionPartial, len(ref))
	outTol := DefaultTolerance().For("o")
	lseTol := DefaultTolerance().For("lse")
	for s := range ref {
		o, ok1, _ := d.Src.Stage(p, l, fmt.Sprintf("o_split/%d", s))
		lse, ok2, _ := d.Src.Stage(p, l, fmt.Sprintf("lse_split/%d", s))
		if !ok1 || !ok2 || len(o.F) != H*D || len(lse.F) != H {
			return "", nil, false
		}
		gpuParts[s] = attentionPartial{O: o.F, LSE2: lse.F}
		mo := CompareFloat(engine.FromF(engine.KindF32, ref[s].O, H, D), engine.FromF(engine.KindF32, o.F, H, D), outTol, true)
		ml := CompareFloat(engine.FromF(engine.KindF32, ref[s].LSE2, H), engine.FromF(engine.KindF32, lse.F, H), lseTol, true)
		okO, whyO := outTol.Judge(mo, true)
		okL, whyL := lseTol.Judge(ml, true)
		if !okO || !okL {
			msg := fmt.Sprintf("split %d (index entries %d..%d) already differs:", s, bt.I[s], bt.I[s+1]-1)
			if !okO {
				msg += " partial output " + whyO
			}
			if !okL {
				msg += " partial LSE " + whyL
			}
			return msg + " — the split kernel, not the combine", lines, true
		}
		lines = append(lines, fmt.Sprintf("split %d (index entries %d..%d): partial output and LSE match the reference", s, bt.I[s], bt.I[s+1]-1))
	}
	// The reference o runs the kernel-faithful chunked softmax (P rounded
	// to bf16 for P·V); a merge of fp32 partials differs from it in the low
	// bits, so "reproduces o" means within tolerance or far closer to the
	// reference than the GPU's o is.
	merged := mergeGPUPartials(d, gpuParts)
	mm := CompareFloat(d.Ref, merged, outTol, true)
	okM, _ := outTol.Judge(mm, true)
	if gpuCos := CosDiff(d.Ref.F, d.GPU.F); okM || mm.CosDiff*100 < gpuCos {
		lines = append(lines, fmt.Sprintf("merged GPU partials vs reference o: cos_diff %.3g; GPU o vs reference o: cos_diff %.3g", mm.CosDiff, gpuCos))
		return fmt.Sprintf("every split-K partial matches the reference, and merging them the reference way gives the reference o, but the GPU's o differs in heads %v: the split-K combine (merge) is wrong", heads), lines, true
	}
	return "every split-K partial matches the reference, but merging them does not reproduce o: the index list was split differently from split_bounds", lines, true
}

// attentionPartial is attention.Partial (kept local to name its use here).
type attentionPartial = attention.Partial

// mergeGPUPartials merges dumped partials with the reference combine
// (attention.MergePartials: base-2 LSE, sink folded in) into a bf16 o.
func mergeGPUPartials(d DiagnoseInput, parts []attentionPartial) engine.Tensor {
	cfg := d.Model.Cfg
	o := make([]float32, cfg.NHeads*cfg.HeadDim)
	attention.MergePartials(o, parts, d.Model.Weights[d.Result.Layer].AttnSink, cfg.HeadDim)
	return engine.FromF(engine.KindBF16, o, cfg.NHeads, cfg.HeadDim)
}

// nonFiniteInputs names the first input of the stage holding NaN or inf, with
// where it came from, or "".
func nonFiniteInputs(d DiagnoseInput) string {
	for _, info := range d.Result.Inputs {
		t, ok := d.In[info.Name]
		if !ok || !t.Kind.IsFloat() {
			continue
		}
		nan, inf := 0, 0
		for _, v := range t.F {
			switch {
			case v != v:
				nan++
			case !finite(v):
				inf++
			}
		}
		// score_state holds −∞ by design (empty entries); only NaN counts there.
		if strings.HasSuffix(info.Name, "score_state") {
			inf = 0
		}
		if nan+inf > 0 {
			return fmt.Sprintf("%s (%s, %s: %d NaN, %d inf)", info.Name, info.From, info.Status, nan, inf)
		}
	}
	return ""
}

// padFront reports whether a window list starts with -1 entries followed by
// valid ones (the V4.1 layout).
func padFront(w []int64) bool {
	return len(w) > 1 && w[0] < 0 && w[len(w)-1] >= 0
}
