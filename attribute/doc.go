// Package attribute names what a GPU did when one of its stages diverges from
// the reference. For each stage it runs a short list of hypotheses (the stage
// computed the way a known engine ships it or a known bug computes it) on the
// stage's inputs and reports the one that reproduces the GPU's tensor bit for
// bit, or the closest one when it is closer to the GPU than the reference is.
//
// The hypotheses include bf16 logits or softmax in attention, split-K merges
// without rescaling or without the sink, window K without FQ8, another FP8
// scale rule, FP8 linears as bf16 GEMMs, an indexer without Hadamard or FQ4,
// an fp32 scorer, bf16 compressor GEMMs, vLLM's FP8 o_inv, a wrong RoPE table or position and a
// cache write to the wrong slot; around the attention sub-layer
// (hypotheses_block.go) a hash lookup of a neighbouring token id, a router
// without its bias or with its weights not normalised or unscaled, routed
// FP4 experts with their nibbles swapped, scales per 128 or no
// swiglu_limit clamp, a shared expert clamped, with gate and up swapped or
// per-token activation scales or left out, hc_split_sinkhorn with an
// iteration more or fewer, without hc_eps or without its sigmoids, hc_post
// with comb transposed, unweighted or unmixed, and a head without its final
// norm or with another collapse; in a teacher-forced replay the inputs are
// the dumped ones. Package replay calls it when it diagnoses a diverging
// stage; it imports engine, attention, indexer, kvcache, quant and moe,
// mhc and head (through engine's block weights), and reads no dump.
//
// # Overview
//
//	c := &attribute.Call{Ctx: ctx, Def: def, In: in, Ref: ref, Get: get}
//	v := attribute.Attribute(c, gpu)   // v.Best: the reproducing hypothesis, v.Exact: all that do
//
// Hypotheses(stage) lists what is tried for a stage. Each hypothesis is a
// named function of the attention, indexer, quant and kvcache packages
// (their hypotheses*.go / writes.go files), wired here to the stage's inputs
// and weights; a hypothesis that needs a value the stage does not read
// (split_bounds, the state before the step) asks Call.Get for it and is
// skipped when it is absent. The wiring is grouped by stage kind:
// hypotheses.go (the registry; FP8 linears, norms, FQ8/FQ4, wo_a),
// hypotheses_rope.go (RoPE tables, pairing, positions),
// hypotheses_attention.go (indexer scores, attention, cache writes, the
// index list) and hypotheses_block.go (router, experts, hyper-connections,
// head; RoutedVariant gives package replay a routed-expert variant to say
// which expert it changes).
//
// # Invariants
//
// A hypothesis never changes its inputs. Results are deterministic: the
// hypotheses run in list order and ties keep the first. A hypothesis that
// cannot run (a missing input, weights in the compact form it cannot read)
// is reported as skipped with the reason, never as a match. The distance is
// the number of elements whose bits differ from the GPU's, then the largest
// bf16 ulp distance among them (integer tensors: differing entries).
package attribute
