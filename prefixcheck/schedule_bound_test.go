package prefixcheck

import (
	"strings"
	"testing"

	"sparsemla/kvcache"
)

// A schedule of a million layers (a dump header's compress_ratios) would
// make every page's resume needs cost a million steps: NewRunner refuses
// more than maxLayers, and keeps taking a model's own schedule.
func TestScheduleLayersBounded(t *testing.T) {
	huge := make([]int, 1<<20)
	for _, s := range []kvcache.Schedule{{Window: 128, Ratios: huge}, {Window: 128, IndexRatios: huge}} {
		_, err := NewRunner(Config{PageSize: 64, Schedule: s}, Trace{})
		if err == nil || !strings.Contains(err.Error(), "a schedule of 1048576 layers: at most 1024") {
			t.Errorf("error %v", err)
		}
	}
	flash := make([]int, 43)
	for l := 2; l < 43; l++ {
		flash[l] = 4 << (l % 2 * 5) // 4, 128, 4, …
	}
	if _, err := NewRunner(Config{PageSize: 64, Schedule: kvcache.Schedule{Window: 128, Ratios: flash}}, Trace{}); err != nil {
		t.Error(err)
	}
}
