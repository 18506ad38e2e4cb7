//go:build !amd64 || purego

package attention

// Without the amd64 assembly (other architectures, or the purego build tag)
// every fast path runs its pure-Go lane loop; these are never called.

const hasAVX2 = false

const hasAVX512 = false

const hasVBMI = false

const hasVNNI = false

// fp8VBMI is the AVX-512 kernels' switch (kernels_fast_amd64.go); unused here.
var fp8VBMI uint8

func fp8Panel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int) {
	panic("attention: no assembly kernels in this build")
}

func bf16Panel64AVX2(y *float32, w *uint16, x *float32, k int) {
	panic("attention: no assembly kernels in this build")
}

func f32Panel64AVX2(y *float32, w *float32, x *float32, k int) {
	panic("attention: no assembly kernels in this build")
}

func indexTerms64AVX2(terms *float32, icache *float32, iqT *float32, w *float32, rows int) {
	panic("attention: no assembly kernels in this build")
}

func indexSum64(sums *float32, terms *float32, rows int) {
	panic("attention: no assembly kernels in this build")
}

func indexTerms64AVX512(terms *float32, icache *float32, iqT *float32, w *float32, rows int) {
	panic("attention: no assembly kernels in this build")
}

func pvChunkAVX2(acc *float32, rows **float32, p *float32, n int, alpha float32, d int) {
	panic("attention: no assembly kernels in this build")
}

func fp8PlainPanel64AVX2(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int) {
	panic("attention: no assembly kernels in this build")
}

func fp8Terms64AVX2(t *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int) {
	panic("attention: no assembly kernels in this build")
}

func sumTerms64AVX2(y *float32, t *float32, n int) {
	panic("attention: no assembly kernels in this build")
}

func loadReadAVX2(p *byte, n int) uint64 {
	panic("attention: no assembly kernels in this build")
}

func fp8Widen64AVX2(v *float32, codes *uint8) {
	panic("attention: no assembly kernels in this build")
}

func fp8Panel64AVX512(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int) {
	panic("attention: no assembly kernels in this build")
}

func fp8Terms64AVX512(t *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int) {
	panic("attention: no assembly kernels in this build")
}

func bf16Panel64AVX512(y *float32, w *uint16, x *float32, k int) {
	panic("attention: no assembly kernels in this build")
}

func f32Panel64AVX512(y *float32, w *float32, x *float32, k int) {
	panic("attention: no assembly kernels in this build")
}

func f32Panel64x4AVX512(ys *[4]*float32, w *float32, xs *[4]*float32, k int) {
	panic("attention: no assembly kernels in this build")
}

func pvChunkAVX512(acc *float32, rows **float32, p *float32, n int, alpha float32, d int) {
	panic("attention: no assembly kernels in this build")
}

func fp8PlainPanel64AVX512(y *float32, codes *uint8, x *float32, scl *float32, sub *uint64, nkb int) {
	panic("attention: no assembly kernels in this build")
}

func getMXCSR() uint32  { panic("attention: no assembly kernels in this build") }
func setMXCSR(v uint32) { panic("attention: no assembly kernels in this build") }

func absMaxBitsAVX2(x *float32, n int) uint32 {
	panic("attention: no assembly kernels in this build")
}

func plainRangeAVX2(v *float32, n int) (lom, him, low uint32) {
	panic("attention: no assembly kernels in this build")
}

func quantBlockAVX2(out, xs *float32, x *float32, inv float32, n int) {
	panic("attention: no assembly kernels in this build")
}

func vnniPackRows(recs *byte, src *float32, rows int, limit int) (done uint64) {
	panic("attention: no assembly kernels in this build")
}

func indexTerms64VNNI(terms *float32, recs *byte, q *vnniQuery, done uint64, rows int) {
	panic("attention: no assembly kernels in this build")
}

func vnniVerifyRows(recs *byte, src *float32, rows int, limit int) (done uint64) {
	panic("attention: no assembly kernels in this build")
}

func exp32x8AVX512(dst *float32, src *float32, n int, window int64) (bad uint64) {
	panic("attention: no assembly kernels in this build")
}

func pvChunk2AVX512(acc0, acc1 *float32, rows **float32, p0, p1 *float32, n int, alpha0, alpha1 float32) {
	panic("attention: no assembly kernels in this build")
}
