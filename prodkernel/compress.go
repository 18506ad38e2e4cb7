package prodkernel

import (
	"fmt"
	"math"

	"sparsemla/kvcache"
	"sparsemla/quant"
	"sparsemla/replay"
)

// Compressor kernels: vLLM's fused_compress_quant_cache (pooling → RMSNorm
// → RoPE → MODEL1 entry, one program per token) and SGLang's
// fused_ape_pool_norm_rope (pooling → RMSNorm → RoPE, fp32 out), given the
// window of (kv, score) state rows the reference pools at an emission step
// (capture/prodkernels/harness.py compressor_window).

// CompressWindow is that window for the main compressor at emission step p of
// layer l: kv and score rows [coff·r][coff·d] fp32 (scores hold ape), from the
// dumped state after step p−1 (rows 0..3, the previous group) and after step
// p (rows 4..7) for r = 4, after step p for r = 128.
func CompressWindow(src replay.Source, p int64, l, r int) (kv, score []float32, err error) {
	return compressWindow(src, p, l, r, "cmp_", 512)
}

// compressWindow is CompressWindow for the compressor whose stages are named
// prefix+"kv_state" ("cmp_", "icmp_") and whose head dim is d.
func compressWindow(src replay.Source, p int64, l, r int, prefix string, d int) (kv, score []float32, err error) {
	get := func(q int64, stage string) ([]float32, error) {
		t, ok, err := src.Stage(q, l, stage)
		if err != nil || !ok {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no %s (%v)", q, l, stage, err)
		}
		return t.F, nil
	}
	if r == 128 {
		if kv, err = get(p, prefix+"kv_state"); err != nil {
			return nil, nil, err
		}
		score, err = get(p, prefix+"score_state")
		if len(kv) != 128*d {
			return nil, nil, fmt.Errorf("prodkernel: step %d layer %d: kv_state of %d values at an emission step", p, l, len(kv))
		}
		return kv, score, err
	}
	w := 2 * d
	pk, e1 := get(p-1, prefix+"kv_state")
	ps, e2 := get(p-1, prefix+"score_state")
	ck, e3 := get(p, prefix+"kv_state")
	cs, e4 := get(p, prefix+"score_state")
	for _, e := range []error{e1, e2, e3, e4} {
		if e != nil {
			return nil, nil, e
		}
	}
	if len(pk) != 8*w || len(ck) != 8*w || len(ps) != 8*w || len(cs) != 8*w {
		return nil, nil, fmt.Errorf("prodkernel: step %d layer %d: %skv_state of %d values, want %d", p, l, prefix, len(ck), 8*w)
	}
	kv = append(append([]float32(nil), pk[:4*w]...), ck[4*w:8*w]...)
	score = append(append([]float32(nil), ps[:4*w]...), cs[4*w:8*w]...)
	return kv, score, nil
}

// PoolF32 is the pooled row of spec §5 in fp32 without the bf16 cast the
// reference makes before its norm: per channel c, over the window's rows
// (r = 4: rows 0..3 read channels [0, d), rows 4..7 channels [d, 2d)),
// softmax of the scores (max, exp, sum, divide) then Σ weight·kv.
func PoolF32(kv, score []float32, r, d int) []float32 {
	coff, rows := 1, r
	if r == 4 {
		coff, rows = 2, 8
	}
	out := make([]float32, d)
	for c := 0; c < d; c++ {
		col := func(i int) int {
			off := 0
			if r == 4 && i >= 4 {
				off = d
			}
			return i*coff*d + off + c
		}
		m := float32(math.Inf(-1))
		for i := 0; i < rows; i++ {
			m = max(m, score[col(i)])
		}
		var den float32
		e := make([]float32, rows)
		for i := 0; i < rows; i++ {
			e[i] = float32(math.Exp(float64(score[col(i)] - m)))
			den += e[i]
		}
		var acc float32
		for i := 0; i < rows; i++ {
			acc += kv[col(i)] * (e[i] / den)
		}
		out[c] = acc
	}
	return out
}

// NormF32 is RMSNorm in fp32 with no rounding: x·rsqrt(mean(x²) + eps)·w.
func NormF32(x, w []float32, eps float32) []float32 {
	var ss float32
	for _, v := range x {
		ss += v * v
	}
	rr := float32(1 / math.Sqrt(float64(ss/float32(len(x))+eps)))
	out := make([]float32, len(x))
	for i, v := range x {
		out[i] = v * rr * w[i]
	}
	return out
}

// VLLMCompressEntry is vLLM's fused_compress_quant_cache rule for the main
// compressor (spec §9.11) over an fp32 pooled row:
//
//	n = NormF32(pooled)                            (no bf16(row) first)
//	dims 0..447, per 64: x = bf16(n); s = 2^ceil(log2(max(max|x|, 1e-4)/448));
//	                     code = E4M3(clamp(x/s, ±448)), scale byte = log2 s + 127
//	dims 448..511: bf16(RoPE_fp32(n) at position j·r)   (interleaved pairs)
//
// and returns the 584-byte MODEL1 entry (scale pad byte 0).
func VLLMCompressEntry(pooled, w []float32, eps float32, rope RopeTable, pos int64) []byte {
	n := NormF32(pooled, w, eps)
	e := make([]byte, kvcache.Model1EntryBytes)
	for b := 0; b < 7; b++ {
		var amax float32
		x := make([]float32, 64)
		for i := range x {
			x[i] = quant.BF16Round(n[b*64+i])
			amax = max(amax, float32(math.Abs(float64(x[i]))))
		}
		s := scaleLog2Ceil(max(amax, 1e-4) * float32(1.0/448))
		for i, v := range x {
			e[b*64+i] = quant.EncodeE4M3Sat(v / s)
		}
		e[kvcache.Model1DataBytes+b] = uint8(int(math.Round(math.Log2(float64(s)))) + 127)
	}
	for i := 0; i < 32; i++ {
		c, s := rope.at(pos, i)
		x, y := n[448+2*i], n[449+2*i]
		a, b := quant.BF16Round(x*c-y*s), quant.BF16Round(y*c+x*s)
		ab, bb := quant.BF16Bits(a), quant.BF16Bits(b)
		o := 448 + 4*i
		e[o], e[o+1], e[o+2], e[o+3] = byte(ab), byte(ab>>8), byte(bb), byte(bb>>8)
	}
	return e
}

// CompressUnit is one emission (step, layer, row j) a compressor kernel ran.
type CompressUnit struct {
	P     int64
	Layer int
	Ratio int
}

// CheckVLLMCompress holds vLLM's stored entries (PREFIX.pP.LL.entry, 584
// bytes) against VLLMCompressEntry over PoolF32 of the dumped window, byte
// for byte, and measures the decoded entry against the reference's cmp_row
// (error / block amax; rope dims against their own amax).
func CheckVLLMCompress(src replay.Source, r *Run, prefix string, units []CompressUnit, norm map[int][]float32, eps float32, rope RopeTable) (*Check, error) {
	c := &Check{Kernel: prefix, Rule: "vLLM compressor: fp32 pool, fp32 RMSNorm, FP8 of bf16(norm) / bf16(fp32 RoPE)", Versus: "cmp_row"}
	var errs []float64
	for _, u := range units {
		got, _, err := r.Bytes(fmt.Sprintf("%s.p%d.L%d.entry", prefix, u.P, u.Layer))
		if err != nil {
			return nil, err
		}
		if len(got) != kvcache.Model1EntryBytes {
			return nil, fmt.Errorf("prodkernel: %s p%d L%d: entry of %d bytes", prefix, u.P, u.Layer, len(got))
		}
		kv, sc, err := CompressWindow(src, u.P, u.Layer, u.Ratio)
		if err != nil {
			return nil, err
		}
		pos := u.P / int64(u.Ratio) * int64(u.Ratio)
		want := VLLMCompressEntry(PoolF32(kv, sc, u.Ratio, 512), norm[u.Layer], eps, rope, pos)
		for i := 0; i < kvcache.Model1DataBytes; i++ {
			c.Codes++
			if got[i] == want[i] {
				c.Equal++
			} else {
				c.mismatch("p%d L%d byte %d: kernel 0x%02x, rule 0x%02x", u.P, u.Layer, i, got[i], want[i])
			}
		}
		for t := 0; t < kvcache.Model1Tiles; t++ {
			c.Scales++
			if got[kvcache.Model1DataBytes+t] == want[kvcache.Model1DataBytes+t] {
				c.ScalesEqual++
			} else {
				c.mismatch("p%d L%d scale %d: kernel 0x%02x, rule 0x%02x", u.P, u.Layer, t, got[kvcache.Model1DataBytes+t], want[kvcache.Model1DataBytes+t])
			}
		}
		row, _, err := DecodeEntry(got)
		if err != nil {
			return nil, err
		}
		ref, ok, err := src.Stage(u.P, u.Layer, "cmp_row")
		if err != nil || !ok {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no cmp_row (%v)", u.P, u.Layer, err)
		}
		errs = append(errs, blockErrors(row, ref.F, 64)...)
	}
	c.Dist = newDist(errs)
	return c, nil
}

// blockErrors is |a−b| / max|b over the block| per element, blocks of n.
func blockErrors(a, b []float32, n int) []float64 {
	var out []float64
	for lo := 0; lo < len(b); lo += n {
		var m float64
		for _, v := range b[lo:min(lo+n, len(b))] {
			m = max(m, math.Abs(float64(v)))
		}
		if m == 0 {
			continue
		}
		for i := lo; i < min(lo+n, len(b)); i++ {
			out = append(out, math.Abs(float64(a[i])-float64(b[i]))/m)
		}
	}
	return out
}

// PoolCheck is SGLang's fused_ape_pool_norm_rope output (fp32 [d]) held
// against the reference: its no-RoPE dims against NormF32(PoolF32(window))
// (relative to the row's amax) and the reference's cmp_normed (bf16 ulps of
// bf16(x)); its RoPE pairs against RoPE_fp32(NormF32(PoolF32(window))) at
// j·r, |kernel − rule| / |rule pair| per pair. A pair beyond 1e-3 is not the
// RoPE of this row's own values (the magnitudes of those pairs are not kept
// either, so no rotation of the row explains them).
type PoolCheck struct {
	Units       int
	NopeULP     Dist // bf16 ulps of bf16(kernel) against cmp_normed, dims 0..447
	NopeRel     Dist // |kernel − rule| / max|rule|, dims 0..447
	RopePairs   int
	RopeWrong   int      // pairs beyond 1e-3 of the rule
	WrongUnits  []string // units with such pairs
	RopeRelGood Dist     // the pair errors of the units without wrong pairs
}

// CheckSGLangPool builds the PoolCheck of SGLang's rows PREFIX.pP.LL.row.
// The main compressor's rows (d = 512, RoPE on dims 448..511) are checked
// against cmp_normed, the indexer compressor's (SGLang prefix "sglang_ipool",
// d = 128, RoPE on 64..127) against icmp_normed.
func CheckSGLangPool(src replay.Source, r *Run, prefix string, units []CompressUnit, norm map[int][]float32, eps float32, rope RopeTable) (*PoolCheck, error) {
	stage, d := "cmp_", 512
	if prefix == "sglang_ipool" {
		stage, d = "icmp_", 128
	}
	nope := d - 64
	pc := &PoolCheck{}
	var ulps, rels, good []float64
	for _, u := range units {
		k, err := r.Floats(fmtUnit(prefix, u.P, u.Layer))
		if err != nil {
			return nil, err
		}
		kv, sc, err := compressWindow(src, u.P, u.Layer, u.Ratio, stage, d)
		if err != nil {
			return nil, err
		}
		rule := NormF32(PoolF32(kv, sc, u.Ratio, d), norm[u.Layer], eps)
		nm, ok, err := src.Stage(u.P, u.Layer, stage+"normed")
		if !ok || err != nil || len(k.F) != d {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no cmp_normed (%v) or row of %d", u.P, u.Layer, err, len(k.F))
		}
		pc.Units++
		var rmax float64
		for _, v := range rule[:nope] {
			rmax = max(rmax, math.Abs(float64(v)))
		}
		for i := 0; i < nope; i++ {
			ulps = append(ulps, math.Abs(float64(quant.BF16ULPDistance(quant.BF16Round(k.F[i]), nm.F[i]))))
			rels = append(rels, math.Abs(float64(k.F[i]-rule[i]))/rmax)
		}
		pos := u.P / int64(u.Ratio) * int64(u.Ratio)
		bad := 0
		var errs []float64
		for i := 0; i < 32; i++ {
			c, s := rope.at(pos, i)
			x, y := rule[nope+2*i], rule[nope+1+2*i]
			a, b := x*c-y*s, y*c+x*s
			e := math.Hypot(float64(a-k.F[nope+2*i]), float64(b-k.F[nope+1+2*i])) / math.Hypot(float64(x), float64(y))
			pc.RopePairs++
			errs = append(errs, e)
			if e > 1e-3 {
				bad++
			}
		}
		if bad > 0 {
			pc.RopeWrong += bad
			pc.WrongUnits = append(pc.WrongUnits, fmt.Sprintf("p%d L%d (%d/32 pairs)", u.P, u.Layer, bad))
		} else {
			good = append(good, errs...)
		}
	}
	pc.NopeULP, pc.NopeRel, pc.RopeRelGood = newDist(ulps), newDist(rels), newDist(good)
	return pc, nil
}

func fmtUnit(prefix string, p int64, l int) string {
	if prefix == "vllm_cmp" || prefix == "vllm_icmp8" {
		return fmt.Sprintf("%s.p%d.L%d.entry", prefix, p, l)
	}
	return fmt.Sprintf("%s.p%d.L%d.row", prefix, p, l)
}

// VLLMIndexerCompressFP8 is vLLM's fused_compress_quant_cache rule for the
// indexer compressor's FP8 cache (d = 128, one quantisation block, fp32
// scale) over an fp32 pooled row:
//
//	n = NormF32(pooled); dims 64..127: RoPE_fp32(n) at j·r (interleaved pairs)
//	x = bf16(n); s = 2^ceil(log2(max(max|x|, 1e-4)·(1/448))); code = E4M3(clamp(x/s, ±448))
//
// It returns the 128 codes and s. The reference instead rotates by a
// Hadamard matrix and quantises to FP4 per 32 (icmp_had, icmp_row).
func VLLMIndexerCompressFP8(pooled, w []float32, eps float32, rope RopeTable, pos int64) ([]byte, float32) {
	n := NormF32(pooled, w, eps)
	for i := 0; i < 32; i++ {
		c, s := rope.at(pos, i)
		x, y := n[64+2*i], n[65+2*i]
		n[64+2*i], n[65+2*i] = x*c-y*s, y*c+x*s
	}
	var amax float32
	for i, v := range n {
		n[i] = quant.BF16Round(v)
		amax = max(amax, float32(math.Abs(float64(n[i]))))
	}
	s := scaleLog2Ceil(max(amax, 1e-4) * float32(1.0/448))
	codes := make([]byte, len(n))
	for i, v := range n {
		codes[i] = quant.EncodeE4M3Sat(v / s)
	}
	return codes, s
}

// CheckVLLMIndexerCompress holds vLLM's indexer-compressor FP8 entries
// (PREFIX.pP.LL.entry: 128 codes + fp32 scale) against
// VLLMIndexerCompressFP8 over the dumped icmp window, and measures the
// dequantised row against the reference's icmp_roped (error / row amax).
func CheckVLLMIndexerCompress(src replay.Source, r *Run, prefix string, units []CompressUnit, norm map[int][]float32, eps float32, rope RopeTable) (*Check, error) {
	c := &Check{Kernel: prefix, Rule: "vLLM indexer compressor (FP8): fp32 pool, fp32 RMSNorm, fp32 RoPE, FP8 of bf16 per row", Versus: "icmp_roped"}
	var errs []float64
	for _, u := range units {
		got, _, err := r.Bytes(fmtUnit(prefix, u.P, u.Layer))
		if err != nil {
			return nil, err
		}
		if len(got) != 132 {
			return nil, fmt.Errorf("prodkernel: %s p%d L%d: entry of %d bytes, want 132", prefix, u.P, u.Layer, len(got))
		}
		kv, sc, err := compressWindow(src, u.P, u.Layer, u.Ratio, "icmp_", 128)
		if err != nil {
			return nil, err
		}
		pos := u.P / int64(u.Ratio) * int64(u.Ratio)
		codes, s := VLLMIndexerCompressFP8(PoolF32(kv, sc, u.Ratio, 128), norm[u.Layer], eps, rope, pos)
		gs := math.Float32frombits(uint32(got[128]) | uint32(got[129])<<8 | uint32(got[130])<<16 | uint32(got[131])<<24)
		c.Scales++
		if gs == s {
			c.ScalesEqual++
		} else {
			c.mismatch("p%d L%d: kernel scale %g, rule %g", u.P, u.Layer, gs, s)
		}
		ref, ok, err := src.Stage(u.P, u.Layer, "icmp_roped")
		if err != nil || !ok || len(ref.F) != 128 {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no icmp_roped (%v)", u.P, u.Layer, err)
		}
		deq := make([]float32, 128)
		for i := range codes {
			c.Codes++
			if got[i] == codes[i] {
				c.Equal++
			} else {
				c.mismatch("p%d L%d dim %d: kernel code 0x%02x, rule 0x%02x", u.P, u.Layer, i, got[i], codes[i])
			}
			deq[i] = quant.DecodeE4M3(got[i]) * gs
		}
		errs = append(errs, blockErrors(deq, ref.F, 128)...)
	}
	c.Dist = newDist(errs)
	return c, nil
}
