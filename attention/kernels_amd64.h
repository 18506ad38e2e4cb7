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

// TERM64 is TERM16 on the 64 heads of one key: heads 0-15 in a, 16-31 in
// b, 32-47 in c, 48-63 in d, stored at 0(BX) … 192(BX).
#define TERM64(a, b, c, d) \
	TERM16(0, a); \
	TERM16(64, b); \
	TERM16(128, c); \
	TERM16(192, d)

// TERM16CONSTS sets the registers BF16RZ and TERM16 read (AX scratch): Z12
// = 0x7FFF, Z13 = 1, Z14 = 0xFFFF0000 in every lane, Z10 = +0.
#define TERM16CONSTS \
	MOVL $0x7FFF, AX; \
	VPBROADCASTD AX, Z12; \
	MOVL $1, AX; \
	VPBROADCASTD AX, Z13; \
	MOVL $0xFFFF0000, AX; \
	VPBROADCASTD AX, Z14; \
	VPXORD Z10, Z10, Z10
