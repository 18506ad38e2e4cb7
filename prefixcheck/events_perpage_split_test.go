package prefixcheck

import "testing"

// A radix node split (its pages removed and stored again at the same place)
// whose first page's parent hash several cached pages have: the split is no
// eviction, so a later hit through the node's pages is not an evicted page.
func TestEventsSGLangSplitUnderAmbiguousParent(t *testing.T) {
	h := func(v int64) int64 { return ppHash(v) }
	root := ppHash()
	tr, rep := runSGLang(t, EventsOptions{}, 1,
		stored{hashes: []int64{h(9)}, parent: p64(root), tokens: []int64{9}, bs: 1},
		// N1 = 3 1 2 under 9, N2 = 4 under N1.
		stored{hashes: []int64{h(3)}, parent: p64(h(9)), tokens: []int64{3}, bs: 1},
		stored{hashes: []int64{h(1)}, parent: p64(h(3)), tokens: []int64{1}, bs: 1},
		stored{hashes: []int64{h(2)}, parent: p64(h(1)), tokens: []int64{2}, bs: 1},
		stored{hashes: []int64{h(4)}, parent: p64(h(2)), tokens: []int64{4}, bs: 1},
		// 7 9: a second page 9.
		stored{hashes: []int64{h(7)}, parent: p64(root), tokens: []int64{7}, bs: 1},
		stored{hashes: []int64{h(9)}, parent: p64(h(7)), tokens: []int64{9}, bs: 1},
		// 9 3 1 8 splits N1 into 3 1 and 2, then stores 8 under 1.
		removed{hashes: []int64{h(3)}}, removed{hashes: []int64{h(1)}}, removed{hashes: []int64{h(2)}},
		stored{hashes: []int64{h(3)}, parent: p64(h(9)), tokens: []int64{3}, bs: 1},
		stored{hashes: []int64{h(1)}, parent: p64(h(3)), tokens: []int64{1}, bs: 1},
		stored{hashes: []int64{h(2)}, parent: p64(h(1)), tokens: []int64{2}, bs: 1},
		stored{hashes: []int64{h(8)}, parent: p64(h(1)), tokens: []int64{8}, bs: 1},
		// 9 3 1 2 4 6 reuses N2.
		stored{hashes: []int64{h(6)}, parent: p64(h(4)), tokens: []int64{6}, bs: 1})
	if rep.Verdict != "agree" || rep.Summary.Warn+rep.Summary.Unchecked != 0 {
		t.Errorf("verdict %s, summary %+v", rep.Verdict, rep.Summary)
	}
	for _, q := range tr.Requests {
		if len(q.Evictions) != 0 {
			t.Errorf("request %s: %d evictions", q.ID, len(q.Evictions))
		}
	}
	if !hasNote(tr, "3 BlockStored events stored again pages just removed") {
		t.Errorf("notes %q", tr.Notes)
	}
}

// A radix node split whose first page's hash several cached pages have: its
// removal evicts none, and its store again at its place is that page, not a
// second copy; the node's other pages are stored again too, so nothing was
// evicted.
func TestEventsSGLangSplitOfAmbiguousPage(t *testing.T) {
	h := func(v int64) int64 { return ppHash(v) }
	root := ppHash()
	tr, rep := runSGLang(t, EventsOptions{}, 1,
		// N1 = 3 1 2 under the root, N2 = 4 under N1.
		stored{hashes: []int64{h(3)}, parent: p64(root), tokens: []int64{3}, bs: 1},
		stored{hashes: []int64{h(1)}, parent: p64(h(3)), tokens: []int64{1}, bs: 1},
		stored{hashes: []int64{h(2)}, parent: p64(h(1)), tokens: []int64{2}, bs: 1},
		stored{hashes: []int64{h(4)}, parent: p64(h(2)), tokens: []int64{4}, bs: 1},
		// 9 3: a second page 3.
		stored{hashes: []int64{h(9)}, parent: p64(root), tokens: []int64{9}, bs: 1},
		stored{hashes: []int64{h(3)}, parent: p64(h(9)), tokens: []int64{3}, bs: 1},
		// 3 1 8 splits N1 into 3 1 and 2, then stores 8 under 1.
		removed{hashes: []int64{h(3)}}, removed{hashes: []int64{h(1)}}, removed{hashes: []int64{h(2)}},
		stored{hashes: []int64{h(3)}, parent: p64(root), tokens: []int64{3}, bs: 1},
		stored{hashes: []int64{h(1)}, parent: p64(h(3)), tokens: []int64{1}, bs: 1},
		stored{hashes: []int64{h(2)}, parent: p64(h(1)), tokens: []int64{2}, bs: 1},
		stored{hashes: []int64{h(8)}, parent: p64(h(1)), tokens: []int64{8}, bs: 1},
		// 3 1 2 4 6 reuses N2.
		stored{hashes: []int64{h(6)}, parent: p64(h(4)), tokens: []int64{6}, bs: 1})
	if rep.Verdict != "agree" || rep.Summary.Warn+rep.Summary.Unchecked != 0 {
		t.Errorf("verdict %s, summary %+v", rep.Verdict, rep.Summary)
	}
	for _, q := range tr.Requests {
		if len(q.Evictions) != 0 {
			t.Errorf("request %s: %d evictions", q.ID, len(q.Evictions))
		}
	}
	if !hasNote(tr, "3 BlockStored events stored again pages just removed") {
		t.Errorf("notes %q", tr.Notes)
	}
}
