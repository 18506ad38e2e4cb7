package indexer

import (
	"fmt"
	"slices"
)

// TieReport describes the score tie at the k-th (last selected) place of a
// top-k selection. torch.topk on CUDA returns tied scores in no particular
// order (spec §9.6, §14), so when more rows tie with the k-th score than fit,
// a GPU may legally select a different subset of them.
type TieReport struct {
	K            int     // rows selected
	KthScore     float32 // score of the k-th selected row (0 when K = 0)
	Tied         int     // rows, selected or not, whose score equals KthScore
	TiedSelected int     // how many of the Tied rows are selected
}

// Boundary reports whether the selection cut through a tie: some row left out
// scores exactly as the k-th selected one, so another subset is equally valid.
func (t TieReport) Boundary() bool { return t.Tied > t.TiedSelected }

// String prints the report in one line for replay output.
func (t TieReport) String() string {
	if t.K == 0 {
		return "k=0"
	}
	return fmt.Sprintf("k=%d kth=%g tied=%d selected=%d boundary=%t", t.K, t.KthScore, t.Tied, t.TiedSelected, t.Boundary())
}

// sameScore is equality of two scores, with NaN equal to NaN (so a NaN tie is
// reported as a tie rather than as a divergence).
func sameScore(a, b float32) bool { return a == b || (a != a && b != b) }

// before is the reference order: larger score first, then lower row index.
// NaN ranks above every number, as it does in torch.topk.
func before(scores []float32, i, j int64) bool {
	a, b := scores[i], scores[j]
	switch {
	case a != a && b != b:
		return i < j
	case a != a:
		return true
	case b != b:
		return false
	case a != b:
		return a > b
	}
	return i < j
}

// TopK selects the k rows with the largest scores (index_topk) with the
// deterministic reference rule "larger score first, then lower row index", and
// returns them in that order (descending score, like torch.topk) with the
// boundary-tie report. k must be in [0, len(scores)]; callers pass
// min(index_topk, Tc). Tc = 0 gives an empty selection.
func TopK(scores []float32, k int) ([]int64, TieReport) {
	if k < 0 || k > len(scores) {
		panic("indexer: TopK k out of range")
	}
	order := make([]int64, len(scores))
	for i := range order {
		order[i] = int64(i)
	}
	slices.SortFunc(order, func(i, j int64) int {
		if before(scores, i, j) {
			return -1
		}
		if before(scores, j, i) {
			return 1
		}
		return 0
	})
	sel := order[:k:k]
	rep := TieReport{K: k}
	if k == 0 {
		return sel, rep
	}
	rep.KthScore = scores[sel[k-1]]
	for _, s := range scores {
		if sameScore(s, rep.KthScore) {
			rep.Tied++
		}
	}
	for _, j := range sel {
		if sameScore(scores[j], rep.KthScore) {
			rep.TiedSelected++
		}
	}
	return sel, rep
}

// Verdict is the outcome of comparing a GPU selection with the reference's.
type Verdict int

const (
	// Same: the two selections are the same set of rows.
	Same Verdict = iota
	// Tie: the sets differ only among rows that tie exactly with the k-th
	// score, so the GPU's set is an equally valid top-k (not a divergence).
	Tie
	// Diverged: the GPU selected a row a valid top-k could not contain, or
	// left out one it must contain, or its list is malformed.
	Diverged
)

func (v Verdict) String() string {
	switch v {
	case Same:
		return "same"
	case Tie:
		return "tie"
	case Diverged:
		return "diverged"
	}
	return fmt.Sprintf("verdict(%d)", int(v))
}

// SelectionDiff is the comparison of a GPU top-k selection with the reference
// selection over the same scores.
type SelectionDiff struct {
	Verdict Verdict
	Ref     []int64   // the reference selection (TopK order)
	Missing []int64   // rows in Ref but not selected by the GPU, ascending
	Extra   []int64   // rows selected by the GPU but not in Ref, ascending
	Recall  float64   // |GPU ∩ Ref| / |Ref|; 1 when both are empty
	Jaccard float64   // |GPU ∩ Ref| / |GPU ∪ Ref|; 1 when both are empty
	Ties    TieReport // tie report of the reference selection
	Reason  string    // why the verdict is Diverged ("" otherwise)
}

// CompareSelection compares the rows a GPU selected (index_topk, any order)
// with the reference selection TopK(scores, k). The sets are compared, not the
// order. The verdict is Tie, not Diverged, when every row in one set but not
// the other scores exactly the k-th score: those rows tie at the boundary and
// torch.topk may pick any of them. A GPU list of the wrong length, with rows
// outside [0, len(scores)) or with duplicates, is Diverged.
func CompareSelection(gpu []int64, scores []float32, k int) SelectionDiff {
	ref, ties := TopK(scores, k)
	d := SelectionDiff{Ref: ref, Ties: ties}
	seen := make(map[int64]bool, len(gpu))
	for _, j := range gpu {
		switch {
		case j < 0 || j >= int64(len(scores)):
			d.Reason = fmt.Sprintf("GPU selected row %d outside 0..%d", j, len(scores)-1)
		case seen[j]:
			d.Reason = fmt.Sprintf("GPU selected row %d twice", j)
		}
		seen[j] = true
	}
	d.Missing, d.Extra, d.Recall, d.Jaccard = SetDiff(ref, gpu)
	if d.Reason == "" && len(gpu) != k {
		d.Reason = fmt.Sprintf("GPU selected %d rows, want min(index_topk, Tc) = %d", len(gpu), k)
	}
	if d.Reason == "" {
		// A row outside the boundary tie on either side decides a divergence.
		for _, j := range d.Extra {
			if !sameScore(scores[j], ties.KthScore) {
				d.Reason = fmt.Sprintf("GPU selected row %d (score %g), below the k-th score %g", j, scores[j], ties.KthScore)
				break
			}
		}
	}
	if d.Reason == "" {
		for _, j := range d.Missing {
			if !sameScore(scores[j], ties.KthScore) {
				d.Reason = fmt.Sprintf("GPU left out row %d (score %g), above the k-th score %g", j, scores[j], ties.KthScore)
				break
			}
		}
	}
	switch {
	case d.Reason != "":
		d.Verdict = Diverged
	case len(d.Missing) == 0 && len(d.Extra) == 0:
		d.Verdict = Same
	default:
		d.Verdict = Tie
	}
	return d
}

// SetDiff compares two selections as sets of rows (order and duplicates
// ignored): missing = rows of ref not in gpu, extra = rows of gpu not in ref,
// both ascending; recall = |gpu ∩ ref| / |ref| and jaccard = |gpu ∩ ref| /
// |gpu ∪ ref|, each 1 when its denominator is 0.
func SetDiff(ref, gpu []int64) (missing, extra []int64, recall, jaccard float64) {
	inRef := make(map[int64]bool, len(ref))
	for _, j := range ref {
		inRef[j] = true
	}
	inGPU := make(map[int64]bool, len(gpu))
	for _, j := range gpu {
		if !inGPU[j] && !inRef[j] {
			extra = append(extra, j)
		}
		inGPU[j] = true
	}
	common := 0
	for j := range inRef {
		if inGPU[j] {
			common++
		} else {
			missing = append(missing, j)
		}
	}
	slices.Sort(missing)
	slices.Sort(extra)
	recall, jaccard = 1, 1
	if len(inRef) > 0 {
		recall = float64(common) / float64(len(inRef))
	}
	if union := len(inRef) + len(inGPU) - common; union > 0 {
		jaccard = float64(common) / float64(union)
	}
	return missing, extra, recall, jaccard
}
