package engine

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"

	"sparsemla/attention"
	"sparsemla/head"
	"sparsemla/mhc"
	"sparsemla/moe"
	"sparsemla/quant"
)

// RandomBlockWeights makes synthetic block weights for layer l (mHC, norms,
// MoE), seeded and deterministic, with the golden's shapes but not its
// mHC magnitudes (the official-v4-tiny weights measure hc_*_fn RMS ≈ 0.031,
// hc_*_base 0.5–0.6, hc_*_scale 0.7–1.5; fault's synth --whole rescales to
// those): hc_*_fn N(0,1)/sqrt(hc·dim)·0.1, hc_*_base 0.1·N, hc_*_scale 0.5 + 0.1·N
// (fp32), norms bf16(1 + 0.1·N), gate weight bf16(N/sqrt(dim)), gate bias
// 0.1·N, tid2eid the first k of a random permutation per token, experts
// bf16(N/sqrt(in)) quantised to FP4 (per-32 ceil2 scales, RNE), the shared
// expert to FP8 128×128. Routed experts are made when first routed to (each
// from its own stream, so the same at any order or GOMAXPROCS): a V4-Flash
// layer's 256 experts are never all held.
func RandomBlockWeights(cfg *Config, layer int, seed uint64) *BlockWeights {
	hc, dim, E, inter := cfg.HCMult, cfg.Dim, cfg.NRoutedExperts, cfg.MoEInterDim
	stream := func(id uint64) *rand.Rand {
		return rand.New(rand.NewPCG(seed^0x5eed_b10c, uint64(layer)<<48|id))
	}
	rng := stream(0)
	f32 := func(n int, mean, sd float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(mean + sd*rng.NormFloat64())
		}
		return v
	}
	bf := func(n int, mean, sd float64) []float32 {
		v := f32(n, mean, sd)
		quant.BF16RoundSlice(v)
		return v
	}
	nm := mhc.NMixes(hc)
	site := func() *mhc.Site {
		return &mhc.Site{Mult: hc, Dim: dim, Fn: f32(nm*hc*dim, 0, 0.1/math.Sqrt(float64(hc*dim))), Base: f32(nm, 0, 0.1), Scale: f32(3, 0.5, 0.1)}
	}
	bw := &BlockWeights{AttnSite: site(), FFNSite: site(), AttnNorm: bf(dim, 1, 0.1), FFNNorm: bf(dim, 1, 0.1)}
	sf, err := moe.ParseScoreFunc(cfg.ScoreFunc)
	if err != nil {
		panic("engine: RandomBlockWeights: " + err.Error())
	}
	m := &moe.MoE{SwigluLimit: float32(cfg.SwigluLimit), Gate: moe.Gate{Experts: E, TopK: cfg.NActivatedExperts, Dim: dim,
		Func: sf, RouteScale: float32(cfg.RouteScale), Weight: bf(E*dim, 0, 1/math.Sqrt(float64(dim)))}}
	if cfg.HashLayer(layer) {
		k := cfg.NActivatedExperts
		m.Gate.TID2EID = make([]int32, cfg.VocabSize*k)
		for t := 0; t < cfg.VocabSize; t++ {
			for i, e := range rng.Perm(E)[:k] {
				m.Gate.TID2EID[t*k+i] = int32(e)
			}
		}
	} else {
		m.Gate.Bias = f32(E, 0, 0.1)
	}
	fp8 := func(id uint64, rows, cols int) *attention.FP8Weight {
		r := stream(id)
		w := make([]float32, rows*cols)
		for i := range w {
			w[i] = quant.BF16Round(float32(r.NormFloat64() / math.Sqrt(float64(cols))))
		}
		return attention.QuantizeFP8Weight(w, rows, cols)
	}
	m.Shared = &moe.Shared{W1: fp8(1, inter, dim), W2: fp8(2, dim, inter), W3: fp8(3, inter, dim)}
	m.Experts = make([]*moe.Expert, E)
	m.Source = &randomExperts{stream: stream, dim: dim, inter: inter, made: map[int]*moe.Expert{}}
	bw.MoE = m
	return bw
}

// randomExperts makes the synthetic routed experts of RandomBlockWeights on
// first use (expert e from stream 16 + e), guarded for concurrent replays.
type randomExperts struct {
	stream     func(id uint64) *rand.Rand
	dim, inter int
	mu         sync.Mutex
	made       map[int]*moe.Expert
}

func (s *randomExperts) Expert(e int) (*moe.Expert, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ex, ok := s.made[e]; ok {
		return ex, nil
	}
	r := s.stream(16 + uint64(e))
	fp4 := func(rows, cols int) *moe.FP4Weight {
		w := make([]float32, rows*cols)
		for i := range w {
			w[i] = quant.BF16Round(float32(r.NormFloat64() / math.Sqrt(float64(cols))))
		}
		packed := make([]uint8, rows*cols/2)
		scale := make([]uint8, rows*cols/moe.FP4Block)
		quant.QuantizeFP4(packed, scale, w, moe.FP4Block, quant.ScaleCeil2, quant.FP4AmaxFloor)
		fw, err := moe.NewFP4Weight(packed, scale, rows, cols)
		if err != nil {
			panic("engine: random FP4 expert: " + err.Error())
		}
		return fw
	}
	ex := &moe.Expert{W1: fp4(s.inter, s.dim), W2: fp4(s.dim, s.inter), W3: fp4(s.inter, s.dim)}
	s.made[e] = ex
	return ex, nil
}

// RandomHead makes a synthetic head: hc_head_fn N(0,1)/sqrt(hc·dim)·0.1,
// base 0.1·N, scale 0.5 + 0.1·N, norm bf16(1 + 0.1·N), head bf16(N/sqrt(dim))
// (a vocab × dim fp32 table: 2 GiB for V4-Flash).
func RandomHead(cfg *Config, seed uint64) *head.Head {
	hc, dim, V := cfg.HCMult, cfg.Dim, cfg.VocabSize
	rng := rand.New(rand.NewPCG(seed^0x5eed_4ead, 0))
	f32 := func(n int, mean, sd float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(mean + sd*rng.NormFloat64())
		}
		return v
	}
	h := &head.Head{Mult: hc, Dim: dim, Vocab: V, NormEps: float32(cfg.NormEps), HCEps: float32(cfg.HCEps),
		HCFn: f32(hc*hc*dim, 0, 0.1/math.Sqrt(float64(hc*dim))), HCBase: f32(hc, 0, 0.1), HCScale: f32(1, 0.5, 0.1)[0]}
	h.Norm = f32(dim, 1, 0.1)
	quant.BF16RoundSlice(h.Norm)
	h.Weight = f32(V*dim, 0, 1/math.Sqrt(float64(dim)))
	quant.BF16RoundSlice(h.Weight)
	return h
}

// RandomEmbedding is a synthetic embedding: row tok is bf16(N(0,1)) from its
// own stream (seed, tok), made on demand (no vocab × dim table is held).
func RandomEmbedding(cfg *Config, seed uint64) head.Embedding {
	return randomEmbedding{seed: seed, dim: cfg.Dim, vocab: int64(cfg.VocabSize)}
}

// randomEmbedding is RandomHeadWeights' embedding: row tok from stream
// (seed, tok).
type randomEmbedding struct {
	seed  uint64
	dim   int
	vocab int64
}

func (r randomEmbedding) Row(e []float32, tok int64) error {
	if len(e) != r.dim {
		panic("engine: random embedding row width")
	}
	if tok < 0 || tok >= r.vocab {
		return fmt.Errorf("head: token id %d outside the vocabulary [0, %d)", tok, r.vocab)
	}
	rng := rand.New(rand.NewPCG(r.seed^0x5eed_e3b, uint64(tok)))
	for i := range e {
		e[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	return nil
}
