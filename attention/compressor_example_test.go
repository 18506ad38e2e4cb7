package attention_test

import (
	"fmt"

	"sparsemla/attention"
)

// The ratio-4 compressor state machine with one channel per half (d = 1): each
// token writes state row 4 + p mod 4; at p = 3 the row pools the B halves of
// tokens 0..3 (rows 0..3 are still fresh: score −∞, weight 0); then rows 4..7
// move to 0..3, where their A halves feed row 1:
//
//	row 0 = (0 + 10 + 20 + 30) / 4 = 15
//	row 1 = (0 + 1 + 2 + 3 + 40 + 50 + 60 + 70) / 8 = 28.25
func ExampleCompressor() {
	c := &attention.Compressor{Ratio: 4, HeadDim: 1, Dim: 1,
		Wkv: []float32{0, 0}, Wgate: []float32{0, 0}, Ape: make([]float32, 8), Norm: []float32{1}}
	st := c.NewState()
	row := make([]float32, 1)
	for p := int64(0); p < 8; p++ {
		a := []float32{float32(p), float32(10 * p)} // [A half, B half] of token p
		b := []float32{0, 0}                        // equal scores: plain means
		c.Ingest(st, a, b, p)
		if c.Emits(p) {
			c.Pool(row, st)
			c.Shift(st)
			fmt.Printf("p=%d emits row %d = %v\n", p, p/4, row[0])
		}
	}
	// Output:
	// p=3 emits row 0 = 15
	// p=7 emits row 1 = 28.25
}
