package kvcache

import (
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkDecodePage decodes one 64-entry page of each layout; b.SetBytes is
// the page size, so ns/op converts to page bytes per second (target ≥ 2 GB/s
// for v4-model1 on one core).
func BenchmarkDecodePage(b *testing.B) {
	rng := rand.New(rand.NewPCG(41, 42))
	for _, l := range allLayouts {
		f := MustFormat(l, map[bool]int{true: 512, false: 0}[l == LayoutBF16], 64)
		page := make([]byte, f.PageBytes())
		f.EncodePage(page, randRows(rng, 64, f.Dim), RefScaling(l))
		dst := make([]float32, 64*f.Dim)
		for _, fast := range []bool{true, false} {
			name := "fast/" + l.String()
			if !fast {
				name = "reference/" + l.String()
			}
			b.Run(name, func(b *testing.B) {
				fastDecode = fast
				defer func() { fastDecode = true }()
				b.SetBytes(int64(f.PageBytes()))
				for b.Loop() {
					f.DecodePage(dst, page)
				}
			})
		}
	}
}

func BenchmarkEncodePage(b *testing.B) {
	rng := rand.New(rand.NewPCG(43, 44))
	f := MustFormat(LayoutV4Model1, 0, 64)
	rows := randRows(rng, 64, 512)
	page := make([]byte, f.PageBytes())
	b.SetBytes(int64(f.PageBytes()))
	for b.Loop() {
		f.EncodePage(page, rows, RefFP8)
	}
}

// radix1M builds a cache holding 1M tokens: requests of 1024 tokens (page 64)
// forming a tree, each sharing a random page-aligned prefix (0..15 pages) with
// an earlier one. Every request keeps a snapshot at its end.
func radix1M(b *testing.B) (*RadixCache, [][]int32) {
	rng := rand.New(rand.NewPCG(45, 46))
	sched := Schedule{Window: 128, Ratios: []int{0, 0, 4, 128}}
	c := NewRadixCache(64, sched, Sizes{PrefixBytesPerToken: 179, WindowBytesPerToken: 584, SnapshotBytes: 16 << 10})
	var reqs [][]int32
	vals := make([]int64, 1024)
	for c.Usage().Tokens < 1<<20 {
		s := make([]int32, 1024)
		shared := 0
		if len(reqs) > 0 {
			shared = rng.IntN(16) * 64
			copy(s, reqs[rng.IntN(len(reqs))][:shared])
		}
		for i := shared; i < len(s); i++ {
			s[i] = int32(rng.IntN(1 << 17))
		}
		c.Insert(s, vals, []Snapshot{{At: 1024, StateFrom: 1024 - 4}})
		reqs = append(reqs, s)
	}
	return c, reqs
}

func BenchmarkRadixMatch1M(b *testing.B) {
	c, reqs := radix1M(b)
	i := 0
	for b.Loop() {
		m := c.MatchPrefix(reqs[i%len(reqs)], false)
		if m.Len != 1024 {
			b.Fatalf("match %d", m.Len)
		}
		i++
	}
}

// BenchmarkRadixInsert1M inserts a 1024-token request sharing half its tokens
// with a cached one into a 1M-token cache, then evicts as much to stay at 1M
// (every 64 inserts). ns/op is the whole loop, evictions included;
// insert-ns/op is the inserts alone, on the benchmark's own clock (a
// B.StopTimer/StartTimer pair around each eviction, the form before, stops
// the world twice and slows what follows).
func BenchmarkRadixInsert1M(b *testing.B) {
	c, reqs := radix1M(b)
	rng := rand.New(rand.NewPCG(47, 48))
	s := make([]int32, 1024)
	vals := make([]int64, 1024)
	n := 0
	var ins time.Duration
	for b.Loop() {
		copy(s, reqs[rng.IntN(len(reqs))][:512])
		for i := 512; i < 1024; i++ {
			s[i] = int32(rng.IntN(1 << 17))
		}
		t0 := time.Now()
		c.Insert(s, vals, []Snapshot{{At: 1024, StateFrom: 1020}})
		ins += time.Since(t0)
		if n++; n%64 == 0 {
			c.Evict(64 * 512)
		}
	}
	b.ReportMetric(float64(ins.Nanoseconds())/float64(b.N), "insert-ns/op")
}

// BenchmarkRadixEvict1M keeps a 1M-token cache full: each iteration inserts a
// 1024-token request (half shared) and evicts 1024 tokens, through the LRU
// heaps (heap) and through the whole-tree walk Evict used before (walk).
func BenchmarkRadixEvict1M(b *testing.B) {
	for _, mode := range []string{"heap", "walk"} {
		b.Run(mode, func(b *testing.B) {
			c, reqs := radix1M(b)
			rng := rand.New(rand.NewPCG(49, 50))
			s := make([]int32, 1024)
			vals := make([]int64, 1024)
			for b.Loop() {
				copy(s, reqs[rng.IntN(len(reqs))][:512])
				for i := 512; i < 1024; i++ {
					s[i] = int32(rng.IntN(1 << 17))
				}
				c.Insert(s, vals, []Snapshot{{At: 1024, StateFrom: 1020}})
				if mode == "heap" {
					c.Evict(1024)
				} else {
					c.evictWalk(1024)
				}
			}
		})
	}
}

// BenchmarkRadixInsertChain inserts a chain of 2,000 requests, each one page
// longer than the one before (page 1) with a snapshot at every page end, as
// prefixcheck does for a KV-event chain: a node per request, so the tree is
// 2,000 deep. Each snapshot's node is found by binary search on the insert
// path; climbing from the leaf for each snapshot made the chain cubic
// (2,800 chained events took prefixcheck 26.6 s before, 7.8 s after, on the
// 2-core development VM).
func BenchmarkRadixInsertChain(b *testing.B) {
	const n = 2000
	toks := make([]int32, n)
	vals := make([]int64, n)
	snaps := make([]Snapshot, n)
	for i := range n {
		toks[i], vals[i] = 7, int64(i)
		snaps[i] = Snapshot{At: i + 1, StateFrom: i + 1}
	}
	for b.Loop() {
		c := NewRadixCache(1, Schedule{Window: 128}, Sizes{})
		for l := 1; l <= n; l++ {
			c.Insert(toks[:l], vals, snaps[:l])
		}
		if u := c.Usage(); u.Tokens != n || u.Snapshots != n {
			b.Fatalf("usage %+v", u)
		}
	}
}
