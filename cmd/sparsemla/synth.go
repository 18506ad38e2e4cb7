package main

import (
	"fmt"
	"io"

	"sparsemla/engine"
	"sparsemla/fault"
	"sparsemla/userfile"
)

func init() {
	register(&command{
		name:    "synth",
		summary: "write a synthetic model and dump, optionally with an injected GPU fault",
		run:     runSynth,
	})
}

const synthDoc = `Writes a seeded random model (config.json, weights.safetensors under the official
state_dict names) and the native dump (dump.smd) a GPU would write running it:
the start state after the prefill, then every stage of every layer at each
decode step. With --fault KIND@step,layer the dump carries a realistic GPU bug
at that step and layer, applied where the GPU would make it (every later stage
computed from the faulty value). Fault kinds:
  splitk-merge     sparse-attention split-K combine adds a partial unscaled
  wrong-lse        the combine's LSE misses the attention sink
  fp8-scale        FQ8 block scale rounded down instead of up (window K)
  scale-byte       one UE8M0 scale byte of an older cache row has a bit flipped
  topk-off-by-one  the indexer's last top-k row is off by one (CSA layers, step >= 7)
  stale-prefix     the last four window rows come from another request's page
  compressor-late  the compressed row is written one step late (CSA or HCA layers, emission steps)
  window-order     the window index list puts its -1 padding first (the V4.1 layout; steps < 127)
With --whole the model is the whole one, not the attention path only: every
layer's hyper-connections (hc_attn_*, hc_ffn_*), attn_norm / ffn_norm, the MoE
(gate weight with its bias, or tid2eid on the first n_hash_layers; routed
experts in FP4 E2M1 with UE8M0 per-32 scales; the FP8 shared expert), the
embedding, the final norm and the head, all under the official state_dict
names, run on a seeded random token stream; the dump holds every stage of the
whole decode step (h_in, hc_attn_*, attn_norm_in, x, ..., y, h_mid, hc_ffn_*,
ffn_norm_in, ffn_in, moe_indices, moe_weights, ffn_out, h_out; tok and, after
the last layer, logits) and replays in every mode (--mode chained too). Its
swiglu_limit is 2 (written into config.json; the preset's 10 is out of reach
of the synthetic activations), so the clamp acts. The faults of the whole
layer need --whole:
  expert-nibble          routed FP4 experts read the even column from the high nibble: ffn_out
  expert-scale-block     routed FP4 experts index their UE8M0 scales per 128 columns: ffn_out
  expert-no-clamp        routed experts skip the swiglu_limit clamp: ffn_out
  shared-gate-up-swapped the shared expert runs with w1 and w3 exchanged: ffn_out
  router-bias            the router ranks experts without gate.bias (score layers): moe_indices
  router-hash-off        the router reads tid2eid[tok+1] (hash layers): moe_indices
  router-unnormalised    the router's weights are not divided by their sum: moe_weights
  hc-post-transposed     the attention-side hc_post mixes the streams with comb transposed: h_mid
  hc-split-no-sigmoid    the FFN-side hc split leaves the sigmoid out of post: hc_ffn_post
  head-no-norm           the head skips the final RMSNorm (last layer): logits
With --config v32-tiny (DeepSeek-V3.2) --whole is the whole V3.2 layer (norms,
dense MLP, MoE with grouped routing and FP8 experts, head); of the kinds of the
whole layer router-unnormalised, shared-gate-up-swapped and head-no-norm apply,
router-bias where the gate has a bias (n_expert_groups > 1), and
  router-groups-ignored  the router's top-k ignores the expert groups: moe_indices
                         (n_expert_groups > 1)
  dense-gate-up-swapped  the dense MLP runs with w1 and w3 exchanged: ffn_out
v32-tiny has one expert group and no gate bias; --config v32-tiny-grouped (8
experts in 4 groups, the best one kept, a gate bias) takes router-bias and
router-groups-ignored too, e.g. --whole --fault router-groups-ignored@6,1.
With --config v41-tiny (DeepSeek-V4.1) it writes a directory in the official
V4.1 layout (config.json, weights, prefill_state, step_P.safetensors) that
replay reads (--format native: a native dump.smd, the caches of every step
also as V4.1 KV pages; native-pages: as pages only); of the kinds above window-order (there: V4's order, -1 last)
and topk-off-by-one (index sources) apply, the others are refused.
With --prefix SCENARIO it writes a multi-request prefix-cache run instead
('sparsemla synth --prefix x --help').`

func runSynth(args []string, stdout, stderr io.Writer) int {
	if prefixSynthRequested(args) {
		return runPrefixSynth(args, stdout, stderr)
	}
	fs := rpFlagSet("synth", "synth --out DIR [--config tiny|v32-tiny|v32-tiny-grouped|v41-tiny] [--steps N] [--prefill N] [--seed S] [--whole] [--fault KIND@step,layer] [--format native|official|native-pages]", synthDoc, stdout, stderr)
	out := fs.String("out", "", "output directory (required; an existing one must be empty or one sparsemla wrote, which is replaced)")
	cfg := fs.String("config", "tiny", "model preset: tiny (DeepSeek-V4), v32-tiny or v32-tiny-grouped (DeepSeek-V3.2) or v41-tiny (DeepSeek-V4.1)")
	steps := fs.Int("steps", 8, "decode steps to dump")
	prefill := fs.Int("prefill", 6, "positions run before the first dumped step (the start state is valid after them)")
	seed := fs.Uint64("seed", 1, "random seed of the weights and the token stream")
	faultFlag := fs.String("fault", "", "inject a fault, KIND@step,layer (see above)")
	format := fs.String("format", "", "dump format: native (dump.smd; the default of V4), or for --config v41-*: official (the V4.1 layout, its default), native (dump.smd with the caches also as V4.1 KV pages) or native-pages (the caches as pages only)")
	fs.StringVar(format, "form", "", "the same as -format")
	whole := fs.Bool("whole", false, "the whole model (hyper-connections, MoE, head) and every whole-step stage, not the attention path only")
	if _, code, ok := rpArgs(fs, args, 0, []string{"out"}); !ok {
		return code
	}
	// Refuse a directory that is not new, empty or an earlier output before
	// the work (Write checks again, and writes through a temporary).
	if err := (&userfile.Guard{}).CheckDir(*out); err != nil {
		return rpFail(stderr, "synth", err)
	}
	opt := fault.SynthOptions{Config: *cfg, Prefill: *prefill, Steps: *steps, Seed: *seed, Whole: *whole}
	if *faultFlag != "" {
		f, err := fault.Parse(*faultFlag)
		if err != nil {
			return rpFail(stderr, "synth", err)
		}
		opt.Fault = &f
	}
	if c, err := engine.Preset(*cfg); err == nil && c.IsV41() {
		if *whole {
			return rpFail(stderr, "synth", fmt.Errorf("--whole: the DeepSeek-V4.1 synthetic model (--config %s) holds the attention path only", *cfg))
		}
		return runSynthV41(c, opt, *format, *out, stdout, stderr)
	}
	if *format != "" && *format != "native" {
		return rpFail(stderr, "synth", fmt.Errorf("--format %q: a V4 synthetic dump is native only (official and native-pages are V4.1 formats)", *format))
	}
	s, err := fault.Synthesize(opt)
	if err != nil {
		return rpFail(stderr, "synth", err)
	}
	if err := s.Write(*out); err != nil {
		return rpFail(stderr, "synth", err)
	}
	what := ""
	if *whole {
		what = " (the whole model)"
	}
	fmt.Fprintf(stdout, "wrote %s: %s config%s, steps %d..%d after a %d-token prefill, seed %d",
		*out, *cfg, what, *prefill, *prefill+*steps-1, *prefill, *seed)
	if opt.Fault != nil {
		fmt.Fprintf(stdout, ", fault %s (first divergence expected at stage %s: %s)", opt.Fault, opt.Fault.StageIn(s.Cfg), opt.Fault.DiagnosisIn(s.Cfg))
	}
	fmt.Fprintln(stdout)
	return exitOK
}
