package kvcache_test

import (
	"fmt"

	"sparsemla/kvcache"
)

// Decode a MODEL1 page as FlashMLA lays it out, then corrupt one scale byte
// and let the decoder name it.
func ExampleFormat_DecodePage() {
	f := kvcache.MustFormat(kvcache.LayoutV4Model1, 0, 2) // 2 entries per page
	fmt.Println(f)

	row := make([]float32, 512)
	for i := range row {
		row[i] = float32(i%7) - 3 // nope dims 0..447, rope dims 448..511
	}
	page := make([]byte, f.PageBytes())
	f.EncodePage(page, append(row, row...), kvcache.RefFP8)

	dst := make([]float32, 2*512)
	fmt.Println("faults:", len(f.DecodePage(dst, page)), "dim 3 =", dst[3], "dim 501 =", dst[501])

	page[2*576+8+5] = 0xFF // entry 1, scale of nope dims 320..383
	for _, flt := range f.DecodePage(dst, page) {
		fmt.Println(flt.Kind, "entry", flt.Entry, "byte", flt.Offset, flt.Loc)
	}
	// Output:
	// v4-model1[dim 512, 2 entries/page, 1728 B/page]
	// faults: 0 dim 3 = 0 dim 501 = 1
	// scale-nan entry 1 byte 1165 entry 1 scale 5 byte 0
}

// A prefix is resumable only where the compressor state was kept with the
// ratio-4 overlap halo.
func ExampleRadixCache_MatchPrefix() {
	sched := kvcache.Schedule{Window: 128, Ratios: []int{0, 4, 128}}
	c := kvcache.NewRadixCache(4, sched, kvcache.Sizes{})
	tokens := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	slots := []int64{10, 11, 12, 13, 14, 15, 16, 17, 18}
	fmt.Println("needs at 8:", sched.Needs(8).StateFrom, "(state of tokens 0..7: the C128 group is unfinished)")

	c.Insert(tokens, slots, []kvcache.Snapshot{{At: 4, StateFrom: 0}, {At: 8, StateFrom: 4}})
	m := c.MatchPrefix(tokens, true)
	fmt.Println("matched", m.Matched, "resumable", m.Len, m.Vals)
	fmt.Println(m.Refusal.Reason)
	c.Unlock(m.Node)
	// Output:
	// needs at 8: 0 (state of tokens 0..7: the C128 group is unfinished)
	// matched 8 resumable 4 [10 11 12 13]
	// snapshot at 8 keeps compressor state from token 4, resuming needs it from token 0 (unfinished group and the ratio-4 overlap halo)
}

// A request B served from request A's cached prefix: B's window row for token
// 2 is A's, not B's own.
func ExampleVerifyPrefixHit() {
	sched := kvcache.Schedule{Window: 4, Ratios: []int{0}}
	own, a := kvcache.RowMap{}, kvcache.RowMap{}
	for t := 0; t < 4; t++ {
		own[kvcache.RowKey{Layer: 0, Cache: kvcache.CacheWindow, Index: t}] = []float32{float32(t), 1}
		a[kvcache.RowKey{Layer: 0, Cache: kvcache.CacheWindow, Index: t}] = []float32{float32(t), 2}
	}
	gpu := kvcache.RowMap{}
	for k, v := range own {
		gpu[k] = v
	}
	gpu[kvcache.RowKey{Layer: 0, Cache: kvcache.CacheWindow, Index: 2}] = a[kvcache.RowKey{Layer: 0, Cache: kvcache.CacheWindow, Index: 2}]
	stale, _ := kvcache.VerifyPrefixHit(kvcache.PrefixHit{Request: "B", Donor: "A", Tokens: 4, Schedule: sched},
		gpu, own, map[string]kvcache.RowSource{"A": a})
	fmt.Println(stale)
	// Output:
	// layer 0 window row 2 (tokens 2..2): dim 1 GPU 2, own 1 (1 values differ); the GPU row equals request A's window row 2 (1 stale rows in the hit)
}
