package replay

import (
	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/quant"
)

// hfEagerTol are the local-mode tolerances of the stages whose value under
// engine.PolicyHFEager has another number format than model.py's: the
// compressor projections are bf16 GEMM outputs (HF's nn.Linear), the
// indexer's q·k and scores fp32 sums.
func hfEagerTol() map[string]StageTol {
	gemm := StageTol{Mode: TolULP, MaxULP: 1, Why: "hf-eager: bf16 nn.Linear, fp32 accumulate, bf16 out"}
	f32 := StageTol{Mode: TolClose, Abs: 1e-4, Rel: 2e-3, Cos: 1e-6, Why: "hf-eager: fp32 sum, summation order differs"}
	return map[string]StageTol{
		"cmp_a": gemm, "cmp_b": gemm, "icmp_a": gemm, "icmp_b": gemm,
		"iw": f32, "index_qk": f32, "index_score": f32,
	}
}

// policyTolerance adapts a local replay's tolerances to the model's
// numerics policy: a stage whose tolerance is still the default one takes
// the policy's (hfEagerTol); a stage set by the caller (--tol, --tol-stage)
// keeps it. Propagated tolerances (cos_diff only) need no change.
func policyTolerance(t *Tolerance, mode Mode, policy string) *Tolerance {
	if policy != engine.PolicyHFEager || mode != Local {
		return t
	}
	def := DefaultTolerance()
	out := t.Clone()
	for name, st := range hfEagerTol() {
		if t.For(name) == def.For(name) {
			out.Set(name, st)
		}
	}
	return out
}

// ropeBF16Name names the RoPE table whose cos and sin are the config's
// rounded to bf16: transformers' DeepseekV4RotaryEmbedding returns
// `cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)` for a bf16 x.
const ropeBF16Name = "cos/sin rounded to bf16 (transformers: DeepseekV4RotaryEmbedding returns cos.to(x.dtype))"

// ropeBF16Diff compares tb with the table p implies, its cos and sin rounded
// to bf16: Differ counts entries whose bits differ, Over those more than one
// bf16 ulp off in cos or sin (one ulp: CUDA's cos/sin before the rounding);
// the angle fields stay zero.
func ropeBF16Diff(tb *engine.RopeTable, p attention.RopeParams) attention.RopeDiff {
	ref := attention.NewRopeTable(p, tb.T)
	d := attention.RopeDiff{T: tb.T, Pairs: attention.RopePairs}
	for k := range tb.Cos {
		wc, ws := quant.BF16Round(ref.Cos[k]), quant.BF16Round(ref.Sin[k])
		if tb.Cos[k] != wc || tb.Sin[k] != ws {
			d.Differ++
		}
		uc, us := quant.BF16ULPDistance(tb.Cos[k], wc), quant.BF16ULPDistance(tb.Sin[k], ws)
		if uc > 1 || uc < -1 || us > 1 || us < -1 {
			d.Over++
		}
	}
	return d
}
