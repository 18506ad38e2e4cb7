package prefixcheck

import (
	"bytes"
	"strconv"
	"testing"
)

// FuzzRunTrace builds a small trace from the input (tokens over a tiny
// alphabet, hits, sources, namespaces, extra keys, page ids, evictions,
// clears, all three trace flags) and runs the check: it must not panic, its
// counts must add up, and its report must be the one made inserting every
// snapshot again (Runner.reinsertSnaps).
func FuzzRunTrace(f *testing.F) {
	f.Add([]byte{0})
	f.Add([]byte("a prefix-cache trace with hits, evictions and namespaces"))
	f.Add([]byte{7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20})
	f.Fuzz(func(t *testing.T, data []byte) {
		pos := 0
		next := func(n int) int {
			if n <= 1 || pos >= len(data) {
				return 0
			}
			v := int(data[pos]) % n
			pos++
			return v
		}
		flags := next(8)
		page := 1 + next(4)
		tr := Trace{HitsRecorded: flags&1 != 0, EvictionsRecorded: flags&2 != 0, ContentPageIDs: flags&4 != 0}
		var seen [][]int32
		for i := 0; i < 12 && pos < len(data); i++ {
			q := Request{ID: "r" + strconv.Itoa(i), Namespace: []string{"", "", "l1"}[next(3)]}
			n := next(20)
			if k := next(3); k > 0 && len(seen) > 0 {
				src := seen[next(len(seen))]
				q.Tokens = append(q.Tokens, src[:min(len(src), next(len(src)+1))]...)
			}
			for len(q.Tokens) < n {
				q.Tokens = append(q.Tokens, int32(next(3)))
			}
			if next(6) == 0 {
				q.Tokens, q.Unknown = nil, "not dumped"
			}
			if next(2) == 0 {
				q.Hit = &Hit{Tokens: next(len(q.Tokens) + 3), Source: "r" + strconv.Itoa(next(i+2))}
			}
			for p := 0; p < next(4); p++ {
				q.Extra = append(q.Extra, []string{"", "img"}[next(2)])
			}
			for p := 0; p < next(6); p++ {
				q.PageIDs = append(q.PageIDs, "p"+strconv.Itoa(next(5)))
			}
			if next(4) == 0 && len(seen) > 0 {
				src := seen[next(len(seen))]
				if m := len(src) / page * page; m > 0 {
					q.Evictions = append(q.Evictions, Eviction{Namespace: q.Namespace, Prefix: src[:m]})
				}
			}
			q.Clear = next(10) == 0
			if q.Tokens != nil {
				seen = append(seen, q.Tokens)
			}
			tr.Requests = append(tr.Requests, q)
		}
		cfg := Config{PageSize: page, Schedule: testCfg.Schedule, Capacity: next(3) * 8, ResumeAtEndOnly: next(2) == 0, Retain: next(3)}
		rep, err := Run(&tr, cfg)
		if err != nil {
			return
		}
		// The same report when every snapshot is inserted again (Add leaves
		// out those the cache holds).
		r, err := NewRunner(cfg, tr)
		if err != nil {
			t.Fatal(err)
		}
		r.reinsertSnaps = true
		r.rep.Notes = append(r.rep.Notes, tr.Notes...)
		for i := range tr.Requests {
			if _, err := r.Add(&tr.Requests[i]); err != nil {
				t.Fatalf("inserting every snapshot: %v", err)
			}
		}
		var j0, j1 bytes.Buffer
		if err := rep.WriteJSON(&j0); err != nil {
			t.Fatal(err)
		}
		if err := r.Report().WriteJSON(&j1); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(j0.Bytes(), j1.Bytes()) {
			t.Fatalf("report:\n%s\ninserting every snapshot:\n%s", j0.Bytes(), j1.Bytes())
		}
		s := rep.Summary
		if s.Agree+s.Warn+s.Diverged+s.Unchecked != s.Requests || s.Requests != len(tr.Requests) || rep.Diverged() != (s.Diverged > 0) {
			t.Fatalf("counts %+v for %d requests, verdict %s", s, len(tr.Requests), rep.Verdict)
		}
		var b bytes.Buffer
		rep.WriteText(&b)
		if err := rep.WriteJSON(&b); err != nil {
			t.Fatal(err)
		}
	})
}
