package main

import (
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"sparsemla/dump"
	"sparsemla/fault"
	"sparsemla/prefixcheck"
	"sparsemla/userfile"
)

const prefixSynthUsage = "synth --prefix SCENARIO --out FILE [--force] [--format events|native] [--requests N] [--seed S] [--page N] [--capacity TOKENS] [--resume-at-end-only] [--fault KIND@N]"

const prefixSynthDoc = `Writes a synthetic multi-request serving run whose prefix-cache decisions a
correct engine made (a radix cache with page size --page, window 8, compress
ratios 0,4,128 and --capacity tokens, LRU), for 'sparsemla prefix' to check.
Scenarios:
  system-prompts  four shared system prompts (one also under a LoRA adapter), unique user turns
  branching       conversations that continue or branch from earlier requests
  eviction        branching under a cache too small for the working set
--format events (default) writes a vLLM KV-cache event stream: a BlockStored
per request that stores a new page, a BlockRemoved for every eviction (as in
vLLM's stream, a request whose hit covers every whole page it has sends no
event, so 'prefix' counts fewer requests; the output names them). --format
native writes a native dump: tok records of every request, a prefix frame per
hit; no namespaces, and no eviction record (its check runs the same LRU with
--capacity). --form is the same as --format.
An existing --out is replaced only if synth --prefix wrote it as a native dump
(its header says so; an event stream carries no mark of its writer); anything
else is refused: remove it, give another path, or --force.
--fault KIND@N inserts one extra request at arrival position N carrying a
decision bug; 'sparsemla prefix' then reports exactly that request:
  hit-too-long         reuses one page more than it shares with its source (native)
  beyond-cache         reuses one token past the last cached page (native)
  resume-beyond-cache  resumes at a page boundary where no state was kept (native, --resume-at-end-only)
  namespace-mix        builds under another LoRA adapter on a default-namespace page (events)
  missed-hit           recomputes cached pages under other hashes (events)
  evicted-page         builds on a page the engine evicted (events, eviction scenario)
  overwritten-page     stores other tokens under a cached page's hash (events)`

func prefixSynthRequested(args []string) bool {
	for _, a := range args {
		if a == "--prefix" || a == "-prefix" || strings.HasPrefix(a, "--prefix=") || strings.HasPrefix(a, "-prefix=") {
			return true
		}
	}
	return false
}

func runPrefixSynth(args []string, stdout, stderr io.Writer) int {
	fs := rpFlagSet("synth", prefixSynthUsage, prefixSynthDoc, stdout, stderr)
	scenario := fs.String("prefix", "", "scenario: "+strings.Join(fault.PrefixScenarios, ", "))
	out := fs.String("out", "", "output file (required; an existing one is replaced only if synth --prefix wrote it as a native dump, or with --force)")
	force := fs.Bool("force", false, forceUsage)
	form := fs.String("format", fault.FormEvents, "events or native")
	fs.StringVar(form, "form", fault.FormEvents, "the same as -format (its earlier name)")
	requests := fs.Int("requests", 24, "requests in the run")
	seed := fs.Uint64("seed", 1, "random seed")
	page := fs.Int("page", 16, "page size in tokens")
	capacity := fs.Int("capacity", 0, "engine cache capacity in tokens (0: unbounded; eviction scenario: 6 requests' worth)")
	atEnd := fs.Bool("resume-at-end-only", false, "the engine keeps compressor state only at request ends")
	faultFlag := fs.String("fault", "", "inject a decision fault, KIND@N (see above)")
	if _, code, ok := rpArgs(fs, args, 0, []string{"out"}); !ok {
		return code
	}
	fail := func(err error) int { return rpFail(stderr, "synth", err) }
	// 0 is no page size and no run (the library reads 0 as its default).
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if given["page"] && *page < 1 {
		return fail(fmt.Errorf("--page %d: a page holds at least 1 token", *page))
	}
	if given["requests"] && *requests < 1 {
		return fail(fmt.Errorf("--requests %d: a run has at least 2 requests", *requests))
	}
	g := &userfile.Guard{}
	if err := g.CheckOutputFile(*out, prefixRunOutput(*force)); err != nil {
		return fail(err)
	}
	if *form != fault.FormEvents && *form != fault.FormNative {
		return fail(fmt.Errorf("--format %q: want events or native", *form))
	}
	s, err := fault.SynthPrefix(fault.PrefixOptions{Scenario: *scenario, Requests: *requests, Seed: *seed, PageSize: *page,
		Capacity: *capacity, NoNamespaces: *form == fault.FormNative, ResumeAtEndOnly: *atEnd})
	if err != nil {
		return fail(err)
	}
	faultID := ""
	if *faultFlag != "" {
		kind, at, ok := strings.Cut(*faultFlag, "@")
		n, err := strconv.Atoi(at)
		if !ok || err != nil {
			return fail(fmt.Errorf("--fault %q: want KIND@N (N an arrival position)", *faultFlag))
		}
		if f, known := fault.PrefixFaultForms[kind]; known && f != *form {
			return fail(fmt.Errorf("--fault %s: expressible in --format %s only", kind, f))
		}
		if faultID, err = s.Inject(kind, n); err != nil {
			return fail(err)
		}
	}
	cfg := s.Config()
	// An event stream shows a request only by its BlockStored event: one
	// that stores no new whole page (its hit covers every whole page it
	// has) sends none, so 'prefix' counts fewer requests than were run.
	var unseen []string
	check := fmt.Sprintf("sparsemla prefix %s --window %d --ratios %s", *out, cfg.Schedule.Window, joinInts(cfg.Schedule.Ratios))
	if *form == fault.FormEvents {
		evs := s.Events()
		for i, b := range evs {
			if n := len(b.Events); n == 0 || b.Events[n-1].Type != "BlockStored" {
				unseen = append(unseen, fmt.Sprintf("%s (batch %d)", s.Requests[i].ID, i))
			}
		}
		data, err := prefixcheck.EncodeEvents(evs, prefixcheck.EncodingMap)
		if err != nil {
			return fail(err)
		}
		// Through a temporary and a rename: a full disk leaves nothing partial.
		if err := g.WriteOutputFile(*out, 0o644, prefixRunOutput(*force), func(w io.Writer) error { _, err := w.Write(data); return err }); err != nil {
			return fail(err)
		}
		if faultID != "" {
			faultID = s.EventID(faultID)
		}
	} else {
		h := dump.Header{ModelArgs: fmt.Sprintf(`{"window_size": %d}`, cfg.Schedule.Window), CompressRatios: cfg.Schedule.Ratios,
			Producer: map[string]string{"engine": prefixRunProducer + *scenario}}
		if err := s.WriteNative(*out, h); err != nil {
			return fail(err)
		}
		check += fmt.Sprintf(" --page %d", cfg.PageSize)
		if cfg.Capacity > 0 {
			check += fmt.Sprintf(" --capacity %d", cfg.Capacity)
		}
	}
	if cfg.ResumeAtEndOnly {
		check += " --resume-at-end-only"
	}
	fmt.Fprintf(stdout, "wrote %s: %s, %d requests, page %d", *out, *scenario, len(s.Requests), cfg.PageSize)
	if cfg.Capacity > 0 {
		fmt.Fprintf(stdout, ", capacity %d tokens", cfg.Capacity)
	}
	if faultID != "" {
		kind, _, _ := strings.Cut(*faultFlag, "@")
		fmt.Fprintf(stdout, "; fault %s in request %s", kind, faultID)
	}
	fmt.Fprintln(stdout)
	if n := len(unseen); n > 0 {
		const maxListed = 5
		list := strings.Join(unseen[:min(n, maxListed)], ", ")
		if n > maxListed {
			list += fmt.Sprintf(" and %d more", n-maxListed)
		}
		verb, obj := "stores", "it"
		if n > 1 {
			verb, obj = "store", "them"
		}
		fmt.Fprintf(stdout, "note: the event stream shows %d of the %d requests: it shows a request only by the BlockStored event of its new pages, and %s %s none (its hit covers every whole page it has), so 'prefix' has no event of %s to check\n",
			len(s.Requests)-n, len(s.Requests), list, verb, obj)
	}
	fmt.Fprintf(stdout, "check: %s\n", check)
	return exitOK
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}
