package mhc

import (
	"flag"
	"fmt"
	"math"
	"path/filepath"
	"testing"

	"sparsemla/attention"
	"sparsemla/dump"
)

// goldenDir is the committed copy of the official-v4-tiny GPU dumps (every
// block stage; see its README.md), longDir the past-the-window-wrap golden
// (attention side of the block only: h_in, hc_attn_*, attn_norm_in).
var (
	goldenDir = flag.String("golden", "../testdata/official-v4-tiny", "directory of the official-v4-tiny GPU dumps")
	longDir   = flag.String("golden-long", "../testdata/gpu-v4-tiny-long", "directory of the gpu-v4-tiny-long GPU dumps")
)

const (
	tinyLayers = 4
	tinyHC     = 4
	tinyDim    = 256
	tinyEps    = 1e-6 // norm_eps = hc_eps
	tinyIters  = 20
)

func openST(t *testing.T, path string) *dump.Safetensors {
	t.Helper()
	st, err := dump.OpenSafetensors(path)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func read(t *testing.T, st *dump.Safetensors, name string) []float32 {
	t.Helper()
	v, _, err := st.Float32(name)
	if err != nil {
		t.Fatalf("%s: %s: %v", st.Path, name, err)
	}
	return v
}

// site loads layer l's hc_<side>_* parameters from the golden's weights.
func site(t *testing.T, w *dump.Safetensors, l int, side string) *Site {
	p := fmt.Sprintf("layers.%d.hc_%s_", l, side)
	s := &Site{Mult: tinyHC, Dim: tinyDim, Fn: read(t, w, p+"fn"), Base: read(t, w, p+"base"), Scale: read(t, w, p+"scale")}
	s.Check()
	return s
}

// ulp32 is the distance of two fp32 values in units in the last place along
// the ordered fp32 line (0 for equal values, ±0 equal).
func ulp32(a, b float32) int64 {
	ord := func(f float32) int64 {
		u := int64(math.Float32bits(f))
		if u&0x80000000 != 0 {
			return -(u & 0x7fffffff)
		}
		return u
	}
	d := ord(a) - ord(b)
	if d < 0 {
		d = -d
	}
	return d
}

// agreement tallies one stage over the golden: elements, bit-exact elements,
// worst fp32 ulp distance.
type agreement struct {
	n, exact int
	worst    int64
}

func (a *agreement) add(got, want []float32) {
	for i := range want {
		d := ulp32(got[i], want[i])
		a.n++
		if d == 0 {
			a.exact++
		}
		a.worst = max(a.worst, d)
	}
}

// TestGoldenBlockTeacherForced recomputes every mHC stage of every decode
// step and layer of the official-v4-tiny GPU dumps from the DUMPED inputs of
// that stage, both sites (attention: h_in → hc_attn_* → attn_norm_in → x; y →
// h_mid; FFN: h_mid → hc_ffn_* → ffn_norm_in → ffn_in; ffn_out → h_out):
//
//   - the collapse (attn_norm_in, ffn_norm_in), the norms (x = attn_norm,
//     ffn_in = ffn_norm; attention.RMSNorm) and hc_post (h_mid, h_out) are
//     bit-exact;
//   - pre/post/comb (hc_split_sinkhorn of the dumped mixes) within the
//     measured fp32 ulps: exp is CUDA's expf on the GPU (not correctly
//     rounded), and the 20 Sinkhorn iterations carry its last-bit differences;
//   - mixes (an fp32 GEMM, cuBLAS order on the GPU) within 8 fp32 rounding
//     units of the sum of the magnitudes of its terms (measured: 5.7).
func TestGoldenBlockTeacherForced(t *testing.T) {
	w := openST(t, filepath.Join(*goldenDir, "weights.safetensors"))
	// Measured worst fp32 ulps on this golden (see the package doc).
	limits := map[string]int64{"pre": 2, "post": 2, "comb": 8, "collapse": 0, "norm": 0, "hc_post": 0}
	agree := map[string]*agreement{}
	for k := range limits {
		agree[k] = &agreement{}
	}
	var worstMix float64
	for P := 2; P <= 7; P++ {
		st := openST(t, filepath.Join(*goldenDir, fmt.Sprintf("step_%d.safetensors", P)))
		for l := 0; l < tinyLayers; l++ {
			L := fmt.Sprintf("L%d.", l)
			for _, sd := range []struct{ side, in, normIn, normOut, out, sub string }{
				{"attn", "h_in", "attn_norm_in", "x", "h_mid", "y"},
				{"ffn", "h_mid", "ffn_norm_in", "ffn_in", "h_out", "ffn_out"},
			} {
				s := site(t, w, l, sd.side)
				h := read(t, st, L+sd.in)
				hc := L + "hc_" + sd.side + "_"

				normed := make([]float32, tinyDim)
				attention.RMSNorm(normed, read(t, st, L+sd.normIn), read(t, w, fmt.Sprintf("layers.%d.%s_norm.weight", l, sd.side)), attention.NormEps)
				agree["norm"].add(normed, read(t, st, L+sd.normOut))

				mixes := make([]float32, NMixes(tinyHC))
				Mixes(mixes, h, s.Fn, tinyEps)
				worstMix = max(worstMix, mixesError(mixes, read(t, st, hc+"mixes"), h, s.Fn))

				pre, post, comb := make([]float32, tinyHC), make([]float32, tinyHC), make([]float32, tinyHC*tinyHC)
				SplitSinkhorn(pre, post, comb, read(t, st, hc+"mixes"), s.Scale, s.Base, tinyHC, tinyIters, tinyEps)
				agree["pre"].add(pre, read(t, st, hc+"pre"))
				agree["post"].add(post, read(t, st, hc+"post"))
				agree["comb"].add(comb, read(t, st, hc+"comb"))

				x := make([]float32, tinyDim)
				Collapse(x, h, read(t, st, hc+"pre"))
				agree["collapse"].add(x, read(t, st, L+sd.normIn))

				out := make([]float32, tinyHC*tinyDim)
				Post(out, read(t, st, L+sd.sub), h, read(t, st, hc+"post"), read(t, st, hc+"comb"))
				agree["hc_post"].add(out, read(t, st, L+sd.out))
			}
		}
	}
	for _, k := range []string{"pre", "post", "comb", "collapse", "norm", "hc_post"} {
		a := agree[k]
		t.Logf("%-8s %5d values, %5d bit-exact, worst %d fp32 ulp", k, a.n, a.exact, a.worst)
		if a.worst > limits[k] {
			t.Errorf("%s: worst %d fp32 ulp, measured bound %d", k, a.worst, limits[k])
		}
	}
	t.Logf("mixes: worst |ref-gpu| = %.2f u · ρ·Σ|terms|", worstMix)
	if worstMix > 8 {
		t.Errorf("mixes: worst error %.2f u of the GEMM bound, want <= 8", worstMix)
	}
}

// mixesError returns the worst |got-want| of the mixes in units of
// 2^-24 · ρ · Σ_c |fn[r][c]·h_c|, the scale of a summation-order difference.
func mixesError(got, want, h, fn []float32) float64 {
	n := len(h)
	var ss float64
	for _, v := range h {
		ss += float64(v) * float64(v)
	}
	rho := 1 / math.Sqrt(ss/float64(n)+tinyEps)
	var worst float64
	for r := range got {
		var mag float64
		for c, v := range h {
			mag += math.Abs(float64(fn[r*n+c]) * float64(v))
		}
		worst = max(worst, math.Abs(float64(got[r])-float64(want[r]))/(mag*rho*0x1p-24))
	}
	return worst
}

// TestGoldenBlockChained runs hc_pre and hc_post from the dumped streams only
// (mixes, pre, post, comb all the reference's own) and checks the bf16
// outputs: a last-bit difference of pre, post or comb crosses a bf16
// rounding boundary rarely, so a handful of values may differ by one bf16
// ulp (measured on this golden: attn_norm_in/ffn_norm_in 1 of 12288,
// h_mid/h_out 5 of 49152).
func TestGoldenBlockChained(t *testing.T) {
	w := openST(t, filepath.Join(*goldenDir, "weights.safetensors"))
	var nX, diffX, nH, diffH int
	for P := 2; P <= 7; P++ {
		st := openST(t, filepath.Join(*goldenDir, fmt.Sprintf("step_%d.safetensors", P)))
		for l := 0; l < tinyLayers; l++ {
			L := fmt.Sprintf("L%d.", l)
			for _, sd := range []struct{ side, in, normIn, out, sub string }{
				{"attn", "h_in", "attn_norm_in", "h_mid", "y"},
				{"ffn", "h_mid", "ffn_norm_in", "h_out", "ffn_out"},
			} {
				s := site(t, w, l, sd.side)
				h := read(t, st, L+sd.in)
				p := s.HCPre(h, tinyEps, tinyEps, tinyIters)
				want := read(t, st, L+sd.normIn)
				for i, v := range p.X {
					nX++
					if d := ulp32(v, want[i]); d != 0 {
						diffX++
						if d > 1<<16 {
							t.Errorf("step %d L%d %s[%d]: %v, GPU %v: more than one bf16 ulp", P, l, sd.normIn, i, v, want[i])
						}
					}
				}
				out := make([]float32, tinyHC*tinyDim)
				Post(out, read(t, st, L+sd.sub), h, p.Post, p.Comb)
				want = read(t, st, L+sd.out)
				for i, v := range out {
					nH++
					if d := ulp32(v, want[i]); d != 0 {
						diffH++
						if d > 1<<16 {
							t.Errorf("step %d L%d %s[%d]: %v, GPU %v: more than one bf16 ulp", P, l, sd.out, i, v, want[i])
						}
					}
				}
			}
		}
	}
	t.Logf("collapse from own mixes: %d of %d differ by one bf16 ulp; hc_post from own post/comb: %d of %d", diffX, nX, diffH, nH)
	if diffX > nX/1000 || diffH > nH/1000 {
		t.Errorf("more than 0.1%% of the chained bf16 values differ")
	}
}

// TestGoldenLongAttnSite checks the attention site of the block on the
// gpu-v4-tiny-long golden (steps 126 … 256; it dumps h_in, hc_attn_* and
// attn_norm_in and x but no FFN stages): pre/post/comb, the collapse and
// attn_norm from the dumped inputs within the same bounds as above.
func TestGoldenLongAttnSite(t *testing.T) {
	w := openST(t, filepath.Join(*longDir, "weights.safetensors"))
	limits := map[string]int64{"pre": 2, "post": 2, "comb": 8, "collapse": 0, "norm": 0}
	agree := map[string]*agreement{"pre": {}, "post": {}, "comb": {}, "collapse": {}, "norm": {}}
	var worstMix float64
	steps := 0
	for _, P := range []int{126, 127, 128, 255, 256} {
		st := openST(t, filepath.Join(*longDir, fmt.Sprintf("step_%d.safetensors", P)))
		steps++
		for l := 0; l < tinyLayers; l++ {
			L := fmt.Sprintf("L%d.", l)
			s := site(t, w, l, "attn")
			h := read(t, st, L+"h_in")
			mixes := make([]float32, NMixes(tinyHC))
			Mixes(mixes, h, s.Fn, tinyEps)
			worstMix = max(worstMix, mixesError(mixes, read(t, st, L+"hc_attn_mixes"), h, s.Fn))
			pre, post, comb := make([]float32, tinyHC), make([]float32, tinyHC), make([]float32, tinyHC*tinyHC)
			SplitSinkhorn(pre, post, comb, read(t, st, L+"hc_attn_mixes"), s.Scale, s.Base, tinyHC, tinyIters, tinyEps)
			agree["pre"].add(pre, read(t, st, L+"hc_attn_pre"))
			agree["post"].add(post, read(t, st, L+"hc_attn_post"))
			agree["comb"].add(comb, read(t, st, L+"hc_attn_comb"))
			x := make([]float32, tinyDim)
			Collapse(x, h, read(t, st, L+"hc_attn_pre"))
			agree["collapse"].add(x, read(t, st, L+"attn_norm_in"))
			normed := make([]float32, tinyDim)
			attention.RMSNorm(normed, read(t, st, L+"attn_norm_in"), read(t, w, fmt.Sprintf("layers.%d.attn_norm.weight", l)), attention.NormEps)
			agree["norm"].add(normed, read(t, st, L+"x"))
		}
	}
	for _, k := range []string{"pre", "post", "comb", "collapse", "norm"} {
		a := agree[k]
		t.Logf("%-8s %5d values, %5d bit-exact, worst %d fp32 ulp", k, a.n, a.exact, a.worst)
		if a.worst > limits[k] {
			t.Errorf("%s: worst %d fp32 ulp, bound %d", k, a.worst, limits[k])
		}
	}
	t.Logf("mixes: worst %.2f u · ρ·Σ|terms| over %d steps", worstMix, steps)
	if worstMix > 8 {
		t.Errorf("mixes: worst error %.2f u, want <= 8", worstMix)
	}
}
