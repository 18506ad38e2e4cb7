package prefixcheck

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"sparsemla/userfile"
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
	// Component keeps the events of this SGLang KV-cache component (its
	// component_type: "full", "swa", "mamba", "c128", ...; hybrid models
	// such as DeepSeek V3.2/V4 publish one event per component for the same
	// pages, each component a cache of its own). "": "full" when an event
	// names it, else the first component seen. Events without a component
	// (AllBlocksCleared, other engines) are always kept.
	Component string
	// DPRank keeps the batches of this data-parallel rank (each rank has its
	// own cache). Nil: the stream must hold one rank only (batches without a
	// rank count as rank 0).
	DPRank *int64
	// HashScheme says what a block hash names: HashChained (the whole
	// prefix up to and including the block, as vLLM and SGLang since PR
	// #13488 hash), HashPerPage (the block's own tokens alone, as SGLang
	// before PR #13488 hashed) or HashAuto ("" too): per-page when every
	// stored block's hash is Python's hash of its token tuple (the per-page
	// hash recomputed; no chained hash is that), else chained.
	HashScheme string
}

// Block hash schemes (EventsOptions.HashScheme).
const (
	HashAuto    = "auto"
	HashChained = "chained"
	HashPerPage = "per-page"
)

// evBlock is a stored block (with per-page hashes: a page at one place of
// the tree). Its parent is the block its parent hash named
// when it was stored, and never changes: a later BlockStored of that hash
// under another parent replaces the hash's block for later events but leaves
// the chains already built on the old one as they were. A parent is thus
// always stored before its children and no block is its own ancestor, even
// when one hash recurs along a chain (SGLang hashes a page's tokens alone, so
// a page repeated in a prompt has one hash at every place it occurs).
type evBlock struct {
	hash       BlockHash
	id         string    // the page id requests and evictions name it by: the hash when hashes are chained, else the hash and a serial number
	parent     *evBlock  // nil: a root, or a parent never stored (unknown)
	parentHash BlockHash // the parent's hash ("" none)
	tokens     []int32   // this block's tokens
	extra      string    // raw msgpack of its extra keys ("" none)
	ns         string
	depth      int // blocks from the root, this one included
	live       int // cached copies (vLLM does not deduplicate)
	stored     string
	unknown    bool // its chain reaches a parent never stored
}

// Limits on the prefixes EventsTrace builds. Every request (one per
// BlockStored) and every eviction holds its whole parent chain, so a stream
// that keeps extending one chain costs memory quadratic in its length (8,000
// one-token events, 191 KB, took 1.3 GB), and Run's work and report grow
// alike (about four times the prefixes' bytes in memory). The prefixes built
// are therefore bounded by a floor plus a multiple of the stream's bytes
// before the event that builds one; the tokens an event stores itself are the
// stream's own and not counted.
const (
	prefixTokenBytes = 4  // a token of a prefix (int32)
	prefixPageBytes  = 32 // a page of a prefix: its id and extra key (string headers; their text is shared)
	// prefixBytesFloor is allowed whatever the stream's size: a thousand
	// requests of 16,000 tokens in pages of 16 take about 90 MiB. A hostile
	// stream of 64 KB reaches it and costs Run a few seconds and 0.5 GB.
	prefixBytesFloor = 128 << 20
	// prefixBytesPerStreamByte is allowed beyond the floor per byte of the
	// stream: streams that carry their requests' new tokens stay well within
	// it; ones whose events mostly extend long chains by a block (decode
	// steps of long contexts) may not.
	prefixBytesPerStreamByte = 128
)

// namespaceOf is the namespace of a BlockStored event: its LoRA adapter
// ("lora:<name>", else "lora-id:<id>") and SGLang's cache salt
// (`salt:"<quoted salt>"` before the adapter's, a space between): requests of
// two salts, or of a salt and none, never share a prefix, as in SGLang, whose
// radix tree keys a node by (extra_key, cache_salt). The quoted salt ends at
// its closing quote and an unsalted namespace never starts with "salt:", so
// no adapter name or salt can make another pair's namespace. session_id is no
// part of it.
func namespaceOf(ev *Event) string {
	lora := ""
	switch {
	case ev.LoraName != "":
		lora = "lora:" + ev.LoraName
	case ev.LoraID != nil:
		lora = "lora-id:" + strconv.FormatInt(*ev.LoraID, 10)
	}
	if ev.CacheSalt == nil {
		return lora
	}
	ns := "salt:" + strconv.Quote(*ev.CacheSalt)
	if lora != "" {
		ns += " " + lora
	}
	return ns
}

// EventsTrace turns decoded KV-cache events into a trace: every BlockStored
// event is a request whose tokens are its parent chain's and its own, whose
// recorded hit is its parent chain (the cached prefix the engine built on,
// from the event that stored the parent), whose page ids are the block
// hashes; BlockRemoved (of a block's last cached copy) and AllBlocksCleared
// are the evictions and clears before the next request. The trace records
// hits and evictions, and its page ids are content addresses. The prefixes
// the requests and evictions hold together are limited to prefixBytesFloor
// plus prefixBytesPerStreamByte per byte of the stream (an error beyond).
func EventsTrace(batches []EventBatch, input string, opt EventsOptions) (*Trace, error) {
	return eventsTrace(batches, input, opt, prefixBytesFloor)
}

// eventsTrace is EventsTrace with the floor of the prefix budget as a
// parameter (tests lower it).
func eventsTrace(batches []EventBatch, input string, opt EventsOptions, floor int64) (*Trace, error) {
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
	component := opt.Component
	if component == "" {
		component = pickComponent(batches)
	}
	r := &eventsReader{
		t:       &Trace{Input: input, Format: "kv-events", HitsRecorded: true, EvictionsRecorded: true, ContentPageIDs: true},
		input:   input,
		blocks:  map[BlockHash]*evBlock{},
		live:    map[BlockHash][]*evBlock{},
		at:      map[place]*evBlock{},
		pendAt:  map[place]int{},
		pendBy:  map[place]int{},
		pendAmb: map[BlockHash]int{},
		floor:   floor,

		skippedComponent: map[string]int{},
	}
	// skip says why an event is not followed (0: it is).
	skip := func(bi int, ev *Event) int {
		switch {
		case opt.DPRank != nil && rankOf(&batches[bi]) != *opt.DPRank:
			return skipRank
		case ev.Medium != "" && ev.Medium != medium:
			return skipMedium
		case ev.GroupIdx != nil && ev.Type != "AllBlocksCleared" && group != nil && *ev.GroupIdx != *group:
			return skipGroup
		case ev.Component != "" && ev.Component != component:
			return skipComponent
		case ev.Type == "BlockStored" && len(ev.TokenIDs) == 0:
			return skipInventory
		}
		return 0
	}
	switch opt.HashScheme {
	case "", HashAuto:
		r.perPage = perPageHashes(batches, skip)
	case HashChained:
	case HashPerPage:
		r.perPage = true
	default:
		return nil, fmt.Errorf("prefixcheck: hash scheme %q: want %s, %s or %s", opt.HashScheme, HashAuto, HashChained, HashPerPage)
	}
	for bi := range batches {
		for ei := range batches[bi].Events {
			ev := &batches[bi].Events[ei]
			switch skip(bi, ev) {
			case skipRank:
				continue
			case skipMedium:
				r.skippedMedium++
				continue
			case skipGroup:
				r.skippedGroup++
				continue
			case skipComponent:
				r.skippedComponent[ev.Component]++
				continue
			case skipInventory:
				r.inventory++
				continue
			}
			switch ev.Type {
			case "AllBlocksCleared":
				r.cleared()
			case "BlockRemoved":
				if err := r.removed(ev, bi, ei); err != nil {
					return nil, err
				}
			case "BlockStored":
				if err := r.stored(ev, bi, ei); err != nil {
					return nil, err
				}
			}
		}
	}
	r.notes(medium, group, component)
	if len(r.t.Requests) == 0 {
		of := "medium " + medium
		if component != "" {
			of += ", component " + userfile.Quote(component)
		}
		if opt.DPRank != nil {
			of += fmt.Sprintf(", data-parallel rank %d", *opt.DPRank)
		}
		return nil, fmt.Errorf("prefixcheck: %s: no BlockStored events (of %s)", input, of)
	}
	return r.t, nil
}

// Why EventsTrace does not follow an event.
const (
	skipRank = iota + 1
	skipMedium
	skipGroup
	skipComponent
	skipInventory
)

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
// blocks stored so far, the evictions and clear since the last request, the
// bytes of prefixes built and the counts of what it skipped.
type eventsReader struct {
	t         *Trace
	input     string
	blocks    map[BlockHash]*evBlock // the block each hash names now
	evictions []Eviction
	clear     bool
	built     int64 // estimated bytes of the prefixes built (prefixTokenBytes, prefixPageBytes)
	floor     int64 // the prefix budget's floor (prefixBytesFloor)

	skippedMedium, skippedGroup, unknownRemoved, dups, inventory int
	skippedComponent                                             map[string]int // events skipped, by component

	// Per-page hashes (SGLang before PR #13488): a hash names every page of
	// that content, so the blocks are kept by place, not by hash.
	perPage bool
	live    map[BlockHash][]*evBlock // the cached blocks of each hash
	at      map[place]*evBlock       // the cached blocks by place
	pend    []pendingRemoval         // removed blocks whose eviction no request has taken yet (b nil: stored again)
	pendAt  map[place]int            // the index in pend of a removed block, by place
	// pendBy is the index in pend of a removed block by its place without
	// its parent block (-1: several), to find where a page goes whose
	// parent hash several cached pages have; pendAmb counts the removals of
	// each hash several cached pages have, since the last request.
	pendBy  map[place]int
	pendAmb map[BlockHash]int
	serial  int // blocks created (their ids' numbers)
	// ambiguous: a removal named a hash several cached pages have and none
	// was stored again at its place before the next request, so which the
	// engine evicted is not known (until the next AllBlocksCleared).
	ambiguous                                             bool
	noParent, ambiguousParent, ambiguousRemoved, restored int
}

// where names event ei of batch bi in errors.
func where(bi, ei int, ev *Event) string {
	return fmt.Sprintf("batch %d event %d (byte %d)", bi, ei, ev.Offset)
}

// chain is the prefix that ends with block b: its tokens, the extra keys and
// the hashes of its blocks from the root, with room for more blocks after it;
// ok is false when a block of it was never stored in this stream. at is the
// byte offset of the event that needs it: the prefixes built so far, this one
// included, must fit the budget of the stream before that byte.
func (r *eventsReader) chain(b *evBlock, at int64, more int) (toks []int32, extra, ids []string, ok bool, err error) {
	if b.unknown {
		return nil, nil, nil, false, nil
	}
	P := r.t.PageSize // every stored block has this many tokens
	r.built += int64(b.depth) * (prefixTokenBytes*int64(P) + prefixPageBytes)
	if limit := r.floor + prefixBytesPerStreamByte*at; r.built > limit {
		return nil, nil, nil, false, fmt.Errorf("a chain of %d blocks brings the prefixes held by requests and evictions to %d bytes, over the limit of %d for the %d bytes of the stream before this event (%d plus %d a byte): each request and eviction holds its whole parent chain, and this stream's chains are too long and too many to check",
			b.depth, r.built, limit, at, r.floor, prefixBytesPerStreamByte)
	}
	toks = make([]int32, b.depth*P, (b.depth+more)*P)
	extra = make([]string, b.depth, b.depth+more)
	ids = make([]string, b.depth, b.depth+more)
	i := b.depth - 1
	for x := b; x != nil; x = x.parent {
		// A guard: parents are stored before their children, so a chain is
		// exactly depth blocks long; a longer one would be a cycle.
		if i < 0 {
			return nil, nil, nil, false, fmt.Errorf("the parent chain of block %s is longer than its %d blocks (a cycle of parents)", b.hash, b.depth)
		}
		copy(toks[i*P:], x.tokens)
		extra[i], ids[i] = x.extra, x.id
		i--
	}
	if i >= 0 {
		return nil, nil, nil, false, fmt.Errorf("the parent chain of block %s is shorter than its %d blocks", b.hash, b.depth)
	}
	return toks, extra, ids, true, nil
}

// cleared follows AllBlocksCleared: no block is cached any more, and the
// next request starts from an empty cache.
func (r *eventsReader) cleared() {
	for _, b := range r.blocks {
		b.live = 0
	}
	for _, bs := range r.live {
		for _, b := range bs {
			b.live = 0
		}
	}
	clear(r.live)
	clear(r.at)
	clear(r.pendAt)
	clear(r.pendBy)
	clear(r.pendAmb)
	r.evictions, r.clear = nil, true
	r.pend, r.ambiguous = nil, false
}

// removed follows BlockRemoved (event ei of batch bi): a block whose last
// cached copy goes is an eviction before the next request.
func (r *eventsReader) removed(ev *Event, bi, ei int) error {
	if r.perPage {
		return r.removedPage(ev, bi, ei)
	}
	for _, h := range ev.BlockHashes {
		b := r.blocks[h]
		if b == nil || b.live == 0 {
			r.unknownRemoved++
			continue
		}
		if b.live--; b.live > 0 {
			continue
		}
		toks, extra, ids, ok, err := r.chain(b, ev.Offset, 0)
		if err != nil {
			return fmt.Errorf("prefixcheck: %s: %s: %w", r.input, where(bi, ei, ev), err)
		}
		if !ok {
			continue
		}
		r.evictions = append(r.evictions, Eviction{Namespace: b.ns, Prefix: toks, Extra: extra, PageID: ids[len(ids)-1]})
	}
	return nil
}

// stored follows BlockStored (event ei of batch bi): a request whose hit is
// its parent chain, and whose blocks are cached from now on.
func (r *eventsReader) stored(ev *Event, bi, ei int) error {
	t := r.t
	if t.PageSize == 0 {
		t.PageSize = ev.BlockSize
	} else if ev.BlockSize != t.PageSize {
		return fmt.Errorf("prefixcheck: %s: %s: block size %d, earlier events %d (a partial last page?)", r.input, where(bi, ei, ev), ev.BlockSize, t.PageSize)
	}
	id := fmt.Sprintf("b%d.e%d", bi, ei)
	ns := namespaceOf(ev)
	q := Request{ID: id, Namespace: ns}
	known := true
	var parent *evBlock
	var toks []int32
	var extra, ids []string
	root := ev.Parent == ""
	if r.perPage {
		var why string
		root, parent, why = r.pageParent(ev)
		if why != "" {
			known = false
			q.Unknown = why
		}
	} else if !root {
		if parent = r.blocks[ev.Parent]; parent == nil {
			known = false
			q.Unknown = fmt.Sprintf("parent block %s was never stored in this stream (it starts mid-run?)", ev.Parent)
		}
	}
	if parent != nil {
		var err error
		toks, extra, ids, known, err = r.chain(parent, ev.Offset, len(ev.BlockHashes))
		if err != nil {
			return fmt.Errorf("prefixcheck: %s: %s: %w", r.input, where(bi, ei, ev), err)
		}
		if !known && r.perPage {
			q.Unknown = fmt.Sprintf("the place of parent block %s is not known", ev.Parent)
		} else if !known {
			q.Unknown = fmt.Sprintf("parent block %s was never stored in this stream (it starts mid-run?)", ev.Parent)
		} else {
			q.Hit = &Hit{Tokens: parent.depth * ev.BlockSize, Source: parent.stored}
		}
	} else if root {
		q.Hit = &Hit{}
	}
	B := ev.BlockSize
	dupAll := len(ev.BlockHashes) > 0
	revivedAll := r.perPage && len(ev.BlockHashes) > 0
	prev := parent // the block before the next one
	for i, h := range ev.BlockHashes {
		x := ""
		if ev.ExtraKeys != nil {
			x = ev.ExtraKeys[i]
		}
		own := ev.TokenIDs[i*B : (i+1)*B]
		parentHash := ev.Parent
		if i > 0 {
			parentHash = ev.BlockHashes[i-1]
		}
		if r.perPage {
			at := placeOf(h, prev, parentHash, x, ns, own)
			if b := r.revive(at); b != nil {
				dupAll = false
				prev = b
			} else if b := r.at[at]; b != nil && r.pendAmb[h] > 0 {
				// A page a removal of a hash several cached pages have
				// named, stored again at its place: that removal took it,
				// and it is back.
				r.pendAmb[h]--
				r.ambiguousRemoved--
				dupAll = false
				prev = b
			} else if b != nil {
				revivedAll = false
				b.live++
				prev = b
			} else {
				dupAll, revivedAll = false, false
				prev = r.newBlock(h, prev, parentHash, own, x, ns, id, !known)
				r.live[h] = append(r.live[h], prev)
				r.at[at] = prev
			}
		} else if b := r.blocks[h]; b != nil && b.live > 0 && sameCopy(b, prev, parentHash, x, ns, own) {
			b.live++
			prev = b
		} else {
			dupAll = false
			prev = r.newBlock(h, prev, parentHash, own, x, ns, id, !known)
			r.blocks[h] = prev
		}
		if known {
			toks = append(toks, own...)
			extra = append(extra, x)
			ids = append(ids, prev.id)
		}
	}
	if revivedAll {
		// The pages a split radix node announced again: no request, and the
		// removals before it are held for the next one.
		r.restored++
		return nil
	}
	q.Clear = r.clear
	if r.perPage {
		for _, p := range r.pend {
			if p.ok {
				q.Evictions = append(q.Evictions, p.e)
			}
		}
		r.pend = nil
		clear(r.pendAt)
		clear(r.pendBy)
		for _, n := range r.pendAmb {
			if n > 0 {
				r.ambiguous = true
			}
		}
		clear(r.pendAmb)
	} else {
		q.Evictions = r.evictions
	}
	r.evictions, r.clear = nil, false
	if dupAll {
		r.dups++
		q.MissExplained = "every block of this event was already cached with the same hash: vLLM does not deduplicate blocks two requests computed in the same step, and some builds also re-announce reused blocks"
	} else if r.ambiguous {
		q.MissExplained = "an earlier removal named a per-page hash several cached pages have, so which of them the engine evicted is not known"
	}
	if known {
		q.Tokens, q.Extra, q.PageIDs = toks, extra, ids
	}
	t.Requests = append(t.Requests, q)
	return nil
}

// sameCopy reports whether a block stored with chained hashes on prev is
// another copy of the cached block b (vLLM does not deduplicate): the same
// parent hash, extra key, namespace and tokens, so the same content address,
// on the same parent block or on another copy of it. A parent evicted and
// stored again is a new block; a child still cached from before (vLLM may
// evict a parent and keep its child) stored again on it is a second copy of
// that child, and a removal of one copy then leaves the other cached. (A
// parent known now but not when b was stored, or the reverse, makes a new
// block: b's chain is not changed.)
func sameCopy(b, prev *evBlock, parentHash BlockHash, x, ns string, own []int32) bool {
	if b.parentHash != parentHash || b.extra != x || b.ns != ns || !equal32(b.tokens, own) {
		return false
	}
	return b.parent == prev || b.parent != nil && prev != nil && !b.parent.unknown && !prev.unknown
}

// newBlock makes a stored block on prev.
func (r *eventsReader) newBlock(h BlockHash, prev *evBlock, parentHash BlockHash, own []int32, x, ns, stored string, unknown bool) *evBlock {
	depth := 1
	if prev != nil {
		depth = prev.depth + 1
	}
	id := string(h)
	if r.perPage {
		r.serial++
		id = fmt.Sprintf("%s#%d", h, r.serial)
	}
	return &evBlock{hash: h, id: id, parent: prev, parentHash: parentHash, tokens: own, extra: x, ns: ns, depth: depth, live: 1, stored: stored, unknown: unknown}
}

// notes records in the trace what EventsTrace skipped.
func (r *eventsReader) notes(medium string, group *int64, component string) {
	t := r.t
	if r.skippedMedium > 0 {
		t.Notes = append(t.Notes, fmt.Sprintf("%s of other media than %s skipped", plural(r.skippedMedium, "event"), medium))
	}
	if r.skippedGroup > 0 {
		t.Notes = append(t.Notes, fmt.Sprintf("%s of other KV-cache groups than %d skipped", plural(r.skippedGroup, "event"), *group))
	}
	if len(r.skippedComponent) > 0 {
		names := make([]string, 0, len(r.skippedComponent))
		for c := range r.skippedComponent {
			names = append(names, c)
		}
		sort.Strings(names)
		n, parts := 0, []string{}
		for i, c := range names {
			n += r.skippedComponent[c]
			if i == maxNotedComponents {
				parts = append(parts, fmt.Sprintf("%d more", len(names)-i))
				break
			}
			parts = append(parts, fmt.Sprintf("%d %s", r.skippedComponent[c], userfile.Quote(c)))
		}
		for _, c := range names[min(len(names), maxNotedComponents):] {
			n += r.skippedComponent[c]
		}
		t.Notes = append(t.Notes, fmt.Sprintf("%s of other KV-cache components than %s skipped (%s): each SGLang component is a cache of its own", plural(n, "event"), userfile.Quote(component), strings.Join(parts, ", ")))
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
	if r.perPage {
		t.Notes = append(t.Notes, "block hashes are per-page (one page's tokens alone: Python's hash(tuple(page)), as SGLang before PR #13488): a block is placed under the one cached page its parent hash names, and page ids are the hash and a serial number")
		if n := r.noParent + r.ambiguousParent; n > 0 {
			t.Notes = append(t.Notes, plural(n, "BlockStored event")+" not placed in the tree (no parent hash, or one several cached pages have): not checked")
		}
		if r.ambiguousRemoved > 0 {
			t.Notes = append(t.Notes, plural(r.ambiguousRemoved, "removal")+" of a hash several cached pages have: which page went is not known, missed hits after it are warnings")
		}
		if r.restored > 0 {
			t.Notes = append(t.Notes, plural(r.restored, "BlockStored event")+" stored again pages just removed at the same place (a radix node split, announced so before PR #13488): no eviction")
		}
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

// maxNotedComponents is how many skipped components the trace's note names.
const maxNotedComponents = 8

// pickComponent chooses the SGLang KV-cache component to check when none is
// asked for: "full" (full attention, the base component every hybrid model
// has) when an event names it, else the first component seen ("" when no
// event names one).
func pickComponent(batches []EventBatch) string {
	first := ""
	for _, b := range batches {
		for _, ev := range b.Events {
			if ev.Type != "BlockStored" || ev.Component == "" {
				continue
			}
			if ev.Component == "full" {
				return "full"
			}
			if first == "" {
				first = ev.Component
			}
		}
	}
	return first
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
