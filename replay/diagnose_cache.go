package replay

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"sparsemla/engine"
	"sparsemla/quant"
)

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
	if h := exactHypothesis(d.hyp); h != "" {
		div.Why = fmt.Sprintf("%s differ in 64-blocks %v (input %s matched): %s", what, div.Blocks, inName, d.hyp.Text())
		if h == "no-fq8" {
			div.Detail = []string{fmt.Sprintf("the GPU's value is %s itself: it was never rounded to the FP8 grid", inName)}
		}
		return
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

// ScaleExp2 is the exponent e of a power-of-two scale s = 2^e (the UE8M0
// byte of s is 127 + e).
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
	if h := exactHypothesis(d.hyp); strings.HasPrefix(h, "window-") {
		// The step's own write went wrong (wrong slot, no write, a double
		// write): a cache-write error, whatever other rows it touched.
		div.Kind = KindCacheWrite
		div.Why = fmt.Sprintf("cache rows %v differ; the GPU's cache is the previous cache with this step's kv (token %d, slot %d = p mod %d) %s", rows, p, slot, W, writeWhat(h))
		return
	}
	if w, o, ok := misplacedWrite(ref, gpu, append(written, compressed...), old); ok {
		div.Kind = KindCache
		held := "other values"
		if allZero(row(gpu, w)) {
			held = "zeros"
		}
		div.Why = fmt.Sprintf("the row this step wrote (cache row %d, %s) is not in its place, which holds %s, but in cache row %d (%s), which this step does not write: the cache write went to the wrong page or slot (slot mapping / block table)",
			w, rowPosition(w, slot, p, W, r), held, o, rowPosition(o, slot, p, W, r))
		return
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

// misplacedWrite finds a row w written at this step whose reference value
// (non-zero) the GPU holds, bit for bit, in a row o this step does not write.
func misplacedWrite(ref, gpu engine.Tensor, written, old []int) (w, o int, ok bool) {
	D := ref.Shape[1]
	for _, w := range written {
		rw := ref.F[w*D : (w+1)*D]
		if allZero(rw) {
			continue
		}
		for _, o := range old {
			if slices.Equal(gpu.F[o*D:(o+1)*D], rw) {
				return w, o, true
			}
		}
	}
	return 0, 0, false
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
	// Rows nobody wrote at this step changed: a prefix-cache hit only when
	// the dump records one; otherwise stale or corrupted cache rows.
	div.Kind = KindCache
	why := fmt.Sprintf("cache rows %v (first: %s) were not written at this step but differ from this request's own rows after the previous step", old, pos)
	if ps, ok := d.Src.(PrefixSource); ok {
		if _, ok := ps.PrefixHit(); ok {
			div.Kind = KindPrefix
		}
	}
	if div.Kind == KindCache {
		div.Why = why + "; the dump records no prefix-cache hit for this request, so these are stale or corrupted rows of its own cache (a page freed and reused, an out-of-bounds write)"
		return
	}
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
		if p-back < 0 {
			return fmt.Sprintf("window slot %d, which holds no token yet", row)
		}
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

// writeWhat says what a window-write hypothesis did, for the diagnosis.
func writeWhat(h string) string {
	switch h {
	case "window-slot p-1":
		return "written to slot (p-1) mod W instead (the previous token's row overwritten), while slot p keeps its previous row"
	case "window-slot p+1":
		return "written to slot (p+1) mod W instead (that slot's row overwritten), while slot p keeps its previous row"
	case "window-not-written":
		return "never written: slot p keeps its previous row"
	case "window-double-write p,p-1":
		return "written twice, to slot p and to slot (p-1) mod W (the previous token's row overwritten)"
	case "window-double-write p,p+1":
		return "written twice, to slot p and to slot (p+1) mod W (that slot's row overwritten)"
	}
	return "written the way hypothesis " + h + " says"
}
