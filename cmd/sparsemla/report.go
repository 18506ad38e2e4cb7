package main

import (
	"context"
	"fmt"
	"io"

	"sparsemla/htmlreport"
	"sparsemla/replay"
	"sparsemla/userfile"
)

func init() {
	register(&command{
		name:    "report",
		summary: "self-contained HTML page: error heatmap by layer x step, per-stage plots, diagnosis",
		run:     runReport,
	})
}

const reportDoc = `Replays DUMP (as 'replay' does) and writes a self-contained HTML page: the
verdict and first-divergence diagnosis, a heatmap of the worst stage error by
layer x step, one plot per stage of its metric (bf16 ulps, cos_diff or values
differing) over the steps, and the table of failing and tied stages. Images
are inline SVG. An existing OUT is replaced only if it is a page sparsemla
wrote (else refused: remove it, give another path, or --force); never an
input. Exit status: 0 agree, 1 diverged, 2 error, 3 incomplete.`

func runReport(args []string, stdout, stderr io.Writer) int {
	var f replayFlags
	fs := rpFlagSet("report", "report DUMP --html OUT [--force] "+rpModeUsage+" "+rpCommonUsage, reportDoc, stdout, stderr)
	f.register(fs, true)
	out := fs.String("html", "", "output HTML file (required; an existing file is replaced only if it is a page sparsemla wrote, or with --force)")
	force := fs.Bool("force", false, forceUsage)
	pos, code, ok := rpArgs(fs, args, 1, []string{"html"})
	if !ok {
		return code
	}
	// The page must not replace any input (report D --html D/weights.safetensors
	// would destroy the weights) nor a file sparsemla did not write (output.go):
	// refused before anything runs, written through a temporary file and a
	// rename.
	g, err := rpOutputGuard(pos[0], &f)
	if err != nil {
		return rpFail(stderr, "report", err)
	}
	if err := g.CheckOutputFile(*out, htmlOutput(*force)); err != nil {
		return rpFail(stderr, "report", err)
	}
	var rep *replay.Report
	if replay.IsV41(pos[0]) {
		if rep, code = rpRunV41("report", pos[0], &f, stderr); rep == nil {
			return code
		}
	} else {
		tol, err := f.tolerance()
		if err != nil {
			return rpFail(stderr, "report", err)
		}
		o, err := rpOpenDump(pos[0], &f, modelRequired)
		if err != nil {
			return rpFail(stderr, "report", err)
		}
		defer o.Close()
		steps, err := parseSteps(f.steps)
		if err != nil {
			return rpFail(stderr, "report", err)
		}
		rep, err = replay.Run(context.Background(), o.model, o.src, replay.Options{
			Mode: replay.Mode(f.mode), Tol: tol, Steps: steps, Progress: rpProgress(stderr, "report"),
		})
		if err != nil {
			return rpFail(stderr, "report", err)
		}
	}
	if err := g.WriteOutputFile(*out, 0o644, htmlOutput(*force), func(w io.Writer) error { return htmlreport.Write(w, rep) }); err != nil {
		return rpFail(stderr, "report", err)
	}
	if f.json {
		if err := rep.WriteJSON(stdout); err != nil {
			return rpFail(stderr, "report", err)
		}
	} else {
		fmt.Fprintf(stdout, "wrote %s (%s)\n", *out, rep.Verdict)
		if rep.First != nil || rep.Incomplete() {
			// What the verdict rests on (the page says it all).
			fmt.Fprintln(stdout, rep.VerdictLine())
		}
	}
	return rpExit(rep)
}

// rpOutputGuard records the inputs of a command that reads the dump at path
// with flags f: the dump, its weights file, the tolerance and name-map files.
func rpOutputGuard(path string, f *replayFlags) (*userfile.Guard, error) {
	ins := []string{path, f.weights, f.tolFile, f.mapFile}
	if w, err := replay.FindWeights(path, f.weights); err == nil {
		ins = append(ins, w)
	}
	return userfile.NewGuard(ins...)
}
