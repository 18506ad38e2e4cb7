package quant_test

import (
	"fmt"

	"sparsemla/quant"
)

// bf16(v): round to nearest, ties to even, on the 8-bit significand.
func ExampleBF16Round() {
	fmt.Println(quant.BF16Round(1 + 0x1p-8))   // halfway between 1 and 1+2^-7: even is 1
	fmt.Println(quant.BF16Round(1 + 3*0x1p-8)) // halfway between 1+2^-7 and 1+2^-6: even is 1+2^-6
	fmt.Println(quant.BF16Round(0.1))
	// Output:
	// 1
	// 1.015625
	// 0.100097656
}

// torch's E4M3 cast turns values past 464 into NaN; the spec clamps first,
// which EncodeE4M3Sat does in one step.
func ExampleEncodeE4M3() {
	for _, x := range []float32{448, 464, 465, 0x1p-10, 3 * 0x1p-10} {
		fmt.Printf("%-12g E4M3 %#02x  saturating %#02x\n", x, quant.EncodeE4M3(x), quant.EncodeE4M3Sat(x))
	}
	// Output:
	// 448          E4M3 0x7e  saturating 0x7e
	// 464          E4M3 0x7e  saturating 0x7e
	// 465          E4M3 0x7f  saturating 0x7e
	// 0.0009765625 E4M3 0x00  saturating 0x00
	// 0.0029296875 E4M3 0x02  saturating 0x02
}

// FQ8 on one block: amax = 100, s = ceil2(100·f32(1/448)) = ceil2(0.2232) = 0.25.
// 1/s = 4 is on the grid; bf16(0.3)/s = 1.203 rounds to 1.25; 100/s = 400 is
// halfway between 384 and 416 and goes to the even 384.
func ExampleFQ8() {
	v := make([]float32, 64)
	v[0], v[1], v[2] = 1, quant.BF16Round(0.3), 100
	codes := make([]uint8, 64)
	scales := make([]uint8, 1)
	quant.QuantizeFP8(codes, scales, v, 64, quant.ScaleCeil2, quant.FP8AmaxFloor)
	quant.FQ8(v, 64)
	fmt.Println(v[0], v[1], v[2])
	fmt.Printf("codes %#02x %#02x %#02x, scale byte %d = 2^%d\n", codes[0], codes[1], codes[2], scales[0], int(scales[0])-127)
	// Output:
	// 1 0.3125 96
	// codes 0x48 0x3a 0x7c, scale byte 125 = 2^-2
}

// FQ4 on one block: amax = 3, s = ceil2(3·f32(1/6)) = 0.5; the scaled values
// 6, 2.2 and -0.8 round to 6, 2 and -1.
func ExampleFQ4() {
	v := make([]float32, 32)
	v[0], v[1], v[2] = 3, quant.BF16Round(1.1), quant.BF16Round(-0.4)
	quant.FQ4(v, 32)
	fmt.Println(v[0], v[1], v[2])
	// Output:
	// 3 1 -0.5
}

// torch's float8_e8m0fnu cast rounds the linear mantissa (ties up) and drops the
// sign; it is not ceil2.
func ExampleCastUE8M0() {
	for _, x := range []float32{1.25, 1.5, 3, -3, 0} {
		b := quant.CastUE8M0(x)
		fmt.Printf("%g -> byte %d = %g\n", x, b, quant.DecodeUE8M0(b))
	}
	fmt.Println("ceil2(1.25) =", quant.Ceil2(1.25))
	// Output:
	// 1.25 -> byte 127 = 1
	// 1.5 -> byte 128 = 2
	// 3 -> byte 129 = 4
	// -3 -> byte 129 = 4
	// 0 -> byte 0 = 5.877472e-39
	// ceil2(1.25) = 2
}

// Had on a 4-vector: W·[1 2 3 4] = [10 -2 -4 0], times 4^-0.5.
func ExampleHadamard() {
	v := []float32{1, 2, 3, 4}
	quant.Hadamard(v)
	fmt.Println(v)
	// Output:
	// [5 -1 -2 0]
}
