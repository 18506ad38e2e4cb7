package main

import (
	"fmt"
	"io"

	"sparsemla/engine"
	"sparsemla/fault"
)

// runSynthV41 is synth for a V4.1 preset: a dump directory in the official
// V4.1 layout that 'sparsemla replay' reads (fault.SynthesizeV41).
func runSynthV41(cfg *engine.Config, opt fault.SynthOptions, out string, stdout, stderr io.Writer) int {
	s, err := fault.SynthesizeV41(cfg, opt.Prefill, opt.Steps, opt.Seed, opt.Fault)
	if err != nil {
		return rpFail(stderr, "synth", err)
	}
	if err := s.Write(out); err != nil {
		return rpFail(stderr, "synth", err)
	}
	fmt.Fprintf(stdout, "wrote %s: %s config (DeepSeek-V4.1), steps %d..%d after a %d-token synthetic state, seed %d",
		out, opt.Config, opt.Prefill, opt.Prefill+opt.Steps-1, opt.Prefill, opt.Seed)
	if opt.Fault != nil {
		st, why := fault.V41FaultStage(*opt.Fault)
		fmt.Fprintf(stdout, ", fault %s (first divergence expected at stage %s: %s)", opt.Fault, st, why)
	}
	fmt.Fprintln(stdout)
	return exitOK
}
