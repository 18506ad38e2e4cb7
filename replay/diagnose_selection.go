package replay

import (
	"fmt"

	"strings"
)

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

// padFront reports whether a window list starts with -1 entries followed by
// valid ones (the V4.1 layout).
func padFront(w []int64) bool {
	return len(w) > 1 && w[0] < 0 && w[len(w)-1] >= 0
}
