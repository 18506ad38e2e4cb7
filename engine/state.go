package engine

import (
	"fmt"
	"math"
	"math/rand/v2"

	"sparsemla/attention"
	"sparsemla/quant"
)

// LayerState is everything one layer carries from one decode step to the next
// (spec §2.2), in the reference layout:
//
//	KV       bf16 [Window + Tc][HeadDim]  kv_cache: window ring (slot t mod Window holds
//	                                      token t's K = V), then compressed rows 0 … Tc−1
//	Cmp      fp32 kv_state / score_state  main compressor (r > 0), [coff·r][coff·d]
//	ICache   bf16 [Tc][IndexHeadDim]      indexer key cache (r = 4)
//	ICmp     fp32 kv_state / score_state  indexer compressor (r = 4), [8][256]
//
// Next is the position of the next token to decode (= tokens ingested so far)
// when known, 0 when not (a state loaded from a dump whose position the caller
// did not give). RunStep sets it.
type LayerState struct {
	Ratio        int
	Window       int
	HeadDim      int
	IndexHeadDim int
	Next         int64

	KV     []float32
	Cmp    *attention.CompressorState
	ICache []float32
	ICmp   *attention.CompressorState

	// V32 marks a V3.2 layer's state (engine/v32state.go): KV is the latent
	// cache [T][kv_lora_rank+64], ICache the indexer's k_cache E4M3 values
	// [T][128] and IScale its k_scale_cache [T].
	V32    bool
	IScale []float32

	// ikeys is the integer form of ICache's rows kept for the index scoring
	// (attention.IndexKeys): packed as rows are added, checked against
	// ICache by every call, so that a cache changed in place only costs
	// its packing again
	ikeys *attention.IndexKeys
}

// NewLayerState returns the state of a fresh sequence for layer l: empty window
// (zeros), no compressed rows, compressor states kv = 0 and score = −∞.
func NewLayerState(cfg *Config, layer int) *LayerState {
	if cfg.V32() {
		return newV32State(cfg)
	}
	r := cfg.Ratio(layer)
	st := &LayerState{Ratio: r, Window: cfg.WindowSize, HeadDim: cfg.HeadDim, IndexHeadDim: cfg.IndexHeadDim,
		KV: make([]float32, cfg.WindowSize*cfg.HeadDim)}
	if r > 0 {
		st.Cmp = newCompressorState(r, cfg.HeadDim)
	}
	if r == 4 {
		st.ICmp = newCompressorState(r, cfg.IndexHeadDim)
	}
	return st
}

func newCompressorState(r, d int) *attention.CompressorState {
	n := Coff(r) * r * Coff(r) * d
	st := &attention.CompressorState{KV: make([]float32, n), Score: make([]float32, n)}
	// Score = −inf everywhere, filled by doubling copies (memmove: an
	// r = 128 state is 64K values, and a loop of stores was ~18 % of a
	// fuzzed replay under the fuzzer's instrumentation).
	if n > 0 {
		st.Score[0] = float32(math.Inf(-1))
		for i := 1; i < n; i *= 2 {
			copy(st.Score[i:], st.Score[:i])
		}
	}
	return st
}

// Rows is Tc, the number of compressed rows in the cache.
func (s *LayerState) Rows() int { return len(s.KV)/s.HeadDim - s.Window }

// Clone returns a deep copy.
func (s *LayerState) Clone() *LayerState {
	c := *s
	c.KV = append([]float32(nil), s.KV...)
	c.ICache = append([]float32(nil), s.ICache...)
	c.IScale = append([]float32(nil), s.IScale...)
	if s.Cmp != nil {
		c.Cmp = s.Cmp.Clone()
	}
	if s.ICmp != nil {
		c.ICmp = s.ICmp.Clone()
	}
	c.ikeys = s.ikeys.Clone()
	return &c
}

// StateTensors returns the state as stage tensors named and shaped as the
// golden dumps (step_<P> after step P):
//
//	kv_cache                          BF16 [Window + Tc, HeadDim]
//	cmp_kv_state, cmp_score_state     F32 r = 4: [8, 1024]; r = 128: [Next−1 mod 128 + 1, 512]
//	                                  (the live rows only) when Next > 0, else [128, 512]
//	icache                            BF16 [Tc, 128]            (r = 4)
//	icmp_kv_state, icmp_score_state   F32 [8, 256]              (r = 4)
//
// The tensors share no memory with the state.
func (s *LayerState) StateTensors() map[string]Tensor {
	if s.V32 {
		return s.v32StateTensors()
	}
	m := map[string]Tensor{
		"kv_cache": FromF(KindBF16, append([]float32(nil), s.KV...), s.Window+s.Rows(), s.HeadDim),
	}
	if s.Ratio > 0 {
		w := Coff(s.Ratio) * s.HeadDim
		rows := Coff(s.Ratio) * s.Ratio
		if s.Ratio == 128 && s.Next > 0 {
			rows = int((s.Next-1)%128) + 1
		}
		m["cmp_kv_state"] = FromF(KindF32, append([]float32(nil), s.Cmp.KV[:rows*w]...), rows, w)
		m["cmp_score_state"] = FromF(KindF32, append([]float32(nil), s.Cmp.Score[:rows*w]...), rows, w)
	}
	if s.Ratio == 4 {
		w := 2 * s.IndexHeadDim
		m["icache"] = FromF(KindBF16, append([]float32(nil), s.ICache...), len(s.ICache)/s.IndexHeadDim, s.IndexHeadDim)
		m["icmp_kv_state"] = FromF(KindF32, append([]float32(nil), s.ICmp.KV...), 8, w)
		m["icmp_score_state"] = FromF(KindF32, append([]float32(nil), s.ICmp.Score...), 8, w)
	}
	return m
}

// LoadState builds layer l's state from dumped state tensors named as in
// StateTensors (prefill_state.safetensors L<l>.* or the state keys of a
// step_<P> dump, prefix removed). A compressor state with fewer rows than the
// full buffer (r = 128 dumps keep only the live rows) is padded with kv = 0 and
// score = −∞: those rows are rewritten before they are read. Next is left 0;
// set it to the position of the next step. Shapes are checked; a mismatch is
// an error naming the tensor.
func LoadState(cfg *Config, layer int, m map[string]Tensor) (*LayerState, error) {
	if layer < 0 || layer >= cfg.NLayers {
		return nil, fmt.Errorf("engine: LoadState: layer %d outside the model (%d layers)", layer, cfg.NLayers)
	}
	if cfg.V32() {
		return loadV32State(cfg, layer, m)
	}
	st := NewLayerState(cfg, layer)
	get := func(name string, cols int, minRows, maxRows int) (Tensor, error) {
		t, ok := m[name]
		if !ok {
			return Tensor{}, fmt.Errorf("engine: LoadState layer %d: missing %s", layer, name)
		}
		if !t.Kind.IsFloat() || len(t.Shape) != 2 || t.Shape[1] != cols || t.Shape[0] < minRows || t.Shape[0] > maxRows || len(t.F) != t.Len() {
			return Tensor{}, fmt.Errorf("engine: LoadState layer %d: %s has shape %v (%s), want [%d..%d, %d]",
				layer, name, t.Shape, t.Kind, minRows, maxRows, cols)
		}
		return t, nil
	}
	maxCmp := 0 // compressed rows: none for r = 0, any number otherwise
	if st.Ratio > 0 {
		maxCmp = math.MaxInt32
	}
	kv, err := get("kv_cache", cfg.HeadDim, cfg.WindowSize, cfg.WindowSize+maxCmp)
	if err != nil {
		return nil, err
	}
	st.KV = append([]float32(nil), kv.F...)
	if st.Ratio > 0 {
		rows, w := Coff(st.Ratio)*st.Ratio, Coff(st.Ratio)*cfg.HeadDim
		for _, p := range []struct {
			name string
			dst  []float32
		}{{"cmp_kv_state", st.Cmp.KV}, {"cmp_score_state", st.Cmp.Score}} {
			t, err := get(p.name, w, 1, rows)
			if err != nil {
				return nil, err
			}
			copy(p.dst, t.F)
		}
	}
	if st.Ratio == 4 {
		ic, err := get("icache", cfg.IndexHeadDim, 0, st.Rows())
		if err != nil {
			return nil, err
		}
		if ic.Shape[0] != st.Rows() {
			return nil, fmt.Errorf("engine: LoadState layer %d: icache has %d rows, kv_cache %d compressed rows", layer, ic.Shape[0], st.Rows())
		}
		st.ICache = append([]float32(nil), ic.F...)
		for _, p := range []struct {
			name string
			dst  []float32
		}{{"icmp_kv_state", st.ICmp.KV}, {"icmp_score_state", st.ICmp.Score}} {
			t, err := get(p.name, 2*cfg.IndexHeadDim, 8, 8)
			if err != nil {
				return nil, err
			}
			copy(p.dst, t.F)
		}
	}
	return st, nil
}

// SyntheticState builds a plausible state of layer w.Layer before the token at
// position next, for explain and benchmarks, from seeded random attention
// inputs x_t ~ bf16(N(0,1)) (one stream per token, so every path sees the same
// x_t):
//
//   - window slots: the real K path (wkv → kv_norm → RoPE at t → FQ8) of the last
//     min(next, window) tokens;
//   - compressed rows j < next div r (and index keys for r = 4): a random pooled
//     row finished by the real row path (norm → RoPE at j·r → FQ8, or
//     Had → FQ4 for index keys) — on the right grids, but not pooled from
//     the tokens (that would cost next projections);
//   - compressor states: the real projections of the tokens of the open group
//     (and, for r = 4, the previous group), advanced as decode does.
//
// rope must cover positions 0 … next−1.
func SyntheticState(cfg *Config, w *LayerWeights, rope *RopeTable, next int64, seed uint64) *LayerState {
	if cfg.V32() {
		return syntheticV32State(cfg, w, rope, next, seed)
	}
	st := NewLayerState(cfg, w.Layer)
	st.Next = next
	D, win, r := cfg.HeadDim, int64(cfg.WindowSize), w.Ratio
	xOf := func(t int64) []float32 { return SyntheticInput(cfg, t, seed).F }
	for t := max(0, next-win); t < next; t++ {
		k := make([]float32, D)
		if cfg.BF16Checkpoint() {
			attention.BF16Linear(k, xOf(t), w.Wkv.W, w.Wkv.Rows, w.Wkv.Cols)
		} else {
			attention.FP8Linear(k, xOf(t), w.Wkv)
		}
		attention.RMSNorm(k, k, w.KVNorm, float32(cfg.NormEps))
		rope.Apply(k[cfg.NopeDim():], t)
		quant.FQ8(k[:cfg.NopeDim()], 64)
		copy(st.KV[int(t%win)*D:], k)
	}
	if r == 0 {
		return st
	}
	rng := rand.New(rand.NewPCG(seed, 1<<62))
	row := func(c *attention.Compressor, j int) []float32 {
		z := make([]float32, c.HeadDim)
		for i := range z {
			z[i] = quant.BF16Round(float32(rng.NormFloat64()))
		}
		n, ro := make([]float32, c.HeadDim), make([]float32, c.HeadDim)
		c.Normed(n, z)
		c.Roped(ro, n, int64(j), rope)
		if c.Rotate {
			c.Had(n, ro)
			ro = n
		}
		out := make([]float32, c.HeadDim)
		c.Quantize(out, ro)
		return out
	}
	tc := int(next / int64(r))
	for j := 0; j < tc; j++ {
		st.KV = append(st.KV, row(w.Compressor, j)...)
		if r == 4 {
			st.ICache = append(st.ICache, row(w.Indexer.Compressor, j)...)
		}
	}
	start := next - next%int64(r)
	if r == 4 {
		start = max(0, start-4)
	}
	advance := func(c *attention.Compressor, cs *attention.CompressorState, x []float32, t int64) {
		a, b := make([]float32, c.Width()), make([]float32, c.Width())
		c.Project(a, b, x)
		c.Advance(cs, a, b, t)
	}
	for t := start; t < next; t++ {
		x := xOf(t)
		advance(w.Compressor, st.Cmp, x, t)
		if r == 4 {
			advance(w.Indexer.Compressor, st.ICmp, x, t)
		}
	}
	return st
}

// SyntheticInput is the seeded random attention input of token p used by
// SyntheticState: bf16(N(0,1)) [dim], the same x_p the state would have used.
func SyntheticInput(cfg *Config, p int64, seed uint64) Tensor {
	rng := rand.New(rand.NewPCG(seed, uint64(p)))
	x := make([]float32, cfg.Dim)
	for i := range x {
		x[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	return FromF(KindBF16, x, cfg.Dim)
}
