package head

import (
	"flag"
	"fmt"
	"math"
	"path/filepath"
	"testing"

	"sparsemla/dump"
	"sparsemla/mhc"
)

// goldenDir is the committed copy of the official-v4-tiny GPU dumps (see its
// README.md): tok, L0.h_in, L3.h_out and logits of every decode step, and
// embed, hc_head_*, norm and head weights.
var goldenDir = flag.String("golden", "../testdata/official-v4-tiny", "directory of the official-v4-tiny GPU dumps")

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

func goldenHead(t *testing.T, w *dump.Safetensors) *Head {
	hd := &Head{Mult: 4, Dim: 256, Vocab: 512, HCFn: read(t, w, "hc_head_fn"), HCBase: read(t, w, "hc_head_base"),
		HCScale: read(t, w, "hc_head_scale")[0], Norm: read(t, w, "norm.weight"), Weight: read(t, w, "head.weight"),
		NormEps: 1e-6, HCEps: 1e-6}
	hd.Check()
	return hd
}

// TestGoldenEmbedAndHead checks both ends of every decode step of the
// official-v4-tiny GPU dumps:
//
//   - L0.h_in = the embedding row of tok copied into the 4 streams: bit-exact;
//   - logits from the dumped last-layer output L3.h_out (hc_head, norm, fp32
//     head GEMV; no intermediate is dumped): within 4 u · Σ_i |head[v][i]·x_i| (u = 2^-24)
//     of the GPU's (an fp32 GEMV in another summation order; measured below),
//     and the greedy token equal to the argmax of the GPU's logits.
func TestGoldenEmbedAndHead(t *testing.T) {
	w := openST(t, filepath.Join(*goldenDir, "weights.safetensors"))
	hd := goldenHead(t, w)
	table := read(t, w, "embed.weight")
	var worst, worstAbs float64
	for P := 2; P <= 7; P++ {
		st := openST(t, filepath.Join(*goldenDir, fmt.Sprintf("step_%d.safetensors", P)))
		toks, _, err := st.Int64("tok")
		if err != nil {
			t.Fatal(err)
		}
		e := make([]float32, hd.Dim)
		if err := Embed(e, table, toks[0]); err != nil {
			t.Fatal(err)
		}
		h := make([]float32, hd.Mult*hd.Dim)
		mhc.Expand(h, e, hd.Mult)
		for i, v := range read(t, st, "L0.h_in") {
			if h[i] != v {
				t.Fatalf("step %d: h_in[%d] = %v, GPU %v", P, i, h[i], v)
			}
		}

		o := hd.Forward(read(t, st, "L3.h_out"))
		gpu := read(t, st, "logits")
		for v := range gpu {
			var mag float64
			for i, x := range o.Normed {
				mag += math.Abs(float64(hd.Weight[v*hd.Dim+i]) * float64(x))
			}
			d := math.Abs(float64(o.Logits[v]) - float64(gpu[v]))
			worst = max(worst, d/mag)
			worstAbs = max(worstAbs, d)
		}
		if g := Greedy(gpu); o.Token != g {
			t.Errorf("step %d: greedy token %d, GPU logits' argmax %d", P, o.Token, g)
		}
	}
	t.Logf("logits: worst |ref-gpu| = %.3g · Σ|terms| (= %.2f u), worst abs %.3g", worst, worst/0x1p-24, worstAbs)
	if worst > 4*0x1p-24 {
		t.Errorf("logits: worst error %.2f u of Σ|terms|, want <= 4", worst/0x1p-24)
	}
}
