package prefixcheck

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strconv"
	"testing"

	"sparsemla/kvcache"
)

// snapsWorkload is a random trace of n requests over a tiny alphabet: most
// requests continue an earlier one (of any length: exactly it, a prefix of it
// ending on or off a page end, or it and more), in three namespaces, some
// with extra keys, page ids, unknown tokens or recorded hits that are right,
// too long or too short. With evictions the trace records the engine's
// evictions (pages of earlier requests, interior ones included) and a rare
// clear.
func snapsWorkload(rng *rand.Rand, P, n int, evictions bool) Trace {
	tr := Trace{Input: "snaps", PageSize: P, HitsRecorded: rng.IntN(3) > 0, EvictionsRecorded: evictions}
	var seen []Request
	for i := range n {
		q := Request{ID: "r" + strconv.Itoa(i), Namespace: []string{"", "", "a", "b"}[rng.IntN(4)]}
		if len(seen) > 0 && rng.IntN(5) > 0 {
			src := seen[rng.IntN(len(seen))]
			if rng.IntN(4) > 0 {
				q.Namespace = src.Namespace
			}
			k := len(src.Tokens)
			switch rng.IntN(4) {
			case 0: // a prefix ending on a page end
				k = rng.IntN(k/P+1) * P
			case 1: // a prefix ending anywhere
				k = rng.IntN(k + 1)
			}
			q.Tokens = append(q.Tokens, src.Tokens[:k]...)
			if rng.IntN(3) == 0 {
				q.Extra = src.Extra
			}
			if rng.IntN(2) == 0 {
				q.Hit = &Hit{Tokens: k / P * P, Source: src.ID}
				if rng.IntN(4) == 0 {
					q.Hit.Tokens = max(0, q.Hit.Tokens+P*(rng.IntN(3)-1))
				}
			}
		}
		for range rng.IntN(4 * P) {
			q.Tokens = append(q.Tokens, int32(rng.IntN(3)))
		}
		if rng.IntN(10) == 0 {
			q.Extra = append([]string{}, q.Extra...)
			q.Extra = append(q.Extra, "", "img"+strconv.Itoa(rng.IntN(2)))
		}
		if rng.IntN(8) == 0 {
			for p := range len(q.Tokens) / P {
				q.PageIDs = append(q.PageIDs, "p"+strconv.Itoa(p*7+rng.IntN(3)))
			}
		}
		switch rng.IntN(25) {
		case 0:
			q.Tokens, q.Unknown, q.Extra = nil, "not dumped", nil
		case 1:
			q.Unknown = "source not in the input"
		}
		if evictions && len(seen) > 0 {
			for range rng.IntN(3) {
				src := seen[rng.IntN(len(seen))]
				if m := len(src.Tokens) / P; m > 0 {
					e := Eviction{Namespace: src.Namespace, Prefix: src.Tokens[:(1+rng.IntN(m))*P], Extra: src.Extra}
					q.Evictions = append(q.Evictions, e)
				}
			}
			q.Clear = rng.IntN(40) == 0
		}
		if q.Tokens != nil {
			seen = append(seen, q)
		}
		tr.Requests = append(tr.Requests, q)
	}
	return tr
}

// TestRunnerSnapshotSkip runs varied workloads through two runners, one that
// leaves out the snapshots the cache already holds (Add's snapsFrom) and one
// that inserts a snapshot at every page end of every request (the behaviour
// before), and checks that every result, the report and the correct cache
// are the same: after every request the cache's accounting and invariants,
// at the end every page end of every request matched in both (what is
// cached, what is resumable and why not, the values) and the whole cache
// evicted in LRU order. Without ResumeAtEndOnly every page end of the cache
// must hold a snapshot after every request (the count snapsFrom checks).
func TestRunnerSnapshotSkip(t *testing.T) {
	skipped := map[bool]int{} // requests matched with a resumable prefix, by ResumeAtEndOnly
	for seed := range 48 {
		rng := rand.New(rand.NewPCG(uint64(seed), 99))
		P := []int{1, 2, 4, 16}[seed%4]
		evictions := seed%3 == 0
		n := 60
		if P == 1 {
			n = 150
		}
		tr := snapsWorkload(rng, P, n, evictions)
		sched := testCfg.Schedule
		if seed%2 == 1 {
			sched = v4FlashSchedule()
		}
		cfg := Config{PageSize: P, Schedule: sched, ResumeAtEndOnly: seed%8 >= 4, Retain: rng.IntN(3) * 8}
		if !evictions && rng.IntN(3) > 0 {
			cfg.Capacity = (4 + rng.IntN(12)) * P
		}
		t.Run(fmt.Sprintf("seed%d/P%d/atEnd=%v/cap%d/ev=%v", seed, P, cfg.ResumeAtEndOnly, cfg.Capacity, evictions), func(t *testing.T) {
			rs := [2]*Runner{}
			for k := range rs {
				r, err := NewRunner(cfg, tr)
				if err != nil {
					t.Fatal(err)
				}
				rs[k] = r
			}
			rs[1].reinsertSnaps = true
			for i := range tr.Requests {
				var res [2]*Result
				for k, r := range rs {
					q := tr.Requests[i] // Add may not change it; each runner gets its own copy anyway
					var err error
					if res[k], err = r.Add(&q); err != nil {
						t.Fatal(err)
					}
					if err := r.cache.CheckInvariants(); err != nil {
						t.Fatalf("request %d, runner %d: %v", i, k, err)
					}
				}
				if !reflect.DeepEqual(res[0], res[1]) {
					t.Fatalf("request %d: result %+v, inserting every snapshot %+v", i, res[0], res[1])
				}
				u0, u1 := rs[0].cache.Usage(), rs[1].cache.Usage()
				if u0 != u1 {
					t.Fatalf("request %d: usage %+v, inserting every snapshot %+v", i, u0, u1)
				}
				if !cfg.ResumeAtEndOnly && u0.Snapshots*P != u0.Tokens {
					t.Fatalf("request %d: %d snapshots for %d page ends", i, u0.Snapshots, u0.Tokens/P)
				}
				if res[0].Truth != nil && res[0].Truth.Tokens > 0 {
					skipped[cfg.ResumeAtEndOnly]++
				}
			}
			var js [2]bytes.Buffer
			for k, r := range rs {
				if err := r.Report().WriteJSON(&js[k]); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(js[0].Bytes(), js[1].Bytes()) {
				t.Fatalf("reports differ:\n%s\ninserting every snapshot:\n%s", js[0].Bytes(), js[1].Bytes())
			}
			// Every page end of every request, matched in both caches.
			for _, q := range tr.Requests {
				if q.Tokens == nil {
					continue
				}
				for end := P; end <= len(q.Tokens); end += P {
					var ms [2]kvcache.Match
					for k, r := range rs {
						keys := r.fold(q.Tokens, q.Extra)
						ms[k] = r.cache.MatchPrefixNS(q.Namespace, keys[:end], false)
						ms[k].Node = kvcache.Handle{}
					}
					if !reflect.DeepEqual(ms[0], ms[1]) {
						t.Fatalf("request %q, prefix %d: match %+v, inserting every snapshot %+v", q.ID, end, ms[0], ms[1])
					}
				}
			}
			e0, e1 := rs[0].cache.Evict(1<<62), rs[1].cache.Evict(1<<62)
			if !reflect.DeepEqual(e0, e1) {
				t.Fatalf("evicted %+v, inserting every snapshot %+v", e0, e1)
			}
		})
	}
	if skipped[false] < 100 || skipped[true] < 100 {
		t.Fatalf("requests with a resumable hit: %v (too few to exercise the skip)", skipped)
	}
}

// A cache lacking snapshots at interior page ends without ResumeAtEndOnly
// (which Add never makes: here the cache is rebuilt by hand with A's end
// snapshot only) has fewer snapshots than page ends, so Add inserts them all
// again, as inserting every snapshot does: B, which extends A, adds the
// resume points at A's interior page ends.
func TestRunnerSnapshotSkipShortCount(t *testing.T) {
	cfg := Config{PageSize: 4, Schedule: testCfg.Schedule}
	a, b := req("A", "abcdefghijkl", 0, ""), req("B", "abcdefghijklmnop", 12, "A")
	var us [2]kvcache.Usage
	for k := range us {
		r, err := NewRunner(cfg, Trace{HitsRecorded: true})
		if err != nil {
			t.Fatal(err)
		}
		r.reinsertSnaps = k == 1
		if _, err := r.Add(&a); err != nil {
			t.Fatal(err)
		}
		r.cache = kvcache.NewRadixCache(4, cfg.Schedule, kvcache.Sizes{})
		vals := make([]int64, len(a.Tokens))
		for i := range vals {
			vals[i] = val(0, i)
		}
		r.cache.Insert(a.Tokens, vals, []kvcache.Snapshot{{At: 12, StateFrom: cfg.Schedule.StateFrom(12)}})
		res, err := r.Add(&b)
		if err != nil {
			t.Fatal(err)
		}
		if res.Status != StatusAgree || res.Truth.Tokens != 12 {
			t.Fatalf("runner %d: B %+v, truth %+v", k, res, res.Truth)
		}
		us[k] = r.cache.Usage()
		for end := 4; end <= 16; end += 4 {
			if m := r.cache.MatchPrefix(b.Tokens[:end], false); m.Len != end {
				t.Fatalf("runner %d: prefix %d resumes at %d (%v)", k, end, m.Len, m.Refusal)
			}
		}
	}
	if us[0] != us[1] || us[0].Snapshots != 4 {
		t.Fatalf("usage %+v, inserting every snapshot %+v", us[0], us[1])
	}
}
