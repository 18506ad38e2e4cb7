package quant

// HadamardScale128 is f32(128^-0.5), bits 0x3DB504F3: the scale of Had on the
// 128-dim indexer head.
const HadamardScale128 float32 = 0.08838834764831845

// Hadamard is the spec's Had(v) (§3.5), in place on a vector of bf16 values
// whose length n is a power of two (128 in the model):
//
//	Had(v) = bf16( f32(n^-0.5) · (W·v) ),  W[i][j] = (-1)^popcount(i & j)
//
// with W in Sylvester (natural) order. W·v is evaluated by the fast
// Walsh–Hadamard butterfly in fp32, stages h = 1, 2, 4, … (pairs j, j+h become
// a+b, a-b), the way fast_hadamard_transform computes it for the official
// rotate_activation. The indexer applies it to q and to the keys before FQ4; it is
// orthonormal, so it leaves q·k unchanged apart from the quantisation.
//
// On the GPU golden vectors this equals torch's fp32 butterfly bit for bit and
// differs from F.linear(x, W)·scale (cuBLAS) in 3 of 32,768 outputs, by one
// bf16 ulp: fp32 sums of 128 terms depend on their order (§9.10).
func Hadamard(v []float32) {
	n := len(v)
	if n&(n-1) != 0 || n == 0 {
		panic("quant: Hadamard length not a power of two")
	}
	for h := 1; h < n; h *= 2 {
		for i := 0; i < n; i += 2 * h {
			for j := i; j < i+h; j++ {
				a, b := v[j], v[j+h]
				v[j], v[j+h] = a+b, a-b
			}
		}
	}
	s := hadamardScale(n)
	for i := range v {
		v[i] = BF16Round(v[i] * s)
	}
}

// HadamardRef computes Had(v) as the plain matrix-vector product, the form the
// fast_hadamard_transform library tests against:
//
//	dst[i] = bf16( f32(n^-0.5) · Σ_j (-1)^popcount(i&j) · v[j] )   (fp32, j ascending)
//
// It agrees with F.linear on CUDA on all 32,768 golden outputs and with Hadamard
// to one bf16 ulp. dst and v must have the same power-of-two length and must not
// overlap.
func HadamardRef(dst, v []float32) {
	n := len(v)
	if n&(n-1) != 0 || n == 0 || len(dst) != n {
		panic("quant: HadamardRef length mismatch")
	}
	s := hadamardScale(n)
	for i := 0; i < n; i++ {
		var acc float32
		for j := 0; j < n; j++ {
			if popcount(i&j)%2 == 0 {
				acc += v[j]
			} else {
				acc -= v[j]
			}
		}
		dst[i] = BF16Round(acc * s)
	}
}

// hadamardScale returns f32(n^-0.5) for a power of two n (tested against
// 1/math.Sqrt).
func hadamardScale(n int) float32 {
	if n == 128 {
		return HadamardScale128
	}
	s := 1.0
	for m := n; m > 1; m /= 4 {
		if m == 2 {
			s *= 0.7071067811865476
			break
		}
		s *= 0.5
	}
	return float32(s)
}

func popcount(x int) int {
	c := 0
	for ; x != 0; x &= x - 1 {
		c++
	}
	return c
}
