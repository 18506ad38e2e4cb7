package prefixcheck

import (
	"crypto/sha256"
	"encoding/binary"
	"strconv"
	"strings"
	"testing"
)

// SGLang's KV events name pages by hashes computed in
// python/sglang/srt/mem_cache/radix_cache.py. Before PR #13488 (e.g. commit
// 95769b280eaaf946a45dd3b50f7e864df09ac893) a page's hash is Python's
// hash(tuple(page_tokens)), one page's tokens alone, and its parent hash the
// same hash of the page before it (hash(()) under the root; some later
// versions sent no parent for the first page of a radix node); a node's
// split is announced as the removal of its pages and their store again.
// Since PR #13488 (e.g. commit 006b0e3d317f1cd4a7300e919a4eaa878b1947e7) a
// page's hash is chained: SHA-256 over the parent page's digest and the
// page's tokens (4 bytes each, little-endian), its first 8 bytes as a signed
// int64 (hash_str_to_int64), and the first page under the root has no
// parent.

// ppHash is SGLang's per-page hash of a page (before PR #13488).
func ppHash(toks ...int64) int64 {
	t := make([]int32, len(toks))
	for i, v := range toks {
		t[i] = int32(v)
	}
	return pyTupleHash(t)
}

// sglChain is SGLang's chained page hashes (since PR #13488) of toks in
// pages of bs, after prior (nil: from the root).
func sglChain(prior []byte, bs int, toks ...int64) (hashes []int64, last []byte) {
	for i := 0; i+bs <= len(toks); i += bs {
		h := sha256.New()
		h.Write(prior)
		for _, t := range toks[i : i+bs] {
			h.Write(binary.LittleEndian.AppendUint32(nil, uint32(t)))
		}
		prior = h.Sum(nil)
		hashes = append(hashes, int64(binary.BigEndian.Uint64(prior)))
	}
	return hashes, prior
}

func runSGLang(t *testing.T, opt EventsOptions, bs int, evs ...any) (*Trace, *Report) {
	t.Helper()
	x := newEvEnc()
	x.sglangBatch(1, evs...)
	b, err := DecodeEvents(x.buf.Bytes(), "x")
	if err != nil {
		t.Fatal(err)
	}
	tr, err := EventsTrace(b, "x", opt)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	return tr, rep
}

func hasNote(tr *Trace, s string) bool {
	for _, n := range tr.Notes {
		if strings.Contains(n, s) {
			return true
		}
	}
	return false
}

// A prompt that repeats a page (5 7 5 9 in pages of one token) stores page
// "5" at two places. Per-page hashes give both one hash: that is no
// overwritten page, and a correct SGLang stream is never reported diverged.
func TestEventsSGLangRepeatedPage(t *testing.T) {
	h5, h7, h9, root := ppHash(5), ppHash(7), ppHash(9), ppHash()

	// Versions that sent no parent for a node's first page: its place is
	// not known, so nothing is judged (it was overwritten-page, diverged).
	t.Run("per-page, no parent", func(t *testing.T) {
		tr, rep := runSGLang(t, EventsOptions{}, 1,
			stored{hashes: []int64{h5}, tokens: []int64{5}, bs: 1},
			stored{hashes: []int64{h7}, parent: p64(h5), tokens: []int64{7}, bs: 1},
			stored{hashes: []int64{h5}, parent: p64(h7), tokens: []int64{5}, bs: 1},
			stored{hashes: []int64{h9}, parent: p64(h5), tokens: []int64{9}, bs: 1})
		if rep.Verdict != VerdictIncomplete || rep.ExitCode() != 3 || rep.Summary.Diverged != 0 || !hasNote(tr, "per-page") {
			t.Fatalf("verdict %s, %d diverged, notes %q", rep.Verdict, rep.Summary.Diverged, tr.Notes)
		}
	})

	// Commit 95769b28: the root's page hash is hash(()). Each page is placed
	// while its parent hash names one cached page; 9's parent hash names
	// both 5s, so 9 is not judged.
	t.Run("per-page, root hash(())", func(t *testing.T) {
		tr, rep := runSGLang(t, EventsOptions{}, 1,
			stored{hashes: []int64{h5}, parent: p64(root), tokens: []int64{5}, bs: 1},
			stored{hashes: []int64{h7}, parent: p64(h5), tokens: []int64{7}, bs: 1},
			stored{hashes: []int64{h5}, parent: p64(h7), tokens: []int64{5}, bs: 1},
			stored{hashes: []int64{h9}, parent: p64(h5), tokens: []int64{9}, bs: 1})
		checkWants(t, rep, []want{
			{"b0.e0", StatusAgree, "", "", ""},
			{"b0.e1", StatusAgree, "", "", ""},
			{"b0.e2", StatusAgree, "", "", ""},
			{"b0.e3", StatusUnchecked, "", "", ""},
		})
		if q := tr.Requests[3]; !strings.Contains(q.Unknown, "2 cached pages have") {
			t.Fatalf("request 3: %q", q.Unknown)
		}
		if ids := strings.Join(tr.Requests[2].PageIDs, " "); ids != strings.Join([]string{itoa(h5) + "#1", itoa(h7) + "#2", itoa(h5) + "#3"}, " ") {
			t.Fatalf("page ids %s", ids)
		}
	})

	// Since PR #13488 the hashes are chained: the two 5s differ and every
	// request is judged as a vLLM stream's.
	t.Run("chained", func(t *testing.T) {
		hs, _ := sglChain(nil, 1, 5, 7, 5, 9)
		if hs[0] == hs[2] {
			t.Fatal("chained hashes of 5 at two places are equal")
		}
		var evs []any
		for i, tok := range []int64{5, 7, 5, 9} {
			ev := stored{hashes: []int64{hs[i]}, tokens: []int64{tok}, bs: 1}
			if i > 0 {
				ev.parent = p64(hs[i-1])
			}
			evs = append(evs, ev)
		}
		tr, rep := runSGLang(t, EventsOptions{}, 1, evs...)
		if hasNote(tr, "per-page") {
			t.Fatalf("chained stream read as per-page: %q", tr.Notes)
		}
		checkWants(t, rep, []want{
			{"b0.e0", StatusAgree, "", "", ""},
			{"b0.e1", StatusAgree, "", "", ""},
			{"b0.e2", StatusAgree, "", "", ""},
			{"b0.e3", StatusAgree, "", "", ""},
		})
	})
}

func itoa(v int64) string { return strconv.FormatInt(v, 10) }

// SGLang before PR #13488 announced the split of a radix node as the removal
// of its pages and their store again at the same place; the pages under the
// node stay cached, so a later hit through them is no evicted page.
func TestEventsSGLangSplitNode(t *testing.T) {
	h12, h34, h56, h78, h99, root := ppHash(1, 2), ppHash(3, 4), ppHash(5, 6), ppHash(7, 8), ppHash(9, 9), ppHash()
	tr, rep := runSGLang(t, EventsOptions{}, 2,
		// A = 1 2 3 4, one node.
		stored{hashes: []int64{h12}, parent: p64(root), tokens: []int64{1, 2}, bs: 2},
		stored{hashes: []int64{h34}, parent: p64(h12), tokens: []int64{3, 4}, bs: 2},
		// B = A 5 6, a node under A's.
		stored{hashes: []int64{h56}, parent: p64(h34), tokens: []int64{5, 6}, bs: 2},
		// C = 1 2 7 8 splits A's node into 1 2 and 3 4 (removed, stored
		// again), then stores 7 8 under 1 2.
		removed{hashes: []int64{h12}}, removed{hashes: []int64{h34}},
		stored{hashes: []int64{h12}, parent: p64(root), tokens: []int64{1, 2}, bs: 2},
		stored{hashes: []int64{h34}, parent: p64(h12), tokens: []int64{3, 4}, bs: 2},
		stored{hashes: []int64{h78}, parent: p64(h12), tokens: []int64{7, 8}, bs: 2},
		// D = B 9 9 reuses B's six tokens.
		stored{hashes: []int64{h99}, parent: p64(h56), tokens: []int64{9, 9}, bs: 2})
	checkWants(t, rep, []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b0.e1", StatusAgree, "", "", ""},
		{"b0.e2", StatusAgree, "", "", ""},
		{"b0.e7", StatusAgree, "", "", ""},
		{"b0.e8", StatusAgree, "", "", ""},
	})
	if !hasNote(tr, "2 BlockStored events stored again pages just removed") {
		t.Fatalf("notes %q", tr.Notes)
	}
}

// The scheme: auto reads a stream as per-page only when every stored block's
// hash is the per-page hash of its tokens (a vLLM stream never is); it can
// be forced either way; another name is an error.
func TestEventsHashScheme(t *testing.T) {
	h5, h7 := ppHash(5), ppHash(7)
	perPage := []any{
		stored{hashes: []int64{h5}, tokens: []int64{5}, bs: 1},
		stored{hashes: []int64{h7}, parent: p64(h5), tokens: []int64{7}, bs: 1},
		stored{hashes: []int64{h5}, parent: p64(h7), tokens: []int64{5}, bs: 1},
	}
	// Read as chained, the per-page stream's second 5 overwrites the first.
	_, rep := runSGLang(t, EventsOptions{HashScheme: HashChained}, 1, perPage...)
	if rep.Summary.Kinds[StatusDiverged+":"+KindOverwritten] != 1 {
		t.Fatalf("forced chained: kinds %v", rep.Summary.Kinds)
	}
	// One hash that is not the per-page one: chained.
	mixed := append([]any{}, perPage...)
	mixed = append(mixed, stored{hashes: []int64{99}, parent: p64(h5), tokens: []int64{9}, bs: 1})
	if tr, _ := runSGLang(t, EventsOptions{}, 1, mixed...); hasNote(tr, "per-page") {
		t.Fatalf("mixed stream read as per-page")
	}
	// Forced per-page on small hashes: placed by parent hash alone.
	tr, _ := runSGLang(t, EventsOptions{HashScheme: HashPerPage}, 1,
		stored{hashes: []int64{1}, parent: p64(ppHash()), tokens: []int64{5}, bs: 1},
		stored{hashes: []int64{1}, parent: p64(1), tokens: []int64{5}, bs: 1})
	if !hasNote(tr, "per-page") || tr.Requests[1].Hit == nil || tr.Requests[1].Hit.Tokens != 1 {
		t.Fatalf("forced per-page: %+v %q", tr.Requests, tr.Notes)
	}
	x := newEvEnc()
	x.sglangBatch(1, perPage...)
	b, err := DecodeEvents(x.buf.Bytes(), "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := EventsTrace(b, "x", EventsOptions{HashScheme: "sha"}); err == nil || !strings.Contains(err.Error(), `hash scheme "sha"`) {
		t.Fatalf("error %v", err)
	}
}

// With per-page hashes a removal of a hash several cached pages have
// removes none (which one went is not known): a later miss is a warning,
// not a divergence.
func TestEventsSGLangAmbiguousRemoval(t *testing.T) {
	h5, h7, h8, root := ppHash(5), ppHash(7), ppHash(8), ppHash()
	_, rep := runSGLang(t, EventsOptions{}, 1,
		stored{hashes: []int64{h5}, parent: p64(root), tokens: []int64{5}, bs: 1},
		stored{hashes: []int64{h7}, parent: p64(h5), tokens: []int64{7}, bs: 1},
		stored{hashes: []int64{h5}, parent: p64(h7), tokens: []int64{5}, bs: 1},
		// The engine evicts the leaf 5 (the stream cannot say which 5), a
		// request stores 5 7 8...
		removed{hashes: []int64{h5}},
		stored{hashes: []int64{h8}, parent: p64(h7), tokens: []int64{8}, bs: 1},
		// ... and another 5 7 5 again from 7: a miss of one page.
		stored{hashes: []int64{h5}, parent: p64(h7), tokens: []int64{5}, bs: 1})
	checkWants(t, rep, []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b0.e1", StatusAgree, "", "", ""},
		{"b0.e2", StatusAgree, "", "", ""},
		{"b0.e4", StatusAgree, "", "", ""},
		{"b0.e5", StatusWarn, KindMissedHit, CauseNone, "already cached"},
	})
}
