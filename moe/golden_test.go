package moe

import (
	"flag"
	"fmt"
	"math"
	"path/filepath"
	"testing"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/mhc"
	"sparsemla/quant"
)

// goldenDir is the committed copy of the official-v4-tiny GPU dumps (every
// FFN stage and every MoE parameter; see its README.md).
var goldenDir = flag.String("golden", "../testdata/official-v4-tiny", "directory of the official-v4-tiny GPU dumps")

// The tiny golden's MoE config (config.json there).
const (
	tinyLayers  = 4
	tinyDim     = 256
	tinyInter   = 256
	tinyExperts = 4
	tinyTopK    = 2
	tinyHash    = 1 // n_hash_layers
)

func openST(t testing.TB, path string) *dump.Safetensors {
	t.Helper()
	st, err := dump.OpenSafetensors(path)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func read(t testing.TB, st *dump.Safetensors, name string) []float32 {
	t.Helper()
	v, _, err := st.Float32(name)
	if err != nil {
		t.Fatalf("%s: %s: %v", st.Path, name, err)
	}
	return v
}

func readInt(t testing.TB, st *dump.Safetensors, name string) []int64 {
	t.Helper()
	v, _, err := st.Int64(name)
	if err != nil {
		t.Fatalf("%s: %s: %v", st.Path, name, err)
	}
	return v
}

func raw(t testing.TB, st *dump.Safetensors, name string) []byte {
	t.Helper()
	r, err := st.Read(name)
	if err != nil {
		t.Fatalf("%s: %s: %v", st.Path, name, err)
	}
	return r.Data
}

// goldenMoE loads layer l's FFN from the golden's weights (score_func
// sqrtsoftplus, route_scale 1.5, swiglu_limit 10; layer 0 hashes).
func goldenMoE(t testing.TB, w *dump.Safetensors, l int) *MoE {
	t.Helper()
	p := fmt.Sprintf("layers.%d.ffn.", l)
	m := &MoE{SwigluLimit: 10, Gate: Gate{Experts: tinyExperts, TopK: tinyTopK, Dim: tinyDim,
		Func: SqrtSoftplus, RouteScale: 1.5, Weight: read(t, w, p+"gate.weight")}}
	if l < tinyHash {
		for _, v := range readInt(t, w, p+"gate.tid2eid") {
			m.Gate.TID2EID = append(m.Gate.TID2EID, int32(v))
		}
	} else {
		m.Gate.Bias = read(t, w, p+"gate.bias")
	}
	for e := 0; e < tinyExperts; e++ {
		fp4 := func(name string, rows, cols int) *FP4Weight {
			n := fmt.Sprintf("%sexperts.%d.%s.", p, e, name)
			fw, err := NewFP4Weight(raw(t, w, n+"weight"), raw(t, w, n+"scale"), rows, cols)
			if err != nil {
				t.Fatal(err)
			}
			return fw
		}
		m.Experts = append(m.Experts, &Expert{W1: fp4("w1", tinyInter, tinyDim), W2: fp4("w2", tinyDim, tinyInter), W3: fp4("w3", tinyInter, tinyDim)})
	}
	fp8 := func(name string, rows, cols int) *attention.FP8Weight {
		n := p + "shared_experts." + name + "."
		return attention.NewFP8Weight(raw(t, w, n+"weight"), raw(t, w, n+"scale"), rows, cols)
	}
	m.Shared = &Shared{W1: fp8("w1", tinyInter, tinyDim), W2: fp8("w2", tinyDim, tinyInter), W3: fp8("w3", tinyInter, tinyDim)}
	return m
}

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

// TestGoldenMoETeacherForced recomputes the FFN of every decode step and
// layer of the official-v4-tiny GPU dumps from the dumped ffn_in and the
// dumped token:
//
//   - moe_indices: equal, in order, on the hash layer (tid2eid) and the
//     top-k layers (no score tie occurs in this golden);
//   - moe_weights: within 2 fp32 ulps (the gate GEMV is cuBLAS-ordered on
//     the GPU and CUDA's expf/log1pf are not correctly rounded);
//   - ffn_out from the dumped route (the routed FP4 experts, the FP8 shared
//     expert, the fp32 sum): bit-exact on every value, and bit-exact as well
//     from the reference's own route; the fast routed experts (MoE.Fast)
//     give the reference's bits.
//
// (ffn_in = ffn_norm(ffn_norm_in) is checked in package mhc.)
func TestGoldenMoETeacherForced(t *testing.T) {
	w := openST(t, filepath.Join(*goldenDir, "weights.safetensors"))
	moes := make([]*MoE, tinyLayers)
	for l := range moes {
		moes[l] = goldenMoE(t, w, l)
	}
	var nW, exactW, nOut, diffOut, diffOwn int
	var worstW int64
	for P := 2; P <= 7; P++ {
		st := openST(t, filepath.Join(*goldenDir, fmt.Sprintf("step_%d.safetensors", P)))
		tok := readInt(t, st, "tok")[0]
		for l := 0; l < tinyLayers; l++ {
			L := fmt.Sprintf("L%d.", l)
			x := read(t, st, L+"ffn_in")

			r, err := moes[l].Gate.Route(x, tok)
			if err != nil {
				t.Fatal(err)
			}
			if r.Tie {
				t.Errorf("step %d L%d: unexpected score tie at the k-th place", P, l)
			}
			gpuIdx := readInt(t, st, L+"moe_indices")
			gpuW := read(t, st, L+"moe_weights")
			for k := range gpuIdx {
				if int64(r.Indices[k]) != gpuIdx[k] {
					t.Errorf("step %d L%d: moe_indices %v, GPU %v (select scores %v)", P, l, r.Indices, gpuIdx, r.Select)
					break
				}
			}
			for k := range gpuW {
				d := ulp32(r.Weights[k], gpuW[k])
				nW++
				if d == 0 {
					exactW++
				}
				worstW = max(worstW, d)
			}

			idx := make([]int32, len(gpuIdx))
			for k, v := range gpuIdx {
				idx[k] = int32(v)
			}
			want := read(t, st, L+"ffn_out")
			out, err := moes[l].Combine(x, idx, gpuW)
			if err != nil {
				t.Fatal(err)
			}
			own, err := moes[l].Combine(x, r.Indices, r.Weights)
			if err != nil {
				t.Fatal(err)
			}
			moes[l].Fast = true
			fast, err := moes[l].Combine(x, idx, gpuW)
			moes[l].Fast = false
			if err != nil {
				t.Fatal(err)
			}
			for i := range out {
				if math.Float32bits(fast[i]) != math.Float32bits(out[i]) {
					t.Fatalf("step %d L%d: fast ffn_out[%d] = %v, reference %v", P, l, i, fast[i], out[i])
				}
			}
			for i := range want {
				nOut++
				if out[i] != want[i] {
					diffOut++
					if diffOut <= 3 {
						t.Errorf("step %d L%d ffn_out[%d] = %v, GPU %v (%d bf16 ulp)", P, l, i, out[i], want[i], quant.BF16ULPDistance(out[i], want[i]))
					}
				}
				if own[i] != want[i] {
					diffOwn++
				}
			}
		}
	}
	t.Logf("moe_weights: %d of %d bit-exact, worst %d fp32 ulp; ffn_out: %d of %d differ (own route: %d)",
		exactW, nW, worstW, diffOut, nOut, diffOwn)
	if worstW > 2 {
		t.Errorf("moe_weights: worst %d fp32 ulp, measured bound 2", worstW)
	}
	if diffOut != 0 || diffOwn != 0 {
		t.Errorf("ffn_out: %d values differ from the dumped route, %d from the reference's own", diffOut, diffOwn)
	}
}

// TestGoldenLongFFNChained covers the FFN side on the gpu-v4-tiny-long
// golden, which dumps no FFN stage: L(l+1).h_in is layer l's output h_out,
// so for l = 0, 1, 2 the chain
//
//	h_mid = hc_post(y, h_in, hc_attn_post, hc_attn_comb)     (dumped inputs)
//	x     = ffn_norm(hc_pre_ffn(h_mid))                      (own mixes, Sinkhorn)
//	h_out = hc_post(MoE(x, tok), h_mid, own post, own comb)
//
// is compared with the dumped L(l+1).h_in. The reference's own fp32 mixes
// and Sinkhorn feed bf16 roundings, so a few values may differ by one bf16
// ulp (as in package mhc's chained test); none may differ by more.
func TestGoldenLongFFNChained(t *testing.T) {
	dir := filepath.Join(filepath.Dir(*goldenDir), "gpu-v4-tiny-long")
	w := openST(t, filepath.Join(dir, "weights.safetensors"))
	var n, diff int
	for _, P := range []int{126, 127, 128, 255, 256} {
		st := openST(t, filepath.Join(dir, fmt.Sprintf("step_%d.safetensors", P)))
		tok := readInt(t, st, "tok")[0]
		for l := 0; l+1 < tinyLayers; l++ {
			L := fmt.Sprintf("L%d.", l)
			site := func(side string) *mhc.Site {
				p := fmt.Sprintf("layers.%d.hc_%s_", l, side)
				return &mhc.Site{Mult: 4, Dim: tinyDim, Fn: read(t, w, p+"fn"), Base: read(t, w, p+"base"), Scale: read(t, w, p+"scale")}
			}
			hIn := read(t, st, L+"h_in")
			hMid := make([]float32, len(hIn))
			mhc.Post(hMid, read(t, st, L+"y"), hIn, read(t, st, L+"hc_attn_post"), read(t, st, L+"hc_attn_comb"))
			pre := site("ffn").HCPre(hMid, attention.NormEps, 1e-6, 20)
			x := make([]float32, tinyDim)
			attention.RMSNorm(x, pre.X, read(t, w, fmt.Sprintf("layers.%d.ffn_norm.weight", l)), attention.NormEps)
			res, err := goldenMoE(t, w, l).Forward(x, tok)
			if err != nil {
				t.Fatal(err)
			}
			hOut := make([]float32, len(hIn))
			mhc.Post(hOut, res.Out, hMid, pre.Post, pre.Comb)
			want := read(t, st, fmt.Sprintf("L%d.h_in", l+1))
			for i := range want {
				n++
				if hOut[i] != want[i] {
					diff++
					if d := quant.BF16ULPDistance(hOut[i], want[i]); d > 1 || d < -1 {
						t.Errorf("step %d L%d h_out[%d] = %v, GPU L%d.h_in %v (%d bf16 ulp)", P, l, i, hOut[i], l+1, want[i], d)
					}
				}
			}
		}
	}
	t.Logf("h_out chained through the FFN: %d of %d values differ by one bf16 ulp", diff, n)
	if diff > n/1000 {
		t.Errorf("more than 0.1%% of the chained h_out values differ")
	}
}
