package main

import (
	"sparsemla/engine"
	"sparsemla/kvcache"
)

// v41PrefixSchedule is what a DeepSeek-V4.1 request must get back to resume
// after a prefix hit (kvcache.Schedule): the window of every layer; the
// compressed rows and the open group's compressor state of each KV source
// (ratio 1 or 2, no overlap, so no halo: the default rule of
// Schedule.Needs); the index keys of the index sources that own them (one
// per r tokens, IndexRatios). Consumer layers hold no cache of their own
// beyond the window: their compressed rows and keys are their sources'.
func v41PrefixSchedule(cfg *engine.Config) kvcache.Schedule {
	s := kvcache.Schedule{Window: cfg.WindowSize, Ratios: make([]int, cfg.NLayers), IndexRatios: make([]int, cfg.NLayers)}
	for l := 0; l < cfg.NLayers; l++ {
		if cfg.IsKVSource(l) {
			s.Ratios[l] = cfg.Ratio(l)
			if cfg.IsIndexSource(l) {
				s.IndexRatios[l] = cfg.Ratio(l)
			}
		}
	}
	return s
}
