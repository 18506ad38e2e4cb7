package replay

import (
	"sparsemla/engine"
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
