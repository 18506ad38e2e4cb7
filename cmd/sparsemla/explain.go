package main

import (
	"flag"
	"fmt"
	"io"

	"sparsemla/engine"
)

const explainDoc = `explain walks ONE decode step of ONE attention layer of DeepSeek-V4 in the
order of the official model.py (spec dsv4-attention.md §4), printing every stage:
its name (the dump key), its equation, shape, dtype and a few values. Weights and
the state of the earlier tokens are synthetic (seeded random, generated only for
the layer asked for); the arithmetic is the reference's. A V3.2 preset (v32,
v32-tiny) walks the V3.2 layer (MLA with the lightning indexer), a V4.1 preset
(v41-tiny, v41-flash) the V4.1 attention sub-layer and the layers it reads.
Exit status: 0, or 2 for a bad flag.`

const explainUsage = "explain [--config tiny|flash|pro|v32|v32-tiny|v41-tiny|v41-flash] [--layer L] [--step P] [--seed S] [--values N] [--policy official|bf16|hf-eager]"

func init() {
	register(&command{name: "explain", summary: "walk one decode step of one layer, stage by stage (teaching view)", run: runExplain})
}

func runExplain(args []string, stdout, stderr io.Writer) int {
	fs := rpFlagSet("explain", explainUsage, explainDoc, stdout, stderr)
	cfgName := fs.String("config", "tiny", "model preset: tiny | flash | pro | v32 | v32-tiny | v41-tiny | v41-flash")
	layer := fs.Int("layer", -1, "layer index (default: the first CSA layer, r = 4; V4.1: the first index source using candidate blocks)")
	step := fs.Int64("step", 255, "decode position p (> 0); the state holds tokens 0 … p−1")
	seed := fs.Uint64("seed", 1, "seed of the synthetic weights, state and input")
	nvals := fs.Int("values", 4, "values printed per stage, at least 1")
	policy := fs.String("policy", "official", "numerics policy: official (model.py, FP8 checkpoint), bf16 (model.py on a bf16 checkpoint) or hf-eager (transformers' eager bf16 path); other than official, the stages that differ are listed first")
	pos, err := rpParseArgs(fs, args)
	if err == flag.ErrHelp {
		return exitOK
	}
	if err != nil {
		return exitError
	}
	if len(pos) > 0 {
		rpUsageError(fs, fmt.Sprintf("unexpected argument %q", pos[0]))
		return exitError
	}
	if *nvals < 1 {
		rpUsageError(fs, fmt.Sprintf("--values %d: at least 1 value per stage", *nvals))
		return exitError
	}
	layerGiven := false
	fs.Visit(func(f *flag.Flag) { layerGiven = layerGiven || f.Name == "layer" })
	if layerGiven && *layer < 0 {
		rpUsageError(fs, fmt.Sprintf("--layer %d: a layer index is 0 or more", *layer))
		return exitError
	}
	cfg, err := engine.Preset(*cfgName)
	if err != nil {
		return rpFail(stderr, "explain", err)
	}
	if cfg.IsV41() {
		return runExplainV41(cfg, *cfgName, *policy, *layer, *step, *seed, *nvals, stdout, stderr)
	}
	switch *policy {
	case "official":
	case "bf16":
		cfg.DType = "bf16"
	case engine.PolicyHFEager:
		cfg.DType = "bf16" // HF runs bf16 weights: the synthetic ones serve as such
		if err := cfg.SetPolicy(*policy); err != nil {
			return rpFail(stderr, "explain", err)
		}
	default:
		return rpFail(stderr, "explain", fmt.Errorf("--policy %q: official, bf16 or hf-eager", *policy))
	}
	if *layer < 0 {
		for l := 0; l < cfg.NLayers; l++ {
			if cfg.Ratio(l) == 4 {
				*layer = l
				break
			}
		}
		if *layer < 0 {
			*layer = 0
		}
	}
	if *layer >= cfg.NLayers {
		return rpFail(stderr, "explain", fmt.Errorf("--layer %d: outside the model (%d layers)", *layer, cfg.NLayers))
	}
	// The state holds tokens 0 … p−1 and the model's RoPE tables and caches
	// cover max_seq_len positions: p < max_seq_len.
	if *step <= 0 || *step >= int64(cfg.MaxSeqLen) {
		return rpFail(stderr, "explain", fmt.Errorf("--step %d: a decode position of the %s config is 1 … %d (max_seq_len = %d)", *step, *cfgName, cfg.MaxSeqLen-1, cfg.MaxSeqLen))
	}
	if err := engine.Explain(stdout, cfg, *cfgName, *layer, *step, *seed, *nvals); err != nil {
		return rpFail(stderr, "explain", err)
	}
	return exitOK
}
