package kvcache

import (
	"container/heap"
	"errors"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// The eviction order before the LRU heaps: every Evict walked the whole tree,
// heaped the unlocked leaves by (last, seq) and popped them, pushing a parent
// that became an unlocked leaf; EvictWindows heaped every unlocked node with
// window rows. evictWalk and evictWindowsWalk keep that algorithm (choosing by
// a walk, removing through the same bookkeeping), and the tests below run it in
// lockstep with Evict and EvictWindows.

type walkHeap []*node

func (h walkHeap) Len() int           { return len(h) }
func (h walkHeap) Less(i, j int) bool { return lruLess(h[i], h[j]) }
func (h walkHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *walkHeap) Push(x any)        { *h = append(*h, x.(*node)) }
func (h *walkHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

func (c *RadixCache) evictWalk(tokens int) []Evicted {
	c.mu.Lock()
	defer c.mu.Unlock()
	h := &walkHeap{}
	c.walk(func(n *node) {
		if len(n.children) == 0 && n.lock == 0 {
			*h = append(*h, n)
		}
	})
	heap.Init(h)
	var out []Evicted
	freed := 0
	for freed < tokens && h.Len() > 0 {
		n := heap.Pop(h).(*node)
		p := n.parent
		freed += len(n.key)
		out = append(out, c.drop(n))
		if p.parent != nil && len(p.children) == 0 && p.lock == 0 {
			heap.Push(h, p)
		}
	}
	return out
}

func (c *RadixCache) evictWindowsWalk(tokens int) []Evicted {
	c.mu.Lock()
	defer c.mu.Unlock()
	h := &walkHeap{}
	c.walk(func(n *node) {
		if n.window && n.lock == 0 {
			*h = append(*h, n)
		}
	})
	heap.Init(h)
	var out []Evicted
	freed := 0
	for freed < tokens && h.Len() > 0 {
		n := heap.Pop(h).(*node)
		n.window = false
		c.windowTokens -= len(n.key)
		freed += len(n.key)
		c.reindex(n)
		out = append(out, Evicted{Namespace: rootOf(n).ns, Prefix: c.prefixOf(n), Start: n.start, Vals: n.vals})
	}
	return out
}

// lockstep applies one random operation sequence to two caches, one evicting
// through the heaps and one through the walk, and requires identical results.
func lockstep(t *testing.T, seed uint64, page, steps int) {
	rng := rand.New(rand.NewPCG(seed, uint64(page)*7))
	sched := Schedule{Window: 8, Ratios: []int{0, 4, 16}}
	a, b := NewRadixCache(page, sched, Sizes{1, 1, 1}), NewRadixCache(page, sched, Sizes{1, 1, 1})
	type lk struct{ ha, hb Handle }
	var locks []lk
	nss := []string{"", "lora-1", "lora-2"}
	var next int64
	for i := 0; i < steps; i++ {
		ns := nss[rng.IntN(len(nss))]
		switch op := rng.IntN(12); {
		case op < 4:
			s := seqFrom(rng.IntN, 24)
			vals := make([]int64, len(s))
			for j := range vals {
				next++
				vals[j] = next
			}
			var snaps []Snapshot
			for at := page; at <= len(s)/page*page; at += page {
				if rng.IntN(2) == 0 {
					snaps = append(snaps, Snapshot{At: at, StateFrom: sched.Needs(at).StateFrom})
				}
			}
			ea, _ := a.InsertNS(ns, s, vals, snaps)
			eb, _ := b.InsertNS(ns, s, vals, snaps)
			if ea != eb {
				t.Fatalf("step %d: Insert existing %d vs %d", i, ea, eb)
			}
		case op < 7:
			s := seqFrom(rng.IntN, 24)
			lock := rng.IntN(2) == 0
			ma, mb := a.MatchPrefixNS(ns, s, lock), b.MatchPrefixNS(ns, s, lock)
			if ma.Len != mb.Len || ma.Matched != mb.Matched || !slices.Equal(ma.Vals, mb.Vals) {
				t.Fatalf("step %d: match %+v vs %+v", i, ma, mb)
			}
			if lock && ma.Len > 0 {
				locks = append(locks, lk{ma.Node, mb.Node})
			}
		case op < 8:
			if len(locks) > 0 {
				j := rng.IntN(len(locks))
				a.Unlock(locks[j].ha)
				b.Unlock(locks[j].hb)
				locks = slices.Delete(locks, j, j+1)
			}
		case op < 10:
			k := rng.IntN(30)
			if ea, eb := a.Evict(k), b.evictWalk(k); !reflect.DeepEqual(ea, eb) {
				t.Fatalf("step %d: Evict(%d) = %v, walk %v", i, k, ea, eb)
			}
		default:
			k := rng.IntN(12)
			if ea, eb := a.EvictWindows(k), b.evictWindowsWalk(k); !reflect.DeepEqual(ea, eb) {
				t.Fatalf("step %d: EvictWindows(%d) = %v, walk %v", i, k, ea, eb)
			}
		}
		for _, c := range []*RadixCache{a, b} {
			if err := c.CheckInvariants(); err != nil {
				t.Fatalf("step %d: %v", i, err)
			}
		}
		if a.Usage() != b.Usage() {
			t.Fatalf("step %d: usage %+v vs %+v", i, a.Usage(), b.Usage())
		}
	}
}

func TestRadixEvictHeapMatchesWalk(t *testing.T) {
	steps := 1500
	if testing.Short() {
		steps = 300
	}
	for seed := uint64(1); seed <= 4; seed++ {
		for _, page := range []int{1, 2, 4} {
			lockstep(t, seed, page, steps)
		}
	}
}

// Namespaces never share a prefix; eviction crosses them in LRU order.
func TestRadixNamespaces(t *testing.T) {
	c := NewRadixCache(2, Schedule{Window: 2}, Sizes{})
	snap := []Snapshot{{At: 4, StateFrom: 4}}
	c.InsertNS("lora-a", toks("abcd"), iota64(0, 4), snap)
	if m := c.MatchPrefix(toks("abcd"), false); m.Matched != 0 || m.Len != 0 {
		t.Fatalf("namespace \"\" matched %+v of namespace lora-a", m)
	}
	if m := c.MatchPrefixNS("lora-b", toks("abcd"), false); m.Matched != 0 {
		t.Fatalf("lora-b matched %+v", m)
	}
	if m := c.MatchPrefixNS("lora-a", toks("abcd"), false); m.Len != 4 || !slices.Equal(m.Vals, iota64(0, 4)) {
		t.Fatalf("lora-a match %+v", m)
	}
	if ex, _ := c.InsertNS("lora-b", toks("abcd"), iota64(10, 4), snap); ex != 0 {
		t.Fatalf("lora-b insert found %d tokens of lora-a", ex)
	}
	ev := c.Evict(1)
	if len(ev) != 1 || ev[0].Namespace != "lora-a" {
		t.Fatalf("evicted %+v, want lora-a's (older) prefix", ev)
	}
	if err := c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// Remove drops a page and everything extending it, splitting a node when the
// page starts inside it; it refuses a locked subtree and changes nothing.
func TestRadixRemove(t *testing.T) {
	c := NewRadixCache(2, Schedule{Window: 2}, Sizes{})
	_, h := c.Insert(toks("abcdef"), iota64(0, 6), nil)
	c.Insert(toks("abcdxy"), iota64(10, 6), nil)
	c.Insert(toks("abgh"), iota64(20, 4), nil)
	if ev, err := c.Remove("", toks("abzz")); ev != nil || err != nil {
		t.Fatalf("Remove of an uncached page: %v %v", ev, err)
	}
	if _, err := c.Remove("", toks("abc")); err == nil {
		t.Fatal("Remove of an unaligned prefix succeeded")
	}
	if err := c.Lock(h); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Remove("", toks("abcd")); !errors.Is(err, ErrLocked) {
		t.Fatalf("Remove under a lock: %v", err)
	}
	if u := c.Usage(); u.Tokens != 10 {
		t.Fatalf("a refused Remove changed the cache: %+v", u)
	}
	c.Unlock(h)
	ev, err := c.Remove("", toks("abcd"))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ev {
		got = append(got, string(runes(e.Prefix))+"@"+string(rune('0'+e.Start)))
	}
	if strings.Join(got, " ") != "abcd@2 abcdef@4 abcdxy@4" {
		t.Fatalf("removed %v", got)
	}
	if u := c.Usage(); u.Tokens != 4 || u.Nodes != 2 {
		t.Fatalf("usage after Remove %+v", u)
	}
	if m := c.MatchPrefix(toks("abcdef"), false); m.Matched != 2 {
		t.Fatalf("after Remove matched %d, want 2", m.Matched)
	}
	if err := c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	c.Evict(100)
	if u := c.Usage(); u != (Usage{}) {
		t.Fatalf("after evicting all: %+v", u)
	}
}

func runes(s []int32) []rune {
	r := make([]rune, len(s))
	for i, v := range s {
		r[i] = rune(v)
	}
	return r
}

// Remove against the model: random operation sequences (radixRun.step) with
// removals of random cached pages mixed in.
func TestRadixRemoveAgainstModel(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		for _, page := range []int{1, 2, 4} {
			rng := rand.New(rand.NewPCG(seed, 99+uint64(page)))
			r := newRadixRun(t, page)
			for i := 0; i < 400; i++ {
				if rng.IntN(6) != 0 {
					r.step(rng.IntN)
					continue
				}
				s := seqFrom(rng.IntN, 24)
				n := len(s) / page * page
				if n == 0 {
					continue
				}
				prefix := s[:n-page*rng.IntN(n/page)]
				key := pageKey(prefix)
				locked, cached := false, r.m.p[key] != nil
				var doomed []string
				for k, pg := range r.m.p {
					if strings.HasPrefix(k, key) {
						doomed = append(doomed, k)
						locked = locked || pg.lock > 0
					}
				}
				ev, err := r.c.Remove("", prefix)
				switch {
				case !cached:
					if ev != nil || err != nil {
						t.Fatalf("Remove of uncached %v: %v %v", prefix, ev, err)
					}
				case locked:
					if !errors.Is(err, ErrLocked) {
						t.Fatalf("Remove of locked %v: %v", prefix, err)
					}
				default:
					if err != nil {
						t.Fatal(err)
					}
					freed := 0
					for _, e := range ev {
						freed += len(e.Prefix) - e.Start
						if len(e.Vals) != len(e.Prefix)-e.Start {
							t.Fatalf("removed node with %d values for %d tokens", len(e.Vals), len(e.Prefix)-e.Start)
						}
					}
					if freed != len(doomed)*page {
						t.Fatalf("Remove(%v) freed %d tokens, model %d pages", prefix, freed, len(doomed))
					}
					for _, k := range doomed {
						delete(r.m.p, k)
					}
				}
				if err := r.c.CheckInvariants(); err != nil {
					t.Fatal(err)
				}
				got, want := r.c.Usage(), r.m.usage()
				got.Nodes, got.Bytes = 0, 0
				if got != want {
					t.Fatalf("after Remove: usage %+v, model %+v", got, want)
				}
			}
			r.releaseAll()
		}
	}
}

// LRU: the least recently matched leaf goes first.
func TestRadixLRUOrder(t *testing.T) {
	c := NewRadixCache(2, Schedule{Window: 2}, Sizes{})
	for _, s := range []string{"aaaa", "bbbb", "cccc"} {
		c.Insert(toks(s), iota64(0, 4), nil)
	}
	c.MatchPrefix(toks("aaaa"), false) // b is now the oldest, then c, then a
	ev := c.Evict(1)
	if len(ev) != 1 || string(rune(ev[0].Prefix[0])) != "b" {
		t.Fatalf("evicted %v, want the b branch", ev)
	}
	ev = c.Evict(1)
	if len(ev) != 1 || string(rune(ev[0].Prefix[0])) != "c" {
		t.Fatalf("evicted %v, want the c branch", ev)
	}
}
