package prefixcheck

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
)

// Event stream encodings EncodeEvents writes.
const (
	// EncodingMap is vLLM's current wire form (kv_events.py without
	// array_like): batches and events are maps, events tagged by "type".
	EncodingMap = "map"
	// EncodingArray is SGLang's (and older vLLM's) array_like form:
	// [ts, events] batches, [tag, fields...] events with the five
	// BlockStored fields and one BlockRemoved field of those versions; a
	// BlockStored with a cache salt or session id is SGLang's
	// BlockStoredWithMetadata (PR #30827): medium and the metadata map after
	// them.
	EncodingArray = "array"
)

type evWriter struct {
	buf bytes.Buffer
	e   *msgpack.Encoder
	err error
}

func (w *evWriter) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *evWriter) str(s string) { w.do(w.e.EncodeString(s)) }
func (w *evWriter) int(v int64)  { w.do(w.e.EncodeInt(v)) }
func (w *evWriter) nil_()        { w.do(w.e.EncodeNil()) }
func (w *evWriter) arr(n int)    { w.do(w.e.EncodeArrayLen(n)) }
func (w *evWriter) mapLen(n int) { w.do(w.e.EncodeMapLen(n)) }
func (w *evWriter) optStr(s string) {
	if s == "" {
		w.nil_()
	} else {
		w.str(s)
	}
}
func (w *evWriter) optInt(v *int64) {
	if v == nil {
		w.nil_()
	} else {
		w.int(*v)
	}
}

func (w *evWriter) hash(h BlockHash) {
	s := string(h)
	if strings.HasPrefix(s, "0x") {
		b, err := hex.DecodeString(s[2:])
		w.do(err)
		w.do(w.e.EncodeBytes(b))
		return
	}
	if strings.HasPrefix(s, "-") {
		v, err := strconv.ParseInt(s, 10, 64)
		w.do(err)
		w.int(v)
		return
	}
	u, err := strconv.ParseUint(s, 10, 64)
	w.do(err)
	w.do(w.e.EncodeUint(u))
}

func (w *evWriter) hashes(hs []BlockHash) {
	w.arr(len(hs))
	for _, h := range hs {
		w.hash(h)
	}
}

func (w *evWriter) tokens(t []int32) {
	w.arr(len(t))
	for _, v := range t {
		w.int(int64(v))
	}
}

func (w *evWriter) extra(keys []string) {
	w.arr(len(keys))
	for _, k := range keys {
		if k == "" {
			w.nil_()
		} else {
			_, err := w.buf.WriteString(k) // already msgpack
			w.do(err)
		}
	}
}

// entry is one key of a map the writer writes: written when set, its value
// by put.
type entry struct {
	key string
	set bool
	put func()
}

// entries writes a map of the set entries, in order: the length is counted
// from the same list the keys are written from.
func (w *evWriter) entries(es ...entry) {
	n := 0
	for _, e := range es {
		if e.set {
			n++
		}
	}
	w.mapLen(n)
	for _, e := range es {
		if e.set {
			w.str(e.key)
			e.put()
		}
	}
}

// parent writes a parent block hash (nil: none).
func (w *evWriter) parent(h BlockHash) {
	if h == "" {
		w.nil_()
	} else {
		w.hash(h)
	}
}

// metadata writes SGLang's BlockStoredMetadata map of ev.
func (w *evWriter) metadata(ev *Event) {
	w.entries(
		entry{"cache_salt", ev.CacheSalt != nil, func() { w.str(*ev.CacheSalt) }},
		entry{"session_id", ev.SessionID != "", func() { w.str(ev.SessionID) }})
}

func (w *evWriter) mapEvent(ev *Event) {
	tag := entry{"type", true, func() { w.str(ev.Type) }}
	component := entry{"component_type", ev.Component != "", func() { w.str(ev.Component) }}
	switch ev.Type {
	case "BlockStored":
		w.entries(tag,
			entry{"block_hashes", true, func() { w.hashes(ev.BlockHashes) }},
			entry{"parent_block_hash", true, func() { w.parent(ev.Parent) }},
			entry{"token_ids", true, func() { w.tokens(ev.TokenIDs) }},
			entry{"block_size", true, func() { w.int(int64(ev.BlockSize)) }},
			entry{"lora_id", true, func() { w.optInt(ev.LoraID) }},
			entry{"medium", true, func() { w.optStr(ev.Medium) }},
			entry{"lora_name", true, func() { w.optStr(ev.LoraName) }},
			entry{"extra_keys", ev.ExtraKeys != nil, func() { w.extra(ev.ExtraKeys) }},
			entry{"group_idx", ev.GroupIdx != nil, func() { w.int(*ev.GroupIdx) }},
			entry{"kv_cache_spec_kind", ev.SpecKind != "", func() { w.str(ev.SpecKind) }},
			entry{"cache_salt", ev.CacheSalt != nil, func() { w.str(*ev.CacheSalt) }},
			entry{"session_id", ev.SessionID != "", func() { w.str(ev.SessionID) }},
			component)
	case "BlockRemoved":
		w.entries(tag,
			entry{"block_hashes", true, func() { w.hashes(ev.BlockHashes) }},
			entry{"medium", true, func() { w.optStr(ev.Medium) }},
			entry{"group_idx", ev.GroupIdx != nil, func() { w.int(*ev.GroupIdx) }},
			component)
	case "AllBlocksCleared":
		w.entries(tag)
	default:
		w.do(fmt.Errorf("prefixcheck: cannot encode event type %q", ev.Type))
	}
}

func (w *evWriter) arrayEvent(ev *Event) {
	switch ev.Type {
	case "BlockStored":
		meta := ev.CacheSalt != nil || ev.SessionID != ""
		comp := ev.Component != ""
		n := 6 // tag, hashes, parent, tokens, block size, lora_id
		if comp || meta {
			n++ // medium
		}
		if comp {
			n++
		}
		if meta {
			n++
		}
		w.arr(n)
		w.str(ev.Type)
		w.hashes(ev.BlockHashes)
		w.parent(ev.Parent)
		w.tokens(ev.TokenIDs)
		w.int(int64(ev.BlockSize))
		w.optInt(ev.LoraID)
		if comp || meta {
			w.optStr(ev.Medium)
		}
		if comp {
			// SGLang's BlockStoredWithComponentType(AndMetadata).
			w.str(ev.Component)
		}
		if meta {
			w.metadata(ev)
		}
		if ev.LoraName != "" || ev.ExtraKeys != nil || (ev.Medium != "" && !meta && !comp) || ev.GroupIdx != nil || ev.SpecKind != "" || (comp && ev.LoraID != nil) {
			w.do(fmt.Errorf("prefixcheck: the array encoding has no lora_name, extra_keys, group_idx or kv_cache_spec_kind, a medium only with a cache salt, session id or component, and no lora_id with a component"))
		}
	case "BlockRemoved":
		if ev.Component != "" {
			// SGLang's BlockRemovedWithComponentType.
			w.arr(4)
			w.str(ev.Type)
			w.hashes(ev.BlockHashes)
			w.optStr(ev.Medium)
			w.str(ev.Component)
			break
		}
		w.arr(2)
		w.str(ev.Type)
		w.hashes(ev.BlockHashes)
	case "AllBlocksCleared":
		w.arr(1)
		w.str(ev.Type)
	default:
		w.do(fmt.Errorf("prefixcheck: cannot encode event type %q", ev.Type))
	}
}

// EncodeEvents writes batches as a stream of EventBatch payloads in the given
// encoding (EncodingMap: batches carry data_parallel_rank, 0 when nil).
func EncodeEvents(batches []EventBatch, encoding string) ([]byte, error) {
	w := &evWriter{}
	w.e = msgpack.NewEncoder(&w.buf)
	for i := range batches {
		b := &batches[i]
		switch encoding {
		case EncodingMap:
			w.mapLen(3)
			w.str("ts")
			w.do(w.e.EncodeFloat64(b.TS))
			w.str("events")
			w.arr(len(b.Events))
			for j := range b.Events {
				w.mapEvent(&b.Events[j])
			}
			w.str("data_parallel_rank")
			if b.DPRank == nil {
				w.int(0)
			} else {
				w.int(*b.DPRank)
			}
		case EncodingArray:
			w.arr(2)
			w.do(w.e.EncodeFloat64(b.TS))
			w.arr(len(b.Events))
			for j := range b.Events {
				w.arrayEvent(&b.Events[j])
			}
		default:
			return nil, fmt.Errorf("prefixcheck: unknown event encoding %q (want %s or %s)", encoding, EncodingMap, EncodingArray)
		}
	}
	if w.err != nil {
		return nil, w.err
	}
	return w.buf.Bytes(), nil
}
