// Package quant holds every number format of the DeepSeek-V4 attention path and
// every rounding point the reference names, as small pure functions that are
// bit-exact with PyTorch 2.11 on CUDA.
//
// # Overview
//
// The spec (dsv4-attention.md) writes its rounding points as bf16(v), E4M3(v),
// E2M1(v), ceil2(t), FQ8(v, 64), FQ4(v, 32) and Had(v). Each has one function
// here, named in the table below; the reference engine calls them at exactly the
// points where the official model.py calls .to(bfloat16), act_quant,
// fp4_act_quant and rotate_activation.
//
// # Formats
//
//	format      bits             values                                 encode / decode
//	bf16        1·8·7            fp32 with 16 low bits rounded away     BF16Bits / BF16ToF32
//	fp16        1·5·10 (IEEE)    max 65504, subnormal step 2^-24        F16Bits / F16ToF32
//	E4M3FN      1·4·3, bias 7    max 448, min normal 2^-6, step 2^-9;   EncodeE4M3 / DecodeE4M3
//	                             no inf, NaN = 0x7F/0xFF
//	E5M2        1·5·2, bias 15   max 57344, ±inf, IEEE-like             EncodeE5M2 / DecodeE5M2
//	E2M1 (FP4)  1·2·1, bias 1    {0, 0.5, 1, 1.5, 2, 3, 4, 6}, no NaN   EncodeE2M1 / DecodeE2M1
//	UE8M0       8 exponent bits  2^(byte-127), 0xFF = NaN               CastUE8M0, EncodeUE8M0 / DecodeUE8M0
//
// FP4 codes are packed two per byte, the even index in the low nibble
// (PackFP4), as torch's float4_e2m1fn_x2 and the MXFP4 caches store them.
//
// # Rounding points of the spec
//
//	spec               function                           where
//	bf16(v)            BF16Round, BF16Bits                §0.2: every linear, norm, RoPE, attention output
//	E4M3(v)            E4M3, EncodeE4M3                   §0.2, inside FQ8 and the FP8 linears
//	E2M1(v)            E2M1, EncodeE2M1                   §0.2, inside FQ4
//	ceil2(t)           Ceil2, Ceil2Exp, Pow2              §0.2: every power-of-two block scale
//	FQ8(v, 64)         FQ8                                §3.3: window K and compressed rows, dims 0..447
//	FQ4(v, 32)         FQ4                                §3.4: indexer q and keys after Had
//	Had(v)             Hadamard (HadamardRef)             §3.5: indexer q and keys
//	FP8 activations    QuantizeActFP8                     §3.2: input of every FP8 linear (blocks of 128)
//	FP8 weights        DequantFP8Weight(Inv)              §3.2: 128x128 UE8M0 (or fp32) block scales
//	FP8/FP4 storage    QuantizeFP8/FP4, DequantizeFP8/FP4 §8: codes + UE8M0 bytes as KV caches store them
//	engine scales      BlockScaleExp with a ScaleRule     §9.4: ceil2 (reference), log2ceil, flashmla, roundlog2
//
// # Shapes and axis order
//
// Slices are row-major with the innermost axis last, as PyTorch stores them.
// Block functions take a flat slice whose length is a multiple of the block size
// B and treat each run of B consecutive elements as one block; block b owns
// elements b·B .. b·B+B-1 and scale b. Weights are [out, in] with scales
// [ceil(out/128), ceil(in/128)].
//
// # Invariants
//
// Every function is deterministic, allocation-free and independent of
// GOMAXPROCS; slices are processed in index order. NaN results carry fixed bit
// patterns (see Precision), so outputs are the same bits on every CPU. Length
// and shape mismatches are programmer errors and panic with a "quant: " message.
// Values that are already on a grid (bf16 inputs to FQ8/FQ4, E4M3 codes times a
// power of two) are never rounded twice: the products the spec writes are exact.
//
// Fast paths live beside their references and are tested equal on every code,
// every halfway point and a sweep of all fp32 inputs (all 2^32 with
// go test ./quant -args -quant.exhaustive): EncodeE4M3, EncodeE4M3Sat,
// EncodeE5M2 and EncodeE2M1 round with an integer add (normal range) or an fp32
// add (subnormal range), as torch's c10 code does, against references that round
// the significand (roundMinifloat); FQ8 and FQ4 multiply by the exact inverse of
// the power-of-two scale and use the saturating encoders in place of
// clamp-then-round, against fq8Ref and fq4Ref, which transcribe the spec;
// DequantizeFP8 looks for NaN codes eight at a time and multiplies without a
// per-element NaN check when a block has none, against dequantizeFP8Ref.
//
// # Precision
//
// Conformance was measured on an H200 with torch 2.11.0+cu130; testdata/quant
// holds the vectors and capture/golden/quant_golden.py makes them. What the GPU
// does, where it is not obvious:
//
//   - fp32 → bf16 and fp32 → fp16 round to nearest even; every NaN becomes the
//     canonical 0x7FFF (sign and payload dropped). torch's CPU cast agrees on all
//     57,437 golden inputs except the 42 NaNs (0xFFFF for the bf16 NaNs inspected).
//   - fp32 → E4M3FN does not saturate: |x| > 464 and ±inf become NaN (0x7F with
//     x's sign). The spec clamps to ±448 first, which EncodeE4M3Sat folds in.
//   - fp32 → E5M2 overflows to ±inf from 61440 (halfway to 2^16).
//   - fp32 → float8_e8m0fnu (CastUE8M0) rounds: it keeps the fp32 exponent and
//     adds one when the mantissa is ≥ 1.5 (round to nearest on the linear
//     mantissa, ties up), ignores the sign, maps 0 to 2^-127 and inf/NaN/overflow
//     to 0xFF. It is not ceil2: 1.25 → 1, 1.5 → 2, while ceil2(1.25) = 2. The
//     quantisers never depend on it because their scales are already powers of two.
//   - Decoding: E4M3 NaN → 0x7FF00000|sign, E5M2 NaN → 0x7FFFFFFF|sign, fp16 NaN →
//     0x7FFFFFFF, UE8M0 0xFF → 0x7F800001, UE8M0 0x00 → 2^-127; bf16 widens by a
//     shift. NaN products (dequantisation) are the canonical CUDA NaN 0x7FFFFFFF.
//   - FQ8, FQ4, the real quantisers and the four ScaleRules (torch.log2 in fp32 on
//     CUDA for the log2 rules) agree bit for bit on every golden block.
//   - Had(v): the butterfly equals torch's fp32 butterfly bit for bit; against
//     F.linear with the Sylvester matrix (cuBLAS) it differs in 3 of 32,768
//     outputs by one bf16 ulp, while HadamardRef (row sums, ascending index)
//     agrees on all of them. FP4 rounding has no GPU reference (no FP4 cast on
//     sm_90): its ties rule is the spec's, checked against an independent
//     threshold formulation run in torch.
package quant
