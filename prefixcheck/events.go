package prefixcheck

import (
	"bytes"
	"errors"
	"fmt"
	"io"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"sparsemla/userfile"
)

// KV-cache event streams, as vLLM (vllm/distributed/kv_events.py) and SGLang
// (python/sglang/srt/disaggregation/kv_events.py) publish them over ZMQ: each
// message payload is one msgspec-encoded EventBatch
//
//	EventBatch = [ts, events, data_parallel_rank?]            (array_like)
//	           | {"ts": ts, "events": events, "data_parallel_rank": r}
//	event      = ["BlockStored", block_hashes, parent_block_hash, token_ids,
//	              block_size, lora_id, medium?, lora_name?, extra_keys?,
//	              group_idx?, kv_cache_spec_kind?, kv_cache_spec_sliding_window?]
//	           | ["BlockStored", block_hashes, parent_block_hash, token_ids,
//	              block_size, lora_id, medium, metadata]
//	           | ["BlockStored", block_hashes, parent_block_hash, token_ids,
//	              block_size, nil, medium, component_type, metadata?]
//	           | ["BlockRemoved", block_hashes, medium?, group_idx?]
//	           | ["BlockRemoved", block_hashes, medium, component_type]
//	           | ["AllBlocksCleared"]
//	           | the same as maps tagged by "type" (vLLM since its events
//	             dropped array_like, SGLang since PR #37482), e.g.
//	             {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"};
//	             a BlockStored map may also carry "cache_salt", "session_id"
//	             (strings or nil) and "metadata"
//	metadata   = {"cache_salt"?: str, "session_id"?: str}   (BlockStoredMetadata)
//
// The second BlockStored form is SGLang's BlockStoredWithMetadata
// (sgl-project/sglang PR #30827, SGLang 0.5.18): the legacy array of an
// unsalted event plus, at position 7 (the tag at 0) where vLLM's array has
// lora_name, the BlockStoredMetadata map, written only for a salted node (PR
// #37482's description adds session_id to it). PR #37482 as merged (issue
// #38561) made SGLang's events tagged maps with cache_salt and session_id
// fields; PR #37271 (closed) had the map under "metadata": all three are
// read. cache_salt is a namespace (SGLang keys its radix tree by
// (extra_key, cache_salt) and seeds a salted chain's event hashes with
// SHA-256("sglang-cache-salt-v1\0" + salt)); session_id only attributes a
// store to a session ("event metadata does not participate in block hashing
// or cache identity", PR #37482) and is read but changes nothing.
//
// The third BlockStored form and the second BlockRemoved are SGLang's
// per-component events (BlockStoredWithComponentType(AndMetadata),
// BlockRemovedWithComponentType: mem_cache/events.py KVCacheEventRecorder,
// --enable-kv-events-component-types, on the branch of sgl-project/sglang PR
// #32514, not on main; see doc.go): the keyword-only component_type
// after medium; a map event's "component_type" key; also taken under the
// class names as tags. Position 7 is the component only in that shape (nil
// lora_id, then nothing or the metadata map): vLLM sets lora_name with its
// lora_id and writes extra_keys (an array) after it. An array at position 7
// is PR #32514's component_types (open; read and dropped).
//
// Block hashes are ints (64-bit, signed or not) or bytes (vLLM's sha256 block
// hashes unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). Trailing array fields
// may be absent (msgspec omit_defaults; older versions have fewer fields);
// unknown map keys are skipped (vLLM's locality and ownership, for one). Token
// ids are ints; SGLang under EAGLE publishes token pairs (its bigram radix
// keys), which are refused with an error saying so. A file of events is such
// payloads one after another (what a subscriber writing each payload to a
// file produces).

// Limits on an event stream (every claimed length is also checked against the
// bytes left before anything is allocated).
const (
	maxHashBytes = 64 // a block hash given as bytes
	maxNesting   = 32 // nesting of skipped values (extra keys, unknown fields)
	maxStrBytes  = 1 << 16
)

// BlockHash is a block hash in canonical text: decimal for an int hash, "0x"
// and hex for a bytes hash.
type BlockHash string

// Event is one KV-cache event.
type Event struct {
	Type        string      // BlockStored | BlockRemoved | AllBlocksCleared
	BlockHashes []BlockHash // stored or removed blocks
	Parent      BlockHash   // BlockStored: the block before the first stored one ("" none)
	TokenIDs    []int32     // BlockStored: tokens of the stored blocks, len = len(BlockHashes)·BlockSize
	BlockSize   int
	LoraID      *int64
	LoraName    string
	CacheSalt   *string  // BlockStored: SGLang's cache_salt (nil: none; "" is a salt); part of the namespace
	SessionID   string   // BlockStored: SGLang's or vLLM's session_id ("" none); no part of the namespace
	Medium      string   // "" when absent or null
	ExtraKeys   []string // BlockStored: per block, the raw msgpack of its extra keys ("" for null); nil when absent
	GroupIdx    *int64
	SpecKind    string // kv_cache_spec_kind: "full_attention", "mla_attention", "sliding_window", ... ("" absent)
	Component   string // SGLang's component_type: "full", "swa", "mamba", "c128", "draft", ... ("" absent); a cache of its own
	Offset      int64  // byte offset of the event in the stream
}

// EventBatch is one published batch.
type EventBatch struct {
	TS     float64
	DPRank *int64
	Events []Event
	Offset int64 // byte offset of the batch in the stream
}

// Field orders of the array-encoded events (vLLM's declaration order).
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
	removedFields = []string{"block_hashes", "medium", "group_idx"}
	batchFields   = []string{"ts", "events", "data_parallel_rank"}
)

// field decodes one named field of an event into ev.
func (e *evReader) field(ev *Event, name string) (err error) {
	what := ev.Type + "." + name
	switch name {
	case "block_hashes":
		ev.BlockHashes, err = e.hashes(what)
	case "parent_block_hash":
		if null, err := e.isNil(); null || err != nil {
			return err
		}
		ev.Parent, err = e.hash(what)
	case "token_ids":
		n, err := e.arrayLen(what)
		if err != nil {
			return err
		}
		if n < 0 {
			return e.errf(e.off(), "%s: null", what)
		}
		ev.TokenIDs = make([]int32, 0, n)
		for i := 0; i < n; i++ {
			at := e.off()
			if c, err := e.peek(); err != nil {
				return err
			} else if isArrayCode(c) {
				// SGLang under EAGLE keys its radix tree by bigrams and
				// publishes them: a page of (token j, token j+1) pairs,
				// one token more than the page. The reference cache
				// keys pages by their tokens alone, so no reading of
				// the pairs matches pages as the engine does.
				return e.errf(at, "%s[%d]: a token pair, as SGLang publishes the bigram keys of EAGLE speculative decoding: not supported (a page of pairs holds the next page's first token too)", what, i)
			}
			v, err := e.integer(what)
			if err != nil {
				return err
			}
			if v < 0 || v > 1<<31-1 {
				return e.errf(at, "%s[%d]: token id %d outside [0, 2^31)", what, i, v)
			}
			ev.TokenIDs = append(ev.TokenIDs, int32(v))
		}
	case "block_size":
		at := e.off()
		v, err := e.integer(what)
		if err != nil {
			return err
		}
		if v <= 0 || v > 1<<20 {
			return e.errf(at, "%s: %d (want 1 to 2^20)", what, v)
		}
		ev.BlockSize = int(v)
	case "lora_id":
		ev.LoraID, err = e.optInt(what)
	case "group_idx":
		ev.GroupIdx, err = e.optInt(what)
	case "medium":
		ev.Medium, err = e.str(what)
	case "lora_name":
		ev.LoraName, err = e.str(what)
	case "kv_cache_spec_kind":
		ev.SpecKind, err = e.str(what)
	case "component_type":
		ev.Component, err = e.str(what)
	case "component_types":
		return e.componentTypes(what)
	case "cache_salt":
		return e.salt(ev, what)
	case "session_id":
		ev.SessionID, err = e.str(what)
	case "metadata":
		if ev.Type != "BlockStored" {
			return e.skip(what, 0)
		}
		return e.metadata(ev, what)
	case "extra_keys":
		n, err := e.arrayLen(what)
		if err != nil || n < 0 {
			return err
		}
		ev.ExtraKeys = make([]string, 0, n)
		for i := 0; i < n; i++ {
			k, err := e.raw(fmt.Sprintf("%s[%d]", what, i))
			if err != nil {
				return err
			}
			ev.ExtraKeys = append(ev.ExtraKeys, k)
		}
	default:
		return e.skip(what, 0)
	}
	return err
}

var eventFields = map[string][]string{"BlockStored": storedFields, "BlockRemoved": removedFields, "AllBlocksCleared": nil}

func (e *evReader) event() (Event, error) {
	ev := Event{Offset: e.off()}
	c, err := e.peek()
	if err != nil {
		return ev, err
	}
	seen := map[string]bool{}
	if msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 {
		n, err := e.mapLen("event")
		if err != nil {
			return ev, err
		}
		// The tag may come anywhere; msgspec writes it first. Read keys in
		// order, requiring the tag before any field.
		for i := 0; i < n; i++ {
			at := e.off()
			k, err := e.str("event key")
			if err != nil {
				return ev, err
			}
			if seen[k] {
				return ev, e.errf(at, "event: key %s twice", userfile.Quote(k))
			}
			seen[k] = true
			if k == "type" {
				if ev.Type, err = e.str("event type"); err != nil {
					return ev, err
				}
				if base, ok := componentTags[ev.Type]; ok {
					ev.Type = base
				}
				if _, ok := eventFields[ev.Type]; !ok {
					return ev, e.errf(at, "unknown event type %s (want BlockStored, BlockRemoved, AllBlocksCleared)", userfile.Quote(ev.Type))
				}
				continue
			}
			if ev.Type == "" {
				return ev, e.errf(at, "event: field %s before the \"type\" tag", userfile.Quote(k))
			}
			if err := e.field(&ev, k); err != nil {
				return ev, err
			}
		}
		if ev.Type == "" {
			return ev, e.errf(ev.Offset, "event: no \"type\" tag")
		}
	} else {
		n, err := e.arrayLen("event")
		if err != nil {
			return ev, err
		}
		if n < 1 {
			return ev, e.errf(ev.Offset, "event: empty or null array (no tag)")
		}
		at := e.off()
		if ev.Type, err = e.str("event tag"); err != nil {
			return ev, err
		}
		base, compTag := componentTags[ev.Type]
		if compTag {
			ev.Type = base
		}
		fields, ok := eventFields[ev.Type]
		if !ok {
			return ev, e.errf(at, "unknown event type %s (want BlockStored, BlockRemoved, AllBlocksCleared)", userfile.Quote(ev.Type))
		}
		component := false // a BlockStored with SGLang's component_type at position 7
		for i := 1; i < n; i++ {
			if i-1 >= len(fields) {
				if err := e.skip(ev.Type+" extra field", 0); err != nil {
					return ev, err
				}
				continue
			}
			f := fields[i-1]
			seen[f] = true
			c, err := e.peek()
			if err != nil {
				return ev, err
			}
			switch {
			case f == "lora_name" && ev.Type == "BlockStored" && isMapCode(c):
				// SGLang's BlockStoredWithMetadata: its metadata map
				// where vLLM has lora_name.
				f = "metadata"
			case f == "lora_name" && ev.Type == "BlockStored" && isStrCode(c):
				// vLLM's lora_name, or SGLang's component_type
				// (BlockStoredWithComponentType: medium, then the
				// keyword-only component_type). vLLM sets lora_name and
				// lora_id from one LoRA request and writes extra_keys
				// (an array or nil) after it; SGLang's component events
				// have no lora_id and end there or with the metadata
				// map (BlockStoredWithComponentTypeAndMetadata).
				s, err := e.str(ev.Type + ".lora_name or component_type")
				if err != nil {
					return ev, err
				}
				next := byte(0)
				if n == 9 {
					if next, err = e.peek(); err != nil {
						return ev, err
					}
				}
				if compTag || ev.LoraID == nil && (n == 8 || n == 9 && isMapCode(next)) {
					ev.Component, component = s, true
				} else {
					ev.LoraName = s
				}
				continue
			case f == "lora_name" && ev.Type == "BlockStored" && isArrayCode(c):
				// PR #32514's component_types list, where vLLM has
				// lora_name (a string or nil).
				f = "component_types"
			case f == "extra_keys" && component && isMapCode(c):
				f = "metadata"
			case f == "group_idx" && ev.Type == "BlockRemoved" && isStrCode(c):
				// SGLang's BlockRemovedWithComponentType: component_type
				// after medium, where vLLM has group_idx (an int).
				f = "component_type"
			}
			if err := e.field(&ev, f); err != nil {
				return ev, err
			}
		}
	}
	need := map[string][]string{"BlockStored": {"block_hashes", "token_ids", "block_size"}, "BlockRemoved": {"block_hashes"}}[ev.Type]
	for _, f := range need {
		if !seen[f] {
			return ev, e.errf(ev.Offset, "%s without %s", ev.Type, f)
		}
	}
	// An empty token list with hashes announces blocks without their tokens
	// (an inventory snapshot some publishers send); EventsTrace skips it.
	if ev.Type == "BlockStored" && len(ev.TokenIDs) != len(ev.BlockHashes)*ev.BlockSize && len(ev.TokenIDs) > 0 {
		return ev, e.errf(ev.Offset, "BlockStored: %d token ids for %d blocks of %d tokens", len(ev.TokenIDs), len(ev.BlockHashes), ev.BlockSize)
	}
	if ev.ExtraKeys != nil && len(ev.ExtraKeys) != len(ev.BlockHashes) {
		return ev, e.errf(ev.Offset, "%s: %d extra keys for %d blocks", ev.Type, len(ev.ExtraKeys), len(ev.BlockHashes))
	}
	return ev, nil
}

func (e *evReader) batchField(b *EventBatch, name string) error {
	at := e.off()
	switch name {
	case "ts":
		c, err := e.peek()
		if err != nil {
			return err
		}
		if c == msgpcode.Float || c == msgpcode.Double {
			b.TS, err = e.d.DecodeFloat64()
			if err != nil {
				return e.errf(at, "ts: %v", err)
			}
			return nil
		}
		v, err := e.integer("ts")
		b.TS = float64(v)
		return err
	case "events":
		n, err := e.arrayLen("events")
		if err != nil {
			return err
		}
		if n < 0 {
			return e.errf(at, "events: null")
		}
		b.Events = make([]Event, 0, n)
		for i := 0; i < n; i++ {
			ev, err := e.event()
			if err != nil {
				return err
			}
			b.Events = append(b.Events, ev)
		}
		return nil
	case "data_parallel_rank":
		var err error
		b.DPRank, err = e.optInt("data_parallel_rank")
		return err
	}
	return e.skip("batch field "+name, 0)
}

func (e *evReader) batch() (EventBatch, error) {
	b := EventBatch{Offset: e.off()}
	c, err := e.peek()
	if err != nil {
		return b, err
	}
	seen := map[string]bool{}
	if msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 {
		n, err := e.mapLen("batch")
		if err != nil {
			return b, err
		}
		for i := 0; i < n; i++ {
			at := e.off()
			k, err := e.str("batch key")
			if err != nil {
				return b, err
			}
			if seen[k] {
				return b, e.errf(at, "batch: key %s twice", userfile.Quote(k))
			}
			seen[k] = true
			if err := e.batchField(&b, k); err != nil {
				return b, err
			}
		}
	} else {
		n, err := e.arrayLen("batch")
		if err != nil {
			return b, err
		}
		for i := 0; i < n; i++ {
			name := "extra"
			if i < len(batchFields) {
				name = batchFields[i]
			}
			seen[name] = true
			if err := e.batchField(&b, name); err != nil {
				return b, err
			}
		}
	}
	if !seen["ts"] || !seen["events"] {
		return b, e.errf(b.Offset, "batch without ts or events")
	}
	return b, nil
}

// ReadEvents decodes a stream of EventBatch payloads (at most limit bytes are
// read from r; a longer stream is an error). name is used in errors.
func ReadEvents(r io.Reader, name string, limit int64) ([]EventBatch, error) {
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, fmt.Errorf("prefixcheck: %s: %w", name, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("prefixcheck: %s: longer than %d bytes", name, limit)
	}
	return DecodeEvents(data, name)
}

// DecodeEvents decodes a stream of EventBatch payloads held in data.
func DecodeEvents(data []byte, name string) ([]EventBatch, error) {
	br := bytes.NewReader(data)
	e := &evReader{name: name, data: data, r: br, d: msgpack.NewDecoder(br)}
	var out []EventBatch
	for e.left() > 0 {
		b, err := e.batch()
		if err != nil {
			return nil, fmt.Errorf("%w (batch %d)", err, len(out))
		}
		out = append(out, b)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("prefixcheck: %s: %w", name, errNoBatches)
	}
	return out, nil
}

var errNoBatches = errors.New("no event batches")
