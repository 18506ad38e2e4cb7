package engine

import (
	"fmt"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// A V3.2 layer's state (V32-M:450-451, 540-541) is every token's latent row
// and index key — nothing is compressed or windowed:
//
//	latent_cache    bf16 [T, kv_lora_rank + 64]   kv_cache | pe_cache of model.py (bf16 buffers;
//	                                              the latent half holds FQ8 values, 4 blocks of 128)
//	k_cache         f32  [T, 128]                 the indexer's E4M3 key codes (as values)
//	k_scale_cache   f32  [T]                      their UE8M0-valued fp32 scales
//
// T = Next (the tokens ingested). model.py keeps bf16 buffers but rounds
// the latent through act_quant first, the numerics of the deployed FP8
// cache; the 656-byte page layout (kvcache.LayoutV32: 512 E4M3, 4 fp32
// scales, 64 bf16 rope) is that cache's serving form.

func newV32State(cfg *Config) *LayerState {
	return &LayerState{V32: true, HeadDim: cfg.V32KVDim(), IndexHeadDim: cfg.IndexHeadDim}
}

func (s *LayerState) v32StateTensors() map[string]Tensor {
	T := len(s.KV) / s.HeadDim
	return map[string]Tensor{
		"latent_cache":  FromF(KindBF16, append([]float32(nil), s.KV...), T, s.HeadDim),
		"k_cache":       FromF(KindF32, append([]float32(nil), s.ICache...), T, s.IndexHeadDim),
		"k_scale_cache": FromF(KindF32, append([]float32(nil), s.IScale...), T),
	}
}

// loadV32State builds a V3.2 layer's state from latent_cache, k_cache and
// k_scale_cache; the three must hold the same number of tokens.
func loadV32State(cfg *Config, layer int, m map[string]Tensor) (*LayerState, error) {
	st := newV32State(cfg)
	get := func(name string, shape ...int) (Tensor, error) {
		t, ok := m[name]
		if !ok {
			return Tensor{}, fmt.Errorf("engine: LoadState layer %d: missing %s", layer, name)
		}
		good := t.Kind.IsFloat() && len(t.Shape) == len(shape) && len(t.F) == t.Len()
		for i := 1; good && i < len(shape); i++ {
			good = t.Shape[i] == shape[i]
		}
		if !good {
			return Tensor{}, fmt.Errorf("engine: LoadState layer %d: %s has shape %v (%s), want [T%s]", layer, name, t.Shape, t.Kind, shapeTail(shape[1:]))
		}
		return t, nil
	}
	kv, err := get("latent_cache", 0, cfg.V32KVDim())
	if err != nil {
		return nil, err
	}
	kc, err := get("k_cache", 0, cfg.IndexHeadDim)
	if err != nil {
		return nil, err
	}
	ks, err := get("k_scale_cache", 0)
	if err != nil {
		return nil, err
	}
	if kc.Shape[0] != kv.Shape[0] || ks.Shape[0] != kv.Shape[0] {
		return nil, fmt.Errorf("engine: LoadState layer %d: latent_cache holds %d tokens, k_cache %d, k_scale_cache %d", layer, kv.Shape[0], kc.Shape[0], ks.Shape[0])
	}
	st.KV = append([]float32(nil), kv.F...)
	st.ICache = append([]float32(nil), kc.F...)
	st.IScale = append([]float32(nil), ks.F...)
	return st, nil
}

func shapeTail(s []int) string {
	out := ""
	for _, v := range s {
		out += fmt.Sprintf(", %d", v)
	}
	return out
}

// syntheticV32State runs the real latent and index-key paths of the seeded
// inputs x_t (SyntheticInput) of tokens 0 … next−1.
func syntheticV32State(cfg *Config, w *LayerWeights, rope *RopeTable, next int64, seed uint64) *LayerState {
	st := newV32State(cfg)
	st.Next = next
	for t := int64(0); t < next; t++ {
		x := SyntheticInput(cfg, t, seed).F
		row, k, ks := v32TokenRows(cfg, w.V32, rope, x, t)
		st.KV = append(st.KV, row...)
		st.ICache = append(st.ICache, k...)
		st.IScale = append(st.IScale, ks)
	}
	return st
}

// v32TokenRows is what token t with input x writes: its latent cache row
// (kv_norm(kv_a[:c]) | RoPE(kv_a[c:], t)) and its index key (codes, scale).
func v32TokenRows(cfg *Config, v *V32Weights, rope *RopeTable, x []float32, t int64) (row, k []float32, ks float32) {
	c := cfg.KVLoraRank
	kvA := make([]float32, cfg.V32KVDim())
	attention.FP8Linear(kvA, x, v.WkvA)
	attention.RMSNorm(kvA[:c], kvA[:c], v.KVNorm, float32(cfg.NormEps))
	quant.FQ8(kvA[:c], 128)
	rope.Apply(kvA[c:], t)
	ik := make([]float32, cfg.IndexHeadDim)
	attention.FP8Linear(ik, x, v.IWk)
	indexer.V32LayerNorm(ik, ik, v.IKNormW, v.IKNormB, float32(cfg.NormEps))
	indexer.V32RopeFirst(ik, t, rope)
	quant.Hadamard(ik)
	k = make([]float32, len(ik))
	ks = indexer.V32Quant(k, ik)
	return kvA, k, ks
}
