package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/fault"
	"sparsemla/replay"
	"sparsemla/userfile"
)

func init() {
	register(&command{
		name:    "demo",
		summary: "synthetic model, a clean and a faulty dump, replayed (the main job, in seconds)",
		run:     runDemo,
	})
}

const demoDoc = `Builds a tiny synthetic DeepSeek-V4 attention model (4 layers: window-only,
CSA r=4 with the indexer, HCA r=128, CSA), writes two GPU-style dumps of the same
decode steps into a temporary directory — one clean, one where a stale
prefix-cache page from another request is served at one step and layer — and
replays both against the reference. The clean dump agrees; the faulty one is
reported at its first divergence with a diagnosis. The same can be done by hand
with 'sparsemla synth' and 'sparsemla replay'.`

// demoFault is the fault the demo injects: a stale prefix-cache page (the
// failure DeepSeek-V4 serving stacks report most, tools-and-formats.md §3.5).
var demoFault = fault.Fault{Kind: fault.StalePrefix, Step: 9, Layer: 3}

func runDemo(args []string, stdout, stderr io.Writer) (code int) {
	fs := rpFlagSet("demo", "demo [--keep DIR] [--reference]", demoDoc, stdout, stderr)
	keep := fs.String("keep", "", "write the dumps into DIR and keep them (default: a temporary directory, removed)")
	reference := fs.Bool("reference", false, referenceUsage)
	if _, code, ok := rpArgs(fs, args, 0, nil); !ok {
		return code
	}
	dir := *keep
	if dir == "" {
		var err error
		dir, err = os.MkdirTemp("", "sparsemla-demo-")
		if err != nil {
			return rpFail(stderr, "demo", err)
		}
		defer os.RemoveAll(dir)
	} else {
		// --keep DIR: a new or empty directory, or an earlier demo's; the two
		// dumps are written into it one by one (each through a temporary
		// directory), and it is marked as sparsemla's when both are there.
		kd, err := (&userfile.Guard{}).CreateDirInPlace(dir)
		if err != nil {
			return rpFail(stderr, "demo", err)
		}
		defer kd.Abort()
		defer func() {
			if code == exitOK {
				if err := kd.Commit(); err != nil {
					code = rpFail(stderr, "demo", err)
				}
			}
		}()
	}
	const prefill, steps, seed = 6, 8, 1
	fmt.Fprintf(stdout, "sparsemla demo: tiny synthetic model (layers r = 0, 4, 128, 4), decode steps %d..%d after a %d-token prefill, seed %d\n",
		prefill, prefill+steps-1, prefill, seed)
	runs := []struct {
		name  string
		fault *fault.Fault
	}{{"clean", nil}, {"faulty", &demoFault}}
	for _, r := range runs {
		out := filepath.Join(dir, r.name)
		s, err := fault.Synthesize(fault.SynthOptions{Prefill: prefill, Steps: steps, Seed: seed, Fault: r.fault})
		if err != nil {
			return rpFail(stderr, "demo", err)
		}
		if err := s.Write(out); err != nil {
			return rpFail(stderr, "demo", err)
		}
		what := "no fault"
		if r.fault != nil {
			what = "injected: " + r.fault.String() + " (stale prefix-cache page from request " + fault.SynthOtherRequest + ")"
		}
		fmt.Fprintf(stdout, "\n== %s dump (%s)\n   $ sparsemla replay %s\n", r.name, what, out)
		d, err := dump.Open(filepath.Join(out, fault.SynthDumpFile))
		if err != nil {
			return rpFail(stderr, "demo", err)
		}
		src, err := replay.NewDumpSource(d, "")
		if err == nil {
			var m *engine.Model
			if m, err = replay.LoadModelWith(d, src, replay.LoadOptions{Weights: out, Prepared: !*reference}); err == nil {
				var rep *replay.Report
				if rep, err = replay.Run(context.Background(), m, src, replay.Options{}); err == nil {
					rep.WriteText(stdout)
				}
				if err == nil && r.fault != nil {
					// How the error grows: the reference's own chain, which
					// never saw the fault, against the dump.
					var prop *replay.Report
					if prop, err = replay.Run(context.Background(), m, src, replay.Options{Mode: replay.Propagated}); err == nil {
						fmt.Fprintf(stdout, "   $ sparsemla replay --mode propagated %s\n   %s\n", out, growth(prop))
					}
				}
			}
		}
		d.Close()
		if err != nil {
			return rpFail(stderr, "demo", err)
		}
	}
	if *keep == "" {
		fmt.Fprintln(stdout, "\n(the dumps above are removed now; 'sparsemla demo --keep DIR' keeps them)")
	}
	fmt.Fprintln(stdout, "\nTry: sparsemla synth --out DIR --fault KIND@step,layer (sparsemla synth --help lists the faults), then sparsemla replay DIR [--json] or sparsemla report DIR --html out.html")
	return exitOK
}

// growth summarises a propagated replay: which (step, layer) units and how
// many stages are out of tolerance.
func growth(r *replay.Report) string {
	type unit struct {
		step  int64
		layer int
	}
	n := map[unit]int{}
	var order []unit
	for _, s := range r.Results {
		if s.Status != replay.StatusFail {
			continue
		}
		u := unit{s.Step, s.Layer}
		if n[u] == 0 {
			order = append(order, u)
		}
		n[u]++
	}
	if len(order) == 0 {
		return "propagated: the reference chain stays within tolerance"
	}
	msg := fmt.Sprintf("propagated: %d stages out of tolerance in", r.Summary.Fail)
	for i, u := range order {
		if i == 6 {
			msg += fmt.Sprintf(" … (%d units)", len(order))
			break
		}
		msg += fmt.Sprintf(" step %d/layer %d (%d)", u.step, u.layer, n[u])
	}
	return msg + ": the fault's effect persists in later steps through the cache"
}
