package fault

import (
	"fmt"

	"sparsemla/replay"
)

// V41SynthPageBlock is the page size (entries) of the KV pages a native V4.1
// synthetic dump holds: 64, the engines' SWA page size (as SynthPageBlock).
const V41SynthPageBlock = 64

// WriteNative writes the run into dir as a native dump (config.json,
// weights.safetensors, dump.smd: replay.WriteV41Native) with the caches of
// every step also as V4.1 KV pages; pagesOnly leaves the cache tensors out
// (the replay then decodes the pages).
func (s *V41Synth) WriteNative(dir string, pagesOnly bool) error {
	prod := map[string]string{"engine": "sparsemla synth", "seed": fmt.Sprint(s.Seed)}
	var user map[string]string
	if s.Fault != nil {
		user = map[string]string{"injected_fault": s.Fault.String()}
	}
	opt := replay.V41NativeOptions{Request: SynthRequest, Producer: prod, User: user, PageBlock: V41SynthPageBlock, PagesOnly: pagesOnly}
	if err := replay.WriteV41Native(dir, s.Model, s.Pre, s.Steps, s.IndexKAt, opt); err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	return nil
}
