package fault

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/quant"
	"sparsemla/replay"
)

// Faults in a V3.2 (DSA) model (engine.V32Stages). Three kinds apply:
//
//	splitk-merge     o_latent: the split-K combine of the sparse MLA adds the
//	                 second split's partial without rescaling it by e^(lse_1 − L)
//	                 (FlashMLA's split form; the first split keeps its weight)
//	scale-byte       k_scale_cache: bit 0 of the exponent of one older token's
//	                 index-key scale (a power of two) flips, so that key's
//	                 scores read ×2 or ÷2 (the V3.2 cache's only scales)
//	topk-off-by-one  index_topk: the last entry is a neighbouring token
//
// Every other kind names a part V3.2 does not have (attention sink, FQ8
// window K, compressor, window list, FP4 experts, hyper-connections) or one
// the V3.2 injection does not implement (stale-prefix pages; the FFN side:
// router, shared expert, head, although the reference has them since
// engine.V32BlockStages); checkV32 refuses them in one line.

func (f Fault) v32Stage() string {
	switch f.Kind {
	case SplitKMerge:
		return "o_latent"
	case ScaleByte:
		return "k_scale_cache"
	case TopKOffByOne:
		return "index_topk"
	}
	return ""
}

func (f Fault) v32Diagnosis() string {
	switch f.Kind {
	case SplitKMerge:
		return replay.KindAttention
	case ScaleByte:
		return replay.KindCache
	case TopKOffByOne:
		return replay.KindIndexer
	}
	return ""
}

// checkV32 says whether f can be injected into a V3.2 model at its step.
func (f Fault) checkV32(cfg *engine.Config) error {
	no := func(why string) error { return fmt.Errorf("fault %s: not in a V3.2 model: %s", f, why) }
	switch f.Kind {
	case SplitKMerge, ScaleByte:
		if f.Step < 1 {
			return fmt.Errorf("fault %s: needs an earlier token in the latent cache (step >= 1)", f)
		}
		return nil
	case TopKOffByOne:
		if f.Step+1 <= int64(cfg.IndexTopK) {
			return fmt.Errorf("fault %s: at step %d the indexer selects every one of its %d tokens (top-%d): no unselected neighbour to be off by one to (needs step >= %d)",
				f, f.Step, f.Step+1, cfg.IndexTopK, cfg.IndexTopK)
		}
		return nil
	case WrongLSE:
		return no("MLA attention has no attention sink, so the combine has no sink term to miss")
	case FP8Scale:
		return no("model.py keeps the latent cache in bf16; there is no FQ8 window K whose scale could be rounded down")
	case CompressorLate:
		return no("V3.2 has no compressor (the indexer ranks every token)")
	case WindowOrder:
		return no("V3.2 has no sliding window, so no window index list")
	case ExpertNibble:
		return no("V3.2's experts are FP8 (no FP4 nibbles)")
	case RouterBias:
		return fmt.Errorf("fault %s: not implemented for V3.2: the reference has the V3 MoE router (engine.V32BlockStages), but no fault is injected into it yet (and the official Gate has a bias only at dim 7168)", f)
	case HCPostTransposed, HCSplitNoSigmoid:
		return no("V3.2 has no hyper-connections (plain residual adds)")
	case ExpertScaleBlock, ExpertNoClamp:
		return no("V3.2's routed experts are FP8 (no FP4 scale blocks or SwiGLU clamp)")
	case RouterHashOff, RouterUnnormalised, SharedGateUp, HeadNoNorm:
		return fmt.Errorf("fault %s: not implemented for V3.2: the reference has the whole layer (engine.V32BlockStages), but faults are injected into its attention stages only", f)
	case StalePrefix:
		return fmt.Errorf("fault %s: not implemented for V3.2: the stale-page injection knows V4's window ring only", f)
	}
	return no("unknown kind")
}

// corruptV32 applies a V3.2 fault to its stage's value out.
func (j *faultInjector) corruptV32(ctx *engine.StepContext, out engine.Tensor, in map[string]engine.Tensor) (engine.Tensor, error) {
	cfg := ctx.Cfg
	bad := out.Clone()
	switch j.fault.Kind {
	case SplitKMerge:
		H, c, r := cfg.NHeads, cfg.KVLoraRank, cfg.QKRopeHeadDim
		sel := slices.Clone(in["index_topk"].I)
		slices.Sort(sel)
		sel = slices.Compact(sel)
		if len(sel) < 2 {
			return engine.Tensor{}, fmt.Errorf("fault %s: fewer than 2 selected tokens", j.fault)
		}
		kv := in["latent_cache"]
		T := kv.Shape[0]
		parts := [][]int64{sel[:len(sel)/2], sel[len(sel)/2:]}
		var o [2][]float32
		var lse [2][]float64
		for i, part := range parts {
			s, err := attention.V32Scores(in["q_absorbed"].F, in["q_pe"].F, kv.F, H, c, r, T, part, cfg.V32SoftmaxScale())
			if err != nil {
				return engine.Tensor{}, err
			}
			o[i], lse[i] = v32Partial(s, kv.F, H, c, r, T)
		}
		for h := 0; h < H; h++ {
			m := math.Max(lse[0][h], lse[1][h])
			L := m + math.Log(math.Exp(lse[0][h]-m)+math.Exp(lse[1][h]-m))
			w0 := float32(math.Exp(lse[0][h] - L))
			for k := 0; k < c; k++ {
				bad.F[h*c+k] = quant.BF16Round(w0*o[0][h*c+k] + o[1][h*c+k]) // split 1 added with weight 1
			}
		}
		return bad, nil
	case ScaleByte:
		rng := rand.New(rand.NewPCG(j.seed, uint64(j.fault.Step)<<8|uint64(j.fault.Layer)))
		t := rng.IntN(int(j.fault.Step)) // an older token
		b := math.Float32bits(bad.F[t])
		bad.F[t] = math.Float32frombits(b ^ 1<<23) // exponent bit 0: ×2 or ÷2
		return bad, nil
	}
	return engine.Tensor{}, fmt.Errorf("fault %s: not a V3.2 fault", j.fault)
}

// v32Partial is one split's normalised partial output o_s [H][c] (fp32) and
// its natural-log LSE per head, from masked scores s [H][T].
func v32Partial(s, kv []float32, H, c, r, T int) ([]float32, []float64) {
	o := make([]float32, H*c)
	lse := make([]float64, H)
	for h := 0; h < H; h++ {
		sh := s[h*T : (h+1)*T]
		m := float32(math.Inf(-1))
		for _, v := range sh {
			m = max(m, v)
		}
		var z float32
		e := make([]float32, T)
		for t, v := range sh {
			e[t] = float32(math.Exp(float64(v - m)))
			z += e[t]
		}
		for t := 0; t < T; t++ {
			if e[t] == 0 {
				continue
			}
			p := e[t] / z
			for k := 0; k < c; k++ {
				o[h*c+k] += p * kv[t*(c+r)+k]
			}
		}
		lse[h] = float64(m) + math.Log(float64(z))
	}
	return o, lse
}

// StageIn is the stage where the fault first shows in a model of cfg: Stage
// for V4, the V3.2 stage (o_latent, k_scale_cache, index_topk) for V3.2.
func (f Fault) StageIn(cfg *engine.Config) string {
	if cfg != nil && cfg.V32() {
		return f.v32Stage()
	}
	return f.Stage()
}

// DiagnosisIn is Diagnosis in a model of cfg.
func (f Fault) DiagnosisIn(cfg *engine.Config) string {
	if cfg != nil && cfg.V32() {
		return f.v32Diagnosis()
	}
	return f.Diagnosis()
}
