package quant

import (
	"math/rand/v2"
	"testing"
)

// benchN is the element count of each benchmark call: 64 Ki values, a window's
// worth of 128 KV rows of 512, small enough to stay in L2.
const benchN = 1 << 16

func benchValues(n int, scale float32) []float32 {
	r := rand.New(rand.NewPCG(1, 2))
	v := make([]float32, n)
	for i := range v {
		v[i] = BF16Round(float32(r.NormFloat64()) * scale)
	}
	return v
}

// reportElems turns the benchmark time into elements per second.
func reportElems(b *testing.B, perOp int) {
	b.ReportMetric(float64(perOp)*float64(b.N)/b.Elapsed().Seconds(), "elem/s")
}

func BenchmarkBF16Round(b *testing.B) {
	v := benchValues(benchN, 3)
	dst := make([]float32, len(v))
	b.SetBytes(int64(4 * len(v)))
	for b.Loop() {
		copy(dst, v)
		BF16RoundSlice(dst)
	}
	reportElems(b, len(v))
}

func BenchmarkEncodeE4M3(b *testing.B) {
	v := benchValues(benchN, 100)
	codes := make([]uint8, len(v))
	for b.Loop() {
		for i, x := range v {
			codes[i] = EncodeE4M3(x)
		}
	}
	reportElems(b, len(v))
}

func BenchmarkEncodeE4M3Ref(b *testing.B) {
	v := benchValues(benchN, 100)
	codes := make([]uint8, len(v))
	for b.Loop() {
		for i, x := range v {
			codes[i] = encodeE4M3Ref(x)
		}
	}
	reportElems(b, len(v))
}

func BenchmarkQuantizeFP8(b *testing.B) {
	v := benchValues(benchN, 3)
	codes := make([]uint8, len(v))
	scales := make([]uint8, len(v)/64)
	for b.Loop() {
		QuantizeFP8(codes, scales, v, 64, ScaleCeil2, FP8AmaxFloor)
	}
	reportElems(b, len(v))
}

func BenchmarkDequantizeFP8(b *testing.B) {
	v := benchValues(benchN, 3)
	codes := make([]uint8, len(v))
	scales := make([]uint8, len(v)/64)
	QuantizeFP8(codes, scales, v, 64, ScaleCeil2, FP8AmaxFloor)
	dst := make([]float32, len(v))
	for b.Loop() {
		DequantizeFP8(dst, codes, scales, 64)
	}
	reportElems(b, len(v))
}

func BenchmarkFQ8(b *testing.B) {
	v := benchValues(benchN, 3)
	dst := make([]float32, len(v))
	for b.Loop() {
		copy(dst, v)
		FQ8(dst, 64)
	}
	reportElems(b, len(v))
}

func BenchmarkQuantizeFP4(b *testing.B) {
	v := benchValues(benchN, 3)
	packed := make([]uint8, len(v)/2)
	scales := make([]uint8, len(v)/32)
	for b.Loop() {
		QuantizeFP4(packed, scales, v, 32, ScaleCeil2, FP4AmaxFloor)
	}
	reportElems(b, len(v))
}

func BenchmarkDequantizeFP4(b *testing.B) {
	v := benchValues(benchN, 3)
	packed := make([]uint8, len(v)/2)
	scales := make([]uint8, len(v)/32)
	QuantizeFP4(packed, scales, v, 32, ScaleCeil2, FP4AmaxFloor)
	dst := make([]float32, len(v))
	for b.Loop() {
		DequantizeFP4(dst, packed, scales, 32)
	}
	reportElems(b, len(v))
}

func BenchmarkFQ4(b *testing.B) {
	v := benchValues(benchN, 3)
	dst := make([]float32, len(v))
	for b.Loop() {
		copy(dst, v)
		FQ4(dst, 32)
	}
	reportElems(b, len(v))
}

func BenchmarkHadamard(b *testing.B) {
	v := benchValues(benchN, 1)
	dst := make([]float32, len(v))
	for b.Loop() {
		copy(dst, v)
		for r := 0; r < len(dst); r += 128 {
			Hadamard(dst[r : r+128])
		}
	}
	reportElems(b, len(v))
}

func BenchmarkHadamardRef(b *testing.B) {
	v := benchValues(benchN, 1)
	dst := make([]float32, len(v))
	for b.Loop() {
		for r := 0; r < len(dst); r += 128 {
			HadamardRef(dst[r:r+128], v[r:r+128])
		}
	}
	reportElems(b, len(v))
}

func BenchmarkDequantFP8Weight(b *testing.B) {
	const rows, cols = 256, 256
	r := rand.New(rand.NewPCG(3, 4))
	w := make([]uint8, rows*cols)
	for i := range w {
		w[i] = uint8(r.IntN(256)) &^ 0x80 // no NaN-heavy mix: realistic codes
	}
	scale := []uint8{120, 121, 122, 123}
	dst := make([]float32, rows*cols)
	for b.Loop() {
		DequantFP8Weight(dst, w, scale, rows, cols)
	}
	reportElems(b, rows*cols)
}
