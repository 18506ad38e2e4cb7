package attention

import (
	"math"
	"testing"
)

// TestBufPoolPoison: with PoisonBufPools on, a buffer is all poison whether
// the pool made it or kept it (a kept one holds its last user's values
// otherwise), and off again, a kept buffer comes back as it was put.
func TestBufPoolPoison(t *testing.T) {
	var fp BufPool[float32]
	var up BufPool[uint64]
	old := PoisonBufPools(true)
	defer PoisonBufPools(old)
	for round := range 2 {
		b := fp.Get(100)
		for i, v := range *b {
			if math.Float32bits(v) != math.Float32bits(poisonNaN) {
				t.Fatalf("round %d: float32 value %d is %v, want the poison NaN", round, i, v)
			}
			(*b)[i] = 1
		}
		fp.Put(b)
		u := up.Get(10)
		for i, v := range *u {
			if v != math.MaxUint64 {
				t.Fatalf("round %d: uint64 value %d is %#x, want all ones", round, i, v)
			}
			(*u)[i] = 7
		}
		up.Put(u)
	}
	PoisonBufPools(false)
	b := fp.Get(50)
	if len(*b) != 50 {
		t.Fatalf("len %d, want 50", len(*b))
	}
	fp.Put(b)
}
