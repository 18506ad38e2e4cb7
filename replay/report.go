package replay

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"

	"sparsemla/attribute"
	"sparsemla/engine"
	"sparsemla/indexer"
)

// SchemaVersion names the JSON schema of Report (docs/replay-json.md). It
// changes only when a field changes meaning or disappears.
const SchemaVersion = "sparsemla.replay/v4"

// Report is the outcome of a replay, diff or bisect: every stage comparison in
// replay order and the first divergence with its diagnosis. Its JSON form is
// the stable --json output.
type Report struct {
	Schema        string        `json:"schema"`
	Command       string        `json:"command"` // replay | diff | bisect
	Dump          string        `json:"dump"`
	Against       string        `json:"against,omitempty"`                    // diff: the second dump
	Mode          string        `json:"mode"`                                 // local | propagated
	Model         string        `json:"model,omitempty"`                      // the model family when not DeepSeek-V4 (e.g. DeepSeek-V4.1), detected from the config
	GPURope       bool          `json:"gpu_rope_table"`                       // RoPE from the GPU's own table
	Kernels       string        `json:"kernels,omitempty"`                    // prepared | reference | mixed (Model.Kernels); empty: no reference ran
	Policy        string        `json:"policy,omitempty"`                     // numerics policy other than engine.PolicyOfficial (e.g. hf-eager)
	TolOverrides  []string      `json:"tolerance_overrides,omitempty"`        // the tolerances the user set over the defaults (Tolerance.Overrides: --tol-stage, --tol), "stage=mode,…"
	TolUnused     []string      `json:"tolerance_overrides_unused,omitempty"` // the stages of TolOverrides that judged nothing here: no result of that stage was compared (unusedOverrides)
	Steps         []int64       `json:"steps"`                                // decode steps in the dump
	Layers        []int         `json:"layers"`
	StepsReplayed int           `json:"steps_replayed"`
	Verdict       string        `json:"verdict"` // agree | diverged | incomplete (VerdictAgree, …)
	Summary       Summary       `json:"summary"`
	Coverage      Coverage      `json:"coverage"`
	First         *Divergence   `json:"first_divergence"`  // null when agree
	Referee       *Referee      `json:"referee,omitempty"` // diff with weights
	Probes        []Probe       `json:"probes,omitempty"`  // bisect: the steps probed, in order
	Scanned       []int64       `json:"scanned,omitempty"` // bisect: the steps replayed after the search (those before the first diverging probe it did not probe)
	Results       []StageResult `json:"stages"`
}

// The verdicts of a report. "agree" is given only when every stage of the
// requested steps and layers that the dump holds (and the reference defines)
// was compared and none was out of tolerance; "incomplete" when none was out
// of tolerance but something the dump holds was not compared
// (Coverage.NotChecked, Coverage.StepsNotChecked say what and why);
// "diverged" when a stage was out of tolerance.
const (
	VerdictAgree      = "agree"
	VerdictDiverged   = "diverged"
	VerdictIncomplete = "incomplete"
)

// Coverage says what a report compared and what it did not. Every stage
// tensor the dump holds at the compared steps and layers (those of no layer,
// tok, pos and logits, included) is accounted for: compared, read as an
// input the replay starts from (Inputs), or not compared (NotChecked, with
// why: an input of the stage unavailable, the reference failing on the
// dumped inputs, the weights given lacking the part of the model that
// computes it, or a tensor the reference does not model). Anything not
// compared makes the report incomplete; the inputs do not.
type Coverage struct {
	Complete bool    `json:"complete"` // NotChecked and StepsNotChecked are empty
	Steps    []int64 `json:"steps"`    // decode steps whose stages were compared
	Layers   []int   `json:"layers"`   // layers compared
	Held     int     `json:"held"`     // stage tensors of those steps and layers the dump holds, with the KV pages and RoPE tables judged: Compared + len(NotChecked) + len(Inputs)
	Compared int     `json:"compared"` // of them, compared (pass, fail or tie)
	// NotChecked lists the held stage tensors that were not compared, in
	// replay order, each with why (an input neither dumped nor computable, a
	// reference computation that failed on the dumped inputs, the weights
	// given lacking the part that computes it: WhyNoBlockWeights,
	// WhyNoHead, …; a tensor the reference does not model:
	// WhyNotModelled).
	NotChecked []NotChecked `json:"not_checked"`
	// Inputs lists the held stage tensors the replay read as its inputs and
	// did not compare (the token and position of each step, each layer's x
	// when the reference runs the attention sub-layer only, the h_in each
	// layer's chain starts from in propagated mode), in replay order, with
	// why; layer -1 is a tensor of no layer (tok, pos). They do not make a
	// report incomplete.
	Inputs []NotChecked `json:"inputs"`
	// StepsNotChecked lists dumped decode steps within the request that were
	// not compared (bisect: the steps it did not probe), with why.
	StepsNotChecked []int64 `json:"steps_not_checked"`
	StepsWhy        string  `json:"steps_why,omitempty"`
	// NotModelled names (sorted) the stage tensors the dump holds at the
	// compared steps and layers that are no stage of the reference's model
	// (each is in NotChecked, with WhyNotModelled).
	NotModelled []string `json:"not_modelled"`
	// Unread says what the dump's files hold that the replay did not read
	// as stage tensors of the steps it replays (unreadOf): the first step
	// of a window without a prefill state (its cache states are the start
	// state, its other tensors are not compared), tensors no name-map rule
	// places at a decode step. They lie outside the steps the verdict is
	// about and do not make a report incomplete; the report names them.
	Unread []Unread `json:"unread,omitempty"`
	// Scope says which part of the model the reference ran, when a replay
	// covers less than the whole step or a model family's tool says it
	// (V4.1: whole step or attention sub-layers only).
	Scope string `json:"scope,omitempty"`
}

// Unread is a number of tensors of the dump's files a replay did not read,
// and why.
type Unread struct {
	Tensors int    `json:"tensors"`
	Why     string `json:"why"`
}

// NotChecked is one held stage tensor that was not compared.
type NotChecked struct {
	Step  int64  `json:"step"`
	Layer int    `json:"layer"`
	Stage string `json:"stage"`
	Why   string `json:"why"`
}

// Summary counts the stage comparisons by status.
type Summary struct {
	Compared int `json:"compared"` // pass + fail + tie
	Pass     int `json:"pass"`
	Fail     int `json:"fail"`
	Tie      int `json:"tie"`
	Missing  int `json:"missing"`
	Skipped  int `json:"skipped"`
}

// StageResult is one stage of one layer at one decode step.
type StageResult struct {
	Step     int64       `json:"step"`
	Layer    int         `json:"layer"`
	Stage    string      `json:"stage"`
	Equation string      `json:"equation,omitempty"`
	Status   string      `json:"status"` // pass | fail | tie | missing | skipped
	Reason   string      `json:"reason,omitempty"`
	Tol      string      `json:"tol,omitempty"` // tolerance mode used
	Shape    []int       `json:"shape"`
	GPUShape []int       `json:"gpu_shape,omitempty"`
	Severity float64     `json:"severity"` // 0 identical, <1 within tolerance, >=1 out (max 2)
	Metrics  *Metrics    `json:"metrics,omitempty"`
	Set      *SetMetrics `json:"set,omitempty"`
	Inputs   []InputInfo `json:"inputs"`
}

// InputInfo says where one input of a stage came from and whether it had been
// checked against the reference.
type InputInfo struct {
	Name   string `json:"name"`
	From   string `json:"from"`   // dump | dump@prev | start-state | reference | propagated
	Status string `json:"status"` // matched | diverged | unchecked
}

// SetMetrics compare a top-k selection as a set.
type SetMetrics struct {
	K        int     `json:"k"`
	Recall   float64 `json:"recall"`
	Jaccard  float64 `json:"jaccard"`
	Missing  []int64 `json:"missing"` // rows the reference selects and the GPU does not
	Extra    []int64 `json:"extra"`   // rows the GPU selects and the reference does not
	KthScore F64     `json:"kth_score"`
	Tied     int     `json:"tied"` // rows whose score equals the k-th score
	Boundary bool    `json:"boundary_tie"`
}

// Divergence is the first out-of-tolerance stage with its diagnosis.
type Divergence struct {
	Step   int64       `json:"step"`
	Layer  int         `json:"layer"`
	Stage  string      `json:"stage"`
	Kind   string      `json:"kind"` // see the Kind* constants
	Why    string      `json:"why"`
	Text   string      `json:"text"` // "first divergence: decode step P, layer L, stage S — kind: why"
	Mode   string      `json:"mode"`
	Inputs []InputInfo `json:"inputs"`
	// Heads / Rows / Blocks name where inside the tensor it differs (leading
	// axis: heads for q/o, cache rows for kv_cache, FQ8 blocks for kv).
	Heads  []int    `json:"heads,omitempty"`
	Rows   []int    `json:"rows,omitempty"`
	Blocks []int    `json:"blocks,omitempty"`
	Detail []string `json:"detail,omitempty"` // further lines for a human
	Hint   string   `json:"hint,omitempty"`   // where to look next
	// Hypothesis is the verdict of the stage's hypotheses (package
	// attribute): which known alternative computation reproduces the GPU's
	// value bit for bit, or the closest one; absent when the stage has none
	// or an input had already diverged.
	Hypothesis *attribute.Verdict `json:"hypothesis,omitempty"`
}

// hints says, per diagnosis kind, where a GPU engineer should look next.
var hints = map[string]string{
	KindAttention:  "check the sparse-attention kernel's split-K combine (LSE merge, sink folded as lse += log2(1 + 2^(σ·log2e − lse))) and the keys it gathers; dump split_bounds/o_split/lse_split to separate a split from the combine",
	KindIndexer:    "check the indexer's top-k (k = min(index_topk, Tc), descending scores, indices offset by 128); ties at the k-th score are legal, other differences are not",
	KindIndexScore: "check the indexer query path (wq_b, RoPE, Hadamard, FQ4) and the per-head ReLU·weight products, each rounded to bf16 before the head sum (spec §6)",
	KindFP8Cache:   "check the KV writer: FQ8 scale = ceil2(f32(max(amax,1e-4)·f32(1/448))) per 64-block, UE8M0 byte = exponent+127, and the page bytes it stores",
	KindCompressor: "check the compressor's state update and emission condition ((p+1) mod r == 0, row j = p div r written before attention at the same step)",
	KindPrefix:     "check the prefix/radix cache: the rows served for the reused prefix belong to another request (a window ring page that is not content-addressed is a known DeepSeek-V4 serving bug)",
	KindUpstream:   "look at the earlier divergence of the input named; this stage only inherited it",
	KindProjection: "check the linear / norm / RoPE kernel of this stage against its equation (FP8 activation quantisation per 128, fp32 accumulation, bf16 out)",
	KindCache:      "check the cache write of this step (window slot p mod W, compressed row 128 + p div r)",
	KindCacheWrite: "check the KV cache writer's slot index: token p goes to window slot p mod W (W = window_size), exactly once per step, before attention reads the cache",
	KindRopeTable:  "check how the GPU builds its cos/sin table: inv_freq in fp32 (not bf16), base rope_theta for window-only layers and compress_rope_theta with YaRN (rope_factor, original_seq_len, beta_fast/slow) for compressed layers (spec §3.6)",
	KindIndexList:  "check the index list given to sparse attention: window ring order oldest to newest, -1 padding at the end, then 128 + selected rows",
}

// Referee is the diff verdict on which of two dumps the reference agrees
// with: the verdict of a replay of each, and which side is right — "a" or
// "b" when that side's replay agrees and the other's diverged, "both" when
// both agree, "neither" when both diverged, else "unknown" (a replay failed,
// or one is incomplete: it did not compare everything its dump holds) —
// with Text, the sentence of the text report. A diff without weights has a
// Referee too: both sides RefereeNotRun, right "unknown", Text saying why.
type Referee struct {
	A     string `json:"a"` // agree | diverged | incomplete | not-run
	B     string `json:"b"`
	Right string `json:"right"` // a | b | neither | both | unknown
	Text  string `json:"text"`
}

// RefereeNotRun is a Referee side whose replay did not run (it failed, or
// there is no referee: no weights).
const RefereeNotRun = "not-run"

// Diagnosis kinds.
const (
	KindAttention  = "attention kernel"
	KindIndexer    = "indexer selection"
	KindIndexScore = "indexer scores"
	KindFP8Cache   = "FP8 cache"
	KindCompressor = "compressor"
	KindPrefix     = "prefix cache"
	KindUpstream   = "upstream"
	KindProjection = "projection"
	KindNonFinite  = "NaN/inf"
	KindCache      = "KV cache"
	KindIndexList  = "index list"
	KindCacheWrite = "cache write"
	KindRopeTable  = "RoPE table"
)

func newReport(dump, mode string, gpuRope bool, steps []int64, layers []int) *Report {
	return &Report{Schema: SchemaVersion, Command: "replay", Dump: dump, Mode: mode, GPURope: gpuRope,
		Steps: append([]int64{}, steps...), Layers: append([]int{}, layers...), Results: []StageResult{},
		Coverage: Coverage{Steps: append([]int64{}, steps...), Layers: append([]int{}, layers...),
			NotChecked: []NotChecked{}, Inputs: []NotChecked{}, StepsNotChecked: []int64{}, NotModelled: []string{}}}
}

// finish fills Summary, Coverage and Verdict from Results (Coverage's steps,
// layers, Inputs, StepsNotChecked and NotModelled are set by the caller).
func (r *Report) finish() {
	c := &r.Coverage
	c.Held, c.Compared, c.NotChecked = 0, 0, []NotChecked{}
	for _, s := range r.Results {
		switch s.Status {
		case StatusPass, StatusFail, StatusTie:
			c.Held++
			c.Compared++
		case StatusSkipped:
			c.Held++
			c.NotChecked = append(c.NotChecked, NotChecked{s.Step, s.Layer, s.Stage, s.Reason})
		}
	}
	if c.StepsNotChecked == nil {
		c.StepsNotChecked = []int64{}
	}
	if c.NotModelled == nil {
		c.NotModelled = []string{}
	}
	if c.Inputs == nil {
		c.Inputs = []NotChecked{}
	}
	c.Held += len(c.Inputs)
	c.Complete = len(c.NotChecked) == 0 && len(c.StepsNotChecked) == 0
	r.Summary = Summary{}
	for _, s := range r.Results {
		switch s.Status {
		case StatusPass:
			r.Summary.Pass++
		case StatusFail:
			r.Summary.Fail++
		case StatusTie:
			r.Summary.Tie++
		case StatusMissing:
			r.Summary.Missing++
		case StatusSkipped:
			r.Summary.Skipped++
		}
	}
	r.Summary.Compared = r.Summary.Pass + r.Summary.Fail + r.Summary.Tie
	r.TolUnused = unusedOverrides(r.TolOverrides, r.Results)
	switch {
	case r.Summary.Fail > 0 || r.First != nil:
		r.Verdict = VerdictDiverged
	case !c.Complete:
		r.Verdict = VerdictIncomplete
	default:
		r.Verdict = VerdictAgree
	}
}

// overridesText is TolOverrides for the report's lines, with the stages
// that judged nothing named (TolUnused).
func (r *Report) overridesText() string {
	t := strings.Join(r.TolOverrides, "; ")
	if len(r.TolUnused) > 0 {
		t += "; " + strings.Join(r.TolUnused, ", ") + ": no such stage compared here, so not applied"
	}
	return t
}

// Diverged reports whether any stage was out of tolerance.
func (r *Report) Diverged() bool { return r.Verdict == VerdictDiverged }

// Incomplete reports whether nothing was out of tolerance but something the
// dump holds was not compared.
func (r *Report) Incomplete() bool { return r.Verdict == VerdictIncomplete }

// VerdictLine is the verdict sentence of the text report and the HTML
// page: the first divergence's text, or what "agree" / "incomplete" rest on
// (and, when the user set tolerances, which).
func (r *Report) VerdictLine() string {
	line := r.verdictLine()
	if r.First == nil && len(r.TolOverrides) > 0 {
		line += " (tolerances overridden: " + r.overridesText() + ")"
	}
	return line
}

func (r *Report) verdictLine() string {
	switch {
	case r.First != nil:
		return r.First.Text
	case r.Verdict == VerdictIncomplete && r.Command == "diff":
		return "incomplete: A and B differ nowhere they were compared, but not everything they hold was compared: " + r.CoverageLine()
	case r.Verdict == VerdictIncomplete:
		return "incomplete: no stage compared was out of tolerance, but not everything the dump holds was compared: " + r.CoverageLine()
	}
	c := r.Coverage
	if r.Command == "diff" {
		// A diff's verdict is about A against B; whether either is right is
		// the referee's line.
		return fmt.Sprintf("agree: A and B agree with each other: %d stage tensors compared, none out of tolerance between them: every stage tensor either dump holds at the %s they share", c.Compared, StepsXLayers(len(c.Steps), len(c.Layers)))
	}
	line := fmt.Sprintf("agree: %d stage tensors compared, none out of tolerance: every stage tensor the dump holds at %s", c.Compared, StepsXLayers(len(c.Steps), len(c.Layers)))
	if r.Command == "bisect" {
		line = fmt.Sprintf("agree: every one of the %d steps replayed (the probes and the scan), %d stage tensors compared, none out of tolerance: every stage tensor the dump holds at %s", r.StepsReplayed, c.Compared, StepsXLayers(len(c.Steps), len(c.Layers)))
	}
	if n := len(c.Inputs); n > 0 {
		line += fmt.Sprintf(" but the %d inputs the replay starts from (%s)", n, strings.Join(groupNames(c.Inputs), ", "))
	}
	return line
}

// CoverageLine says in one line what was not compared and why ("" when the
// coverage is complete): the same words in the text report, the HTML page
// and (tensor by tensor) the JSON.
func (r *Report) CoverageLine() string {
	c := r.Coverage
	if c.Complete {
		return ""
	}
	var parts []string
	if n := len(c.NotChecked); n > 0 {
		gs := groupCoverage(c.NotChecked)
		var ds []string
		for i, g := range gs {
			if i == maxLineGroups {
				ds = append(ds, fmt.Sprintf("and %d more reasons (coverage.not_checked in --json)", len(gs)-i))
				break
			}
			ds = append(ds, g.short())
		}
		holds := "the dump holds"
		if r.Command == "diff" {
			holds = "A or B holds"
		}
		parts = append(parts, fmt.Sprintf("%d of %d stage tensors %s were not compared: %s", n, c.Held, holds, strings.Join(ds, "; ")))
	}
	if n := len(c.StepsNotChecked); n > 0 {
		parts = append(parts, fmt.Sprintf("%d dumped steps were not compared (%s): %s", n, StepList(c.StepsNotChecked), c.StepsWhy))
	}
	return strings.Join(parts, "; ")
}

// CoverageLines are the lines of the text report (and paragraphs of the
// HTML page) that say what the verdict covers: the scope, the inputs read
// and not compared, each reason some held tensors were not compared, the
// steps not compared.
func (r *Report) CoverageLines() []string {
	c := r.Coverage
	var out []string
	if c.Scope != "" {
		out = append(out, "scope: "+c.Scope)
	}
	for _, g := range groupCoverage(c.Inputs) {
		out = append(out, "inputs, read from the dump and not compared: "+g.describeNames()+": "+g.why)
	}
	gs := groupCoverage(c.NotChecked)
	for i, g := range gs {
		if i == maxTextGroups {
			out = append(out, fmt.Sprintf("not compared: %d more reasons (coverage.not_checked in --json lists every tensor)", len(gs)-i))
			break
		}
		out = append(out, "not compared: "+g.describe())
	}
	if n := len(c.StepsNotChecked); n > 0 {
		out = append(out, fmt.Sprintf("not checked: %d dumped steps were not compared (%s): %s", n, StepList(c.StepsNotChecked), c.StepsWhy))
	}
	for _, u := range c.Unread {
		out = append(out, fmt.Sprintf("not read: %d tensors: %s", u.Tensors, u.Why))
	}
	return out
}

// maxLineGroups and maxTextGroups bound the reasons CoverageLine and
// CoverageLines spell out (the JSON lists every tensor); CoverageLines
// names every stage of each reason it gives.
const (
	maxLineGroups = 3
	maxTextGroups = 12
)

// coverageGroup is the held tensors of a report not compared (or read as
// inputs) for one reason: their stage names in order of first appearance,
// with counts, and the first of them.
type coverageGroup struct {
	why   string
	names []string
	count map[string]int
	n     int
	first NotChecked
}

// groupCoverage groups list by reason, in order of first appearance.
func groupCoverage(list []NotChecked) []*coverageGroup {
	var out []*coverageGroup
	by := map[string]*coverageGroup{}
	for _, e := range list {
		g := by[e.Why]
		if g == nil {
			g = &coverageGroup{why: e.Why, count: map[string]int{}, first: e}
			by[e.Why] = g
			out = append(out, g)
		}
		if g.count[e.Stage] == 0 {
			g.names = append(g.names, e.Stage)
		}
		g.count[e.Stage]++
		g.n++
	}
	return out
}

// describe is the group in words: "step P layer L S: why" for one tensor,
// else "S1 (n1), S2 (n2), …: n tensors, first at step P layer L: why".
func (g *coverageGroup) describe() string {
	where := func(e NotChecked) string {
		if e.Layer < 0 {
			return fmt.Sprintf("step %d", e.Step)
		}
		return fmt.Sprintf("step %d layer %d", e.Step, e.Layer)
	}
	if g.n == 1 {
		return fmt.Sprintf("%s %s: %s", where(g.first), g.first.Stage, g.why)
	}
	return fmt.Sprintf("%s: %d tensors, first at %s: %s", g.describeNames(), g.n, where(g.first), g.why)
}

// short is the group in a few words: "step P layer L S: why" for one
// tensor, else "S1, S2, S3, … (n): why".
func (g *coverageGroup) short() string {
	if g.n == 1 {
		return g.describe()
	}
	ns := g.names
	if len(ns) > 3 {
		ns = append(ns[:3:3], "…")
	}
	return fmt.Sprintf("%s (%d): %s", strings.Join(ns, ", "), g.n, g.why)
}

// describeNames is "S1 (n1), S2 (n2), …".
func (g *coverageGroup) describeNames() string {
	var ns []string
	for _, n := range g.names {
		ns = append(ns, fmt.Sprintf("%s (%d)", n, g.count[n]))
	}
	return strings.Join(ns, ", ")
}

// groupNames are the distinct stage names of list, sorted.
func groupNames(list []NotChecked) []string {
	set := map[string]bool{}
	for _, e := range list {
		set[e.Stage] = true
	}
	return sortedNames(set)
}

// WriteJSON writes the report as indented JSON (the --json output).
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// StepsXLayers says how many steps and layers a report covers: "4 steps x 4
// layers", "1 step x 1 layer".
func StepsXLayers(steps, layers int) string {
	noun := func(n int, one string) string {
		if n == 1 {
			return "1 " + one
		}
		return fmt.Sprintf("%d %ss", n, one)
	}
	return noun(steps, "step") + " x " + noun(layers, "layer")
}

// WriteText writes the human summary: the verdict, counts, ties, and the
// first divergence with its diagnosis and the inputs it was computed from.
func (r *Report) WriteText(w io.Writer) {
	s := r.Summary
	what := fmt.Sprintf("%s %s (%s mode)", r.Command, r.Dump, r.Mode)
	if r.Command == "diff" {
		what = fmt.Sprintf("diff %s (A) vs %s (B)", r.Dump, r.Against)
	}
	fmt.Fprintf(w, "%s: %s, %d stages compared: %d pass, %d tie, %d fail; %d not dumped, %d skipped\n",
		what, StepsXLayers(len(r.Steps), len(r.Layers)), s.Compared, s.Pass, s.Tie, s.Fail, s.Missing, s.Skipped)
	r.WriteNotes(w)
	r.WriteVerdict(w)
}

// WriteNotes writes the lines between the text report's summary line and
// its verdict (bisect writes them under its own summary): the model, the
// RoPE table, the numerics policy, the ties, and what the verdict covers
// (CoverageLines), each indented by two spaces.
func (r *Report) WriteNotes(w io.Writer) {
	if r.Model != "" {
		fmt.Fprintf(w, "  model: %s (detected from the dump's config)\n", r.Model)
	}
	if !r.GPURope {
		fmt.Fprintln(w, "  (no GPU RoPE table in the dump: RoPE stages allowed one bf16 ulp)")
	}
	if r.Policy != "" {
		fmt.Fprintf(w, "  numerics policy %s: the reference follows that path's rounding points, not model.py's (explain --policy %s)\n", r.Policy, r.Policy)
	}
	if len(r.TolOverrides) > 0 {
		fmt.Fprintf(w, "  tolerances overridden (--tol-stage, --tol): %s\n", r.overridesText())
	}
	for _, sr := range r.Results {
		if sr.Status == StatusTie {
			fmt.Fprintf(w, "  tie: step %d layer %d %s: %s\n", sr.Step, sr.Layer, sr.Stage, sr.Reason)
		}
	}
	for _, line := range r.CoverageLines() {
		fmt.Fprintln(w, "  "+line)
	}
}

// WriteVerdict writes the verdict: VerdictLine, or the first divergence
// with its details, hint and inputs; then the referee of a diff.
func (r *Report) WriteVerdict(w io.Writer) {
	if r.Referee != nil {
		defer fmt.Fprintln(w, "referee: "+r.Referee.Text)
	}
	if r.First == nil {
		fmt.Fprintln(w, r.VerdictLine())
		return
	}
	d := r.First
	fmt.Fprintln(w, d.Text)
	for _, line := range d.Detail {
		fmt.Fprintln(w, "  "+line)
	}
	if d.Hint != "" {
		fmt.Fprintln(w, "  hint: "+d.Hint)
	}
	if len(d.Inputs) > 0 {
		var parts []string
		for _, in := range d.Inputs {
			parts = append(parts, fmt.Sprintf("%s (%s, %s)", in.Name, in.From, in.Status))
		}
		fmt.Fprintln(w, "  inputs: "+strings.Join(parts, ", "))
	}
}

// judgeSet compares a top-k selection (index_topk, or index_sel = topk+128) as
// a set with indexer.CompareSelection, using the dumped index_score (an input
// of the stage) to recognise boundary ties.
//
// topk_idxs in set mode (propagated replays, where the reference's own
// index_sel orders tied rows by its own rule) is its window part (exact) and
// its compressed part, 128 + index_topk, compared as a set.
func judgeSet(sr *StageResult, ref, gpu engine.Tensor, in map[string]engine.Tensor, window int) {
	if ref.Kind.IsFloat() || gpu.Kind.IsFloat() {
		sr.Status, sr.Severity, sr.Reason = StatusFail, 2, "top-k must be an integer tensor"
		return
	}
	off := int64(0)
	if sr.Stage == "index_sel" {
		off = int64(window)
	}
	if sr.Stage == "topk_idxs" {
		if len(ref.I) < window || len(gpu.I) < window {
			sr.Status, sr.Severity = StatusFail, 2
			sr.Reason = fmt.Sprintf("index list of %d entries, reference %d (window %d)", len(gpu.I), len(ref.I), window)
			return
		}
		for i := 0; i < window; i++ {
			if ref.I[i] != gpu.I[i] {
				sr.Status, sr.Severity = StatusFail, 2
				sr.Reason = fmt.Sprintf("window part differs at entry %d: GPU %d, reference %d", i, gpu.I[i], ref.I[i])
				return
			}
		}
		ref = engine.FromI(ref.Kind, ref.I[window:], len(ref.I)-window)
		gpu = engine.FromI(gpu.Kind, gpu.I[window:], len(gpu.I)-window)
		off = int64(window)
	}
	g := make([]int64, len(gpu.I))
	for i, v := range gpu.I {
		g[i] = v - off
	}
	k := len(ref.I)
	scores, ok := in["index_score"]
	var d indexer.SelectionDiff
	// The scores recognise ties only when they are the scores the
	// selection was made over: at least k of them (a dumped index_score of
	// another length, as a hostile or mismatched dump has, is not).
	if ok && scores.Kind.IsFloat() && k <= len(scores.F) {
		d = indexer.CompareSelection(g, scores.F, k)
	} else {
		// No scores at hand: the reference's own list defines the set, so
		// any difference is a divergence (ties cannot be recognised).
		r := make([]int64, len(ref.I))
		for i, v := range ref.I {
			r[i] = v - off
		}
		d = plainSetDiff(r, g)
	}
	sr.Set = &SetMetrics{K: k, Recall: d.Recall, Jaccard: d.Jaccard, Missing: orEmpty(d.Missing), Extra: orEmpty(d.Extra),
		KthScore: F64(d.Ties.KthScore), Tied: d.Ties.Tied, Boundary: d.Ties.Boundary()}
	switch d.Verdict {
	case indexer.Same:
		sr.Status = StatusPass
	case indexer.Tie:
		sr.Status, sr.Severity = StatusTie, 0.5
		sr.Reason = fmt.Sprintf("GPU chose %v instead of %v among %d rows tied at score %g (k-th place)", d.Extra, d.Missing, d.Ties.Tied, d.Ties.KthScore)
	default:
		sr.Status, sr.Severity, sr.Reason = StatusFail, 1+(1-d.Jaccard), d.Reason
	}
}

func orEmpty(v []int64) []int64 {
	if v == nil {
		return []int64{}
	}
	return v
}

// plainSetDiff compares two selections as sets with no tie information.
func plainSetDiff(ref, gpu []int64) indexer.SelectionDiff {
	d := indexer.SelectionDiff{Ref: ref}
	d.Missing, d.Extra, d.Recall, d.Jaccard = indexer.SetDiff(ref, gpu)
	if len(d.Missing) > 0 || len(d.Extra) > 0 || len(ref) != len(gpu) {
		d.Verdict = indexer.Diverged
		d.Reason = fmt.Sprintf("GPU selected %v not in the reference set, left out %v", d.Extra, d.Missing)
	}
	return d
}

// sortedNames are the keys of m, sorted (an empty map gives an empty,
// non-nil slice).
func sortedNames[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for n := range m {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}
