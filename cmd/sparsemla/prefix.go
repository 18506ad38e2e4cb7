package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/htmlreport"
	"sparsemla/prefixcheck"
	"sparsemla/userfile"
)

func init() {
	register(&command{
		name:    "prefix",
		summary: "check a run's prefix-cache decisions against a correct radix cache (dump or vLLM/SGLang KV events)",
		run:     runPrefix,
	})
}

const prefixUsage = "prefix INPUT [--page N] [--config NAME|FILE] [--window N] [--ratios R,R,...] [--capacity TOKENS] [--resume-at-end-only] [--retain N] [--brief] [--json] [--all] [--html OUT] [--force] [--events] [--medium NAME] [--group N] [--component NAME] [--dp-rank N] [--hash-scheme auto|chained|per-page] [--map FILE|NAME]"

const prefixDoc = `Runs a radix prefix cache with the engine's page size, sliding window and
compress ratios over the run's requests in arrival order and sets, for every
request, the hit the correct cache would have served (tokens, source request,
pages, the V4 resume point with the ratio-4 halo and the window) next to the
hit the engine recorded. Verdicts: hit-too-long (names the first differing
token), namespace-mix, overwritten-page, evicted-page, beyond-cache,
resume-beyond-cache, missed-hit (with its cause: none, alignment, eviction,
namespace, resume).

INPUT is either
  - a dump (native .smd file or directory, safetensors, npz, ...): token streams
    from the tok records, hits from prefix frames (or the sparsemla.prefix
    metadata of foreign dumps); dumps record no evictions: give --capacity to
    let the correct cache evict by LRU, or leave it unbounded;
  - a KV-cache event stream (EventBatch msgpack payloads one after another, as
    vLLM's or SGLang's ZMQ publisher sends them; --events forces this reading):
    every BlockStored is a request whose hit is its parent chain; BlockRemoved
    and AllBlocksCleared are the engine's evictions, which the correct cache
    follows.

--page defaults to the input's (the events' block_size, a dump's page records);
the window and ratios come from --window and --ratios, else --config (a preset:
tiny, flash, pro, or a ModelArgs JSON file), else a dump's header (model args
window_size, compress_ratios); an event stream says neither. --medium keeps events of one medium (default GPU), --group
those of one KV-cache group (default: the first full- or MLA-attention group,
else the first seen), --component those of one SGLang KV-cache component
(its component_type: full, swa, mamba, c128, ...; default full, else the first
seen; each component is a cache of its own), --dp-rank those of one data-parallel rank (each rank has
its own cache; required when the stream mixes ranks). A --medium, --group or
--component that no event of the stream has is refused (exit 2), not
ignored: a stream that names no medium is the GPU cache's (--medium GPU is
kept), one that names no group is one group (--group 0 is kept). These
flags and --hash-scheme apply to event streams only, --map to dumps only;
given with the other kind of input they are refused. --hash-scheme says what
a block hash names: chained (the whole prefix: vLLM, SGLang since its PR
#13488), per-page (one page's tokens alone, Python's hash(tuple(page)):
SGLang before), or auto (default: per-page only when every stored hash is
that hash of its tokens). --retain N keeps the
token streams of the last N requests only (older sources are compared page by
page). --brief lists only the requests that are not plain agreements (JSON);
the text lists at most 20 requests of each status unless --all. --html OUT
also writes a self-contained HTML page (an existing OUT is replaced only if it
is a page sparsemla wrote, else refused: remove it, give another path, or
--force; never an input).

Exit status: 0 agree (every request judged, every decision the correct
cache's; warn requests, which the input cannot prove wrong, included), 1
diverged (a decision is wrong), 2 error (bad input), 3 incomplete (no judged
decision is wrong, but some request could not be judged: its tokens, its hit
or its place in the cache is not recorded; the report says how many, and
lists each as unchecked with the reason).`

const maxEventStream = 4 << 30

func runPrefix(args []string, stdout, stderr io.Writer) int {
	fs := rpFlagSet("prefix", prefixUsage, prefixDoc, stdout, stderr)
	page := fs.Int("page", 0, "page size in tokens (default: the input's)")
	model := fs.String("config", "", "window and ratios of a model: a preset (tiny, flash, pro, v41-tiny, v41-flash) or a ModelArgs JSON file (DeepSeek-V4.1: its KV sources' ratios and index keys)")
	window := fs.Int("window", -1, "sliding window (default: the dump header's, else 0)")
	ratios := fs.String("ratios", "", "per-layer compress ratios, comma separated (default: the dump header's)")
	capacity := fs.Int("capacity", 0, "correct cache capacity in tokens when the input records no evictions (0: unbounded)")
	atEnd := fs.Bool("resume-at-end-only", false, "the cache keeps compressor state only at request ends")
	retain := fs.Int("retain", 0, "keep the token streams of the last N requests (0: all)")
	brief := fs.Bool("brief", false, "list only requests that are not plain agreements")
	asJSON := fs.Bool("json", false, "write the JSON report (docs/prefix-json.md)")
	htmlOut := fs.String("html", "", "also write a self-contained HTML page to this file (an existing one is replaced only if it is a page sparsemla wrote, or with --force)")
	force := fs.Bool("force", false, forceUsage)
	all := fs.Bool("all", false, "text: list every request that is not a plain agreement (default: 20 of each status)")
	events := fs.Bool("events", false, "read INPUT as a KV-cache event stream")
	medium := fs.String("medium", "", "event medium to keep (default GPU)")
	group := fs.Int64("group", -1, "KV-cache group to keep (default: the first full-attention group, else the first seen)")
	component := fs.String("component", "", "SGLang KV-cache component to keep (default: full, else the first seen)")
	dpRank := fs.Int64("dp-rank", -1, "data-parallel rank to keep (default: the stream's only rank; required when it mixes ranks)")
	hashScheme := fs.String("hash-scheme", prefixcheck.HashAuto, "what a block hash names: auto, chained (the whole prefix, vLLM) or per-page (one page's tokens, SGLang before PR #13488)")
	mapFlag := fs.String("map", "", "name map for a foreign dump (file or built-in name)")
	pos, code, ok := rpArgs(fs, args, 1, nil)
	if !ok {
		return code
	}
	// A value out of range is an error, not the default: --page 0 is no
	// page size, --window -3 no window.
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, c := range []struct {
		name   string
		v, min int64
		what   string
	}{
		{"page", int64(*page), 1, "a page holds at least 1 token"},
		{"window", int64(*window), 0, "a window is 0 or more tokens"},
		{"capacity", int64(*capacity), 0, "0 (unbounded) or a number of tokens"},
		{"retain", int64(*retain), 0, "0 (all) or a number of requests"},
		{"group", *group, 0, "a KV-cache group index is 0 or more"},
		{"dp-rank", *dpRank, 0, "a data-parallel rank is 0 or more"},
	} {
		if given[c.name] && c.v < c.min {
			rpUsageError(fs, fmt.Sprintf("--%s %d: %s", c.name, c.v, c.what))
			return exitError
		}
	}
	fail := func(err error) int { return rpFail(stderr, "prefix", err) }
	in := pos[0]
	// The page: refused before the run when it would replace an input or a
	// file sparsemla did not write (output.go).
	var guard *userfile.Guard
	if *htmlOut != "" {
		var err error
		if guard, err = userfile.NewGuard(in, *mapFlag, *model); err != nil {
			return fail(err)
		}
		if err := guard.CheckOutputFile(*htmlOut, htmlOutput(*force)); err != nil {
			return fail(err)
		}
	}
	var tr *prefixcheck.Trace
	var cfg prefixcheck.Config
	stream := *events || isEventStream(in)
	// a flag of the other kind of input is refused, not ignored
	for _, name := range []string{"map", "medium", "group", "component", "dp-rank", "hash-scheme"} {
		if !given[name] {
			continue
		}
		if stream && name == "map" {
			return fail(fmt.Errorf("--map names the tensors of a foreign dump; %s is read as a KV-cache event stream: leave --map out", in))
		}
		if !stream && name != "map" {
			return fail(fmt.Errorf("--%s selects events of a KV-cache event stream; %s is read as a dump (--events reads it as a stream): leave --%s out", name, in, name))
		}
	}
	if stream {
		f, _, err := userfile.Open(in) // a regular file: a FIFO or device is refused at once
		if err != nil {
			return fail(err)
		}
		b, err := prefixcheck.ReadEvents(f, in, maxEventStream)
		f.Close()
		if err != nil {
			return fail(err)
		}
		if err := eventFilterError(b, in, *component, *medium, *group); err != nil {
			return fail(err)
		}
		opt := prefixcheck.EventsOptions{Medium: *medium, Component: *component, HashScheme: *hashScheme}
		if *group >= 0 {
			opt.Group = group
		}
		if *dpRank >= 0 {
			opt.DPRank = dpRank
		}
		if tr, err = prefixcheck.EventsTrace(b, in, opt); err != nil {
			return fail(err)
		}
		cfg.PageSize = tr.PageSize
	} else {
		var m *dump.NameMap
		if *mapFlag != "" {
			var err error
			if m, err = dump.LoadNameMap(*mapFlag); err != nil {
				return fail(err)
			}
		}
		d, err := dump.OpenMapped(in, m)
		if err != nil {
			return fail(err)
		}
		defer d.Close()
		if tr, err = prefixcheck.FromDump(d); err != nil {
			return fail(err)
		}
		if cfg, err = prefixcheck.ConfigFromDump(d); err != nil {
			return fail(err)
		}
		if mc, err := engine.ParseConfig([]byte(d.Header.ModelArgs)); err == nil && mc.IsV41() {
			setV41PrefixSchedule(&cfg, mc)
		}
	}
	if *page > 0 {
		cfg.PageSize = *page
		if tr.PageSize != 0 && tr.PageSize != *page {
			return fail(fmt.Errorf("--page %d, but %s records block size %d", *page, in, tr.PageSize))
		}
	}
	if cfg.PageSize == 0 {
		return fail(fmt.Errorf("%s does not say its page size: give --page", in))
	}
	if *model != "" {
		mc, err := engine.Preset(*model)
		if err != nil {
			if _, statErr := os.Stat(*model); statErr != nil {
				return fail(err)
			}
			if mc, err = engine.LoadConfig(*model); err != nil {
				return fail(err)
			}
		}
		if mc.IsV41() {
			setV41PrefixSchedule(&cfg, mc)
		} else {
			cfg.SetSchedule(mc.WindowSize, mc.CompressRatios)
		}
	}
	if *window >= 0 {
		cfg.Schedule.Window = *window
	}
	if *ratios != "" {
		var rs []int
		for _, f := range strings.Split(*ratios, ",") {
			r, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || (r != 0 && r != 4 && r != 128) {
				return fail(fmt.Errorf("--ratios %q: each ratio is 0, 4 or 128", *ratios))
			}
			rs = append(rs, r)
		}
		cfg.SetSchedule(cfg.Schedule.Window, rs)
	}
	if *capacity > 0 && tr.EvictionsRecorded {
		return fail(fmt.Errorf("--capacity: %s records the engine's evictions, which the correct cache follows", in))
	}
	cfg.Capacity, cfg.ResumeAtEndOnly, cfg.Retain, cfg.Brief = *capacity, *atEnd, *retain, *brief
	rep, err := prefixcheck.Run(tr, cfg)
	if err != nil {
		return fail(err)
	}
	if *htmlOut != "" {
		// Through a temporary and a rename: an error leaves nothing partial.
		if err := guard.WriteOutputFile(*htmlOut, 0o644, htmlOutput(*force), func(w io.Writer) error { return htmlreport.WritePrefix(w, rep) }); err != nil {
			return fail(err)
		}
	}
	if *asJSON {
		if err := rep.WriteJSON(stdout); err != nil {
			return fail(err)
		}
	} else {
		rep.TextAll = *all
		rep.WriteText(stdout)
	}
	switch {
	case rep.Diverged():
		return exitDiverged
	case rep.Incomplete():
		return exitIncomplete
	}
	return exitOK
}

// eventFilterError refuses a --component, --medium or --group (group < 0:
// not given) that the stream cannot honour: one its events do not name at
// all, or a value none of them has. Read whole, the stream would be judged
// as if it were that component's, tier's or group's cache, which it is not;
// filtered to nothing, a verdict would judge none of it. --medium GPU is
// kept on a stream that names no medium, and --group 0 on one that names no
// group: such events are the GPU cache's, of its one group.
func eventFilterError(batches []prefixcheck.EventBatch, in, component, medium string, group int64) error {
	components, media, groups := map[string]bool{}, map[string]bool{}, map[int64]bool{}
	for _, b := range batches {
		for _, ev := range b.Events {
			if ev.Component != "" {
				components[ev.Component] = true
			}
			if ev.Medium != "" {
				media[ev.Medium] = true
			}
			if ev.GroupIdx != nil && ev.Type != "AllBlocksCleared" {
				groups[*ev.GroupIdx] = true
			}
		}
	}
	quoted := func(set map[string]bool) string {
		var names []string
		for n := range set {
			names = append(names, userfile.Quote(n))
		}
		slices.Sort(names)
		return strings.Join(names, ", ")
	}
	switch {
	case component != "" && len(components) == 0:
		return fmt.Errorf("--component %s: no event of %s names a KV-cache component (the stream is of one cache, as vLLM's and SGLang's before its per-component events): leave --component out",
			userfile.Quote(component), in)
	case component != "" && !components[component]:
		return fmt.Errorf("--component %s: no event of %s is of that KV-cache component (its components: %s)", userfile.Quote(component), in, quoted(components))
	case medium != "" && len(media) == 0 && medium != "GPU":
		return fmt.Errorf("--medium %s: no event of %s names a medium (the stream is of the GPU cache only, as SGLang's and vLLM's before its medium field): leave --medium out",
			userfile.Quote(medium), in)
	case medium != "" && len(media) > 0 && !media[medium]:
		return fmt.Errorf("--medium %s: no event of %s is of that medium (its media: %s)", userfile.Quote(medium), in, quoted(media))
	case group > 0 && len(groups) == 0:
		return fmt.Errorf("--group %d: no event of %s names a KV-cache group (the stream is of one group, as SGLang's and vLLM's before its group_idx field): leave --group out", group, in)
	case group >= 0 && len(groups) > 0 && !groups[group]:
		var ids []int64
		for g := range groups {
			ids = append(ids, g)
		}
		slices.Sort(ids)
		return fmt.Errorf("--group %d: no event of %s is of that KV-cache group (its groups: %s)", group, in, strings.Trim(fmt.Sprint(ids), "[]"))
	}
	return nil
}

// isEventStream tells an event stream from a dump: a dump is a directory, a
// native file (magic SPMLDUMP) or a file with a dump extension.
func isEventStream(path string) bool {
	fi, err := os.Stat(path)
	if err != nil || fi.IsDir() {
		return false
	}
	switch strings.ToLower(filepath.Ext(path)) {
	case ".smd", ".safetensors", ".npy", ".npz", ".pt", ".pth", ".bin":
		return false
	}
	f, _, err := userfile.Open(path) // never blocks on a FIFO
	if err != nil {
		return false
	}
	defer f.Close()
	head := make([]byte, len(dump.Magic))
	n, _ := io.ReadFull(f, head)
	return !bytes.Equal(head[:n], []byte(dump.Magic))
}
