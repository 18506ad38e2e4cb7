// Macros of the amd64 kernels that more than one assembly file uses: a
// macro is defined only in the file that defines or includes it, so
// kernels_fast_amd64.s (indexTerms64AVX512) and the generated
// index_vnni_amd64.s (indexTerms64VNNI) both include this header.

// BF16RZ is BF16R (kernels_fast_amd64.s) on the 16 lanes of a ZMM register
// r (Z9 scratch, Z12 = 0x7FFF, Z13 = 1, Z14 = 0xFFFF0000).
#define BF16RZ(r) \
	VPSRLD $16, r, Z9; \
	VPANDD Z13, Z9, Z9; \
	VPADDD Z12, Z9, Z9; \
	VPADDD Z9, r, r; \
	VPANDD Z14, r, r

// TERM16 is TERM8 (kernels_fast_amd64.s) on 16 heads (Z10 = +0): the score
// terms bf16(max(bf16(acc), 0)·w[off]) of the 16 head dot products in acc,
// with w at R8, stored at off(BX).
#define TERM16(off, acc) \
	BF16RZ(acc); \
	VMAXPS acc, Z10, acc; \
	VMULPS off(R8), acc, acc; \
	BF16RZ(acc); \
	VMOVUPS acc, off(BX)
