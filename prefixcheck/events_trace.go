package prefixcheck

import (
	"fmt"
	"strconv"
)

// EventsOptions selects the events of one cache tier and KV-cache group.
type EventsOptions struct {
	// Medium keeps events of this medium ("GPU" when empty); events without
	// a medium (older versions, SGLang) are always kept.
	Medium string
	// Group keeps events of this KV-cache group (vLLM's group_idx; hybrid
	// models cache full-attention and sliding-window layers in separate
	// groups). Nil: the first group whose kv_cache_spec_kind is
	// full_attention or mla_attention, else the first group seen.
	Group *int64
	// DPRank keeps the batches of this data-parallel rank (each rank has its
	// own cache). Nil: the stream must hold one rank only (batches without a
	// rank count as rank 0).
	DPRank *int64
}

type evBlock struct {
	parent  BlockHash
	tokens  []int32 // this block's tokens
	extra   string  // raw msgpack of its extra keys ("" none)
	ns      string
	depth   int // blocks from the root, this one included
	live    int // cached copies (vLLM does not deduplicate)
	stored  string
	unknown bool // its chain reaches a parent never stored
}

func namespaceOf(ev *Event) string {
	switch {
	case ev.LoraName != "":
		return "lora:" + ev.LoraName
	case ev.LoraID != nil:
		return "lora-id:" + strconv.FormatInt(*ev.LoraID, 10)
	}
	return ""
}

// EventsTrace turns decoded KV-cache events into a trace: every BlockStored
// event is a request whose tokens are its parent chain's and its own, whose
// recorded hit is its parent chain (the cached prefix the engine built on,
// from the event that stored the parent), whose page ids are the block
// hashes; BlockRemoved (of a block's last cached copy) and AllBlocksCleared
// are the evictions and clears before the next request. The trace records
// hits and evictions, and its page ids are content addresses.
func EventsTrace(batches []EventBatch, input string, opt EventsOptions) (*Trace, error) {
	medium := opt.Medium
	if medium == "" {
		medium = "GPU"
	}
	if opt.DPRank == nil {
		if err := oneRank(batches, input); err != nil {
			return nil, err
		}
	}
	group := opt.Group
	if group == nil {
		group = pickGroup(batches)
	}
	r := &eventsReader{
		t:      &Trace{Input: input, Format: "kv-events", HitsRecorded: true, EvictionsRecorded: true, ContentPageIDs: true},
		input:  input,
		blocks: map[BlockHash]*evBlock{},
	}
	for bi := range batches {
		if opt.DPRank != nil && rankOf(&batches[bi]) != *opt.DPRank {
			continue
		}
		for ei := range batches[bi].Events {
			ev := &batches[bi].Events[ei]
			if ev.Medium != "" && ev.Medium != medium {
				r.skippedMedium++
				continue
			}
			if ev.GroupIdx != nil && ev.Type != "AllBlocksCleared" && group != nil && *ev.GroupIdx != *group {
				r.skippedGroup++
				continue
			}
			if ev.Type == "BlockStored" && len(ev.TokenIDs) == 0 {
				r.inventory++
				continue
			}
			switch ev.Type {
			case "AllBlocksCleared":
				r.cleared()
			case "BlockRemoved":
				r.removed(ev)
			case "BlockStored":
				if err := r.stored(ev, bi, ei); err != nil {
					return nil, err
				}
			}
		}
	}
	r.notes(medium, group)
	if len(r.t.Requests) == 0 {
		return nil, fmt.Errorf("prefixcheck: %s: no BlockStored events (of medium %s)", input, medium)
	}
	return r.t, nil
}

// rankOf is a batch's data-parallel rank (0 when it names none).
func rankOf(b *EventBatch) int64 {
	if b.DPRank == nil {
		return 0
	}
	return *b.DPRank
}

// oneRank refuses a stream whose batches come from more than one
// data-parallel rank (each rank has its own cache).
func oneRank(batches []EventBatch, input string) error {
	for i := range batches {
		if r, r0 := rankOf(&batches[i]), rankOf(&batches[0]); r != r0 {
			return fmt.Errorf("prefixcheck: %s: batch %d (byte %d) is from data-parallel rank %d, batch 0 from rank %d: each rank has its own cache, choose one", input, i, batches[i].Offset, r, r0)
		}
	}
	return nil
}

// eventsReader is the state EventsTrace carries from event to event: the
// blocks stored so far, the evictions and clear since the last request, and
// the counts of what it skipped.
type eventsReader struct {
	t         *Trace
	input     string
	blocks    map[BlockHash]*evBlock
	evictions []Eviction
	clear     bool

	skippedMedium, skippedGroup, unknownRemoved, dups, inventory int
}

// chain is the prefix that ends with block h: its tokens, the extra keys and
// the hashes of its blocks from the root; ok is false when a block of it was
// never stored in this stream.
func (r *eventsReader) chain(h BlockHash) (toks []int32, extra []string, ids []string, ok bool) {
	var path []*evBlock
	var hs []BlockHash
	for h != "" {
		b := r.blocks[h]
		if b == nil || b.unknown {
			return nil, nil, nil, false
		}
		path, hs = append(path, b), append(hs, h)
		h = b.parent
	}
	for i := len(path) - 1; i >= 0; i-- {
		toks = append(toks, path[i].tokens...)
		extra = append(extra, path[i].extra)
		ids = append(ids, string(hs[i]))
	}
	return toks, extra, ids, true
}

// cleared follows AllBlocksCleared: no block is cached any more, and the
// next request starts from an empty cache.
func (r *eventsReader) cleared() {
	for _, b := range r.blocks {
		b.live = 0
	}
	r.evictions, r.clear = nil, true
}

// removed follows BlockRemoved: a block whose last cached copy goes is an
// eviction before the next request.
func (r *eventsReader) removed(ev *Event) {
	for _, h := range ev.BlockHashes {
		b := r.blocks[h]
		if b == nil || b.live == 0 {
			r.unknownRemoved++
			continue
		}
		if b.live--; b.live > 0 {
			continue
		}
		toks, extra, ids, ok := r.chain(h)
		if !ok {
			continue
		}
		r.evictions = append(r.evictions, Eviction{Namespace: b.ns, Prefix: toks, Extra: extra, PageID: ids[len(ids)-1]})
	}
}

// stored follows BlockStored (event ei of batch bi): a request whose hit is
// its parent chain, and whose blocks are cached from now on.
func (r *eventsReader) stored(ev *Event, bi, ei int) error {
	t := r.t
	if t.PageSize == 0 {
		t.PageSize = ev.BlockSize
	} else if ev.BlockSize != t.PageSize {
		where := fmt.Sprintf("batch %d event %d (byte %d)", bi, ei, ev.Offset)
		return fmt.Errorf("prefixcheck: %s: %s: block size %d, earlier events %d (a partial last page?)", r.input, where, ev.BlockSize, t.PageSize)
	}
	id := fmt.Sprintf("b%d.e%d", bi, ei)
	ns := namespaceOf(ev)
	q := Request{ID: id, Namespace: ns, Evictions: r.evictions, Clear: r.clear}
	r.evictions, r.clear = nil, false
	known := true
	var toks []int32
	var extra, ids []string
	depth := 0
	if ev.Parent != "" {
		p := r.blocks[ev.Parent]
		toks, extra, ids, known = r.chain(ev.Parent)
		if !known {
			q.Unknown = fmt.Sprintf("parent block %s was never stored in this stream (it starts mid-run?)", ev.Parent)
		} else {
			depth = p.depth
			q.Hit = &Hit{Tokens: depth * ev.BlockSize, Source: p.stored}
		}
	} else {
		q.Hit = &Hit{}
	}
	B := ev.BlockSize
	dupAll := len(ev.BlockHashes) > 0
	for i, h := range ev.BlockHashes {
		x := ""
		if ev.ExtraKeys != nil {
			x = ev.ExtraKeys[i]
		}
		own := ev.TokenIDs[i*B : (i+1)*B]
		parent := ev.Parent
		if i > 0 {
			parent = ev.BlockHashes[i-1]
		}
		if b := r.blocks[h]; b != nil && b.live > 0 && b.parent == parent && b.extra == x && b.ns == ns && equal32(b.tokens, own) {
			b.live++
		} else {
			dupAll = false
			r.blocks[h] = &evBlock{parent: parent, tokens: own, extra: x, ns: ns, depth: depth + i + 1, live: 1, stored: id, unknown: !known}
		}
		if known {
			toks = append(toks, own...)
			extra = append(extra, x)
			ids = append(ids, string(h))
		}
	}
	if dupAll {
		r.dups++
		q.MissExplained = "every block of this event was already cached with the same hash: vLLM does not deduplicate blocks two requests computed in the same step, and some builds also re-announce reused blocks"
	}
	if known {
		q.Tokens, q.Extra, q.PageIDs = toks, extra, ids
	}
	t.Requests = append(t.Requests, q)
	return nil
}

// notes records in the trace what EventsTrace skipped.
func (r *eventsReader) notes(medium string, group *int64) {
	t := r.t
	if r.skippedMedium > 0 {
		t.Notes = append(t.Notes, fmt.Sprintf("%s of other media than %s skipped", plural(r.skippedMedium, "event"), medium))
	}
	if r.skippedGroup > 0 {
		t.Notes = append(t.Notes, fmt.Sprintf("%s of other KV-cache groups than %d skipped", plural(r.skippedGroup, "event"), *group))
	}
	if r.unknownRemoved > 0 {
		t.Notes = append(t.Notes, plural(r.unknownRemoved, "removal")+" of blocks not cached in this stream (it starts mid-run?)")
	}
	if r.inventory > 0 {
		t.Notes = append(t.Notes, plural(r.inventory, "BlockStored event")+" without token ids (an inventory announcement) skipped")
	}
	if r.dups > 0 {
		t.Notes = append(t.Notes, plural(r.dups, "BlockStored event")+" only re-stored cached blocks")
	}
}

func equal32(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// pickGroup chooses the KV-cache group to check when none is asked for: the
// first whose spec kind is a full-attention one, else the first group seen
// (nil when no event names a group).
func pickGroup(batches []EventBatch) *int64 {
	var first *int64
	for _, b := range batches {
		for _, ev := range b.Events {
			if ev.Type != "BlockStored" || ev.GroupIdx == nil {
				continue
			}
			if ev.SpecKind == "full_attention" || ev.SpecKind == "mla_attention" {
				g := *ev.GroupIdx
				return &g
			}
			if first == nil {
				g := *ev.GroupIdx
				first = &g
			}
		}
	}
	return first
}
