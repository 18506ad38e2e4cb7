package prefixcheck

import (
	"fmt"

	"sparsemla/kvcache"
)

// Trace is a serving run as far as prefix caching is concerned: its requests
// in arrival order and what the engine recorded about their reuse.
type Trace struct {
	Input  string // file the trace was read from
	Format string // "native", "vllm-events", ...
	// HitsRecorded: the input records the engine's hit for every request, so a
	// request without one reused nothing (native dumps with prefix frames,
	// event streams). Without it requests lacking a Hit are not judged.
	HitsRecorded bool
	// EvictionsRecorded: the input records every eviction the engine made
	// (event streams): the correct cache then follows them instead of its own
	// LRU, and a miss the correct cache would have served is an engine error.
	EvictionsRecorded bool
	// ContentPageIDs: page ids are content addresses (vLLM block hashes), so
	// one id stored with two different contents is an error; otherwise ids are
	// physical pages, which are legitimately rewritten after an eviction.
	ContentPageIDs bool
	PageSize       int // the engine's page (block) size when the input says it (0: unknown)
	Requests       []Request
	Notes          []string // about the input: skipped events, unknown parents
}

// Request is one request (or, for event streams, one BlockStored event).
type Request struct {
	ID        string
	Namespace string // LoRA adapter, cache salt ("" default); never shares with another
	// Tokens is the token stream from position 0 as far as known (prompt and
	// generated tokens). A request whose leading tokens are not known has none
	// here and Unknown says why; it is reported unchecked and not cached.
	// Unknown with tokens: the request is not judged (e.g. its source is not
	// in the input) but is cached.
	Tokens  []int32
	Unknown string
	// Extra holds, per page, an extra key that is part of that page's identity
	// (a multimodal input hash, vLLM's extra_keys); "" for none. Shorter than
	// the page count means "" for the rest.
	Extra []string
	// PageIDs is the engine's id of each page (index i: tokens [iP, (i+1)P)):
	// a physical page or a content hash; optional.
	PageIDs []string
	Hit     *Hit // the engine's recorded hit (nil: none recorded)
	// Evictions and Clear are what the engine recorded between the previous
	// request and this one (applied before this request's lookup).
	Evictions []Eviction
	Clear     bool
	// MissExplained, when set, says why a missed hit of this request is not
	// provably an engine error (reported as warn with this reason).
	MissExplained string
}

// Hit is a prefix hit an engine recorded.
type Hit struct {
	Tokens int    // the request reused tokens [0, Tokens)
	Source string // the request whose cached prefix it reused ("" when not recorded)
}

// Eviction is one page the engine evicted: the page ending at len(Prefix) of
// namespace Namespace (a cached prefix that extends it becomes unreachable).
type Eviction struct {
	Namespace string
	Prefix    []int32
	Extra     []string // per-page extra keys of Prefix (as Request.Extra)
	PageID    string
}

// Config is the engine's cache geometry and the correct cache's policy.
type Config struct {
	PageSize int              // tokens per page (the engine's)
	Schedule kvcache.Schedule // sliding window and per-layer compress ratios
	// Capacity bounds the correct cache in tokens (LRU eviction of unlocked
	// leaves) when the trace records no evictions; 0: unbounded.
	Capacity int
	// ResumeAtEndOnly: the cache keeps the compressor state only at the end of
	// each cached request (not at every page boundary), so it can resume only
	// there.
	ResumeAtEndOnly bool
	// Retain keeps the token streams of the last Retain requests for the
	// hit-too-long check (older sources are compared page by page through
	// their chain hashes); 0 keeps all.
	Retain int
	// Brief lists in the report only the requests that are not plain
	// agreements (the summary still counts all).
	Brief bool
}

// SetSchedule sets the sliding window and the per-layer compress ratios (0, 4
// or 128) of the correct cache, replacing both; Run validates them.
func (c *Config) SetSchedule(window int, ratios []int) {
	c.Schedule = kvcache.Schedule{Window: window, Ratios: ratios}
}

// maxLayers bounds the layers of a schedule (Config.validate).
const maxLayers = 1024

func (c Config) validate() error {
	if c.PageSize <= 0 {
		return fmt.Errorf("prefixcheck: page size %d: must be positive", c.PageSize)
	}
	if c.Schedule.Window < 0 {
		return fmt.Errorf("prefixcheck: window %d: must not be negative", c.Schedule.Window)
	}
	// The schedule comes from a dump's header or a config: the run computes
	// a resume's needs over every layer at every page of every request, so
	// a header of a million layers would make that quadratic in the input.
	if n := max(len(c.Schedule.Ratios), len(c.Schedule.IndexRatios)); n > maxLayers {
		return fmt.Errorf("prefixcheck: a schedule of %d layers: at most %d (DeepSeek-V4 has 43 or 61)", n, maxLayers)
	}
	for l, r := range c.Schedule.Ratios {
		if r < 0 {
			return fmt.Errorf("prefixcheck: layer %d compress ratio %d: must not be negative", l, r)
		}
	}
	if c.Capacity < 0 || c.Retain < 0 {
		return fmt.Errorf("prefixcheck: capacity %d, retain %d: must not be negative", c.Capacity, c.Retain)
	}
	return nil
}
