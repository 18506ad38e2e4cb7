package attention

import (
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"

	"sparsemla/dump"
	"sparsemla/quant"
)

// goldenDir is the trimmed copy of the official-v4-tiny GPU dumps (see its
// README). -golden points the test at another copy with the same layout.
var goldenDir = flag.String("golden", "../testdata/official-v4-tiny", "directory of the official-v4-tiny GPU dumps")

// goldenConfig is the part of the golden's config.json (ModelArgs) the
// compressor needs.
type goldenConfig struct {
	Dim            int     `json:"dim"`
	CompressRatios []int   `json:"compress_ratios"`
	HeadDim        int     `json:"head_dim"`
	IndexHeadDim   int     `json:"index_head_dim"`
	NormEps        float32 `json:"norm_eps"`
	MaxSeqLen      int     `json:"max_seq_len"`
}

// golden is an opened copy of the dumps; tests skip when it is absent.
type golden struct {
	dir string
	cfg goldenConfig
}

func openGolden(t *testing.T) *golden {
	t.Helper()
	if _, err := os.Stat(filepath.Join(*goldenDir, "config.json")); err != nil {
		t.Skipf("golden dumps not found in %s (%v): the GPU referee test needs testdata/official-v4-tiny", *goldenDir, err)
	}
	g := &golden{dir: *goldenDir}
	b, err := os.ReadFile(filepath.Join(g.dir, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &g.cfg); err != nil {
		t.Fatalf("config.json: %v", err)
	}
	return g
}

// file opens one safetensors file of the golden (closed at the end of the test).
func (g *golden) file(t *testing.T, name string) *dump.Safetensors {
	t.Helper()
	s, err := dump.OpenSafetensors(filepath.Join(g.dir, name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func mustF32(t *testing.T, s *dump.Safetensors, name string) []float32 {
	t.Helper()
	v, _, err := s.Float32(name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// compressorFromGolden builds layer l's main (prefix "attn.compressor") or
// indexer ("attn.indexer.compressor") compressor from the golden weights.
func compressorFromGolden(t *testing.T, g *golden, w *dump.Safetensors, l int, indexer bool) *Compressor {
	t.Helper()
	c := &Compressor{Ratio: g.cfg.CompressRatios[l], HeadDim: g.cfg.HeadDim, Dim: g.cfg.Dim, Eps: g.cfg.NormEps}
	prefix := fmt.Sprintf("layers.%d.attn.compressor.", l)
	if indexer {
		c.HeadDim, c.Rotate = g.cfg.IndexHeadDim, true
		prefix = fmt.Sprintf("layers.%d.attn.indexer.compressor.", l)
	}
	c.Wkv = mustF32(t, w, prefix+"wkv.weight")
	c.Wgate = mustF32(t, w, prefix+"wgate.weight")
	c.Ape = mustF32(t, w, prefix+"ape")
	c.Norm = mustF32(t, w, prefix+"norm.weight")
	c.check()
	return c
}

// gpuRope is the compressed layers' RoPE table as the GPU built it.
func gpuRope(t *testing.T, g *golden) *RopeTable {
	t.Helper()
	cis, shape, err := g.file(t, "rope_tables.safetensors").Float32("freqs_cis_cmp")
	if err != nil {
		t.Fatal(err)
	}
	return RopeTableFromCis(cis, shape[0], "gpu freqs_cis_cmp")
}

// stageStat accumulates the agreement of one recomputed stage with the dump.
type stageStat struct {
	name    string
	n, same int     // values compared, values bit-identical
	maxULP  int32   // bf16 stages: largest distance in bf16 ulps
	maxRel  float64 // fp32 stages: largest |diff| / Σ|terms| (see compareDot)
}

func (s *stageStat) String() string {
	frac := 1.0
	if s.n > 0 {
		frac = float64(s.same) / float64(s.n)
	}
	return fmt.Sprintf("%-18s n=%6d exact=%.4f maxULP=%d maxRel=%.3g", s.name, s.n, frac, s.maxULP, s.maxRel)
}

// bf16 compares bf16 values and records ulp distances.
func (s *stageStat) bf16(t *testing.T, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: length %d, dump has %d", s.name, len(got), len(want))
	}
	for i := range got {
		s.n++
		if math.Float32bits(got[i]) == math.Float32bits(want[i]) {
			s.same++
		}
		s.maxULP = max(s.maxULP, quant.BF16ULPDistance(got[i], want[i]))
	}
}

// exactF32 compares fp32 values bit for bit (−∞ included).
func (s *stageStat) exactF32(t *testing.T, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: length %d, dump has %d", s.name, len(got), len(want))
	}
	for i := range got {
		s.n++
		if math.Float32bits(got[i]) == math.Float32bits(want[i]) {
			s.same++
		} else {
			s.maxRel = math.Inf(1)
		}
	}
}

// dotF32 compares fp32 GEMM outputs y = W·x with the dump, relative to the sum of
// the absolute terms Σ_k |W[n,k]·x[k]| (the scale of any summation-order error).
func (s *stageStat) dotF32(t *testing.T, got, want, W, x []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: length %d, dump has %d", s.name, len(got), len(want))
	}
	for n := range got {
		s.n++
		if got[n] == want[n] {
			s.same++
			continue
		}
		var mag float64
		for k, xk := range x {
			mag += math.Abs(float64(W[n*len(x)+k]) * float64(xk))
		}
		s.maxRel = max(s.maxRel, math.Abs(float64(got[n])-float64(want[n]))/mag)
	}
}

// fullState turns a dumped state (all rows, or for r = 128 only the live rows
// 0..k-1) into a full CompressorState; missing rows keep their fresh values.
func fullState(c *Compressor, kv, score []float32) *CompressorState {
	st := c.NewState()
	if len(kv) > len(st.KV) || len(score) != len(kv) || len(kv)%c.Width() != 0 {
		panic("compressor_golden_test: dumped state shape")
	}
	copy(st.KV, kv)
	copy(st.Score, score)
	return st
}

// TestCompressorGolden is the GPU referee of the compressor: every compressor
// stage of every decode step of the official-v4-tiny dumps, main and indexer
// compressors of every r > 0 layer, recomputed from the dump's own inputs
// (teacher forced) and compared with the dump.
//
// Tolerances (measured on this golden, see the log of `go test -v -run
// CompressorGolden ./attention/`):
//   - cmp_a/cmp_b: fp32 GEMMs; the GPU sums in another order, so the error is
//     bounded relative to Σ|w·x|: at most dim·2^-24 (the worst-case bound of
//     any fp32 summation order).
//   - state after the step from the state before + dumped (a, b): bit-exact.
//   - pooled (fp32 softmax pooling, then bf16): ≤ 1 bf16 ulp.
//   - normed (RMSNorm): ≤ 1 bf16 ulp.
//   - roped with the GPU's table, Hadamard, FQ8/FQ4 rows, cache rows: bit-exact.
func TestCompressorGolden(t *testing.T) {
	g := openGolden(t)
	w := g.file(t, "weights.safetensors")
	rope := gpuRope(t, g)
	pre := g.file(t, "prefill_state.safetensors")

	stats := map[string]*stageStat{}
	stat := func(name string) *stageStat {
		if stats[name] == nil {
			stats[name] = &stageStat{name: name}
		}
		return stats[name]
	}
	var order []string
	for _, p := range []string{"cmp_", "icmp_"} {
		for _, s := range []string{"a", "b", "kv_state", "score_state", "pooled", "normed", "roped", "had", "row", "cache_row"} {
			order = append(order, p+s)
		}
	}

	steps := 0
	for l, r := range g.cfg.CompressRatios {
		if r == 0 {
			continue
		}
		kinds := []bool{false}
		if r == 4 {
			kinds = append(kinds, true)
		}
		for _, isIdx := range kinds {
			c := compressorFromGolden(t, g, w, l, isIdx)
			p := "cmp_"
			if isIdx {
				p = "icmp_"
			}
			L := fmt.Sprintf("L%d.", l)
			prev := fullState(c, mustF32(t, pre, L+p+"kv_state"), mustF32(t, pre, L+p+"score_state"))
			for P := int64(2); ; P++ {
				name := fmt.Sprintf("step_%d.safetensors", P)
				if _, err := os.Stat(filepath.Join(g.dir, name)); err != nil {
					break
				}
				steps++
				f := g.file(t, name)
				x := mustF32(t, f, L+"x")
				a, b := mustF32(t, f, L+p+"a"), mustF32(t, f, L+p+"b")

				ga, gb := make([]float32, c.Width()), make([]float32, c.Width())
				c.Project(ga, gb, x)
				stat(p+"a").dotF32(t, ga, a, c.Wkv, x)
				stat(p+"b").dotF32(t, gb, b, c.Wgate, x)

				// Emission stages: pooled from the state before + (a, b), each
				// later stage from the dumped value of the one before.
				if c.Emits(P) {
					j := P / int64(c.Ratio)
					d := c.HeadDim
					got := make([]float32, d)
					c.PoolAt(got, prev, a, b, P)
					stat(p+"pooled").bf16(t, got, mustF32(t, f, L+p+"pooled"))
					c.Normed(got, mustF32(t, f, L+p+"pooled"))
					stat(p+"normed").bf16(t, got, mustF32(t, f, L+p+"normed"))
					c.Roped(got, mustF32(t, f, L+p+"normed"), j, rope)
					stat(p+"roped").bf16(t, got, mustF32(t, f, L+p+"roped"))
					in := mustF32(t, f, L+p+"roped")
					if isIdx {
						c.Had(got, in)
						stat(p+"had").bf16(t, got, mustF32(t, f, L+p+"had"))
						in = mustF32(t, f, L+p+"had")
					}
					c.Quantize(got, in)
					row := mustF32(t, f, L+p+"row")
					stat(p+"row").bf16(t, got, row)
					var cache []float32
					if isIdx {
						cache = mustF32(t, f, L+"icache")[j*int64(d) : (j+1)*int64(d)]
					} else {
						cache = mustF32(t, f, L+"kv_cache")[(128+j)*int64(d) : (129+j)*int64(d)]
					}
					stat(p+"cache_row").bf16(t, row, cache)
				}

				// State after the step from the state before + the dumped (a, b).
				st := prev.Clone()
				c.Advance(st, a, b, P)
				kvDump, scDump := mustF32(t, f, L+p+"kv_state"), mustF32(t, f, L+p+"score_state")
				stat(p+"kv_state").exactF32(t, st.KV[:len(kvDump)], kvDump)
				stat(p+"score_state").exactF32(t, st.Score[:len(scDump)], scDump)

				prev = fullState(c, kvDump, scDump) // teacher forcing: the next step starts from the dump
			}
		}
	}
	if steps == 0 {
		t.Fatal("no step_<P>.safetensors in the golden")
	}

	for _, name := range order {
		s := stats[name]
		if s == nil {
			continue
		}
		t.Log(s)
		var tolULP int32 // bf16 stages
		switch name {
		case "cmp_pooled", "icmp_pooled", "cmp_normed", "icmp_normed":
			tolULP = 1
		}
		switch name {
		case "cmp_a", "cmp_b", "icmp_a", "icmp_b":
			if lim := float64(g.cfg.Dim) * 0x1p-24; s.maxRel > lim {
				t.Errorf("%s: relative error %.3g exceeds dim·2^-24 = %.3g", name, s.maxRel, lim)
			}
		case "cmp_kv_state", "cmp_score_state", "icmp_kv_state", "icmp_score_state":
			if s.same != s.n {
				t.Errorf("%s: %d of %d values differ; the state update must be bit-exact", name, s.n-s.same, s.n)
			}
		default:
			if s.maxULP > tolULP {
				t.Errorf("%s: %d bf16 ulps, tolerance %d", name, s.maxULP, tolULP)
			}
		}
	}
	for _, must := range []string{"cmp_pooled", "cmp_row", "icmp_had", "icmp_row"} {
		if stats[must] == nil || stats[must].n == 0 {
			t.Errorf("the golden has no %s stage: emission steps were not exercised", must)
		}
	}
}
