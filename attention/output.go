package attention

// WoA is the grouped low-rank output projection (R-M:537-541,
// torch.einsum("bsgd,grd->bsgr", o, wo_a.view(G, R, -1)), a bf16 GEMM):
//
//	u[g][r] = bf16( Σ_k o[g][k] · wo_a[g·R + r][k] )     fp32 accumulation, k ascending
//
// o [H·d] is the inverse-roped attention output viewed as [G][(H/G)·d]: group g
// holds heads g·H/G … (g+1)·H/G − 1 concatenated. woa [G·R][(H/G)·d] holds bf16
// values (checkpoint FP8 dequantised by convert.py). u has G·R elements.
func WoA(u, o, woa []float32, groups, rank int) {
	if groups <= 0 || len(o)%groups != 0 {
		panic("attention: WoA heads do not split into groups")
	}
	gd := len(o) / groups
	if len(u) != groups*rank || len(woa) != groups*rank*gd {
		panic("attention: WoA shape mismatch")
	}
	for g := 0; g < groups; g++ {
		BF16Linear(u[g*rank:(g+1)*rank], o[g*gd:(g+1)*gd], woa[g*rank*gd:(g+1)*rank*gd], rank, gd)
	}
}
