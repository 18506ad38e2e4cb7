package quant

// Alternative fake quantisers: FQ8 the way engines that do not follow the
// reference compute it (spec §9.4, §9.5). The replay runs them as hypotheses
// on the dumped input of a diverging FQ8 stage to name what the GPU did; the
// reference is FQ8.

// FQ8Rule is FQ8(v, B) with the block scale picked by rule and the amax floor
// floor instead of the reference's ceil2 and 1e-4, in place:
//
//	x    = BlockScaleExp(rule, max_i |v_i|, 448, floor),  s = 2^x
//	v'_i = bf16( E4M3(clamp(v_i / s, -448, 448)) · s )
//
// FQ8Rule(v, B, ScaleCeil2, FP8AmaxFloor) is FQ8 (tested). Engines:
// ScaleLog2Ceil with floor 1e-4 (vLLM's Triton writers), ScaleLog2Ceil with
// floor 1e-8 (SGLang), ScaleFlashMLA (FlashMLA's test quantiser),
// ScaleRoundLog2 (SGLang's experimental MXFP4 codec rule applied to FP8).
func FQ8Rule(v []float32, B int, rule ScaleRule, floor float32) {
	if B <= 0 || len(v)%B != 0 {
		panic("quant: FQ8Rule length not a multiple of the block")
	}
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		fq8Exp(blk, BlockScaleExp(rule, absMax(blk), E4M3Max, floor))
	}
}

// FQ8Floor2 is FQ8(v, B) with the block scale rounded down instead of up,
// in place: with t = f32(max(amax, 1e-4) · f32(1/448)),
//
//	s = ceil2(t) when t is a power of two, else ceil2(t)/2 (= 2^floor(log2 t))
//	v'_i = bf16( E4M3(clamp(v_i / s, -448, 448)) · s )
//
// Values above 448·s saturate at ±448·s. It is the scale bug of the
// fp8-scale fault (spec §9.4: a scale 2× apart).
func FQ8Floor2(v []float32, B int) {
	if B <= 0 || len(v)%B != 0 {
		panic("quant: FQ8Floor2 length not a multiple of the block")
	}
	for b := 0; b < len(v); b += B {
		blk := v[b : b+B]
		t := max(absMax(blk), FP8AmaxFloor) * InvE4M3Max
		x := Ceil2Exp(t)
		if Pow2(x) != t {
			x--
		}
		fq8Exp(blk, x)
	}
}

// fq8Exp fake-quantises one block with the scale 2^x:
// v'_i = bf16(E4M3(clamp(v_i / 2^x, ±448)) · 2^x), dividing as the spec
// writes it (the reference form; no fast path).
func fq8Exp(blk []float32, x int) {
	s, _, _ := blockScale(x)
	for i, f := range blk {
		q := DecodeE4M3(encodeE4M3Ref(clamp(f/s, -E4M3Max, E4M3Max)))
		blk[i] = BF16Round(q * s)
	}
}

// QuantizeActFP8Rule is QuantizeActFP8 with the block scale picked by rule
// and floor (engines that quantise FP8 GEMM activations with log2 + ceil or
// another floor, §9.4). QuantizeActFP8Rule(q, s, x, B, ScaleCeil2,
// FP8AmaxFloor) is QuantizeActFP8 (tested).
func QuantizeActFP8Rule(q, s []float32, x []float32, B int, rule ScaleRule, floor float32) {
	if B <= 0 || len(x)%B != 0 || len(q) < len(x) || len(s) < len(x)/B {
		panic("quant: QuantizeActFP8Rule length mismatch")
	}
	for b := 0; b < len(x)/B; b++ {
		blk := x[b*B : (b+1)*B]
		sc, _, _ := blockScale(BlockScaleExp(rule, absMax(blk), E4M3Max, floor))
		s[b] = sc
		for i, f := range blk {
			q[b*B+i] = DecodeE4M3(encodeE4M3Ref(clamp(f/sc, -E4M3Max, E4M3Max)))
		}
	}
}
