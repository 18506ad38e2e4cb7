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
	"sparsemla/userfile"
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
	policy    string
}

// Usage-line parts of the flags replayFlags registers (register): the mode
// and steps (withMode), then those every command that replays takes.
const (
	rpModeUsage   = "[--mode local|propagated|chained] [--steps LIST]"
	rpCommonUsage = "[--weights FILE|DIR] [--map FILE|NAME] [--request ID] [--policy official|hf-eager] [--tol FILE] [--tol-stage SPEC]... [--json] [--reference]"
)

// referenceUsage documents --reference (every command that runs the reference).
const referenceUsage = "run the plain reference loops (weights kept with their fp32 dequantisations) instead of the prepared fast kernels on compact weights, the default; both give the same bits, the report's JSON field 'kernels' names the one that ran"

type rpMultiFlag []string

func (m *rpMultiFlag) String() string     { return strings.Join(*m, " ") }
func (m *rpMultiFlag) Set(s string) error { *m = append(*m, s); return nil }

func (f *replayFlags) register(fs *flag.FlagSet, withMode bool) {
	fs.StringVar(&f.weights, "weights", "", "weights: a safetensors file or a directory with weights.safetensors (default: beside the dump)")
	fs.StringVar(&f.mapFile, "map", "", "name map for non-native dumps: a JSON file or a built-in name (default: detected)")
	if withMode {
		fs.StringVar(&f.mode, "mode", "local", "local (teacher-forced: each stage from the dump's own inputs), propagated (the reference's own chain from each layer's x, or h_in with the whole layer's weights) or chained (the whole model: layer 0 from the token, each layer from the chain's h_out below, up to the logits)")
		fs.StringVar(&f.steps, "steps", "", "replay only these decode steps: P, A-B or a comma list of both (default: all)")
	}
	fs.StringVar(&f.tolFile, "tol", "", "JSON file overriding stage tolerances (docs/replay-json.md)")
	fs.Var(&f.tolStage, "tol-stage", "override one stage's tolerance, e.g. 'o=close,abs=2e-3,rel=0.02,cos=1e-5' or 'u=ulp,max_ulp=3' (repeatable)")
	fs.StringVar(&f.request, "request", "", "request to replay when the dump holds several (default: the first)")
	fs.BoolVar(&f.json, "json", false, "write the report as JSON (schema "+replay.SchemaVersion+")")
	fs.BoolVar(&f.reference, "reference", false, referenceUsage)
	fs.StringVar(&f.policy, "policy", "", "numerics policy: official (model.py, the dump's checkpoint dtype) or hf-eager (transformers' eager bf16 path); default: the dump header's dtype_policy, else official")
}

// tolerance builds the policy: defaults, then --tol, then --tol-stage.
func (f *replayFlags) tolerance() (*replay.Tolerance, error) {
	t := replay.DefaultTolerance()
	switch f.mode {
	case string(replay.Propagated):
		t = replay.PropagatedTolerance()
	case string(replay.Chained):
		t = replay.ChainedTolerance()
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
		t.Override(name, st)
	}
	return t, nil
}

// rpOpened is a dump ready to replay.
type rpOpened struct {
	d     *dump.Dump
	src   *replay.DumpSource
	model *engine.Model // nil when the weights could not be loaded and were not required
	// modelErr says why model is nil (modelIfFound): no weights beside the
	// dump (replay.NoWeightsError) or weights there that cannot be used.
	modelErr error
}

func (o *rpOpened) Close() {
	if o.d != nil {
		o.d.Close()
	}
}

// rpModelNeed says what rpOpenDump does with a dump's weights.
type rpModelNeed int

const (
	modelRequired rpModelNeed = iota // loaded; none found is an error
	modelIfFound                     // loaded; weights given (--weights), or a --policy, that cannot be loaded are an error, else no model (modelErr says why)
	modelNone                        // not loaded (diff's B: the referee replays A's inputs)
)

// rpOpenDump opens path with the flags' name map and request and loads the
// model as need says: prepared (fast kernels, compact weights) unless
// --reference.
func rpOpenDump(path string, f *replayFlags, need rpModelNeed) (*rpOpened, error) {
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
	if need == modelNone {
		return o, nil
	}
	o.model, err = replay.LoadModelWith(d, o.src, replay.LoadOptions{Weights: f.weights, Prepared: !f.reference, Policy: f.policy})
	if err != nil {
		if need == modelRequired || f.weights != "" || f.policy != "" {
			o.Close()
			return nil, err
		}
		o.model, o.modelErr = nil, err
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
	msg := strings.TrimPrefix(errLine(err), cmd+": ")
	var pe *rpParseErr
	if errors.As(err, &pe) {
		msg = userfile.Escape(pe.msg)
	}
	fmt.Fprintf(stderr, "sparsemla %s: %s\n", cmd, msg)
	return exitError
}

// errLine is err as exactly one line: errors joined with errors.Join (at
// any depth of %w wrapping) are joined with "; ", and every control
// character left (a newline or an escape code in a file name or a value)
// is escaped (userfile.Escape), so that no input can forge a line or
// colour the terminal.
func errLine(err error) string {
	return userfile.Escape(joinedText(err))
}

// joinedText is err.Error() with the parts of an errors.Join joined by "; "
// instead of newlines. A wrapper's own text around a joined error is kept:
// the wrapper's message is split at the joined error's text.
func joinedText(err error) string {
	switch u := err.(type) {
	case interface{ Unwrap() []error }:
		var parts []string
		for _, e := range u.Unwrap() {
			if e != nil {
				parts = append(parts, joinedText(e))
			}
		}
		if err.Error() == joinedRaw(u.Unwrap()) { // errors.Join, not fmt.Errorf with several %w
			return strings.Join(parts, "; ")
		}
	case interface{ Unwrap() error }:
		inner := u.Unwrap()
		if inner != nil {
			msg, in := err.Error(), inner.Error()
			if i := strings.LastIndex(msg, in); i >= 0 && strings.Contains(in, "\n") {
				return msg[:i] + joinedText(inner) + msg[i+len(in):]
			}
		}
	}
	return err.Error()
}

// joinedRaw is what errors.Join prints for errs.
func joinedRaw(errs []error) string {
	var parts []string
	for _, e := range errs {
		if e != nil {
			parts = append(parts, e.Error())
		}
	}
	return strings.Join(parts, "\n")
}

type rpParseErr struct{ msg string }

func (e *rpParseErr) Error() string { return e.msg }

// rpFlagSet returns a flag set that never exits the process: errors go to
// stderr (one line, rpUsageError), the help --help asks for goes to stdout
// (rpHelp: the usage line, doc, then the flags).
func rpFlagSet(name, usageLine, doc string, stdout, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { rpHelp(stdout, fs, "usage: sparsemla "+usageLine+"\n\n"+doc+"\n\nflags:\n") }
	return fs
}

// rpHelp writes head, then every flag of fs as flag.PrintDefaults does,
// to w (stdout: help that was asked for is output, not an error), except
// that a flag whose usage already says its default ("(default: ...)") is
// not followed by the flag package's "(default -1)" too.
func rpHelp(w io.Writer, fs *flag.FlagSet, head string) {
	fmt.Fprint(w, head)
	fs.VisitAll(func(f *flag.Flag) {
		var b strings.Builder
		fmt.Fprintf(&b, "  -%s", f.Name)
		name, usage := flag.UnquoteUsage(f)
		if len(name) > 0 {
			b.WriteString(" " + name)
		}
		if b.Len() <= 4 {
			b.WriteString("\t")
		} else {
			b.WriteString("\n    \t")
		}
		b.WriteString(strings.ReplaceAll(usage, "\n", "\n    \t"))
		zero := f.DefValue == "" || f.DefValue == "0" || f.DefValue == "false"
		if !zero && !strings.Contains(usage, "(default") {
			if fmt.Sprintf("%T", f.Value) == "*flag.stringValue" {
				fmt.Fprintf(&b, " (default %q)", f.DefValue)
			} else {
				fmt.Fprintf(&b, " (default %v)", f.DefValue)
			}
		}
		fmt.Fprintln(w, b.String())
	})
}

// rpArgs parses args (flags before or after the positional arguments) and
// checks that there are exactly npos positional arguments and that every flag
// named in required was given a value (the command's required flags; an
// error names the first one missing).
// When ok is false the command returns code: 0 after --help (the usage has
// been printed), 2 otherwise (one error line has been printed).
func rpArgs(fs *flag.FlagSet, args []string, npos int, required []string) (pos []string, code int, ok bool) {
	pos, err := rpParseArgs(fs, args)
	if err == flag.ErrHelp {
		return nil, exitOK, false
	}
	if err != nil {
		return nil, exitError, false // rpParseArgs printed the error line
	}
	if len(pos) != npos {
		rpUsageError(fs, fmt.Sprintf("want %d argument(s), got %d", npos, len(pos)))
		return nil, exitError, false
	}
	for _, name := range required {
		if f := fs.Lookup(name); f != nil && f.Value.String() == "" {
			rpUsageError(fs, "--"+name+" is required")
			return nil, exitError, false
		}
	}
	return pos, exitOK, true
}

// rpUsageError prints one error line about the command line of fs.
func rpUsageError(fs *flag.FlagSet, msg string) {
	help := fs.Name()
	if help == "synth" && fs.Lookup("prefix") != nil {
		help = "synth --prefix x" // the prefix-cache run has its own flags and help
	}
	fmt.Fprintf(fs.Output(), "sparsemla %s: %s (see 'sparsemla %s --help')\n", fs.Name(), userfile.Escape(msg), help)
}

// rpParseArgs parses flags placed before or after the positional arguments.
// A bad flag is one error line on fs's output (not the flag package's
// error and usage); --help prints the usage and returns flag.ErrHelp.
func rpParseArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	usage, out := fs.Usage, fs.Output()
	fs.Usage = func() {}
	fs.SetOutput(io.Discard)
	defer func() { fs.Usage = usage; fs.SetOutput(out) }()
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			fs.Usage = usage
			fs.SetOutput(out)
			if err == flag.ErrHelp {
				usage()
			} else {
				rpUsageError(fs, err.Error())
			}
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
with a name map (e.g. the official-v4-tiny layout), any format 'inspect'
reads, or a DeepSeek-V4.1 directory in the official V4.1 layout (detected from
its config.json; testdata/v41-tiny, docs/v41.md). The stages run on the prepared fast kernels (weights packed once, the
same bits as the reference loops); --reference runs the plain reference loops.
Exit status: 0 agree (every tensor the dump holds at the steps asked for was
compared, none out of tolerance, but the inputs the replay starts from, which
the report names: the token and position, x with attention-only weights, the
h_in of each layer's propagated chain), 1 diverged, 2 error (also: --steps
naming a step the dump does not hold), 3 incomplete (nothing out of tolerance,
but some tensor the dump holds was not compared: an input missing, the weights
given lacking the part that computes it, or a tensor the reference does not
model; the report names each and why).`

func runReplay(args []string, stdout, stderr io.Writer) int {
	var f replayFlags
	fs := rpFlagSet("replay", "replay DUMP "+rpModeUsage+" "+rpCommonUsage, replayDoc, stdout, stderr)
	f.register(fs, true)
	pos, code, ok := rpArgs(fs, args, 1, nil)
	if !ok {
		return code
	}
	if replay.IsV41(pos[0]) {
		return runReplayV41(pos[0], &f, stdout, stderr)
	}
	tol, err := f.tolerance()
	if err != nil {
		return rpFail(stderr, "replay", err)
	}
	o, err := rpOpenDump(pos[0], &f, modelRequired)
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

// Limits of --steps: a decode position is below maxStepValue (2^31, far
// past any max_seq_len), and one command line names at most maxSteps steps.
const (
	maxStepValue = 1 << 31
	maxSteps     = 1 << 21
)

// parseSteps parses --steps: "P", "A-B" or a comma list of both; "" is nil
// (every step). Every step is in 0 … maxStepValue−1 and the list names at
// most maxSteps steps (counting repeats), so that no flag can make the loop
// wrap or the list take gigabytes.
func parseSteps(s string) ([]int64, error) {
	if s == "" {
		return nil, nil
	}
	var out []int64
	step := func(part, tok string) (int64, error) {
		v, err := strconv.ParseInt(strings.TrimSpace(tok), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("--steps %q: %q is not a step", s, part)
		}
		if v < 0 || v >= maxStepValue {
			return 0, fmt.Errorf("--steps %q: step %d is out of range (0 … %d)", s, v, maxStepValue-1)
		}
		return v, nil
	}
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := step(part, lo)
		if err != nil {
			return nil, err
		}
		b := a
		if isRange {
			if b, err = step(part, hi); err != nil {
				return nil, err
			}
			if b < a {
				return nil, fmt.Errorf("--steps %q: %q is not a range A-B with A <= B", s, part)
			}
		}
		if b-a+1 > int64(maxSteps-len(out)) {
			return nil, fmt.Errorf("--steps %q: names more than %d steps", s, maxSteps)
		}
		for p := a; p <= b; p++ {
			out = append(out, p)
		}
	}
	return out, nil
}
