package prefixcheck

import (
	"testing"
)

// perPageScaleStream is a per-page SGLang stream (page size 1) of n pages
// stored under the root, each with its own token, then what more appends.
func perPageScaleStream(n int, more func(evs []any) []any) []byte {
	root := ppHash()
	evs := make([]any, 0, 3*n)
	for k := range n {
		tok := int64(1000 + k)
		evs = append(evs, stored{hashes: []int64{ppHash(tok)}, parent: p64(root), tokens: []int64{tok}, bs: 1})
	}
	evs = more(evs)
	x := newEvEnc()
	x.sglangBatch(1, evs...)
	return x.buf.Bytes()
}

// Work per event must not grow with the pages of one hash or with the
// removals pending: 100,000 pages of one content, each under its own
// parent, and 100,000 pages removed and then stored again at their places
// (a split announced so), each take a second at most here; a scan of the
// hash's pages or of the pending removals per block made both quadratic
// (minutes).
func TestEventsPerPageScale(t *testing.T) {
	const n = 100_000
	same := ppHash(7)
	cases := map[string]struct {
		data     []byte
		requests int
	}{
		"one content at many places": {perPageScaleStream(n, func(evs []any) []any {
			for k := range n {
				evs = append(evs, stored{hashes: []int64{same}, parent: p64(ppHash(int64(1000 + k))), tokens: []int64{7}, bs: 1})
			}
			return evs
		}), 2 * n},
		"removed and stored again": {perPageScaleStream(n, func(evs []any) []any {
			for k := range n {
				evs = append(evs, removed{hashes: []int64{ppHash(int64(1000 + k))}})
			}
			for k := n - 1; k >= 0; k-- {
				tok := int64(1000 + k)
				evs = append(evs, stored{hashes: []int64{ppHash(tok)}, parent: p64(ppHash()), tokens: []int64{tok}, bs: 1})
			}
			return evs
		}), n},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			b, err := DecodeEvents(c.data, "x")
			if err != nil {
				t.Fatal(err)
			}
			tr, err := EventsTrace(b, "x", EventsOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(tr.Requests) != c.requests {
				t.Fatalf("%d requests, want %d", len(tr.Requests), c.requests)
			}
			for i, q := range tr.Requests {
				if q.Unknown != "" || len(q.Evictions) != 0 {
					t.Fatalf("request %d: unknown %q, %d evictions", i, q.Unknown, len(q.Evictions))
				}
			}
		})
	}
}
