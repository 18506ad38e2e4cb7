package prodkernel

import (
	"fmt"
	"math"
	"slices"

	"sparsemla/kvcache"
	"sparsemla/quant"
	"sparsemla/replay"
)

// Check is the result of holding a kernel's stored codes against an engine's
// rule written over the reference's own stage tensors: how many codes the rule
// reproduces bit for bit, the first mismatches, and how far the kernel's
// dequantised values are from the reference stage the engine replaces.
type Check struct {
	Kernel      string
	Rule        string // the equation
	Codes       int    // codes compared
	Equal       int    // codes reproduced bit for bit
	Scales      int    // scales compared
	ScalesEqual int
	First       []string // the first mismatches, in order
	// Versus is the reference stage the engine replaces and Dist the
	// distribution of |kernel − reference| / max|reference block| over it.
	Versus string
	Dist   Dist
}

// Dist is a distribution of non-negative errors.
type Dist struct {
	N                   int
	Max, P50, P99, P999 float64
}

func newDist(v []float64) Dist {
	if len(v) == 0 {
		return Dist{}
	}
	s := slices.Clone(v)
	slices.Sort(s)
	q := func(f float64) float64 { return s[min(len(s)-1, int(f*float64(len(s))))] }
	return Dist{N: len(s), Max: s[len(s)-1], P50: q(0.5), P99: q(0.99), P999: q(0.999)}
}

func (d Dist) String() string {
	return fmt.Sprintf("n %d, max %.3g, p50 %.3g, p99 %.3g, p99.9 %.3g", d.N, d.Max, d.P50, d.P99, d.P999)
}

// Agrees says whether every code and scale was reproduced.
func (c *Check) Agrees() bool { return c.Codes > 0 && c.Equal == c.Codes && c.ScalesEqual == c.Scales }

func (c *Check) mismatch(format string, a ...any) {
	if len(c.First) < 5 {
		c.First = append(c.First, fmt.Sprintf(format, a...))
	}
}

func (c *Check) String() string {
	s := fmt.Sprintf("%s: %d/%d codes and %d/%d scales reproduced by %s", c.Kernel, c.Equal, c.Codes, c.ScalesEqual, c.Scales, c.Rule)
	for _, f := range c.First {
		s += "\n  mismatch: " + f
	}
	if c.Versus != "" {
		s += fmt.Sprintf("\n  against the reference stage %s (error / block amax): %v", c.Versus, c.Dist)
	}
	return s
}

// CheckWindowKEntries holds every entry a window-K writer stored against the
// kvcache encoder under scaling sc applied to the pre-quantisation row the
// kernel was given (kv_roped, or cmp_roped for a compressed row), byte for
// byte (the pad byte excluded: SGLang leaves it unwritten).
func CheckWindowKEntries(src replay.Source, w *WindowK, window int, sc kvcache.Scaling, name string) (*Check, error) {
	c := &Check{Kernel: w.Prefix, Rule: name}
	f := kvcache.MustFormat(kvcache.LayoutV4Model1, 0, 1)
	keys := sortedKeys(w.Entries)
	for _, k := range keys {
		p, l := k[0], int(k[1])
		for _, row := range sortedRows(w.Entries[k]) {
			got := w.Entries[k][row]
			in := "kv_roped"
			if row >= window {
				in = "cmp_roped"
			}
			x, ok, err := src.Stage(p, l, in)
			if err != nil || !ok {
				return nil, fmt.Errorf("prodkernel: step %d layer %d: no %s (%v)", p, l, in, err)
			}
			if len(x.F) != f.Dim || len(got) != kvcache.Model1EntryBytes {
				return nil, fmt.Errorf("prodkernel: step %d layer %d: %s has %d values, entry %d bytes", p, l, in, len(x.F), len(got))
			}
			page := make([]byte, f.PageBytes())
			f.EncodeEntry(page, 0, x.F, sc)
			for i := 0; i < kvcache.Model1DataBytes; i++ {
				c.Codes++
				if page[i] == got[i] {
					c.Equal++
				} else {
					c.mismatch("p%d L%d row %d byte %d: kernel 0x%02x, rule 0x%02x", p, l, row, i, got[i], page[i])
				}
			}
			for t := 0; t < kvcache.Model1Tiles; t++ {
				c.Scales++
				a, b := got[kvcache.Model1DataBytes+t], page[kvcache.Model1DataBytes+t]
				if a == b {
					c.ScalesEqual++
				} else {
					c.mismatch("p%d L%d row %d scale %d: kernel 0x%02x, rule 0x%02x", p, l, row, t, a, b)
				}
			}
		}
	}
	return c, nil
}

func sortedKeys[V any](m map[[2]int64]V) [][2]int64 {
	keys := make([][2]int64, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b [2]int64) int {
		if a[0] != b[0] {
			return int(a[0] - b[0])
		}
		return int(a[1] - b[1])
	})
	return keys
}

func sortedRows(m map[int][]byte) []int {
	rows := make([]int, 0, len(m))
	for r := range m {
		rows = append(rows, r)
	}
	slices.Sort(rows)
	return rows
}

// RopeTable is the GPU's cos/sin table of a layer: [pos][pair] (cos, sin).
type RopeTable struct {
	Pairs int
	CS    []float32 // [pos][pair][2]
}

func (r RopeTable) at(pos int64, i int) (cos, sin float32) {
	o := (int(pos)*r.Pairs + i) * 2
	return r.CS[o], r.CS[o+1]
}

// scaleLog2Ceil is the Triton kernels' scale 2^ceil(log2(a)) of a positive
// fp32 a, from its bits (log2 of a power of two is exact, of anything else
// rounds up to the next exponent).
func scaleLog2Ceil(a float32) float32 {
	return float32(math.Ldexp(1, quant.BlockScaleExp(quant.ScaleLog2Ceil, a, 1, 0)))
}

// CheckInvRopeFP8 holds vLLM's fused_inv_rope_fp8_quant output (E4M3 codes
// [T, G, heads/G·512] and fp32 scales [T, G, heads/G·4] of one layer, tokens =
// steps) against its rule over the reference's attention output o:
//
//	x = o[h] (bf16 widened); dims nope..: x0' = x0·cos + x1·sin, x1' = x1·cos − x0·sin (fp32, inverse RoPE at p)
//	per 128 dims b of each head: s_b = 2^ceil(log2(f32(max(max|x|, 1e-10) · f32(1/448))))
//	code = E4M3(clamp(x / s_b, ±448))
//
// The reference keeps o_inv in bf16 for the bf16 wo_a GEMM; Dist measures the
// kernel's dequantised values against it.
func CheckInvRopeFP8(src replay.Source, r *Run, layer int, rope RopeTable, heads, groups, nope int) (*Check, error) {
	c := &Check{Kernel: "vllm fused_inv_rope_fp8_quant", Rule: "FP8(InvRoPE_fp32(o)) per 128 dims, s = 2^ceil(log2(max(amax,1e-10)/448))", Versus: "o_inv"}
	base := fmt.Sprintf("vllm_oinv.L%d.", layer)
	codes, shape, err := r.Bytes(base + "fp8")
	if err != nil {
		return nil, err
	}
	scales, err := r.Floats(base + "scale")
	if err != nil {
		return nil, err
	}
	steps, err := r.Ints(base + "steps")
	if err != nil {
		return nil, err
	}
	hpg := heads / groups
	D := 0
	if len(shape) == 3 {
		D = shape[2] / hpg
	}
	if len(shape) != 3 || shape[0] != len(steps) || shape[1] != groups || D*hpg != shape[2] || D%128 != 0 {
		return nil, fmt.Errorf("prodkernel: %s: %sfp8 shape %v", r.Path, base, shape)
	}
	nb := D / 128
	if len(scales.F) != len(steps)*groups*hpg*nb {
		return nil, fmt.Errorf("prodkernel: %s: %sscale shape %v", r.Path, base, scales.Shape)
	}
	var errs []float64
	for t, p := range steps {
		o, ok, err := src.Stage(p, layer, "o")
		if err != nil || !ok {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no o (%v)", p, layer, err)
		}
		oinv, ok, err := src.Stage(p, layer, "o_inv")
		if err != nil || !ok {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no o_inv (%v)", p, layer, err)
		}
		if len(o.F) != heads*D || len(oinv.F) != heads*D || nope < 0 || nope > D || (D-nope)/2 > rope.Pairs || int(p) < 0 || (int(p)+1)*rope.Pairs*2 > len(rope.CS) {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: o %v, o_inv %v, rope table of %d values for %d heads × %d", p, layer, o.Shape, oinv.Shape, len(rope.CS), heads, D)
		}
		for h := 0; h < heads; h++ {
			g, hg := h/hpg, h%hpg
			x := slices.Clone(o.F[h*D : (h+1)*D])
			for i := 0; i < (D-nope)/2; i++ {
				cs, sn := rope.at(p, i)
				x0, x1 := x[nope+2*i], x[nope+2*i+1]
				x[nope+2*i] = x0*cs + x1*sn
				x[nope+2*i+1] = x1*cs - x0*sn
			}
			for b := 0; b < nb; b++ {
				blk := x[b*128 : (b+1)*128]
				var amax float32
				for _, v := range blk {
					amax = max(amax, float32(math.Abs(float64(v))))
				}
				s := scaleLog2Ceil(max(amax, 1e-10) * float32(1.0/448))
				got := scales.F[(t*groups+g)*hpg*nb+hg*nb+b]
				c.Scales++
				if got == s {
					c.ScalesEqual++
				} else {
					c.mismatch("p%d L%d head %d block %d: kernel scale %g, rule %g", p, layer, h, b, got, s)
				}
				ref := oinv.F[h*D+b*128 : h*D+(b+1)*128]
				var ramax float64
				for _, v := range ref {
					ramax = max(ramax, math.Abs(float64(v)))
				}
				for i, v := range blk {
					want := quant.EncodeE4M3Sat(v / s)
					gc := codes[(t*groups+g)*hpg*D+hg*D+b*128+i]
					c.Codes++
					if gc == want {
						c.Equal++
					} else {
						c.mismatch("p%d L%d head %d dim %d: kernel code 0x%02x, rule 0x%02x (x = %g, s = %g)", p, layer, h, b*128+i, gc, want, v, s)
					}
					if ramax > 0 {
						errs = append(errs, math.Abs(float64(quant.DecodeE4M3(gc)*got)-float64(ref[i]))/ramax)
					}
				}
			}
		}
	}
	c.Dist = newDist(errs)
	return c, nil
}

// CheckIndexerQ holds vLLM's fused_indexer_q_rope_quant FP8 output (E4M3 codes
// [T, H, 128] and folded fp32 weights [T, H] of one layer) against its rule
// over the reference's stages iq_roped and iw_raw:
//
//	x = iq_roped[h] (its rope dims are the kernel's bf16-rounded RoPE)
//	s = 2^ceil(log2(max(max|x|, 1e-4) / 448)) per head;  code = E4M3(x / s)
//	weight = f32(iw_raw[h]) · s · 128^-0.5 · H^-0.5
//
// The reference replaces this with iq = FQ4(Had(iq_roped), 32) and iw =
// bf16(iw_raw · f32(128^-0.5·H^-0.5)); Dist measures the kernel's dequantised
// q against iq_roped, the last stage both compute.
func CheckIndexerQ(src replay.Source, r *Run, layer, heads, dim int, softmaxScale, headScale float32) (*Check, error) {
	c := &Check{Kernel: "vllm fused_indexer_q_rope_quant (FP8)", Rule: "FP8(iq_roped) per head, s = 2^ceil(log2(max(amax,1e-4)/448)); w = iw_raw·s·softmax·head scales", Versus: "iq_roped"}
	base := fmt.Sprintf("vllm_iq8.L%d.", layer)
	codes, shape, err := r.Bytes(base + "fp8")
	if err != nil {
		return nil, err
	}
	wts, err := r.Floats(base + "weights")
	if err != nil {
		return nil, err
	}
	steps, err := r.Ints(base + "steps")
	if err != nil {
		return nil, err
	}
	if len(shape) != 3 || shape[0] != len(steps) || shape[1] != heads || shape[2] != dim || len(wts.F) != len(steps)*heads {
		return nil, fmt.Errorf("prodkernel: %s: %sfp8 shape %v, weights %v", r.Path, base, shape, wts.Shape)
	}
	var errs []float64
	for t, p := range steps {
		x, ok, err := src.Stage(p, layer, "iq_roped")
		if err != nil || !ok {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no iq_roped (%v)", p, layer, err)
		}
		iw, ok, err := src.Stage(p, layer, "iw_raw")
		if err != nil || !ok {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: no iw_raw (%v)", p, layer, err)
		}
		if len(x.F) != heads*dim || len(iw.F) != heads {
			return nil, fmt.Errorf("prodkernel: step %d layer %d: iq_roped %v, iw_raw %v for %d heads × %d", p, layer, x.Shape, iw.Shape, heads, dim)
		}
		for h := 0; h < heads; h++ {
			v := x.F[h*dim : (h+1)*dim]
			var amax float32
			for _, f := range v {
				amax = max(amax, float32(math.Abs(float64(f))))
			}
			s := scaleLog2Ceil(max(amax, 1e-4) / 448)
			w := iw.F[h] * s
			w *= softmaxScale
			w *= headScale
			c.Scales++
			if got := wts.F[t*heads+h]; got == w {
				c.ScalesEqual++
			} else {
				c.mismatch("p%d L%d head %d: kernel weight %g, rule %g (q scale %g)", p, layer, h, got, w, s)
			}
			for i, f := range v {
				want := quant.EncodeE4M3Sat(f / s)
				gc := codes[(t*heads+h)*dim+i]
				c.Codes++
				if gc == want {
					c.Equal++
				} else {
					c.mismatch("p%d L%d head %d dim %d: kernel code 0x%02x, rule 0x%02x", p, layer, h, i, gc, want)
				}
				if amax > 0 {
					errs = append(errs, math.Abs(float64(quant.DecodeE4M3(gc)*s)-float64(f))/float64(amax))
				}
			}
		}
	}
	c.Dist = newDist(errs)
	return c, nil
}
