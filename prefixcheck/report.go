package prefixcheck

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// SchemaVersion names the JSON layout of Report.
const SchemaVersion = "sparsemla.prefix/v1"

// Report is the result of a ground-truth run.
type Report struct {
	Schema  string    `json:"schema"`
	Command string    `json:"command"` // "prefix"
	Input   string    `json:"input"`
	Format  string    `json:"format"`
	Cache   CacheInfo `json:"cache"`
	// Verdict: agree (every request judged, none wrong), diverged (a
	// decision is wrong) or incomplete (none wrong among those judged, but
	// Summary.Unchecked requests could not be judged: no agreement claimed).
	Verdict  string   `json:"verdict"`
	Summary  Summary  `json:"summary"`
	First    *Result  `json:"first_divergence"` // null when agree
	Requests []Result `json:"requests"`         // arrival order
	Notes    []string `json:"notes,omitempty"`
	// TextAll makes WriteText list every request that is not a plain
	// agreement (by default at most 20 of each status, and agreeing misses
	// as counts by cause).
	TextAll bool `json:"-"`
	brief   bool
}

const maxTextLines = 20

// CacheInfo says what the correct cache was and what was compared.
type CacheInfo struct {
	PageSize        int    `json:"page_size"`
	Window          int    `json:"window"`
	Ratios          []int  `json:"compress_ratios"`
	Capacity        int    `json:"capacity_tokens"` // 0: unbounded
	Evictions       string `json:"evictions"`       // "recorded" | "model-lru" | "none"
	Hits            string `json:"hits"`            // "recorded" | "partial"
	ResumeAtEndOnly bool   `json:"resume_at_end_only"`
	Retain          int    `json:"retain_streams"` // 0: all
	Brief           bool   `json:"brief"`          // requests lists only those not plainly agreeing
}

// Summary counts requests by status and tokens reused.
type Summary struct {
	Requests  int `json:"requests"`
	Agree     int `json:"agree"`
	Warn      int `json:"warn"`
	Diverged  int `json:"diverged"`
	Unchecked int `json:"unchecked"`
	// Reused tokens summed over the judged requests.
	RecordedTokens int `json:"recorded_hit_tokens"`
	TruthTokens    int `json:"truth_hit_tokens"`
	// AlignmentLoss: tokens shared with an earlier request that no page
	// boundary could capture (the silent 0 % hit rate of a page too large).
	AlignmentLoss int `json:"alignment_loss_tokens"`
	AlignmentReqs int `json:"alignment_requests"`
	// UnknownEvictions: recorded evictions of pages the correct cache did not
	// hold (an input that starts mid-run, or a cache out of step).
	UnknownEvictions int            `json:"unknown_evictions"`
	Kinds            map[string]int `json:"kinds"` // status:kind → requests
}

// Result is one request's verdict.
type Result struct {
	Index         int        `json:"index"` // arrival order
	ID            string     `json:"id"`
	Namespace     string     `json:"namespace,omitempty"`
	Tokens        int        `json:"tokens"`
	Status        string     `json:"status"`
	Kind          string     `json:"kind,omitempty"`
	Cause         string     `json:"cause,omitempty"` // missed-hit only
	Detail        string     `json:"detail,omitempty"`
	Truth         *HitInfo   `json:"truth"`    // the correct cache's hit (null: not computed)
	Recorded      *HitInfo   `json:"recorded"` // the engine's (null: none recorded)
	FirstDiff     *TokenDiff `json:"first_differing_token,omitempty"`
	AlignmentLoss int        `json:"alignment_loss_tokens,omitempty"`
}

// HitInfo is a prefix hit: the correct cache's (all fields) or the engine's
// (Tokens, Source; Resume when judged).
type HitInfo struct {
	Tokens  int       `json:"tokens"`           // reused tokens [0, Tokens)
	Matched int       `json:"matched"`          // cached page-aligned prefix (≥ Tokens)
	Source  string    `json:"source,omitempty"` // request that cached the last reused page
	Pages   []PageRun `json:"pages,omitempty"`  // which request cached which pages
	Resume  *Resume   `json:"resume,omitempty"`
	Refusal string    `json:"refusal,omitempty"` // why Matched > Tokens
}

// PageRun is pages [From, To) cached by request Source.
type PageRun struct {
	Source string `json:"source"`
	From   int    `json:"from"`
	To     int    `json:"to"`
}

// Resume is the V4 state a resume at At needs (kvcache.Schedule.Needs).
type Resume struct {
	At         int  `json:"at"`
	WindowFrom int  `json:"window_from"` // window rows [WindowFrom, At)
	StateFrom  int  `json:"state_from"`  // compressor state of tokens [StateFrom, At)
	IndexKeys  int  `json:"index_keys"`  // indexer keys needed (ratio-4 layers)
	Halo       bool `json:"ratio4_halo"` // StateFrom includes the previous 4-token group
}

// TokenDiff is the first token where a request and its recorded source differ.
type TokenDiff struct {
	Pos         int   `json:"pos"`
	Token       int64 `json:"token"`
	SourceToken int64 `json:"source_token"`
	SourceEnds  bool  `json:"source_ends,omitempty"` // the source has only Pos tokens
}

func newReport(cfg Config, t Trace) *Report {
	rep := &Report{Schema: SchemaVersion, Command: "prefix", Input: t.Input, Format: t.Format,
		Cache: CacheInfo{PageSize: cfg.PageSize, Window: cfg.Schedule.Window, Ratios: cfg.Schedule.Ratios,
			Capacity: cfg.Capacity, Evictions: "none", Hits: "partial", ResumeAtEndOnly: cfg.ResumeAtEndOnly, Retain: cfg.Retain, Brief: cfg.Brief},
		Requests: []Result{}, Summary: Summary{Kinds: map[string]int{}}, brief: cfg.Brief}
	if rep.Cache.Ratios == nil {
		rep.Cache.Ratios = []int{}
	}
	switch {
	case t.EvictionsRecorded:
		rep.Cache.Evictions = "recorded"
		rep.Cache.Capacity = 0
	case cfg.Capacity > 0:
		rep.Cache.Evictions = "model-lru"
	}
	if t.HitsRecorded {
		rep.Cache.Hits = "recorded"
	}
	return rep
}

func (rep *Report) add(res *Result) {
	s := &rep.Summary
	s.Requests++
	switch res.Status {
	case StatusAgree:
		s.Agree++
	case StatusWarn:
		s.Warn++
	case StatusDiverged:
		s.Diverged++
	case StatusUnchecked:
		s.Unchecked++
	}
	if res.Kind != "" {
		s.Kinds[res.Status+":"+res.Kind]++
	}
	if res.Status != StatusUnchecked {
		if res.Recorded != nil {
			s.RecordedTokens += res.Recorded.Tokens
		}
		if res.Truth != nil {
			s.TruthTokens += res.Truth.Tokens
		}
	}
	if res.AlignmentLoss > 0 {
		s.AlignmentLoss += res.AlignmentLoss
		s.AlignmentReqs++
	}
	if !rep.brief || res.Status != StatusAgree || res.Kind != "" {
		rep.Requests = append(rep.Requests, *res)
	}
}

// Verdicts of a report (Report.Verdict).
const (
	VerdictAgree      = "agree"
	VerdictDiverged   = "diverged"
	VerdictIncomplete = "incomplete"
)

func (rep *Report) finish() {
	rep.Verdict = VerdictAgree
	if rep.Summary.Unchecked > 0 {
		rep.Verdict = VerdictIncomplete // some request could not be judged: no agreement claimed
	}
	for i := range rep.Requests {
		if rep.Requests[i].Status == StatusDiverged {
			rep.Verdict = VerdictDiverged
			rep.First = &rep.Requests[i]
			break
		}
	}
}

// Diverged reports whether any request's decision was wrong.
func (rep *Report) Diverged() bool { return rep.Verdict == VerdictDiverged }

// Incomplete reports whether no judged decision was wrong but some request
// could not be judged.
func (rep *Report) Incomplete() bool { return rep.Verdict == VerdictIncomplete }

// ExitCode is the command's exit status, as replay's: 0 agree (every request
// judged), 1 diverged, 3 incomplete (some request not judged, none wrong);
// 2, an error, is the caller's.
func (rep *Report) ExitCode() int {
	switch {
	case rep.Diverged():
		return 1
	case rep.Incomplete():
		return 3
	}
	return 0
}

// WriteJSON writes the report as indented JSON.
func (rep *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// Text describes the hit in words: tokens, source, pages by source, resume
// point ("nothing recorded" for a nil hit).
func (h *HitInfo) Text() string { return h.describe(0) }

func (h *HitInfo) describe(P int) string {
	if h == nil {
		return "nothing recorded"
	}
	if h.Tokens == 0 {
		return "no hit"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "tokens 0..%d", h.Tokens-1)
	if h.Source != "" {
		fmt.Fprintf(&b, " from %q", h.Source)
	}
	if len(h.Pages) > 0 {
		var runs []string
		for _, p := range h.Pages {
			runs = append(runs, fmt.Sprintf("[%d, %d) of %q", p.From, p.To, p.Source))
		}
		fmt.Fprintf(&b, " (pages %s)", strings.Join(runs, ", "))
	}
	if r := h.Resume; r != nil {
		fmt.Fprintf(&b, ", resume at %d: window rows [%d, %d), compressor state from %d", r.At, r.WindowFrom, r.At, r.StateFrom)
		if r.Halo {
			b.WriteString(" (with the ratio-4 halo)")
		}
	}
	return b.String()
}

// WriteText writes the human summary: verdict and counts, then every request
// that is not a plain agreement, truth next to the engine's record.
func (rep *Report) WriteText(w io.Writer) {
	s, c := rep.Summary, rep.Cache
	fmt.Fprintf(w, "prefix %s (%s): %s: %s: %d agree, %d warn, %d diverged, %d unchecked\n",
		rep.Input, rep.Format, rep.Verdict, plural(s.Requests, "request"), s.Agree, s.Warn, s.Diverged, s.Unchecked)
	capa := "unbounded"
	switch c.Evictions {
	case "recorded":
		capa = "follows the engine's recorded evictions"
	case "model-lru":
		capa = fmt.Sprintf("%d tokens, LRU (the input records no evictions)", c.Capacity)
	}
	fmt.Fprintf(w, "  correct cache: page %d, window %d, ratios %v, capacity %s; hits %s\n", c.PageSize, c.Window, c.Ratios, capa, c.Hits)
	fmt.Fprintf(w, "  reused tokens: engine %d, correct cache %d", s.RecordedTokens, s.TruthTokens)
	if s.AlignmentLoss > 0 {
		fmt.Fprintf(w, "; %d shared tokens in %s fall inside a page (alignment)", s.AlignmentLoss, plural(s.AlignmentReqs, "request"))
	}
	fmt.Fprintln(w)
	if rep.Incomplete() {
		what := fmt.Sprintf("%d of the %d requests could not be judged", s.Unchecked, s.Requests)
		switch {
		case s.Requests == 1:
			what = "the one request could not be judged"
		case s.Unchecked == s.Requests:
			what = fmt.Sprintf("none of the %d requests could be judged", s.Requests)
		}
		fmt.Fprintf(w, "  incomplete: %s (listed below as unchecked, with the reason); agree needs every request judged\n", what)
	}
	// Diverged, warn and unchecked requests (at most maxTextLines of each
	// unless TextAll), then the causes of agreeing misses as counts.
	shown := map[string]int{}
	causes := map[string]int{}
	for _, r := range rep.Requests {
		if r.Status == StatusAgree {
			if r.Kind != "" && !rep.TextAll {
				causes[r.Cause]++
				continue
			}
			if r.Kind == "" {
				continue
			}
		}
		if shown[r.Status]++; shown[r.Status] > maxTextLines && !rep.TextAll {
			continue
		}
		what := r.Detail
		if r.Kind != "" {
			kind := r.Kind
			if r.Cause != "" {
				kind += " (" + r.Cause + ")"
			}
			what = kind + ": " + r.Detail
		}
		fmt.Fprintf(w, "  %s: request %q (#%d): %s\n", r.Status, r.ID, r.Index, what)
		if r.Status != StatusUnchecked {
			fmt.Fprintf(w, "      correct cache: %s\n      engine:        %s\n", r.Truth.describe(c.PageSize), r.Recorded.describe(c.PageSize))
		}
	}
	for _, st := range []string{StatusDiverged, StatusWarn, StatusUnchecked} {
		if n := shown[st] - maxTextLines; n > 0 && !rep.TextAll {
			fmt.Fprintf(w, "  (%d more %s requests; --json or --all lists them)\n", n, st)
		}
	}
	if len(causes) > 0 {
		var parts []string
		for _, cause := range []string{CauseAlignment, CauseEviction, CauseNamespace, CauseResume} {
			if causes[cause] > 0 {
				parts = append(parts, fmt.Sprintf("%d %s", causes[cause], cause))
			}
		}
		fmt.Fprintf(w, "  agreeing misses (the correct cache misses too): %s (--json or --all lists them)\n", strings.Join(parts, ", "))
	}
	for _, n := range rep.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
	if rep.First != nil {
		f := rep.First
		fmt.Fprintf(w, "first divergence: request %q (#%d): %s: %s\n", f.ID, f.Index, f.Kind, f.Detail)
	}
}
