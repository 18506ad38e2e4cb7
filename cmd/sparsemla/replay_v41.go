package main

import (
	"fmt"
	"io"

	"sparsemla/replay"
)

// runReplayV41 is replay for a DeepSeek-V4.1 dump directory in the official
// layout (replay.V41Replay): --mode local or propagated; the flags of the
// V4 replay that V4.1 does not implement are refused, one line each.
func runReplayV41(dir string, f *replayFlags, stdout, stderr io.Writer) int {
	for _, u := range []struct {
		set  bool
		flag string
	}{{f.json, "--json"}, {f.tolFile != "" || len(f.tolStage) > 0, "--tol/--tol-stage"}, {f.mapFile != "", "--map"},
		{f.weights != "", "--weights"}, {f.request != "", "--request"}, {f.steps != "", "--steps"},
		{f.policy != "" && f.policy != "official", "--policy"}, {f.mode == string(replay.Chained), "--mode chained"}} {
		if u.set {
			fmt.Fprintf(stderr, "sparsemla replay: %s: not implemented for DeepSeek-V4.1 dumps (docs/v41.md)\n", u.flag)
			return exitError
		}
	}
	d, err := replay.LoadV41Dir(dir)
	if err != nil {
		return rpFail(stderr, "replay", err)
	}
	rep, err := replay.V41Replay(d, replay.Mode(f.mode))
	if err != nil {
		return rpFail(stderr, "replay", err)
	}
	fmt.Fprint(stdout, rep.Text())
	if rep.First != nil {
		return exitDiverged
	}
	return exitOK
}
