package prefixcheck

import (
	"encoding/json"
	"fmt"
	"sort"

	"sparsemla/dump"
	"sparsemla/kvcache"
	"sparsemla/userfile"
)

// FromDump builds a trace from a multi-request dump (any format dump.Open
// reads): a request's token stream is its "tok" records (token fed at
// position p = step p), its recorded hit the prefix-hit frame naming it
// (dump/FORMAT.md "Prefix frame"; a request without one reused nothing).
// Arrival order is the order of first appearance in the dump (files in name
// order, records in file order), moved only as far as needed to put every
// hit's source before its request (the dump has no arrival times; a source
// appearing later is taken to have arrived earlier). A request whose tokens
// before some position are not dumped, or whose hit names a request absent
// from the dump, is unchecked. A dump with no prefix hit at all is taken not
// to record hits (every request unchecked, with a note). Dumps record no
// evictions.
func FromDump(d *dump.Dump) (*Trace, error) {
	// A dump without any prefix hit may simply not record them: then a
	// request without one is not judged.
	t := &Trace{Input: d.Path, Format: d.Format, HitsRecorded: len(d.Prefix) > 0}
	if !t.HitsRecorded {
		t.Notes = append(t.Notes, "the dump records no prefix hit at all (no prefix frames, no sparsemla.prefix metadata): the engine's decisions cannot be judged, only the correct cache's hits are shown")
	}
	first := map[string]int{}
	toks := map[string]map[int]int64{}
	for i := range d.Entries {
		e := &d.Entries[i]
		if _, ok := first[e.Request]; !ok {
			first[e.Request] = len(first)
		}
		if e.Stage != "tok" || e.Kind != dump.KindStage || e.Layer != -1 {
			continue
		}
		if e.Step < 0 {
			return nil, fmt.Errorf("prefixcheck: %s: record %d of %s: tok record at step %d", d.Path, e.Record, e.File, e.Step)
		}
		rec, err := d.Read(e)
		if err != nil {
			return nil, err
		}
		v, err := rec.Int64()
		if err != nil {
			return nil, fmt.Errorf("prefixcheck: %s: %w", d.Path, err)
		}
		if len(v) != 1 || v[0] < 0 || v[0] > 1<<31-1 {
			return nil, fmt.Errorf("prefixcheck: %s: record %d of %s (%s): tok must be one token id in [0, 2^31), got %v", d.Path, e.Record, e.File, e.Key, v)
		}
		if toks[e.Request] == nil {
			toks[e.Request] = map[int]int64{}
		}
		toks[e.Request][e.Step] = v[0]
	}
	hits := map[string]dump.PrefixHit{}
	for _, h := range d.Prefix {
		if old, dup := hits[h.Request]; dup {
			if old.Source == h.Source && old.Tokens == h.Tokens {
				continue // the same hit stated twice (e.g. a sidecar and file metadata)
			}
			return nil, fmt.Errorf("prefixcheck: %s: record %d of %s: a second prefix hit for request %q (%d tokens of %q, earlier %d of %q)", d.Path, h.Record, h.File, h.Request, h.Tokens, h.Source, old.Tokens, old.Source)
		}
		hits[h.Request] = h
		if _, ok := first[h.Request]; !ok {
			first[h.Request] = len(first)
		}
	}
	if len(first) == 0 {
		return nil, fmt.Errorf("%w: %s", errNoRequests, d.Path)
	}
	ids := make([]string, 0, len(first))
	for id := range first {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return first[ids[i]] < first[ids[j]] })
	// Sources first: each request is placed after the chain of sources its
	// hit leads to, in first-appearance order. The chain is walked, not
	// recursed into: a dump may chain any number of hits.
	placed := map[string]int{} // 1 placing, 2 placed
	var order []string
	for _, id := range ids {
		var chain []string // id, its source, the source's source, ... not yet placed
		for cur := id; placed[cur] != 2; {
			if placed[cur] == 1 {
				return nil, fmt.Errorf("prefixcheck: %s: prefix hits form a cycle through request %q", d.Path, cur)
			}
			placed[cur] = 1
			chain = append(chain, cur)
			h, ok := hits[cur]
			if !ok || h.Tokens <= 0 || h.Source == cur {
				break
			}
			if _, in := first[h.Source]; !in {
				break
			}
			cur = h.Source
		}
		for i := len(chain) - 1; i >= 0; i-- {
			placed[chain[i]] = 2
			order = append(order, chain[i])
		}
	}
	for _, id := range order {
		q := Request{ID: id}
		m := toks[id]
		n := 0
		for ; ; n++ {
			if _, ok := m[n]; !ok {
				break
			}
		}
		q.Tokens = make([]int32, n)
		for p := range q.Tokens {
			q.Tokens[p] = int32(m[p])
		}
		if n == 0 {
			q.Unknown = "no tok record at position 0"
			if len(m) > 0 {
				low := -1
				for p := range m {
					if low < 0 || p < low {
						low = p
					}
				}
				q.Unknown = fmt.Sprintf("tok records start at position %d (the prompt's tokens are not dumped)", low)
			}
		}
		if h, ok := hits[id]; ok {
			q.Hit = &Hit{Tokens: h.Tokens, Source: h.Source}
			if _, in := first[h.Source]; !in && h.Tokens > 0 && q.Unknown == "" {
				q.Unknown = fmt.Sprintf("its prefix-hit source request %q is not in the dump", h.Source)
			}
		}
		t.Requests = append(t.Requests, q)
	}
	return t, nil
}

// ConfigFromDump reads the cache geometry a dump's header states: the compress
// ratios, the window (ModelArgs window_size) and the page size (the block
// size of its first page record). Fields it cannot find are zero.
func ConfigFromDump(d *dump.Dump) (Config, error) {
	var c Config
	c.Schedule = kvcache.Schedule{Ratios: d.Header.CompressRatios}
	if d.Header.ModelArgs != "" {
		var args struct {
			Window *int `json:"window_size"`
		}
		if err := json.Unmarshal([]byte(d.Header.ModelArgs), &args); err != nil {
			return c, fmt.Errorf("prefixcheck: %s: model args: %w", d.Path, userfile.JSONError(err))
		}
		if args.Window != nil {
			c.Schedule.Window = *args.Window
		}
	}
	for i := range d.Entries {
		if p := d.Entries[i].Page; p != nil && p.BlockSize > 0 {
			c.PageSize = p.BlockSize
			break
		}
	}
	return c, nil
}
