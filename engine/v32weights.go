package engine

import (
	"fmt"
	"math"
	"math/rand/v2"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/quant"
)

// V32Weights are one V3.2 layer's attention parameters, named as in the
// official state_dict (layers.N.attn.<name>, V32-M:515-537 and 436-446).
// Shapes [out, in]; FP8 = E4M3 codes + UE8M0 128×128 block scales (.scale):
//
//	WqA          FP8  [q_lora_rank, dim]                         wq_a
//	QNorm        fp32 [q_lora_rank]                              q_norm.weight
//	WqB          FP8  [H·(nope+rope), q_lora_rank]               wq_b
//	WkvA         FP8  [kv_lora_rank + rope, dim]                 wkv_a
//	KVNorm       fp32 [kv_lora_rank]                             kv_norm.weight
//	WkvB         FP8  [H·(nope+v), kv_lora_rank]                 wkv_b (its bf16 dequantisation, WkvB.W, is what decode reads)
//	Wo           FP8  [dim, H·v]                                 wo
//	IWqB         FP8  [H_I·128, q_lora_rank]                     indexer.wq_b
//	IWk          FP8  [128, dim]                                 indexer.wk
//	IKNormW/B    fp32 [128]                                      indexer.k_norm.weight / .bias
//	IWeightsProj bf16 [H_I, dim]                                 indexer.weights_proj.weight
type V32Weights struct {
	WqA, WqB, WkvA, WkvB, Wo *attention.FP8Weight
	QNorm, KVNorm            []float32
	IWqB, IWk                *attention.FP8Weight
	IKNormW, IKNormB         []float32
	IWeightsProj             []float32
	// FFN holds the layer's norms, FFN and (last layer) head
	// (engine/v32ffn.go); nil when the weights hold the attention only.
	FFN *V32FFNWeights
}

// v32Shapes lists every tensor of a V3.2 layer's attention: FP8 weights
// (name, rows, cols) and plain ones (name, shape).
func v32FP8Shapes(cfg *Config) []struct {
	name       string
	rows, cols int
} {
	H, HI := cfg.NHeads, cfg.IndexNHeads
	return []struct {
		name       string
		rows, cols int
	}{
		{"wq_a", cfg.QLoraRank, cfg.Dim},
		{"wq_b", H * cfg.V32QKHeadDim(), cfg.QLoraRank},
		{"wkv_a", cfg.V32KVDim(), cfg.Dim},
		{"wkv_b", H * (cfg.QKNopeHeadDim + cfg.VHeadDim), cfg.KVLoraRank},
		{"wo", cfg.Dim, H * cfg.VHeadDim},
		{"indexer.wq_b", HI * cfg.IndexHeadDim, cfg.QLoraRank},
		{"indexer.wk", cfg.IndexHeadDim, cfg.Dim},
	}
}

func (w *V32Weights) fp8Slots() []**attention.FP8Weight {
	return []**attention.FP8Weight{&w.WqA, &w.WqB, &w.WkvA, &w.WkvB, &w.Wo, &w.IWqB, &w.IWk}
}

// loadV32LayerWeights reads a V3.2 layer's attention weights (every dtype,
// shape and value checked as LoadLayerWeights does).
func loadV32LayerWeights(cfg *Config, layer int, st dump.WeightSource) (*LayerWeights, error) {
	if layer < 0 || layer >= cfg.NLayers {
		return nil, fmt.Errorf("engine: weights: layer %d outside the model (%d layers)", layer, cfg.NLayers)
	}
	wr := &attnWeightReader{cfg: cfg, st: st, pre: fmt.Sprintf("layers.%d.attn.", layer)}
	v := &V32Weights{}
	var err error
	for i, s := range v32FP8Shapes(cfg) {
		if *v.fp8Slots()[i], err = wr.fp8(s.name, s.rows, s.cols); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct {
		name string
		dst  *[]float32
		n    []int
	}{
		{"q_norm.weight", &v.QNorm, []int{cfg.QLoraRank}},
		{"kv_norm.weight", &v.KVNorm, []int{cfg.KVLoraRank}},
		{"indexer.k_norm.weight", &v.IKNormW, []int{cfg.IndexHeadDim}},
		{"indexer.k_norm.bias", &v.IKNormB, []int{cfg.IndexHeadDim}},
		{"indexer.weights_proj.weight", &v.IWeightsProj, []int{cfg.IndexNHeads, cfg.Dim}},
	} {
		if *f.dst, err = wr.f32(f.name, f.n...); err != nil {
			return nil, err
		}
	}
	if HasV32FFNWeights(st, layer) {
		if v.FFN, err = loadV32FFN(cfg, layer, st); err != nil {
			return nil, err
		}
	}
	return &LayerWeights{Layer: layer, V32: v}, nil
}

// v32WeightRecords is LayerWeightRecords for a V3.2 layer.
func v32WeightRecords(cfg *Config, lw *LayerWeights) []dump.Record {
	v := lw.V32
	pre := fmt.Sprintf("layers.%d.attn.", lw.Layer)
	var out []dump.Record
	for i, s := range v32FP8Shapes(cfg) {
		w := *v.fp8Slots()[i]
		out = append(out,
			dump.Record{Name: pre + s.name + ".weight", DType: dump.E4M3, Shape: []int{w.Rows, w.Cols}, Data: append([]byte(nil), w.CodesRowMajor()...)},
			dump.Record{Name: pre + s.name + ".scale", DType: dump.U8, Shape: fp8Scale(w.Rows, w.Cols), Data: append([]byte(nil), w.Scale...)})
	}
	f32 := func(name string, x []float32, shape ...int) {
		out = append(out, dump.Record{Name: pre + name, DType: dump.F32, Shape: shape, Data: f32Bytes(x)})
	}
	f32("q_norm.weight", v.QNorm, cfg.QLoraRank)
	f32("kv_norm.weight", v.KVNorm, cfg.KVLoraRank)
	f32("indexer.k_norm.weight", v.IKNormW, cfg.IndexHeadDim)
	f32("indexer.k_norm.bias", v.IKNormB, cfg.IndexHeadDim)
	out = append(out, dump.Record{Name: pre + "indexer.weights_proj.weight", DType: dump.BF16,
		Shape: []int{cfg.IndexNHeads, cfg.Dim}, Data: bf16Bytes(v.IWeightsProj)})
	if v.FFN != nil {
		out = append(out, v32FFNRecords(cfg, lw.Layer, v.FFN)...)
	}
	return out
}

// randomV32LayerWeights makes seeded synthetic V3.2 attention weights:
// linear weights bf16(N(0,1)/sqrt(in)) block-quantised to FP8 as the
// checkpoint is (weights_proj stays bf16), norm weights bf16(1 + 0.1·N),
// k_norm.bias bf16(0.1·N). One random stream per matrix.
func randomV32LayerWeights(cfg *Config, layer int, seed uint64) *LayerWeights {
	v := &V32Weights{}
	for i, s := range v32FP8Shapes(cfg) {
		rng := rand.New(rand.NewPCG(seed, uint64(layer)<<48|uint64(i+1)<<32|0x32))
		w := make([]float32, s.rows*s.cols)
		sd := 1 / math.Sqrt(float64(s.cols))
		for j := range w {
			w[j] = quant.BF16Round(float32(rng.NormFloat64() * sd))
		}
		*v.fp8Slots()[i] = attention.QuantizeFP8Weight(w, s.rows, s.cols)
	}
	rng := rand.New(rand.NewPCG(seed, uint64(layer)<<48|0xff<<32|0x32))
	vec := func(n int, mean, sd float64) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = quant.BF16Round(float32(mean + sd*rng.NormFloat64()))
		}
		return x
	}
	v.QNorm, v.KVNorm = vec(cfg.QLoraRank, 1, 0.1), vec(cfg.KVLoraRank, 1, 0.1)
	v.IKNormW, v.IKNormB = vec(cfg.IndexHeadDim, 1, 0.1), vec(cfg.IndexHeadDim, 0, 0.1)
	v.IWeightsProj = vec(cfg.IndexNHeads*cfg.Dim, 0, 1/math.Sqrt(float64(cfg.Dim)))
	return &LayerWeights{Layer: layer, V32: v}
}
