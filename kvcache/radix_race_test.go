package kvcache

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
)

// slotPool is the KV-slot allocator a serving engine runs beside its radix
// cache: every slot is owned by one token prefix (the prefix whose last
// token's KV it holds) from allocation to free. A cache that served a value
// of an evicted node, of another prefix, or twice would show up as a slot
// whose owner is not the matched prefix; a cache that lost a value would
// show up as a slot never freed.
type slotPool struct {
	mu        sync.Mutex
	owner     map[int64]string // live slot -> pageKey of the owning prefix
	free      []int64
	next      int64
	allocated int
	freed     int
}

func (p *slotPool) alloc(prefix []int32) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var s int64
	if n := len(p.free); n > 0 {
		s, p.free = p.free[n-1], p.free[:n-1]
	} else {
		s = p.next
		p.next++
	}
	p.owner[s] = pageKey(prefix)
	p.allocated++
	return s
}

func (p *slotPool) release(vals []int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range vals {
		if _, ok := p.owner[s]; !ok {
			return fmt.Errorf("slot %d freed twice (or never allocated)", s)
		}
		delete(p.owner, s)
		p.free = append(p.free, s)
		p.freed++
	}
	return nil
}

// check: vals[j] must be a live slot owned by tokens[:j+1].
func (p *slotPool) check(tokens []int32, vals []int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for j, s := range vals {
		o, ok := p.owner[s]
		if !ok {
			return fmt.Errorf("served slot %d for token %d of %v: the slot is free (a value of an evicted or never-adopted node)", s, j, tokens[:j+1])
		}
		if o != pageKey(tokens[:j+1]) {
			return fmt.Errorf("served slot %d for token %d of %v: the slot holds another prefix's KV", s, j, tokens[:j+1])
		}
	}
	return nil
}

// TestRadixConcurrentNeverServesWrongKV: goroutines insert, match (locked
// and not), unlock, evict and drop window rows on one cache while a slot
// pool tracks who owns every value. After every operation the goroutine
// checks the cache invariants; every locked match serves only slots owned
// by exactly the matched prefix (the lock keeps them from being evicted
// while checked); at the end, with every lock released and everything
// evicted, the accounting is zero and every slot ever allocated was handed
// back exactly once. Run under -race by .ci/run.
func TestRadixConcurrentNeverServesWrongKV(t *testing.T) {
	for _, page := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("page%d", page), func(t *testing.T) {
			radixStressSlots(t, page)
		})
	}
}

func radixStressSlots(t *testing.T, page int) {
	c := NewRadixCache(page, Schedule{Window: 4, Ratios: []int{0, 4, 128}}, Sizes{3, 5, 7})
	pool := &slotPool{owner: map[int64]string{}}
	const G = 6
	ops := 800
	if testing.Short() {
		ops = 300
	}
	var wg sync.WaitGroup
	errs := make(chan error, G)
	for g := 0; g < G; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			fail := func(err error) { errs <- fmt.Errorf("goroutine %d: %w", g, err) }
			rng := rand.New(rand.NewPCG(uint64(g), uint64(page)))
			var held []Handle
			for i := 0; i < ops; i++ {
				s := seqFrom(rng.IntN, 20)
				switch op := rng.IntN(10); {
				case op < 4: // insert with fresh slots; free the ones the cache did not adopt
					vals := make([]int64, len(s))
					for j := range vals {
						vals[j] = pool.alloc(s[:j+1])
					}
					n := len(s) / page * page
					var snaps []Snapshot
					for at := page; at <= n; at += page {
						if rng.IntN(3) == 0 {
							snaps = append(snaps, Snapshot{At: at, StateFrom: max(0, at-at%4-rng.IntN(2)*4)})
						}
					}
					existing, _ := c.Insert(s, vals, snaps)
					if existing > n {
						fail(fmt.Errorf("insert of %d aligned tokens says %d existed", n, existing))
						return
					}
					if err := pool.release(vals[:existing]); err != nil {
						fail(err)
						return
					}
					if err := pool.release(vals[n:]); err != nil {
						fail(err)
						return
					}
				case op < 7: // locked match: the served slots must be the prefix's own
					m := c.MatchPrefix(s, true)
					if m.Len > m.Matched || m.Len%page != 0 || len(m.Vals) != m.Len || m.Node.End() != m.Len {
						fail(fmt.Errorf("match of %v: matched %d, len %d, %d values, node end %d", s, m.Matched, m.Len, len(m.Vals), m.Node.End()))
						return
					}
					if err := pool.check(s, m.Vals); err != nil {
						fail(err)
						return
					}
					if m.Node.End() > 0 {
						held = append(held, m.Node)
					}
				case op < 8: // unlocked match
					m := c.MatchPrefix(s, false)
					if len(m.Vals) != m.Len {
						fail(fmt.Errorf("unlocked match: %d values for %d tokens", len(m.Vals), m.Len))
						return
					}
				case op < 9: // unlock one held handle
					if len(held) > 0 {
						k := rng.IntN(len(held))
						c.Unlock(held[k])
						held = append(held[:k], held[k+1:]...)
					}
				default: // evict (free the slots) or drop window rows
					if rng.IntN(2) == 0 {
						for _, e := range c.Evict(rng.IntN(12)) {
							if len(e.Vals) != len(e.Prefix)-e.Start {
								fail(fmt.Errorf("evicted node of %d values for tokens %d..%d", len(e.Vals), e.Start, len(e.Prefix)))
								return
							}
							if err := evictedOwned(pool, e); err != nil {
								fail(err)
								return
							}
							if err := pool.release(e.Vals); err != nil {
								fail(err)
								return
							}
						}
					} else {
						c.EvictWindows(rng.IntN(12))
					}
				}
				if err := c.CheckInvariants(); err != nil {
					fail(fmt.Errorf("after op %d: %w", i, err))
					return
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
	if u := c.Usage(); u.Protected != 0 {
		t.Fatalf("locks left after every goroutine unlocked: %+v", u)
	}
	for _, e := range c.Evict(1 << 30) {
		if err := evictedOwned(pool, e); err != nil {
			t.Fatal(err)
		}
		if err := pool.release(e.Vals); err != nil {
			t.Fatal(err)
		}
	}
	if u := c.Usage(); u != (Usage{}) {
		t.Fatalf("accounting after releasing everything: %+v", u)
	}
	if err := c.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	if pool.allocated != pool.freed || len(pool.owner) != 0 {
		t.Fatalf("%d slots allocated, %d handed back; %d still owned (values the cache lost)", pool.allocated, pool.freed, len(pool.owner))
	}
	t.Logf("page %d: %d slots allocated and all handed back", page, pool.allocated)
}

// evictedOwned: each value of an evicted node is a live slot owned by the
// node's prefix up to that token.
func evictedOwned(p *slotPool, e Evicted) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for j, s := range e.Vals {
		want := pageKey(e.Prefix[:e.Start+j+1])
		if o, ok := p.owner[s]; !ok || o != want {
			return fmt.Errorf("evicted slot %d (token %d of %v) is not owned by its prefix (live %v)", s, e.Start+j, e.Prefix, ok)
		}
	}
	return nil
}
