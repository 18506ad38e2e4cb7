package kvcache

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"testing"
)

// goldenF32 reads testdata/kvcache/compressor_state.{json,f32}: fp32 tensors
// from the official model's GPU dump (see the README there).
func goldenF32(t *testing.T) func(name string) ([]float32, []int) {
	t.Helper()
	idxRaw, err := os.ReadFile("../testdata/kvcache/compressor_state.json")
	if err != nil {
		t.Fatal(err)
	}
	blob, err := os.ReadFile("../testdata/kvcache/compressor_state.f32")
	if err != nil {
		t.Fatal(err)
	}
	var idx map[string]struct {
		Offset int
		Shape  []int
	}
	if err := json.Unmarshal(idxRaw, &idx); err != nil {
		t.Fatal(err)
	}
	return func(name string) ([]float32, []int) {
		e, ok := idx[name]
		if !ok {
			t.Fatalf("golden tensor %s missing", name)
		}
		n := 1
		for _, d := range e.Shape {
			n *= d
		}
		v := make([]float32, n)
		for i := range v {
			v[i] = math.Float32frombits(binary.LittleEndian.Uint32(blob[e.Offset+4*i:]))
		}
		return v, e.Shape
	}
}

// Per-token state rows rebuilt into the reference's kv_state / score_state
// reproduce the GPU's state tensors bit for bit: token t's row is (cmp_a,
// cmp_b + ape[t mod r]) of its decode step (tokens 0, 1 come from the prefill
// hand-off, spec §2.4), and StatePool.Reference places them as the official
// Compressor does (ratio 4 with the overlap shift, ratio 128, and the
// indexer's ratio-4 compressor).
func TestStatePoolMatchesGPUState(t *testing.T) {
	get := goldenF32(t)
	for _, c := range []struct {
		name, layer, prefix, ape string
		ratio, d                 int
	}{
		{"main r=4", "L1", "cmp", "L1.ape", 4, 512},
		{"indexer r=4", "L1", "icmp", "L1.iape", 4, 128},
		{"main r=128", "L2", "cmp", "L2.ape", 128, 512},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := NewStatePool(c.ratio, c.d, 4, 16)
			w := s.Width()
			ape, _ := get(c.ape)
			pkv, _ := get(fmt.Sprintf("prefill.%s.%s_kv_state", c.layer, c.prefix))
			psc, _ := get(fmt.Sprintf("prefill.%s.%s_score_state", c.layer, c.prefix))
			for tok := 0; tok < 2; tok++ { // prefill of S = 2: state row off + tok, off = 4 for r = 4
				row := tok
				if c.ratio == 4 {
					row = 4 + tok
				}
				if err := s.Store(tok, pkv[row*w:(row+1)*w], psc[row*w:(row+1)*w]); err != nil {
					t.Fatal(err)
				}
			}
			for p := 2; p <= 7; p++ {
				a, _ := get(fmt.Sprintf("step%d.%s.%s_a", p, c.layer, c.prefix))
				b, _ := get(fmt.Sprintf("step%d.%s.%s_b", p, c.layer, c.prefix))
				score := make([]float32, w)
				for i := range score {
					score[i] = b[i] + ape[(p%c.ratio)*w+i] // ape is added in fp32 when the token is stored
				}
				if err := s.Store(p, a, score); err != nil {
					t.Fatal(err)
				}
				if p%2 == 0 {
					continue // goldens kept for steps 3, 5, 7
				}
				kv, sc, err := s.Reference(p)
				if err != nil {
					t.Fatal(err)
				}
				wantKV, shape := get(fmt.Sprintf("step%d.%s.%s_kv_state", p, c.layer, c.prefix))
				wantSc, _ := get(fmt.Sprintf("step%d.%s.%s_score_state", p, c.layer, c.prefix))
				// r = 128 dumps hold only the live rows 0 .. p mod 128.
				for i := 0; i < shape[0]*shape[1]; i++ {
					if !sameBits(kv[i], wantKV[i]) || !sameBits(sc[i], wantSc[i]) {
						t.Fatalf("step %d row %d col %d: kv %g score %g, GPU %g %g", p, i/w, i%w, kv[i], sc[i], wantKV[i], wantSc[i])
					}
				}
			}
		})
	}
}
