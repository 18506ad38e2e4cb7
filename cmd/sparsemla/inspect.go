package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"regexp"
	"slices"
	"sort"
	"strings"

	"sparsemla/dump"
)

func init() {
	register(&command{
		name:    "inspect",
		summary: "list what a dump holds: requests, steps, layers, stages, dtypes, shapes, value stats",
		run:     runInspect,
	})
}

const inspectUsage = "inspect DUMP [--map FILE|NAME] [--json] [--index-only] [--filter REGEXP] [--summary]"

const inspectDoc = `DUMP is a native dump (.smd file, or a directory of them), a safetensors file or
directory, an .npz file, a directory of .npy/.npz files, a torch.save .pt file
(or a directory of them), or an SGLang dumper directory (or its older per-pass
tensor dumps). Non-native dumps are mapped to canonical keys (request, step,
layer, stage) by a name map: --map, else a built-in map detected for the
directory (official-v4-tiny, sglang, ...), else the generic map.

For every record: key, kind, dtype, shape, bytes and min/max/mean/NaN/inf counts
(records are read one at a time; memory is bounded by the largest record).
--index-only skips the data (only the index pass: fast on many-GB dumps).

Exit status: 0 success, 2 bad input (one line naming file, record, offset, reason).`

type inspectRecord struct {
	Request string   `json:"request"`
	Step    int      `json:"step"`
	Layer   int      `json:"layer"`
	Stage   string   `json:"stage"`
	Kind    string   `json:"kind"`
	Name    string   `json:"name,omitempty"`
	DType   string   `json:"dtype"`
	Shape   []int    `json:"shape"`
	Bytes   int64    `json:"bytes"`
	File    string   `json:"file"`
	Offset  int64    `json:"offset"`
	Layout  string   `json:"page_layout,omitempty"`
	Min     *float64 `json:"min,omitempty"`
	Max     *float64 `json:"max,omitempty"`
	Mean    *float64 `json:"mean,omitempty"`
	NaN     int64    `json:"nan"`
	Inf     int64    `json:"inf"`
}

type inspectReport struct {
	Path     string           `json:"path"`
	Format   string           `json:"format"`
	Map      string           `json:"map,omitempty"`
	Detect   string           `json:"map_detection,omitempty"` // generic map: the detect rule each built-in map failed
	Header   inspectHeader    `json:"header"`
	Requests []string         `json:"requests"`
	Steps    []int            `json:"steps"`
	StateAt  []int            `json:"state_valid_after"`
	Layers   []int            `json:"layers"`
	Stages   []string         `json:"stages"`
	Kinds    map[string]int   `json:"kinds"`
	DTypes   map[string]int   `json:"dtypes"`
	Records  int              `json:"records"`
	Bytes    int64            `json:"bytes"`
	NaN      int64            `json:"nan"`
	Inf      int64            `json:"inf"`
	Prefix   []dump.PrefixHit `json:"prefix_hits"`
	Unmapped []string         `json:"unmapped"`
	Cut      []string         `json:"incomplete_files"`
	Unknown  []string         `json:"noncanonical_stages"`
	List     []inspectRecord  `json:"list,omitempty"`
}

type inspectHeader struct {
	Version        int               `json:"version"`
	ModelArgs      json.RawMessage   `json:"model_args,omitempty"`
	CompressRatios []int             `json:"compress_ratios"`
	DTypePolicy    map[string]string `json:"dtype_policy,omitempty"`
	Producer       map[string]string `json:"producer,omitempty"`
	User           map[string]string `json:"user,omitempty"`
}

func runInspect(args []string, stdout, stderr io.Writer) int {
	fs := rpFlagSet("inspect", inspectUsage, inspectDoc, stdout, stderr)
	mapFile := fs.String("map", "", "name map: a JSON file or a built-in name ("+strings.Join(dump.BuiltinNameMaps(), ", ")+")")
	asJSON := fs.Bool("json", false, "write a JSON report")
	indexOnly := fs.Bool("index-only", false, "do not read record data (no value statistics)")
	filter := fs.String("filter", "", "only records whose key (request/pSTEP/LLAYER/stage) matches this regexp, and the prefix hits of their requests")
	summary := fs.Bool("summary", false, "print the summary only, not one line per record")
	pos, err := rpParseArgs(fs, args)
	if err == flag.ErrHelp {
		return exitOK
	}
	if err != nil {
		return exitError
	}
	if len(pos) != 1 {
		rpUsageError(fs, fmt.Sprintf("want exactly one DUMP argument, got %d", len(pos)))
		return exitError
	}
	var re *regexp.Regexp
	if *filter != "" {
		if re, err = regexp.Compile(*filter); err != nil {
			rpFail(stderr, "inspect", fmt.Errorf("--filter: %w", err))
			return exitError
		}
	}
	var m *dump.NameMap
	if *mapFile != "" {
		if m, err = dump.LoadNameMap(*mapFile); err != nil {
			rpFail(stderr, "inspect", err)
			return exitError
		}
	}
	d, err := dump.OpenMapped(pos[0], m)
	if err != nil {
		rpFail(stderr, "inspect", err)
		return exitError
	}
	defer d.Close()
	rep, err := buildInspect(d, re, !*indexOnly)
	if err != nil {
		rpFail(stderr, "inspect", err)
		return exitError
	}
	if *asJSON {
		if *summary {
			rep.List = nil
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			rpFail(stderr, "inspect", err)
			return exitError
		}
		return exitOK
	}
	writeInspectText(stdout, rep, !*summary, !*indexOnly)
	return exitOK
}

func buildInspect(d *dump.Dump, re *regexp.Regexp, stats bool) (*inspectReport, error) {
	rep := &inspectReport{
		Path: d.Path, Format: d.Format, Kinds: map[string]int{}, DTypes: map[string]int{},
		Prefix: d.Prefix, Unmapped: d.Unmapped, Cut: d.Incomplete,
		Header: inspectHeader{Version: d.Header.Version, CompressRatios: d.Header.CompressRatios,
			DTypePolicy: d.Header.DTypePolicy, Producer: d.Header.Producer, User: d.Header.User},
	}
	if d.Map != nil && d.Map.Name == "generic" {
		rep.Detect = d.Detect // why no built-in map was detected
	}
	if d.Map != nil {
		rep.Map = d.Map.Name
	}
	if d.Header.ModelArgs != "" && json.Valid([]byte(d.Header.ModelArgs)) {
		rep.Header.ModelArgs = json.RawMessage(d.Header.ModelArgs)
	}
	reqs, steps, stateAt, layers, stages, unknown := map[string]bool{}, map[int]bool{}, map[int]bool{}, map[int]bool{}, map[string]bool{}, map[string]bool{}
	var buf []byte // reused across records: memory = the largest record
	for i := range d.Entries {
		e := &d.Entries[i]
		if re != nil && !re.MatchString(e.Key.String()) {
			continue
		}
		rec := inspectRecord{Request: e.Request, Step: e.Step, Layer: e.Layer, Stage: e.Stage, Kind: e.Kind.String(),
			DType: e.DType.String(), Shape: e.Shape, Bytes: e.NBytes, File: e.File, Offset: e.Offset}
		if e.Name != e.Stage {
			rec.Name = e.Name
		}
		if e.Page != nil {
			rec.Layout = e.Page.Layout
		}
		if rec.Shape == nil {
			rec.Shape = []int{}
		}
		if stats {
			r, err := d.ReadBuf(e, buf)
			if err != nil {
				return nil, err
			}
			buf = r.Data
			s, err := r.Stats()
			if err != nil {
				return nil, fmt.Errorf("%s: record %d (%s) at offset %d: %w", e.File, e.Record, e.Key, e.Offset, err)
			}
			if s.N > s.NaN+s.Inf {
				rec.Min, rec.Max, rec.Mean = &s.Min, &s.Max, &s.Mean
			}
			rec.NaN, rec.Inf = s.NaN, s.Inf
			rep.NaN += s.NaN
			rep.Inf += s.Inf
		}
		reqs[e.Request] = true
		switch {
		case e.Kind == dump.KindState:
			stateAt[e.Step] = true
		case e.Step != dump.NoStep:
			steps[e.Step] = true
		}
		if e.Layer != dump.Global {
			layers[e.Layer] = true
		}
		if e.Kind != dump.KindWeight && e.Kind != dump.KindPage {
			stages[e.Stage] = true
			if _, ok := dump.LookupStage(e.Stage); !ok {
				unknown[e.Stage] = true
			}
		}
		rep.Kinds[rec.Kind]++
		rep.DTypes[rec.DType]++
		rep.Records++
		rep.Bytes += e.NBytes
		rep.List = append(rep.List, rec)
	}
	rep.Requests = slices.Sorted(maps.Keys(reqs))
	rep.Steps = slices.Sorted(maps.Keys(steps))
	rep.StateAt = slices.Sorted(maps.Keys(stateAt))
	rep.Layers = slices.Sorted(maps.Keys(layers))
	rep.Stages = slices.Sorted(maps.Keys(stages))
	rep.Unknown = slices.Sorted(maps.Keys(unknown))
	if rep.Unmapped == nil {
		rep.Unmapped = []string{}
	}
	if rep.Cut == nil {
		rep.Cut = []string{}
	}
	if re != nil {
		// a filtered report lists the prefix hits of its requests only: a
		// hit whose reusing or reused request has a record that matched
		var hits []dump.PrefixHit
		for _, h := range rep.Prefix {
			if reqs[h.Request] || reqs[h.Source] {
				hits = append(hits, h)
			}
		}
		rep.Prefix = hits
	}
	if rep.Prefix == nil {
		rep.Prefix = []dump.PrefixHit{}
	}
	return rep, nil
}

// ranges prints sorted ints compactly: 2..7, 9.
func ranges(v []int) string {
	if len(v) == 0 {
		return "none"
	}
	var parts []string
	for i := 0; i < len(v); {
		j := i
		for j+1 < len(v) && v[j+1] == v[j]+1 {
			j++
		}
		if j > i {
			parts = append(parts, fmt.Sprintf("%d..%d", v[i], v[j]))
		} else {
			parts = append(parts, fmt.Sprint(v[i]))
		}
		i = j + 1
	}
	return strings.Join(parts, ", ")
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func sortedCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func fmtStat(p *float64) string {
	if p == nil {
		return "-"
	}
	if math.Abs(*p) >= 1e5 || (*p != 0 && math.Abs(*p) < 1e-3) {
		return fmt.Sprintf("%.4g", *p)
	}
	return fmt.Sprintf("%.5g", *p)
}

func writeInspectText(w io.Writer, r *inspectReport, list, stats bool) {
	mp := ""
	if r.Map != "" {
		mp = ", name map " + r.Map
	}
	fmt.Fprintf(w, "dump %s (%s%s)\n", r.Path, r.Format, mp)
	if r.Detect != "" {
		fmt.Fprintf(w, "  %s\n", r.Detect)
	}
	h := r.Header
	if h.Version > 0 {
		fmt.Fprintf(w, "  format version %d\n", h.Version)
	}
	if len(h.CompressRatios) > 0 {
		fmt.Fprintf(w, "  layer schedule (compress ratios) %v\n", h.CompressRatios)
	}
	for _, kv := range []struct {
		name string
		m    map[string]string
	}{{"dtype policy", h.DTypePolicy}, {"producer", h.Producer}, {"user", h.User}} {
		if len(kv.m) > 0 {
			keys := make([]string, 0, len(kv.m))
			for k := range kv.m {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			var parts []string
			for _, k := range keys {
				parts = append(parts, k+"="+kv.m[k])
			}
			fmt.Fprintf(w, "  %s: %s\n", kv.name, strings.Join(parts, " "))
		}
	}
	if len(h.ModelArgs) > 0 {
		fmt.Fprintf(w, "  model args: %d bytes of JSON\n", len(h.ModelArgs))
	}
	reqs := make([]string, len(r.Requests))
	for i, q := range r.Requests {
		reqs[i] = fmt.Sprintf("%q", q)
	}
	fmt.Fprintf(w, "  requests %s; steps %s; layers %s\n", strings.Join(reqs, " "), ranges(r.Steps), ranges(r.Layers))
	if len(r.StateAt) > 0 {
		fmt.Fprintf(w, "  replay start state valid after step %s\n", ranges(r.StateAt))
	}
	fmt.Fprintf(w, "  %d records, %s; kinds: %s; dtypes: %s\n", r.Records, humanBytes(r.Bytes), sortedCounts(r.Kinds), sortedCounts(r.DTypes))
	fmt.Fprintf(w, "  %d stages: %s\n", len(r.Stages), strings.Join(r.Stages, " "))
	if stats {
		fmt.Fprintf(w, "  non-finite values: %d NaN, %d inf\n", r.NaN, r.Inf)
	}
	if len(r.Unknown) > 0 {
		fmt.Fprintf(w, "  not canonical stage names: %s\n", strings.Join(r.Unknown, " "))
	}
	for _, f := range r.Cut {
		fmt.Fprintf(w, "  warning: %s has no end frame (cut short, e.g. by a crashed capture); its records are intact\n", f)
	}
	for _, p := range r.Prefix {
		fmt.Fprintf(w, "  prefix hit: request %q reused %d tokens of request %q\n", p.Request, p.Tokens, p.Source)
	}
	if len(r.Unmapped) > 0 {
		fmt.Fprintf(w, "  %d tensors matched no name-map rule (not indexed):\n", len(r.Unmapped))
		for _, u := range r.Unmapped {
			fmt.Fprintf(w, "    %s\n", u)
		}
	}
	if !list {
		return
	}
	fmt.Fprintf(w, "\n%-28s %-6s %-5s %-16s %10s", "key", "kind", "dtype", "shape", "bytes")
	if stats {
		fmt.Fprintf(w, " %11s %11s %11s %4s %4s", "min", "max", "mean", "nan", "inf")
	}
	fmt.Fprintln(w)
	for _, e := range r.List {
		k := dump.Key{Request: e.Request, Step: e.Step, Layer: e.Layer, Stage: e.Stage}
		shape := strings.ReplaceAll(fmt.Sprint(e.Shape), " ", ",")
		fmt.Fprintf(w, "%-28s %-6s %-5s %-16s %10d", k.String(), e.Kind, e.DType, shape, e.Bytes)
		if stats {
			fmt.Fprintf(w, " %11s %11s %11s %4d %4d", fmtStat(e.Min), fmtStat(e.Max), fmtStat(e.Mean), e.NaN, e.Inf)
		}
		if e.Layout != "" {
			fmt.Fprintf(w, "  page %s", e.Layout)
		}
		fmt.Fprintln(w)
	}
}
