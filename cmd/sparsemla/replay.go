package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
)

func init() {
	register(&command{
		name:    "replay",
		summary: "replay a dump against the reference and name the first divergence",
		run:     runReplay,
	})
}

// replayFlags are the flags replay, diff, bisect and report share.
type replayFlags struct {
	weights  string
	mapFile  string
	mode     string
	tolFile  string
	tolStage rpMultiFlag
	request  string
	json     bool
	steps    string
	// reference runs the plain reference loops on the full fp32 weights
	// instead of the prepared fast kernels on compact weights (same bits).
	reference bool
}

// referenceUsage documents --reference (every command that runs the reference).
const referenceUsage = "run the plain reference loops (weights kept with their fp32 dequantisations) instead of the prepared fast kernels on compact weights, the default; both give the same bits, the report's JSON field 'kernels' names the one that ran"

type rpMultiFlag []string

func (m *rpMultiFlag) String() string     { return strings.Join(*m, " ") }
func (m *rpMultiFlag) Set(s string) error { *m = append(*m, s); return nil }

func (f *replayFlags) register(fs *flag.FlagSet, withMode bool) {
	fs.StringVar(&f.weights, "weights", "", "weights: a safetensors file or a directory with weights.safetensors (default: beside the dump)")
	fs.StringVar(&f.mapFile, "map", "", "name map for non-native dumps: a JSON file or a built-in name (default: detected)")
	if withMode {
		fs.StringVar(&f.mode, "mode", "local", "local (teacher-forced: each stage from the dump's own inputs) or propagated (the reference's own chain from each layer's x)")
		fs.StringVar(&f.steps, "steps", "", "replay only these decode steps: P, A-B or a comma list of both (default: all)")
	}
	fs.StringVar(&f.tolFile, "tol", "", "JSON file overriding stage tolerances (docs/replay-json.md)")
	fs.Var(&f.tolStage, "tol-stage", "override one stage's tolerance, e.g. 'o=close,abs=2e-3,rel=0.02,cos=1e-5' or 'u=ulp,max_ulp=3' (repeatable)")
	fs.StringVar(&f.request, "request", "", "request to replay when the dump holds several (default: the first)")
	fs.BoolVar(&f.json, "json", false, "write the report as JSON (schema "+replay.SchemaVersion+")")
	fs.BoolVar(&f.reference, "reference", false, referenceUsage)
}

// tolerance builds the policy: defaults, then --tol, then --tol-stage.
func (f *replayFlags) tolerance() (*replay.Tolerance, error) {
	t := replay.DefaultTolerance()
	if f.mode == string(replay.Propagated) {
		t = replay.PropagatedTolerance()
	}
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
		t.Set(name, st)
	}
	return t, nil
}

// rpOpened is a dump ready to replay.
type rpOpened struct {
	d     *dump.Dump
	src   *replay.DumpSource
	model *engine.Model // nil when the weights could not be found and not required
}

func (o *rpOpened) Close() {
	if o.d != nil {
		o.d.Close()
	}
}

// openDump opens path with the flags' name map and request and loads the
// model (needModel: a missing weights file is an error): prepared (fast
// kernels, compact weights) unless --reference.
func rpOpenDump(path string, f *replayFlags, needModel bool) (*rpOpened, error) {
	var m *dump.NameMap
	if f.mapFile != "" {
		var err error
		if m, err = dump.LoadNameMap(f.mapFile); err != nil {
			return nil, err
		}
	}
	d, err := dump.OpenMapped(path, m)
	if err != nil {
		return nil, err
	}
	o := &rpOpened{d: d}
	o.src, err = replay.NewDumpSource(d, f.request)
	if err != nil {
		o.Close()
		return nil, err
	}
	o.model, err = replay.LoadModelWith(d, o.src, replay.LoadOptions{Weights: f.weights, Prepared: !f.reference})
	if err != nil {
		if needModel {
			o.Close()
			return nil, err
		}
		o.model = nil
	}
	return o, nil
}

// progress returns a progress callback drawing a bar on stderr when stderr is
// a terminal, else nil.
func rpProgress(stderr io.Writer, label string) func(done, total int) {
	f, ok := stderr.(*os.File)
	if !ok {
		return nil
	}
	fi, err := f.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	return func(done, total int) {
		if total < 8 {
			return
		}
		const w = 30
		n := done * w / total
		fmt.Fprintf(f, "\r%s [%s%s] %d/%d", label, strings.Repeat("#", n), strings.Repeat(" ", w-n), done, total)
		if done == total {
			fmt.Fprint(f, "\r\033[K")
		}
	}
}

// fail prints one error line and returns the error exit code.
func rpFail(stderr io.Writer, cmd string, err error) int {
	msg := strings.TrimPrefix(err.Error(), cmd+": ")
	var pe *rpParseErr
	if errors.As(err, &pe) {
		msg = pe.msg
	}
	fmt.Fprintf(stderr, "sparsemla %s: %s\n", cmd, msg)
	return exitError
}

type rpParseErr struct{ msg string }

func (e *rpParseErr) Error() string { return e.msg }

// newFlagSet returns a flag set that writes its usage to stderr and never
// exits the process.
func rpFlagSet(name, usageLine, doc string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: sparsemla %s\n\n%s\n\nflags:\n", usageLine, doc)
		fs.PrintDefaults()
	}
	return fs
}

// rpArgs parses args (flags before or after the positional arguments) and
// checks that there are exactly npos positional arguments and, when ready is
// not nil, that ready() holds after parsing (the command's required flags).
// When ok is false the command returns code: 0 after --help, 2 otherwise (the
// usage has been printed).
func rpArgs(fs *flag.FlagSet, args []string, npos int, ready func() bool) (pos []string, code int, ok bool) {
	pos, err := rpParseArgs(fs, args)
	if err == flag.ErrHelp {
		return nil, exitOK, false
	}
	if err != nil {
		return nil, exitError, false // the flag package printed the error and the usage
	}
	if len(pos) != npos || (ready != nil && !ready()) {
		fs.Usage()
		return nil, exitError, false
	}
	return pos, exitOK, true
}

// rpParseArgs parses flags placed before or after the positional arguments.
func rpParseArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// exitFor maps a report to the exit code.
func rpExit(r *replay.Report) int {
	switch {
	case r.Diverged():
		return exitDiverged
	case r.Incomplete():
		return exitIncomplete
	}
	return exitOK
}

func rpWrite(stdout io.Writer, r *replay.Report, asJSON bool) error {
	if asJSON {
		return r.WriteJSON(stdout)
	}
	r.WriteText(stdout)
	return nil
}

const replayDoc = `Replays every stage of every layer at every decode step of DUMP through the
CPU reference and names the first stage out of tolerance, with a diagnosis.
DUMP is a native dump (.smd file or directory), a safetensors/npz directory
with a name map (e.g. the official-v4-tiny layout), or any format 'inspect'
reads. The stages run on the prepared fast kernels (weights packed once, the
same bits as the reference loops); --reference runs the plain reference loops.
Exit status: 0 agree (every stage the dump holds at the steps asked for was
compared, none out of tolerance), 1 diverged, 2 error (also: --steps naming a
step the dump does not hold), 3 incomplete (nothing out of tolerance, but some
stage the dump holds could not be compared; the report names them and why).`

func runReplay(args []string, stdout, stderr io.Writer) int {
	var f replayFlags
	fs := rpFlagSet("replay", "replay DUMP [--weights DIR] [--map FILE] [--mode local|propagated] [--tol FILE] [--json] [--reference]", replayDoc, stderr)
	f.register(fs, true)
	pos, code, ok := rpArgs(fs, args, 1, nil)
	if !ok {
		return code
	}
	tol, err := f.tolerance()
	if err != nil {
		return rpFail(stderr, "replay", err)
	}
	o, err := rpOpenDump(pos[0], &f, true)
	if err != nil {
		return rpFail(stderr, "replay", err)
	}
	defer o.Close()
	steps, err := parseSteps(f.steps)
	if err != nil {
		return rpFail(stderr, "replay", err)
	}
	rep, err := replay.Run(context.Background(), o.model, o.src, replay.Options{
		Mode: replay.Mode(f.mode), Tol: tol, Steps: steps, Progress: rpProgress(stderr, "replay"),
	})
	if err != nil {
		return rpFail(stderr, "replay", err)
	}
	if err := rpWrite(stdout, rep, f.json); err != nil {
		return rpFail(stderr, "replay", err)
	}
	return rpExit(rep)
}

// parseSteps parses --steps: "P", "A-B" or a comma list of both; "" is nil
// (every step).
func parseSteps(s string) ([]int64, error) {
	if s == "" {
		return nil, nil
	}
	var out []int64
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.ParseInt(strings.TrimSpace(lo), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("--steps %q: %q is not a step", s, part)
		}
		b := a
		if isRange {
			if b, err = strconv.ParseInt(strings.TrimSpace(hi), 10, 64); err != nil || b < a || b-a > 1<<20 {
				return nil, fmt.Errorf("--steps %q: %q is not a range A-B with A <= B", s, part)
			}
		}
		for p := a; p <= b; p++ {
			out = append(out, p)
		}
	}
	return out, nil
}
