// Package quant holds every number format of the DeepSeek-V4 attention path and
// every rounding point the reference names, as small pure functions.
//
// # Formats
//
//   - bf16: fp32 with the low 16 mantissa bits rounded away (round to nearest,
//     ties to even). [BF16Round] is the rounding point the spec writes bf16(v).
//   - fp16: IEEE binary16 through github.com/x448/float16.
//   - FP8 E4M3FN (OCP): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448,
//     no infinities, NaN = 0x7F/0xFF. [E4M3] rounds, [EncodeE4M3]/[DecodeE4M3]
//     convert codes.
//   - FP8 E5M2: 1/5/2 bits, bias 15, IEEE-like with infinities.
//   - FP4 E2M1: values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign bit; two codes per
//     byte with the even index in the low nibble ([PackFP4]).
//   - UE8M0 (torch float8_e8m0fnu): one byte, value 2^(byte-127), 0xFF = NaN.
//
// # Rounding points of the spec (dsv4-attention.md)
//
//	bf16(v)            BF16Round                          §0.2, everywhere
//	ceil2(t)           Ceil2                              §0.2, every power-of-two scale
//	FQ8(v, 64)         FQ8                                §3.3  window K, compressed rows
//	FQ4(v, 32)         FQ4                                §3.4  indexer q and keys
//	Had(v)             Hadamard                           §3.5  indexer q and keys
//	FP8 activations    QuantizeActFP8                     §3.2  input of every FP8 linear
//	FP8 weights        DequantFP8Weight                   §3.2  128x128 UE8M0 blocks
//
// Every function here is deterministic and independent of GOMAXPROCS. Inputs that
// are slices are processed in index order; nothing allocates unless it says so.
//
// # Conformance
//
// The casts are bit-exact with PyTorch 2.11 on CUDA (testdata/quant holds vectors
// made on an H200). Note that torch's fp32 → float8_e4m3fn cast does not saturate:
// values that round beyond 448 and ±inf become NaN. [EncodeE4M3] follows torch;
// [EncodeE4M3Sat] is the saturating (satfinite) variant kernels use.
package quant
