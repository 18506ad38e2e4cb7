package main

import (
	"fmt"
	"io"

	"sparsemla/engine"
)

// runExplainV41 is explain for a V4.1 preset: the attention sub-layer of the
// layer asked for and of every layer it reads publications from
// (engine.ExplainV41).
func runExplainV41(cfg *engine.Config, name, policy string, layer int, step int64, seed uint64, nvals int, stdout, stderr io.Writer) int {
	if policy != "official" {
		return rpFail(stderr, "explain", fmt.Errorf("--policy %q: V4.1 has only the official numerics (model.py on the FP8 checkpoint)", policy))
	}
	if layer < 0 {
		for l := 0; l < cfg.NLayers; l++ {
			if cfg.UsesCandidates(l) {
				layer = l
				break
			}
		}
		if layer < 0 && len(cfg.IndexSources()) > 0 {
			layer = cfg.IndexSources()[0]
		}
	}
	if layer < 0 || layer >= cfg.NLayers {
		return rpFail(stderr, "explain", fmt.Errorf("--layer %d: outside the model (%d layers)", layer, cfg.NLayers))
	}
	if step <= 0 || step >= int64(cfg.MaxSeqLen) {
		return rpFail(stderr, "explain", fmt.Errorf("--step %d: a decode position of the %s config is 1 … %d (max_seq_len = %d)", step, name, cfg.MaxSeqLen-1, cfg.MaxSeqLen))
	}
	if err := engine.ExplainV41(stdout, cfg, name, layer, step, seed, nvals); err != nil {
		return rpFail(stderr, "explain", err)
	}
	return exitOK
}
