package quant

// HadamardScale128 is f32(128^-0.5), bits 0x3DB504F3.
const HadamardScale128 float32 = 0.08838834764831845

// Hadamard is the spec's Had(v) (§3.5), in place on a 128-vector of bf16 values:
//
//	Had(v) = bf16( f32(128^-0.5) · (W·v) ),  W[i][j] = (-1)^popcount(i & j)
//
// W·v is evaluated by the fast Walsh–Hadamard butterfly in fp32 (Sylvester order),
// the way fast_hadamard_transform does; HadamardRef sums each row in index order.
// The two can differ in the last fp32 bit before the bf16 rounding (§9.10).
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

// HadamardRef computes Had(v) as the plain matrix-vector product
// out_i = Σ_j (-1)^popcount(i&j) · v_j (fp32, j ascending), then bf16(s · out_i).
// dst and v must not overlap.
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
