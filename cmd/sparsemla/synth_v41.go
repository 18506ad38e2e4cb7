package main

import (
	"fmt"
	"io"

	"sparsemla/engine"
	"sparsemla/fault"
)

// runSynthV41 is synth for a V4.1 preset: a dump directory that 'sparsemla
// replay' reads (fault.SynthesizeV41), in the official V4.1 layout (format
// "" or official) or native (native: dump.smd with KV pages beside the
// cache tensors; native-pages: the caches as pages only).
func runSynthV41(cfg *engine.Config, opt fault.SynthOptions, format, out string, stdout, stderr io.Writer) int {
	switch format {
	case "", "official", "native", "native-pages":
	default:
		return rpFail(stderr, "synth", fmt.Errorf("--format %q: official, native or native-pages", format))
	}
	s, err := fault.SynthesizeV41(cfg, opt.Prefill, opt.Steps, opt.Seed, opt.Fault)
	if err != nil {
		return rpFail(stderr, "synth", err)
	}
	if format == "native" || format == "native-pages" {
		err = s.WriteNative(out, format == "native-pages")
	} else {
		err = s.Write(out)
	}
	if err != nil {
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
