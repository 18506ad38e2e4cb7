package dump_test

import (
	"bytes"
	"fmt"
	"io"

	"sparsemla/dump"
	"sparsemla/quant"
)

// Write two records of one decode step in the native format and read them
// back as a stream.
func Example() {
	var buf bytes.Buffer
	w, err := dump.NewWriter(&buf, dump.Header{
		CompressRatios: []int{0, 4},
		Producer:       map[string]string{"engine": "example"},
	})
	if err != nil {
		panic(err)
	}
	// kv of layer 1 at position p = 7: two bf16 values.
	kv := make([]byte, 4)
	for i, v := range []float32{1.5, -0.25} {
		b := quant.BF16Bits(v)
		kv[2*i], kv[2*i+1] = byte(b), byte(b>>8)
	}
	recs := []dump.Record{
		{Key: dump.Key{Step: 7, Layer: 1, Stage: "kv"}, DType: dump.BF16, Shape: []int{2}, Data: kv},
		{Key: dump.Key{Step: 7, Layer: dump.Global, Stage: "pos"}, DType: dump.I64, Shape: []int{1}, Data: []byte{7, 0, 0, 0, 0, 0, 0, 0}},
	}
	for i := range recs {
		if err := w.Write(&recs[i]); err != nil {
			panic(err)
		}
	}
	if err := w.Close(); err != nil {
		panic(err)
	}

	sr, err := dump.NewStreamReader(&buf, "example.smd")
	if err != nil {
		panic(err)
	}
	fmt.Println("producer:", sr.Header.Producer["engine"], "schedule:", sr.Header.CompressRatios)
	for {
		r, err := sr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			panic(err)
		}
		if r.DType.IsFloat() {
			v, _ := r.Float32()
			fmt.Println(r.Key, r.DType, r.Shape, v)
		} else {
			v, _ := r.Int64()
			fmt.Println(r.Key, r.DType, r.Shape, v)
		}
	}
	fmt.Println("complete:", sr.Complete())
	// Output:
	// producer: example schedule: [0 4]
	// -/p7/L1/kv bf16 [2] [1.5 -0.25]
	// -/p7/G/pos i64 [1] [7]
	// complete: true
}

// Look up a canonical stage.
func ExampleLookupStage() {
	s, _ := dump.LookupStage("index_sel")
	fmt.Println(s.DType, s.Shape, s.When)
	// Output:
	// i64 [K] r=4
}
