package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"sparsemla/engine"
	"sparsemla/replay"
)

func init() {
	register(&command{
		name:    "diff",
		summary: "first divergence between two dumps of one run, with the reference as referee",
		run:     runDiff,
	})
}

const diffDoc = `Compares two dumps of the same run (same model, same tokens, e.g. two engines or
two kernel versions) stage by stage in replay order and names the first stage
where B leaves A's tolerance. When the weights are found (beside A, or
--weights), the reference referees: it recomputes that stage from A's inputs and
says which side it agrees with, and replays both dumps. Weights named by
--weights that cannot be loaded are an error, and so is a --policy (which only
the referee uses) that cannot be applied; without them, when there are no
weights beside A or they cannot be used, there is no referee and the referee's
line (and the JSON's referee, "right": "unknown") says why. Two dumps of different runs (another model config, no decode step in
common, other layers, other tokens or positions at a step, an unrelated
attention input) are refused: their first difference would be the runs', not a
kernel's. Steps only one dump holds are reported as not checked, so are tensors
only one dump holds. The verdict is about B against A ('agree: A and B agree
with each other', 'first divergence: … A and B differ'); the referee's line says
whether the reference agrees with either (a side is right only when the replay
of that side agrees). Exit status: 0 the dumps agree at every step, 1 they
differ, 2 error (also: not the same run), 3 incomplete (no difference where they
were compared, but steps or tensors only one dump holds). Two DeepSeek-V4.1
directories are compared with V4.1's stages and tolerances (docs/v41.md); a V4.1
dump is not diffed against a V4 one.`

func runDiff(args []string, stdout, stderr io.Writer) int {
	var f replayFlags
	fs := rpFlagSet("diff", "diff A B "+rpCommonUsage, diffDoc, stdout, stderr)
	f.register(fs, false)
	pos, code, ok := rpArgs(fs, args, 2, nil)
	if !ok {
		return code
	}
	if v41a, v41b := replay.IsV41(pos[0]), replay.IsV41(pos[1]); v41a || v41b {
		return runDiffV41(pos, v41a && v41b, &f, stdout, stderr)
	}
	tol, err := f.tolerance()
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	a, err := rpOpenDump(pos[0], &f, modelIfFound)
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	defer a.Close()
	b, err := rpOpenDump(pos[1], &f, modelNone)
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	defer b.Close()
	if err := replay.SameRun(a.src, b.src); err != nil {
		return rpFail(stderr, "diff", err)
	}
	var cfg *engine.Config
	if a.model != nil {
		cfg = a.model.Cfg
	} else if cfg, err = engine.ParseConfig([]byte(a.d.Header.ModelArgs)); err != nil {
		return rpFail(stderr, "diff", fmt.Errorf("%s: no usable model config: %w", pos[0], err))
	}
	rep, err := replay.Diff(context.Background(), cfg, a.model, a.src, b.src, tol)
	if err != nil {
		return rpFail(stderr, "diff", err)
	}
	if none := (*replay.NoWeightsError)(nil); a.model == nil {
		// no referee, said in the text and the JSON alike
		why := fmt.Sprintf("the weights beside A cannot be used (%s)", errLine(a.modelErr))
		if errors.As(a.modelErr, &none) {
			why = "no weights beside A (--weights names them)"
		}
		rep.Referee = &replay.Referee{A: replay.RefereeNotRun, B: replay.RefereeNotRun, Right: "unknown", Text: "no referee: " + why + "; the verdict is B against A only"}
	}
	if err := rpWrite(stdout, rep, f.json); err != nil {
		return rpFail(stderr, "diff", err)
	}
	return rpExit(rep)
}
