package fault

import (
	"fmt"
	"slices"

	"sparsemla/engine"
)

// The whole-step fault kinds of V4 that V4.1 has a part for, injected by
// SynthesizeV41 into a whole V4.1 run: each writes the named hypothesis of
// engine.V41Hypotheses at its stage (so a local replay names it exactly),
// and the rest of the run — later stages, layers and steps — is computed
// from the faulty value as the GPU would. router-hash-off is refused (V4.1
// has no hash layers); head-no-norm means the final norm skipped (V4.1 has
// no hc_head). The expert kinds show at moe_expert_out / moe_shared_out
// (V4.1 dumps hold each expert's output; V4's show at ffn_out), and ffn_out,
// their sum, follows from them.
var v41BlockFaults = map[Kind]struct{ stage, hyp string }{
	ExpertNibble:       {"moe_expert_out", "fp4-nibble-swap"},
	ExpertScaleBlock:   {"moe_expert_out", "fp4-scale-per-128"},
	ExpertNoClamp:      {"moe_expert_out", "no-swiglu-clamp"},
	SharedGateUp:       {"moe_shared_out", "shared-gate-up-swapped"},
	RouterBias:         {"moe_indices", "no-selection-bias"},
	RouterUnnormalised: {"moe_weights", "weights-unnormalised"},
	HCPostTransposed:   {"h_mid", "hc-post-comb-transposed"},
	HCSplitNoSigmoid:   {"hc_ffn_post", "post-no-sigmoid"},
	HeadNoNorm:         {"logits", "head-no-final-norm"},
}

// V41BlockFaultHypothesis is the hypothesis that names a V4.1 block fault
// kind ("" for other kinds).
func V41BlockFaultHypothesis(k Kind) string { return v41BlockFaults[k].hyp }

// checkV41BlockFault refuses a block fault kind where V4.1 has no such part
// or the place does not apply; whole says whether the run has the whole
// model.
func checkV41BlockFault(cfg *engine.Config, f Fault, whole bool) error {
	if f.Kind == RouterHashOff {
		return fmt.Errorf("fault %s: DeepSeek-V4.1 has no hash-routed layers (no tid2eid; every gate routes by top-k with a bias)", f)
	}
	if _, ok := v41BlockFaults[f.Kind]; !ok {
		return nil
	}
	if !whole {
		return fmt.Errorf("fault %s: needs the whole V4.1 model (mHC, MoE, head), which this dump does not hold", f)
	}
	switch f.Kind {
	case HeadNoNorm:
		if f.Layer != cfg.NLayers-1 {
			return fmt.Errorf("fault %s: the head follows the last layer (%d)", f, cfg.NLayers-1)
		}
	case RouterUnnormalised:
		if cfg.NActivatedExperts < 2 || (cfg.NormTopKProb != nil && !*cfg.NormTopKProb) {
			return fmt.Errorf("fault %s: the gate does not normalise its weights (norm_topk_prob false or k = 1)", f)
		}
	case ExpertNoClamp:
		if cfg.SwigluLimit <= 0 {
			return fmt.Errorf("fault %s: swiglu_limit is 0, there is no clamp to leave out", f)
		}
	}
	return nil
}

// v41BlockInject is the faulty value of a block fault's stage: its
// hypothesis computed from the stage's inputs. A fault that leaves the
// value unchanged (the bias does not change the choice, the clamp does not
// act, …) is refused with ErrInvisible.
func v41BlockInject(c *engine.V41Context, f Fault, in map[string]engine.Tensor, t engine.Tensor) (engine.Tensor, error) {
	bf := v41BlockFaults[f.Kind]
	for _, h := range engine.V41Hypotheses(bf.stage) {
		if h.Name != bf.hyp {
			continue
		}
		bad, err := h.Compute(c, in)
		if err != nil {
			return engine.Tensor{}, fmt.Errorf("fault %s: %w", f, err)
		}
		if slices.Equal(bad.F, t.F) && slices.Equal(bad.I, t.I) {
			return engine.Tensor{}, fmt.Errorf("fault %s: %s at step %d, layer %d is the same as the correct value (%s): %w", f, bf.stage, f.Step, f.Layer, h.Why, ErrInvisible)
		}
		return bad, nil
	}
	return engine.Tensor{}, fmt.Errorf("fault %s: no hypothesis %q at %s", f, bf.hyp, bf.stage)
}
