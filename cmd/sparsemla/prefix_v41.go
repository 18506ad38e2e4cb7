package main

import (
	"sparsemla/engine"
	"sparsemla/prefixcheck"
)

// setV41PrefixSchedule sets what a DeepSeek-V4.1 request must get back to
// resume after a prefix hit (prefixcheck.Config.SetV41Schedule): the window
// of every layer; the compressed rows and the open group's compressor state
// of each KV source (ratio 1 or 2, no overlap, so no halo); the index keys
// of the index sources that own them (one per r tokens). Consumer layers
// hold no cache of their own beyond the window: their compressed rows and
// keys are their sources'.
func setV41PrefixSchedule(c *prefixcheck.Config, cfg *engine.Config) {
	ratios, index := make([]int, cfg.NLayers), make([]int, cfg.NLayers)
	for l := 0; l < cfg.NLayers; l++ {
		if cfg.IsKVSource(l) {
			ratios[l] = cfg.Ratio(l)
			if cfg.IsIndexSource(l) {
				index[l] = cfg.Ratio(l)
			}
		}
	}
	c.SetV41Schedule(cfg.WindowSize, ratios, index)
}
