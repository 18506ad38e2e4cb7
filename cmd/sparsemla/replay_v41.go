package main

import (
	"fmt"
	"io"

	"sparsemla/dump"
	"sparsemla/fault"
	"sparsemla/replay"
)

// runReplayV41 is replay for a DeepSeek-V4.1 dump directory in the official
// layout (replay.V41Run, the common report): --mode local or propagated,
// --steps, --tol/--tol-stage and --json as for V4; the flags V4.1 does not
// implement are refused, one line each.
func runReplayV41(dir string, f *replayFlags, stdout, stderr io.Writer) int {
	rep, code := rpRunV41("replay", dir, f, stderr)
	if rep == nil {
		return code
	}
	if err := rpWrite(stdout, rep, f.json); err != nil {
		return rpFail(stderr, "replay", err)
	}
	return rpExit(rep)
}

// rpRefuseV41 refuses the flags of the V4 replay that have no V4.1
// implementation; false when one was set (the message is written).
// --mode chained is V4's whole-model chain; on a whole V4.1 dump the
// propagated replay already runs the model from the token to the logits.
func rpRefuseV41(cmd string, f *replayFlags, stderr io.Writer) bool {
	if f.mode == string(replay.Chained) {
		fmt.Fprintf(stderr, "sparsemla %s: --mode chained: not implemented for DeepSeek-V4.1 dumps; on a whole V4.1 dump (block and MoE weights present) --mode propagated runs the whole model from the token through every layer to the logits (docs/v41.md)\n", cmd)
		return false
	}
	return true
}

// rpOpenV41 loads a V4.1 dump with the flags' name map, request, weights
// and policy (replay.OpenV41).
func rpOpenV41(path string, f *replayFlags) (*replay.V41Dump, error) {
	opt := replay.V41OpenOptions{Request: f.request, Weights: f.weights, Policy: f.policy}
	if f.mapFile != "" {
		m, err := dump.LoadNameMap(f.mapFile)
		if err != nil {
			return nil, err
		}
		opt.Map = m
	}
	return replay.OpenV41(path, opt)
}

// v41Tolerance is the V4.1 default tolerance of the mode, then --tol, then
// --tol-stage.
func (f *replayFlags) v41Tolerance(d *replay.V41Dump) (*replay.Tolerance, error) {
	t := replay.V41DefaultTolerance(d, replay.Mode(f.mode))
	if f.tolFile != "" {
		if err := t.LoadToleranceFile(f.tolFile); err != nil {
			return nil, err
		}
	}
	for _, s := range f.tolStage {
		name, st, err := replay.ParseStageTol(s)
		if err != nil {
			return nil, err
		}
		t.Override(name, st)
	}
	return t, nil
}

// rpRunV41 loads and replays a V4.1 dump with the flags; nil and the exit
// code on an error (written to stderr).
func rpRunV41(cmd, dir string, f *replayFlags, stderr io.Writer) (*replay.Report, int) {
	if !rpRefuseV41(cmd, f, stderr) {
		return nil, exitError
	}
	steps, err := parseSteps(f.steps)
	if err != nil {
		return nil, rpFail(stderr, cmd, err)
	}
	d, err := rpOpenV41(dir, f)
	if err != nil {
		return nil, rpFail(stderr, cmd, err)
	}
	tol, err := f.v41Tolerance(d)
	if err != nil {
		return nil, rpFail(stderr, cmd, err)
	}
	rep, err := replay.V41Run(d, replay.V41Options{Mode: replay.Mode(f.mode), Tol: tol, Steps: steps})
	if err != nil {
		return nil, rpFail(stderr, cmd, err)
	}
	return rep, exitOK
}

// runDiffV41 is diff when either dump is a V4.1 directory: both must be
// (replay.V41Diff), a V4.1 dump is not diffed against a V4 one.
func runDiffV41(pos []string, both bool, f *replayFlags, stdout, stderr io.Writer) int {
	if !both {
		return rpFail(stderr, "diff", fmt.Errorf("diff %s %s: only one of them is a DeepSeek-V4.1 dump (config.json): these dumps are of different models", pos[0], pos[1]))
	}
	if !rpRefuseV41("diff", f, stderr) {
		return exitError
	}
	tol, err := f.v41Tolerance(nil)
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	a, err := rpOpenV41(pos[0], f)
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	b, err := rpOpenV41(pos[1], f)
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	rep, err := replay.V41Diff(a, b, tol)
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	if err := rpWrite(stdout, rep, f.json); err != nil {
		return rpFail(stderr, "diff", err)
	}
	return rpExit(rep)
}

// rpBisectV41 is bisect of a V4.1 dump directory (replay.V41Bisect).
func rpBisectV41(dir string, f *replayFlags, persistent bool, stderr io.Writer) (*replay.Report, int) {
	if !rpRefuseV41("bisect", f, stderr) {
		return nil, exitError
	}
	tol, err := f.v41Tolerance(nil)
	if err != nil {
		return nil, rpFail(stderr, "bisect", err)
	}
	d, err := rpOpenV41(dir, f)
	if err != nil {
		return nil, rpFail(stderr, "bisect", err)
	}
	rep, err := replay.V41Bisect(d, tol, persistent)
	if err != nil {
		return nil, rpFail(stderr, "bisect", err)
	}
	return rep, exitOK
}

// runFaultV41 is fault --in on a V4.1 dump directory (fault.WriteFaultedV41).
func runFaultV41(in, out string, flt fault.Fault, f *replayFlags, stdout, stderr io.Writer) int {
	if !rpRefuseV41("fault", f, stderr) {
		return exitError
	}
	d, err := rpOpenV41(in, f)
	if err != nil {
		return rpFail(stderr, "fault", err)
	}
	res, err := fault.WriteFaultedV41(in, d, out, flt)
	if err != nil {
		return rpFail(stderr, "fault", err)
	}
	stage, why := fault.V41FaultStage(flt)
	fmt.Fprintf(stdout, "wrote %s: %s (DeepSeek-V4.1) with fault %s\n", res.Dir, in, flt)
	fmt.Fprintf(stdout, "  first divergence expected: decode step %d, layer %d, stage %s — %s\n", flt.Step, flt.Layer, stage, why)
	fmt.Fprintf(stdout, "  changed: %s\n", stageKeys(res.Changed))
	for _, n := range res.NotRecomputed {
		fmt.Fprintf(stdout, "  not recomputed: %s\n", n)
	}
	fmt.Fprintf(stdout, "replay it: sparsemla replay %s\n", res.Dir)
	return exitOK
}
