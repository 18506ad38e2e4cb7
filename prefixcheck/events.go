package prefixcheck

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"

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
// --enable-kv-events-component-types): the keyword-only component_type
// after medium; a map event's "component_type" key; also taken under the
// class names as tags. Position 7 is the component only in that shape (nil
// lora_id, then nothing or the metadata map): vLLM sets lora_name with its
// lora_id and writes extra_keys (an array) after it. An array at position 7
// is PR #32514's component_types (open; read and dropped).
//
// Block hashes are ints (64-bit, signed or not) or bytes (vLLM's sha256 block
// hashes unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). Trailing array fields
// may be absent (msgspec omit_defaults; older versions have fewer fields);
// unknown map keys are skipped. A file of events is such payloads one after
// another (what a subscriber writing each payload to a file produces).

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

type evReader struct {
	name string
	data []byte
	r    *bytes.Reader
	d    *msgpack.Decoder
}

func (e *evReader) off() int64 { return int64(len(e.data) - e.r.Len()) }
func (e *evReader) left() int  { return e.r.Len() }
func (e *evReader) errf(at int64, format string, args ...any) error {
	return fmt.Errorf("prefixcheck: %s: byte %d: %s", e.name, at, fmt.Sprintf(format, args...))
}

func (e *evReader) peek() (byte, error) {
	at := e.off()
	c, err := e.d.PeekCode()
	if err != nil {
		return 0, e.errf(at, "truncated: %v", err)
	}
	return c, nil
}

// isNil consumes a nil if one is next.
func (e *evReader) isNil() (bool, error) {
	c, err := e.peek()
	if err != nil || c != msgpcode.Nil {
		return false, err
	}
	return true, e.d.DecodeNil()
}

// arrayLen reads an array header (nil: -1) and checks the claim (at least a
// byte an element) against the bytes left.
func (e *evReader) arrayLen(what string) (int, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return 0, err
	}
	if c != msgpcode.Nil && !msgpcode.IsFixedArray(c) && c != msgpcode.Array16 && c != msgpcode.Array32 {
		return 0, e.errf(at, "%s: want an array, found msgpack code 0x%02x", what, c)
	}
	n, err := e.d.DecodeArrayLen()
	if err != nil {
		return 0, e.errf(at, "%s: %v", what, err)
	}
	if n > e.left() {
		return 0, e.errf(at, "%s: array of %d elements claimed, %d bytes left", what, n, e.left())
	}
	return n, nil
}

func (e *evReader) mapLen(what string) (int, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return 0, err
	}
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		return 0, e.errf(at, "%s: want a map, found msgpack code 0x%02x", what, c)
	}
	n, err := e.d.DecodeMapLen()
	if err != nil {
		return 0, e.errf(at, "%s: %v", what, err)
	}
	if 2*n > e.left() {
		return 0, e.errf(at, "%s: map of %d entries claimed, %d bytes left", what, n, e.left())
	}
	return n, nil
}

// rawLen returns the length a str or bin header at the current position
// claims, checked against the bytes left, without consuming anything.
func (e *evReader) rawLen(what string, bin bool) (int, error) {
	at := e.off()
	b := e.data[at:]
	if len(b) == 0 {
		return 0, e.errf(at, "%s: truncated", what)
	}
	c := b[0]
	var n, hdr int
	switch {
	case !bin && msgpcode.IsFixedString(c):
		n, hdr = int(c&msgpcode.FixedStrMask), 1
	case !bin && c == msgpcode.Str8, bin && c == msgpcode.Bin8:
		if len(b) < 2 {
			return 0, e.errf(at, "%s: truncated length", what)
		}
		n, hdr = int(b[1]), 2
	case !bin && c == msgpcode.Str16, bin && c == msgpcode.Bin16:
		if len(b) < 3 {
			return 0, e.errf(at, "%s: truncated length", what)
		}
		n, hdr = int(binary.BigEndian.Uint16(b[1:])), 3
	case !bin && c == msgpcode.Str32, bin && c == msgpcode.Bin32:
		if len(b) < 5 {
			return 0, e.errf(at, "%s: truncated length", what)
		}
		u := binary.BigEndian.Uint32(b[1:])
		if int64(u) > int64(len(b)) {
			return 0, e.errf(at, "%s: %d bytes claimed, %d left", what, u, len(b)-5)
		}
		n, hdr = int(u), 5
	default:
		kind := "a string"
		if bin {
			kind = "bytes"
		}
		return 0, e.errf(at, "%s: want %s, found msgpack code 0x%02x", what, kind, c)
	}
	if n > len(b)-hdr {
		return 0, e.errf(at, "%s: %d bytes claimed, %d left", what, n, len(b)-hdr)
	}
	return n, nil
}

func (e *evReader) str(what string) (string, error) {
	if null, err := e.isNil(); null || err != nil {
		return "", err
	}
	at := e.off()
	n, err := e.rawLen(what, false)
	if err != nil {
		return "", err
	}
	if n > maxStrBytes {
		return "", e.errf(at, "%s: string of %d bytes (at most %d)", what, n, maxStrBytes)
	}
	s, err := e.d.DecodeString()
	if err != nil {
		return "", e.errf(at, "%s: %v", what, err)
	}
	return s, nil
}

// integer reads any msgpack integer as int64 (a uint64 above MaxInt64 is an
// error).
func (e *evReader) integer(what string) (int64, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return 0, err
	}
	switch {
	case msgpcode.IsFixedNum(c), c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64,
		c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32:
		v, err := e.d.DecodeInt64()
		if err != nil {
			return 0, e.errf(at, "%s: %v", what, err)
		}
		return v, nil
	case c == msgpcode.Uint64:
		u, err := e.d.DecodeUint64()
		if err != nil {
			return 0, e.errf(at, "%s: %v", what, err)
		}
		if u > 1<<63-1 {
			return 0, e.errf(at, "%s: %d does not fit an int64", what, u)
		}
		return int64(u), nil
	}
	return 0, e.errf(at, "%s: want an integer, found msgpack code 0x%02x", what, c)
}

func (e *evReader) optInt(what string) (*int64, error) {
	if null, err := e.isNil(); null || err != nil {
		return nil, err
	}
	v, err := e.integer(what)
	return &v, err
}

// hash reads a block hash: an int (signed or unsigned 64-bit) or bytes.
func (e *evReader) hash(what string) (BlockHash, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return "", err
	}
	switch {
	case c == msgpcode.Uint64:
		u, err := e.d.DecodeUint64()
		if err != nil {
			return "", e.errf(at, "%s: %v", what, err)
		}
		return BlockHash(strconv.FormatUint(u, 10)), nil
	case c == msgpcode.Bin8 || c == msgpcode.Bin16 || c == msgpcode.Bin32:
		n, err := e.rawLen(what, true)
		if err != nil {
			return "", err
		}
		if n == 0 || n > maxHashBytes {
			return "", e.errf(at, "%s: a %d-byte hash (1 to %d)", what, n, maxHashBytes)
		}
		b, err := e.d.DecodeBytes()
		if err != nil {
			return "", e.errf(at, "%s: %v", what, err)
		}
		return BlockHash("0x" + hex.EncodeToString(b)), nil
	}
	v, err := e.integer(what)
	if err != nil {
		return "", e.errf(at, "%s: want an int or bytes block hash, found msgpack code 0x%02x", what, c)
	}
	return BlockHash(strconv.FormatInt(v, 10)), nil
}

func (e *evReader) hashes(what string) ([]BlockHash, error) {
	n, err := e.arrayLen(what)
	if err != nil || n < 0 {
		if n < 0 {
			err = e.errf(e.off(), "%s: null", what)
		}
		return nil, err
	}
	out := make([]BlockHash, 0, n)
	for i := 0; i < n; i++ {
		h, err := e.hash(fmt.Sprintf("%s[%d]", what, i))
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, nil
}

// skip skips one value of any type, nesting at most maxNesting deep, checking
// every claimed length.
func (e *evReader) skip(what string, depth int) error {
	at := e.off()
	if depth > maxNesting {
		return e.errf(at, "%s: nested deeper than %d", what, maxNesting)
	}
	c, err := e.peek()
	if err != nil {
		return err
	}
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := e.arrayLen(what)
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			if err := e.skip(what, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := e.mapLen(what)
		if err != nil {
			return err
		}
		for i := 0; i < 2*n; i++ {
			if err := e.skip(what, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsString(c):
		if _, err := e.rawLen(what, false); err != nil {
			return err
		}
	case msgpcode.IsBin(c):
		if _, err := e.rawLen(what, true); err != nil {
			return err
		}
	case msgpcode.IsExt(c):
		return e.errf(at, "%s: msgpack extension type 0x%02x not expected", what, c)
	}
	if err := e.d.Skip(); err != nil {
		return e.errf(at, "%s: %v", what, err)
	}
	return nil
}

// raw returns the msgpack bytes of the next value (skipped), "" for nil.
func (e *evReader) raw(what string) (string, error) {
	if null, err := e.isNil(); null || err != nil {
		return "", err
	}
	from := e.off()
	if err := e.skip(what, 0); err != nil {
		return "", err
	}
	return string(e.data[from:e.off()]), nil
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

// salt reads a cache_salt (nil: none). A salt given twice (a map event's
// field and its metadata) must be the same.
func (e *evReader) salt(ev *Event, what string) error {
	if null, err := e.isNil(); null || err != nil {
		return err
	}
	at := e.off()
	s, err := e.str(what)
	if err != nil {
		return err
	}
	if ev.CacheSalt != nil && *ev.CacheSalt != s {
		return e.errf(at, "%s: %s, but cache_salt %s given before", what, userfile.Quote(s), userfile.Quote(*ev.CacheSalt))
	}
	ev.CacheSalt = &s
	return nil
}

// metadata reads SGLang's BlockStoredMetadata map: cache_salt and session_id
// (strings or nil); other keys are skipped.
func (e *evReader) metadata(ev *Event, what string) error {
	n, err := e.mapLen(what)
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	for i := 0; i < n; i++ {
		at := e.off()
		k, err := e.str(what + " key")
		if err != nil {
			return err
		}
		if seen[k] {
			return e.errf(at, "%s: key %s twice", what, userfile.Quote(k))
		}
		seen[k] = true
		switch k {
		case "cache_salt":
			err = e.salt(ev, what+".cache_salt")
		case "session_id":
			ev.SessionID, err = e.str(what + ".session_id")
		default:
			err = e.skip(what+"."+userfile.Clip(k), 0)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// componentTypes reads the component_types list of sgl-project/sglang PR
// #32514 (open): the components one BlockStored's blocks hold at its medium
// ("full", "swa", "mamba"; nil: not reported). The event is one per block
// whatever its components, and a removal is the whole block's, so the list
// selects nothing: it is checked (strings, bounded) and dropped.
func (e *evReader) componentTypes(what string) error {
	n, err := e.arrayLen(what)
	if err != nil || n < 0 {
		return err
	}
	for i := 0; i < n; i++ {
		if _, err := e.str(fmt.Sprintf("%s[%d]", what, i)); err != nil {
			return err
		}
	}
	return nil
}

// componentTags are SGLang's component event classes under their own
// names, should they be tagged so (msgspec's tag=True default) rather than
// as their base classes: same fields, component_type after medium.
var componentTags = map[string]string{
	"BlockStoredWithComponentType":            "BlockStored",
	"BlockStoredWithComponentTypeAndMetadata": "BlockStored",
	"BlockRemovedWithComponentType":           "BlockRemoved",
}

// isMapCode says whether c starts a msgpack map.
func isMapCode(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

// isStrCode says whether c starts a msgpack string.
func isStrCode(c byte) bool { return msgpcode.IsString(c) }

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
			case f == "lora_name" && ev.Type == "BlockStored" && (msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32):
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
