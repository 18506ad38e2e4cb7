package prefixcheck

import "testing"

// vLLM may evict a parent block and keep its child (any free cached block
// may go), and does not deduplicate: a request that recomputes the parent
// stores both blocks again, the child under the hash it already has. A
// later removal of that hash takes one copy; the other stays cached, and a
// request that builds on it is a correct hit. Counting the recomputed child
// as a new block (its parent is a new block) made that removal an eviction
// and the hit a false evicted-page divergence.
func TestEventsChildCopyOfEvictedParent(t *testing.T) {
	S1, S2, S3 := seqTok(1000, 4), seqTok(2000, 4), seqTok(3000, 4)
	x := newEvEnc()
	x.vllmBatch(1, stored{hashes: []int64{1, 2}, tokens: cat64(S1, S2), bs: 4, medium: "GPU"})
	x.vllmBatch(2, removed{hashes: []int64{1}, medium: "GPU"})
	x.vllmBatch(3, stored{hashes: []int64{1, 2}, tokens: cat64(S1, S2), bs: 4, medium: "GPU"})
	x.vllmBatch(4, removed{hashes: []int64{2}, medium: "GPU"},
		stored{hashes: []int64{3}, parent: p64(2), tokens: S3, bs: 4, medium: "GPU"})
	// Both copies removed: the next store on 2 builds on an evicted page.
	x.vllmBatch(5, removed{hashes: []int64{2}, medium: "GPU"},
		stored{hashes: []int64{4}, parent: p64(2), tokens: seqTok(4000, 4), bs: 4, medium: "GPU"})
	b, err := DecodeEvents(x.buf.Bytes(), "x")
	if err != nil {
		t.Fatal(err)
	}
	tr, err := EventsTrace(b, "x", EventsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: 4, Schedule: testCfg.Schedule})
	if err != nil {
		t.Fatal(err)
	}
	checkWants(t, rep, []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b2.e0", StatusAgree, KindMissedHit, CauseEviction, ""},
		{"b3.e1", StatusAgree, "", "", ""},
		{"b4.e1", StatusDiverged, KindEvicted, "", "evicted by the engine"},
	})
}
