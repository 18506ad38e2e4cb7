package replay

import "testing"

// TestLocalSlot: a teacher-forced result replaces the chain's own
// comparison of its stage, or goes where the local order puts it, so that
// the report's first failing stage stays its first divergence.
func TestLocalSlot(t *testing.T) {
	r := func(step int64, layer int, stage, status string) StageResult {
		return StageResult{Step: step, Layer: layer, Stage: stage, Status: status}
	}
	rs := []StageResult{
		r(11, 0, "q_a", StatusPass), r(11, 0, "kv", StatusPass),
		r(12, 0, RopeStage, StatusPass), r(12, 0, "q_a", StatusPass), r(12, 0, "kv", StatusSkipped), r(12, 0, "kv_cache", StatusFail), r(12, 0, "o", StatusPass),
		r(13, 0, "q_a", StatusPass),
	}
	lrs := []StageResult{r(12, 0, "q_a", StatusPass), r(12, 0, "kv", StatusFail), r(12, 0, "kv_cache", StatusSkipped), r(12, 0, "o", StatusFail), r(12, 0, "split", StatusPass)}
	for _, c := range []struct {
		step    int64
		layer   int
		stage   string
		at      int
		replace bool
		failed  bool
	}{
		{12, 0, "q_a", 3, true, false},   // the chain's own comparison
		{12, 0, "o", 6, true, true},      // after the chain's failed kv_cache
		{12, 0, "kv", 5, false, false},   // skipped by the chain: before kv_cache, as the local order has it
		{12, 0, "split", 7, false, true}, // after the unit's last result
		{12, 1, "q_a", 7, false, true},   // a unit the chain has no result of: before step 13
		{14, 0, "q_a", len(rs), false, true},
	} {
		at, replace := localSlot(rs, lrs, c.step, c.layer, c.stage)
		if at != c.at || replace != c.replace || failedBefore(rs, at) != c.failed {
			t.Errorf("step %d layer %d %s: at %d replace %v failed before %v, want %d %v %v", c.step, c.layer, c.stage, at, replace, failedBefore(rs, at), c.at, c.replace, c.failed)
		}
	}
}
