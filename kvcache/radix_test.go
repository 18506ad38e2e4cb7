package kvcache

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
)

// ---------------------------------------------------------------------------
// A simple model of the radix cache: a map from every cached page-aligned
// prefix to its state. No tree, no splitting, no LRU order.

type mPage struct {
	vals   []int64 // the values of this prefix's last page
	lock   int
	window bool
	snap   *Snapshot // snapshot at the end of this prefix
}

type radixModel struct {
	page  int
	sched Schedule
	p     map[string]*mPage // key: pageKey(prefix)
}

func newRadixModel(page int, sched Schedule) *radixModel {
	return &radixModel{page: page, sched: sched, p: map[string]*mPage{}}
}

func (m *radixModel) matched(tokens []int32) int {
	n := 0
	for n+m.page <= len(tokens) {
		if _, ok := m.p[pageKey(tokens[:n+m.page])]; !ok {
			break
		}
		n += m.page
	}
	return n
}

func (m *radixModel) insert(tokens []int32, vals []int64, snaps []Snapshot) int {
	n := len(tokens) / m.page * m.page
	existing := m.matched(tokens[:n])
	for e := existing + m.page; e <= n; e += m.page {
		m.p[pageKey(tokens[:e])] = &mPage{vals: append([]int64(nil), vals[e-m.page:e]...), window: true}
	}
	for _, s := range snaps {
		pg := m.p[pageKey(tokens[:s.At])]
		if pg.snap == nil || pg.snap.StateFrom > s.StateFrom {
			s := s
			pg.snap = &s
		}
	}
	return existing
}

// resumable is the definition the cache must implement (Schedule.Needs).
func (m *radixModel) resumable(tokens []int32, at int) bool {
	if at == 0 {
		return true
	}
	pg := m.p[pageKey(tokens[:at])]
	need := m.sched.Needs(at)
	if pg.snap == nil || pg.snap.StateFrom > need.StateFrom {
		return false
	}
	for e := m.page; e <= at; e += m.page {
		if e > need.WindowFrom && !m.p[pageKey(tokens[:e])].window {
			return false
		}
	}
	return true
}

func (m *radixModel) match(tokens []int32) (matched, best int, vals []int64) {
	n := len(tokens) / m.page * m.page
	matched = m.matched(tokens[:n])
	for best = matched; best > 0 && !m.resumable(tokens, best); best -= m.page {
	}
	for e := m.page; e <= best; e += m.page {
		vals = append(vals, m.p[pageKey(tokens[:e])].vals...)
	}
	return matched, best, vals
}

func (m *radixModel) lock(tokens []int32, end, d int) {
	for e := m.page; e <= end; e += m.page {
		m.p[pageKey(tokens[:e])].lock += d
	}
}

func (m *radixModel) isLeaf(prefix []int32) bool {
	for k := range m.p {
		if len(k) > 4*len(prefix) && strings.HasPrefix(k, pageKey(prefix)) {
			return false
		}
	}
	return true
}

func (m *radixModel) usage() Usage {
	var u Usage
	for _, pg := range m.p {
		u.Tokens += m.page
		if pg.lock > 0 {
			u.Protected += m.page
		} else {
			u.Evictable += m.page
		}
		if pg.window {
			u.WindowTokens += m.page
		}
		if pg.snap != nil {
			u.Snapshots++
		}
	}
	return u
}

// ---------------------------------------------------------------------------
// The driver: one random operation sequence applied to the cache and the model.

type lockRec struct {
	h      Handle
	tokens []int32
}

type radixRun struct {
	t     testing.TB
	c     *RadixCache
	m     *radixModel
	locks []lockRec
	next  int64
}

func newRadixRun(t testing.TB, page int) *radixRun {
	sched := Schedule{Window: 8, Ratios: []int{0, 4, 16}}
	return &radixRun{t: t, c: NewRadixCache(page, sched, Sizes{1, 1, 1}), m: newRadixModel(page, sched)}
}

// seq draws a token sequence over a tiny alphabet so prefixes are shared.
func seqFrom(next func(int) int, maxLen int) []int32 {
	n := next(maxLen + 1)
	s := make([]int32, n)
	for i := range s {
		s[i] = int32(next(3))
	}
	return s
}

func (r *radixRun) step(next func(int) int) {
	t := r.t
	switch op := next(10); {
	case op < 4: // insert with random snapshots, some lacking the ratio-4 halo
		toks := seqFrom(next, 24)
		vals := make([]int64, len(toks))
		for i := range vals {
			r.next++
			vals[i] = r.next
		}
		n := len(toks) / r.c.page * r.c.page
		var snaps []Snapshot
		for at := r.c.page; at <= n; at += r.c.page {
			if next(2) == 0 {
				from := r.m.sched.Needs(at).StateFrom
				if next(3) == 0 {
					from = at // keeps only the unfinished group: no halo
				}
				snaps = append(snaps, Snapshot{At: at, StateFrom: from})
			}
		}
		for i := len(snaps) - 1; i > 0; i-- { // in any order
			j := next(i + 1)
			snaps[i], snaps[j] = snaps[j], snaps[i]
		}
		want := r.m.insert(toks, vals, snaps)
		got, _ := r.c.Insert(toks, vals, snaps)
		if got != want {
			t.Fatalf("Insert(%v) existing = %d, model %d", toks, got, want)
		}
	case op < 7: // match, maybe locking
		toks := seqFrom(next, 24)
		lock := next(2) == 0
		mt, best, vals := r.m.match(toks)
		got := r.c.MatchPrefix(toks, lock)
		if got.Matched != mt || got.Len != best || !slices.Equal(got.Vals, vals) || got.Node.End() != best {
			t.Fatalf("MatchPrefix(%v) = matched %d len %d vals %v end %d; model %d %d %v", toks, got.Matched, got.Len, got.Vals, got.Node.End(), mt, best, vals)
		}
		if (got.Refusal != nil) != (best < mt) {
			t.Fatalf("MatchPrefix(%v): refusal %v with len %d < matched %d", toks, got.Refusal, best, mt)
		}
		if lock && best > 0 {
			r.m.lock(toks, best, +1)
			r.locks = append(r.locks, lockRec{got.Node, toks[:best]})
		}
	case op < 8: // unlock one
		if len(r.locks) == 0 {
			return
		}
		i := next(len(r.locks))
		l := r.locks[i]
		r.locks = append(r.locks[:i], r.locks[i+1:]...)
		r.c.Unlock(l.h)
		r.m.lock(l.tokens, len(l.tokens), -1)
	case op < 9: // evict
		k := next(20)
		r.checkEvicted(r.c.Evict(k), k, false)
	default: // drop windows
		k := next(12)
		r.checkEvicted(r.c.EvictWindows(k), k, true)
	}
	if err := r.c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	got, want := r.c.Usage(), r.m.usage()
	got.Nodes, got.Bytes = 0, 0
	if got != want {
		t.Fatalf("usage %+v, model %+v", got, want)
	}
}

func (r *radixRun) checkEvicted(ev []Evicted, k int, windows bool) {
	t := r.t
	freed := 0
	for _, e := range ev {
		if len(e.Vals) != len(e.Prefix)-e.Start {
			t.Fatalf("evicted node [%d, %d) with %d values", e.Start, len(e.Prefix), len(e.Vals))
		}
		if !windows && !r.m.isLeaf(e.Prefix) {
			t.Fatalf("evicted %v, which is not a leaf", e.Prefix)
		}
		for end := len(e.Prefix); end > e.Start; end -= r.c.page {
			pg := r.m.p[pageKey(e.Prefix[:end])]
			if pg == nil || pg.lock != 0 || (windows && !pg.window) {
				t.Fatalf("evicted prefix %v page ending %d: %+v (must exist, unlocked)", e.Prefix, end, pg)
			}
			if windows {
				pg.window = false
			} else {
				delete(r.m.p, pageKey(e.Prefix[:end]))
			}
		}
		freed += len(e.Prefix) - e.Start
	}
	if freed < k { // only when nothing else was evictable
		for key, pg := range r.m.p {
			prefix := make([]int32, len(key)/4)
			for i := range prefix {
				prefix[i] = int32(uint32(key[4*i]) | uint32(key[4*i+1])<<8 | uint32(key[4*i+2])<<16 | uint32(key[4*i+3])<<24)
			}
			if pg.lock == 0 && ((windows && pg.window) || (!windows && r.m.isLeaf(prefix))) {
				t.Fatalf("freed %d < %d tokens but %v is still evictable", freed, k, prefix)
			}
		}
	}
}

// releaseAll unlocks everything, evicts everything and checks that the
// accounting is back to zero.
func (r *radixRun) releaseAll() {
	for _, l := range r.locks {
		r.c.Unlock(l.h)
	}
	r.locks = nil
	r.c.Evict(1 << 30)
	if u := r.c.Usage(); u != (Usage{}) {
		r.t.Fatalf("after releasing everything: %+v", u)
	}
	if err := r.c.CheckInvariants(); err != nil {
		r.t.Fatal(err)
	}
}

func TestRadixPropertyAgainstModel(t *testing.T) {
	steps := 800
	if testing.Short() {
		steps = 200
	}
	for seed := uint64(1); seed <= 4; seed++ {
		for _, page := range []int{1, 2, 4} {
			rng := rand.New(rand.NewPCG(seed, uint64(page)))
			r := newRadixRun(t, page)
			for i := 0; i < steps; i++ {
				r.step(rng.IntN)
			}
			r.releaseAll()
		}
	}
}

// ---------------------------------------------------------------------------
// Hand cases.

func toks(s string) []int32 {
	out := make([]int32, len(s))
	for i, c := range s {
		out[i] = int32(c)
	}
	return out
}

func iota64(from, n int) []int64 {
	v := make([]int64, n)
	for i := range v {
		v[i] = int64(from + i)
	}
	return v
}

func TestRadixPageAlignedSplitAndResume(t *testing.T) {
	sched := Schedule{Window: 4, Ratios: []int{0, 4}}
	c := NewRadixCache(4, sched, Sizes{PrefixBytesPerToken: 10, WindowBytesPerToken: 100, SnapshotBytes: 1000})
	// "abcdefghij" caches 8 tokens (the 2-token tail is dropped), snapshot at 8 with the halo.
	if ex, _ := c.Insert(toks("abcdefghij"), iota64(0, 10), []Snapshot{{At: 8, StateFrom: 4}}); ex != 0 {
		t.Fatalf("existing %d", ex)
	}
	// "abcdxyzw" shares one page: the node splits at 4; no snapshot at 4.
	if ex, _ := c.Insert(toks("abcdxyzw"), iota64(100, 8), nil); ex != 4 {
		t.Fatalf("existing %d, want 4", ex)
	}
	m := c.MatchPrefix(toks("abcdefgh??"), false)
	if m.Matched != 8 || m.Len != 8 || !slices.Equal(m.Vals, iota64(0, 8)) || m.Refusal != nil {
		t.Fatalf("match %+v", m)
	}
	// Matching inside a node stops at a page boundary (7 → 4); 4 has no snapshot.
	m = c.MatchPrefix(toks("abcdefg"), false)
	if m.Matched != 4 || m.Len != 0 || m.Refusal == nil || !strings.Contains(m.Refusal.Reason, "no compressor-state snapshot") {
		t.Fatalf("match %+v", m)
	}
	// The second branch was inserted without a snapshot: not resumable.
	m = c.MatchPrefix(toks("abcdxyzw"), false)
	if m.Matched != 8 || m.Len != 0 {
		t.Fatalf("match %+v", m)
	}
	// A snapshot without the ratio-4 overlap halo (state only from token 8) is refused at 8.
	c.Insert(toks("abcdxyzw"), iota64(200, 8), []Snapshot{{At: 8, StateFrom: 8}})
	m = c.MatchPrefix(toks("abcdxyzw"), false)
	if m.Len != 0 || m.Refusal == nil || !strings.Contains(m.Refusal.Reason, "overlap halo") {
		t.Fatalf("match %+v", m)
	}
	// Adding the halo later makes it resumable, with the original values.
	c.Insert(toks("abcdxyzw"), iota64(300, 8), []Snapshot{{At: 8, StateFrom: 4}})
	m = c.MatchPrefix(toks("abcdxyzw"), true)
	want := append(iota64(0, 4), iota64(104, 4)...)
	if m.Len != 8 || !slices.Equal(m.Vals, want) {
		t.Fatalf("match %+v, want vals %v", m, want)
	}
	u := c.Usage()
	if u.Tokens != 12 || u.Protected != 8 || u.Evictable != 4 || u.Snapshots != 2 || u.Bytes != 12*10+12*100+2*1000 {
		t.Fatalf("usage %+v", u)
	}
	// Dropping windows skips the locked branch; the snapshot at 8 of "abcdefgh"
	// loses its window rows and stops being a resume point.
	c.EvictWindows(1)
	m2 := c.MatchPrefix(toks("abcdefgh"), false)
	if m2.Len != 0 || m2.Refusal == nil || !strings.Contains(m2.Refusal.Reason, "window rows of tokens [4, 8) were evicted") {
		t.Fatalf("after window eviction: %+v", m2)
	}
	// Evict cannot take the locked branch.
	c.Evict(100)
	if u := c.Usage(); u.Tokens != 8 {
		t.Fatalf("usage after evict %+v", u)
	}
	if err := c.Lock(m.Node); err != nil {
		t.Fatal(err)
	}
	c.Unlock(m.Node)
	c.Unlock(m.Node)
	ev := c.Evict(100)
	if len(ev) != 2 || u2(c).Tokens != 0 {
		t.Fatalf("evicted %d nodes, usage %+v", len(ev), u2(c))
	}
	if err := c.Lock(m.Node); err == nil {
		t.Fatal("Lock of an evicted node succeeded")
	}
}

func u2(c *RadixCache) Usage { return c.Usage() }

func TestRadixUnlockUnlockedPanics(t *testing.T) {
	c := NewRadixCache(2, Schedule{Window: 2}, Sizes{})
	_, h := c.Insert(toks("aa"), iota64(0, 2), nil)
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	c.Unlock(h)
}

// Goroutines doing random operations on one cache; invariants hold throughout
// and the accounting returns to zero. Meant for go test -race.
func TestRadixConcurrentStress(t *testing.T) {
	c := NewRadixCache(2, Schedule{Window: 4, Ratios: []int{0, 4}}, Sizes{1, 1, 1})
	const G = 8
	ops := 2000
	if testing.Short() {
		ops = 300
	}
	var wg sync.WaitGroup
	errs := make(chan error, G)
	for g := 0; g < G; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 99))
			var held []Handle
			for i := 0; i < ops; i++ {
				s := seqFrom(rng.IntN, 16)
				switch rng.IntN(6) {
				case 0, 1:
					n := len(s) / 2 * 2
					var snaps []Snapshot
					if n > 0 {
						snaps = []Snapshot{{At: n, StateFrom: max(0, n-n%4-4)}}
					}
					c.Insert(s, iota64(g*1_000_000+i*100, len(s)), snaps)
				case 2, 3:
					m := c.MatchPrefix(s, true)
					if m.Node.End() > 0 {
						held = append(held, m.Node)
					}
					if len(m.Vals) != m.Len {
						errs <- fmt.Errorf("match returned %d values for %d tokens", len(m.Vals), m.Len)
						return
					}
				case 4:
					if len(held) > 0 {
						c.Unlock(held[len(held)-1])
						held = held[:len(held)-1]
					}
				default:
					if rng.IntN(2) == 0 {
						c.Evict(rng.IntN(10))
					} else {
						c.EvictWindows(rng.IntN(10))
					}
				}
				if i%100 == 0 {
					if err := c.CheckInvariants(); err != nil {
						errs <- err
						return
					}
				}
			}
			for _, h := range held {
				c.Unlock(h)
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	if u := c.Usage(); u.Protected != 0 {
		t.Fatalf("locks left after every goroutine unlocked: %+v", u)
	}
	c.Evict(1 << 30)
	if u := c.Usage(); u != (Usage{}) {
		t.Fatalf("accounting after releasing everything: %+v", u)
	}
}

// V4-Flash (spec §1): 43 layers [0, 0, 4, 128, …, 4, 128, 4]: 21 C4, 20 C128.
func TestScheduleSizesV4Flash(t *testing.T) {
	ratios := []int{0, 0}
	for len(ratios) < 43 {
		ratios = append(ratios, 4, 128)
	}
	ratios = ratios[:43]
	c4, c128 := 0, 0
	for _, r := range ratios {
		switch r {
		case 4:
			c4++
		case 128:
			c128++
		}
	}
	if c4 != 21 || c128 != 20 {
		t.Fatalf("schedule has %d C4 and %d C128 layers", c4, c128)
	}
	sz := Schedule{Window: 128, Ratios: ratios}.Sizes(LayoutV4Model1, LayoutIndexerFP8)
	// spec §8.5: 21·(584/4 + 132/4) + 20·584/128 = 3850.25 bytes per token.
	if sz.PrefixBytesPerToken != 3851 {
		t.Fatalf("prefix bytes per token %d, want ⌈3850.25⌉", sz.PrefixBytesPerToken)
	}
	// 43 × 584 = 25,112 bytes of window rows per token (43 × 128 × 584 ≈ 3.2 MB per window).
	if sz.WindowBytesPerToken != 43*584 {
		t.Fatalf("window bytes per token %d", sz.WindowBytesPerToken)
	}
	if sz.SnapshotBytes != 21*(16384+4096) {
		t.Fatalf("snapshot bytes %d", sz.SnapshotBytes)
	}
}
