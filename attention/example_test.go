package attention_test

import (
	"fmt"

	"sparsemla/attention"
)

// The window part of the index list early in a sequence and after the ring
// has wrapped (window of 8 slots here; V4 uses 128).
func ExampleWindowIdx() {
	fmt.Println(attention.WindowIdx(3, 8))
	fmt.Println(attention.WindowIdx(10, 8))
	// Output:
	// [0 1 2 3 -1 -1 -1 -1]
	// [3 4 5 6 7 0 1 2]
}

// When compressed rows appear and which tokens they cover.
func ExampleEmissionPos() {
	for j := 0; j < 3; j++ {
		aF, aL, bF, bL := attention.RowTokens(j, 4)
		fmt.Printf("r=4 row %d: appears at p=%d, pools tokens %d..%d (+ overlap %d..%d), RoPE at %d\n",
			j, attention.EmissionPos(j, 4), bF, bL, aF, aL, attention.RowRopePos(j, 4))
	}
	// Output:
	// r=4 row 0: appears at p=3, pools tokens 0..3 (+ overlap -1..-1), RoPE at 0
	// r=4 row 1: appears at p=7, pools tokens 4..7 (+ overlap 0..3), RoPE at 4
	// r=4 row 2: appears at p=11, pools tokens 8..11 (+ overlap 4..7), RoPE at 8
}

// One head attending to two keys with a sink logit of 0: the sink takes its
// share of the denominator but adds no value (see TestSparseAttnHand).
func ExampleSparseAttn() {
	q := []float32{1, 0}
	kv := []float32{1, 0, 0, 1} // rows K0 = [1 0], K1 = [0 1]
	o := make([]float32, 2)
	lse := attention.SparseAttn(o, q, kv, 2, []int32{0, 1, -1}, []float32{0}, 1)
	fmt.Printf("o = %v, lse = %.4f\n", o, lse[0])
	// Output:
	// o = [0.57421875 0.21191406], lse = 1.5514
}
