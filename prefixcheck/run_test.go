package prefixcheck

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"sparsemla/kvcache"
)

func tk(s string) []int32 {
	out := make([]int32, len(s))
	for i, c := range s {
		out[i] = int32(c)
	}
	return out
}

var testCfg = Config{PageSize: 4, Schedule: kvcache.Schedule{Window: 4, Ratios: []int{0, 4, 128}}}

func req(id, toks string, hit int, src string) Request {
	r := Request{ID: id, Tokens: tk(toks)}
	if hit > 0 || src != "" {
		r.Hit = &Hit{Tokens: hit, Source: src}
	}
	return r
}

type want struct {
	id, status, kind, cause, detail string
}

func TestVerdicts(t *testing.T) {
	withNS := func(r Request, ns string) Request { r.Namespace = ns; return r }
	withPages := func(r Request, ids ...string) Request { r.PageIDs = ids; return r }
	withExtra := func(r Request, ex ...string) Request { r.Extra = ex; return r }
	evict := func(r Request, prefixes ...string) Request {
		for _, p := range prefixes {
			r.Evictions = append(r.Evictions, Eviction{Prefix: tk(p)})
		}
		return r
	}
	cases := []struct {
		name  string
		trace Trace
		cfg   Config
		want  []want
	}{
		{"agree", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), req("B", "abcdwxyz", 4, "A")}}, testCfg,
			[]want{{"A", StatusAgree, "", "", ""}, {"B", StatusAgree, "", "", ""}}},
		{"hit longer than the common prefix", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), req("B", "abcdxyzw", 8, "A")}}, testCfg,
			[]want{{"A", StatusAgree, "", "", ""}, {"B", StatusDiverged, KindHitTooLong, "", "share only 4: token 4 is 120 here, 101 there"}}},
		{"hit longer than the source", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcd", 0, ""), req("B", "abcdefgh", 8, "A")}}, testCfg,
			[]want{{"B", StatusDiverged, KindHitTooLong, "", "which has only 4 tokens"}}},
		{"multimodal extra keys differ", Trace{HitsRecorded: true, Requests: []Request{
			withExtra(req("A", "abcdefgh", 0, ""), "", "img1"), withExtra(req("B", "abcdefgh", 8, "A"), "", "img2")}}, testCfg,
			[]want{{"B", StatusDiverged, KindHitTooLong, "", "page 1's extra keys (multimodal input) differ"}}},
		{"namespace mixing", Trace{HitsRecorded: true, Requests: []Request{
			withNS(req("A", "abcdefgh", 0, ""), "lora-1"), withNS(req("B", "abcdefgh", 8, "A"), "lora-2")}}, testCfg,
			[]want{{"B", StatusDiverged, KindNamespaceMix, "", `namespace "lora-1"`}}},
		{"unaligned hit", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefghij", 0, ""), req("B", "abcdefghij", 10, "A")}}, testCfg,
			[]want{{"B", StatusDiverged, KindBeyondCache, "", "not a whole number of pages (4)"}}},
		{"source not arrived", Trace{HitsRecorded: true, Requests: []Request{
			req("B", "abcdefgh", 4, "Z")}}, testCfg,
			[]want{{"B", StatusDiverged, KindBeyondCache, "", "had not arrived"}}},
		{"hit on a page the engine evicted", Trace{HitsRecorded: true, EvictionsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), evict(req("B", "abcdefgh", 8, "A"), "abcdefgh")}}, testCfg,
			[]want{{"B", StatusDiverged, KindEvicted, "", "evicted by the engine before request \"B\""}}},
		{"hit on a page the model evicted", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), req("C", "wxyzwxyz", 0, ""), req("B", "abcdefgh", 8, "A")}},
			Config{PageSize: 4, Schedule: testCfg.Schedule, Capacity: 8},
			[]want{{"B", StatusWarn, KindEvicted, "", "capacity 8 tokens) before request \"C\""}}},
		{"resume beyond the kept state", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), req("B", "abcdxxxx", 4, "A")}},
			Config{PageSize: 4, Schedule: testCfg.Schedule, ResumeAtEndOnly: true},
			[]want{{"B", StatusDiverged, KindResumeBeyond, "", "no compressor-state snapshot kept at token 4"}}},
		{"missed hit, evictions recorded", Trace{HitsRecorded: true, EvictionsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), req("B", "abcdefgh", 0, "")}}, testCfg,
			[]want{{"B", StatusDiverged, KindMissedHit, CauseNone, "held 8 resumable tokens"}}},
		{"missed hit, no eviction record", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), req("B", "abcdefgh", 0, "")}}, testCfg,
			[]want{{"B", StatusWarn, KindMissedHit, CauseNone, "may have evicted them"}}},
		{"miss from alignment", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcxxxxx", 0, ""), req("B", "abcyyyyy", 0, "")}}, testCfg,
			[]want{{"B", StatusAgree, KindMissedHit, CauseAlignment, "shares 3 tokens with request \"A\""}}},
		{"miss from alignment after a hit", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefgxxx", 0, ""), req("B", "abcdefgyyy", 4, "A")}}, testCfg,
			[]want{{"B", StatusAgree, KindMissedHit, CauseAlignment, "shares 7 tokens"}}},
		{"miss from namespace", Trace{HitsRecorded: true, Requests: []Request{
			withNS(req("A", "abcdefgh", 0, ""), "l1"), withNS(req("B", "abcdefgh", 0, ""), "l2")}}, testCfg,
			[]want{{"B", StatusAgree, KindMissedHit, CauseNamespace, `namespace "l1"`}}},
		{"miss from eviction", Trace{HitsRecorded: true, EvictionsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), evict(req("B", "abcdefgh", 4, "A"), "abcdefgh")}}, testCfg,
			[]want{{"B", StatusAgree, KindMissedHit, CauseEviction, "evicted by the engine"}}},
		{"overwritten physical page", Trace{HitsRecorded: true, Requests: []Request{
			withPages(req("A", "abcdefgh", 0, ""), "p1", "p2"), withPages(req("C", "wxyzwxyz", 0, ""), "p3", "p2"),
			withPages(req("B", "abcdefgh", 8, "A"), "p1", "p2")}}, testCfg,
			[]want{{"C", StatusAgree, "", "", ""}, {"B", StatusDiverged, KindOverwritten, "", "page p2 for tokens [4, 8), but that page holds request \"C\"'s"}}},
		{"one content address, two contents", Trace{HitsRecorded: true, ContentPageIDs: true, Requests: []Request{
			withPages(req("A", "abcdefgh", 0, ""), "h1", "h2"), withPages(req("C", "wxyzwxyz", 0, ""), "h3", "h2")}}, testCfg,
			[]want{{"C", StatusDiverged, KindOverwritten, "", "still holds request \"A\"'s"}}},
		{"tokens not recorded", Trace{HitsRecorded: true, Requests: []Request{
			req("A", "abcdefgh", 0, ""), {ID: "B", Unknown: "no tok records before step 8", Hit: &Hit{Tokens: 8, Source: "A"}}}}, testCfg,
			[]want{{"B", StatusUnchecked, "", "", "no tok records"}}},
		{"hits not recorded", Trace{Requests: []Request{req("A", "abcdefgh", 0, "")}}, testCfg,
			[]want{{"A", StatusUnchecked, "", "", "records no hit"}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rep, err := Run(&c.trace, c.cfg)
			if err != nil {
				t.Fatal(err)
			}
			byID := map[string]Result{}
			for _, r := range rep.Requests {
				byID[r.ID] = r
			}
			diverged := false
			for _, w := range c.want {
				r := byID[w.id]
				if r.Status != w.status || r.Kind != w.kind || r.Cause != w.cause || !strings.Contains(r.Detail, w.detail) {
					t.Errorf("request %s: %s %s (%s): %q\nwant %s %s (%s) containing %q", w.id, r.Status, r.Kind, r.Cause, r.Detail, w.status, w.kind, w.cause, w.detail)
				}
			}
			for _, r := range rep.Requests {
				diverged = diverged || r.Status == StatusDiverged
			}
			if rep.Diverged() != diverged || (rep.ExitCode() == 1) != diverged {
				t.Errorf("verdict %s exit %d with diverged=%v", rep.Verdict, rep.ExitCode(), diverged)
			}
			var txt, js bytes.Buffer
			rep.WriteText(&txt)
			if err := rep.WriteJSON(&js); err != nil {
				t.Fatal(err)
			}
			var back Report
			if err := json.Unmarshal(js.Bytes(), &back); err != nil || back.Verdict != rep.Verdict || len(back.Requests) != len(rep.Requests) {
				t.Fatalf("JSON round trip: %v", err)
			}
			if diverged && !strings.Contains(txt.String(), "first divergence: request") {
				t.Errorf("text report lacks the first divergence:\n%s", txt.String())
			}
		})
	}
}

// The correct cache's hit names its pages, source and V4 resume point.
func TestTruthHitDetail(t *testing.T) {
	tr := Trace{HitsRecorded: true, Requests: []Request{
		req("A", "abcdefgh", 0, ""), req("C", "abcdefghijkl", 8, "A"), req("B", "abcdefghijklmn", 12, "C")}}
	cfg := Config{PageSize: 4, Schedule: kvcache.Schedule{Window: 6, Ratios: []int{0, 4}}}
	rep, err := Run(&tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	b := rep.Requests[2]
	if b.Status != StatusAgree || b.Truth.Tokens != 12 || b.Truth.Source != "C" {
		t.Fatalf("B: %+v truth %+v", b, b.Truth)
	}
	wantPages := []PageRun{{"A", 0, 2}, {"C", 2, 3}}
	if len(b.Truth.Pages) != 2 || b.Truth.Pages[0] != wantPages[0] || b.Truth.Pages[1] != wantPages[1] {
		t.Fatalf("pages %+v, want %+v", b.Truth.Pages, wantPages)
	}
	// Resume at 12: window rows [6, 12), compressor state from 12 - 0 - 4 = 8 (halo).
	if r := b.Truth.Resume; *r != (Resume{At: 12, WindowFrom: 6, StateFrom: 8, IndexKeys: 3, Halo: true}) {
		t.Fatalf("resume %+v", *r)
	}
	var txt bytes.Buffer
	rep.WriteText(&txt)
	if !strings.Contains(txt.String(), "agree: 3 requests: 3 agree") {
		t.Fatalf("text:\n%s", txt.String())
	}
}

func TestRunErrors(t *testing.T) {
	for _, c := range []struct {
		tr   Trace
		cfg  Config
		want string
	}{
		{Trace{Requests: []Request{req("A", "ab", 0, ""), req("A", "cd", 0, "")}}, testCfg, "arrives twice"},
		{Trace{Requests: []Request{{ID: "A", Tokens: tk("abcd"), Hit: &Hit{Tokens: -1}}}}, testCfg, "negative hit length"},
		{Trace{Requests: []Request{{ID: "A", Tokens: tk("abcd"), Evictions: []Eviction{{Prefix: tk("abc")}}}}}, testCfg, "not a whole number of pages"},
		{Trace{}, Config{}, "page size 0"},
		{Trace{PageSize: 16, Input: "x"}, testCfg, "records page size 16"},
	} {
		if _, err := Run(&c.tr, c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("error %v, want %q", err, c.want)
		}
	}
}

// With Retain, an old source's tokens are dropped and the hit is compared
// page by page through the chain hashes.
func TestRetainComparesOldSourcesByPage(t *testing.T) {
	tr := Trace{HitsRecorded: true, Requests: []Request{
		req("A", "abcdefgh", 0, ""), req("X", "zzzz", 0, ""), req("B", "abcdxyzw", 8, "A"), req("C", "abcdefgh", 8, "A")}}
	cfg := testCfg
	cfg.Retain = 1
	rep, err := Run(&tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	checkWants(t, rep, []want{
		{"A", StatusAgree, "", "", ""}, {"X", StatusAgree, "", "", ""},
		{"B", StatusDiverged, KindHitTooLong, "", "page 1 (tokens [4, 8)) differs (that request's tokens are no longer retained"},
		{"C", StatusAgree, "", "", ""},
	})
}

// Brief reports list only what is not a plain agreement; the counts cover all.
func TestBriefReport(t *testing.T) {
	tr := Trace{HitsRecorded: true, Requests: []Request{req("A", "abcdefgh", 0, ""), req("B", "abcdxyzw", 8, "A"), req("C", "abcdwxyz", 4, "A")}}
	cfg := testCfg
	cfg.Brief = true
	rep, err := Run(&tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Requests) != 1 || rep.Requests[0].ID != "B" || rep.Summary.Requests != 3 || rep.First.ID != "B" {
		t.Fatalf("%+v", rep)
	}
}

func TestTextCapsLines(t *testing.T) {
	tr := Trace{}
	for i := 0; i < 25; i++ {
		tr.Requests = append(tr.Requests, req(strings.Repeat("r", i+1), "abcd", 0, ""))
	}
	rep, err := Run(&tr, testCfg)
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	rep.WriteText(&b)
	if n := strings.Count(b.String(), "  unchecked: "); n != 20 || !strings.Contains(b.String(), "(5 more unchecked requests") {
		t.Fatalf("%d lines:\n%s", n, b.String())
	}
	rep.TextAll = true
	b.Reset()
	rep.WriteText(&b)
	if n := strings.Count(b.String(), "  unchecked: "); n != 25 {
		t.Fatalf("TextAll: %d lines", n)
	}
}

// A request that could not be judged makes the report incomplete (exit 3,
// as replay's), never agree: agree needs every request judged. A divergence
// among the judged ones still makes it diverged.
func TestIncompleteVerdict(t *testing.T) {
	unknown := Request{ID: "u", Unknown: "the request's tokens are not recorded"}
	for _, c := range []struct {
		name    string
		reqs    []Request
		hits    bool
		verdict string
		exit    int
		text    string
	}{
		{"all judged", []Request{req("a", "abcdefgh", 0, ""), req("b", "abcdxyzw", 4, "a")}, true, VerdictAgree, 0, ""},
		{"none judged", []Request{req("a", "abcd", 0, ""), req("b", "abcd", 0, "")}, false, VerdictIncomplete, 3,
			"incomplete: none of the 2 requests could be judged"},
		{"one not judged", []Request{req("a", "abcdefgh", 0, ""), unknown, req("b", "abcdxyzw", 4, "a")}, true, VerdictIncomplete, 3,
			"incomplete: 1 of the 3 requests could not be judged"},
		{"one not judged, one wrong", []Request{req("a", "abcdefgh", 0, ""), unknown, req("b", "abcdxyzw", 8, "a")}, true, VerdictDiverged, 1, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			tr := Trace{Requests: c.reqs, HitsRecorded: c.hits}
			rep, err := Run(&tr, testCfg)
			if err != nil {
				t.Fatal(err)
			}
			var b bytes.Buffer
			rep.WriteText(&b)
			first, _, _ := strings.Cut(b.String(), "\n")
			if rep.Verdict != c.verdict || rep.ExitCode() != c.exit || !strings.Contains(first, ": "+c.verdict+": ") ||
				(c.text != "") != strings.Contains(b.String(), "  incomplete: ") || !strings.Contains(b.String(), c.text) {
				t.Errorf("verdict %s exit %d, want %s %d and %q:\n%s", rep.Verdict, rep.ExitCode(), c.verdict, c.exit, c.text, b.String())
			}
		})
	}
}
