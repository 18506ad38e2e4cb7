package main

import (
	"context"
	"fmt"
	"io"

	"sparsemla/replay"
)

func init() {
	register(&command{
		name:    "bisect",
		summary: "find the first diverging step of a large dump with few replays",
		run:     runBisect,
	})
}

const bisectDoc = `Finds the first diverging decode step of DUMP with few replays. A binary search
over the steps probes one step at a time in local mode (and checks that the
cache after the step still holds the rows the dump recorded when they were
written: the cache summarises every earlier step), which finds a divergence
that persists once it appears (a kernel bug past some context length, a
corrupted cache row) with about log2(steps) replays. A divergence confined to
one step and leaving nothing in the cache is not seen by the probes, so the
steps before the first diverging probe that were not probed (every step when
none diverged) are then replayed too: the verdict, step, layer and stage are
those of 'replay' in local mode, and the steps after the first persistent
divergence are saved. --assume-persistent skips that scan and says which steps
it did not check (verdict 'incomplete' when no probe diverged).
A DeepSeek-V4.1 directory is probed with V4.1's local replay, without the separate
cache check (its window and kv_cache stages are checked at every step replayed).
Exit status: 0 agree (every step replayed), 1 diverged, 2 error, 3 incomplete.`

func runBisect(args []string, stdout, stderr io.Writer) int {
	var f replayFlags
	fs := rpFlagSet("bisect", "bisect DUMP "+rpCommonUsage+" [--assume-persistent]", bisectDoc, stdout, stderr)
	f.register(fs, false)
	persistent := fs.Bool("assume-persistent", false, "probe only (binary search), without replaying the steps it did not probe; the report lists them as not checked")
	pos, code, ok := rpArgs(fs, args, 1, nil)
	if !ok {
		return code
	}
	var rep *replay.Report
	if replay.IsV41(pos[0]) {
		if rep, code = rpBisectV41(pos[0], &f, *persistent, stderr); rep == nil {
			return code
		}
	} else {
		tol, err := f.tolerance()
		if err != nil {
			return rpFail(stderr, "bisect", err)
		}
		o, err := rpOpenDump(pos[0], &f, modelRequired)
		if err != nil {
			return rpFail(stderr, "bisect", err)
		}
		defer o.Close()
		rep, err = replay.BisectWith(context.Background(), o.model, o.src, replay.BisectOptions{Tol: tol, AssumePersistent: *persistent})
		if err != nil {
			return rpFail(stderr, "bisect", err)
		}
	}
	if f.json {
		if err := rep.WriteJSON(stdout); err != nil {
			return rpFail(stderr, "bisect", err)
		}
		return rpExit(rep)
	}
	fmt.Fprintf(stdout, "bisect %s: replayed %d of %d steps (probes: ", rep.Dump, rep.StepsReplayed, len(rep.Steps))
	for i, p := range rep.Probes {
		if i > 0 {
			fmt.Fprint(stdout, ", ")
		}
		v := "agrees"
		if p.Diverged {
			v = "diverged"
		}
		fmt.Fprintf(stdout, "step %d %s", p.Step, v)
	}
	if len(rep.Scanned) > 0 {
		fmt.Fprintf(stdout, "; then scanned steps %s", replay.StepList(rep.Scanned))
	}
	fmt.Fprintln(stdout, ")")
	// The notes and verdict of the report, in replay's words: what was
	// compared, what was not and why.
	rep.WriteNotes(stdout)
	rep.WriteVerdict(stdout)
	return rpExit(rep)
}
