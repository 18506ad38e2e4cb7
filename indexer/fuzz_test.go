package indexer

import (
	"math"
	"testing"

	"sparsemla/quant"
)

// rankAbove is the score order of torch.topk by value alone: NaN above every
// number, otherwise larger first. Ties (equal scores, or both NaN) rank
// neither above the other.
func rankAbove(a, b float32) bool {
	switch {
	case a != a:
		return b == b
	case b != b:
		return false
	}
	return a > b
}

// validTopK is the brute-force oracle: sel is a valid top-k of scores when it
// has k distinct rows in range and no row left out ranks strictly above a
// row selected.
func validTopK(sel []int64, scores []float32, k int) bool {
	if len(sel) != k {
		return false
	}
	in := map[int64]bool{}
	for _, j := range sel {
		if j < 0 || j >= int64(len(scores)) || in[j] {
			return false
		}
		in[j] = true
	}
	for i := range scores {
		if in[int64(i)] {
			continue
		}
		for _, j := range sel {
			if rankAbove(scores[i], scores[j]) {
				return false
			}
		}
	}
	return true
}

// FuzzCompareSelection checks the verdict on a GPU's index_topk (outside
// input: any length, rows out of range, repeats, -1) against the brute-force
// oracle: not Diverged exactly when the GPU list is a valid top-k; Same
// exactly when it is the reference's set; the reference itself is valid.
// Scores are bf16 codes (few distinct values, so ties and NaN are common).
func FuzzCompareSelection(f *testing.F) {
	f.Add([]byte{0x80, 0x3f, 0x80, 0x3f, 0x00, 0x40, 0x00, 0x00}, []byte{2, 0}, uint8(2))
	f.Add([]byte{0xc0, 0x7f, 0x80, 0x3f, 0xc0, 0x7f}, []byte{0, 2}, uint8(2))
	f.Add([]byte{0x80, 0x3f, 0x80, 0x3f}, []byte{0, 0}, uint8(2))
	f.Add([]byte{0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f}, []byte{0xff, 5}, uint8(2))
	f.Add([]byte{}, []byte{}, uint8(0))
	f.Fuzz(func(t *testing.T, sb, gb []byte, kb uint8) {
		if len(sb) > 2*512 || len(gb) > 512 {
			return
		}
		scores := make([]float32, len(sb)/2)
		for i := range scores {
			scores[i] = quant.BF16ToF32(uint16(sb[2*i]) | uint16(sb[2*i+1])<<8)
		}
		k := int(kb) % (len(scores) + 1)
		gpu := make([]int64, len(gb))
		for i, b := range gb {
			gpu[i] = int64(int8(b))
		}
		ref, ties := TopK(scores, k)
		if !validTopK(ref, scores, k) {
			t.Fatalf("TopK(%v, %d) = %v is not a valid top-k", scores, k, ref)
		}
		if k > 0 && !sameScore(ties.KthScore, scores[ref[k-1]]) {
			t.Fatalf("tie report k-th score %g, last selected %g", ties.KthScore, scores[ref[k-1]])
		}
		d := CompareSelection(gpu, scores, k)
		valid := validTopK(gpu, scores, k)
		if (d.Verdict != Diverged) != valid {
			t.Fatalf("scores %v k %d GPU %v: verdict %v (reason %q), oracle valid = %v", scores, k, gpu, d.Verdict, d.Reason, valid)
		}
		if d.Verdict == Diverged && d.Reason == "" {
			t.Fatalf("Diverged without a reason")
		}
		same := valid && len(d.Missing) == 0 && len(d.Extra) == 0
		if (d.Verdict == Same) != same {
			t.Fatalf("scores %v k %d GPU %v: verdict %v, same set = %v", scores, k, gpu, d.Verdict, same)
		}
		if d.Recall < 0 || d.Recall > 1 || d.Jaccard < 0 || d.Jaccard > 1 || math.IsNaN(d.Recall) || math.IsNaN(d.Jaccard) {
			t.Fatalf("recall %g Jaccard %g", d.Recall, d.Jaccard)
		}
	})
}
