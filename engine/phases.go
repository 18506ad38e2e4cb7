package engine

import "time"

// phaseClock, when set, receives the wall time of each phase of
// PreparedLayer.Step (BenchmarkPreparedStepPhases sets it, to show where a
// step's time goes at a given GOMAXPROCS; nothing else does). Phases of the
// step's concurrent branches overlap, so their times do not add up to the
// step's. It is called from several goroutines at once.
var phaseClock func(phase string, d time.Duration)

// phaseStart returns the start time of a phase, or the zero time (without
// reading the clock) when no phaseClock is set.
func phaseStart() time.Time {
	if phaseClock == nil {
		return time.Time{}
	}
	return time.Now()
}

// phaseEnd reports the phase that began at t0 to phaseClock, if set, and
// returns the time the next phase begins.
func phaseEnd(phase string, t0 time.Time) time.Time {
	if phaseClock == nil {
		return t0
	}
	now := time.Now()
	phaseClock(phase, now.Sub(t0))
	return now
}
