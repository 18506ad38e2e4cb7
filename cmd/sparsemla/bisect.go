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

const bisectDoc = `Binary search over the decode steps of DUMP for the first diverging step,
replaying one step per probe in local mode (and checking that the cache after
the step still holds the rows the dump recorded when they were written: the
cache summarises every earlier step). It then names the layer and stage of that
step's first divergence and prints how many steps it replayed. It assumes a
divergence persists once it appears (a kernel bug past some context length, a
corrupted cache row): a divergence confined to one step and leaving nothing in
the cache can be missed — 'replay' scans every step.
Exit status: 0 agree, 1 diverged, 2 error.`

func runBisect(args []string, stdout, stderr io.Writer) int {
	var f replayFlags
	fs := rpFlagSet("bisect", "bisect DUMP [--weights DIR] [--map FILE] [--tol FILE] [--json] [--reference]", bisectDoc, stderr)
	f.register(fs, false)
	pos, code, ok := rpArgs(fs, args, 1, nil)
	if !ok {
		return code
	}
	tol, err := f.tolerance()
	if err != nil {
		return rpFail(stderr, "bisect", err)
	}
	o, err := rpOpenDump(pos[0], &f, true)
	if err != nil {
		return rpFail(stderr, "bisect", err)
	}
	defer o.Close()
	rep, err := replay.Bisect(context.Background(), o.model, o.src, tol)
	if err != nil {
		return rpFail(stderr, "bisect", err)
	}
	if f.json {
		if err := rep.WriteJSON(stdout); err != nil {
			return rpFail(stderr, "bisect", err)
		}
		return rpExit(rep)
	}
	fmt.Fprintf(stdout, "bisect %s: replayed %d of %d steps (", rep.Dump, rep.StepsReplayed, len(rep.Steps))
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
	fmt.Fprintln(stdout, ")")
	if rep.First == nil {
		fmt.Fprintln(stdout, "agree: the last step and the cache it holds agree with the reference")
		return rpExit(rep)
	}
	fmt.Fprintln(stdout, rep.First.Text)
	for _, line := range rep.First.Detail {
		fmt.Fprintln(stdout, "  "+line)
	}
	return rpExit(rep)
}
