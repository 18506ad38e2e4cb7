package prefixcheck

import "sparsemla/kvcache"

// SetV41Schedule sets the correct cache's schedule for a DeepSeek-V4.1
// model, replacing it: the window of every layer, ratios[l] the compress
// ratio (1 or 2) of each KV source and 0 elsewhere (a consumer layer reads
// its source's compressed rows and holds none), indexRatios[l] the ratio of
// the index keys of each index source owning keys (kvcache.Schedule
// IndexRatios). V4.1 compressors have no overlap, so no layer needs V4's
// ratio-4 halo.
func (c *Config) SetV41Schedule(window int, ratios, indexRatios []int) {
	c.Schedule = kvcache.Schedule{Window: window, Ratios: ratios, IndexRatios: indexRatios}
}
