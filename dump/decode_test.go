package dump

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"sparsemla/quant"
)

// TestDecodeFloatTurns: decodeFloat's four-a-turn f32 and bf16 loops give
// the element-by-element widening bit for bit, for every length 0..19 (the
// tail of 0-3 elements after the turns included) and every bit pattern
// class (NaN payloads, ±inf, ±0, subnormals).
func TestDecodeFloatTurns(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for n := 0; n < 20; n++ {
		b32, b16 := make([]byte, 4*n), make([]byte, 2*n)
		for i := range b32 {
			b32[i] = byte(rng.Uint32())
		}
		for i := range b16 {
			b16[i] = byte(rng.Uint32())
		}
		got32, got16 := make([]float32, n), make([]float32, n)
		decodeFloat(got32, F32, b32)
		decodeFloat(got16, BF16, b16)
		for i := 0; i < n; i++ {
			if w := binary.LittleEndian.Uint32(b32[4*i:]); math.Float32bits(got32[i]) != w {
				t.Fatalf("f32 n=%d element %d: bits %#x, want %#x", n, i, math.Float32bits(got32[i]), w)
			}
			if w := math.Float32bits(quant.BF16ToF32(binary.LittleEndian.Uint16(b16[2*i:]))); math.Float32bits(got16[i]) != w {
				t.Fatalf("bf16 n=%d element %d: bits %#x, want %#x", n, i, math.Float32bits(got16[i]), w)
			}
		}
	}
}
