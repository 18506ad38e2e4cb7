package attention

// WindowIdx is get_window_topk_idxs at decode (R-M:255-266, spec §4): the
// window part of the index list for position p > 0, window size win (128):
//
//	p ≥ win−1:   s = p mod win;  [s+1, …, win−1, 0, …, s]     oldest → newest
//	0 < p < win−1:  [0, 1, …, p, −1, …, −1]                 win−p−1 trailing −1
//
// Entries are kv_cache row numbers (window slot t mod win holds token t); −1
// means "no key". The list always has win entries.
func WindowIdx(p int64, win int) []int32 {
	if p <= 0 || win <= 0 {
		panic("attention: WindowIdx needs a decode position p > 0")
	}
	idx := make([]int32, win)
	if p >= int64(win-1) {
		s := int(p % int64(win))
		n := 0
		for i := s + 1; i < win; i++ {
			idx[n] = int32(i)
			n++
		}
		for i := 0; i <= s; i++ {
			idx[n] = int32(i)
			n++
		}
		return idx
	}
	for i := range idx {
		if int64(i) <= p {
			idx[i] = int32(i)
		} else {
			idx[i] = -1
		}
	}
	return idx
}

// CompressedIdx is get_compress_topk_idxs at decode for HCA layers (r = 128,
// R-M:269-276): every complete compressed row, ascending, as kv_cache offsets:
// [win + 0, win + 1, …, win + Tc − 1], Tc = (p+1) div r.
func CompressedIdx(p int64, r, win int) []int32 {
	tc := VisibleRows(p, r)
	idx := make([]int32, tc)
	for j := range idx {
		idx[j] = int32(win + j)
	}
	return idx
}

// IndexList is the int32 list handed to sparse_attn (R-M:508-513):
// window part (WindowIdx) followed by the compressed part (CompressedIdx for
// r = 128, win + indexer top-k for r = 4, nothing for r = 0).
func IndexList(window, compressed []int32) []int32 {
	return append(append(make([]int32, 0, len(window)+len(compressed)), window...), compressed...)
}

// VisibleWindow returns the first and last token position the query at p sees
// through the window (spec §2.3): max(0, p−win+1) … p.
func VisibleWindow(p int64, win int) (first, last int64) {
	return max(0, p-int64(win)+1), p
}

// VisibleRows is Tc = (p+1) div r, the number of complete compressed rows
// visible at step p (rows 0 … Tc−1, all groups whose last token is ≤ p,
// including those whose tokens are also in the window: no de-duplication).
// r = 0 layers have none.
func VisibleRows(p int64, r int) int {
	if r == 0 {
		return 0
	}
	return int((p + 1) / int64(r))
}

// EmitsRow reports whether the compressor completes a row at step p:
// (p+1) mod r == 0. The row is j = p div r (EmittedRow).
func EmitsRow(p int64, r int) bool { return r > 0 && (p+1)%int64(r) == 0 }

// EmittedRow is the row j = p div r completed at an emitting step p.
func EmittedRow(p int64, r int) int { return int(p / int64(r)) }

// EmissionPos is the step at which row j appears: p = j·r + r − 1. The row is
// written before attention, so the query at that very step already sees it.
func EmissionPos(j, r int) int64 { return int64(j)*int64(r) + int64(r) - 1 }

// RowRopePos is the RoPE position of compressed row j: j·r, the first token of
// its group (R-M:363-367 uses freqs_cis[p+1−r] at emission).
func RowRopePos(j, r int) int64 { return int64(j) * int64(r) }

// RowTokens returns the tokens pooled into row j: for r = 128 tokens
// 128j … 128j+127; for r = 4 (overlap) the B-half of tokens 4j … 4j+3 and the
// A-half of tokens 4j−4 … 4j−1 (none for j = 0), as [first, last] ranges.
func RowTokens(j, r int) (aFirst, aLast, bFirst, bLast int64) {
	bFirst, bLast = int64(j)*int64(r), int64(j)*int64(r)+int64(r)-1
	aFirst, aLast = -1, -1
	if r == 4 && j > 0 {
		aFirst, aLast = bFirst-4, bFirst-1
	}
	return
}
