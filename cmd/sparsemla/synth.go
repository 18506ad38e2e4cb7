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
With --config v41-tiny (DeepSeek-V4.1) it writes a directory in the official
V4.1 layout (config.json, weights, prefill_state, step_P.safetensors) that
replay reads; of the kinds above window-order (there: V4's order, -1 last)
and topk-off-by-one (index sources) apply, the others are refused.
With --prefix SCENARIO it writes a multi-request prefix-cache run instead
('sparsemla synth --prefix x --help').`

func runSynth(args []string, stdout, stderr io.Writer) int {
	if prefixSynthRequested(args) {
		return runPrefixSynth(args, stdout, stderr)
	}
	fs := rpFlagSet("synth", "synth --out DIR [--config tiny] [--steps N] [--prefill N] [--seed S] [--fault KIND@step,layer]", synthDoc, stderr)
	out := fs.String("out", "", "output directory (required)")
	cfg := fs.String("config", "tiny", "model preset (tiny, or v41-tiny for DeepSeek-V4.1)")
	steps := fs.Int("steps", 8, "decode steps to dump")
	prefill := fs.Int("prefill", 6, "positions run before the first dumped step (the start state is valid after them)")
	seed := fs.Uint64("seed", 1, "random seed of the weights and the token stream")
	faultFlag := fs.String("fault", "", "inject a fault, KIND@step,layer (see above)")
	if _, code, ok := rpArgs(fs, args, 0, func() bool { return *out != "" }); !ok {
		return code
	}
	// Refuse a directory that is not new, empty or an earlier output before
	// the work (Write checks again, and writes through a temporary).
	if err := (&userfile.Guard{}).CheckDir(*out); err != nil {
		return rpFail(stderr, "synth", err)
	}
	opt := fault.SynthOptions{Config: *cfg, Prefill: *prefill, Steps: *steps, Seed: *seed}
	if *faultFlag != "" {
		f, err := fault.Parse(*faultFlag)
		if err != nil {
			return rpFail(stderr, "synth", err)
		}
		opt.Fault = &f
	}
	if c, err := engine.Preset(*cfg); err == nil && c.IsV41() {
		return runSynthV41(c, opt, *out, stdout, stderr)
	}
	s, err := fault.Synthesize(opt)
	if err != nil {
		return rpFail(stderr, "synth", err)
	}
	if err := s.Write(*out); err != nil {
		return rpFail(stderr, "synth", err)
	}
	fmt.Fprintf(stdout, "wrote %s: %s config, steps %d..%d after a %d-token prefill, seed %d",
		*out, *cfg, *prefill, *prefill+*steps-1, *prefill, *seed)
	if opt.Fault != nil {
		fmt.Fprintf(stdout, ", fault %s (first divergence expected at stage %s: %s)", opt.Fault, opt.Fault.StageIn(s.Cfg), opt.Fault.DiagnosisIn(s.Cfg))
	}
	fmt.Fprintln(stdout)
	return exitOK
}
