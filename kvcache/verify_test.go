package kvcache

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// requestRows makes every row a request of n tokens has, with values drawn
// from rng (8 values per row: the verifier does not care about widths).
func requestRows(rng *rand.Rand, sched Schedule, n int) RowMap {
	m := RowMap{}
	row := func() []float32 {
		r := make([]float32, 8)
		for i := range r {
			r[i] = float32(rng.NormFloat64())
		}
		return r
	}
	for l, r := range sched.Ratios {
		for t := 0; t < n; t++ {
			m[RowKey{l, CacheWindow, t}] = row()
			if r > 0 {
				m[RowKey{l, CacheState, t}] = row()
			}
			if r == 4 {
				m[RowKey{l, CacheIndexState, t}] = row()
			}
		}
		if r > 0 {
			for j := 0; j < n/r; j++ {
				m[RowKey{l, CacheCompressed, j}] = row()
			}
		}
		if r == 4 {
			for j := 0; j < n/4; j++ {
				m[RowKey{l, CacheIndex, j}] = row()
			}
		}
	}
	return m
}

func cloneRows(m RowMap) RowMap {
	c := RowMap{}
	for k, v := range m {
		c[k] = append([]float32(nil), v...)
	}
	return c
}

func TestHitRowsFollowNeeds(t *testing.T) {
	hit := PrefixHit{Tokens: 10, Schedule: Schedule{Window: 4, Ratios: []int{0, 4, 128}}}
	count := map[[2]int]int{}
	for _, r := range hitRows(hit) {
		count[[2]int{r.layer, int(r.cache)}]++
	}
	// layer 0: window 6..9; layer 1 (r=4): window 6..9, rows 0,1, keys 0,1, state of
	// tokens 4..9 (group 8..9 plus the halo 4..7); layer 2 (r=128): window 6..9 and
	// the state of the whole unfinished group 0..9.
	want := map[[2]int]int{
		{0, int(CacheWindow)}: 4,
		{1, int(CacheWindow)}: 4, {1, int(CacheCompressed)}: 2, {1, int(CacheIndex)}: 2,
		{1, int(CacheState)}: 6, {1, int(CacheIndexState)}: 6,
		{2, int(CacheWindow)}: 4, {2, int(CacheState)}: 10,
	}
	if len(count) != len(want) {
		t.Fatalf("rows per cache %v, want %v", count, want)
	}
	for k, n := range want {
		if count[k] != n {
			t.Fatalf("rows per cache %v, want %v", count, want)
		}
	}
}

func TestVerifyPrefixHit(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	sched := Schedule{Window: 4, Ratios: []int{0, 4, 128}}
	hit := PrefixHit{Request: "B", Donor: "A", Tokens: 10, Schedule: sched, StateRelTol: 1e-3}
	own := requestRows(rng, sched, 10)
	a := requestRows(rng, sched, 16)
	others := map[string]RowSource{"A": a}

	t.Run("clean", func(t *testing.T) {
		s, err := VerifyPrefixHit(hit, cloneRows(own), own, others)
		if err != nil || s != nil {
			t.Fatalf("%v %v", s, err)
		}
	})
	t.Run("foreign window row", func(t *testing.T) {
		gpu := cloneRows(own)
		gpu[RowKey{1, CacheWindow, 8}] = a[RowKey{1, CacheWindow, 8}]
		s, err := VerifyPrefixHit(hit, gpu, own, others)
		if err != nil || s == nil || s.Layer != 1 || s.Cache != CacheWindow || s.Index != 8 || s.MatchesOther != "A" || s.OtherIndex != 8 || s.StaleRows != 1 || s.Values != 8 {
			t.Fatalf("%+v %v", s, err)
		}
		if !strings.Contains(s.String(), "request A's window row 8") {
			t.Fatalf("String() = %q", s.String())
		}
	})
	t.Run("stale ring slot", func(t *testing.T) {
		// Window slot 7 mod 4 still holds A's token 11 (a ring not reset between requests).
		gpu := cloneRows(own)
		gpu[RowKey{2, CacheWindow, 7}] = a[RowKey{2, CacheWindow, 11}]
		s, _ := VerifyPrefixHit(hit, gpu, own, others)
		if s == nil || s.Layer != 2 || s.Index != 7 || s.MatchesOther != "A" || s.OtherIndex != 11 {
			t.Fatalf("%+v", s)
		}
	})
	t.Run("first in layer order, all counted", func(t *testing.T) {
		gpu := cloneRows(own)
		gpu[RowKey{1, CacheCompressed, 1}][3] += 1
		gpu[RowKey{0, CacheWindow, 9}][0] = -gpu[RowKey{0, CacheWindow, 9}][0]
		s, _ := VerifyPrefixHit(hit, gpu, own, others)
		if s == nil || s.Layer != 0 || s.Index != 9 || s.Dim != 0 || s.StaleRows != 2 || s.MatchesOther != "" {
			t.Fatalf("%+v", s)
		}
		if s.Tokens != [2]int{9, 10} {
			t.Fatalf("tokens %v", s.Tokens)
		}
	})
	t.Run("missing compressed row", func(t *testing.T) {
		gpu := cloneRows(own)
		delete(gpu, RowKey{1, CacheCompressed, 1})
		s, _ := VerifyPrefixHit(hit, gpu, own, others)
		// Compressed row 1 of a ratio-4 layer pools tokens 0..7 (the overlap).
		if s == nil || !s.Missing || s.Cache != CacheCompressed || s.Index != 1 || s.Tokens != [2]int{0, 8} {
			t.Fatalf("%+v", s)
		}
	})
	t.Run("state within tolerance", func(t *testing.T) {
		gpu := cloneRows(own)
		gpu[RowKey{2, CacheState, 3}][2] *= 1 + 1e-5
		if s, _ := VerifyPrefixHit(hit, gpu, own, others); s != nil {
			t.Fatalf("fp32 GEMM noise reported: %+v", s)
		}
		gpu[RowKey{1, CacheState, 5}][2] *= 1.1
		s, _ := VerifyPrefixHit(hit, gpu, own, others)
		if s == nil || s.Cache != CacheState || s.Index != 5 {
			t.Fatalf("%+v", s)
		}
	})
	t.Run("KV rows are exact", func(t *testing.T) {
		gpu := cloneRows(own)
		gpu[RowKey{1, CacheIndex, 0}][0] *= 1 + 1e-6
		if s, _ := VerifyPrefixHit(hit, gpu, own, others); s == nil || s.Cache != CacheIndex {
			t.Fatalf("%+v", s)
		}
	})
	t.Run("reference incomplete", func(t *testing.T) {
		partial := cloneRows(own)
		delete(partial, RowKey{2, CacheState, 0})
		if _, err := VerifyPrefixHit(hit, own, partial, others); err == nil {
			t.Fatal("missing reference row accepted")
		}
	})
}

// End to end with real page bytes: request A's MODEL1 pages are served to B,
// whose prefix is the same tokens, so B's reference rows equal A's and the hit
// verifies clean; request C shares only A's first page, and a GPU that served
// it A's rows for 12 tokens is caught at C's token 4, with A named.
func TestVerifyPrefixHitFromPages(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 32))
	sched := Schedule{Window: 8, Ratios: []int{0}}
	f := MustFormat(LayoutV4Model1, 0, 4)
	pool := NewPool(f, 8)
	pool.Table = BlockTable{0, 1, 2, 3, 4, 5, 6, 7}
	rowsA := randRows(rng, 16, 512)
	for pos := 0; pos < 16; pos++ {
		if err := pool.Write(pos, rowsA[pos*512:(pos+1)*512], RefFP8); err != nil {
			t.Fatal(err)
		}
	}
	decoded := func(src []float32, n int) RowMap {
		m := RowMap{}
		for pos := 0; pos < n; pos++ {
			m[RowKey{0, CacheWindow, pos}] = expectedRoundTrip(LayoutV4Model1, src[pos*512:(pos+1)*512])
		}
		return m
	}
	gpuRows := RowMap{}
	for pos := 0; pos < 16; pos++ {
		r := make([]float32, 512)
		if _, err := pool.Read(r, pos); err != nil {
			t.Fatal(err)
		}
		gpuRows[RowKey{0, CacheWindow, pos}] = r
	}
	hit := PrefixHit{Request: "B", Donor: "A", Tokens: 12, Schedule: sched}
	if s, err := VerifyPrefixHit(hit, gpuRows, decoded(rowsA, 12), nil); err != nil || s != nil {
		t.Fatalf("clean hit: %v %v", s, err)
	}
	// C shares tokens 0..3 only: its own rows 4..11 differ, but the GPU served A's.
	rowsC := append(append([]float32(nil), rowsA[:4*512]...), randRows(rng, 8, 512)...)
	s, err := VerifyPrefixHit(PrefixHit{Request: "C", Donor: "A", Tokens: 12, Schedule: sched},
		gpuRows, decoded(rowsC, 12), map[string]RowSource{"A": decoded(rowsA, 16)})
	if err != nil || s == nil || s.Index != 4 || s.MatchesOther != "A" || s.StaleRows != 8 {
		t.Fatalf("%+v %v", s, err)
	}
}
