package attention

import (
	"math"

	"sparsemla/quant"
)

// Fast linears. A weight is repacked once ("prepared") into panels of
// PanelRows consecutive output rows stored column-major inside the panel,
// panel[k][lane], so that one SIMD lane owns one output row and walks its k in
// ascending order. Each lane performs exactly the reference's fp32 operations
// in the reference's order (a rounded product, then a rounded sum; the FP8
// kernels fuse the two, which gives the same bits because their products are
// exact), so every output is bit-identical to FP8Linear / BF16Linear /
// F32Linear / WoA, and the result does not depend on how panels are spread
// over goroutines (each row is computed by one goroutine only).

// PanelRows is the number of output rows of one panel (8 AVX2 registers of 8
// fp32 lanes).
const PanelRows = 64

// UseAssembly selects the AVX2 kernels when the CPU has them (the default). Set
// it to false to run the pure-Go lane loops, which compute the same bits; the
// tests compare the two. Build with -tags purego to leave the assembly out.
var UseAssembly = hasAVX2

// HasAssembly reports whether this build and CPU can run the AVX2 kernels.
func HasAssembly() bool { return hasAVX2 }

func useAsm() bool { return UseAssembly && hasAVX2 }

// UseAVX512 selects, with UseAssembly, the AVX-512 forms of the kernels when
// the CPU has AVX-512F (the default): the FP8 panels (fp8Panel64AVX512,
// fp8Terms64AVX512, fp8PlainPanel64AVX512), the bf16 and fp32 panels, the
// attention's P·V update and the index scoring. They compute the same bits
// as the AVX2 forms (the tests run both where the CPU can); false keeps
// AVX2, to compare their speed on one machine (SPARSEMLA_AVX512=0 in the
// benchmarks).
var UseAVX512 = hasAVX512

// UseVNNI selects, with UseAVX512, the index scoring's integer products
// (indexTerms64VNNI) for the keys where they give the reference's bits, when
// the CPU has AVX-512 VNNI (the default); false keeps every key on the fp32
// kernel, to compare their speed on one machine (SPARSEMLA_VNNI=0 in the
// benchmarks).
var UseVNNI = true

// HasVNNI reports whether this build and CPU can run the VNNI index kernel.
func HasVNNI() bool { return hasVNNI && HasAVX512() }

// HasAVX512 reports whether this build and CPU can run the AVX-512 kernels.
func HasAVX512() bool { return hasAVX512 && hasAVX2 }

func useAVX512() bool { return UseAVX512 && hasAVX512 && useAsm() }

// boolByte is 1 for true, 0 for false (a flag the assembly reads).
func boolByte(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}

// Panels is a bf16 or fp32 weight [Rows, Cols] repacked as
// [ceil(Rows/64)][Cols][64] (rows past Rows are zero padding). Weights whose
// every value is a bf16 value (weights_proj, wo_a, and the checkpoint's
// compressor weights) are stored as bf16 bits (BF16 != nil), half the bytes;
// others as fp32 (F32 != nil). Both widen to the same fp32 values.
type Panels struct {
	Rows, Cols int
	BF16       []uint16
	F32        []float32
}

// PackPanels repacks W [rows, cols] (row-major), choosing bf16 storage when it
// is lossless.
func PackPanels(W []float32, rows, cols int) *Panels {
	if rows <= 0 || cols <= 0 || len(W) != rows*cols {
		panic("attention: PackPanels shape mismatch")
	}
	np := (rows + PanelRows - 1) / PanelRows
	bf := true
	for _, v := range W {
		if quant.BF16Round(v) != v || v != v {
			bf = false
			break
		}
	}
	p := &Panels{Rows: rows, Cols: cols}
	if bf {
		p.BF16 = make([]uint16, np*cols*PanelRows)
	} else {
		p.F32 = make([]float32, np*cols*PanelRows)
	}
	parallelFor(np, rows*cols, func(lo, hi int) {
		for pi := lo; pi < hi; pi++ {
			base := pi * cols * PanelRows
			for l := 0; l < PanelRows && pi*PanelRows+l < rows; l++ {
				row := W[(pi*PanelRows+l)*cols : (pi*PanelRows+l+1)*cols]
				for k, v := range row {
					if bf {
						p.BF16[base+k*PanelRows+l] = uint16(math.Float32bits(v) >> 16)
					} else {
						p.F32[base+k*PanelRows+l] = v
					}
				}
			}
		}
	})
	return p
}

// Row writes row n of the weight (its fp32 values, widened from bf16
// storage exactly) to dst [Cols].
func (p *Panels) Row(dst []float32, n int) {
	if len(dst) != p.Cols || n < 0 || n >= p.Rows {
		panic("attention: Panels.Row shape mismatch")
	}
	o, l := (n/PanelRows)*p.Cols*PanelRows, n%PanelRows
	for k := range dst {
		if p.BF16 != nil {
			dst[k] = quant.BF16ToF32(p.BF16[o+k*PanelRows+l])
		} else {
			dst[k] = p.F32[o+k*PanelRows+l]
		}
	}
}

// RowMajor returns the weight [Rows, Cols] row-major in fp32 (a new copy).
func (p *Panels) RowMajor() []float32 {
	w := make([]float32, p.Rows*p.Cols)
	for n := 0; n < p.Rows; n++ {
		p.Row(w[n*p.Cols:(n+1)*p.Cols], n)
	}
	return w
}

// Bytes is the memory the packed weight holds.
func (p *Panels) Bytes() int64 { return int64(2*len(p.BF16) + 4*len(p.F32)) }

// Dot is F32Linear on the packed weight, bit-identical: y[n] = Σ_k x[k]·W[n,k],
// fp32, k ascending, no rounding of y. x [Cols], y [Rows].
func (p *Panels) Dot(y, x []float32) { p.apply(y, x, false) }

// Linear is BF16Linear on the packed weight, bit-identical:
// y[n] = bf16(Σ_k x[k]·W[n,k]).
func (p *Panels) Linear(y, x []float32) { p.apply(y, x, true) }

func (p *Panels) apply(y, x []float32, round bool) {
	if len(x) != p.Cols || len(y) != p.Rows {
		panic("attention: Panels shape mismatch")
	}
	np := (p.Rows + PanelRows - 1) / PanelRows
	K := p.Cols
	z := useAVX512()
	parallelFor(np, p.Rows*p.Cols, func(lo, hi int) {
		var tmp [PanelRows]float32
		for pi := lo; pi < hi; pi++ {
			base := pi * K * PanelRows
			switch {
			case useAsm() && p.BF16 != nil:
				bf16Panel64(z, &tmp[0], &p.BF16[base], &x[0], K)
			case useAsm():
				f32Panel64(z, &tmp[0], &p.F32[base], &x[0], K)
			default:
				tmp = [PanelRows]float32{}
				for k, xv := range x {
					o := base + k*PanelRows
					for l := range tmp {
						var w float32
						if p.BF16 != nil {
							w = quant.BF16ToF32(p.BF16[o+l])
						} else {
							w = p.F32[o+l]
						}
						tmp[l] += float32(xv * w)
					}
				}
			}
			n0 := pi * PanelRows
			for l := 0; l < PanelRows && n0+l < p.Rows; l++ {
				if round {
					y[n0+l] = quant.BF16Round(tmp[l])
				} else {
					y[n0+l] = tmp[l]
				}
			}
		}
	})
}

// WoAPanels is the grouped output projection wo_a [G·R, (H/G)·d] packed per
// group: as FP8 codes + block scales (FP8, 1 byte per weight) when the bf16
// values re-encode losslessly (EncodeFP8Blocks: they do for checkpoint
// weights), else as bf16 panels (BF16).
type WoAPanels struct {
	Groups, Rank int
	FP8          []*FP8Panels
	BF16         []*Panels
}

// PackWoA packs wo_a per group.
func PackWoA(woa []float32, groups, rank, gd int) *WoAPanels {
	if len(woa) != groups*rank*gd {
		panic("attention: PackWoA shape mismatch")
	}
	w := &WoAPanels{Groups: groups, Rank: rank}
	if gd%ActBlock == 0 {
		for g := 0; g < groups; g++ {
			codes, scale, ok := EncodeFP8Blocks(woa[g*rank*gd:(g+1)*rank*gd], rank, gd)
			if !ok {
				w.FP8 = nil
				break
			}
			w.FP8 = append(w.FP8, PackFP8(codes, scale, rank, gd))
		}
	}
	if w.FP8 == nil {
		for g := 0; g < groups; g++ {
			w.BF16 = append(w.BF16, PackPanels(woa[g*rank*gd:(g+1)*rank*gd], rank, gd))
		}
	}
	return w
}

// Bytes is the memory the packed weight holds.
func (w *WoAPanels) Bytes() int64 {
	var n int64
	for _, g := range w.FP8 {
		n += g.Bytes()
	}
	for _, g := range w.BF16 {
		n += g.Bytes()
	}
	return n
}

// MACs is the number of multiply-adds of one WoA.
func (w *WoAPanels) MACs() int64 {
	var n int64
	for _, g := range w.FP8 {
		n += int64(g.Rows * g.Cols)
	}
	for _, g := range w.BF16 {
		n += int64(g.Rows * g.Cols)
	}
	return n
}

// WoA is attention.WoA on the packed weight, bit-identical:
// u[g][r] = bf16(Σ_k o[g][k]·wo_a[g·R+r][k]).
func (w *WoAPanels) WoA(u, o []float32) {
	gd := len(o) / w.Groups
	if len(u) != w.Groups*w.Rank || len(o)%w.Groups != 0 {
		panic("attention: WoAPanels shape mismatch")
	}
	if w.FP8 == nil {
		for g := 0; g < w.Groups; g++ {
			w.BF16[g].Linear(u[g*w.Rank:(g+1)*w.Rank], o[g*gd:(g+1)*gd])
		}
		return
	}
	// every group's panels in one parallel loop
	jobs := make([]*fp8Job, w.Groups)
	for g, p := range w.FP8 {
		if len(o[g*gd:(g+1)*gd]) != p.Cols || p.Rows != w.Rank {
			panic("attention: WoAPanels shape mismatch")
		}
		jobs[g] = p.job(u[g*w.Rank:(g+1)*w.Rank], o[g*gd:(g+1)*gd], nil, nil, 1)
	}
	np := jobs[0].items()
	parallelFor(w.Groups*np, w.Groups*w.Rank*gd, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			jobs[i/np].run(i%np, i%np+1)
		}
	})
	for _, j := range jobs {
		j.release()
	}
}

// bf16Panel64, f32Panel64 and pvChunk run a kernel's AVX-512 form when z
// (useAVX512, read once per product by the caller), else its AVX2 form: the
// same bits either way.
func bf16Panel64(z bool, y *float32, w *uint16, x *float32, k int) {
	if z {
		bf16Panel64AVX512(y, w, x, k)
	} else {
		bf16Panel64AVX2(y, w, x, k)
	}
}

func f32Panel64(z bool, y *float32, w *float32, x *float32, k int) {
	if z {
		f32Panel64AVX512(y, w, x, k)
	} else {
		f32Panel64AVX2(y, w, x, k)
	}
}

func pvChunk(z bool, acc *float32, rows **float32, p *float32, n int, alpha float32, d int) {
	if z {
		pvChunkAVX512(acc, rows, p, n, alpha, d)
	} else {
		pvChunkAVX2(acc, rows, p, n, alpha, d)
	}
}
